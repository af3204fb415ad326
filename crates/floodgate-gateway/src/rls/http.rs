//! The rate limit service's HTTP/1.1 listener (`rls.http_listen`), as envoyproxy/ratelimit's
//! HTTP port: `POST /json` (`ShouldRateLimit` in JSON, for callers that cannot speak gRPC) and
//! `GET /healthcheck`.
//!
//! `/json` answers what `ShouldRateLimit` answers, decided by the same [`RlsService`] (its
//! counters, failure policy and override limits), in the peer's JSON and statuses: 200 for
//! `OK`, 429 for `OVER_LIMIT`, 400 for a body that is not a request. A store that fails under
//! `on_store_error: closed` is 503 (the peer answers 400 for every error). Error bodies are one
//! short `text/plain` line about the request, never about floodgate's insides.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;

use super::json;
use super::service::RlsService;

/// The largest `/json` body read. Envoy's requests are a few hundred bytes; 64 KiB holds
/// hundreds of descriptors and keeps a caller from making the service buffer megabytes.
pub(crate) const MAX_BODY_BYTES: usize = 64 * 1024;

/// The router of `rls.http_listen`.
pub(crate) fn router(service: Arc<RlsService>) -> Router {
    Router::new()
        .route("/json", post(should_rate_limit))
        .route("/healthcheck", get(|| async { "OK" }))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(service)
}

/// Serves the router on `listener` (`TCP_NODELAY` on every connection) until the task is
/// dropped.
pub(crate) async fn serve(listener: tokio::net::TcpListener, service: Arc<RlsService>) {
    let served = axum::serve(crate::serve::nodelay_listener(listener), router(service)).await;
    if let Err(error) = served {
        tracing::error!(%error, "rls: the HTTP listener failed");
    }
}

/// A short `text/plain` answer.
fn plain(status: StatusCode, message: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        format!("{message}\n"),
    )
        .into_response()
}

async fn should_rate_limit(
    State(service): State<Arc<RlsService>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return plain(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("request body too large: at most {MAX_BODY_BYTES} bytes"),
            );
        }
        Err(rejection) => {
            tracing::debug!(%rejection, "rls: /json body could not be read");
            return plain(StatusCode::BAD_REQUEST, "could not read the request body");
        }
    };
    let request = match json::parse_request(&body) {
        Ok(request) => request,
        Err(invalid) => return plain(StatusCode::BAD_REQUEST, &invalid.to_string()),
    };
    match service.should_rate_limit(&request).await {
        Ok(response) => {
            let status = if response.overall_code == Code::OverLimit as i32 {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            (status, axum::Json(json::response_json(&response))).into_response()
        }
        // The service's refusals of a request are written for callers (gRPC sends them too).
        Err(refused) if refused.code() == tonic::Code::InvalidArgument => {
            plain(StatusCode::BAD_REQUEST, refused.message())
        }
        Err(refused) if refused.code() == tonic::Code::Unavailable => plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "rate limit service unavailable",
        ),
        Err(error) => {
            tracing::warn!(%error, "rls: /json could not be answered");
            plain(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
        }
    }
}
