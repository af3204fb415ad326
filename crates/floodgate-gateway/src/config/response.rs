//! `response`: header style, `Retry-After` jitter, the docs link and the body format.

use std::sync::Arc;

use floodgate::HeaderStyle;
use floodgate::response::ResponseSettings;

use super::errors::Errors;
use super::raw::RawConfig;

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

    let mut settings = ResponseSettings::default();
    settings.headers = headers?;
    settings.retry_after_jitter = raw.response.retry_after_jitter;
    settings.docs_url = raw.response.docs_url.as_deref().map(Arc::from);
    settings.problem_json = raw.response.problem_json;
    Some(settings)
}
