//! The layer end to end through `oneshot`: what its responses carry (both header styles, the 429 body, `Retry-After` and its jitter, problem+json, custom 429s, nested layers).

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use floodgate::time::{FakeClock, Timestamp};
use floodgate::{Denial, HeaderStyle, Limit, RateLimitLayer, RequestInfo};
use http::{Response, StatusCode};
use tower::{Layer, service_fn};

#[tokio::test]
async fn allowed_responses_carry_both_header_styles_by_default() {
    let clock = FakeClock::new(START);
    let layer = RateLimitLayer::builder()
        .limit(per_second(10))
        .limit(Limit::fixed_window("daily", 1000, Duration::from_secs(86_400)).unwrap())
        .store(memory(&clock))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let response = send(&service, from_peer("203.0.113.1:4000")).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.body(), "9", "the handler sees the decision");
    assert_eq!(header(&response, "x-ratelimit-limit"), "10");
    assert_eq!(header(&response, "x-ratelimit-remaining"), "9");
    // One token refills in 100ms: the bucket is full again at START + 0.1s, rounded up.
    assert_eq!(
        header(&response, "x-ratelimit-reset"),
        (START.as_secs_ceil() + 1).to_string()
    );
    assert_eq!(
        header(&response, "ratelimit-policy"),
        "\"per-second\";q=10;w=1, \"daily\";q=1000;w=86400"
    );
    assert_eq!(header(&response, "ratelimit"), "\"per-second\";r=9;t=1");
}

#[tokio::test]
async fn header_styles_select_which_headers_are_sent() {
    for (style, legacy, ietf) in [
        (HeaderStyle::Legacy, true, false),
        (HeaderStyle::Ietf, false, true),
        (HeaderStyle::Both, true, true),
        (HeaderStyle::None, false, false),
    ] {
        let layer = RateLimitLayer::builder()
            .limit(per_second(1))
            .headers(style)
            .build()
            .unwrap();
        let service = layer.layer(service_fn(ok_handler));
        let allowed = send(&service, from_peer("203.0.113.1:4000")).await;
        let denied = send(&service, from_peer("203.0.113.1:4000")).await;
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
        for response in [&allowed, &denied] {
            assert_eq!(
                response.headers().contains_key("x-ratelimit-remaining"),
                legacy,
                "{style:?}"
            );
            assert_eq!(
                response.headers().contains_key("ratelimit"),
                ietf,
                "{style:?}"
            );
            assert_eq!(
                response.headers().contains_key("ratelimit-policy"),
                ietf,
                "{style:?}"
            );
        }
        assert!(
            denied.headers().contains_key("retry-after"),
            "{style:?}: always on a 429"
        );
    }
}

#[tokio::test]
async fn denial_is_a_429_with_the_spec_body() {
    let clock = FakeClock::new(START);
    let layer = RateLimitLayer::builder()
        .limit(Limit::token_bucket("per-minute", 2, Duration::from_secs(60)).unwrap())
        .store(memory(&clock))
        .retry_after_jitter(0.0)
        .docs_url("https://example.com/docs/rate-limits")
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    for _ in 0..2 {
        assert_eq!(
            send(&service, from_peer("203.0.113.1:1")).await.status(),
            StatusCode::OK
        );
    }
    clock.advance(Duration::from_millis(500));
    let denied = send(&service, from_peer("203.0.113.1:1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&denied, "content-type"), "application/json");
    assert_eq!(header(&denied, "cache-control"), "no-store");
    // One token every 30s; 0.5s passed: the true wait is 29.5s, rounded up to 30.
    assert_eq!(header(&denied, "retry-after"), "30");
    assert_eq!(header(&denied, "x-ratelimit-remaining"), "0");
    assert_eq!(
        denied.body(),
        r#"{"error":"rate_limit_exceeded","retry_after":30,"policy":"per-minute","docs":"https://example.com/docs/rate-limits"}"#,
        "the fields in SPEC §2's order"
    );
    assert_eq!(
        json(&denied),
        serde_json::json!({
            "error": "rate_limit_exceeded",
            "retry_after": 30,
            "policy": "per-minute",
            "docs": "https://example.com/docs/rate-limits",
        })
    );
}

#[tokio::test]
async fn retry_after_is_never_below_the_wait_and_jitter_is_bounded() {
    let clock = FakeClock::new(START);
    let layer = RateLimitLayer::builder()
        .limit(Limit::gcra("slow", 1, Duration::from_secs(10)).unwrap())
        .store(memory(&clock))
        .retry_after_jitter(0.5)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    assert_eq!(
        send(&service, from_peer("203.0.113.1:1")).await.status(),
        StatusCode::OK
    );
    clock.advance(Duration::from_millis(100)); // true wait: 9.9s
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..300 {
        let denied = send(&service, from_peer("203.0.113.1:1")).await;
        let secs: u64 = header(&denied, "retry-after").parse().unwrap();
        assert_eq!(json(&denied)["retry_after"], secs, "body equals header");
        // ≥ ceil(9.9) and ≤ ceil(9.9 × 1.5).
        assert!((10..=15).contains(&secs), "{secs}");
        seen.insert(secs);
    }
    assert!(seen.len() >= 3, "jitter spreads retries: {seen:?}");
    // A client that waits Retry-After and retries alone is admitted.
    clock.advance(Duration::from_secs(*seen.first().unwrap()));
    assert_eq!(
        send(&service, from_peer("203.0.113.1:1")).await.status(),
        StatusCode::OK
    );
}

/// The denials of a fresh client under `limit` (one request allowed) at `now`, whose true
/// wait is `wait`: every `Retry-After` sent over 200 denials, and each checked against SPEC
/// §2's bound: never below the wait rounded up, never past the instant the client is admitted
/// again by more than `min(jitter × wait, 60 s)` (rounded up as the header is).
async fn retry_afters(
    limit: Limit,
    now: Timestamp,
    wait: Duration,
) -> std::collections::BTreeSet<u64> {
    let clock = FakeClock::new(now);
    let layer = RateLimitLayer::builder()
        .limit(limit)
        .store(memory(&clock))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    assert_eq!(
        send(&service, from_peer("203.0.113.1:1")).await.status(),
        StatusCode::OK
    );
    let bound = wait.mul_f64(0.2).min(Duration::from_secs(60));
    let earliest = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let latest = {
        let late = wait + bound;
        late.as_secs() + u64::from(late.subsec_nanos() > 0)
    };
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..200 {
        let denied = send(&service, from_peer("203.0.113.1:1")).await;
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
        let secs: u64 = header(&denied, "retry-after").parse().unwrap();
        assert!(
            (earliest..=latest).contains(&secs),
            "Retry-After {secs} for a wait of {wait:?}: outside {earliest}..={latest}"
        );
        assert_eq!(json(&denied)["retry_after"], secs, "body equals header");
        seen.insert(secs);
    }
    seen
}

/// Regression (issue 45): a monthly quota 12.5 days from its end answered `Retry-After` up to
/// 20 % of the wait late (53.7 h); a yearly one ~43 days. The jitter is bounded by 60 s, still
/// spread; a second-long window keeps its 20 % (of a wait of at most a second).
#[tokio::test]
async fn retry_after_is_never_more_than_the_jitter_bound_past_the_reset() {
    use floodgate::Algorithm;
    use floodgate::calendar::{CalendarPeriod, Period};
    let calendar = |period: Period, name: &str| {
        Limit::builder(name)
            .algorithm(Algorithm::FixedWindow)
            .limit(1)
            .calendar(CalendarPeriod::new(period, "UTC").unwrap())
            .build()
            .unwrap()
    };
    // 2026-01-19T12:00:00Z, 12.5 days before February.
    let month = retry_afters(
        calendar(Period::Month, "monthly"),
        Timestamp::from_secs(1_768_824_000),
        Duration::from_secs(1_769_904_000 - 1_768_824_000),
    )
    .await;
    assert!(month.len() >= 10, "still jittered: {month:?}");
    // 2026-06-01T00:00:00Z, 214 days before 2027.
    let year = retry_afters(
        calendar(Period::Year, "yearly"),
        Timestamp::from_secs(1_780_272_000),
        Duration::from_secs(1_798_761_600 - 1_780_272_000),
    )
    .await;
    assert!(year.len() >= 10, "still jittered: {year:?}");
    // A one-second window, denied a quarter of a second into it.
    let second = retry_afters(
        Limit::fixed_window("per-second", 1, Duration::from_secs(1)).unwrap(),
        Timestamp::from_micros(START.as_micros() + 250_000),
        Duration::from_millis(750),
    )
    .await;
    assert_eq!(second, [1].into(), "0.75 s and at most 0.15 s more: 1 s");
}

#[tokio::test]
async fn problem_json_is_rfc_9457() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .problem_json(true)
        .docs_url("https://example.com/docs")
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    send(&service, from_peer("203.0.113.1:1")).await;
    let denied = send(&service, from_peer("203.0.113.1:1")).await;
    assert_eq!(header(&denied, "content-type"), "application/problem+json");
    let body = json(&denied);
    assert_eq!(body["type"], "https://example.com/docs#quota-exceeded");
    assert_eq!(body["status"], 429);
    assert_eq!(body["violated-policies"], serde_json::json!(["per-second"]));
    assert_eq!(
        body["retry_after"].as_u64().unwrap().to_string(),
        header(&denied, "retry-after")
    );
}

#[tokio::test]
async fn a_cost_above_capacity_is_denied_without_a_retry_promise() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(5))
        .cost(|_: &RequestInfo<'_>| 6)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let denied = send(&service, from_peer("203.0.113.1:1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(!denied.headers().contains_key("retry-after"));
    let body = json(&denied);
    assert_eq!(body["error"], "cost_exceeds_limit");
    assert_eq!(body["capacity"], 5);
}

#[tokio::test]
async fn the_429_can_be_replaced() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .limited_response(|denial: &Denial<'_>| {
            let mut response = Response::new(Bytes::from(format!(
                "slow down, {}s",
                denial.retry_after_secs.unwrap_or(0)
            )));
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            response
        })
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    send(&service, from_peer("203.0.113.1:1")).await;
    let denied = send(&service, from_peer("203.0.113.1:1")).await;
    assert_eq!(denied.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry = header(&denied, "retry-after").to_owned();
    assert_eq!(denied.body(), &format!("slow down, {retry}s"));
    assert!(
        denied.headers().contains_key("x-ratelimit-limit"),
        "rate limit headers still added"
    );
}

#[tokio::test]
async fn nested_layers_send_the_binding_limits_headers() {
    // Regression: a global 10/s layer around a per-route 1/min login limit put its
    // own `x-ratelimit-limit: 10`, `remaining` and `RateLimit-Policy` over the login 429's.
    let outer = RateLimitLayer::builder()
        .limit(per_second(10))
        .rule("global")
        .build()
        .unwrap();
    let inner = RateLimitLayer::builder()
        .limit(Limit::fixed_window("login", 1, Duration::from_secs(60)).unwrap())
        .rule("login")
        .build()
        .unwrap();
    let service = outer.layer(inner.layer(service_fn(ok_handler)));
    let first = send(&service, from_peer("198.51.100.1:1")).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(
        header(&first, "x-ratelimit-limit"),
        "1",
        "login binds: 0 of 1 left"
    );
    assert_eq!(header(&first, "x-ratelimit-remaining"), "0");
    assert_eq!(
        header(&first, "ratelimit-policy"),
        "\"login\";q=1;w=60, \"per-second\";q=10;w=1"
    );
    let denied = send(&service, from_peer("198.51.100.1:1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&denied, "x-ratelimit-limit"), "1");
    assert_eq!(header(&denied, "x-ratelimit-remaining"), "0");
    assert!(header(&denied, "ratelimit").starts_with("\"login\";r=0;"));
    assert_eq!(json(&denied)["policy"], "login");
    // Where the outer limit is the tighter one, its headers win.
    let generous_inner = RateLimitLayer::builder()
        .limit(per_second(1000))
        .rule("inner")
        .build()
        .unwrap();
    let outer = RateLimitLayer::builder()
        .limit(per_second(2))
        .rule("outer")
        .build()
        .unwrap();
    let service = outer.layer(generous_inner.layer(service_fn(ok_handler)));
    let response = send(&service, from_peer("198.51.100.2:1")).await;
    assert_eq!(header(&response, "x-ratelimit-limit"), "2");
    assert_eq!(header(&response, "x-ratelimit-remaining"), "1");
}

#[tokio::test]
async fn the_429_hook_takes_anything_axum_turns_into_a_response() {
    // Regression: the custom 429 hook (`limited_response`) could not return `impl IntoResponse`.
    use axum::response::Html;
    let service = RateLimitLayer::builder()
        .limit(per_second(1))
        .limited_response_with(|denial: &Denial<'_>| {
            (
                StatusCode::TOO_MANY_REQUESTS,
                Html(format!(
                    "<p>retry in {}s</p>",
                    denial.retry_after_secs.unwrap_or(0)
                )),
            )
        })
        .build()
        .unwrap()
        .layer(service_fn(ok_handler));
    assert_eq!(
        send(&service, from_peer("198.51.100.5:1")).await.status(),
        StatusCode::OK
    );
    let denied = send(&service, from_peer("198.51.100.5:1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&denied, "content-type"), "text/html; charset=utf-8");
    let retry = header(&denied, "retry-after").to_owned();
    assert_eq!(
        denied.body(),
        format!("<p>retry in {retry}s</p>").as_str(),
        "the body got the same Retry-After as the header"
    );
    assert_eq!(header(&denied, "x-ratelimit-limit"), "1");
}
