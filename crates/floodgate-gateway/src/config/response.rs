//! `response`: header style, `Retry-After` jitter, the docs link and the body format.

use floodgate::HeaderStyle;

use super::errors::Errors;
use super::raw::RawConfig;

/// `response.*`.
#[derive(Clone, Debug)]
pub struct ResponseSettings {
    /// Header style.
    pub headers: HeaderStyle,
    /// Retry-After jitter.
    pub retry_after_jitter: f64,
    /// Docs link in 429 bodies.
    pub docs_url: Option<String>,
    /// RFC 9457 bodies.
    pub problem_json: bool,
}

/// `response`, checked.
pub(super) fn response(errors: &mut Errors, raw: &RawConfig) -> Option<ResponseSettings> {
    let headers = errors.ok(
        "response.headers",
        raw.response
            .headers
            .parse::<HeaderStyle>()
            .map_err(|error| error.to_string()),
    );
    if !(0.0..=10.0).contains(&raw.response.retry_after_jitter) {
        errors.push("response.retry_after_jitter", "must be between 0 and 10");
    }

    Some(ResponseSettings {
        headers: headers?,
        retry_after_jitter: raw.response.retry_after_jitter,
        docs_url: raw.response.docs_url.clone(),
        problem_json: raw.response.problem_json,
    })
}
