//! The layer end to end through `oneshot`: statuses, headers, bodies, identity, shaping, leases.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use floodgate::key::DefaultIdentifier;
use floodgate::store::BoxFuture;
use floodgate::{
    Algorithm, Decision, Denial, FailurePolicy, HeaderStyle, Identity, Limit, MemoryStore,
    PeerAddr, RateLimitLayer, RequestInfo, Store, StoreError, UserId, store::Check, store::Lease,
    time::FakeClock, time::Timestamp,
};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Either, Full};
use tower::{Layer, Service, ServiceExt, service_fn};

const START: Timestamp = Timestamp::from_secs(1_700_006_400);

async fn ok_handler(request: Request<()>) -> Result<Response<Full<Bytes>>, Infallible> {
    // Echo the binding limit's remaining count from the decision extension.
    let remaining = request
        .extensions()
        .get::<Decision>()
        .and_then(|decision| decision.binding_limit())
        .map_or("none".to_owned(), |limit| limit.remaining.to_string());
    Ok(Response::new(Full::new(Bytes::from(remaining))))
}

fn memory(clock: &FakeClock) -> MemoryStore {
    MemoryStore::builder().clock(clock.clone()).build()
}

fn per_second(limit: u64) -> Limit {
    Limit::token_bucket("per-second", limit, Duration::from_secs(1)).unwrap()
}

fn from_peer(peer: &str) -> http::request::Builder {
    let addr: SocketAddr = peer.parse().unwrap();
    Request::builder()
        .uri("/v1/things")
        .extension(PeerAddr(addr))
}

async fn send<S, B>(service: &S, request: http::request::Builder) -> Response<Bytes>
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible> + Clone,
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let response = service
        .clone()
        .oneshot(request.body(()).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    Response::from_parts(parts, bytes)
}

fn header<'r>(response: &'r Response<Bytes>, name: &str) -> &'r str {
    response
        .headers()
        .get(name)
        .unwrap_or_else(|| panic!("missing {name}"))
        .to_str()
        .unwrap()
}

fn json(response: &Response<Bytes>) -> serde_json::Value {
    serde_json::from_slice(response.body()).unwrap()
}

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
async fn forged_forwarded_for_from_an_untrusted_peer_changes_nothing() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(3))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let mut statuses = Vec::new();
    for forged in 0..6 {
        let request = from_peer("203.0.113.66:5000")
            .header("x-forwarded-for", format!("198.51.100.{forged}"))
            .header("forwarded", format!("for=192.0.2.{forged}"));
        statuses.push(send(&service, request).await.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
}

#[tokio::test]
async fn a_trusted_proxy_chain_is_walked_to_the_client() {
    let identify = DefaultIdentifier::new()
        .trusted_proxies(["10.0.0.0/8"])
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .identify(identify)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let via_proxies = |client: &str| {
        from_peer("10.0.0.1:80").header("x-forwarded-for", format!("6.6.6.6, {client}, 10.0.0.2"))
    };
    assert_eq!(
        send(&service, via_proxies("198.51.100.7")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, via_proxies("198.51.100.8")).await.status(),
        StatusCode::OK,
        "another client"
    );
    assert_eq!(
        send(&service, via_proxies("198.51.100.7")).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "same client behind the same proxies"
    );
}

#[tokio::test]
async fn ipv6_clients_are_grouped_by_prefix() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    assert_eq!(
        send(&service, from_peer("[2001:db8:1:2::1]:1"))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, from_peer("[2001:db8:1:2:ffff::9]:1"))
            .await
            .status(),
        StatusCode::TOO_MANY_REQUESTS,
        "same /64"
    );
    assert_eq!(
        send(&service, from_peer("[2001:db8:1:3::1]:1"))
            .await
            .status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn api_keys_and_bearer_tokens_identify_clients() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let peer = "203.0.113.1:1";
    assert_eq!(
        send(&service, from_peer(peer).header("x-api-key", "key-a"))
            .await
            .status(),
        StatusCode::OK
    );
    // Same key by bearer token: the same client.
    let bearer = from_peer(peer).header("authorization", "Bearer key-a");
    assert_eq!(
        send(&service, bearer).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&service, from_peer(peer).header("x-api-key", "key-b"))
            .await
            .status(),
        StatusCode::OK
    );
    // Keys are not IPs: the IP itself still has its own budget.
    assert_eq!(
        send(&service, from_peer(peer)).await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn oversized_or_malformed_keys_are_treated_as_absent() {
    let identify = Arc::new(DefaultIdentifier::new());
    let counting = identify.clone();
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .identify(move |request: &RequestInfo<'_>| {
            use floodgate::key::IdentifyClient;
            counting.identify(request)
        })
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let peer = "203.0.113.1:1";
    let oversized = "k".repeat(300);
    // Each falls back to the peer IP: one budget for all of them.
    assert_eq!(
        send(
            &service,
            from_peer(peer).header("x-api-key", oversized.as_str())
        )
        .await
        .status(),
        StatusCode::OK
    );
    let with_space = from_peer(peer).header("x-api-key", "two words");
    assert_eq!(
        send(&service, with_space).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let non_ascii = from_peer(peer).header(
        "x-api-key",
        http::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
    );
    assert_eq!(
        send(&service, non_ascii).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let empty_bearer = from_peer(peer).header("authorization", "Bearer ");
    assert_eq!(
        send(&service, empty_bearer).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(identify.malformed_count(), 4);
    // 256 visible ASCII bytes is still a key.
    let longest = "k".repeat(256);
    assert_eq!(
        send(
            &service,
            from_peer(peer).header("x-api-key", longest.as_str())
        )
        .await
        .status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn user_ids_come_from_the_extension_or_a_trusted_header() {
    let identify = DefaultIdentifier::new()
        .user_header(Some("x-user-id"))
        .unwrap()
        .trusted_proxies(["10.0.0.1"])
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .identify(identify)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let user = |peer: &str, id: &str| from_peer(peer).header("x-user-id", id.to_owned());
    assert_eq!(
        send(&service, user("10.0.0.1:1", "alice")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, user("10.0.0.1:1", "bob")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, user("10.0.0.1:1", "alice")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // From an untrusted peer the header is ignored: identified by IP.
    assert_eq!(
        send(&service, user("203.0.113.5:1", "carol"))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, user("203.0.113.5:1", "dave")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // The typed extension from the app's auth layer is always trusted.
    let authenticated = from_peer("203.0.113.5:1").extension(UserId("erin".into()));
    assert_eq!(send(&service, authenticated).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn custom_identity_and_cost_functions() {
    let layer = RateLimitLayer::builder()
        .limit(Limit::fixed_window("units", 10, Duration::from_secs(60)).unwrap())
        .identify(|request: &RequestInfo<'_>| Identity::Custom {
            scope: "tenant".into(),
            value: request
                .headers
                .get("x-tenant")
                .map_or("none", |v| v.to_str().unwrap_or("bad"))
                .to_owned(),
        })
        .cost(|request: &RequestInfo<'_>| {
            if request.method == http::Method::POST {
                4
            } else {
                1
            }
        })
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let post = || {
        Request::builder()
            .method("POST")
            .uri("/")
            .header("x-tenant", "acme")
    };
    assert_eq!(send(&service, post()).await.body(), "6");
    assert_eq!(send(&service, post()).await.body(), "2");
    assert_eq!(
        send(&service, post()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let get = Request::builder().uri("/").header("x-tenant", "acme");
    assert_eq!(
        send(&service, get).await.body(),
        "1",
        "a cheaper request still fits"
    );
    let other = Request::builder()
        .method("POST")
        .uri("/")
        .header("x-tenant", "globex");
    assert_eq!(send(&service, other).await.status(), StatusCode::OK);
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

#[tokio::test(start_paused = true)]
async fn leaky_bucket_delays_requests_instead_of_rejecting() {
    let limit = Limit::builder("shaped")
        .algorithm(Algorithm::LeakyBucket)
        .limit(10)
        .window(Duration::from_secs(1))
        .burst(2)
        .build()
        .unwrap();
    let store = MemoryStore::builder()
        .clock(TokioClock(tokio::time::Instant::now()))
        .build();
    let layer = RateLimitLayer::builder()
        .limit(limit)
        .store(store)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let started = tokio::time::Instant::now();
    let (a, b, c) = tokio::join!(
        send(&service, from_peer("203.0.113.1:1")),
        send(&service, from_peer("203.0.113.1:1")),
        send(&service, from_peer("203.0.113.1:1")),
    );
    assert!(
        [&a, &b, &c]
            .iter()
            .all(|response| response.status() == StatusCode::OK)
    );
    // The third waited two emission intervals (with paused time, exactly the sleeps taken).
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(199) && elapsed < Duration::from_millis(300),
        "{elapsed:?}"
    );
    let fourth = send(&service, from_peer("203.0.113.1:1")).await;
    assert_eq!(
        fourth.status(),
        StatusCode::OK,
        "time has moved on: the queue drained by 200ms"
    );
}

#[tokio::test]
async fn concurrency_lease_is_held_until_the_body_ends() {
    let limit = Limit::builder("in-flight")
        .algorithm(Algorithm::Concurrency)
        .limit(1)
        .build()
        .unwrap();
    let store = MemoryStore::new();
    let layer = RateLimitLayer::builder()
        .limit(limit)
        .store(store.clone())
        .build()
        .unwrap();
    let (sender, receiver) = tokio::sync::mpsc::channel::<Bytes>(1);
    let receiver = Arc::new(std::sync::Mutex::new(Some(receiver)));
    let streaming = service_fn(move |_request: Request<()>| {
        let receiver = receiver.lock().unwrap().take();
        async move {
            let body = match receiver {
                Some(receiver) => Either::Left(ChannelBody(receiver)),
                None => Either::Right(Full::new(Bytes::from_static(b"quick"))),
            };
            Ok::<_, Infallible>(Response::new(body))
        }
    });
    let service = layer.layer(streaming);
    let request = || from_peer("203.0.113.1:1").body(()).unwrap();

    let first = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // The first response's body is still streaming: the client is at its limit.
    let second = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);

    sender.send(Bytes::from_static(b"chunk")).await.unwrap();
    drop(sender);
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "chunk");
    // Body finished: lease released.
    let third = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    // A response dropped before its end releases too.
    drop(third);
    let fourth = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(fourth.status(), StatusCode::OK);
    drop(fourth);
    assert!(store.is_empty(), "no lease left behind");
}

/// The store's clock following Tokio's (paused) time, so sleeps and decisions agree.
struct TokioClock(tokio::time::Instant);

impl floodgate::time::Clock for TokioClock {
    fn now(&self) -> Timestamp {
        START.saturating_add(self.0.elapsed())
    }
}

/// A response body fed chunk by chunk from a channel; it ends when the sender is dropped.
struct ChannelBody(tokio::sync::mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|data| Ok(Frame::data(data))))
    }
}

/// A store whose backend is down: every call fails the way a dead Redis does.
struct DownStore;

impl Store for DownStore {
    fn check_and_consume<'a>(
        &'a self,
        _checks: &'a [Check],
        _now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(async { Err(StoreError::Timeout(Duration::from_millis(50))) })
    }

    fn release<'a>(&'a self, _leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async { Err(StoreError::Timeout(Duration::from_millis(50))) })
    }

    fn backend(&self) -> &'static str {
        "down"
    }
}

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

#[tokio::test]
async fn allowlisted_clients_skip_the_store_and_denylisted_get_403() {
    use floodgate::lists::ClientList;
    let store = MemoryStore::new();
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .store(store.clone())
        .allowlist(
            ClientList::new()
                .api_key("partner")
                .ip("192.0.2.0/24".parse().unwrap()),
        )
        .denylist(
            ClientList::new()
                .ip("203.0.113.66/32".parse().unwrap())
                .user("mallory"),
        )
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    for _ in 0..5 {
        let partner = send(
            &service,
            from_peer("198.51.100.1:1").header("x-api-key", "partner"),
        )
        .await;
        assert_eq!(partner.status(), StatusCode::OK);
        assert!(
            !partner.headers().contains_key("x-ratelimit-limit"),
            "no limit applies"
        );
        assert_eq!(
            send(&service, from_peer("192.0.2.44:1")).await.status(),
            StatusCode::OK
        );
    }
    assert!(store.is_empty(), "allowlisted traffic made no store call");
    let denied = send(&service, from_peer("203.0.113.66:1")).await;
    assert_eq!(denied.status(), StatusCode::FORBIDDEN);
    assert_eq!(json(&denied), serde_json::json!({"error": "forbidden"}));
    let user = send(
        &service,
        from_peer("198.51.100.2:1").extension(UserId("mallory".into())),
    )
    .await;
    assert_eq!(user.status(), StatusCode::FORBIDDEN);
    assert!(store.is_empty(), "denied before any store call");
    assert_eq!(
        send(&service, from_peer("198.51.100.3:1")).await.status(),
        StatusCode::OK
    );
    assert_eq!(store.len(), 1, "others are limited as usual");
}

#[tokio::test]
async fn shadow_mode_and_the_kill_switch_switch_at_runtime() {
    use floodgate::{rollout::Mode, rollout::Rollout};
    let store = MemoryStore::new();
    let rollout = Rollout::new(Mode::Shadow, 100.0);
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .store(store.clone())
        .rollout(rollout.clone())
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    for _ in 0..3 {
        assert_eq!(
            send(&service, from_peer("198.51.100.1:1")).await.status(),
            StatusCode::OK,
            "shadow"
        );
    }
    rollout.set_mode(Mode::Enforce);
    assert_eq!(
        send(&service, from_peer("198.51.100.1:1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    rollout.set_mode(Mode::Off);
    let entries = store.len();
    for _ in 0..3 {
        assert_eq!(
            send(&service, from_peer("198.51.100.9:1")).await.status(),
            StatusCode::OK,
            "kill switch"
        );
    }
    assert_eq!(store.len(), entries, "no store call while off");
}

#[tokio::test]
async fn lists_match_the_exact_resolved_client_address() {
    // Regression: lists saw the /64-grouped address for IP clients (a denylisted
    // 2001:db8::5 was admitted, a single allowlisted IPv6 address allowlisted its /64) and the
    // raw socket peer for keyed clients (an allowlisted load balancer range let every keyed
    // client through; an IP denylist never matched a keyed client behind it).
    use floodgate::lists::ClientList;
    let store = MemoryStore::new();
    let identifier = DefaultIdentifier::new()
        .trusted_proxies(["10.0.0.0/8"])
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .store(store.clone())
        .identify(identifier)
        .allowlist(
            ClientList::new()
                .ip("10.0.0.0/8".parse().unwrap())
                .ip("2001:db8::7/128".parse().unwrap()),
        )
        .denylist(ClientList::new().ip("2001:db8::5/128".parse().unwrap()))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));

    let denied = send(&service, from_peer("[2001:db8::5]:1")).await;
    assert_eq!(
        denied.status(),
        StatusCode::FORBIDDEN,
        "exact address denied"
    );
    let neighbour = send(&service, from_peer("[2001:db8::6]:1")).await;
    assert_eq!(
        neighbour.status(),
        StatusCode::OK,
        "its /64 neighbour is not"
    );
    assert!(
        neighbour.headers().contains_key("x-ratelimit-limit"),
        "and is not allowlisted either: the allowlisted 2001:db8::7 is one address"
    );

    // A keyed client behind the (allowlisted) proxy range is limited by its own address.
    let behind_proxy = || {
        from_peer("10.0.0.1:1")
            .header("x-forwarded-for", "198.51.100.9")
            .header("x-api-key", "client-key")
    };
    assert_eq!(
        send(&service, behind_proxy()).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, behind_proxy()).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the proxy's allowlisted range does not stand for the clients behind it"
    );
    let denied_behind_proxy = send(
        &service,
        from_peer("10.0.0.1:1")
            .header("x-forwarded-for", "2001:db8::5")
            .header("x-api-key", "other-key"),
    )
    .await;
    assert_eq!(
        denied_behind_proxy.status(),
        StatusCode::FORBIDDEN,
        "an IP denylist matches a keyed client behind a trusted proxy"
    );
}

#[tokio::test]
async fn unverified_api_keys_fall_back_to_the_client_address() {
    // Regression: invented API keys each got a fresh budget; with a verification hook they
    // are treated as absent and the client is limited by IP.
    let identifier = DefaultIdentifier::new().verify_api_key(|key: &str| key == "issued-key");
    let layer = RateLimitLayer::builder()
        .limit(per_second(2))
        .identify(identifier)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let statuses: Vec<u16> = statuses_of(
        &service,
        (0..4).map(|n| from_peer("198.51.100.1:1").header("x-api-key", format!("invented-{n}"))),
    )
    .await;
    assert_eq!(statuses, [200, 200, 429, 429]);
    let issued = send(
        &service,
        from_peer("198.51.100.1:1").header("x-api-key", "issued-key"),
    )
    .await;
    assert_eq!(
        issued.status(),
        StatusCode::OK,
        "a known key has its own budget"
    );
}

async fn statuses_of<S, B>(
    service: &S,
    requests: impl Iterator<Item = http::request::Builder>,
) -> Vec<u16>
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible> + Clone,
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let mut statuses = Vec::new();
    for request in requests {
        statuses.push(send(service, request).await.status().as_u16());
    }
    statuses
}

#[tokio::test]
async fn unidentified_clients_are_counted_and_can_be_rejected() {
    // Regression: requests without a peer address all shared one budget in silence. By
    // default they still pass; `UnknownIdentity::Reject` refuses them (500, client_unidentified).
    let shared = RateLimitLayer::builder()
        .limit(per_second(5))
        .build()
        .unwrap()
        .layer(service_fn(ok_handler));
    let no_peer = || Request::builder().uri("/v1/things");
    assert_eq!(send(&shared, no_peer()).await.status(), StatusCode::OK);

    let strict = RateLimitLayer::builder()
        .limit(per_second(5))
        .on_unknown_identity(floodgate::service::UnknownIdentity::Reject)
        .build()
        .unwrap()
        .layer(service_fn(ok_handler));
    let rejected = send(&strict, no_peer()).await;
    assert_eq!(rejected.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        json(&rejected),
        serde_json::json!({"error": "client_unidentified"})
    );
    assert_eq!(
        send(&strict, from_peer("198.51.100.1:1")).await.status(),
        StatusCode::OK,
        "identified clients are unaffected"
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
async fn concurrency_denials_can_promise_a_short_retry() {
    // Regression: a concurrency 429 said `Retry-After: 34` (the 30 s lease lifetime plus
    // jitter) for streams that end in seconds. The bound stays the default; a hint shortens it.
    let limit = || {
        Limit::builder("in-flight")
            .algorithm(Algorithm::Concurrency)
            .limit(1)
            .build()
            .unwrap()
    };
    let held = |hint: Option<Duration>| {
        let builder = RateLimitLayer::builder()
            .limit(limit())
            .retry_after_jitter(0.0);
        let builder = match hint {
            Some(hint) => builder.concurrency_retry_hint(hint),
            None => builder,
        };
        // Responses whose bodies never end (their senders are kept) hold their leases.
        let senders = Arc::new(std::sync::Mutex::new(Vec::new()));
        builder
            .build()
            .unwrap()
            .layer(service_fn(move |_request: Request<()>| {
                let (sender, receiver) = tokio::sync::mpsc::channel::<Bytes>(1);
                senders.lock().unwrap().push(sender);
                async move { Ok::<_, Infallible>(Response::new(ChannelBody(receiver))) }
            }))
    };
    for (hint, expected) in [(None, "30"), (Some(Duration::from_secs(2)), "2")] {
        let service = held(hint);
        let first = service
            .clone()
            .oneshot(from_peer("203.0.113.7:1").body(()).unwrap())
            .await
            .unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        let second = service
            .clone()
            .oneshot(from_peer("203.0.113.7:1").body(()).unwrap())
            .await
            .unwrap();
        assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(second.headers()["retry-after"], expected, "hint {hint:?}");
        drop(first);
    }
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

#[tokio::test]
async fn one_identifier_serves_several_layers() {
    // Regression: DefaultIdentifier was not Clone and `Arc<T>` was no identifier, so a per-route
    // limit keyed like the global one needed a second identifier built the same way.
    let identifier = Arc::new(
        DefaultIdentifier::new()
            .trusted_proxies(["10.0.0.0/8"])
            .unwrap(),
    );
    let global = RateLimitLayer::builder()
        .limit(per_second(10))
        .identify(identifier.clone())
        .build()
        .unwrap();
    let login = RateLimitLayer::builder()
        .limit(Limit::fixed_window("login", 1, Duration::from_secs(60)).unwrap())
        .rule("login")
        .identify(identifier.clone())
        .build()
        .unwrap();
    let cloned = RateLimitLayer::builder()
        .limit(per_second(10))
        .identify(DefaultIdentifier::clone(&identifier))
        .build()
        .unwrap();
    let service = cloned.layer(global.layer(login.layer(service_fn(ok_handler))));
    let behind_proxy = || from_peer("10.0.0.1:1").header("x-forwarded-for", "198.51.100.40");
    assert_eq!(
        send(&service, behind_proxy()).await.status(),
        StatusCode::OK
    );
    let denied = send(&service, behind_proxy()).await;
    assert_eq!(
        denied.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the client, not the proxy"
    );
    assert_eq!(
        send(
            &service,
            from_peer("10.0.0.1:1").header("x-forwarded-for", "198.51.100.41")
        )
        .await
        .status(),
        StatusCode::OK,
        "another client behind the same proxy"
    );
}
