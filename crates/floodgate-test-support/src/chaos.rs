//! A fault-schedule checker: a fleet of store nodes against real `redis-server` processes, a
//! [`FaultProxy`] in front of every Redis link, a mixed workload, and a random schedule of
//! faults drawn from a seed; every decision is recorded and the history checked afterwards
//! against the one promise that matters: never above the limit.
//!
//! ```text
//! seed ─► Schedule { deployment, faults at times }      (fastrand, reproducible)
//!            │
//!            ▼
//!  nodes (exact, batched, cluster, sharded, regions) ──proxies──► redis-server processes
//!            │ decisions and refunds, with their send and answer times
//!            ▼
//!  check: per limit key and window (or interval, for buckets), admitted ≤ allowance
//! ```
//!
//! **What is checked.** A decision counts where it certainly happened: between when it was
//! sent and when it was answered. For a window (`fixed_window`, and `sliding_window_counter`,
//! whose current window's count never exceeds its estimate), the cost of the decisions
//! admitted certainly inside one window, less every refund of them, is at most the limit; for
//! a bucket (`token_bucket`, `gcra`), over every interval between two decisions, at most its
//! capacity and its refill over the interval, plus every refund that may have landed inside;
//! a batched node's decision spends units its lease took from the bucket up to a lease's
//! lifetime earlier (the bound README documents: a bucket's lease held across a refill), so it
//! counts in the intervals that hold that whole span, and in a window only when it is 100 ms
//! clear of its edges (a node cuts a lease's window by its measure of the store's clock). A store that lost its
//! data (a Redis restarted empty: the documented loss of a store without persistence; a
//! cluster master killed, from its death to its replica's promotion, on its slots' keys) adds one
//! limit to every window or interval it falls in or precedes by at most a lease's lifetime (a
//! batched node spends what it was leased before); no other fault adds anything, a node
//! restarted included (a batched node's lease is counted in the store before it is spent, so
//! a restart loses capacity, never a count). Refunds whose
//! answer was lost count as applied: the bound only grows, so a refund applied twice (a
//! client library sending it again) shows as an admission above the limit. Once the faults
//! heal, a fresh identity must be admitted up to 90 % of its limit.
//!
//! A violation names its seed; `FLOODGATE_CHAOS_SEEDS=<seed>` replays it (see
//! `bench/chaos.sh`).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use floodgate::store::batched::LEASE_LIFETIME;
use floodgate::store::{BatchedStore, ConnectionMode, RedisStore, ShardedRedisStore};
use floodgate::time::Timestamp;
use floodgate::{Algorithm, Limit, Store, store::Check};

use crate::RedisServer;
use crate::cluster::{ClusterNode, RedisCluster};
use crate::faults::{Fault, FaultProxy};
use crate::regions::{GlobalSnapshot, Mode, Regions};

/// How the fleet shares its limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Deployment {
    /// Three exact nodes on one Redis, each through its own proxy.
    Exact,
    /// Three batched nodes (leases, 50 ms rounds) on one Redis, each through its own proxy.
    Batched,
    /// A Redis Cluster of three masters behind proxies: three exact nodes (a pool of four,
    /// one multiplexed connection, a pool of two).
    Cluster,
    /// The same cluster under three batched nodes (leases, 50 ms rounds), with the same
    /// connections.
    ClusterBatched,
    /// Three exact nodes, each sharding keys over two Redis servers behind proxies.
    Sharded,
    /// Two regions trading shares through a global store (behind a proxy per region), one
    /// gateway each.
    Regions,
}

impl Deployment {
    /// Every deployment, in the order seeds take them (`seed % 6`).
    pub const ALL: [Deployment; 6] = [
        Deployment::Exact,
        Deployment::Batched,
        Deployment::Cluster,
        Deployment::Sharded,
        Deployment::Regions,
        Deployment::ClusterBatched,
    ];
}

/// A fault the schedule injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// Replies held past the stores' deadline: calls applied, answers lost to the deadline.
    LateReplies,
    /// For a while, script calls applied and their answers dropped with their connection, one
    /// at a time (what follows a dropped call, a re-send included, goes through).
    DroppedAnswer,
    /// For a while, settlements (refunds) applied and their answers dropped with their
    /// connection, one at a time.
    DroppedSettlement,
    /// For a while, lease trades applied and their answers dropped with their connection, one
    /// at a time (batched nodes).
    DroppedTrade,
    /// For a while, every script call applied and its answer dropped with its connection
    /// (and whatever a client library sends again on a new one, the same).
    DroppedAnswers,
    /// A link that swallows everything for a while.
    BlackHole,
    /// A Redis killed and restarted empty (exact, batched, sharded).
    RestartedEmpty,
    /// The global store killed and restarted from a snapshot taken earlier (regions).
    RestoredFromSnapshot,
    /// A region cut off from the global store for a while (regions).
    Partition,
    /// A node (a gateway) stopped and started again at once: the leases it held, its numbered
    /// trades and the settlements of the requests it was serving are lost with it, and a new
    /// node with a new identity on the store takes its traffic (batched, cluster batched;
    /// regions: the region's gateway, whose table its region's store keeps).
    NodeRestarted,
    /// A cluster master killed (SIGKILL) and its replica promoted by the cluster: what the
    /// master had not replicated is lost (its slots' keys only, counted as a loss from the
    /// kill to the promotion), and its slots fail until the promotion (cluster, cluster
    /// batched; such a schedule's cluster has a replica per master).
    MasterKilled,
}

/// One fault of a schedule.
#[derive(Clone, Copy, Debug)]
pub struct FaultEvent {
    /// When, from the run's start.
    pub at: Duration,
    /// What.
    pub kind: FaultKind,
    /// Which link or server (an index, taken modulo what the deployment has).
    pub target: usize,
    /// How long it lasts (faults that last).
    pub lasts: Duration,
}

/// A seed's schedule: the deployment and its faults, in time order.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// The seed it was drawn from.
    pub seed: u64,
    /// The deployment.
    pub deployment: Deployment,
    /// The faults, by time.
    pub faults: Vec<FaultEvent>,
    /// How long the load runs (faults all heal by then).
    pub run: Duration,
}

impl Schedule {
    /// The schedule of `seed`: its deployment is `Deployment::ALL[seed % 6]`, its faults drawn
    /// by `fastrand` from the seed.
    pub fn of(seed: u64) -> Schedule {
        let deployment = Deployment::ALL[(seed % Deployment::ALL.len() as u64) as usize];
        let mut rng = fastrand::Rng::with_seed(seed);
        let kinds = fault_kinds(deployment);
        // A cluster has three links to hit, and its faults are the calls' own: more of them.
        let count = match deployment {
            Deployment::Cluster | Deployment::ClusterBatched => rng.usize(8..=14),
            _ => rng.usize(4..=9),
        };
        let mut faults: Vec<FaultEvent> = (0..count)
            .map(|_| FaultEvent {
                at: Duration::from_millis(rng.u64(150..2_100)),
                kind: kinds[rng.usize(..kinds.len())],
                target: rng.usize(..6),
                lasts: Duration::from_millis(rng.u64(80..400)),
            })
            .collect();
        if deployment == Deployment::Regions {
            // One restore in every regions schedule, of the snapshot taken at the start, after
            // the first region borrowed the second's share and before the second region's
            // clients arrive ([`REGION_ARRIVES`]).
            faults.push(FaultEvent {
                at: Duration::from_millis(rng.u64(1_000..1_400)),
                kind: FaultKind::RestoredFromSnapshot,
                target: 0,
                lasts: Duration::ZERO,
            });
        }
        let run = add_restarts_and_kills(deployment, &mut rng, &mut faults);
        faults.sort_by_key(|fault| fault.at);
        Schedule {
            seed,
            deployment,
            faults,
            run,
        }
    }
}

/// The faults a deployment's schedule draws from (a kind listed twice is drawn twice as often).
fn fault_kinds(deployment: Deployment) -> &'static [FaultKind] {
    match deployment {
        Deployment::Exact | Deployment::Sharded => &[
            FaultKind::LateReplies,
            FaultKind::DroppedAnswer,
            FaultKind::DroppedSettlement,
            FaultKind::DroppedAnswers,
            FaultKind::BlackHole,
            FaultKind::RestartedEmpty,
        ],
        Deployment::Batched => &[
            FaultKind::LateReplies,
            FaultKind::DroppedAnswer,
            FaultKind::DroppedTrade,
            FaultKind::DroppedAnswers,
            FaultKind::BlackHole,
            FaultKind::RestartedEmpty,
        ],
        Deployment::Cluster => &[
            FaultKind::LateReplies,
            FaultKind::DroppedAnswer,
            FaultKind::DroppedSettlement,
            FaultKind::DroppedSettlement,
            FaultKind::DroppedAnswers,
            FaultKind::BlackHole,
        ],
        Deployment::ClusterBatched => &[
            FaultKind::LateReplies,
            FaultKind::DroppedAnswer,
            FaultKind::DroppedTrade,
            FaultKind::DroppedTrade,
            FaultKind::DroppedAnswers,
            FaultKind::BlackHole,
        ],
        Deployment::Regions => &[
            FaultKind::LateReplies,
            FaultKind::Partition,
            FaultKind::RestoredFromSnapshot,
        ],
    }
}

/// Adds node restarts (batched, cluster batched, regions) and a master kill (a third of the
/// cluster schedules), drawn after every other fault so that adding them left the schedules
/// of earlier seeds otherwise as they were; returns how long the load runs (longer with a
/// kill: a promotion takes the node timeout, 1 s, and an election, and the load runs on for
/// a while after it).
fn add_restarts_and_kills(
    deployment: Deployment,
    rng: &mut fastrand::Rng,
    faults: &mut Vec<FaultEvent>,
) -> Duration {
    if matches!(
        deployment,
        Deployment::Batched | Deployment::ClusterBatched | Deployment::Regions
    ) {
        for _ in 0..rng.usize(0..=2) {
            faults.push(FaultEvent {
                at: Duration::from_millis(rng.u64(300..2_000)),
                kind: FaultKind::NodeRestarted,
                target: rng.usize(..6),
                lasts: Duration::ZERO,
            });
        }
    }
    if matches!(deployment, Deployment::Cluster | Deployment::ClusterBatched) && rng.usize(..3) == 0
    {
        faults.push(FaultEvent {
            at: Duration::from_millis(rng.u64(300..1_000)),
            kind: FaultKind::MasterKilled,
            target: rng.usize(..3),
            lasts: Duration::ZERO,
        });
        return Duration::from_millis(5_500);
    }
    Duration::from_millis(2_500)
}

/// How far a batched node's view of the shared store's clock may be from it: the node cuts a
/// lease's window by an offset measured from round trips, each up to a deadline long.
const LEASED_CLOCK_SLACK: Duration = Duration::from_millis(100);

/// When a regions schedule takes its snapshot of the global store.
const SNAPSHOT_AT: Duration = Duration::from_millis(100);

/// When the second region's clients start (until then the first region has the limit to
/// itself, and borrows the second's share).
const REGION_ARRIVES: Duration = Duration::from_millis(1_500);

/// What a decision answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Admitted.
    Admitted,
    /// Denied.
    Denied,
    /// The store failed.
    Failed,
}

/// One decision of the history.
#[derive(Clone, Debug)]
pub struct Decided {
    /// The node that decided.
    pub node: usize,
    /// Decided by a batched node, from a lease: its units may have left the shared bucket as
    /// long as a lease lives before it was sent.
    pub leased: bool,
    /// The identity.
    pub identity: usize,
    /// The keys of the limits checked, with their limits.
    pub keys: Vec<(Arc<str>, Arc<Limit>)>,
    /// Its cost.
    pub cost: u64,
    /// Sent and answered, µs since the epoch.
    pub sent: u64,
    /// Answered, µs since the epoch.
    pub answered: u64,
    /// What it answered.
    pub answer: Answer,
    /// Its settlement, if some of its cost was given back after it was admitted (answered or
    /// not: counted as applied).
    pub refund: Option<Refund>,
}

/// Units given back after a decision, and when the refund was sent and answered (µs since the
/// epoch): it may have been applied at any moment between.
#[derive(Clone, Copy, Debug)]
pub struct Refund {
    /// Units given back.
    pub units: u64,
    /// Sent.
    pub sent: u64,
    /// Answered (or failed).
    pub answered: u64,
}

impl Decided {
    /// Its cost less what was given back.
    fn kept(&self) -> u64 {
        self.cost - self.refund.map_or(0, |refund| refund.units)
    }

    /// When, by the shared store's clock, it may have been counted in a window: between its
    /// sending and its answer; for a batched node's, within [`LEASED_CLOCK_SLACK`] of them
    /// (the node cuts windows by its estimate of the store's clock, measured by round trips).
    fn window_span(&self) -> (u64, u64) {
        if self.leased {
            let slack = LEASED_CLOCK_SLACK.as_micros() as u64;
            (self.sent.saturating_sub(slack), self.answered + slack)
        } else {
            (self.sent, self.answered)
        }
    }

    /// The earliest its units may have left a shared bucket (µs since the epoch): when it was
    /// sent, or, from a lease, a lease's lifetime before (a bucket's lease held across a refill,
    /// the bound README documents for batched mode).
    fn earliest(&self) -> u64 {
        if self.leased {
            self.sent.saturating_sub(LEASE_LIFETIME.as_micros() as u64)
        } else {
            self.sent
        }
    }
}

/// A violation of the history.
#[derive(Clone, Debug)]
pub struct Violation {
    /// The seed whose schedule found it.
    pub seed: u64,
    /// What was exceeded, and by how much.
    pub what: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "seed {}: {}\n  replay: FLOODGATE_CHAOS_SEEDS={} cargo test -p floodgate --test it chaos:: -- --nocapture",
            self.seed, self.what, self.seed
        )
    }
}

/// A schedule run and checked.
#[derive(Debug)]
pub struct Outcome {
    /// The schedule.
    pub schedule: Schedule,
    /// Every decision, in no particular order.
    pub history: Vec<Decided>,
    /// The faults injected, by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// When a store lost its data.
    pub losses: Vec<Loss>,
    /// What the fresh identity after the heal got, and of how much.
    pub fresh: (u64, u64),
    /// What the check found.
    pub violations: Vec<Violation>,
}

fn epoch_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros() as u64)
}

/// The limits every identity is checked against: its own, by algorithm, and a fleet-wide
/// one that every decision names too.
fn limits(deployment: Deployment) -> (Vec<Arc<Limit>>, Arc<Limit>) {
    let second = Duration::from_secs(1);
    let build = |name: &str, algorithm, limit, window, burst: Option<u64>| {
        let mut builder = Limit::builder(name)
            .algorithm(algorithm)
            .limit(limit)
            .window(window);
        if let Some(burst) = burst {
            builder = builder.burst(burst);
        }
        Arc::new(builder.build().expect("a valid limit"))
    };
    if deployment == Deployment::Regions {
        // A window that outlasts the run: what a forgetful global store re-grants shows whole.
        let long = Duration::from_secs(600);
        return (
            vec![
                build("fw", Algorithm::FixedWindow, 60, long, None),
                build("tb", Algorithm::TokenBucket, 40, second, Some(40)),
            ],
            build("all", Algorithm::FixedWindow, 400, long, None),
        );
    }
    (
        vec![
            build("fw", Algorithm::FixedWindow, 30, second, None),
            build("swc", Algorithm::SlidingWindowCounter, 30, second, None),
            build("tb", Algorithm::TokenBucket, 30, second, Some(15)),
            build("gcra", Algorithm::Gcra, 30, second, Some(10)),
        ],
        build("all", Algorithm::FixedWindow, 150, second, None),
    )
}

/// One node of the fleet: a gateway's store, which a restart replaces by a new one built the
/// same way (what the old one held in memory is lost; a call it had in flight still ends, as
/// a call a killed process sent may still be applied).
struct Node {
    /// How many times it was restarted, and the store it decides with now.
    current: Mutex<(u64, Arc<dyn Store>)>,
    /// Builds the store of a restarted node (none: the node cannot be restarted).
    start: Option<Box<dyn Fn() -> Arc<dyn Store> + Send + Sync>>,
}

impl Node {
    /// A node that restarts by calling `start` again.
    fn restartable(start: impl Fn() -> Arc<dyn Store> + Send + Sync + 'static) -> Node {
        Node {
            current: Mutex::new((0, start())),
            start: Some(Box::new(start)),
        }
    }

    /// A node that restarts only as its harness says (a region's gateway), or never (a
    /// sharded node, which holds nothing a restart would lose).
    fn fixed(store: Arc<dyn Store>) -> Node {
        Node {
            current: Mutex::new((0, store)),
            start: None,
        }
    }

    /// Its restarts so far, and its store now.
    fn current(&self) -> (u64, Arc<dyn Store>) {
        let current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        (current.0, current.1.clone())
    }

    /// Replaces the store by a new one; whether the node could be restarted.
    fn restart(&self) -> bool {
        let Some(start) = &self.start else {
            return false;
        };
        self.restarted_as(start());
        true
    }

    /// Goes on with `store`, started again elsewhere (a region's gateway).
    fn restarted_as(&self, store: Arc<dyn Store>) {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        *current = (current.0 + 1, store);
    }
}

/// The servers and proxies of a deployment, kept alive for the run, and the fault switches.
struct Fleet {
    nodes: Vec<Arc<Node>>,
    /// Per node, whether it decides from leases (batched).
    leasing: Vec<bool>,
    /// Links a fault can be set on.
    proxies: Vec<Arc<FaultProxy>>,
    /// Servers that can be restarted empty.
    servers: Vec<RedisServer>,
    regions: Option<Regions>,
    cluster: Option<RedisCluster>,
}

fn redis_store(url: String, mode: ConnectionMode) -> RedisStore {
    RedisStore::builder(url)
        .connection_mode(mode)
        .timeout(Duration::from_millis(100))
        .breaker(5, Duration::from_millis(200))
        .build()
        .expect("a Redis store")
}

fn exact(store: RedisStore) -> Arc<dyn Store> {
    Arc::new(store)
}

fn batched(store: RedisStore) -> Arc<dyn Store> {
    Arc::new(
        BatchedStore::builder(store)
            .sync_interval(Duration::from_millis(50))
            .build(),
    )
}

/// The fleet of `schedule`'s deployment (a cluster with a replica per master if a master is
/// killed).
fn fleet(schedule: &Schedule) -> Fleet {
    let deployment = schedule.deployment;
    let replicas = usize::from(
        schedule
            .faults
            .iter()
            .any(|fault| fault.kind == FaultKind::MasterKilled),
    );
    let mut fleet = Fleet {
        nodes: Vec::new(),
        leasing: Vec::new(),
        proxies: Vec::new(),
        servers: Vec::new(),
        regions: None,
        cluster: None,
    };
    match deployment {
        Deployment::Exact | Deployment::Batched => {
            let server = RedisServer::start();
            let kind = if deployment == Deployment::Batched {
                batched
            } else {
                exact
            };
            for _ in 0..3 {
                let proxy = Arc::new(FaultProxy::start(server.port()));
                let url = proxy.url();
                fleet.nodes.push(Arc::new(Node::restartable(move || {
                    kind(redis_store(url.clone(), ConnectionMode::Multiplexed))
                })));
                fleet.proxies.push(proxy);
            }
            fleet.servers.push(server);
        }
        Deployment::Sharded => {
            let servers = [RedisServer::start(), RedisServer::start()];
            for _ in 0..3 {
                let mut shards = Vec::new();
                for (index, server) in servers.iter().enumerate() {
                    let proxy = Arc::new(FaultProxy::start(server.port()));
                    shards.push((
                        format!("shard-{index}"),
                        redis_store(proxy.url(), ConnectionMode::Multiplexed),
                    ));
                    fleet.proxies.push(proxy);
                }
                let store: Arc<dyn Store> =
                    Arc::new(ShardedRedisStore::new(shards).expect("shards"));
                fleet.nodes.push(Arc::new(Node::fixed(store)));
            }
            fleet.servers.extend(servers);
        }
        Deployment::Cluster | Deployment::ClusterBatched => {
            let cluster = RedisCluster::start_proxied(3, replicas);
            let kind = if deployment == Deployment::ClusterBatched {
                batched
            } else {
                exact
            };
            for mode in [
                ConnectionMode::Pool(4),
                ConnectionMode::Multiplexed,
                ConnectionMode::Pool(2),
            ] {
                let urls = cluster.urls();
                fleet.nodes.push(Arc::new(Node::restartable(move || {
                    kind(
                        RedisStore::cluster(urls.clone())
                            .connection_mode(mode)
                            .timeout(Duration::from_millis(100))
                            .breaker(5, Duration::from_millis(200))
                            .build()
                            .expect("a cluster store"),
                    )
                })));
            }
            fleet.cluster = Some(cluster);
        }
        Deployment::Regions => {
            let regions = Regions::start(Mode::Traded, 2, 1, Duration::from_millis(100));
            for gateway in regions.gateways.iter().flatten() {
                let store: Arc<dyn Store> = gateway.clone();
                fleet.nodes.push(Arc::new(Node::fixed(store)));
            }
            fleet.regions = Some(regions);
        }
    }
    let leases = matches!(deployment, Deployment::Batched | Deployment::ClusterBatched);
    fleet.leasing = vec![leases; fleet.nodes.len()];
    fleet
}

impl Fleet {
    /// The proxy fault `kind` targets, if this fleet has one.
    fn proxy(&self, target: usize) -> Option<&FaultProxy> {
        if let Some(regions) = &self.regions {
            return Some(&regions.links[target % regions.links.len()]);
        }
        if let Some(cluster) = &self.cluster {
            let nodes = cluster.nodes();
            return Some(cluster.proxy(nodes[target % nodes.len()]));
        }
        (!self.proxies.is_empty()).then(|| &*self.proxies[target % self.proxies.len()])
    }

    fn heal(&self) {
        for proxy in &self.proxies {
            proxy.set(Fault::None);
        }
        if let Some(regions) = &self.regions {
            for link in &regions.links {
                link.set(Fault::None);
            }
        }
        if let Some(cluster) = &self.cluster {
            for node in cluster.nodes() {
                cluster.proxy(node).set(Fault::None);
            }
        }
    }
}

/// Drives the workload on `node` until `stop`: decisions as fast as the node answers (a
/// pause of 2 ms between them), identities and costs drawn from `seed`, every few admitted
/// decisions given a unit back (by the same run of the node: a restart loses the
/// settlements of what it was serving, whose charge stands).
async fn drive(
    (node_index, leased): (usize, bool),
    node: Arc<Node>,
    identities: Arc<Vec<Arc<Limit>>>,
    all: Arc<Limit>,
    seed: u64,
    stop: Arc<AtomicBool>,
    start_after: Duration,
) -> Vec<Decided> {
    tokio::time::sleep(start_after).await;
    let mut rng = fastrand::Rng::with_seed(seed ^ ((node_index as u64 + 1) * 0x9E37_79B9));
    let mut history: Vec<Decided> = Vec::new();
    // Settlements to send: (when, the decision's index, its time, the units given back). As
    // a response's real cost is known when it ends, a refund goes 20 to 400 ms after its
    // decision (a streamed answer), so that faults find refunds in flight, several per node,
    // as they find decisions.
    let mut settlements: std::collections::VecDeque<(Instant, u64, usize, Timestamp, u64)> =
        std::collections::VecDeque::new();
    while !stop.load(Ordering::Relaxed) {
        let (run, store) = node.current();
        while settlements
            .front()
            .is_some_and(|(due, ..)| *due <= Instant::now())
        {
            let Some((_, decided_by, index, decided_at, units)) = settlements.pop_front() else {
                break;
            };
            if decided_by != run {
                continue;
            }
            let refund: Vec<Check> = history[index]
                .keys
                .iter()
                .map(|(key, limit)| Check::new(key.clone(), limit.clone(), units))
                .collect();
            // Counted as applied whatever it answers (see the module docs).
            let sent = epoch_micros();
            let _ = store.refund(&refund, decided_at, None).await;
            history[index].refund = Some(Refund {
                units,
                sent,
                answered: epoch_micros(),
            });
        }
        let identity = rng.usize(..identities.len());
        let limit = &identities[identity];
        let cost = rng.u64(1..=4);
        let keys: Vec<(Arc<str>, Arc<Limit>)> = vec![
            (
                format!("chaos:{{id{identity}}}:{}", limit.name()).into(),
                limit.clone(),
            ),
            ("chaos:{all}:all".into(), all.clone()),
        ];
        let checks: Vec<Check> = keys
            .iter()
            .map(|(key, limit)| Check::new(key.clone(), limit.clone(), cost))
            .collect();
        let sent = epoch_micros();
        let result = store.check_and_consume(&checks, None).await;
        let answered = epoch_micros();
        let answer = match &result {
            Ok(decision) if decision.is_allowed() => {
                if cost > 1 && rng.bool() {
                    let due = Instant::now() + Duration::from_millis(rng.u64(20..400));
                    let units = rng.u64(1..cost);
                    settlements.push_back((due, run, history.len(), decision.decided_at(), units));
                }
                Answer::Admitted
            }
            Ok(_) => Answer::Denied,
            Err(_) => Answer::Failed,
        };
        history.push(Decided {
            node: node_index,
            leased,
            identity,
            keys,
            cost,
            sent,
            answered,
            answer,
            refund: None,
        });
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    history
}

/// A store that lost data: from when (µs since the epoch) to when it served again, and the
/// slots it lost (none: every key).
#[derive(Clone, Debug)]
pub struct Loss {
    /// When it was killed.
    pub from: u64,
    /// When it served again (restarted, or its replica promoted).
    pub to: u64,
    /// The slot ranges (first, last) it served, for a cluster master; `None` for a whole store.
    pub slots: Option<Vec<(u16, u16)>>,
}

impl Loss {
    /// Whether it can have lost `key`'s count.
    fn covers(&self, key: &str) -> bool {
        let slot = floodgate::store::redis::hash_slot(key);
        self.slots.as_ref().is_none_or(|ranges| {
            ranges
                .iter()
                .any(|(first, last)| (*first..=*last).contains(&slot))
        })
    }
}

/// A killed master whose replica's promotion a thread of its own watches.
struct Promotion {
    master: usize,
    killed: u64,
    slots: Vec<(u16, u16)>,
    /// When the replica first reported itself master (µs since the epoch; 0 until then).
    promoted: Arc<AtomicU64>,
}

/// Watches the replica on `port` (directly, not through its proxy) until it reports itself
/// master, from a thread of its own so that the schedule goes on meanwhile.
fn watch_promotion(port: u16) -> Arc<AtomicU64> {
    let promoted = Arc::new(AtomicU64::new(0));
    let mark = promoted.clone();
    std::thread::spawn(move || {
        let started = Instant::now();
        let Ok(client) = deadpool_redis::redis::Client::open(format!("redis://127.0.0.1:{port}"))
        else {
            return;
        };
        while started.elapsed() < Duration::from_secs(30) {
            let role = client.get_connection().and_then(|mut connection| {
                deadpool_redis::redis::cmd("INFO")
                    .arg("replication")
                    .query::<String>(&mut connection)
            });
            if role.is_ok_and(|info| info.contains("role:master")) {
                mark.store(epoch_micros(), Ordering::Release);
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    promoted
}

/// Runs `schedule` against a fresh fleet and checks its history. Call inside a multi-thread
/// Tokio runtime.
pub async fn run(schedule: Schedule) -> Outcome {
    let (identities, all) = limits(schedule.deployment);
    let mut fleet = fleet(&schedule);
    if let Some(regions) = &fleet.regions {
        for gateway in regions.gateways.iter().flatten() {
            gateway.probe().await.expect("the region's table loads");
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let drivers = spawn_drivers(&schedule, &fleet, Arc::new(identities), all, &stop);
    let started = Instant::now();
    let snapshot = match &fleet.regions {
        Some(regions) => {
            tokio::time::sleep(SNAPSHOT_AT).await;
            Some(regions.snapshot_global())
        }
        None => None,
    };
    let mut injector = Injector {
        fleet: &mut fleet,
        started,
        snapshot,
        faults: BTreeMap::new(),
        losses: Vec::new(),
        healing: Vec::new(),
        promotions: Vec::new(),
    };
    for event in &schedule.faults {
        injector.heal_due(event.at).await;
        tokio::time::sleep(event.at.saturating_sub(started.elapsed())).await;
        injector.inject(event).await;
    }
    let Injector {
        faults,
        mut losses,
        promotions,
        ..
    } = injector;
    tokio::time::sleep(schedule.run.saturating_sub(started.elapsed())).await;
    fleet.heal();
    if let Some(cluster) = &fleet.cluster {
        for promotion in promotions {
            // Done long before, as a rule: the whole cluster seen well again.
            tokio::task::block_in_place(|| {
                cluster.wait_for_promotion(promotion.master, Duration::from_secs(20));
            });
            let to = match promotion.promoted.load(Ordering::Acquire) {
                0 => epoch_micros(),
                at => at,
            };
            losses.push(Loss {
                from: promotion.killed,
                to,
                slots: Some(promotion.slots),
            });
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut history = Vec::new();
    for driver in drivers {
        history.extend(driver.await.expect("a driver"));
    }
    let fresh = fresh_identity(&fleet, schedule.deployment).await;
    let violations = check(&schedule, &history, &losses, fresh);
    Outcome {
        schedule,
        history,
        faults,
        losses,
        fresh,
        violations,
    }
}

/// One driver per node, until `stop` (a regions schedule's second region starts late).
fn spawn_drivers(
    schedule: &Schedule,
    fleet: &Fleet,
    identities: Arc<Vec<Arc<Limit>>>,
    all: Arc<Limit>,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<Decided>>> {
    fleet
        .nodes
        .iter()
        .enumerate()
        .map(|(index, node)| {
            let start_after = match schedule.deployment {
                Deployment::Regions if index > 0 => REGION_ARRIVES,
                _ => Duration::ZERO,
            };
            tokio::spawn(drive(
                (index, fleet.leasing[index]),
                node.clone(),
                identities.clone(),
                all.clone(),
                schedule.seed,
                stop.clone(),
                start_after,
            ))
        })
        .collect()
}

/// Injects a schedule's faults into a fleet and heals those that last.
struct Injector<'f> {
    fleet: &'f mut Fleet,
    started: Instant,
    /// The global store's snapshot a restore goes back to (regions).
    snapshot: Option<GlobalSnapshot>,
    /// Faults injected, by kind.
    faults: BTreeMap<FaultKind, u64>,
    /// Each restart's loss.
    losses: Vec<Loss>,
    /// Each killed master, until its promotion is read after the run.
    promotions: Vec<Promotion>,
    /// Faults that last: until when (from the start), on which target.
    healing: Vec<(Duration, usize)>,
}

impl Injector<'_> {
    /// Heals every fault due to end by `before` (from the start), each at its time.
    async fn heal_due(&mut self, before: Duration) {
        while let Some(&(until, target)) = self.healing.iter().min_by_key(|(until, _)| *until) {
            if until > before {
                break;
            }
            tokio::time::sleep(until.saturating_sub(self.started.elapsed())).await;
            if let Some(proxy) = self.fleet.proxy(target) {
                proxy.set(Fault::None);
            }
            self.healing.retain(|&(at, t)| (at, t) != (until, target));
        }
    }

    /// Drops answers one at a time with `once` (armed again each time a call took it) for as
    /// long as `event` lasts: many calls lose their answers, while a call sent again on a new
    /// connection goes through (the proxy of the report that found a client library's
    /// re-sends). Whether the fleet has the link.
    async fn drop_answers(&self, event: &FaultEvent, once: Fault) -> bool {
        let Some(proxy) = self.fleet.proxy(event.target) else {
            return false;
        };
        let until = event.at + event.lasts;
        while self.started.elapsed() < until {
            if proxy.fault() == Fault::None {
                proxy.set(once);
            }
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        proxy.set(Fault::None);
        true
    }

    /// Injects `event` now, if the fleet has what it targets.
    async fn inject(&mut self, event: &FaultEvent) {
        let injected = match event.kind {
            FaultKind::LateReplies
            | FaultKind::BlackHole
            | FaultKind::Partition
            | FaultKind::DroppedAnswers => {
                let fault = match event.kind {
                    FaultKind::LateReplies => Fault::DelayReplies(Duration::from_millis(300)),
                    FaultKind::DroppedAnswers => Fault::DropCalls,
                    _ => Fault::BlackHole,
                };
                let proxy = self.fleet.proxy(event.target);
                if let Some(proxy) = proxy {
                    proxy.set(fault);
                    self.healing.push((event.at + event.lasts, event.target));
                }
                proxy.is_some()
            }
            FaultKind::DroppedAnswer | FaultKind::DroppedSettlement | FaultKind::DroppedTrade => {
                let once = match event.kind {
                    FaultKind::DroppedSettlement => Fault::DropNextCallWith("refund"),
                    FaultKind::DroppedTrade => Fault::DropNextCallWith("lease"),
                    _ => Fault::DropNextCall,
                };
                self.drop_answers(event, once).await
            }
            FaultKind::RestartedEmpty => {
                let count = self.fleet.servers.len().max(1);
                match self.fleet.servers.get_mut(event.target % count) {
                    Some(server) => {
                        let from = epoch_micros();
                        server.restart();
                        self.losses.push(Loss {
                            from,
                            to: epoch_micros(),
                            slots: None,
                        });
                        true
                    }
                    None => false,
                }
            }
            FaultKind::MasterKilled => match self.fleet.cluster.as_mut() {
                Some(cluster) => {
                    let master = event.target % 3;
                    let slots = cluster.slots_of(master);
                    let replica = ClusterNode::Replica { master, replica: 0 };
                    let promoted = watch_promotion(cluster.server(replica).port());
                    let killed = epoch_micros();
                    cluster.kill_master(master);
                    self.promotions.push(Promotion {
                        master,
                        killed,
                        slots,
                        promoted,
                    });
                    true
                }
                None => false,
            },
            FaultKind::NodeRestarted => {
                let index = event.target % self.fleet.nodes.len();
                match self.fleet.regions.as_mut() {
                    // One gateway per region: node `index` is region `index`'s.
                    Some(regions) => {
                        regions.restart_region(index);
                        let store: Arc<dyn Store> = regions.gateways[index][0].clone();
                        self.fleet.nodes[index].restarted_as(store);
                        true
                    }
                    None => self.fleet.nodes[index].restart(),
                }
            }
            FaultKind::RestoredFromSnapshot => {
                match (self.fleet.regions.as_mut(), self.snapshot.as_ref()) {
                    (Some(regions), Some(snapshot)) => {
                        regions.restart_global_from(snapshot);
                        true
                    }
                    _ => false,
                }
            }
        };
        if injected {
            *self.faults.entry(event.kind).or_insert(0) += 1;
        }
    }
}

/// Once the faults heal (breakers given their time to close), a fresh identity asks for its
/// whole limit, one unit at a time: what it got, of how much.
async fn fresh_identity(fleet: &Fleet, deployment: Deployment) -> (u64, u64) {
    let window = Duration::from_secs(600);
    let limit = Arc::new(
        Limit::builder("fresh")
            .algorithm(Algorithm::FixedWindow)
            .limit(40)
            .window(window)
            .build()
            .expect("a valid limit"),
    );
    let key: Arc<str> = format!("chaos:{{fresh-{deployment:?}}}:fresh").into();
    let checks = [Check::new(key, limit.clone(), 1)];
    let healed = Instant::now();
    let mut admitted = 0;
    let mut asked = 0;
    while asked < limit.limit() && healed.elapsed() < Duration::from_secs(5) {
        // Regions: spread, as shares start at the fixed ones; elsewhere one node, whose first
        // sight of the identity is the only one (a batched node denies while it leases).
        let (_, node) = match deployment {
            Deployment::Regions => fleet.nodes[asked as usize % fleet.nodes.len()].current(),
            _ => fleet.nodes[0].current(),
        };
        match node.check_and_consume(&checks, None).await {
            Ok(decision) => {
                asked += 1;
                admitted += u64::from(decision.is_allowed());
            }
            // A breaker still open, a connection being made again: asked again shortly.
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
        if deployment == Deployment::Regions {
            // Shares follow demand at the rounds' pace.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    (admitted, limit.limit())
}

/// Every window of `window_micros` that holds admitted cost: (window start, the decisions
/// admitted certainly inside it).
fn by_window(admitted: &[&Decided], window_micros: u64) -> BTreeMap<u64, Vec<usize>> {
    let mut windows: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (index, decision) in admitted.iter().enumerate() {
        let (from, to) = decision.window_span();
        let start = from / window_micros * window_micros;
        if to < start + window_micros {
            windows.entry(start).or_default().push(index);
        }
    }
    windows
}

/// Checks a history against its limits (see the module docs).
pub fn check(
    schedule: &Schedule,
    history: &[Decided],
    losses: &[Loss],
    fresh: (u64, u64),
) -> Vec<Violation> {
    let mut violations = Vec::new();
    let mut per_key: BTreeMap<Arc<str>, (Arc<Limit>, Vec<&Decided>)> = BTreeMap::new();
    for decision in history.iter().filter(|d| d.answer == Answer::Admitted) {
        for (key, limit) in &decision.keys {
            per_key
                .entry(key.clone())
                .or_insert_with(|| (limit.clone(), Vec::new()))
                .1
                .push(decision);
        }
    }
    for (key, (limit, mut admitted)) in per_key {
        // A loss of this key's count (killed to back) weighs on what overlaps it or follows
        // it by a lease's lifetime: a batched node spends what it was leased before the store
        // forgot granting it.
        let lost_between = |from: u64, to: u64| {
            let lifetime = LEASE_LIFETIME.as_micros() as u64;
            losses
                .iter()
                .filter(|loss| loss.covers(&key) && loss.from <= to && loss.to + lifetime >= from)
                .count() as u64
        };
        admitted.sort_by_key(|decision| decision.sent);
        let over = match limit.algorithm() {
            Algorithm::TokenBucket | Algorithm::Gcra => {
                check_bucket(&limit, &admitted, lost_between)
            }
            _ => check_windows(&limit, &admitted, lost_between),
        };
        if let Some(what) = over {
            violations.push(Violation {
                seed: schedule.seed,
                what: format!("{:?} {key}: {what}", schedule.deployment),
            });
        }
    }
    let (got, of) = fresh;
    if got * 10 < of * 9 {
        violations.push(Violation {
            seed: schedule.seed,
            what: format!(
                "{:?}: after the faults healed, a fresh identity got {got} of {of}",
                schedule.deployment
            ),
        });
    }
    violations
}

fn check_windows(
    limit: &Limit,
    admitted: &[&Decided],
    lost_between: impl Fn(u64, u64) -> u64,
) -> Option<String> {
    let window = limit.window_micros();
    for (start, members) in by_window(admitted, window) {
        let spent: u64 = members.iter().map(|&index| admitted[index].kept()).sum();
        let allowance = limit.limit() * (1 + lost_between(start, start + window));
        if spent > allowance {
            return Some(format!(
                "{spent} admitted in the window starting at {start} µs, allowance {allowance}"
            ));
        }
    }
    None
}

/// A bucket: over every interval from a decision's sending (a lease's lifetime earlier for a
/// batched node's, [`Decided::earliest`]) to another's answer, what was admitted certainly
/// inside (at full cost) is at most the capacity (again after each loss), the refill over the
/// interval, and every refund that may have been applied inside it.
fn check_bucket(
    limit: &Limit,
    admitted: &[&Decided],
    lost_between: impl Fn(u64, u64) -> u64,
) -> Option<String> {
    let capacity = limit.capacity() as f64;
    let per_micro = limit.limit() as f64 / limit.window_micros() as f64;
    let refunds: Vec<Refund> = admitted.iter().filter_map(|d| d.refund).collect();
    // By the earliest their units may have left the bucket: every later one began inside.
    let mut by_earliest = admitted.to_vec();
    by_earliest.sort_by_key(|decision| decision.earliest());
    for (first, from) in by_earliest.iter().enumerate() {
        let start = from.earliest();
        // By their answer, the intervals' ends in order.
        let mut ends: Vec<(u64, u64)> = by_earliest[first..]
            .iter()
            .map(|d| (d.answered, d.cost))
            .collect();
        ends.sort_unstable();
        let mut inside = 0;
        for (end, cost) in ends {
            inside += cost;
            let span = end.saturating_sub(start) as f64;
            let refunded: u64 = refunds
                .iter()
                .filter(|refund| refund.sent <= end && refund.answered >= start)
                .map(|refund| refund.units)
                .sum();
            let losses = lost_between(start, end) as f64;
            let allowance = capacity * (1.0 + losses) + per_micro * span + refunded as f64;
            if inside as f64 > allowance + 1e-6 {
                return Some(format!(
                    "{inside} admitted within {:.0} ms, allowance {allowance:.1}",
                    span / 1000.0
                ));
            }
        }
    }
    None
}

/// A schedule's summary line, and the totals of many.
#[derive(Debug, Default)]
pub struct Summary {
    /// Schedules run.
    pub schedules: u64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Decisions checked.
    pub decisions: u64,
    /// Decisions admitted.
    pub admitted: u64,
    /// Decisions that failed (a store error).
    pub failed: u64,
    /// Violations found.
    pub violations: Vec<Violation>,
    /// Schedules by deployment.
    pub deployments: BTreeMap<Deployment, u64>,
}

impl Summary {
    /// Adds an outcome.
    pub fn add(&mut self, outcome: &Outcome) {
        self.schedules += 1;
        *self
            .deployments
            .entry(outcome.schedule.deployment)
            .or_insert(0) += 1;
        for (kind, count) in &outcome.faults {
            *self.faults.entry(*kind).or_insert(0) += count;
        }
        self.decisions += outcome.history.len() as u64;
        self.admitted += outcome
            .history
            .iter()
            .filter(|d| d.answer == Answer::Admitted)
            .count() as u64;
        self.failed += outcome
            .history
            .iter()
            .filter(|d| d.answer == Answer::Failed)
            .count() as u64;
        self.violations.extend(outcome.violations.iter().cloned());
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "schedules: {} {:?}", self.schedules, self.deployments)?;
        writeln!(f, "faults injected: {:?}", self.faults)?;
        writeln!(
            f,
            "decisions checked: {} ({} admitted, {} failed)",
            self.decisions, self.admitted, self.failed
        )?;
        write!(f, "violations: {}", self.violations.len())?;
        for violation in &self.violations {
            write!(f, "\n{violation}")?;
        }
        Ok(())
    }
}
