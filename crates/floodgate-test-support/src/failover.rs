//! A Redis Cluster master killed under load: a 3-master cluster with a replica each, every node
//! behind a [`FaultProxy`](crate::faults::FaultProxy) (`cluster-node-timeout` 1 s, so a
//! failover takes a few seconds), a store in one of floodgate's modes, and concurrent tasks
//! deciding for identities on the master that is killed and on the others, before, during and
//! after the failover. What each identity was admitted, denied and refused, and when, is the
//! [`Report`]: `tests/it/partial_failures.rs` asserts on it, `examples/failover.rs`
//! (`bench/failover.sh`) prints it.
//!
//! Limits are fixed windows of an hour and the run waits until it is clear of the hour's end
//! ([`clear_of_window_end`](crate::clear_of_window_end)), so each identity is counted in one
//! window from the first decision to the last: its admissions, added up, are what that window
//! admitted.
//!
//! **Asynchronous replication.** A master acknowledges a write before its replica has it; a
//! master killed at a random moment takes its last acknowledged writes with it, and the
//! promoted replica then admits them again. That overshoot is Redis's promise, not floodgate's.
//! To hold floodgate to its own (never above what Redis counted), the kill pauses the master's
//! writes (`CLIENT PAUSE WRITE`), waits until its replica's offset is the master's, and kills
//! it with the paused calls unanswered: from the clients' side a master that stops answering
//! and goes, and nothing it acknowledged is lost. Redis's own counts after the failover are
//! not compared with what was admitted, only admissions with the limit.
//!
//! The harness blocks (cluster start, kill, waiting for the promotion) with
//! [`tokio::task::block_in_place`]: run it on a multi-threaded runtime.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use floodgate::Limit;
use floodgate::store::{
    BatchedStore, Check, HotIdentities, RedisStore, Scope, SplitStore, Store, StoreError,
};

use crate::{ClusterNode, RedisCluster};

/// The store the load goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A [`RedisStore`] in cluster mode: one call per decision.
    Exact,
    /// A [`BatchedStore`] over the cluster store, trading every 100 ms in the background.
    Batched,
    /// Exact mode with hot identities: an identity above 50 decisions a second on this node
    /// is decided from leases (every identity of the load is, once it has been seen enough).
    HotIdentities,
    /// A `Scope::Shared` global ceiling batched in front of exact client limits
    /// ([`SplitStore`]); the ceiling's key is on a master that is not killed.
    GlobalCeiling,
}

impl Mode {
    /// Every mode.
    pub const ALL: [Mode; 4] = [
        Mode::Exact,
        Mode::Batched,
        Mode::HotIdentities,
        Mode::GlobalCeiling,
    ];

    /// A short name for tables and command lines.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Exact => "exact",
            Mode::Batched => "batched",
            Mode::HotIdentities => "hot-identities",
            Mode::GlobalCeiling => "global-ceiling",
        }
    }

    /// The mode named `name` (as [`name`](Self::name) spells it).
    pub fn parse(name: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|mode| mode.name() == name)
    }
}

/// The load and its phases.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    /// Identities on the master that is killed, and as many on the others.
    pub identities_per_side: usize,
    /// Concurrent tasks deciding for each identity.
    pub tasks_per_identity: usize,
    /// Decisions a second for each identity (spread over its tasks; a task whose decision
    /// takes longer than its turn starts the next at once).
    pub rate_per_identity: u64,
    /// Each identity's limit, a fixed window of an hour.
    pub limit: u64,
    /// The global ceiling's limit (an hour) in [`Mode::GlobalCeiling`].
    pub ceiling: u64,
    /// Load before the kill.
    pub before_kill: Duration,
    /// Load after the promotion.
    pub after_promotion: Duration,
    /// The store's deadline per call.
    pub timeout: Duration,
}

impl Default for Load {
    /// 3 identities a side, 2 tasks each, 150 decisions a second an identity, a limit of 600
    /// an hour (reached by the healthy identities about 4 s in), a ceiling of 2,400, one
    /// second before the kill and four after the promotion, a deadline of 200 ms.
    fn default() -> Self {
        Load {
            identities_per_side: 3,
            tasks_per_identity: 2,
            rate_per_identity: 150,
            limit: 600,
            ceiling: 2_400,
            before_kill: Duration::from_secs(1),
            after_promotion: Duration::from_secs(4),
            timeout: Duration::from_millis(200),
        }
    }
}

/// What one decision came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted.
    Admitted,
    /// Denied by a limit.
    Denied,
    /// The store failed: the layer's failure policy would answer.
    Failed,
}

/// One decision: when its call started and ended (since the run began), and its outcome.
#[derive(Clone, Copy, Debug)]
pub struct Decided {
    /// When the call started.
    pub started: Duration,
    /// When it returned.
    pub ended: Duration,
    /// What it came to.
    pub outcome: Outcome,
}

/// One identity's run.
#[derive(Clone, Debug)]
pub struct IdentityReport {
    /// Its storage key.
    pub key: String,
    /// Whether its slot was on the master that was killed.
    pub on_killed_master: bool,
    /// Its limit.
    pub limit: u64,
    /// Every decision, in the order they ended.
    pub decisions: Vec<Decided>,
}

impl IdentityReport {
    fn count(&self, outcome: Outcome) -> u64 {
        self.decisions
            .iter()
            .filter(|decided| decided.outcome == outcome)
            .count() as u64
    }

    /// Decisions admitted.
    pub fn admitted(&self) -> u64 {
        self.count(Outcome::Admitted)
    }

    /// Decisions denied by a limit.
    pub fn denied(&self) -> u64 {
        self.count(Outcome::Denied)
    }

    /// Decisions that failed.
    pub fn failed(&self) -> u64 {
        self.count(Outcome::Failed)
    }

    /// The failed decisions.
    pub fn failures(&self) -> impl Iterator<Item = &Decided> {
        self.decisions
            .iter()
            .filter(|decided| decided.outcome == Outcome::Failed)
    }

    /// Decisions whose call started at or after `since`, and that the store decided.
    pub fn decided_since(&self, since: Duration) -> impl Iterator<Item = &Decided> {
        self.decisions
            .iter()
            .filter(move |decided| decided.started >= since && decided.outcome != Outcome::Failed)
    }
}

/// A run's results.
#[derive(Clone, Debug)]
pub struct Report {
    /// The mode.
    pub mode: Mode,
    /// When the master stopped answering (its writes paused, then it was killed), since the
    /// run began.
    pub killed_at: Duration,
    /// When every node that runs saw the cluster whole again with the replica promoted.
    pub promoted_at: Duration,
    /// Every identity.
    pub identities: Vec<IdentityReport>,
    /// The global ceiling's limit and what it admitted, in [`Mode::GlobalCeiling`].
    pub ceiling: Option<(u64, u64)>,
}

impl Report {
    /// From the kill to the promotion.
    pub fn to_promotion(&self) -> Duration {
        self.promoted_at - self.killed_at
    }

    /// Every failed decision, of any identity.
    pub fn failures(&self) -> impl Iterator<Item = &Decided> {
        self.identities.iter().flat_map(IdentityReport::failures)
    }

    /// From the first failure's start to the last failure's end, as offsets from the kill
    /// (`None`: nothing failed).
    pub fn error_window(&self) -> Option<(Duration, Duration)> {
        let first = self.failures().map(|decided| decided.started).min()?;
        let last = self.failures().map(|decided| decided.ended).max()?;
        Some((
            first.saturating_sub(self.killed_at),
            last.saturating_sub(self.killed_at),
        ))
    }

    /// The identities on the killed master (`true`) or on the others (`false`).
    pub fn side(&self, on_killed_master: bool) -> impl Iterator<Item = &IdentityReport> {
        self.identities
            .iter()
            .filter(move |identity| identity.on_killed_master == on_killed_master)
    }
}

/// The master that is killed.
const KILLED: usize = 0;
/// Decisions a second on a node above which an identity is hot ([`Mode::HotIdentities`]).
const HOT_ABOVE: u64 = 50;
/// The batched modes' trading interval.
const INTERVAL: Duration = Duration::from_millis(100);
/// The fixed window of every limit.
const HOUR: Duration = Duration::from_secs(3600);

/// Runs the scenario in `mode` under `load` on a cluster of its own. See the [module
/// docs](self).
pub async fn run(mode: Mode, load: Load) -> Report {
    let mut cluster = tokio::task::block_in_place(|| RedisCluster::start_proxied(3, 1));
    let cluster_store = RedisStore::cluster(cluster.urls())
        .timeout(load.timeout)
        // Open after 3 failures in a row, for 300 ms: a dead master's identities fail fast,
        // and are tried again soon enough to see the promotion.
        .breaker(3, Duration::from_millis(300))
        .build()
        .expect("a cluster store");
    let store = store_for(mode, &cluster_store);

    let limit = Arc::new(Limit::fixed_window("hourly", load.limit, HOUR).expect("a limit"));
    let ceiling = Arc::new(Limit::fixed_window("ceiling", load.ceiling, HOUR).expect("a limit"));
    let (killed_side, healthy_side) =
        tokio::task::block_in_place(|| identities_on_each_side(&cluster, load.identities_per_side));
    let ceiling_key = (0..)
        .map(|index| format!("fgfailover:{{global:ceiling-{index}}}:g:ceiling"))
        .find(|key| tokio::task::block_in_place(|| cluster.master_of(key)) != KILLED)
        .expect("a key on a healthy master");
    let checks_of = |key: &str| -> Vec<Check> {
        let client = Check::new(key.to_owned(), limit.clone(), 1);
        match mode {
            Mode::GlobalCeiling => vec![
                Check::new(ceiling_key.clone(), ceiling.clone(), 1).with_scope(Scope::Shared),
                client,
            ],
            _ => vec![client],
        }
    };

    // The whole run, with a generous margin, in one window of an hour.
    tokio::task::block_in_place(|| {
        crate::clear_of_window_end(HOUR, Duration::from_secs(60));
    });
    let began = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let turn = Duration::from_secs_f64(
        load.tasks_per_identity as f64 / load.rate_per_identity.max(1) as f64,
    );
    let mut tasks = Vec::new();
    for (on_killed_master, key) in killed_side
        .iter()
        .map(|key| (true, key))
        .chain(healthy_side.iter().map(|key| (false, key)))
    {
        for _ in 0..load.tasks_per_identity {
            let (store, stop, checks) = (store.clone(), stop.clone(), checks_of(key));
            tasks.push((
                on_killed_master,
                key.clone(),
                tokio::spawn(
                    async move { decide_until(&*store, &checks, &stop, began, turn).await },
                ),
            ));
        }
    }

    // Phases of load: these sleeps are the load's duration, not waits for a condition.
    tokio::time::sleep(load.before_kill).await;
    let killed_at = began.elapsed();
    tokio::task::block_in_place(|| kill_caught_up(&mut cluster, KILLED));
    let promoted =
        tokio::task::block_in_place(|| cluster.wait_for_promotion(KILLED, Duration::from_secs(30)));
    let promoted_at = began.elapsed();
    assert_eq!(
        promoted,
        ClusterNode::Replica {
            master: KILLED,
            replica: 0
        }
    );
    tokio::time::sleep(load.after_promotion).await;
    stop.store(true, Ordering::SeqCst);

    let identities = reports_of(tasks, load.limit).await;
    let ceiling = (mode == Mode::GlobalCeiling).then(|| {
        let admitted = identities.iter().map(IdentityReport::admitted).sum();
        (load.ceiling, admitted)
    });
    drop(store);
    drop(cluster_store);
    Report {
        mode,
        killed_at,
        promoted_at,
        identities,
        ceiling,
    }
}

/// The store `mode` decides with, over the cluster's.
fn store_for(mode: Mode, cluster_store: &RedisStore) -> Arc<dyn Store> {
    let batched = || {
        BatchedStore::builder(cluster_store.clone())
            .sync_interval(INTERVAL)
            .build()
    };
    match mode {
        Mode::Exact => Arc::new(cluster_store.clone()),
        Mode::Batched => Arc::new(batched()),
        Mode::HotIdentities => Arc::new(
            SplitStore::new(batched(), Arc::new(cluster_store.clone()), |_: &Check| {
                false
            })
            .with_hot_identities(Arc::new(HotIdentities::new(HOT_ABOVE, INTERVAL))),
        ),
        Mode::GlobalCeiling => Arc::new(SplitStore::new(
            batched(),
            Arc::new(cluster_store.clone()),
            |check: &Check| check.scope == Scope::Shared,
        )),
    }
}

/// `per_side` identities' keys on the master to be killed, and as many on the others.
fn identities_on_each_side(cluster: &RedisCluster, per_side: usize) -> (Vec<String>, Vec<String>) {
    let key = |index: usize| format!("fgfailover:{{ip:client-{index}}}:p:hourly");
    let mut killed = Vec::new();
    let mut healthy = Vec::new();
    for index in 0.. {
        let key = key(index);
        let side = if cluster.master_of(&key) == KILLED {
            &mut killed
        } else {
            &mut healthy
        };
        if side.len() < per_side {
            side.push(key);
        }
        if killed.len() == per_side && healthy.len() == killed.len() {
            break;
        }
    }
    (killed, healthy)
}

/// Each identity's decisions, from its tasks, in the order they ended.
async fn reports_of(
    tasks: Vec<(bool, String, tokio::task::JoinHandle<Vec<Decided>>)>,
    limit: u64,
) -> Vec<IdentityReport> {
    let mut identities: Vec<IdentityReport> = Vec::new();
    for (on_killed_master, key, task) in tasks {
        let decisions = task.await.expect("a load task");
        match identities.iter_mut().find(|identity| identity.key == key) {
            Some(identity) => identity.decisions.extend(decisions),
            None => identities.push(IdentityReport {
                key,
                on_killed_master,
                limit,
                decisions,
            }),
        }
    }
    for identity in &mut identities {
        identity.decisions.sort_by_key(|decided| decided.ended);
    }
    identities
}

/// Decides `checks` once per `turn` until `stop`; every decision with its times.
async fn decide_until(
    store: &dyn Store,
    checks: &[Check],
    stop: &AtomicBool,
    began: Instant,
    turn: Duration,
) -> Vec<Decided> {
    let mut decisions = Vec::new();
    let mut ticks = tokio::time::interval(turn);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::SeqCst) {
        ticks.tick().await;
        let started = began.elapsed();
        let outcome = match store.check_and_consume(checks, None).await {
            Ok(decision) if decision.is_allowed() => Outcome::Admitted,
            Ok(_) => Outcome::Denied,
            Err(StoreError::Config(error)) => panic!("a misconfigured store: {error}"),
            Err(_) => Outcome::Failed,
        };
        decisions.push(Decided {
            started,
            ended: began.elapsed(),
            outcome,
        });
    }
    decisions
}

/// Makes master `index` stop answering and kills it once its replica has every write it
/// acknowledged (see the module docs on asynchronous replication).
fn kill_caught_up(cluster: &mut RedisCluster, index: usize) {
    let master = &cluster.masters[index];
    let replica = &cluster.replicas[index][0];
    let _: () = master.command(&["CLIENT", "PAUSE", "30000", "WRITE"]);
    let offset = |info: String, field: &str| -> Option<u64> {
        info.lines()
            .find_map(|line| line.strip_prefix(field)?.trim().parse().ok())
    };
    crate::wait_until(
        Duration::from_secs(5),
        "the replica has every acknowledged write",
        || {
            let master_offset = offset(
                master.command(&["INFO", "replication"]),
                "master_repl_offset:",
            );
            let replica_offset = offset(
                replica.command(&["INFO", "replication"]),
                "slave_repl_offset:",
            );
            master_offset.is_some() && master_offset == replica_offset
        },
    );
    cluster.kill_master(index);
}
