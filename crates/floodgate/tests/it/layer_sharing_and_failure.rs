//! The layer end to end through `oneshot`: a failing store under each failure policy, clones sharing one limit, and the builder refusing bad configuration.

use crate::common;

use common::*;
use floodgate::{FailurePolicy, RateLimitLayer};
use http::StatusCode;
use tower::{Layer, service_fn};

#[tokio::test]
async fn store_failure_fails_open_by_default() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .store(DownStore)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    for _ in 0..3 {
        let response = send(&service, from_peer("203.0.113.1:1")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(
            !response.headers().contains_key("x-ratelimit-remaining"),
            "no made-up numbers"
        );
    }
}

#[tokio::test]
async fn store_failure_fails_closed_when_configured() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .store(DownStore)
        .on_store_error(FailurePolicy::Closed)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let response = send(&service, from_peer("203.0.113.1:1")).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&response, "retry-after"), "1");
    assert_eq!(
        json(&response),
        serde_json::json!({"error": "rate_limiter_unavailable"})
    );
    assert!(
        !String::from_utf8_lossy(response.body()).contains("timed out"),
        "no internal detail"
    );
}

#[tokio::test]
async fn clones_of_layer_and_service_share_one_limit() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(2))
        .build()
        .unwrap();
    let first = layer.clone().layer(service_fn(ok_handler));
    let second = layer.layer(service_fn(ok_handler));
    let third = second.clone();
    assert_eq!(
        send(&first, from_peer("203.0.113.1:1")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&second, from_peer("203.0.113.1:1")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&third, from_peer("203.0.113.1:1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[test]
fn the_builder_rejects_bad_configuration_with_the_field_named() {
    let cases = [
        (RateLimitLayer::builder(), "limits:"),
        (
            RateLimitLayer::builder()
                .limit(per_second(1))
                .limit(per_second(2)),
            "limits[1].name",
        ),
        (
            RateLimitLayer::builder()
                .limit(per_second(1))
                .rule("a rule"),
            "rule:",
        ),
        (
            RateLimitLayer::builder()
                .limit(per_second(1))
                .key_prefix("{fg}"),
            "prefix:",
        ),
        (
            RateLimitLayer::builder()
                .limit(per_second(1))
                .retry_after_jitter(-0.1),
            "retry_after_jitter:",
        ),
        (
            RateLimitLayer::builder()
                .limit(per_second(1))
                .retry_after_jitter(f64::NAN),
            "retry_after_jitter:",
        ),
    ];
    for (builder, field) in cases {
        let error = builder.build().expect_err(field);
        assert!(error.to_string().starts_with(field), "{error}");
    }
    assert!("sometimes".parse::<FailurePolicy>().is_err());
}
