//! `response`: header style, `Retry-After` jitter, the docs link and the body format.

use std::sync::Arc;

use floodgate::HeaderStyle;
use floodgate::response::ResponseSettings;
use serde::{Deserialize, Serialize};

use super::errors::Errors;

/// `response:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawResponse {
    /// `both`, `ietf`, `legacy` (`X-RateLimit-*`) or `none`.
    pub headers: String,
    /// Up to this share of the wait is added at random to `Retry-After`, so that refused
    /// clients do not return together.
    pub retry_after_jitter: f64,
    /// A link put in every 429's body.
    pub docs_url: Option<String>,
    /// Whether a 429's body is `application/problem+json` (RFC 9457).
    pub problem_json: bool,
}

impl Default for RawResponse {
    fn default() -> Self {
        RawResponse {
            headers: "both".to_owned(),
            retry_after_jitter: 0.2,
            docs_url: None,
            problem_json: false,
        }
    }
}

/// `response`, checked.
pub(super) fn response(errors: &mut Errors, raw: &RawResponse) -> Option<ResponseSettings> {
    let headers = errors.ok(
        "response.headers",
        raw.headers
            .parse::<HeaderStyle>()
            .map_err(|error| error.to_string()),
    );
    if !(0.0..=10.0).contains(&raw.retry_after_jitter) {
        errors.push("response.retry_after_jitter", "must be between 0 and 10");
    }

    let mut settings = ResponseSettings::default();
    settings.headers = headers?;
    settings.retry_after_jitter = raw.retry_after_jitter;
    settings.docs_url = raw.docs_url.as_deref().map(Arc::from);
    settings.problem_json = raw.problem_json;
    Some(settings)
}
