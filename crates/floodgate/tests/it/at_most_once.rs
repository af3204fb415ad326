//! At most once: a call whose connection breaks after Redis ran it is never sent again by the
//! client library (SPEC §1). A proxy forwards one script call, lets Redis answer, discards
//! the answer and closes the connection (what a reset after the write looks like); whatever the
//! store then answers, Redis must have applied the call exactly once: a decision counted once,
//! a refund credited once, a lease trade's given-back units credited once. On a single server
//! and on a cluster, with one multiplexed connection and with a pool.
//!
//! Before this was fixed, redis-rs's cluster client (one retry multiplexed, 16 in
//! deadpool-redis's cluster pool) sent the call again on a new connection: a decision counted
//! twice, answered 200.
//!
//! A lease trade is numbered: asked again after its answer was lost, Redis answers the first
//! run's grant and applies nothing twice, so the node keeps what it was granted.
//!
//! No timing: the fault is one-shot and the counts are read back after the call returned.

use floodgate_test_support as support;

use std::sync::Arc;
use std::time::Duration;

use floodgate::store::batched::{LeaseRequest, SyncTarget, Unanswered};
use floodgate::store::resilience::BreakerState;
use floodgate::store::{Check, ConnectionMode, RedisStore, RedisStoreBuilder, StoreError};
use floodgate::{Limit, Store};
use support::RedisCluster;
use support::RedisServer;
use support::faults::{Fault, FaultProxy};

const HOUR: Duration = Duration::from_secs(3600);
const DEADLINE: Duration = Duration::from_secs(2);

const MODES: [ConnectionMode; 2] = [ConnectionMode::Multiplexed, ConnectionMode::Pool(4)];

/// A store as the tests use it: every decision a call (no deny cache), a generous deadline (the
/// answer is lost to the fault, not to time).
fn tuned(builder: RedisStoreBuilder, mode: ConnectionMode) -> RedisStore {
    builder
        .connection_mode(mode)
        .timeout(DEADLINE)
        .deny_cache(false)
        .build()
        .unwrap()
}

/// Where the calls on each key go: the proxy a fault is set on, and a store that reads the
/// shared state without a fault in between.
struct Target<'a> {
    /// The store under test, through the proxies.
    store: RedisStore,
    /// Reads the state behind the proxies.
    reader: RedisStore,
    /// The proxy in front of the node that holds `key`.
    proxy_of: Box<dyn Fn(&str) -> &'a FaultProxy + 'a>,
}

impl Target<'_> {
    /// What `key` has left under `limit`, read behind the proxies.
    async fn remaining(&self, key: &str, limit: &Arc<Limit>) -> u64 {
        let decision = self
            .reader
            .peek(&[Check::new(key.to_owned(), limit.clone(), 0)], None)
            .await
            .expect("read behind the proxies");
        decision.limits()[0].remaining
    }

    /// Runs `call` with the answer of the next script call sent to `key`'s node dropped after
    /// Redis ran it; checks that the fault struck.
    async fn with_dropped_answer<T>(&self, key: &str, call: impl Future<Output = T>) -> T {
        let proxy = (self.proxy_of)(key);
        let swallowed = proxy.bytes_swallowed();
        proxy.set(Fault::DropNextCall);
        let answer = call.await;
        assert!(
            proxy.bytes_swallowed() > swallowed,
            "{key}: the proxy dropped an answer"
        );
        assert_eq!(proxy.fault(), Fault::None, "{key}: the fault was used up");
        answer
    }
}

/// A decision whose answer is lost counts its cost once.
async fn a_decision_counts_once(target: &Target<'_>, tag: &str) {
    let limit = Arc::new(Limit::fixed_window("once", 100, HOUR).unwrap());
    let key = format!("fg:{{client:{tag}-decision}}:r:once");
    let check = [Check::new(key.clone(), limit.clone(), 3)];
    target.store.check_and_consume(&check, None).await.unwrap();
    assert_eq!(target.remaining(&key, &limit).await, 97);
    let answer = target
        .with_dropped_answer(&key, target.store.check_and_consume(&check, None))
        .await;
    assert_eq!(
        target.remaining(&key, &limit).await,
        94,
        "{tag}: the decision whose answer was lost counted once (answered {:?})",
        answer.map(|decision| decision.is_allowed())
    );
}

/// A refund whose answer is lost gives back once.
async fn a_refund_credits_once(target: &Target<'_>, tag: &str) {
    let limit = Arc::new(Limit::fixed_window("refund", 100, HOUR).unwrap());
    let key = format!("fg:{{client:{tag}-refund}}:r:refund");
    let charged = [Check::new(key.clone(), limit.clone(), 10)];
    let decision = target
        .store
        .check_and_consume(&charged, None)
        .await
        .unwrap();
    assert_eq!(target.remaining(&key, &limit).await, 90);
    let refund = [Check::new(key.clone(), limit.clone(), 4)];
    let answer = target
        .with_dropped_answer(
            &key,
            target.store.refund(&refund, decision.decided_at(), None),
        )
        .await;
    assert_eq!(
        target.remaining(&key, &limit).await,
        94,
        "{tag}: the refund whose answer was lost gave back once (answered {answer:?})"
    );
}

/// A lease trade that gives units back, whose answer is lost, credits them once.
async fn a_trade_gives_back_once(target: &Target<'_>, tag: &str) {
    // A bucket that refills one unit an hour: what it holds moves only with the trades.
    let limit = Arc::new(Limit::token_bucket("trade", 100, HOUR * 100).unwrap());
    let key = format!("fg:{{client:{tag}-trade}}:r:trade");
    let trade = |give_back, want| {
        [LeaseRequest {
            check: Check::new(key.clone(), limit.clone(), 1),
            give_back,
            leased_in: None,
            want,
            charge: 0,
        }]
    };
    let first = trade(0, 10);
    let leased = target.store.lease(&first, None).await;
    assert_eq!(leased.grants[0].as_ref().expect("granted").granted, 10);
    assert_eq!(target.remaining(&key, &limit).await, 90);
    let give_back = trade(4, 0);
    let leased = target
        .with_dropped_answer(&key, target.store.lease(&give_back, None))
        .await;
    assert_eq!(
        target.remaining(&key, &limit).await,
        94,
        "{tag}: the trade whose answer was lost gave back once (answered {:?})",
        leased.grants
    );
    // Asked again by its number, the trade is answered: its grant is not lost with the answer.
    assert!(leased.grants[0].is_ok(), "{tag}: {:?}", leased.grants);
    let take = trade(0, 10);
    let leased = target
        .with_dropped_answer(&key, target.store.lease(&take, None))
        .await;
    let grant = leased.grants[0].as_ref();
    assert_eq!(
        grant.map(|grant| grant.granted).ok(),
        Some(10),
        "{tag}: a grant whose answer was lost is answered when asked again ({:?})",
        leased.grants
    );
    assert_eq!(
        target.remaining(&key, &limit).await,
        84,
        "{tag}: and granted once"
    );
}

async fn every_call_applies_once(target: &Target<'_>, tag: &str) {
    // Warm: the connection made and the library loaded, so that the next command the proxy
    // forwards is the call under test.
    let warm = Arc::new(Limit::fixed_window("warm", 10, HOUR).unwrap());
    for key in ["decision", "refund", "trade"] {
        let check = [Check::new(
            format!("fg:{{client:{tag}-{key}}}:r:warm"),
            warm.clone(),
            1,
        )];
        target.store.check_and_consume(&check, None).await.unwrap();
    }
    a_decision_counts_once(target, tag).await;
    a_refund_credits_once(target, tag).await;
    a_trade_gives_back_once(target, tag).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_on_a_single_server_is_applied_once() {
    support::clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    for mode in MODES {
        let target = Target {
            store: tuned(RedisStore::builder(proxy.url()), mode),
            reader: tuned(RedisStore::builder(server.url()), mode),
            proxy_of: Box::new(|_| &proxy),
        };
        every_call_applies_once(&target, &format!("single-{mode:?}")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_on_a_cluster_is_applied_once() {
    support::clear_of_window_end(HOUR, Duration::from_secs(60));
    let cluster = RedisCluster::start_proxied(3, 0);
    let direct: Vec<String> = cluster.masters.iter().map(|master| master.url()).collect();
    for mode in MODES {
        let cluster = &cluster;
        let target = Target {
            store: tuned(RedisStore::cluster(cluster.urls()), mode),
            // Seeded with the masters' own ports; they advertise their proxies' all the same,
            // so this reader goes through the proxies too: it reads only when no fault is set.
            reader: tuned(RedisStore::cluster(direct.clone()), mode),
            proxy_of: Box::new(move |key| cluster.proxy(cluster.node_of(key))),
        };
        every_call_applies_once(&target, &format!("cluster-{mode:?}")).await;
    }
}

/// With the client library's retries off, floodgate follows a cluster's redirections itself: a
/// `MOVED` (the slot has a new owner that the cached slot map does not know yet) to the node
/// it names, an `ASK` (the slot is migrating and the key is not on its old owner) with
/// `ASKING` first. Each call runs once, on the node that holds the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirections_are_followed_to_the_node_named() {
    support::clear_of_window_end(HOUR, Duration::from_secs(60));
    let cluster = RedisCluster::start(2);
    let limit = Arc::new(Limit::fixed_window("once", 100, HOUR).unwrap());
    let check = |key: &str| [Check::new(key.to_owned(), limit.clone(), 3)];
    let node_id = |index: usize| cluster.masters[index].command::<String>(&["CLUSTER", "MYID"]);
    let slot_of = |key: &str| {
        cluster.masters[0]
            .command::<i64>(&["CLUSTER", "KEYSLOT", key])
            .to_string()
    };
    // Keys of the slot on a node, whether or not it owns the slot.
    let holds = |index: usize, key: &str| {
        cluster.masters[index].command::<i64>(&["CLUSTER", "COUNTKEYSINSLOT", &slot_of(key)])
    };
    let remaining = async |store: &RedisStore, key: &str| {
        let read = [Check::new(key.to_owned(), limit.clone(), 0)];
        store.peek(&read, None).await.unwrap().limits()[0].remaining
    };

    for mode in MODES {
        let store = tuned(RedisStore::cluster(cluster.urls()), mode);
        let moved = format!("fg:{{client:moved-{mode:?}}}:r:once");
        let asked = format!("fg:{{client:asked-{mode:?}}}:r:once");
        // The slot map read and the library loaded before the slots move.
        store
            .check_and_consume(&check(&format!("fg:{{warm}}:{mode:?}")), None)
            .await
            .unwrap();

        let from = cluster.master_of(&moved);
        let to = 1 - from;
        cluster.give_slot(&moved, to);
        let decision = store.check_and_consume(&check(&moved), None).await;
        assert!(decision.unwrap().is_allowed(), "{mode:?}: MOVED followed");
        assert_eq!((holds(from, &moved), holds(to, &moved)), (0, 1), "{mode:?}");
        assert_eq!(
            remaining(&store, &moved).await,
            97,
            "{mode:?}: counted once"
        );

        let from = cluster.master_of(&asked);
        let to = 1 - from;
        let slot = slot_of(&asked);
        let _: () = cluster.masters[to].command(&[
            "CLUSTER",
            "SETSLOT",
            &slot,
            "IMPORTING",
            &node_id(from),
        ]);
        let _: () = cluster.masters[from].command(&[
            "CLUSTER",
            "SETSLOT",
            &slot,
            "MIGRATING",
            &node_id(to),
        ]);
        let decision = store.check_and_consume(&check(&asked), None).await;
        assert!(decision.unwrap().is_allowed(), "{mode:?}: ASK followed");
        assert_eq!((holds(from, &asked), holds(to, &asked)), (0, 1), "{mode:?}");
        assert_eq!(
            remaining(&store, &asked).await,
            97,
            "{mode:?}: counted once"
        );
    }
}

/// Regression: a lease trade whose answer comes after the deadline was asked again by its
/// number, under a second deadline and a second breaker count: a node's top-up (and any
/// request waiting on it) waited two deadlines, and one late answer counted two failures. A
/// trade is now one call: asked again only when its connection broke (which spends no
/// deadline), within the same deadline, counted once.
///
/// Replies held 900 ms against a 300 ms deadline: on main the trade took two deadlines and
/// opened a breaker that opens at two failures. The time bound is generous (a deadline and
/// two thirds of another, for a loaded machine's timers); the breaker's state is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_trade_costs_one_deadline_and_one_breaker_failure() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let deadline = Duration::from_millis(300);
    let store = RedisStore::builder(proxy.url())
        .timeout(deadline)
        .breaker(2, HOUR)
        .deny_cache(false)
        .build()
        .unwrap();
    let limit = Arc::new(Limit::token_bucket("late", 100, HOUR).unwrap());
    let key = "fg:{client:late}:r:late".to_owned();
    // Warm: the connection made and the library loaded.
    store
        .check_and_consume(&[Check::new(key.clone(), limit.clone(), 1)], None)
        .await
        .unwrap();
    proxy.set(Fault::DelayReplies(deadline * 3));
    let trade = [LeaseRequest {
        check: Check::new(key.clone(), limit.clone(), 1),
        give_back: 0,
        leased_in: None,
        want: 10,
        charge: 0,
    }];
    let started = std::time::Instant::now();
    let leased = store.lease(&trade, None).await;
    let took = started.elapsed();
    assert_eq!(leased.grants[0].as_ref().err(), Some(&Unanswered::Lost));
    assert!(
        matches!(leased.failure, Some(StoreError::Timeout(_))),
        "{:?}",
        leased.failure
    );
    assert!(took < deadline * 5 / 3, "the trade took {took:?}");
    assert_eq!(
        store.breaker_state(),
        Some(BreakerState::Closed),
        "one late trade is one failure"
    );
}
