//! The responses the limiter answers with instead of calling the service: 429 (SPEC §2),
//! 503 when the store is down under `on_store_error: closed`, 403 for denylisted clients.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};
use serde_json::json;

use crate::decision::Decision;
use crate::headers::{HeaderStyle, write_rate_limit_headers, write_retry_after};

/// A denied request, as handed to a [`MakeLimitedResponse`].
#[derive(Clone, Copy, Debug)]
pub struct Denial<'a> {
    /// The decision.
    pub decision: &'a Decision,
    /// The `Retry-After` value the layer will send (jittered, rounded up, ≥ 1); `None` when
    /// the request can never be admitted.
    pub retry_after_secs: Option<u64>,
}

/// Builds the response for a denied request, replacing the default 429. Closures
/// `Fn(&Denial) -> Response<Bytes>` implement it. The layer still adds the rate limit headers
/// and `Retry-After` unless the response already has them.
pub trait MakeLimitedResponse: Send + Sync + 'static {
    /// The response for `denial`.
    fn make_response(&self, denial: &Denial<'_>) -> Response<Bytes>;
}

impl<F> MakeLimitedResponse for F
where
    F: Fn(&Denial<'_>) -> Response<Bytes> + Send + Sync + 'static,
{
    fn make_response(&self, denial: &Denial<'_>) -> Response<Bytes> {
        self(denial)
    }
}

/// The 429 hook of a layer: a response of bytes, or (with the `axum` feature) anything axum
/// turns into a response, whose body is read once it is made.
#[derive(Clone)]
pub(crate) enum LimitedResponseHook {
    Bytes(Arc<dyn MakeLimitedResponse>),
    #[cfg(feature = "axum")]
    Axum(Arc<dyn Fn(&Denial<'_>) -> axum::response::Response + Send + Sync>),
}

/// The largest body an `IntoResponse` 429 may have; a larger one is replaced by the default.
#[cfg(feature = "axum")]
const MAX_CUSTOM_BODY: usize = 64 * 1024;

impl LimitedResponseHook {
    /// The response the hook makes for `denial` (`settings` shape the default 429 that replaces
    /// an unreadable custom body).
    #[cfg_attr(not(feature = "axum"), allow(unused_variables))]
    pub(crate) async fn make(
        &self,
        denial: &Denial<'_>,
        settings: &ResponseSettings,
    ) -> Response<Bytes> {
        match self {
            LimitedResponseHook::Bytes(make) => make.make_response(denial),
            #[cfg(feature = "axum")]
            LimitedResponseHook::Axum(make) => {
                let (parts, body) = make(denial).into_parts();
                match axum::body::to_bytes(body, MAX_CUSTOM_BODY).await {
                    Ok(bytes) => Response::from_parts(parts, bytes),
                    Err(error) => {
                        tracing::warn!(%error, "custom 429 body unreadable or over 64 KiB; the default 429 is sent");
                        default_limited_response(denial, settings)
                    }
                }
            }
        }
    }
}

/// How the built-in responses look (SPEC §2; `response:` in the gateway's configuration).
/// Set them one by one on [`RateLimitLayerBuilder`](crate::RateLimitLayerBuilder), or all at
/// once with its `responses`; the builder checks them.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ResponseSettings {
    /// Which rate limit headers are sent (default both styles).
    pub headers: HeaderStyle,
    /// `Retry-After` is the exact wait plus a random extra of up to `jitter × wait` (0 to 10,
    /// default 0.2), and never more than
    /// [`MAX_RETRY_AFTER_JITTER`](crate::headers::MAX_RETRY_AFTER_JITTER) (60 s), so that
    /// denied clients do not all come back at once, nor long after the reset.
    pub retry_after_jitter: f64,
    /// A link to the API's rate limit documentation, in 429 bodies.
    pub docs_url: Option<Arc<str>>,
    /// RFC 9457 problem details instead of the plain JSON body.
    pub problem_json: bool,
}

impl Default for ResponseSettings {
    fn default() -> Self {
        ResponseSettings {
            headers: HeaderStyle::Both,
            retry_after_jitter: 0.2,
            docs_url: None,
            problem_json: false,
        }
    }
}

/// A JSON object with its fields in the given order (the order SPEC §2 shows; `serde_json`'s
/// map would sort them).
fn ordered_json(fields: &[(&str, serde_json::Value)]) -> String {
    let mut text = String::from("{");
    for (index, (name, value)) in fields.iter().enumerate() {
        if index > 0 {
            text.push(',');
        }
        text.push_str(&serde_json::Value::from(*name).to_string());
        text.push(':');
        text.push_str(&value.to_string());
    }
    text.push('}');
    text
}

fn json_response(
    status: StatusCode,
    content_type: &'static str,
    fields: &[(&str, serde_json::Value)],
) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from(ordered_json(fields)));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The default 429 body: SPEC §2's JSON, or RFC 9457 problem details.
pub(crate) fn default_limited_response(
    denial: &Denial<'_>,
    settings: &ResponseSettings,
) -> Response<Bytes> {
    let decision = denial.decision;
    let policy = decision.binding_limit().map(|limit| limit.name.to_string());
    let docs = settings.docs_url.as_deref();
    if settings.problem_json {
        let violated: Vec<&str> = decision
            .limits()
            .iter()
            .filter(|limit| !limit.allowed)
            .map(|limit| &*limit.name)
            .collect();
        let detail = match denial.retry_after_secs {
            Some(secs) => format!("Rate limit exceeded; retry in {secs} seconds."),
            None => "The request costs more than the limit can ever allow.".to_owned(),
        };
        let mut fields = vec![
            (
                "type",
                json!(format!("{}#quota-exceeded", docs.unwrap_or("about:blank"))),
            ),
            ("title", json!("Too Many Requests")),
            ("status", json!(429)),
            ("detail", json!(detail)),
            ("violated-policies", json!(violated)),
        ];
        if let Some(secs) = denial.retry_after_secs {
            fields.push(("retry_after", json!(secs)));
        }
        return json_response(
            StatusCode::TOO_MANY_REQUESTS,
            "application/problem+json",
            &fields,
        );
    }
    let mut fields = match denial.retry_after_secs {
        Some(secs) => vec![
            ("error", json!("rate_limit_exceeded")),
            ("retry_after", json!(secs)),
            ("policy", json!(policy)),
        ],
        None => vec![
            ("error", json!("cost_exceeds_limit")),
            (
                "message",
                json!(
                    "the request costs more than this limit can ever admit; it will never succeed as is"
                ),
            ),
            ("policy", json!(policy)),
            (
                "capacity",
                json!(decision.binding_limit().map(|limit| limit.capacity)),
            ),
        ],
    };
    if let Some(docs) = docs {
        fields.push(("docs", json!(docs)));
    }
    json_response(StatusCode::TOO_MANY_REQUESTS, "application/json", &fields)
}

/// Adds what every denial carries, unless a custom response already set it.
pub(crate) fn finish_limited_response(
    response: &mut Response<Bytes>,
    denial: &Denial<'_>,
    settings: &ResponseSettings,
) {
    let headers = response.headers_mut();
    if let Some(secs) = denial.retry_after_secs
        && !headers.contains_key(http::header::RETRY_AFTER)
    {
        write_retry_after(headers, secs);
    }
    if !headers.contains_key(CACHE_CONTROL) {
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    write_rate_limit_headers(headers, denial.decision, settings.headers);
}

/// 503 for `on_store_error: closed`: the limiter cannot decide, so it refuses.
pub fn unavailable_response() -> Response<Bytes> {
    let mut response = json_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "application/json",
        &[("error", json!("rate_limiter_unavailable"))],
    );
    write_retry_after(response.headers_mut(), 1);
    response
}

/// 500 for a request whose client could not be identified, under
/// [`UnknownIdentity::Reject`](crate::service::UnknownIdentity::Reject).
pub fn unidentified_response() -> Response<Bytes> {
    json_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "application/json",
        &[("error", json!("client_unidentified"))],
    )
}

/// 403 for a denylisted client.
pub fn forbidden_response() -> Response<Bytes> {
    json_response(
        StatusCode::FORBIDDEN,
        "application/json",
        &[("error", json!("forbidden"))],
    )
}
