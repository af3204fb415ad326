//! Endpoint patterns (`"METHOD /path"` or `"/path"`, with `{param}` and `{*rest}` segments as in
//! axum's router) and the table that finds a request's endpoint.

use super::errors::Problem;
use std::collections::HashMap;

use http::Method;

/// A parsed `"METHOD /path"` pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// `None` matches any method.
    pub method: Option<Method>,
    /// The path pattern.
    pub path: String,
}

impl Endpoint {
    /// Parses `"POST /v1/things/{id}"` or `"/health"`.
    pub(crate) fn parse(text: &str) -> Result<Endpoint, Problem> {
        let text = text.trim();
        let (method, path) = match text.split_once(' ') {
            Some((method, path)) => {
                let method = Method::from_bytes(method.as_bytes())
                    .map_err(|_| problem!("`{method}` is not an HTTP method"))?;
                (Some(method), path.trim())
            }
            None => (None, text),
        };
        if !path.starts_with('/') {
            return Err(problem!(
                "`{text}`: the path must start with `/` (pattern: \"METHOD /path\" or \"/path\")"
            ));
        }
        Ok(Endpoint {
            method,
            path: path.to_owned(),
        })
    }

    /// A stable identifier usable inside storage keys: no spaces, braces or colons.
    pub(crate) fn key_id(&self) -> String {
        let method = self.method.as_ref().map_or("ANY", Method::as_str);
        let path = floodgate::key::key_part(&self.path, floodgate::key::KeyChars::Path);
        format!("{method}{path}")
    }
}

/// Values by endpoint; a method-specific pattern wins over an any-method one.
#[derive(Debug)]
pub(crate) struct EndpointTable<T> {
    by_method: HashMap<Method, matchit::Router<usize>>,
    any: matchit::Router<usize>,
    entries: Vec<(Endpoint, T)>,
}

impl<T> Default for EndpointTable<T> {
    fn default() -> Self {
        EndpointTable {
            by_method: HashMap::new(),
            any: matchit::Router::new(),
            entries: Vec::new(),
        }
    }
}

impl<T> EndpointTable<T> {
    /// Adds `value` under `endpoint`; fails if the pattern is malformed or conflicts.
    pub(crate) fn insert(&mut self, endpoint: Endpoint, value: T) -> Result<(), Problem> {
        let index = self.entries.len();
        let router = match &endpoint.method {
            Some(method) => self.by_method.entry(method.clone()).or_default(),
            None => &mut self.any,
        };
        router
            .insert(endpoint.path.clone(), index)
            .map_err(|error| format!("`{}`: {error}", endpoint.path))?;
        self.entries.push((endpoint, value));
        Ok(())
    }

    /// The endpoint and value matching a request. `HEAD` is a `GET` without the body (RFC 9110
    /// §9.3.2), so it meets `GET` patterns when no `HEAD` pattern matches: otherwise a limit on
    /// `GET /x` could be dodged with `HEAD /x`, which the upstream serves just the same.
    pub(crate) fn find(&self, method: &Method, path: &str) -> Option<&(Endpoint, T)> {
        self.entry(self.find_index(method, path)?)
    }

    /// Where [`EndpointTable::find`]'s entry stands in the table, to look it up again with
    /// [`EndpointTable::entry`] without matching the path again.
    pub(crate) fn find_index(&self, method: &Method, path: &str) -> Option<usize> {
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

    /// The entry at `index` ([`EndpointTable::find_index`]).
    pub(crate) fn entry(&self, index: usize) -> Option<&(Endpoint, T)> {
        self.entries.get(index)
    }

    /// The same table with every value transformed.
    pub(crate) fn map<U>(self, mut transform: impl FnMut(T) -> U) -> EndpointTable<U> {
        EndpointTable {
            by_method: self.by_method,
            any: self.any,
            entries: self
                .entries
                .into_iter()
                .map(|(endpoint, value)| (endpoint, transform(value)))
                .collect(),
        }
    }

    /// Every endpoint and its value, in the order they were added.
    pub(crate) fn entries(&self) -> impl Iterator<Item = &(Endpoint, T)> {
        self.entries.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_specific_patterns_win_and_params_match() {
        let mut table = EndpointTable::default();
        table
            .insert(Endpoint::parse("/v1/{*rest}").unwrap(), "any")
            .unwrap();
        table
            .insert(Endpoint::parse("POST /v1/things/{id}").unwrap(), "post")
            .unwrap();
        assert_eq!(
            table.find(&Method::POST, "/v1/things/42").unwrap().1,
            "post"
        );
        assert_eq!(table.find(&Method::GET, "/v1/things/42").unwrap().1, "any");
        assert!(table.find(&Method::GET, "/v2").is_none());
    }

    #[test]
    fn bad_patterns_are_errors() {
        assert!(Endpoint::parse("POST v1").is_err());
        assert!(Endpoint::parse("P@ST /v1").is_err());
        let mut table = EndpointTable::default();
        table.insert(Endpoint::parse("/a/{x}").unwrap(), 1).unwrap();
        assert!(
            table.insert(Endpoint::parse("/a/{y}").unwrap(), 2).is_err(),
            "conflict"
        );
    }

    #[test]
    fn key_ids_have_no_separators() {
        let id = Endpoint::parse("POST /v1/{id}:run").unwrap().key_id();
        assert_eq!(id, "POST/v1/_id__run");
    }
}
