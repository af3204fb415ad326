//! Requests that go away mid-decision (an HTTP/2 reset, a client timeout) and deadlines that
//! fire after the script ran: nothing may stay taken. A decision's future is dropped after each
//! number of polls in turn, so that every await point of the decision is cut once; afterwards no
//! lease, fetch slot or key count is left behind.
//!
//! Timing: the pauses between polls (0 to 200µs) only vary where the cut lands; correctness does
//! not depend on them. Background releases are waited for by polling Redis every 50ms for up to
//! 2s, and the paused-server test waits for the server's own count of script calls.

use floodgate_test_support as support;

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use floodgate::store::{BatchedStore, RedisStore};
use floodgate::{Limit, Store, StoreError, store::Check};
use support::{RedisServer, wait_until};

/// Polls `future` `polls` times, `pause` apart, then drops it; its output if it finished first.
async fn drop_after<F: Future>(future: F, polls: usize, pause: Duration) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    for _ in 0..polls {
        let polled = std::future::poll_fn(|context| Poll::Ready(future.as_mut().poll(context)));
        if let Poll::Ready(output) = polled.await {
            return Some(output);
        }
        tokio::time::sleep(pause).await;
    }
    None
}

/// The keys of one limit on three hash slots (global, IP, client), as a real request has them.
fn three_slots(name: &str) -> Vec<String> {
    ["global:GET /x", "ip:203.0.113.7", "client:alice"]
        .iter()
        .map(|scope| format!("fg:{{{scope}}}:r:{name}"))
        .collect()
}

/// A store on `server` with `deadline`, one call per slot if `per_slot`.
fn store(server: &RedisServer, deadline: Duration, per_slot: bool) -> RedisStore {
    RedisStore::builder(server.url())
        .timeout(deadline)
        .cluster_compatible(per_slot)
        .build()
        .unwrap()
}

fn leases_held(server: &RedisServer, keys: &[String]) -> i64 {
    keys.iter()
        .map(|key| server.command::<i64>(&["ZCARD", key]))
        .sum()
}

/// Drop fault injection: a concurrency decision over three slots (three script calls in turn,
/// on a cluster-compatible store) is dropped at every point; whatever the scripts took is
/// released, so no lease leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_dropped_at_any_await_point_leaves_no_lease() {
    let server = RedisServer::start();
    let store = store(&server, Duration::from_secs(5), true);
    let limit = Arc::new(Limit::concurrency("c", 1_000, Duration::from_secs(30)).unwrap());
    let keys = three_slots("c");
    let checks: Vec<Check> = keys
        .iter()
        .map(|key| Check::new(key.clone(), limit.clone(), 1))
        .collect();
    let (mut finished, mut dropped) = (0, 0);
    for pause in [0, 50, 200].map(Duration::from_micros) {
        for polls in 0..16 {
            match drop_after(store.check_and_consume(&checks, None), polls, pause).await {
                Some(decision) => {
                    // Finished: its leases are the caller's, released as the layer would.
                    let leases = decision.expect("decided").leases().to_vec();
                    store.release(leases).await.expect("released");
                    finished += 1;
                }
                None => dropped += 1,
            }
        }
    }
    assert!(
        dropped > 6 && finished > 0,
        "{dropped} dropped, {finished} finished"
    );
    wait_until(Duration::from_secs(2), "every lease released", || {
        leases_held(&server, &keys) == 0
    });
}

/// No lease leaks on a timeout either: the deadline fires while the script waits behind a
/// paused server; the script runs later and takes its lease, which must then be released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_that_fires_before_the_script_runs_leaves_no_lease() {
    let server = RedisServer::start();
    let store = store(&server, Duration::from_millis(50), false);
    let limit = Arc::new(Limit::concurrency("c", 10, Duration::from_secs(30)).unwrap());
    let key = "fg:{ip:203.0.113.8}:r:c".to_owned();
    let checks = [Check::new(key.clone(), limit, 1)];
    let warm = store.check_and_consume(&checks, None).await.unwrap();
    store.release(warm.leases().to_vec()).await.unwrap();
    assert_eq!(leases_held(&server, std::slice::from_ref(&key)), 0);

    let calls_before = server.script_calls();
    // Scripts may write: they wait until the pause ends (300ms), long after the 50ms deadline.
    let _: () = server.command(&["CLIENT", "PAUSE", "300", "WRITE"]);
    let result = store.check_and_consume(&checks, None).await;
    assert!(matches!(result, Err(StoreError::Timeout(_))), "{result:?}");
    wait_until(Duration::from_secs(2), "the paused script to run", || {
        server.script_calls() > calls_before
    });
    wait_until(Duration::from_secs(2), "its lease released", || {
        leases_held(&server, std::slice::from_ref(&key)) == 0
    });
}

/// A request dropped while its identity's first fetch is in flight must not
/// leave the slot "fetching" with the key counted: after `max_keys` such drops, new identities
/// must still be decided.
// One thread: the connection's task runs only while the decision waits, so a first poll never
// finds its reply already in (on two threads a preempted poll sometimes did).
#[tokio::test(flavor = "current_thread")]
async fn a_request_dropped_during_its_first_fetch_frees_its_key() {
    let server = RedisServer::start();
    let batched = BatchedStore::builder(store(&server, Duration::from_secs(5), false))
        .sync_interval(Duration::from_millis(100))
        .max_keys(4)
        .build();
    let limit = Arc::new(Limit::token_bucket("b", 10, Duration::from_secs(1)).unwrap());
    let checks = |identity: u32| {
        [Check::new(
            format!("fg:{{ip:{identity}}}:r:b"),
            limit.clone(),
            1,
        )]
    };
    for pause in [0, 50, 200].map(Duration::from_micros) {
        for identity in 0..10 {
            let checks = checks(identity);
            let pending = drop_after(batched.check_and_consume(&checks, None), 1, pause);
            if let Some(finished) = pending.await {
                panic!("identity {identity}: not dropped mid-fetch: {finished:?}");
            }
        }
    }
    assert_eq!(batched.stats().keys, 0, "no slot left fetching");
    for identity in 100..103 {
        let decision = batched.check_and_consume(&checks(identity), None).await;
        assert!(decision.expect("decided").is_allowed());
    }
    // A dropped fetch of a key another request waits on: the waiter takes it over.
    let shared_key = checks(7);
    let first = drop_after(
        batched.check_and_consume(&shared_key, None),
        1,
        Duration::ZERO,
    );
    let (dropped, waiter) = tokio::join!(first, batched.check_and_consume(&shared_key, None));
    assert!(dropped.is_none());
    assert!(waiter.expect("the waiter decides").is_allowed());
}
