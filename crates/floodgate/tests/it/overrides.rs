//! Per-client overrides through the layer (`RateLimitLayer::set_override` and friends): set
//! on one node, in force on another node of the same store within a second, expiring by
//! themselves, removed at once; on the memory store, one Redis, a cluster and sharded Redis.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use floodgate::overrides::{OverrideError, OverrideSpec, Overrides};
use floodgate::store::RedisStore;
use floodgate::{Limit, PeerAddr, RateLimitLayer, Store};
use floodgate_test_support::{RedisCluster, ServedStore};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{Layer, ServiceExt, service_fn};

fn client(key: &str) -> Request<()> {
    let peer: SocketAddr = "203.0.113.9:4000".parse().unwrap();
    Request::builder()
        .uri("/v1/things")
        .header("x-api-key", key)
        .extension(PeerAddr(peer))
        .body(())
        .unwrap()
}

type Served = floodgate::RateLimit<
    tower::util::ServiceFn<
        fn(Request<()>) -> std::future::Ready<Result<Response<Full<Bytes>>, Infallible>>,
    >,
>;

fn ok(_: Request<()>) -> std::future::Ready<Result<Response<Full<Bytes>>, Infallible>> {
    std::future::ready(Ok(Response::new(Full::new(Bytes::from_static(b"ok")))))
}

/// A node: a layer with three an hour for every client, on `store`.
fn node(store: Arc<dyn Store>) -> (RateLimitLayer, Served) {
    let layer = RateLimitLayer::builder()
        .limit(Limit::fixed_window("hourly", 3, Duration::from_secs(3600)).unwrap())
        .shared_store(store)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok as fn(_) -> _));
    (layer, service)
}

/// The status and `X-RateLimit-Limit` of one request of `key`.
async fn send(service: &Served, key: &str) -> (StatusCode, u64) {
    let response = service.clone().oneshot(client(key)).await.unwrap();
    let limit = response.headers()["x-ratelimit-limit"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    (response.status(), limit)
}

/// Polls `service` with requests of `key` until one answers `status` with `limit`; how long
/// that took. Denied polls consume nothing (a fixed window counts admissions only).
async fn until(
    service: &Served,
    key: &str,
    status: StatusCode,
    limit: u64,
    within: Duration,
) -> Duration {
    let started = Instant::now();
    loop {
        let answer = send(service, key).await;
        if answer == (status, limit) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "still {answer:?} after {within:?}, waiting for {status} with limit {limit}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Node A sets, node B applies within a second; the override expires by itself; a second one
/// is removed at once on A and within a second on B. `a` and `b` are two stores (two nodes'
/// connections) on the same Redis, or the same memory store.
async fn across_nodes(a: Arc<dyn Store>, b: Arc<dyn Store>) {
    let (layer_a, service_a) = node(a);
    let (_, service_b) = node(b);
    for _ in 0..3 {
        assert_eq!(send(&service_b, "k1").await, (StatusCode::OK, 3));
    }
    assert_eq!(
        send(&service_b, "k1").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );

    let spec = OverrideSpec::new("hourly", 5, Duration::from_secs(2));
    let stored = layer_a.set_override(&client("k1"), &spec).await.unwrap();
    assert_eq!((stored.limit, stored.name.as_ref()), (5, "hourly"));
    assert_eq!(
        stored.window,
        Duration::from_secs(3600),
        "the limit's own window"
    );
    let in_force_after = until(&service_b, "k1", StatusCode::OK, 5, Duration::from_secs(3)).await;
    assert!(
        in_force_after < Duration::from_secs(1),
        "in force on the second node after {in_force_after:?}"
    );
    // The counter carried over: 3 before, 1 just now, 1 more and the override is used up.
    assert_eq!(send(&service_b, "k1").await, (StatusCode::OK, 5));
    assert_eq!(
        send(&service_b, "k1").await,
        (StatusCode::TOO_MANY_REQUESTS, 5)
    );
    assert_eq!(layer_a.overrides_of(&client("k1")).await.unwrap().len(), 1);
    // Another client is untouched.
    assert_eq!(send(&service_b, "k2").await, (StatusCode::OK, 3));

    // Expires by itself (2 s after it was set), on both nodes.
    until(
        &service_b,
        "k1",
        StatusCode::TOO_MANY_REQUESTS,
        3,
        Duration::from_secs(4),
    )
    .await;
    until(
        &service_a,
        "k1",
        StatusCode::TOO_MANY_REQUESTS,
        3,
        Duration::from_secs(2),
    )
    .await;
    assert!(
        layer_a
            .overrides_of(&client("k1"))
            .await
            .unwrap()
            .is_empty()
    );

    let long = OverrideSpec::new("hourly", 100, Duration::from_secs(3600));
    layer_a.set_override(&client("k1"), &long).await.unwrap();
    until(
        &service_b,
        "k1",
        StatusCode::OK,
        100,
        Duration::from_secs(2),
    )
    .await;
    assert!(
        layer_a
            .remove_override(&client("k1"), "hourly")
            .await
            .unwrap()
    );
    // At once on the node that removed it.
    assert_eq!(
        send(&service_a, "k1").await,
        (StatusCode::TOO_MANY_REQUESTS, 3)
    );
    let removed_after = until(
        &service_b,
        "k1",
        StatusCode::TOO_MANY_REQUESTS,
        3,
        Duration::from_secs(3),
    )
    .await;
    assert!(
        removed_after < Duration::from_secs(1),
        "removed on the second node after {removed_after:?}"
    );
    assert!(
        !layer_a
            .remove_override(&client("k1"), "hourly")
            .await
            .unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_on_the_memory_store() {
    let store: Arc<dyn Store> = Arc::new(floodgate::MemoryStore::new());
    across_nodes(store.clone(), store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_across_nodes_on_redis() {
    let served = ServedStore::start();
    let second = RedisStore::builder(served.servers[0].url())
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    across_nodes(Arc::new(served.store.clone()), Arc::new(second)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_across_nodes_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let store = || -> Arc<dyn Store> {
        Arc::new(
            RedisStore::cluster(cluster.urls())
                .timeout(Duration::from_secs(2))
                .cluster_compatible(true)
                .build()
                .unwrap(),
        )
    };
    across_nodes(store(), store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_across_nodes_on_sharded_redis() {
    let served = ServedStore::sharded(3);
    let second = floodgate::store::ShardedRedisStore::new(
        served
            .servers
            .iter()
            .map(|server| {
                let node = RedisStore::builder(server.url())
                    .timeout(Duration::from_secs(2))
                    .build()
                    .unwrap();
                (server.url(), node)
            })
            .collect(),
    )
    .unwrap();
    across_nodes(Arc::new(served.store.clone()), Arc::new(second)).await;
}

#[tokio::test]
async fn a_bad_override_is_refused_with_its_field() {
    let store: Arc<dyn Store> = Arc::new(floodgate::MemoryStore::new());
    let overrides = Arc::new(Overrides::in_memory().with_bounds(1, Duration::from_secs(60)));
    let layer = RateLimitLayer::builder()
        .limit(Limit::fixed_window("hourly", 3, Duration::from_secs(3600)).unwrap())
        .shared_store(store)
        .overrides(overrides.clone())
        .build()
        .unwrap();
    let unknown = OverrideSpec::new("daily", 5, Duration::from_secs(10));
    assert!(matches!(
        layer.set_override(&client("k1"), &unknown).await,
        Err(OverrideError::UnknownLimit(name)) if name == "daily"
    ));
    let too_long = OverrideSpec::new("hourly", 5, Duration::from_secs(61));
    let error = layer
        .set_override(&client("k1"), &too_long)
        .await
        .unwrap_err();
    assert_eq!(error.to_string(), "expires_in: must be between 1s and 60s");
    let zero = OverrideSpec::new("hourly", 0, Duration::from_secs(10));
    let error = layer.set_override(&client("k1"), &zero).await.unwrap_err();
    assert!(error.to_string().starts_with("limit:"), "{error}");
    let fine = OverrideSpec::new("hourly", 5, Duration::from_secs(10));
    layer.set_override(&client("k1"), &fine).await.unwrap();
    // The bound: one in force; another client's is refused, the same one's replaced.
    assert!(matches!(
        layer.set_override(&client("k2"), &fine).await,
        Err(OverrideError::Full(1))
    ));
    layer.set_override(&client("k1"), &fine).await.unwrap();
    assert_eq!(overrides.in_force().len(), 1);
}

/// Regression: a Redis restarted without its data started the version (a change counter)
/// again, so a node that read change 1 before the restart took the first change after it for
/// one it had seen, and kept its old copy for up to the 10 s of a full read. Each change now
/// writes a random token. The nodes refresh by hand here (no request starts their background
/// refresh), so the order is the test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_after_redis_restarts_empty_is_seen_at_the_next_refresh() {
    let mut server = floodgate_test_support::RedisServer::start();
    let store = || -> Arc<dyn Store> {
        Arc::new(
            RedisStore::builder(server.url())
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
        )
    };
    let (a, b) = (store(), store());
    let overrides =
        |store: &Arc<dyn Store>| Overrides::new(store.override_backend().unwrap(), "fg");
    let (a, b) = (overrides(&a), overrides(&b));
    let limit = Arc::new(Limit::fixed_window("hourly", 3, Duration::from_secs(3600)).unwrap());
    let check = |client: &str| {
        floodgate::store::Check::new(
            format!("fg:{{key:{client}}}:default:hourly"),
            limit.clone(),
            1,
        )
    };
    let spec = OverrideSpec::new("hourly", 30, Duration::from_secs(3600));

    a.set(&check("before"), &spec).await.unwrap();
    b.refresh().await.unwrap();
    assert!(b.in_force_for(&check("before").key).is_some());

    server.restart();
    // The first calls after the restart may find the old connections closed.
    let started = Instant::now();
    while let Err(error) = a.set(&check("after"), &spec).await {
        assert!(started.elapsed() < Duration::from_secs(5), "{error}");
    }
    while let Err(error) = b.refresh().await {
        assert!(started.elapsed() < Duration::from_secs(5), "{error}");
    }
    assert!(
        b.in_force_for(&check("after").key).is_some(),
        "the change after the restart is in the second node's copy"
    );
    assert!(
        b.in_force_for(&check("before").key).is_none(),
        "what the restarted Redis lost is out of it"
    );
}

/// A node clock that runs behind the system's.
struct Behind(Duration);

impl floodgate::time::Clock for Behind {
    fn now(&self) -> floodgate::time::Timestamp {
        let now = floodgate::time::Timestamp::now().as_micros();
        floodgate::time::Timestamp::from_micros(now - self.0.as_micros() as u64)
    }
}

/// Nodes whose clocks disagree agree on when an override ends: expiry is reckoned on Redis's
/// clock. Regression: a node whose clock ran 30 s behind stored a 2 s override that, by
/// Redis's clock and every other node's, had ended 28 s before it was set: Redis dropped it
/// at once and no other node applied it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_whose_clocks_disagree_agree_on_expiry() {
    let server = floodgate_test_support::RedisServer::start();
    let backend = || {
        RedisStore::builder(server.url())
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap()
            .override_backend()
            .unwrap()
    };
    let behind = Overrides::new(backend(), "fg").with_clock(Behind(Duration::from_secs(30)));
    let on_time = Overrides::new(backend(), "fg");
    let limit = Arc::new(Limit::fixed_window("hourly", 3, Duration::from_secs(3600)).unwrap());
    let target = floodgate::store::Check::new("fg:{key:skewed}:default:hourly", limit, 1);
    let spec = OverrideSpec::new("hourly", 30, Duration::from_secs(2));

    let stored = behind.set(&target, &spec).await.unwrap();
    let system_now = floodgate::time::Timestamp::now().as_micros();
    let left = stored.expires_at.as_micros().saturating_sub(system_now);
    // Up to 2 s, less the calls since it was set; the store's clock is estimated to within
    // half a call, hence the 50 ms of slack above.
    assert!(
        (1_000_000..=2_050_000).contains(&left),
        "ends {left} µs from now by the store's clock"
    );
    let exists: u64 = server.command(&["EXISTS", "fg:{key:skewed}:overrides"]);
    assert_eq!(exists, 1, "Redis keeps it");
    on_time.refresh().await.unwrap();
    for node in [&behind, &on_time] {
        assert!(node.in_force_for(&target.key).is_some(), "{node:?}");
    }

    // Both take it out when the store's clock passes its end (the copies are not refreshed:
    // each decides by its own reckoning). Waiting on the clock is the point here.
    let until_end = Duration::from_micros(stored.expires_at.as_micros().saturating_sub(system_now));
    tokio::time::sleep(until_end + Duration::from_millis(200)).await;
    for node in [&behind, &on_time] {
        assert!(node.in_force_for(&target.key).is_none(), "{node:?}");
    }
}

/// The memory backend, with the first full read held at a gate after it has read: a refresh
/// that read earlier finishes after one that read later.
struct HeldFirstRead {
    inner: Arc<floodgate::overrides::MemoryOverrides>,
    /// Taken by the first full read, which waits on it once it has read.
    gate: std::sync::Mutex<Option<Arc<tokio::sync::Notify>>>,
    /// Signalled once the first full read has read, and waits.
    read: Arc<tokio::sync::Notify>,
}

impl floodgate::overrides::OverrideBackend for HeldFirstRead {
    fn put<'a>(
        &'a self,
        namespace: &'a str,
        entry: &'a floodgate::overrides::Override,
        max_active: usize,
        now: floodgate::time::Timestamp,
    ) -> floodgate::store::BoxFuture<'a, Result<bool, floodgate::StoreError>> {
        self.inner.put(namespace, entry, max_active, now)
    }

    fn remove<'a>(
        &'a self,
        namespace: &'a str,
        target: &'a str,
    ) -> floodgate::store::BoxFuture<'a, Result<bool, floodgate::StoreError>> {
        self.inner.remove(namespace, target)
    }

    fn all<'a>(
        &'a self,
        namespace: &'a str,
        now: floodgate::time::Timestamp,
    ) -> floodgate::store::BoxFuture<
        'a,
        Result<Vec<floodgate::overrides::Override>, floodgate::StoreError>,
    > {
        Box::pin(async move {
            let read = self.inner.all(namespace, now).await;
            let gate = self.gate.lock().unwrap().take();
            if let Some(gate) = gate {
                self.read.notify_one();
                gate.notified().await;
            }
            read
        })
    }

    fn version<'a>(
        &'a self,
        namespace: &'a str,
    ) -> floodgate::store::BoxFuture<'a, Result<u64, floodgate::StoreError>> {
        self.inner.version(namespace)
    }
}

/// A refresh that read before a change, and finishes after a refresh that read the change,
/// leaves the later copy in place: the change stays in force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_refreshs_copy_is_never_replaced_by_an_earlier_ones() {
    use floodgate::overrides::OverrideBackend;

    let memory = Arc::new(floodgate::overrides::MemoryOverrides::default());
    let gate = Arc::new(tokio::sync::Notify::new());
    let held = Arc::new(HeldFirstRead {
        inner: memory.clone(),
        gate: std::sync::Mutex::new(Some(gate.clone())),
        read: Arc::new(tokio::sync::Notify::new()),
    });
    let node = Arc::new(Overrides::new(held.clone(), "fg"));
    let writer = Overrides::new(memory.clone() as Arc<dyn OverrideBackend>, "fg");
    let limit = Arc::new(Limit::fixed_window("hourly", 3, Duration::from_secs(3600)).unwrap());
    let target = floodgate::store::Check::new("fg:{key:raced}:default:hourly", limit, 1);

    // The earlier refresh reads (nothing yet) and is held.
    let earlier = tokio::spawn({
        let node = node.clone();
        async move { node.refresh().await }
    });
    held.read.notified().await;
    // A change, and a later refresh that reads it and puts its copy in place.
    let spec = OverrideSpec::new("hourly", 30, Duration::from_secs(3600));
    writer.set(&target, &spec).await.unwrap();
    node.refresh().await.unwrap();
    assert!(node.in_force_for(&target.key).is_some());

    // The earlier one finishes last, with what it read before the change.
    gate.notify_one();
    earlier.await.unwrap().unwrap();
    assert!(
        node.in_force_for(&target.key).is_some(),
        "the later copy stays"
    );
}
