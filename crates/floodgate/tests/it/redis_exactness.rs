//! The seeds' race, reproduced: a naive GET-then-SET limiter overshoots under concurrency,
//! the script does not. And distributed exactness: 4 separate connection pools × 32 tasks on
//! one key admit exactly the capacity, for every algorithm.

use floodgate_test_support as support;

use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::AsyncCommands;
use floodgate::store::{ConnectionMode, RedisStore};
use floodgate::{Algorithm, Limit, Store, store::Check, time::Timestamp};
use support::RedisServer;
use tokio::sync::Barrier;

const NOW: Timestamp = Timestamp::from_secs(1_700_006_400);
const CAPACITY: u64 = 10;
const NODES: usize = 4;
const TASKS_PER_NODE: usize = 32;

fn node(server: &RedisServer, mode: ConnectionMode) -> RedisStore {
    RedisStore::builder(server.url())
        .connection_mode(mode)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// The naive limiter of the seeds: read the counter, decide, write it back. Every task reads
/// before any writes (the barrier makes the interleaving certain instead of likely).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn naive_get_then_set_overshoots() {
    let server = RedisServer::start();
    let barrier = Arc::new(Barrier::new(NODES * TASKS_PER_NODE));
    let mut tasks = Vec::new();
    for _ in 0..NODES {
        let client = deadpool_redis::redis::Client::open(server.url()).unwrap();
        let connection = client.get_multiplexed_async_connection().await.unwrap();
        for _ in 0..TASKS_PER_NODE {
            let (mut connection, barrier) = (connection.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                let count: Option<u64> = connection.get("naive").await.unwrap();
                let count = count.unwrap_or(0);
                barrier.wait().await;
                if count < CAPACITY {
                    let _: () = connection.set("naive", count + 1).await.unwrap();
                    true
                } else {
                    false
                }
            }));
        }
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += u64::from(task.await.unwrap());
    }
    assert!(
        admitted > CAPACITY,
        "the race should let more than {CAPACITY} through, got {admitted}"
    );
    assert_eq!(
        admitted,
        (NODES * TASKS_PER_NODE) as u64,
        "every reader saw an empty counter"
    );
}

/// `NODES` stores (each its own connection), `TASKS_PER_NODE` tasks each, all released at once
/// on one key; every task keeps asking until denied. Returns how many were admitted.
async fn hammer(server: &RedisServer, mode: ConnectionMode, limit: Arc<Limit>) -> u64 {
    let barrier = Arc::new(Barrier::new(NODES * TASKS_PER_NODE));
    let key = format!("fg:{{ip:hot}}:r:{}", limit.name());
    let mut tasks = Vec::new();
    for _ in 0..NODES {
        let store = node(server, mode);
        for _ in 0..TASKS_PER_NODE {
            let (store, barrier, limit, key) =
                (store.clone(), barrier.clone(), limit.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                let checks = [Check::new(key, limit, 1)];
                barrier.wait().await;
                let mut admitted = 0u64;
                // Same instant for everyone: nothing refills, so the capacity is exact.
                while store
                    .check_and_consume(&checks, Some(NOW))
                    .await
                    .unwrap()
                    .is_allowed()
                {
                    admitted += 1;
                }
                admitted
            }));
        }
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    admitted
}

fn capacity_of(algorithm: Algorithm) -> u64 {
    // A leaky bucket admits one request to leave now plus a queue of `burst`.
    if algorithm == Algorithm::LeakyBucket {
        CAPACITY + 1
    } else {
        CAPACITY
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_nodes_times_32_tasks_admit_exactly_the_capacity() {
    let server = RedisServer::start();
    for mode in [ConnectionMode::Multiplexed, ConnectionMode::Pool(8)] {
        for algorithm in Algorithm::ALL {
            let name = format!(
                "{}-{}",
                algorithm.as_str(),
                matches!(mode, ConnectionMode::Pool(_))
            );
            let limit =
                Arc::new(Limit::new(name, algorithm, CAPACITY, Duration::from_secs(3600)).unwrap());
            let admitted = hammer(&server, mode, limit).await;
            assert_eq!(
                admitted,
                capacity_of(algorithm),
                "{algorithm} over {mode:?}"
            );
        }
    }
}

/// The script's check-and-consume under the same barrier as the naive limiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_does_not_overshoot_under_the_same_race() {
    let server = RedisServer::start();
    let limit = Arc::new(Limit::fixed_window("race", CAPACITY, Duration::from_secs(60)).unwrap());
    let barrier = Arc::new(Barrier::new(NODES * TASKS_PER_NODE));
    let mut tasks = Vec::new();
    for _ in 0..NODES {
        let store = node(&server, ConnectionMode::Multiplexed);
        for _ in 0..TASKS_PER_NODE {
            let (store, barrier, limit) = (store.clone(), barrier.clone(), limit.clone());
            tasks.push(tokio::spawn(async move {
                let checks = [Check::new("fg:{ip:race}:r:race", limit, 1)];
                barrier.wait().await;
                store
                    .check_and_consume(&checks, None)
                    .await
                    .unwrap()
                    .is_allowed()
            }));
        }
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += u64::from(task.await.unwrap());
    }
    assert_eq!(admitted, CAPACITY);
}

/// Keys carry a hash of the identity, never the raw value, and expire when idle.
#[tokio::test]
async fn keys_have_ttls_and_no_raw_identity() {
    use floodgate::RateLimitLayer;
    use tower::{Layer, ServiceExt, service_fn};
    let server = RedisServer::start();
    let layer = RateLimitLayer::builder()
        .limit(Limit::token_bucket("per-second", 5, Duration::from_secs(1)).unwrap())
        .limit(Limit::fixed_window("daily", 100, Duration::from_secs(86_400)).unwrap())
        .rule("api")
        .store(node(&server, ConnectionMode::Multiplexed))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(|_request: http::Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(
            http_body_util::Empty::<bytes::Bytes>::new(),
        ))
    }));
    let request = http::Request::builder()
        .header("x-api-key", "secret-partner-key")
        .body(())
        .unwrap();
    let response = service.oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let keys: Vec<String> = server.command(&["KEYS", "*"]);
    assert_eq!(keys.len(), 2, "{keys:?}");
    for key in &keys {
        assert!(!key.contains("secret-partner-key"), "{key}");
        assert!(key.starts_with("fg:{key:"), "{key}");
        let ttl: i64 = server.command(&["PTTL", key]);
        assert!(ttl > 0, "{key} has no TTL");
        assert!(ttl <= 86_400_000, "{key}: {ttl}");
    }
    let slot = floodgate::store::redis::hash_slot;
    assert_eq!(slot(&keys[0]), slot(&keys[1]), "one identity, one slot");
}

/// Decisions go by FCALL of floodgate's function library, loaded on first use; after a
/// `FUNCTION FLUSH` (or a restart that lost it) the next call finds the function missing, loads
/// the library again and is decided, once: nothing lost, nothing doubled.
#[tokio::test]
async fn a_flushed_function_library_is_loaded_again() {
    let server = RedisServer::start();
    let store = node(&server, ConnectionMode::Multiplexed);
    let limit = Arc::new(Limit::gcra("flush", 2, Duration::from_secs(60)).unwrap());
    let checks = [Check::new("fg:{ip:flush}:r:flush", limit, 1)];
    let decide = || async { store.check_and_consume(&checks, Some(NOW)).await.unwrap() };
    assert!(decide().await.is_allowed());
    let (_, function) = floodgate::store::redis::function_library();
    let _: () = server.command(&["FUNCTION", "FLUSH"]);
    assert!(decide().await.is_allowed(), "the second of two");
    assert!(
        !decide().await.is_allowed(),
        "state kept, the flushed call not doubled"
    );
    assert_eq!(server.command_calls("evalsha"), 0, "never by EVALSHA");
    let libraries: deadpool_redis::redis::Value = server.command(&["FUNCTION", "LIST"]);
    assert!(
        format!("{libraries:?}").contains(function),
        "loaded again: {libraries:?}"
    );
}

/// On a server without functions the scripts are called by EVALSHA; after `SCRIPT FLUSH` (a
/// restart, a failover) the first call gets NOSCRIPT, loads the script and succeeds.
#[tokio::test]
async fn noscript_after_a_script_flush_is_handled() {
    let server = RedisServer::without_functions();
    let store = node(&server, ConnectionMode::Multiplexed);
    let limit = Arc::new(Limit::gcra("flush", 2, Duration::from_secs(60)).unwrap());
    let checks = [Check::new("fg:{ip:flush}:r:flush", limit, 1)];
    assert!(
        store
            .check_and_consume(&checks, Some(NOW))
            .await
            .unwrap()
            .is_allowed()
    );
    let _: () = server.command(&["SCRIPT", "FLUSH"]);
    let sha = deadpool_redis::redis::Script::new(&floodgate::store::redis::check_script_source())
        .get_hash()
        .to_owned();
    let exists: Vec<i64> = server.command(&["SCRIPT", "EXISTS", &sha]);
    assert_eq!(exists, [0]);
    assert!(
        store
            .check_and_consume(&checks, Some(NOW))
            .await
            .unwrap()
            .is_allowed()
    );
    assert!(
        !store
            .check_and_consume(&checks, Some(NOW))
            .await
            .unwrap()
            .is_allowed(),
        "state kept"
    );
    let exists: Vec<i64> = server.command(&["SCRIPT", "EXISTS", &sha]);
    assert_eq!(exists, [1], "reloaded");
}

/// Through the layer on Redis: a concurrency lease is held while the response body streams and
/// released (in Redis) when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_leases_in_redis_follow_the_response_body() {
    use floodgate::{PeerAddr, RateLimitLayer};
    use http_body_util::BodyExt;
    use tower::{Layer, ServiceExt, service_fn};
    let server = RedisServer::start();
    let limit = Limit::builder("in-flight")
        .algorithm(Algorithm::Concurrency)
        .limit(1)
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(limit)
        .store(node(&server, ConnectionMode::Multiplexed))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(|_request: http::Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
            bytes::Bytes::from_static(b"body"),
        )))
    }));
    let request = || {
        http::Request::builder()
            .extension(PeerAddr("203.0.113.7:1".parse().unwrap()))
            .body(())
            .unwrap()
    };
    let first = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(
        service.clone().oneshot(request()).await.unwrap().status(),
        429,
        "lease held"
    );
    let keys: Vec<String> = server.command(&["KEYS", "*"]);
    let in_flight: i64 = server.command(&["ZCARD", &keys[0]]);
    assert_eq!(in_flight, 1);
    // Reading the body to its end releases the lease; the release is a Redis call in the
    // background, so wait for it to be visible (bounded).
    first.into_body().collect().await.unwrap();
    let started = std::time::Instant::now();
    loop {
        let in_flight: i64 = server.command(&["ZCARD", &keys[0]]);
        if in_flight == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "lease never released"
        );
        tokio::task::yield_now().await;
    }
    assert_eq!(
        service.clone().oneshot(request()).await.unwrap().status(),
        200
    );
}

/// A sliding log's entries must stay distinct when a refund removes one that is no longer the
/// newest. Request 1 takes a log entry on one node, then waits on a paused
/// node whose limit denies it; meanwhile request 2 logs an entry at the same instant; the
/// refund of request 1's entry then shrinks the log, and the next entry must not reuse (and so
/// overwrite) request 2's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_between_two_log_entries_never_merges_the_next_one() {
    let served = support::ServedStore::sharded(2);
    let (servers, store) = (&served.servers, &served.store);
    // Identities placed one on each node.
    let key_on = |node: usize, name: &str| {
        (0..)
            .map(|identity| format!("fg:{{ip:{identity}}}:r:{name}"))
            .find(|key| store.node_of(key) == node)
            .unwrap()
    };
    let log = Arc::new(Limit::sliding_window_log("log", 2, Duration::from_secs(10)).unwrap());
    let strict = Arc::new(Limit::fixed_window("strict", 1, Duration::from_secs(3600)).unwrap());
    let (log_key, strict_key) = (key_on(0, "log"), key_on(1, "strict"));
    let now = Some(Timestamp::from_secs(1_700_006_400));
    let exhaust = [Check::new(strict_key.clone(), strict.clone(), 1)];
    assert!(
        store
            .check_and_consume(&exhaust, now)
            .await
            .unwrap()
            .is_allowed()
    );

    let log_only = [Check::new(log_key.clone(), log.clone(), 1)];
    let both = [
        Check::new(log_key.clone(), log.clone(), 1),
        Check::new(strict_key, strict, 1),
    ];
    // The strict node holds writes (scripts) for 300ms: request 1 waits there after its log
    // entry is taken.
    let _: () = servers[1].command(&["CLIENT", "PAUSE", "300", "WRITE"]);
    let first = store.check_and_consume(&both, now);
    let second = async {
        // Request 2 goes once request 1's entry is in the log.
        let started = std::time::Instant::now();
        while servers[0].command::<i64>(&["ZCARD", &log_key]) == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "no entry for request 1"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        store.check_and_consume(&log_only, now).await
    };
    let (first, second) = tokio::join!(first, second);
    assert!(
        !first.unwrap().is_allowed(),
        "the strict limit denies request 1"
    );
    assert!(
        second.unwrap().is_allowed(),
        "request 2 takes the second entry"
    );
    // One entry is live (request 2's): one more fits, then the log of 2 is full.
    assert!(
        store
            .check_and_consume(&log_only, now)
            .await
            .unwrap()
            .is_allowed()
    );
    let held: i64 = servers[0].command(&["ZCARD", &log_key]);
    assert_eq!(held, 2, "two live admissions, two entries");
    assert!(
        !store
            .check_and_consume(&log_only, now)
            .await
            .unwrap()
            .is_allowed()
    );
}

/// Under load, the function library goes missing (a `FUNCTION FLUSH`, then a restart that loses
/// it): every call that found it missing loads it and is decided once. Each phase counts on a
/// key of its own: what Redis counted equals what the callers were told was admitted (nothing
/// lost, nothing doubled), and only calls made while the server was down fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_library_lost_under_load_is_reloaded_and_no_decision_is_lost_or_doubled() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let mut server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(2))
        .breaker(1_000_000, Duration::from_millis(1))
        .deny_cache(false)
        .build()
        .unwrap();
    let limit = Arc::new(Limit::fixed_window("n", 1_000_000, Duration::from_secs(3600)).unwrap());
    let phase = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let admitted: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
    let failed: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (store, limit, phase, stop) =
            (store.clone(), limit.clone(), phase.clone(), stop.clone());
        let (admitted, failed) = (admitted.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let now = phase.load(Ordering::Relaxed) as usize;
                let checks = [Check::new(
                    format!("fgtest:{{load}}:r:n{now}"),
                    limit.clone(),
                    1,
                )];
                match store.check_and_consume(&checks, None).await {
                    Ok(decision) if decision.is_allowed() => {
                        admitted[now].fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => panic!("nothing is denied here"),
                    Err(_) => {
                        failed[now].fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
        }));
    }
    let counted = |server: &RedisServer, phase: usize| -> u64 {
        server
            .try_command::<Option<u64>>(&["HGET", &format!("fgtest:{{load}}:r:n{phase}"), "c"])
            .ok()
            .flatten()
            .unwrap_or(0)
    };
    let settle = || tokio::time::sleep(Duration::from_millis(300));
    settle().await;
    // Phase 1 starts from here; the flush comes in its midst.
    phase.store(1, Ordering::Relaxed);
    settle().await;
    let _: () = server.command(&["FUNCTION", "FLUSH"]);
    settle().await;
    // Phase 2: the server restarts (and the library is gone with it) in its midst.
    phase.store(2, Ordering::Relaxed);
    settle().await;
    // Every phase-1 decision finished long ago: Redis's count of them, exactly.
    let phase_one_counted = counted(&server, 1);
    server.kill();
    // From here on, only replies already on their way (one per task at most) come from the
    // old server.
    let before_restart = admitted[2].load(Ordering::Relaxed);
    server.restart();
    settle().await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    let admitted_in = |phase: usize| admitted[phase].load(Ordering::Relaxed);
    assert!(admitted_in(1) > 0);
    assert_eq!(
        failed[1].load(Ordering::Relaxed),
        0,
        "the flush cost no decision"
    );
    assert_eq!(
        phase_one_counted,
        admitted_in(1),
        "across the flush: none lost or doubled"
    );
    // Phase 2's count on the new server holds the admissions decided there: none beyond what
    // callers were told after the restart began, and at most the 16 decisions in flight at the
    // kill (decided by the old server) fewer.
    let after_restart = admitted_in(2) - before_restart;
    assert!(after_restart > 0, "decisions resumed after the restart");
    let on_new_server = counted(&server, 2);
    assert!(
        on_new_server >= after_restart.saturating_sub(16) && on_new_server <= after_restart,
        "the new server counted {on_new_server} of the {after_restart} admissions told after the restart began"
    );
    let libraries: deadpool_redis::redis::Value = server.command(&["FUNCTION", "LIST"]);
    assert!(format!("{libraries:?}").contains(floodgate::store::redis::function_library().1));
}

/// A caller's own clock at a fixed window's last millisecond: the key's TTL, counted from that
/// clock, runs in Redis's real time. Two calls at the same caller instant, 50 ms apart in real
/// time, count in one window (seen failing under load: the 1 ms TTL ran out between them and
/// the second call found a fresh window). The wait here is the real time under test, not a
/// synchronization.
#[tokio::test]
async fn two_calls_at_a_window_s_last_moment_by_the_caller_s_clock_count_together() {
    let server = RedisServer::start();
    let store = node(&server, ConnectionMode::Multiplexed);
    let limit = Arc::new(Limit::fixed_window("last", 10, Duration::from_secs(1)).unwrap());
    let checks = [Check::new("fg:{ip:last}:r:last", limit, 1)];
    // NOW is on a whole second: one millisecond before the next window.
    let last_moment = Timestamp::from_micros(NOW.as_micros() + 999_000);
    let first = store
        .check_and_consume(&checks, Some(last_moment))
        .await
        .unwrap();
    assert_eq!(first.limits()[0].remaining, 9);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = store
        .check_and_consume(&checks, Some(last_moment))
        .await
        .unwrap();
    assert_eq!(
        second.limits()[0].remaining,
        8,
        "the first call's count was kept"
    );
}
