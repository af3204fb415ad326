//! Sentinel failover under load: one master, one replica, three sentinels (quorum 2,
//! `down-after-milliseconds` 1000). The master is killed (or frozen: a host gone silent, its
//! connections left open) while requests flow through the layer; meanwhile the failure policy
//! answers (here `closed`: 503), and within 10 s the store decides again, on the promoted
//! replica.

use floodgate_test_support as support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use floodgate::store::RedisStore;
use floodgate::{FailurePolicy, Limit, PeerAddr, RateLimitLayer, service::RateLimitBody};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use support::{SENTINEL_MASTER, SentinelGroup};
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt, service_fn};

type Service = BoxCloneSyncService<Request<()>, Response<RateLimitBody<Full<Bytes>>>, Infallible>;

async fn send(service: &Service, client: &str) -> StatusCode {
    let addr: SocketAddr = format!("{client}:1000").parse().unwrap();
    let request = Request::builder()
        .extension(PeerAddr(addr))
        .body(())
        .unwrap();
    let response = service.clone().oneshot(request).await.unwrap();
    let status = response.status();
    response.into_body().collect().await.unwrap();
    status
}

/// How the master is lost.
#[derive(Clone, Copy, Debug)]
enum Loss {
    /// SIGKILL: its connections close at once.
    Killed,
    /// SIGSTOP: it answers nothing and closes nothing (a frozen or vanished host), so the store
    /// must notice the silence itself before it asks the sentinels again.
    Frozen,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_the_promoted_replica_within_ten_seconds() {
    follows_the_promoted_replica(Loss::Killed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_leaves_a_frozen_master_for_the_promoted_replica_within_ten_seconds() {
    follows_the_promoted_replica(Loss::Frozen).await;
}

async fn follows_the_promoted_replica(loss: Loss) {
    let mut group = SentinelGroup::start();
    let store = RedisStore::sentinel(SENTINEL_MASTER, group.sentinel_urls())
        .timeout(Duration::from_millis(200))
        .breaker(3, Duration::from_millis(300))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(Limit::fixed_window("per-hour", 3, Duration::from_secs(3600)).unwrap())
        .store(store)
        .on_store_error(FailurePolicy::Closed)
        .build()
        .unwrap();
    let service: Service =
        BoxCloneSyncService::new(layer.layer(service_fn(|_request: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        })));

    // Enforced on the first master.
    let statuses: Vec<StatusCode> = futures_in_order(&service, "10.0.0.1", 4).await;
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let first_master = group.master.port();
    assert_eq!(group.current_master_port(), Some(first_master));

    match loss {
        Loss::Killed => group.master.kill(),
        Loss::Frozen => group.master.freeze(),
    }
    let killed_at = Instant::now();
    // Load continues: each new client is one request; while the store is gone every answer
    // is the policy's 503, never a hang or a 500.
    let mut client = 0u32;
    let mut unavailable = 0u32;
    let resumed_after = loop {
        client += 1;
        let status = send(&service, &format!("10.1.{}.{}", client / 250, client % 250)).await;
        match status {
            StatusCode::OK => break killed_at.elapsed(),
            StatusCode::SERVICE_UNAVAILABLE => unavailable += 1,
            other => panic!("unexpected {other} during failover"),
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(10),
            "{loss:?}: enforcement did not resume within 10 s ({unavailable} answered by the \
             policy)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        unavailable > 0,
        "the failure policy answered while no master was elected"
    );
    let promoted = group.current_master_port();
    assert_eq!(
        promoted,
        Some(group.replica.port()),
        "the replica was promoted"
    );

    // Enforcement on the new master: a fresh client gets exactly its 3.
    let statuses = futures_in_order(&service, "10.0.0.2", 4).await;
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    eprintln!(
        "failover ({loss:?}): store decided again {resumed_after:?} after the master was lost; \
         {unavailable} requests answered by the policy meanwhile"
    );
}

async fn futures_in_order(service: &Service, client: &str, count: usize) -> Vec<StatusCode> {
    let mut statuses = Vec::with_capacity(count);
    for _ in 0..count {
        statuses.push(send(service, client).await);
    }
    statuses
}
