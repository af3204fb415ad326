//! The Redis store's memory of denials against real redis-server processes: a key Redis denied
//! is denied locally, with Redis's own outcomes, until its wait is over or a reset anywhere
//! reaches it; concurrency limits never use it.
//!
//! Timing: waits are bounded generously (a reset heard within 1 s, a lost server noticed within
//! 2 s), polled every 5 ms; "as soon as the wait is over" sleeps the wait Redis gave plus 50 ms.

use floodgate_test_support as support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate::store::{RedisStore, ShardedRedisStore};
use floodgate::{Algorithm, Decision, Limit, Store, store::Check};
use support::{RedisCluster, RedisServer};

fn store(url: String) -> RedisStore {
    RedisStore::builder(url)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn uncached(url: String) -> RedisStore {
    RedisStore::builder(url)
        .timeout(Duration::from_secs(5))
        .deny_cache(false)
        .build()
        .unwrap()
}

fn limit(algorithm: Algorithm, name: &str, limit: u64, window: Duration) -> Arc<Limit> {
    Arc::new(
        Limit::builder(name)
            .algorithm(algorithm)
            .limit(limit)
            .window(window)
            .build()
            .unwrap(),
    )
}

async fn decide(store: &dyn Store, checks: &[Check]) -> Decision {
    store
        .check_and_consume(checks, None)
        .await
        .expect("decided")
}

/// Decides until denied; returns how many were admitted.
async fn exhaust(store: &dyn Store, checks: &[Check]) -> u64 {
    exhaust_timed(store, checks).await.0
}

/// Decides until denied; returns how many were admitted and how long the denying call took.
/// Redis computed that call's answer at some instant within it; the node dates the denial it
/// remembers at the answer's arrival, so its later answers may differ from Redis's by as much.
async fn exhaust_timed(store: &dyn Store, checks: &[Check]) -> (u64, Duration) {
    let mut admitted = 0;
    loop {
        let started = Instant::now();
        if !decide(store, checks).await.is_allowed() {
            return (admitted, started.elapsed());
        }
        admitted += 1;
        assert!(admitted < 10_000, "never denied");
    }
}

/// Polls `condition` every 5 ms for up to `within`; returns how long it took.
async fn within(
    within: Duration,
    what: &str,
    mut condition: impl AsyncFnMut() -> bool,
) -> Duration {
    let started = Instant::now();
    while !condition().await {
        assert!(started.elapsed() < within, "{what} not within {within:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    started.elapsed()
}

/// The store's resets subscription is up once a reset made elsewhere reaches it: until then it
/// denies nothing locally. Waits for that by denying a probe key locally.
async fn wait_until_listening(store: &RedisStore) {
    let probe = [Check::new(
        "fgtest:{probe}:r:p",
        limit(Algorithm::FixedWindow, "p", 1, Duration::from_secs(600)),
        1,
    )];
    exhaust(store, &probe).await;
    within(
        Duration::from_secs(2),
        "the resets subscription",
        async || {
            let before = store.local_denials();
            let denied = !decide(store, &probe).await.is_allowed();
            denied && store.local_denials() > before
        },
    )
    .await;
}

/// For each counting algorithm, and for a request whose two limits are one denying and one not:
/// the decision the node makes locally equals Redis's (asked through a store without memory
/// right after), to the time between the two plus the denying call's own round trip (the node
/// dates what Redis said at its arrival; a loaded CI machine once took 10 ms there).
#[tokio::test]
async fn a_local_denial_equals_redis_s_decision() {
    let server = RedisServer::start();
    let cached = store(server.url());
    let direct = uncached(server.url());
    wait_until_listening(&cached).await;
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowCounter,
    ] {
        let tight = limit(algorithm, "tight", 3, Duration::from_secs(60));
        let loose = limit(algorithm, "loose", 1000, Duration::from_secs(60));
        let checks = [
            Check::new(format!("fgtest:{{{algorithm}}}:r:loose"), loose, 1),
            Check::new(format!("fgtest:{{{algorithm}}}:r:tight"), tight, 1),
        ];
        let (admitted, denying_call) = exhaust_timed(&cached, &checks).await;
        assert_eq!(admitted, 3, "{algorithm}");
        let calls = server.script_calls();
        let local_before = cached.local_denials();
        let started = Instant::now();
        let local = decide(&cached, &checks).await;
        let remote = decide(&direct, &checks).await;
        let apart = started.elapsed() + denying_call + Duration::from_millis(2);
        assert_eq!(
            cached.local_denials(),
            local_before + 1,
            "{algorithm}: denied locally"
        );
        assert_eq!(
            server.script_calls(),
            calls + 1,
            "{algorithm}: only the direct store called"
        );
        assert!(!local.is_allowed() && !remote.is_allowed(), "{algorithm}");
        assert_eq!(local.limits().len(), remote.limits().len());
        let close = |a: Duration, b: Duration| a.abs_diff(b) <= apart;
        for (local, remote) in local.limits().iter().zip(remote.limits()) {
            let what = format!("{algorithm} {}", local.name);
            assert_eq!(local.allowed, remote.allowed, "{what}");
            assert_eq!(local.remaining, remote.remaining, "{what}");
            assert!(
                close(local.reset_after, remote.reset_after),
                "{what}: {local:?} / {remote:?}"
            );
            match (local.retry_after, remote.retry_after) {
                (Some(a), Some(b)) => assert!(close(a, b), "{what}: {a:?} / {b:?}"),
                (a, b) => assert_eq!(a, b, "{what}"),
            }
        }
        assert_eq!(
            local.binding_limit().map(|b| &b.name),
            remote.binding_limit().map(|b| &b.name)
        );
    }
}

/// A client at 100× its limit costs Redis about one call per retry window: a fixed window of 5
/// per second, hammered for 1.5 s, takes a call per admission and one per window to learn the
/// denial; every other denial is local.
#[tokio::test]
async fn a_hammering_client_costs_a_call_per_retry_window() {
    let server = RedisServer::start();
    let cached = store(server.url());
    wait_until_listening(&cached).await;
    let checks = [Check::new(
        "fgtest:{hammer}:r:w",
        limit(Algorithm::FixedWindow, "w", 5, Duration::from_secs(1)),
        1,
    )];
    let calls_before = server.script_calls();
    let started = Instant::now();
    let (mut admitted, mut requests) = (0u64, 0u64);
    while started.elapsed() < Duration::from_millis(1500) {
        admitted += u64::from(decide(&cached, &checks).await.is_allowed());
        requests += 1;
    }
    let calls = server.script_calls() - calls_before;
    // Two or three windows were touched: at most 5 admissions and one learnt denial each.
    assert!(admitted <= 15, "{admitted} admitted");
    assert!(
        calls <= admitted + 3,
        "{calls} calls for {requests} requests, {admitted} admitted"
    );
    assert!(requests > 20 * calls, "{requests} requests, {calls} calls");
}

/// The wait Redis gave is all a local denial lasts: right after it, the key is decided by Redis
/// again, and admitted.
#[tokio::test]
async fn a_key_is_admitted_again_as_soon_as_its_wait_is_over() {
    let server = RedisServer::start();
    let cached = store(server.url());
    wait_until_listening(&cached).await;
    let checks = [Check::new(
        "fgtest:{wait}:r:g",
        limit(Algorithm::Gcra, "g", 4, Duration::from_secs(1)),
        1,
    )];
    exhaust(&cached, &checks).await;
    let denied = decide(&cached, &checks).await;
    let wait = denied.retry_after().expect("a wait");
    assert!(wait <= Duration::from_millis(250), "{wait:?}");
    tokio::time::sleep(wait + Duration::from_millis(50)).await;
    assert!(
        decide(&cached, &checks).await.is_allowed(),
        "admitted after {wait:?}"
    );
}

/// A lease can come back at any moment: concurrency limits are always decided by Redis.
#[tokio::test]
async fn concurrency_limits_never_use_it() {
    let server = RedisServer::start();
    let cached = store(server.url());
    wait_until_listening(&cached).await;
    let checks = [Check::new(
        "fgtest:{leases}:r:c",
        limit(Algorithm::Concurrency, "c", 1, Duration::from_secs(30)),
        1,
    )];
    let held = decide(&cached, &checks).await;
    assert!(held.is_allowed());
    let local_before = cached.local_denials();
    for _ in 0..5 {
        let calls = server.script_calls();
        assert!(!decide(&cached, &checks).await.is_allowed());
        assert_eq!(server.script_calls(), calls + 1, "every denial is a call");
    }
    assert_eq!(cached.local_denials(), local_before);
    cached.release(held.leases().to_vec()).await.unwrap();
    assert!(
        decide(&cached, &checks).await.is_allowed(),
        "the lease came back"
    );
}

/// A reset through one node reaches another node's memory within one round trip (long before
/// the minute-long wait), on one server, on a sharded store and on a Redis Cluster.
#[tokio::test]
async fn a_reset_anywhere_reaches_every_node() {
    let key = "fgtest:{reset}:r:m";
    let per_minute = limit(Algorithm::FixedWindow, "m", 2, Duration::from_secs(60));
    let checks = [Check::new(key, per_minute, 1)];

    let server = RedisServer::start();
    let (a, b) = (store(server.url()), store(server.url()));
    reset_reaches_the_other(&a, &b, &a, &b, &checks).await;

    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let sharded = || {
        ShardedRedisStore::new(servers.iter().map(|s| (s.url(), store(s.url()))).collect()).unwrap()
    };
    let (a, b) = (sharded(), sharded());
    let owner = a.node_of(key);
    reset_reaches_the_other(&a, &b, a.node(owner), b.node(owner), &checks).await;

    let cluster = RedisCluster::start(3);
    let on_cluster = || {
        RedisStore::cluster(cluster.urls())
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap()
    };
    let (a, b) = (on_cluster(), on_cluster());
    reset_reaches_the_other(&a, &b, &a, &b, &checks).await;
}

/// Exhausts `checks` through `a`, makes `b` deny them locally, resets them through `a`, and
/// expects `b` to admit within a second. `a_node` and `b_node` are the Redis stores holding
/// the key (the stores themselves, or their node of a sharded store).
async fn reset_reaches_the_other(
    a: &dyn Store,
    b: &dyn Store,
    a_node: &RedisStore,
    b_node: &RedisStore,
    checks: &[Check],
) {
    wait_until_listening(a_node).await;
    wait_until_listening(b_node).await;
    exhaust(a, checks).await;
    assert!(!decide(b, checks).await.is_allowed(), "b learns the denial");
    let before = b_node.local_denials();
    assert!(!decide(b, checks).await.is_allowed());
    assert_eq!(b_node.local_denials(), before + 1, "b denies locally");
    let keys: Vec<Arc<str>> = checks.iter().map(|check| check.key.clone()).collect();
    a.reset(&keys).await.unwrap();
    let took = within(
        Duration::from_secs(1),
        "b admitting after the reset",
        async || decide(b, checks).await.is_allowed(),
    )
    .await;
    assert!(took < Duration::from_secs(1), "{took:?}");
}

/// A server that dies takes the memory with it: the node stops denying locally as soon as it
/// notices the lost subscription, and the failure policy decides (here: the store's errors).
#[tokio::test]
async fn a_lost_server_ends_local_denials() {
    let mut server = RedisServer::start();
    let cached = store(server.url());
    wait_until_listening(&cached).await;
    let checks = [Check::new(
        "fgtest:{lost}:r:m",
        limit(Algorithm::FixedWindow, "m", 1, Duration::from_secs(60)),
        1,
    )];
    exhaust(&cached, &checks).await;
    let before = cached.local_denials();
    assert!(!decide(&cached, &checks).await.is_allowed());
    assert_eq!(cached.local_denials(), before + 1);
    server.kill();
    within(
        Duration::from_secs(2),
        "an error instead of a local denial",
        async || cached.check_and_consume(&checks, None).await.is_err(),
    )
    .await;
}

/// Many requests at once from an abuser on three nodes, each with 16 tasks flat out against a
/// gcra limit of 10/s (burst 10): admissions stay exact, and each node sends Redis about one
/// decision per retry window (100 ms) once the burst is spent: when a wait ends, the first
/// request goes to Redis and the others arriving meanwhile are denied locally. Decisions that
/// reach Redis are counted by its `GET`s (each gcra decision reads its key once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abuser_on_three_nodes_costs_a_decision_per_retry_window() {
    let server = RedisServer::start();
    let nodes: Vec<RedisStore> = (0..3).map(|_| store(server.url())).collect();
    for node in &nodes {
        wait_until_listening(node).await;
    }
    let per_second = limit(Algorithm::Gcra, "g", 10, Duration::from_secs(1));
    let gets_before = server.command_calls("get");
    let started = Instant::now();
    let run_for = Duration::from_millis(1500);
    let mut tasks = Vec::new();
    for node in &nodes {
        for _ in 0..16 {
            let (node, per_second) = (node.clone(), per_second.clone());
            tasks.push(tokio::spawn(async move {
                let checks = [Check::new("fgtest:{abuser}:r:g", per_second, 1)];
                let (mut admitted, mut requests) = (0u64, 0u64);
                while started.elapsed() < run_for {
                    admitted += u64::from(decide(&node, &checks).await.is_allowed());
                    requests += 1;
                }
                (admitted, requests)
            }));
        }
    }
    let (mut admitted, mut requests) = (0, 0);
    for task in tasks {
        let (a, r) = task.await.unwrap();
        admitted += a;
        requests += r;
    }
    let elapsed = started.elapsed();
    let decided_by_redis = server.command_calls("get") - gets_before;
    // The burst, then one every 100 ms while the run lasted.
    let allowance = 10 + elapsed.as_millis() as u64 / 100 + 1;
    assert!(
        admitted <= allowance,
        "{admitted} admitted, allowance {allowance}"
    );
    let windows = elapsed.as_millis() as u64 / 100 + 1;
    assert!(
        // Each task's first request (48, before anything is remembered), then at most about
        // one probe and one learnt denial per node and window.
        decided_by_redis <= 48 + 3 * 2 * windows,
        "{decided_by_redis} decisions reached Redis for {requests} requests over {windows} windows"
    );
    assert!(
        requests > 20 * decided_by_redis,
        "{requests} requests, {decided_by_redis} at Redis"
    );
}
