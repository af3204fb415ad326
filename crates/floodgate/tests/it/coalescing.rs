//! Coalesced calls against real redis-server processes: decisions that wait while a node has
//! its calls out go together in one call, each still decided exactly and in order; a request
//! that goes away while its decision waits, or while its batch is out, holds nothing.
//!
//! Timing: replies are held back by a proxy between the store and Redis, which the test opens
//! and closes; every phase is waited for by polling what Redis holds (`ZCARD`, `INFO
//! commandstats`) every few milliseconds within generous bounds.

use floodgate_test_support as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

use floodgate::store::RedisStore;
use floodgate::store::resilience::BreakerState;
use floodgate::{Algorithm, Limit, Store, store::Check};
use support::RedisServer;
use support::faults::{Fault, FaultProxy};

fn store(server: &RedisServer, in_flight: usize) -> RedisStore {
    store_on(server.url(), in_flight)
}

fn store_on(url: String, in_flight: usize) -> RedisStore {
    RedisStore::builder(url)
        .timeout(Duration::from_secs(5))
        .coalesce(in_flight)
        .deny_cache(false)
        .build()
        .unwrap()
}

/// Many concurrent decisions on one key through three stores (three gateways) admit exactly
/// the limit, in far fewer calls than decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_on_one_key_across_three_nodes_admit_exactly_the_limit() {
    let server = RedisServer::start();
    let limit = Arc::new(
        Limit::builder("h")
            .algorithm(Algorithm::Gcra)
            .limit(500)
            .window(Duration::from_secs(3600))
            .build()
            .unwrap(),
    );
    let nodes: Vec<RedisStore> = (0..3).map(|_| store(&server, 1)).collect();
    let calls_before = server.command_calls("fcall");
    let mut tasks = Vec::new();
    for node in &nodes {
        for _ in 0..32 {
            let (node, limit) = (node.clone(), limit.clone());
            tasks.push(tokio::spawn(async move {
                let checks = [Check::new("fgtest:{hot}:r:h", limit, 1)];
                let mut admitted = 0u64;
                for _ in 0..40 {
                    admitted += u64::from(
                        node.check_and_consume(&checks, None)
                            .await
                            .expect("decided")
                            .is_allowed(),
                    );
                }
                admitted
            }));
        }
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    let decisions = 3 * 32 * 40;
    let calls = server.command_calls("fcall") - calls_before;
    assert_eq!(admitted, 500, "exactly the limit of {decisions} decisions");
    assert!(
        calls * 2 < decisions,
        "{calls} calls for {decisions} decisions: coalesced"
    );
}

/// A TCP proxy in front of `port` that passes requests at once and replies only as far as the
/// test allows: `allow(n)` lets `n` more reads of replies through.
struct ReplyGate {
    port: u16,
    allowed: Arc<AtomicU64>,
    changed: Arc<Notify>,
}

impl ReplyGate {
    async fn start(target: u16) -> ReplyGate {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let allowed = Arc::new(AtomicU64::new(u64::MAX));
        let changed = Arc::new(Notify::new());
        let (gate, wake) = (allowed.clone(), changed.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(("127.0.0.1", target))
                    .await
                    .unwrap();
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                let (gate, wake) = (gate.clone(), wake.clone());
                tokio::spawn(async move {
                    let mut buffer = vec![0u8; 65536];
                    loop {
                        let Ok(read) = server_read.read(&mut buffer).await else {
                            return;
                        };
                        if read == 0 {
                            return;
                        }
                        // Wait until a read may pass, then take one.
                        loop {
                            let notified = wake.notified();
                            let left = gate.load(Ordering::SeqCst);
                            if left > 0 {
                                if left != u64::MAX {
                                    gate.fetch_sub(1, Ordering::SeqCst);
                                }
                                break;
                            }
                            notified.await;
                        }
                        if client_write.write_all(&buffer[..read]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        ReplyGate {
            port,
            allowed,
            changed,
        }
    }

    fn allow(&self, reads: u64) {
        self.allowed.store(reads, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

fn leases(server: &RedisServer, key: &str) -> i64 {
    server.command(&["ZCARD", key])
}

/// A request that goes away while its decision waits for a place is never decided; one that
/// goes away while its batch is out has the lease its decision took released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_mid_batch_holds_nothing() {
    let server = RedisServer::start();
    let gate = ReplyGate::start(server.port()).await;
    let node = store_on(format!("redis://127.0.0.1:{}", gate.port), 1);
    let concurrency = Arc::new(
        Limit::builder("c")
            .algorithm(Algorithm::Concurrency)
            .limit(5)
            .window(Duration::from_secs(600))
            .build()
            .unwrap(),
    );
    let key = "fgtest:{leases}:r:c";
    let checks = move || [Check::new(key, concurrency.clone(), 1)];
    let decide = |node: &RedisStore| {
        let (node, checks) = (node.clone(), checks.clone());
        tokio::spawn(async move { node.check_and_consume(&checks(), None).await })
    };
    // Warm up: the connection is made and the library loaded.
    let warm = node.check_and_consume(&checks(), None).await.unwrap();
    node.release(warm.leases().to_vec()).await.unwrap();
    assert_eq!(leases(&server, key), 0);
    let fcalls = || server.command_calls("fcall");

    // 1. Dropped while waiting for a place: never decided (a counting limit: no lease to
    // release, so every call Redis counts is a decision).
    let window = Arc::new(Limit::fixed_window("w", 100, Duration::from_secs(600)).unwrap());
    let counted = "fgtest:{counted}:r:w";
    let count = move |node: &RedisStore| {
        let (node, window) = (node.clone(), window.clone());
        tokio::spawn(async move {
            node.check_and_consume(&[Check::new(counted, window, 1)], None)
                .await
        })
    };
    gate.allow(0);
    let before = fcalls();
    let first = count(&node);
    support::wait_until(Duration::from_secs(2), "the first decision made", || {
        fcalls() == before + 1
    });
    let waiting = count(&node);
    support::wait_until(
        Duration::from_secs(2),
        "the second decision waiting",
        || node.coalesced_waiting() == 1,
    );
    waiting.abort();
    let _ = waiting.await;
    gate.allow(u64::MAX);
    assert!(first.await.unwrap().unwrap().is_allowed());
    // The next decision shows whether a batch decided the dropped one too.
    assert!(count(&node).await.unwrap().unwrap().is_allowed());
    assert_eq!(fcalls(), before + 2, "the dropped decision was never sent");
    let counted_so_far: u64 = server.command(&["HGET", counted, "c"]);
    assert_eq!(counted_so_far, 2);

    // 2. Dropped while its batch is out: the lease the batch took is given back.
    gate.allow(0);
    let before = fcalls();
    let first = decide(&node);
    support::wait_until(Duration::from_secs(2), "the first decision made", || {
        fcalls() == before + 1
    });
    let batched = decide(&node);
    support::wait_until(
        Duration::from_secs(2),
        "the second decision waiting",
        || node.coalesced_waiting() == 1,
    );
    // The first reply passes; the batch goes out and is decided; its reply is held.
    gate.allow(1);
    let first = first.await.unwrap().unwrap();
    support::wait_until(Duration::from_secs(2), "the batch decided", || {
        fcalls() == before + 2
    });
    assert_eq!(leases(&server, key), 2, "the batch took its lease");
    assert!(!batched.is_finished());
    batched.abort();
    let _ = batched.await;
    gate.allow(u64::MAX);
    node.release(first.leases().to_vec()).await.unwrap();
    support::wait_until(
        Duration::from_secs(2),
        "the abandoned lease released",
        || leases(&server, key) == 0,
    );
}

/// A store through `proxy` that coalesces behind one call, with `deadline` and a breaker that
/// opens at the first failure: any timeout shows.
fn store_through(proxy: &FaultProxy, deadline: Duration) -> RedisStore {
    RedisStore::builder(proxy.url())
        .timeout(deadline)
        .breaker(1, Duration::from_secs(60))
        .coalesce(1)
        .deny_cache(false)
        .build()
        .unwrap()
}

/// Spawns a decision of `checks` on `node`.
fn spawn_decision(
    node: &RedisStore,
    checks: Vec<Check>,
) -> tokio::task::JoinHandle<Result<floodgate::Decision, floodgate::StoreError>> {
    let node = node.clone();
    tokio::spawn(async move { node.check_and_consume(&checks, None).await })
}

/// A Redis slower than usual but within the deadline: a decision that waits behind a call
/// (most of a deadline) and then goes out in a batch (most of another) is decided, and the
/// breaker stays closed. The deadline covers the call, not the queueing.
///
/// Timing: replies are held 700 ms against a deadline of 1 s; the queued decision takes about
/// 1.4 s in all, within the bound of two deadlines, and each part has 300 ms to spare.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_redis_within_the_deadline_times_out_no_queued_decision() {
    const DEADLINE: Duration = Duration::from_secs(1);
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let node = store_through(&proxy, DEADLINE);
    let window = Arc::new(Limit::fixed_window("w", 100, Duration::from_secs(3600)).unwrap());
    let checks = |key: &str| vec![Check::new(key, window.clone(), 1)];
    // Warm up: the connection is made and the library loaded.
    assert!(
        node.check_and_consume(&checks("fgtest:{slow}:warm"), None)
            .await
            .unwrap()
            .is_allowed()
    );

    proxy.set(Fault::DelayReplies(Duration::from_millis(700)));
    let before = server.command_calls("fcall");
    let first = spawn_decision(&node, checks("fgtest:{slow}:a"));
    support::wait_until(Duration::from_secs(2), "the first decision made", || {
        server.command_calls("fcall") == before + 1
    });
    let queued = spawn_decision(&node, checks("fgtest:{slow}:b"));
    support::wait_until(Duration::from_secs(2), "the second decision queued", || {
        node.coalesced_waiting() == 1
    });
    assert!(first.await.unwrap().expect("decided").is_allowed());
    assert!(queued.await.unwrap().expect("decided").is_allowed());
    assert_eq!(node.guard().state(), BreakerState::Closed);
}

/// A batch whose middle decision fails in the script (its key's stored state is corrupted):
/// that decision gets its error, and the decisions before and after it are decided and told,
/// each charged exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_decision_fails_alone_in_its_batch() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let node = store_through(&proxy, Duration::from_secs(5));
    let window = Arc::new(Limit::fixed_window("w", 100, Duration::from_secs(3600)).unwrap());
    let checks = |key: &str| vec![Check::new(key, window.clone(), 1)];
    let (before, corrupted, after) = (
        "fgtest:{batch}:before",
        "fgtest:{batch}:corrupted",
        "fgtest:{batch}:after",
    );
    let _: () = server.command(&["HSET", corrupted, "w", "notanumber", "c", "1"]);
    assert!(
        node.check_and_consume(&checks("fgtest:{batch}:warm"), None)
            .await
            .unwrap()
            .is_allowed()
    );

    // One call out, held, while the three queue behind it in order.
    proxy.set(Fault::DelayReplies(Duration::from_millis(500)));
    let calls = server.command_calls("fcall");
    let out = spawn_decision(&node, checks("fgtest:{batch}:out"));
    support::wait_until(Duration::from_secs(2), "the first call made", || {
        server.command_calls("fcall") == calls + 1
    });
    let mut queued = Vec::new();
    for key in [before, corrupted, after] {
        queued.push(spawn_decision(&node, checks(key)));
        let waiting = queued.len();
        support::wait_until(Duration::from_secs(2), "the decision queued", || {
            node.coalesced_waiting() == waiting
        });
    }
    assert!(out.await.unwrap().unwrap().is_allowed());
    let mut answers = Vec::new();
    for decision in queued {
        answers.push(decision.await.unwrap());
    }
    assert_eq!(
        server.command_calls("fcall"),
        calls + 2,
        "the three went out as one batch"
    );
    assert!(answers[0].as_ref().expect("decided").is_allowed());
    let error = answers[1].as_ref().expect_err("the corrupted state fails");
    assert!(!error.is_transient(), "{error}");
    assert!(answers[2].as_ref().expect("decided").is_allowed());
    for key in [before, after] {
        let count: u64 = server.command(&["HGET", key, "c"]);
        assert_eq!(count, 1, "{key} charged once");
    }
    assert_eq!(node.guard().state(), BreakerState::Closed);
}
