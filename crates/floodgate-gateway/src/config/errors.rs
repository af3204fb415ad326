//! Configuration errors: each names the field path it is about.

use std::fmt;

/// One problem in a configuration file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// Where: `plans.free.limits[1].window`, or empty for the file as a whole.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Every problem found in a configuration file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, error) in self.0.iter().enumerate() {
            if index > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// What is wrong with one setting; reported under the setting's path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem(pub String);

impl From<String> for Problem {
    fn from(message: String) -> Self {
        Problem(message)
    }
}

impl From<floodgate::route::RoutePatternError> for Problem {
    fn from(error: floodgate::route::RoutePatternError) -> Self {
        Problem(error.to_string())
    }
}

impl From<floodgate::route::RouteConflict> for Problem {
    fn from(error: floodgate::route::RouteConflict) -> Self {
        Problem(error.to_string())
    }
}

impl From<&str> for Problem {
    fn from(message: &str) -> Self {
        Problem(message.to_owned())
    }
}

impl From<Problem> for String {
    fn from(problem: Problem) -> Self {
        problem.0
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Collects errors with their paths.
#[derive(Default)]
pub(super) struct Errors(pub(super) Vec<ConfigError>);

impl Errors {
    pub(super) fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError {
            path: path.into(),
            message: message.into(),
        });
    }

    pub(super) fn ok<T, E: Into<Problem>>(
        &mut self,
        path: impl Into<String>,
        result: Result<T, E>,
    ) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(message) => {
                self.push(path, message.into().0);
                None
            }
        }
    }
}
