//! The store fails: redis-server killed mid-run, paused beyond the deadline (`CLIENT PAUSE`),
//! then restarted. Each failure policy is held to SPEC §4, and nothing hangs or is lost.
//!
//! Timing bounds: the deadline is 50ms and calls must fail within deadline + 10ms; breaker
//! rejections within 1ms. Recovery is polled every 10ms up to open_for + 1s.

use floodgate_test_support as support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use floodgate::store::RedisStore;
use floodgate::store::resilience::BreakerState;
use floodgate::{
    FailurePolicy, Limit, PeerAddr, RateLimitLayer, Store, StoreError, service::RateLimitBody,
    store::Check,
};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use support::RedisServer;
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt, service_fn};

const DEADLINE: Duration = Duration::from_millis(50);
const SLACK: Duration = Duration::from_millis(10);
const OPEN_FOR: Duration = Duration::from_millis(500);

type Service = BoxCloneSyncService<Request<()>, Response<RateLimitBody<Full<Bytes>>>, Infallible>;

/// A store whose every decision is a call: these tests are about calls that fail. (A node's
/// memory of denials would deny the over-limit client below without a call until it notices
/// the lost server; `deny_cache.rs` tests that.)
fn store(server: &RedisServer) -> RedisStore {
    RedisStore::builder(server.url())
        .timeout(DEADLINE)
        .breaker(5, OPEN_FOR)
        .deny_cache(false)
        .build()
        .unwrap()
}

fn service(store: RedisStore, policy: FailurePolicy, limit: Limit) -> Service {
    let layer = RateLimitLayer::builder()
        .limit(limit)
        .store(store)
        .on_store_error(policy)
        .build()
        .unwrap();
    BoxCloneSyncService::new(layer.layer(service_fn(|_request: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
    })))
}

/// An hour's window: the tests here run for seconds (a server killed and restarted), and a
/// window aligned to the epoch that ended mid-test would restart its count.
fn per_hour(limit: u64) -> Limit {
    Limit::fixed_window("per-hour", limit, Duration::from_secs(3600)).unwrap()
}

async fn send(service: &Service, client: &str) -> Response<Bytes> {
    let addr: SocketAddr = format!("{client}:1000").parse().unwrap();
    let request = Request::builder()
        .extension(PeerAddr(addr))
        .body(())
        .unwrap();
    let response = service.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Response::from_parts(parts, body.collect().await.unwrap().to_bytes())
}

/// Whether the store decided (its decisions carry rate limit headers; fail-open ones do not).
fn store_decided(response: &Response<Bytes>) -> bool {
    response.headers().contains_key("x-ratelimit-remaining")
}

/// Polls until the store decides again; returns how long that took.
async fn time_to_recover(service: &Service, client: &str) -> Duration {
    let started = Instant::now();
    while !store_decided(&send(service, client).await) {
        assert!(
            started.elapsed() < OPEN_FOR + Duration::from_secs(5),
            "never recovered"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    started.elapsed()
}

fn check(limit: &Arc<Limit>) -> [Check; 1] {
    [Check::new("fg:{ip:probe}:r:x", limit.clone(), 1)]
}

async fn timed(
    store: &RedisStore,
    checks: &[Check],
) -> (Result<floodgate::Decision, StoreError>, Duration) {
    let started = Instant::now();
    let result = store.check_and_consume(checks, None).await;
    (result, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_admits_within_the_deadline_then_enforcement_resumes() {
    let mut server = RedisServer::start();
    let redis = store(&server);
    let service = service(redis.clone(), FailurePolicy::Open, per_hour(3));
    for _ in 0..3 {
        assert_eq!(send(&service, "203.0.113.1").await.status(), StatusCode::OK);
    }
    assert_eq!(
        send(&service, "203.0.113.1").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    server.kill();
    for _ in 0..10 {
        let started = Instant::now();
        let response = send(&service, "203.0.113.1").await;
        let latency = started.elapsed();
        assert_eq!(response.status(), StatusCode::OK, "fail open");
        assert!(
            !store_decided(&response),
            "no made-up numbers while failing open"
        );
        assert!(latency <= DEADLINE + SLACK, "{latency:?}");
    }
    assert_eq!(redis.guard().state(), BreakerState::Open);
    // Open breaker: an answer in under 1ms, without a call to the (dead) server.
    let limit = Arc::new(per_hour(3));
    let (result, elapsed) = timed(&redis, &check(&limit)).await;
    assert!(matches!(result, Err(StoreError::BreakerOpen)), "{result:?}");
    assert!(elapsed < Duration::from_millis(1), "{elapsed:?}");

    server.restart();
    let recovery = time_to_recover(&service, "203.0.113.2").await;
    assert!(
        recovery <= OPEN_FOR + Duration::from_secs(1),
        "{recovery:?}"
    );
    // Enforced again (the restarted server kept no counters, so the budget starts afresh).
    for _ in 0..2 {
        assert_eq!(send(&service, "203.0.113.2").await.status(), StatusCode::OK);
    }
    assert_eq!(
        send(&service, "203.0.113.2").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_costs_at_most_the_deadline() {
    let server = RedisServer::start();
    let redis = store(&server);
    let limit = Arc::new(per_hour(100));
    assert!(timed(&redis, &check(&limit)).await.0.is_ok());

    let _: () = server.command(&["CLIENT", "PAUSE", "1000", "ALL"]);
    for _ in 0..5 {
        let (result, elapsed) = timed(&redis, &check(&limit)).await;
        assert!(matches!(result, Err(StoreError::Timeout(_))), "{result:?}");
        assert!(
            elapsed >= DEADLINE && elapsed <= DEADLINE + SLACK,
            "{elapsed:?}"
        );
    }
    assert_eq!(redis.guard().state(), BreakerState::Open);
    let (result, elapsed) = timed(&redis, &check(&limit)).await;
    assert!(matches!(result, Err(StoreError::BreakerOpen)));
    assert!(elapsed < Duration::from_millis(1), "{elapsed:?}");

    // The pause ends after 1s; the probe after open_for then succeeds.
    let service = service(redis.clone(), FailurePolicy::Open, per_hour(100));
    let recovery = time_to_recover(&service, "203.0.113.3").await;
    assert!(
        recovery <= Duration::from_secs(1) + OPEN_FOR + Duration::from_secs(1),
        "{recovery:?}"
    );
    assert_eq!(redis.guard().state(), BreakerState::Closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_answers_503_while_the_store_is_down() {
    let mut server = RedisServer::start();
    let service = service(store(&server), FailurePolicy::Closed, per_hour(3));
    assert_eq!(send(&service, "203.0.113.1").await.status(), StatusCode::OK);
    server.kill();
    for _ in 0..8 {
        let response = send(&service, "203.0.113.1").await;
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()["retry-after"], "1");
        assert_eq!(response.body(), r#"{"error":"rate_limiter_unavailable"}"#);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_enforces_the_fallback_limits() {
    let mut server = RedisServer::start();
    let redis = store(&server);
    let layer = RateLimitLayer::builder()
        .limit(per_hour(6))
        .store(redis)
        .on_store_error(FailurePolicy::Local)
        .fallback_share(0.5)
        .build()
        .unwrap();
    let service: Service =
        BoxCloneSyncService::new(layer.layer(service_fn(|_request: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        })));
    server.kill();
    // 6 per minute × 0.5 on this node alone: 3, then denied, by the in-memory fallback.
    let statuses: Vec<u16> = {
        let mut statuses = Vec::new();
        for _ in 0..5 {
            statuses.push(send(&service, "203.0.113.9").await.status().as_u16());
        }
        statuses
    };
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    let limited = send(&service, "203.0.113.9").await;
    assert_eq!(
        limited.headers()["x-ratelimit-limit"],
        "3",
        "the scaled limit is reported"
    );
    assert_eq!(
        send(&service, "203.0.113.10").await.status(),
        StatusCode::OK,
        "per client"
    );
}

/// Four clients send without pause while the server is killed and restarted: every request
/// gets an answer (200 or 429), none errors, no task hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_is_lost_across_a_crash_and_restart() {
    let mut server = RedisServer::start();
    let service = service(store(&server), FailurePolicy::Open, per_hour(1_000_000));
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..4)
        .map(|client| {
            let (service, stop, answered) = (service.clone(), stop.clone(), answered.clone());
            tokio::spawn(async move {
                let address = format!("198.51.100.{client}");
                let mut statuses = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let status = send(&service, &address).await.status();
                    statuses.push(status);
                    answered.fetch_add(1, Ordering::Relaxed);
                    // Real requests arrive through sockets, which make a task yield; without
                    // this, fail-open answers are so immediate that these loops would starve
                    // the runtime (and the store's reconnection) of its two threads.
                    tokio::task::yield_now().await;
                }
                statuses
            })
        })
        .collect();
    let wait_for = |count: u64| {
        let answered = answered.clone();
        async move {
            while answered.load(Ordering::Relaxed) < count {
                tokio::task::yield_now().await;
            }
        }
    };
    wait_for(200).await;
    server.kill();
    let at_kill = answered.load(Ordering::Relaxed);
    wait_for(at_kill + 200).await;
    server.restart();
    let recovery = time_to_recover(&service, "198.51.100.200").await;
    assert!(
        recovery <= OPEN_FOR + Duration::from_secs(1),
        "{recovery:?}"
    );
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    for client in clients {
        let statuses = tokio::time::timeout(Duration::from_secs(10), client)
            .await
            .expect("no client hangs")
            .expect("no client panics");
        assert!(
            statuses.iter().all(|status| *status == StatusCode::OK),
            "{statuses:?}"
        );
        total += statuses.len();
    }
    assert!(total >= 400, "{total} answered");
}

/// SPEC §3: an error that is the script's or the data's repeats on every call, however often it
/// is retried; it is not transient and never opens the breaker, so that one corrupted key cannot
/// take the limiter down for every client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_error_is_not_transient_and_never_opens_the_breaker() {
    let server = RedisServer::start();
    let redis = store(&server);
    let bucket = Arc::new(Limit::token_bucket("x", 10, Duration::from_secs(1)).unwrap());
    // A token bucket's hash whose level is no number: the script fails on it.
    let _: () = server.command(&["HSET", "fg:{ip:probe}:r:x", "l", "garbage", "u", "5"]);
    for call in 0..20 {
        let (result, _) = timed(&redis, &check(&bucket)).await;
        let error = result.expect_err("a Lua error on corrupted data");
        assert!(!error.is_transient(), "call {call}: {error}");
    }
    assert_eq!(redis.guard().state(), BreakerState::Closed);
    let other = [Check::new("fg:{ip:other}:r:x", bucket.clone(), 1)];
    let (result, _) = timed(&redis, &other).await;
    assert!(result.expect("other identities are decided").is_allowed());
}

/// A connection gone silent for good, the server being fine (a host whose network state was
/// lost: nothing answers and nothing closes, and the kernel would retransmit for about fifteen
/// minutes before calling it dead). Decisions fail at their deadline, and once calls have gone
/// unanswered for a second (four deadlines, at least a second: SPEC §4) the store gives the
/// connection up; the breaker's next probe then decides on a new one. Bound: 10 s against about
/// 1.5 s expected (the silence, then the breaker's `OPEN_FOR`), for a loaded machine.
async fn a_silent_connection_is_given_up(mode: floodgate::store::ConnectionMode) {
    let server = RedisServer::start();
    let proxy = support::faults::FaultProxy::start(server.port());
    let store = RedisStore::builder(proxy.url())
        .connection_mode(mode)
        .timeout(DEADLINE)
        .breaker(5, OPEN_FOR)
        .deny_cache(false)
        .build()
        .unwrap();
    let limit = Arc::new(per_hour(1_000));
    let checks = check(&limit);
    let remaining = |decision: &floodgate::Decision| decision.limits()[0].remaining;
    let first = store.check_and_consume(&checks, None).await.unwrap();
    assert_eq!(remaining(&first), 999);
    let connections = proxy.connections_accepted();

    proxy.set(support::faults::Fault::Strand);
    let (result, took) = timed(&store, &checks).await;
    assert!(
        matches!(result, Err(StoreError::Timeout(_))),
        "the silent connection fails at the deadline: {result:?}"
    );
    assert!(took < DEADLINE + SLACK * 5, "{took:?}");
    let stranded_at = Instant::now();
    let mut failed = 1;
    let decided = loop {
        match store.check_and_consume(&checks, None).await {
            Ok(decision) => break decision,
            Err(_) => failed += 1,
        }
        assert!(
            stranded_at.elapsed() < Duration::from_secs(10),
            "{mode:?}: no decision within 10 s of the connection going silent ({failed} \
             failed): the store kept calling on it"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        proxy.connections_accepted() > connections,
        "decided on a new connection"
    );
    // Nothing sent on the silent connection reached Redis: the count goes on from one.
    assert_eq!(remaining(&decided), 998, "{mode:?}");
    eprintln!(
        "{mode:?}: decided again {:?} after the connection went silent ({failed} calls failed)",
        stranded_at.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_multiplexed_connection_is_given_up_for_a_new_one() {
    a_silent_connection_is_given_up(floodgate::store::ConnectionMode::Multiplexed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_pooled_connection_is_given_up_for_a_new_one() {
    a_silent_connection_is_given_up(floodgate::store::ConnectionMode::Pool(2)).await;
}
