//! Estimates a client cannot lowball (SPEC §9, issue 45): a route charged from the client's
//! `x-max-tokens` and settled against the upstream's `x-tokens-used`, with `estimate_max` 100.
//! Whatever estimate a client sends, however many requests it keeps open and however it
//! leaves, what it is served in a window stays within the limit plus one `estimate_max`;
//! an honest client (estimate at least its real cost) pays its real cost and no more.
//!
//! One body per case, run on the memory store (a fake clock), on Redis exact and on Redis
//! batched (Redis's clock: the windows are 30 days long, and the tests take seconds).

use crate::common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use floodgate::calendar::{CalendarPeriod, Period};
use floodgate::post_charge::{CostHeader, EstimateHeader};
use floodgate::store::RedisStore;
use floodgate::store::batched::BatchedStore;
use floodgate::{Algorithm, Limit, MemoryStore, PeerAddr, RateLimitLayer, Store, time::FakeClock};
use floodgate_test_support::RedisServer;
use http::{HeaderName, Request, Response, StatusCode};
use http_body_util::BodyExt as _;
use tower::{Layer, ServiceExt as _, service_fn};

const MAX_TOKENS: HeaderName = HeaderName::from_static("x-max-tokens");
const TOKENS_USED: HeaderName = HeaderName::from_static("x-tokens-used");
/// The route's `estimate_max`.
const ESTIMATE_MAX: u64 = 100;
const LIMIT: u64 = 1_000;
/// Long enough that no window of a Redis test ends while it runs.
const WINDOW: Duration = Duration::from_secs(30 * 86_400);

/// A store to run a case on, with what keeps it alive.
struct Backend {
    store: Arc<dyn Store>,
    _redis: Option<RedisServer>,
}

fn memory() -> Backend {
    let clock = FakeClock::new(common::START);
    Backend {
        store: Arc::new(MemoryStore::builder().clock(clock).build()),
        _redis: None,
    }
}

fn redis_store(server: &RedisServer) -> RedisStore {
    RedisStore::builder(server.url())
        .timeout(Duration::from_secs(5))
        .build()
        .expect("store")
}

fn redis() -> Backend {
    let server = RedisServer::start();
    Backend {
        store: Arc::new(redis_store(&server)),
        _redis: Some(server),
    }
}

fn batched() -> Backend {
    let server = RedisServer::start();
    Backend {
        store: Arc::new(BatchedStore::builder(redis_store(&server)).build()),
        _redis: Some(server),
    }
}

fn fixed_window() -> Limit {
    Limit::fixed_window("tokens", LIMIT, WINDOW).unwrap()
}

fn calendar_month() -> Limit {
    Limit::builder("tokens")
        .algorithm(Algorithm::FixedWindow)
        .limit(LIMIT)
        .calendar(CalendarPeriod::new(Period::Month, "UTC").unwrap())
        .build()
        .unwrap()
}

/// 1,000 a month: it refills less than a unit while a test runs.
fn token_bucket() -> Limit {
    Limit::token_bucket("tokens", LIMIT, WINDOW).unwrap()
}

fn layer(backend: &Backend, limit: Limit) -> RateLimitLayer {
    RateLimitLayer::builder()
        .limit(limit)
        .shared_store(backend.store.clone())
        .cost(EstimateHeader::new(MAX_TOKENS, ESTIMATE_MAX).default(1))
        .charge_from_response(CostHeader::new(TOKENS_USED))
        .retry_after_jitter(0.0)
        .build()
        .unwrap()
}

fn client(key: &str, estimate: u64) -> Request<()> {
    let peer: SocketAddr = "203.0.113.9:4000".parse().unwrap();
    Request::builder()
        .uri("/v1/completions")
        .header("x-api-key", key)
        .header(&MAX_TOKENS, estimate.to_string())
        .extension(PeerAddr(peer))
        .body(())
        .unwrap()
}

/// Units `key` has used of its 1,000, read without consuming.
async fn used(layer: &RateLimitLayer, key: &str) -> u64 {
    let look = layer.peek(&client(key, 1)).await.unwrap().unwrap();
    LIMIT - look.limits()[0].remaining
}

/// A streamed completion: two data frames, then (when `used` is given) the tokens it used in
/// its trailers. No known length: its end is a stream's.
struct Streamed {
    frames: std::collections::VecDeque<http_body::Frame<Bytes>>,
}

impl Streamed {
    fn new(used: Option<u64>) -> Streamed {
        let mut frames: std::collections::VecDeque<_> = [
            http_body::Frame::data(Bytes::from_static(b"data: one\n\n")),
            http_body::Frame::data(Bytes::from_static(b"data: two\n\n")),
        ]
        .into();
        if let Some(used) = used {
            let mut trailers = http::HeaderMap::new();
            trailers.insert(TOKENS_USED, used.into());
            frames.push_back(http_body::Frame::trailers(trailers));
        }
        Streamed { frames }
    }
}

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        std::task::Poll::Ready(self.frames.pop_front().map(Ok))
    }
}

/// An upstream that streams and reports `used` in its trailers (or never, with `None`).
fn streaming(
    layer: &RateLimitLayer,
    used: Option<u64>,
) -> impl tower::Service<
    Request<()>,
    Response = Response<floodgate::service::RateLimitBody<Streamed>>,
    Error = Infallible,
    Future: Send,
> + Clone
+ Send
+ 'static {
    layer.layer(service_fn(move |_: Request<()>| async move {
        Ok::<_, Infallible>(Response::new(Streamed::new(used)))
    }))
}

/// An upstream that reports `used` in its response's head.
fn reporting(
    layer: &RateLimitLayer,
    used: u64,
) -> impl tower::Service<
    Request<()>,
    Response = Response<floodgate::service::RateLimitBody<http_body_util::Full<Bytes>>>,
    Error = Infallible,
> + Clone {
    layer.layer(service_fn(move |_: Request<()>| async move {
        let mut response = Response::new(http_body_util::Full::new(Bytes::from_static(b"ok")));
        response.headers_mut().insert(TOKENS_USED, used.into());
        Ok::<_, Infallible>(response)
    }))
}

/// Spends `units` of `key`'s limit honestly (its estimate is what it uses).
async fn spend(layer: &RateLimitLayer, key: &str, units: u64) {
    let response = reporting(layer, units)
        .oneshot(client(key, units))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    response.into_body().collect().await.unwrap();
}

/// Issue 45, item 1: a client that sends `x-max-tokens: 1`, reads the whole streamed body and
/// leaves before the trailer is served 100 each time; until denied, it is served no more than
/// the limit plus one `estimate_max`, and each request it left is charged `estimate_max`.
async fn a_client_that_leaves_before_the_trailer_pays_estimate_max(backend: Backend) {
    let layer = layer(&backend, fixed_window());
    let upstream = streaming(&layer, Some(100));
    let mut served = 0;
    for _ in 0..2 * LIMIT {
        let response = upstream.clone().oneshot(client("leaver", 1)).await.unwrap();
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            break;
        }
        assert_eq!(response.status(), StatusCode::OK);
        let mut body = response.into_body();
        body.frame().await.unwrap().unwrap();
        body.frame().await.unwrap().unwrap();
        // The whole completion, and gone before its trailer.
        drop(body);
        served += 100;
        if served == 100 {
            assert_eq!(
                used(&layer, "leaver").await,
                ESTIMATE_MAX,
                "a request never settled is charged estimate_max"
            );
        }
    }
    assert!(
        served <= LIMIT + ESTIMATE_MAX,
        "served {served} in one window of {LIMIT}"
    );
}

/// Issue 45, item 1: an upstream that never sends the trailer; the client reads to the end.
async fn an_upstream_that_never_reports_leaves_estimate_max_charged(backend: Backend) {
    let layer = layer(&backend, fixed_window());
    let upstream = streaming(&layer, None);
    let mut served = 0;
    for _ in 0..2 * LIMIT {
        let response = upstream.clone().oneshot(client("silent", 1)).await.unwrap();
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            break;
        }
        response.into_body().collect().await.unwrap();
        served += 100;
        if served == 100 {
            assert_eq!(used(&layer, "silent").await, ESTIMATE_MAX);
        }
    }
    assert!(
        served <= LIMIT + ESTIMATE_MAX,
        "served {served} in one window of {LIMIT}"
    );
}

/// Issue 45, item 2: 10 units left; `in_flight` streams estimated at 1 that each really cost
/// 100 are opened together, all admitted before any is settled. What the window serves stays
/// within the limit plus one `estimate_max`.
async fn lowballed_requests_in_flight_together(backend: Backend, limit: Limit, in_flight: u64) {
    let layer = layer(&backend, limit);
    spend(&layer, "lowballer", LIMIT - 10).await;
    assert_eq!(used(&layer, "lowballer").await, LIMIT - 10);
    let upstream = streaming(&layer, Some(100));
    let heads = futures_util::future::join_all(
        (0..in_flight).map(|_| upstream.clone().oneshot(client("lowballer", 1))),
    )
    .await;
    let mut served = LIMIT - 10;
    let mut bodies = Vec::new();
    for head in heads {
        let response = head.unwrap();
        if response.status() == StatusCode::OK {
            served += 100;
            bodies.push(response.into_body());
        }
    }
    for body in bodies {
        body.collect().await.unwrap();
    }
    assert!(
        served <= LIMIT + ESTIMATE_MAX,
        "{in_flight} lowballed requests in flight: served {served} in one window of {LIMIT}"
    );
}

/// An honest client (its estimate at least what it uses) pays what it uses, reported in the
/// head or in the trailers, and no more.
async fn an_honest_client_pays_its_real_cost(backend: Backend, limit: Limit) {
    let layer = layer(&backend, limit);
    let mut real = 0;
    for (estimate, cost) in [(80, 30), (100, 100), (5, 5), (60, 0), (9_999, 100)] {
        let response = reporting(&layer, cost)
            .oneshot(client("honest", estimate))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        response.into_body().collect().await.unwrap();
        real += cost;
        assert_eq!(
            used(&layer, "honest").await,
            real,
            "estimated {estimate}, used {cost}"
        );
    }
    // Reported in the trailers: settled when the stream ends (in the background on Redis).
    let response = streaming(&layer, Some(40))
        .oneshot(client("honest", 50))
        .await
        .unwrap();
    response.into_body().collect().await.unwrap();
    real += 40;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while used(&layer, "honest").await != real && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        used(&layer, "honest").await,
        real,
        "settled from the trailers"
    );
}

macro_rules! on_every_store {
    ($($name:ident => |$backend:ident| $body:expr;)*) => {
        mod on_memory {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let $backend = memory();
                $body.await
            })*
        }
        mod on_redis {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let $backend = redis();
                $body.await
            })*
        }
        mod on_redis_batched {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let $backend = batched();
                $body.await
            })*
        }
    };
}

on_every_store! {
    a_client_that_leaves_before_the_trailer => |backend|
        a_client_that_leaves_before_the_trailer_pays_estimate_max(backend);
    an_upstream_that_never_sends_the_trailer => |backend|
        an_upstream_that_never_reports_leaves_estimate_max_charged(backend);
    ten_lowballed_in_a_fixed_window => |backend|
        lowballed_requests_in_flight_together(backend, fixed_window(), 10);
    a_hundred_lowballed_in_a_fixed_window => |backend|
        lowballed_requests_in_flight_together(backend, fixed_window(), 100);
    ten_lowballed_in_a_calendar_month => |backend|
        lowballed_requests_in_flight_together(backend, calendar_month(), 10);
    a_hundred_lowballed_in_a_calendar_month => |backend|
        lowballed_requests_in_flight_together(backend, calendar_month(), 100);
    ten_lowballed_in_a_token_bucket => |backend|
        lowballed_requests_in_flight_together(backend, token_bucket(), 10);
    a_hundred_lowballed_in_a_token_bucket => |backend|
        lowballed_requests_in_flight_together(backend, token_bucket(), 100);
    an_honest_client_in_a_fixed_window => |backend|
        an_honest_client_pays_its_real_cost(backend, fixed_window());
    an_honest_client_in_a_calendar_month => |backend|
        an_honest_client_pays_its_real_cost(backend, calendar_month());
    an_honest_client_in_a_token_bucket => |backend|
        an_honest_client_pays_its_real_cost(backend, token_bucket());
}
