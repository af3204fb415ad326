//! Partial failures, end to end, with faults injected on the wire: a Redis Cluster master
//! killed under load (in every mode), one node of a sharded store gone silent, a Redis that
//! answers late for seconds. The promise under test is the same everywhere: what a fault
//! touches follows the failure policy for as long as the fault lasts and no longer, what it
//! does not touch is decided as if nothing happened, and nothing is ever admitted above its
//! limit.
//!
//! Limits are fixed windows of an hour, each test clear of the hour's end: every identity is
//! counted in one window, so its admissions added up are what that window admitted, and are
//! compared with the limit. Admissions, not Redis's counts: a promoted replica's counts are
//! whatever replication had delivered (see `floodgate_test_support::failover` on how the
//! cluster test keeps that out of the comparison).

use floodgate_test_support as support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate::Limit;
use floodgate::store::{BatchedStore, Check, RedisStore, ShardedRedisStore, Store};
use support::RedisServer;
use support::failover::{self, Load, Mode, Outcome, Report};
use support::faults::{Fault, FaultProxy};

/// How long after the promotion (as the test sees it: every node reports the cluster whole)
/// a killed master's identities may still fail: the store re-reads the slot map at most once
/// a second after a failure, its breaker for the dead master stays open 300 ms, and its
/// cluster connection finds the new master on its next failed or redirected call. A second
/// or two in practice; three allowed for a loaded machine.
const SETTLED_AFTER_PROMOTION: Duration = Duration::from_secs(3);

const HOUR: Duration = Duration::from_secs(3600);

/// Kills a master of a 3×1 proxied cluster under load in `mode` and holds the run to the
/// promise: see the assertions.
async fn a_killed_master_touches_only_its_identities(mode: Mode) -> Report {
    let report = failover::run(mode, Load::default()).await;
    let limit = Load::default().limit;
    print_report(mode, &report);
    assert_healthy_masters_untouched(mode, &report, limit);
    assert_killed_master_recovers(mode, &report, limit);
    if let Some((ceiling, admitted)) = report.ceiling {
        println!("  global ceiling: {admitted} admitted of {ceiling}");
        assert!(
            admitted <= ceiling,
            "{admitted} admitted under a ceiling of {ceiling}"
        );
    }
    report
}

/// What the run saw, identity by identity, for the test's output.
fn print_report(mode: Mode, report: &Report) {
    let window = report.error_window();
    println!(
        "{}: promotion {:?} after the kill; {} decisions failed, from {:?} to {:?} after the kill",
        mode.name(),
        report.to_promotion(),
        report.failures().count(),
        window.map(|(first, _)| first),
        window.map(|(_, last)| last),
    );
    for identity in &report.identities {
        println!(
            "  {} ({}): {} admitted, {} denied, {} failed",
            identity.key,
            if identity.on_killed_master {
                "killed master"
            } else {
                "healthy master"
            },
            identity.admitted(),
            identity.denied(),
            identity.failed()
        );
    }
}

/// The identities on the healthy masters never failed, were never admitted above `limit`, and
/// (but under a global ceiling) were decided exactly through the failover.
fn assert_healthy_masters_untouched(mode: Mode, report: &Report, limit: u64) {
    for identity in report.side(false) {
        assert_eq!(
            identity.failed(),
            0,
            "{}: an identity on a healthy master is never the failure policy's",
            identity.key
        );
        assert!(
            identity.admitted() <= limit,
            "{}: {} admitted in a window of {limit}",
            identity.key,
            identity.admitted()
        );
        if mode != Mode::GlobalCeiling {
            // Driven at 150 a second for 5 s and more: exactly its limit, through the failover.
            assert_eq!(
                identity.admitted(),
                limit,
                "{}: decided exactly while another master fails over",
                identity.key
            );
        }
    }
}

/// The identities on the killed master failed only from the kill until the promotion had
/// settled, were never admitted above `limit`, and were decided (and, but under a global
/// ceiling, admitted) again after the promotion.
fn assert_killed_master_recovers(mode: Mode, report: &Report, limit: u64) {
    let settled = report.promoted_at + SETTLED_AFTER_PROMOTION;
    for identity in report.side(true) {
        assert!(
            identity.failed() > 0,
            "{}: the kill reached its identities",
            identity.key
        );
        for failure in identity.failures() {
            assert!(
                failure.ended >= report.killed_at,
                "{}: a failure before the kill at {:?}: {failure:?}",
                identity.key,
                report.killed_at
            );
            assert!(
                failure.started < settled,
                "{}: still failing {:?} after the promotion: {failure:?}",
                identity.key,
                failure.started - report.promoted_at
            );
        }
        assert!(
            identity.admitted() <= limit,
            "{}: {} admitted in a window of {limit}",
            identity.key,
            identity.admitted()
        );
        assert!(
            identity.decided_since(settled).count() > 0,
            "{}: decided again after the promotion",
            identity.key
        );
        if mode != Mode::GlobalCeiling {
            // Far from its limit at the kill (150 a second for 1 s of 600): admitted again.
            assert!(
                identity
                    .decided_since(report.promoted_at)
                    .any(|decided| decided.outcome == Outcome::Admitted),
                "{}: admitted again after the promotion",
                identity.key
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_cluster_master_in_exact_mode() {
    a_killed_master_touches_only_its_identities(Mode::Exact).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_cluster_master_in_batched_mode() {
    a_killed_master_touches_only_its_identities(Mode::Batched).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_cluster_master_with_hot_identities() {
    a_killed_master_touches_only_its_identities(Mode::HotIdentities).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_cluster_master_under_a_global_ceiling() {
    a_killed_master_touches_only_its_identities(Mode::GlobalCeiling).await;
}

fn per_hour(limit: u64) -> Arc<Limit> {
    Arc::new(Limit::fixed_window("hourly", limit, HOUR).unwrap())
}

fn check(limit: &Arc<Limit>, identity: &str) -> Vec<Check> {
    vec![Check::new(
        format!("fgtest:{{ip:{identity}}}:p:hourly"),
        limit.clone(),
        1,
    )]
}

/// Admitted, denied and failed decisions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Tally {
    admitted: u64,
    denied: u64,
    failed: u64,
}

impl Tally {
    fn add(&mut self, outcome: Result<bool, floodgate::StoreError>) {
        match outcome {
            Ok(true) => self.admitted += 1,
            Ok(false) => self.denied += 1,
            Err(_) => self.failed += 1,
        }
    }
}

/// Decides `checks` on `store` every `every` for `duration`, from `tasks` tasks at once.
async fn drive(
    store: &Arc<dyn Store>,
    checks: &[Check],
    tasks: usize,
    every: Duration,
    duration: Duration,
) -> Tally {
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
            let (store, checks) = (store.clone(), checks.to_vec());
            tokio::spawn(async move {
                let mut tally = Tally::default();
                let started = Instant::now();
                let mut ticks = tokio::time::interval(every);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                while started.elapsed() < duration {
                    ticks.tick().await;
                    let outcome = store.check_and_consume(&checks, None).await;
                    tally.add(outcome.map(|decision| decision.is_allowed()));
                }
                tally
            })
        })
        .collect();
    let mut total = Tally::default();
    for handle in handles {
        let tally = handle.await.unwrap();
        total.admitted += tally.admitted;
        total.denied += tally.denied;
        total.failed += tally.failed;
    }
    total
}

/// Decides each identity's checks concurrently (see [`drive`]); a tally per identity.
async fn drive_all(
    store: &Arc<dyn Store>,
    identities: &[Vec<Check>],
    duration: Duration,
) -> Vec<Tally> {
    let runs = identities
        .iter()
        .map(|checks| drive(store, checks, 2, Duration::from_millis(5), duration));
    futures_util::future::join_all(runs).await
}

/// A sharded store over 3 servers, each behind a proxy, and identities by node: two on each.
struct Sharded {
    _servers: Vec<RedisServer>,
    proxies: Vec<FaultProxy>,
    store: ShardedRedisStore,
    by_node: Vec<Vec<Vec<Check>>>,
}

fn sharded(limit: &Arc<Limit>) -> Sharded {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxies: Vec<FaultProxy> = servers
        .iter()
        .map(|server| FaultProxy::start(server.port()))
        .collect();
    let store = ShardedRedisStore::new(
        proxies
            .iter()
            .map(|proxy| {
                let node = RedisStore::builder(proxy.url())
                    .timeout(Duration::from_millis(100))
                    .breaker(3, Duration::from_millis(300))
                    .build()
                    .unwrap();
                (proxy.url(), node)
            })
            .collect(),
    )
    .unwrap();
    let mut by_node: Vec<Vec<Vec<Check>>> = vec![Vec::new(); 3];
    for index in 0.. {
        let checks = check(limit, &format!("shard-client-{index}"));
        let node = store.node_of(&checks[0].key);
        if by_node[node].len() < 2 {
            by_node[node].push(checks);
        }
        if by_node.iter().all(|identities| identities.len() == 2) {
            break;
        }
    }
    Sharded {
        _servers: servers,
        proxies,
        store,
        by_node,
    }
}

/// One node of a sharded store black-holed: the other nodes' identities are decided exactly
/// and never fail; the silent node's fail; once it answers again, it is decided again.
async fn a_black_holed_shard_touches_only_its_identities(batched: bool) {
    support::clear_of_window_end(HOUR, Duration::from_secs(60));
    let limit = per_hour(40);
    let Sharded {
        _servers,
        proxies,
        store,
        by_node,
    } = sharded(&limit);
    let store: Arc<dyn Store> = if batched {
        Arc::new(
            BatchedStore::builder(store)
                .sync_interval(Duration::from_millis(100))
                .build(),
        )
    } else {
        Arc::new(store)
    };
    let healthy: Vec<Vec<Check>> = by_node[..2].concat();
    let silent = &by_node[2];
    reach_every_node_once(&store, &by_node.concat()).await;

    proxies[2].set(Fault::BlackHole);
    // 2 tasks an identity, one decision each every 5 ms, for 1.5 s: about 600 each, far
    // beyond the limit of 40.
    let during = drive_all(&store, &by_node.concat(), Duration::from_millis(1500)).await;
    let (healthy_during, silent_during) = during.split_at(4);
    assert_only_the_silent_node_failed(healthy_during, &healthy, silent_during, silent);

    proxies[2].set(Fault::None);
    let polled_admission = poll_until_decided(&store, &silent[0]).await;
    let after = drive_all(&store, silent, Duration::from_millis(1000)).await;
    for (index, checks) in silent.iter().enumerate() {
        let tally = after[index];
        assert_eq!(tally.failed, 0, "{}: recovered: {tally:?}", checks[0].key);
        let polled = if index == 0 { polled_admission } else { 0 };
        let admitted = 1 + silent_during[index].admitted + polled + tally.admitted;
        assert!(
            admitted <= 40,
            "{}: {admitted} admitted of 40",
            checks[0].key
        );
        if !batched {
            // Nothing the silent node swallowed ran: in exact mode every unit is still there.
            assert_eq!(
                admitted, 40,
                "{}: the rest of its limit after recovery",
                checks[0].key
            );
        }
    }
    let healthy_after = drive_all(&store, &healthy, Duration::from_millis(200)).await;
    for tally in healthy_after {
        assert_eq!(tally.failed, 0);
        assert_eq!(tally.admitted, 0, "still at their limit");
    }
}

/// Connects to every node and loads the library by reads that count nothing, retried (on a
/// loaded machine a first call, connect and FUNCTION LOAD, may outlast the 100 ms deadline, and
/// a decision that timed out might still have been counted); then admits each identity once,
/// so that a fault meets established connections.
async fn reach_every_node_once(store: &Arc<dyn Store>, identities: &[Vec<Check>]) {
    for checks in identities {
        let started = std::time::Instant::now();
        while store.peek(checks, None).await.is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the nodes answer"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    for checks in identities {
        let decision = store.check_and_consume(checks, None).await.unwrap();
        assert!(decision.is_allowed(), "the first of 40");
    }
}

/// While one node was silent: the healthy nodes' identities never failed and were admitted
/// exactly up to their limit (one admitted before); the silent node's identities failed.
fn assert_only_the_silent_node_failed(
    healthy_during: &[Tally],
    healthy: &[Vec<Check>],
    silent_during: &[Tally],
    silent: &[Vec<Check>],
) {
    for (tally, checks) in healthy_during.iter().zip(healthy) {
        assert_eq!(
            tally.failed, 0,
            "{}: a healthy node's identity is never the failure policy's",
            checks[0].key
        );
        assert_eq!(
            1 + tally.admitted,
            40,
            "{}: exactly its limit while another node is silent",
            checks[0].key
        );
    }
    for (tally, checks) in silent_during.iter().zip(silent) {
        assert!(
            tally.failed > 0,
            "{}: the silent node's identities fail: {tally:?}",
            checks[0].key
        );
        assert!(tally.admitted < 40, "{}: {tally:?}", checks[0].key);
    }
}

/// Recovered once a silent node's identity is decided again: its breaker closes after 300 ms
/// and its connection is remade; 5 s allowed for a loaded machine. Returns 1 if the deciding
/// call admitted, else 0.
async fn poll_until_decided(store: &Arc<dyn Store>, checks: &[Check]) -> u64 {
    let recovered = Instant::now();
    loop {
        if let Ok(decision) = store.check_and_consume(checks, None).await {
            break u64::from(decision.is_allowed());
        }
        assert!(
            recovered.elapsed() < Duration::from_secs(5),
            "the silent node is decided again within 5 s of answering"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_shard_in_exact_mode() {
    a_black_holed_shard_touches_only_its_identities(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_shard_in_batched_mode() {
    a_black_holed_shard_touches_only_its_identities(true).await;
}

/// Three batched nodes sharing one Redis, each through its own proxy, all answered 300 ms
/// late for 2 s (deadline 100 ms: every trade's answer is lost, although Redis applied it),
/// then on time again. Under concurrent load no identity is admitted above its limit, and
/// decisions resume once the answers are on time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_late_for_seconds_never_admit_above_the_limit() {
    support::clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let proxies: Vec<FaultProxy> = (0..3).map(|_| FaultProxy::start(server.port())).collect();
    let nodes: Vec<Arc<dyn Store>> = proxies
        .iter()
        .map(|proxy| {
            let store = RedisStore::builder(proxy.url())
                .timeout(Duration::from_millis(100))
                .breaker(3, Duration::from_millis(300))
                .build()
                .unwrap();
            Arc::new(
                BatchedStore::builder(store)
                    .sync_interval(Duration::from_millis(100))
                    .build(),
            ) as Arc<dyn Store>
        })
        .collect();
    // Limits reached before the fault, during it, and never: 3 nodes × 2 tasks × 50 a second
    // is 300 a second per identity.
    let limits = [150, 600, 100_000];
    let identities: Vec<Vec<Check>> = limits
        .iter()
        .enumerate()
        .map(|(index, &limit)| check(&per_hour(limit), &format!("late-{index}")))
        .collect();
    let every = Duration::from_millis(20);
    let phase = |duration: Duration| {
        let runs = nodes.iter().flat_map(|node| {
            identities
                .iter()
                .map(move |checks| drive(node, checks, 2, every, duration))
        });
        futures_util::future::join_all(runs)
    };
    let sum = |tallies: &[Tally], identity: usize| -> Tally {
        let mut total = Tally::default();
        for tally in tallies.iter().skip(identity).step_by(limits.len()) {
            total.admitted += tally.admitted;
            total.denied += tally.denied;
            total.failed += tally.failed;
        }
        total
    };

    let before = phase(Duration::from_millis(700)).await;
    for proxy in &proxies {
        proxy.set(Fault::DelayReplies(Duration::from_millis(300)));
    }
    let during = phase(Duration::from_secs(2)).await;
    for proxy in &proxies {
        proxy.set(Fault::None);
    }
    // Replies held when the fault ended keep their 300 ms; leases given during the fault
    // live 2 s; the breakers close 300 ms after opening. 3 s lets all of that pass...
    let settling = phase(Duration::from_secs(3)).await;
    // ... and from then on every decision is the store's.
    let after = phase(Duration::from_secs(1)).await;

    for (index, limit) in limits.into_iter().enumerate() {
        let key = &identities[index][0].key;
        let [before, during, settling, after] =
            [&before, &during, &settling, &after].map(|tallies| sum(tallies, index));
        println!("{key} (limit {limit}): {before:?} / {during:?} / {settling:?} / {after:?}");
        let admitted = before.admitted + during.admitted + settling.admitted + after.admitted;
        assert!(
            admitted <= limit,
            "{key}: {admitted} admitted in a window of {limit}"
        );
        assert_eq!(before.failed, 0, "{key}: nothing fails before the fault");
        assert_eq!(after.failed, 0, "{key}: decisions resumed after the fault");
        // Every unit admitted was granted first: Redis counts at least what was admitted.
        let count: Vec<Option<u64>> = server.command(&["HMGET", key, "c"]);
        let count = count[0].unwrap_or(0);
        assert!(
            admitted <= count && count <= limit,
            "{key}: {admitted} admitted, Redis counts {count}, limit {limit}"
        );
    }
    let roomy = sum(&during, 2);
    assert!(
        roomy.failed > 0,
        "the late answers reached the decisions: {roomy:?}"
    );
    assert!(
        sum(&after, 2).admitted > 0,
        "the identity far from its limit is admitted again"
    );
}
