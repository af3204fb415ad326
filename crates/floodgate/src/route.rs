//! Route patterns, one format and one meaning wherever a limit names the requests it applies
//! to (the library's [`crate::plan::TieredPlan`] routes, the gateway's endpoints and routes):
//!
//! - `"METHOD /path"` matches that method only, `"/path"` any method;
//! - the path matches as axum's router matches: literal segments exactly, `{name}` one whole
//!   segment, `{*name}` the rest of the path (at the end only);
//! - a method-specific pattern wins over an any-method one; a `HEAD` request meets the `GET`
//!   patterns when no `HEAD` pattern matches it (RFC 9110 §9.3.2: it is a `GET` without the
//!   body, so a limit on `GET /x` cannot be dodged with `HEAD /x`);
//! - patterns axum's router cannot hold together are refused when added (the same path twice
//!   for one method, or parameters named apart at one place: `/a/{x}` and `/a/{y}`); a literal
//!   segment and a parameter at one place may stand together, the literal matching first
//!   (`/a/b` before `/a/{x}`).
//!
//! The path a pattern is matched against is the request's, as the caller gives it: the gateway
//! normalises it first (`/a/../b` is `/b`), the library does not.

use std::collections::HashMap;

use http::Method;

/// A parsed `"METHOD /path"` or `"/path"` pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutePattern {
    method: Option<Method>,
    path: String,
}

/// Why a text is not a [`RoutePattern`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RoutePatternError {
    /// The word before the path is not an HTTP method.
    #[error("`{0}` is not an HTTP method")]
    NotAMethod(String),
    /// The path does not start with `/`.
    #[error("`{0}`: the path must start with `/` (pattern: \"METHOD /path\" or \"/path\")")]
    NotAPath(String),
}

impl RoutePattern {
    /// Parses `"POST /v1/things/{id}"` or `"/health"` (surrounding spaces ignored).
    pub fn parse(text: &str) -> Result<RoutePattern, RoutePatternError> {
        let text = text.trim();
        let (method, path) = match text.split_once(' ') {
            Some((method, path)) => {
                let method = Method::from_bytes(method.as_bytes())
                    .map_err(|_| RoutePatternError::NotAMethod(method.to_owned()))?;
                (Some(method), path.trim())
            }
            None => (None, text),
        };
        if !path.starts_with('/') {
            return Err(RoutePatternError::NotAPath(text.to_owned()));
        }
        Ok(RoutePattern {
            method,
            path: path.to_owned(),
        })
    }

    /// The method it matches; `None` matches any.
    pub fn method(&self) -> Option<&Method> {
        self.method.as_ref()
    }

    /// The path pattern.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// A stable identifier usable inside storage keys and rule names: the method (`ANY` for
    /// any) and the path, with no spaces, braces or colons.
    pub fn key_id(&self) -> String {
        let method = self.method.as_ref().map_or("ANY", Method::as_str);
        let path = crate::key::key_part(&self.path, crate::key::KeyChars::Path);
        format!("{method}{path}")
    }
}

/// The pattern as configurations write it: `POST /v1/things/{id}`, or `/health` for any
/// method.
impl std::fmt::Display for RoutePattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.method {
            Some(method) => write!(f, "{method} {}", self.path),
            None => f.write_str(&self.path),
        }
    }
}

/// Why a pattern could not join a [`RouteTable`]: it conflicts with one already there, or its
/// path is not a pattern axum's router takes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{path}`: {reason}")]
pub struct RouteConflict {
    /// The pattern's path.
    pub path: String,
    /// What the router said.
    pub reason: String,
}

/// Values by [`RoutePattern`], found for a request as the module's rules say.
#[derive(Clone, Debug)]
pub struct RouteTable<T> {
    by_method: HashMap<Method, matchit::Router<usize>>,
    any: matchit::Router<usize>,
    entries: Vec<(RoutePattern, T)>,
}

impl<T> Default for RouteTable<T> {
    fn default() -> Self {
        RouteTable {
            by_method: HashMap::new(),
            any: matchit::Router::new(),
            entries: Vec::new(),
        }
    }
}

impl<T> RouteTable<T> {
    /// Adds `value` under `pattern`; fails if the pattern conflicts with one already there.
    pub fn insert(&mut self, pattern: RoutePattern, value: T) -> Result<(), RouteConflict> {
        let index = self.entries.len();
        let router = match &pattern.method {
            Some(method) => self.by_method.entry(method.clone()).or_default(),
            None => &mut self.any,
        };
        router
            .insert(pattern.path.clone(), index)
            .map_err(|error| RouteConflict {
                path: pattern.path.clone(),
                reason: error.to_string(),
            })?;
        self.entries.push((pattern, value));
        Ok(())
    }

    /// The pattern and value matching a request of `method` on `path`.
    pub fn find(&self, method: &Method, path: &str) -> Option<&(RoutePattern, T)> {
        self.entry(self.find_index(method, path)?)
    }

    /// Where [`RouteTable::find`]'s entry stands in the table, to look it up again with
    /// [`RouteTable::entry`] without matching the path again.
    pub fn find_index(&self, method: &Method, path: &str) -> Option<usize> {
        let in_router = |method: &Method| {
            self.by_method
                .get(method)
                .and_then(|router| router.at(path).ok())
        };
        let specific = in_router(method).or_else(|| {
            (method == Method::HEAD)
                .then(|| in_router(&Method::GET))
                .flatten()
        });
        let found = specific.or_else(|| self.any.at(path).ok())?;
        Some(*found.value)
    }

    /// The entry at `index` ([`RouteTable::find_index`]).
    pub fn entry(&self, index: usize) -> Option<&(RoutePattern, T)> {
        self.entries.get(index)
    }

    /// The same table with every value transformed.
    pub fn map<U>(self, mut transform: impl FnMut(T) -> U) -> RouteTable<U> {
        RouteTable {
            by_method: self.by_method,
            any: self.any,
            entries: self
                .entries
                .into_iter()
                .map(|(pattern, value)| (pattern, transform(value)))
                .collect(),
        }
    }

    /// Every pattern and its value, in the order they were added.
    pub fn entries(&self) -> impl Iterator<Item = &(RoutePattern, T)> {
        self.entries.iter()
    }

    /// How many patterns were added.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no pattern was added.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(patterns: &[(&str, &'static str)]) -> RouteTable<&'static str> {
        let mut table = RouteTable::default();
        for (pattern, value) in patterns {
            table
                .insert(RoutePattern::parse(pattern).unwrap(), *value)
                .unwrap();
        }
        table
    }

    #[test]
    fn method_specific_patterns_win_and_params_match() {
        let table = table(&[("/v1/{*rest}", "any"), ("POST /v1/things/{id}", "post")]);
        let found = |method: Method, path: &str| table.find(&method, path).map(|entry| entry.1);
        assert_eq!(found(Method::POST, "/v1/things/42"), Some("post"));
        assert_eq!(found(Method::GET, "/v1/things/42"), Some("any"));
        assert_eq!(found(Method::GET, "/v2"), None);
    }

    #[test]
    fn a_literal_path_matches_itself_only_and_head_meets_get() {
        let table = table(&[("GET /login", "get"), ("/login/{step}", "step")]);
        let found = |method: Method, path: &str| table.find(&method, path).map(|entry| entry.1);
        assert_eq!(found(Method::GET, "/login"), Some("get"));
        assert_eq!(found(Method::HEAD, "/login"), Some("get"));
        assert_eq!(found(Method::POST, "/login"), None);
        assert_eq!(found(Method::GET, "/login/"), None);
        assert_eq!(found(Method::GET, "/login/2fa"), Some("step"));
        assert_eq!(found(Method::GET, "/login/2fa/more"), None);
    }

    #[test]
    fn a_literal_segment_matches_before_a_parameter() {
        let table = table(&[("/a/{x}", "param"), ("/a/b", "literal")]);
        let found = |path: &str| table.find(&Method::GET, path).map(|entry| entry.1);
        assert_eq!(found("/a/b"), Some("literal"));
        assert_eq!(found("/a/c"), Some("param"));
    }

    #[test]
    fn bad_patterns_are_errors() {
        assert_eq!(
            RoutePattern::parse("POST v1"),
            Err(RoutePatternError::NotAPath("POST v1".into()))
        );
        assert_eq!(
            RoutePattern::parse("P@ST /v1"),
            Err(RoutePatternError::NotAMethod("P@ST".into()))
        );
        let mut table = RouteTable::default();
        table
            .insert(RoutePattern::parse("/a/{x}").unwrap(), 1)
            .unwrap();
        let conflict = table.insert(RoutePattern::parse("/a/{y}").unwrap(), 2);
        assert_eq!(conflict.unwrap_err().path, "/a/{y}");
    }

    #[test]
    fn key_ids_have_no_separators() {
        let id = RoutePattern::parse("POST /v1/{id}:run").unwrap().key_id();
        assert_eq!(id, "POST/v1/_id__run");
        assert_eq!(RoutePattern::parse(" /x ").unwrap().key_id(), "ANY/x");
        assert_eq!(
            RoutePattern::parse("POST  /a").unwrap().to_string(),
            "POST /a"
        );
    }
}
