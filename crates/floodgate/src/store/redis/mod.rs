//! The Redis store: one atomic Lua call per decision, every algorithm, shared by any number of
//! servers.
//!
//! All limits of a request whose keys share a hash slot (one identity's limits do, through the
//! `{…}` tag of their keys) are checked and consumed by one script call, atomically. On a single
//! Redis node every key can go into one call; [`RedisStoreBuilder::cluster_compatible`] instead
//! calls once per slot, in the order of the checks (global → per IP → per client → per
//! endpoint), and refunds what earlier calls took when a later one denies.
//!
//! Time comes from the Redis server (`TIME` in the script), so that gateways with skewed clocks
//! agree. Every call has a deadline and goes through a circuit breaker ([`Guard`]).

mod cluster;
mod coalesce;
mod connection;
mod deny_cache;
mod groups;
mod overrides;
mod resets;
mod script;
mod server_clock;
mod sharded;
mod silence;
mod slot;

pub use deny_cache::RESETS_CHANNEL;

pub use sharded::{ShardedRedisStore, rendezvous};
pub use slot::hash_slot;

/// The source of the check script that the store calls by EVALSHA on servers without Redis
/// Functions (the files of `lua/`, joined), for tooling such as benchmarks that must run the
/// very same code.
pub fn check_script_source() -> String {
    script::check_source()
}

/// The function library the store loads with `FUNCTION LOAD` and calls by `FCALL`, and the
/// name of its check function, for tooling such as benchmarks.
pub fn function_library() -> (&'static str, &'static str) {
    let library = &*script::LIBRARY;
    (&library.source, &library.check_function)
}

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use deadpool_redis::redis::{self, Client, RedisError, Value};

use super::batched::{Grant, LeaseRequest, Leased, ResetListener, SyncTarget, Synced};
use super::resilience::{BreakerState, Guard, GuardConfig, LogObserver, StoreObserver};
use super::{BoxFuture, Check, Lease, Store, StoreError};
use crate::decision::Decision;
use crate::time::Timestamp;
use cluster::ClusterBreakers;
use connection::{Connection, ConnectionError};
use groups::{Asking, Group, GroupedStore, lease_groups, sync_groups};
use script::{Dispatch, Mode, Reply};

/// How the store talks to Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectionMode {
    /// One multiplexed connection shared by all callers (pipelined, reconnects by itself).
    /// The default: it measured faster (see BENCHMARKS.md).
    Multiplexed,
    /// This many connections: on a single server or behind sentinels a deadpool-redis pool,
    /// one call per connection at a time; on a cluster, this many multiplexed cluster
    /// connections taken in turn. In every mode no call is sent twice by the client library
    /// (SPEC §1, at most once).
    Pool(usize),
}

/// Which Redis deployment a store talks to.
#[derive(Clone, Debug)]
enum Deployment {
    /// One server (or a proxy), by URL.
    Single(String),
    /// A Redis Cluster, reached through any of these seed nodes.
    Cluster(Vec<String>),
    /// The master that these sentinels elect for `master`.
    Sentinel {
        master: String,
        sentinels: Vec<String>,
    },
}

/// Configures a [`RedisStore`].
#[must_use]
pub struct RedisStoreBuilder {
    deployment: Deployment,
    mode: ConnectionMode,
    guard: GuardConfig,
    observer: Arc<dyn StoreObserver>,
    cluster_compatible: bool,
    deny_cache: bool,
    coalesce_in_flight: usize,
    clock: Arc<dyn crate::time::Clock>,
}

impl RedisStoreBuilder {
    /// Multiplexed connection or pool (default multiplexed). A cluster store's connections are
    /// multiplexed either way: one, or a pool's size of them taken in turn.
    pub fn connection_mode(mut self, mode: ConnectionMode) -> Self {
        self.mode = mode;
        self
    }

    /// Deadline of every store call (default 50ms).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.guard.timeout = timeout;
        self
    }

    /// Consecutive failures that open the breaker, and how long it stays open (default 5, 2s).
    pub fn breaker(mut self, failures: u32, open_for: Duration) -> Self {
        self.guard.failures = failures;
        self.guard.open_for = open_for;
        self
    }

    /// Who hears about breaker transitions and failures (default: logs).
    pub fn observer(mut self, observer: Arc<dyn StoreObserver>) -> Self {
        self.observer = observer;
        self
    }

    /// One script call per hash slot, with refunds, as Redis Cluster requires (default false:
    /// one call for all keys, atomic across slots).
    pub fn cluster_compatible(mut self, enabled: bool) -> Self {
        self.cluster_compatible = enabled;
        self
    }

    /// Whether a denial is remembered and the next requests on its keys are denied here until
    /// its `retry_after` is over, without a call (default true; see the deny cache in the
    /// module docs). Resets through any node reach every node's memory by a subscription.
    pub fn deny_cache(mut self, enabled: bool) -> Self {
        self.deny_cache = enabled;
        self
    }

    /// Coalesced calls: at most `in_flight` calls out at once per node (per hash slot on a
    /// cluster); decisions that find none free wait and go out together as one call when one
    /// comes back (see the coalescing in the module docs). 0 sends every decision on its own.
    /// Default 2.
    pub fn coalesce(mut self, in_flight: usize) -> Self {
        self.coalesce_in_flight = in_flight;
        self
    }

    /// This node's clock (default the system's). Decisions are made by the server's clock;
    /// this one only places the calendar boundaries a call carries around the server's time,
    /// by the offset between the two that the last reply showed (SPEC §1). Tests use a
    /// [`FakeClock`](crate::time::FakeClock) to put a node's clock off.
    pub fn clock(mut self, clock: impl crate::time::Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Builds the store. Connects lazily: a Redis that is down at start-up is a store error on
    /// the first calls (handled by the failure policy), not a start-up failure.
    pub fn build(self) -> Result<RedisStore, StoreError> {
        self.check_settings()?;
        let connection = connection::connect(&self.deployment, self.mode, &self.guard)?;
        // Every call on a cluster must stay on one slot.
        let cluster_compatible =
            self.cluster_compatible || matches!(self.deployment, Deployment::Cluster(_));
        let cluster_breakers = matches!(self.deployment, Deployment::Cluster(_))
            .then(|| ClusterBreakers::new(self.guard, self.observer.clone()));
        let reset_source = match &self.deployment {
            Deployment::Single(url) => resets::Source::Servers(vec![url.clone()]),
            Deployment::Cluster(nodes) => resets::Source::Servers(nodes.clone()),
            Deployment::Sentinel { master, sentinels } => resets::Source::Sentinel {
                master: master.clone(),
                sentinels: sentinels.clone(),
            },
        };
        let (stop_listening, _) = tokio::sync::watch::channel(());
        Ok(RedisStore {
            inner: Arc::new(Inner {
                connection,
                guard: Arc::new(Guard::new("redis", self.guard, self.observer)),
                cluster_compatible,
                cluster_breakers,
                dispatch: AtomicU8::new(DISPATCH_UNKNOWN),
                library_loads: AtomicU64::new(0),
                loading: tokio::sync::Mutex::new(()),
                deny_cache: self.deny_cache.then(deny_cache::DenyCache::new),
                listening: std::sync::atomic::AtomicBool::new(false),
                reset_listeners: std::sync::Mutex::default(),
                reset_source,
                stop_listening,
                coalescer: coalesce::Coalescer::default(),
                coalesce_in_flight: self.coalesce_in_flight,
                server_clock: server_clock::ServerClock::new(self.clock),
                trades: Trades::new(),
            }),
        })
    }
}

impl RedisStoreBuilder {
    /// Settings that cannot work, refused before any connection: every URL parses (named in
    /// the error without its password), deadlines and the breaker are not zero.
    fn check_settings(&self) -> Result<(), StoreError> {
        let urls: Vec<&String> = match &self.deployment {
            Deployment::Single(url) => vec![url],
            Deployment::Cluster(nodes) => nodes.iter().collect(),
            Deployment::Sentinel { sentinels, .. } => sentinels.iter().collect(),
        };
        if urls.is_empty() {
            return Err(StoreError::Config("no Redis address given".to_owned()));
        }
        for url in urls {
            if let Err(error) = Client::open(url.as_str()) {
                return Err(StoreError::Config(format!(
                    "`{}` is not a Redis URL: {error}",
                    crate::store::redact_url(url)
                )));
            }
        }
        if self.guard.timeout.is_zero() {
            return Err(StoreError::Config(
                "timeout: must be greater than 0".to_owned(),
            ));
        }
        if self.guard.failures == 0 || self.guard.open_for.is_zero() {
            return Err(StoreError::Config(
                "breaker: failures and open_for must be greater than 0".to_owned(),
            ));
        }
        Ok(())
    }
}

struct Inner {
    connection: Connection,
    guard: Arc<Guard>,
    cluster_compatible: bool,
    /// On a cluster, one breaker per master (see [`cluster`]), so that a dead master trips
    /// the breaker of its identities only.
    cluster_breakers: Option<ClusterBreakers>,
    /// How library calls reach the server: not known yet (functions are tried first), by
    /// `FCALL`, or by `EVALSHA` (the server has no functions, or `FUNCTION` is disabled).
    dispatch: AtomicU8,
    /// Loads of the library so far: a call that found it missing loads it only if nobody did
    /// since.
    library_loads: AtomicU64,
    /// One load of the library at a time.
    loading: tokio::sync::Mutex<()>,
    /// What this node remembers of denials (`None` when turned off).
    deny_cache: Option<deny_cache::DenyCache>,
    /// Whether the resets subscription was started (by the first decision, or the first
    /// listener).
    listening: std::sync::atomic::AtomicBool,
    /// Who else hears resets: batched nodes over this store drop their leases of reset keys.
    reset_listeners: std::sync::Mutex<Vec<ResetListener>>,
    reset_source: resets::Source,
    /// Dropped with the store: ends the subscription task.
    stop_listening: tokio::sync::watch::Sender<()>,
    /// Decisions waiting for a place in a call, by slot.
    coalescer: coalesce::Coalescer,
    /// Most calls out at once per slot before decisions are coalesced (0: never).
    coalesce_in_flight: usize,
    /// The server's time as replies show it: where calendar boundaries are computed.
    server_clock: server_clock::ServerClock,
    /// This node's lease trades, numbered so that Redis applies each once.
    trades: Trades,
}

/// A node's lease trades: its name in the trade records (random, one per store) and the next
/// trade's number.
struct Trades {
    node: String,
    last: AtomicU64,
}

impl Trades {
    fn new() -> Trades {
        Trades {
            node: format!("{:016x}", fastrand::u64(..)),
            last: AtomicU64::new(0),
        }
    }
}

const DISPATCH_UNKNOWN: u8 = 0;
const DISPATCH_FUNCTION: u8 = 1;
const DISPATCH_SCRIPT: u8 = 2;

/// `FCALL` of a function the server does not have (never loaded, or gone with a restart, a
/// `FUNCTION FLUSH` or a new empty master).
fn function_missing(error: &RedisError) -> bool {
    error
        .detail()
        .is_some_and(|detail| detail.starts_with("Function not found"))
}

/// A command the server does not know (`FCALL` before Redis 7, `FUNCTION` renamed away).
fn unknown_command(error: &RedisError) -> bool {
    error
        .detail()
        .is_some_and(|detail| detail.starts_with("unknown command"))
}

/// The Redis store. Clones share connections and breaker.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("guard", &self.inner.guard)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Configures a store for `url` (`redis://host:port/db`).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStore::builder_for(Deployment::Single(url.into()))
    }

    /// Configures a store on a Redis Cluster reached through `nodes` (any subset of its
    /// masters; the slot map is learned from them). Calls go one per hash slot.
    pub fn cluster(nodes: Vec<String>) -> RedisStoreBuilder {
        RedisStore::builder_for(Deployment::Cluster(nodes))
    }

    /// Configures a store on the master that `sentinels` (`redis://host:port` URLs) elect
    /// under the name `master`; after a failover it follows the promoted replica.
    pub fn sentinel(master: impl Into<String>, sentinels: Vec<String>) -> RedisStoreBuilder {
        RedisStore::builder_for(Deployment::Sentinel {
            master: master.into(),
            sentinels,
        })
    }

    fn builder_for(deployment: Deployment) -> RedisStoreBuilder {
        RedisStoreBuilder {
            deployment,
            mode: ConnectionMode::Multiplexed,
            guard: GuardConfig::default(),
            observer: Arc::new(LogObserver),
            cluster_compatible: false,
            deny_cache: true,
            coalesce_in_flight: 2,
            clock: Arc::new(crate::time::SystemClock),
        }
    }

    /// This node's memory of denials, if it keeps one.
    fn deny_cache(&self) -> Option<&deny_cache::DenyCache> {
        self.inner.deny_cache.as_ref()
    }

    /// Starts hearing resets (once, from inside a runtime), so that local denials can begin.
    fn ensure_listening(&self) {
        if self.inner.listening.load(Ordering::Relaxed)
            || (self.inner.deny_cache.is_none() && self.inner.reset_listeners().is_empty())
        {
            return;
        }
        if tokio::runtime::Handle::try_current().is_ok()
            && !self.inner.listening.swap(true, Ordering::AcqRel)
        {
            resets::spawn(
                Arc::downgrade(&self.inner),
                self.inner.reset_source.clone(),
                self.inner.stop_listening.subscribe(),
            );
        }
    }

    /// Decisions waiting now for a call to come back, to go out together in the next one.
    pub fn coalesced_waiting(&self) -> usize {
        self.inner.coalescer.waiting()
    }

    /// Requests this store denied locally so far (tests and benchmarks).
    pub fn local_denials(&self) -> u64 {
        self.deny_cache()
            .map_or(0, |cache| cache.local_denials.load(Ordering::Relaxed))
    }

    /// The deadline and circuit breaker of this store (on a cluster, the template that each
    /// master's breaker is made from).
    pub fn guard(&self) -> &Guard {
        &self.inner.guard
    }

    /// Runs `call` for `key` under its breaker; on a cluster, reads the slot map first if it
    /// was never read, and again (in the background) after a failure, since a failure may
    /// mean a failover that moved slots.
    async fn guarded<T>(
        &self,
        key: &str,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let Some(breakers) = &self.inner.cluster_breakers else {
            return self.inner.guard.call(call).await;
        };
        if !breakers.is_known() {
            // Boxed: rare, and a large future that would size every decision's.
            Box::pin(self.refresh_slot_map()).await;
        }
        let result = breakers.guard_for(key).call(call).await;
        if matches!(
            result,
            Err(StoreError::Unavailable(_) | StoreError::Timeout(_))
        ) {
            let store = self.clone();
            tokio::spawn(async move { store.refresh_slot_map().await });
        }
        result
    }

    /// Reads `CLUSTER SLOTS` (at most once a second, within the deadline) into the breakers'
    /// slot map. A failure leaves the previous map.
    async fn refresh_slot_map(&self) {
        let Some(breakers) = &self.inner.cluster_breakers else {
            return;
        };
        if !breakers.claim_refresh() {
            return;
        }
        let mut command = redis::cmd("CLUSTER");
        command.arg("SLOTS");
        match self.query(&command).await {
            Ok(reply) => match cluster::parse_slots(&reply) {
                Ok(ranges) => breakers.apply(&ranges),
                Err(error) => tracing::warn!(%error, "could not read the cluster's slot map"),
            },
            Err(error) => tracing::debug!(%error, "could not read the cluster's slot map"),
        }
    }

    /// Whether calls on `key` are being refused by an open breaker.
    fn is_refused(&self, key: &str) -> bool {
        // Asked on every batched decision: a single node's breaker is read in place. Not its
        // state: an open breaker due for its probe must let the next call out, or a batched
        // store, which asks this before calling, would never call again.
        match &self.inner.cluster_breakers {
            None => self.inner.guard.refuses_calls(),
            Some(breakers) => breakers.guard_for(key).refuses_calls(),
        }
    }

    /// Runs a command outside the decisions (slot map, probes): within the deadline (at least
    /// 100ms), outside the breaker.
    async fn query(&self, command: &redis::Cmd) -> Result<Value, StoreError> {
        let deadline = self.deadline_outside_decisions();
        self.inner.connection.query(command, deadline).await
    }

    /// The deadline of a command outside the decisions: `store.timeout`, at least 100ms.
    fn deadline_outside_decisions(&self) -> Duration {
        let timeout = self.inner.guard.config().timeout;
        timeout.max(Duration::from_millis(100))
    }

    /// Runs `command` on the decisions' connection (no connection of its own, unlike
    /// [`RedisStore::query`]: operations that recur, such as reading overrides), within the
    /// deadline (at least 100ms), outside the breaker.
    pub(crate) async fn command(&self, command: &redis::Cmd) -> Result<Value, StoreError> {
        let deadline = self.deadline_outside_decisions();
        match tokio::time::timeout(deadline, self.inner.connection.run(command)).await {
            Ok(result) => result.map_err(ConnectionError::into_store_error),
            Err(_) => Err(StoreError::Timeout(deadline)),
        }
    }

    /// Runs one of floodgate's scripts outside the decisions (a quota's shares) on the node of
    /// its one key, `key`: `EVALSHA` of the script's `(source, hash)`, and on `NOSCRIPT` (a
    /// call Redis refused unrun: a restart, a `SCRIPT FLUSH`, a node new to the script) one
    /// `EVAL` of its source on the same key's node. Within the deadline of commands outside
    /// decisions, outside the breaker, never sent twice otherwise.
    pub(crate) async fn run_keyed_script(
        &self,
        (source, hash): (&str, &str),
        key: &str,
        args: &[String],
    ) -> Result<Value, StoreError> {
        let deadline = self.deadline_outside_decisions();
        let connection = &self.inner.connection;
        let call = |command: &str, script: &str| {
            let mut call = redis::cmd(command);
            call.arg(script).arg(1).arg(key).arg(args);
            call
        };
        let run = async {
            match connection.run(&call("EVALSHA", hash)).await {
                Err(ConnectionError::Redis(error))
                    if error.kind()
                        == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    connection.run(&call("EVAL", source)).await
                }
                other => other,
            }
        };
        match tokio::time::timeout(deadline, run).await {
            Ok(result) => result.map_err(ConnectionError::into_store_error),
            Err(_) => Err(StoreError::Timeout(deadline)),
        }
    }

    /// Makes every node's deny cache forget what it denied on `keys` (this node's at once,
    /// the others' through [`RESETS_CHANNEL`]): their limits changed, or were reset. A failed
    /// publish is logged: other nodes keep denying those keys locally until their waits end.
    pub(crate) async fn forget_denials(&self, keys: &[&str]) {
        if let Some(cache) = self.deny_cache() {
            cache.forget_reset(keys.iter().copied());
        }
        let mut publish = redis::cmd("PUBLISH");
        publish.arg(RESETS_CHANNEL).arg(keys.join("\n"));
        if let Err(error) = self.query(&publish).await {
            tracing::warn!(%error, "could not publish a reset: other nodes may keep denying its keys locally until their waits are over");
        }
    }

    /// Runs a call of the library: by `FCALL` while the server has its functions, loading them
    /// when they are missing (first use, a restart, a `FUNCTION FLUSH`, a new master); by
    /// `EVALSHA` on a server that has no functions or refuses `FUNCTION`, detected on first
    /// use. A call that found the library missing did nothing, so calling it again after the
    /// load neither loses nor doubles a decision.
    async fn run_library(
        &self,
        command: impl Fn(Dispatch) -> redis::Cmd,
    ) -> Result<Value, StoreError> {
        let connection = &self.inner.connection;
        if self.inner.dispatch.load(Ordering::Relaxed) == DISPATCH_SCRIPT {
            return self.run_script(&command(Dispatch::Script)).await;
        }
        let loads_before = self.inner.library_loads.load(Ordering::Acquire);
        let error = match connection.run(&command(Dispatch::Function)).await {
            Ok(value) => return Ok(value),
            Err(error) => error,
        };
        let recoverable = error
            .redis()
            .is_some_and(|error| function_missing(error) || unknown_command(error));
        if !recoverable {
            return Err(error.into_store_error());
        }
        // Boxed: rare, and its future would size every decision's.
        match Box::pin(self.load_library(loads_before)).await {
            Ok(()) => connection
                .run(&command(Dispatch::Function))
                .await
                .map_err(ConnectionError::into_store_error),
            Err(load) if load.redis().is_some_and(unknown_command) => {
                if self.inner.dispatch.swap(DISPATCH_SCRIPT, Ordering::Relaxed) != DISPATCH_SCRIPT {
                    tracing::info!(
                        "Redis refuses FUNCTION (a server before 7.0, or the command renamed): \
                         decisions go by EVALSHA"
                    );
                }
                Box::pin(self.run_script(&command(Dispatch::Script))).await
            }
            Err(load) => Err(load.into_store_error()),
        }
    }

    /// Loads the function library (`FUNCTION LOAD REPLACE`; on a cluster, on every master)
    /// unless another call loaded it since `loads_before`.
    async fn load_library(&self, loads_before: u64) -> Result<(), ConnectionError> {
        let _one_at_a_time = self.inner.loading.lock().await;
        if self.inner.library_loads.load(Ordering::Acquire) != loads_before {
            return Ok(());
        }
        let mut load = redis::cmd("FUNCTION");
        load.arg("LOAD").arg("REPLACE").arg(&script::LIBRARY.source);
        self.inner.connection.run(&load).await?;
        self.inner.library_loads.fetch_add(1, Ordering::Release);
        self.inner
            .dispatch
            .store(DISPATCH_FUNCTION, Ordering::Relaxed);
        tracing::debug!("floodgate's function library loaded");
        Ok(())
    }

    /// Runs an `EVALSHA`; on `NOSCRIPT` (a restart, a `SCRIPT FLUSH`) loads the scripts and
    /// runs it again.
    async fn run_script(&self, command: &redis::Cmd) -> Result<Value, StoreError> {
        let connection = &self.inner.connection;
        match connection.run(command).await {
            Err(ConnectionError::Redis(error))
                if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                let library = &*script::LIBRARY;
                for (source, _) in [&library.check_script, &library.release_script] {
                    let mut load = redis::cmd("SCRIPT");
                    load.arg("LOAD").arg(source);
                    connection
                        .run(&load)
                        .await
                        .map_err(ConnectionError::into_store_error)?;
                }
                connection
                    .run(command)
                    .await
                    .map_err(ConnectionError::into_store_error)
            }
            other => other.map_err(ConnectionError::into_store_error),
        }
    }

    /// One script call of one decision under this store's deadline and breaker.
    async fn guarded_call(
        &self,
        mode: Mode,
        checks: &[&Check],
        tokens: &[String],
        now: Option<Timestamp>,
    ) -> Result<Reply, StoreError> {
        let key = checks.first().map_or("", |check| &*check.key);
        self.guarded(key, async {
            let in_flight = self.inner.coalesce_in_flight;
            if mode == Mode::Check && now.is_none() && in_flight > 0 {
                let slot = if self.inner.cluster_compatible {
                    hash_slot(key)
                } else {
                    0
                };
                return coalesce::check(self, slot, in_flight, checks, tokens).await;
            }
            let decision = script::Decision { checks, tokens };
            let mut replies = self.call(mode, &[decision], now).await?;
            replies
                .pop()
                .ok_or_else(|| StoreError::Protocol("a decision went unanswered".into()))
        })
        .await
    }

    /// One batched-sync call under this store's deadline and breaker.
    async fn guarded_sync(
        &self,
        checks: &[&Check],
        now: Option<Timestamp>,
    ) -> Result<Synced, StoreError> {
        let key = checks.first().map_or("", |check| &*check.key);
        self.guarded(key, async {
            let decision = script::Decision {
                checks,
                tokens: &[],
            };
            let calendar = checks.iter().any(|check| check.limit.calendar().is_some());
            let spec_time = self.spec_time(calendar, now).await;
            let value = self
                .run_library(|dispatch| {
                    script::command(dispatch, Mode::Sync, &[decision], now, spec_time)
                })
                .await?;
            self.inner.server_clock.observe_reply(&value);
            script::decode_sync(value, checks)
        })
        .await
    }

    /// One lease trade under this store's deadline and breaker.
    async fn guarded_lease(
        &self,
        requests: &[&LeaseRequest],
        now: Option<Timestamp>,
    ) -> Result<Vec<Grant>, StoreError> {
        let key = requests.first().map_or("", |request| &*request.check.key);
        let trades = &self.inner.trades;
        let record = script::trade_record_key(key, &trades.node);
        let trade = script::TradeId {
            number: trades.last.fetch_add(1, Ordering::Relaxed) + 1,
            record: &record,
        };
        // A trade whose connection broke may have been applied, its answer lost: asked again
        // by its number (on a new connection), Redis applies it only if it was not, and
        // answers its grants either way. Within the same deadline and counted once by the
        // breaker: one trade, one call. A trade whose answer came late has spent the deadline
        // already: asking again would make whoever waits for it wait twice (it is
        // `Unanswered::Lost`: its units are counted as neither given back nor granted).
        let once_more_if_broken = async {
            match self.lease_once(requests, trade, now).await {
                Err(broken @ StoreError::Unavailable(_)) => self
                    .lease_once(requests, trade, now)
                    .await
                    .map_err(|_| broken),
                answered => answered,
            }
        };
        self.guarded(key, once_more_if_broken).await
    }

    /// One run of lease trade `trade`. A trade its node's record can no longer tell about (a
    /// number below all of a full record's: dropped from it, perhaps applied) fails as a lost
    /// answer would, with an error that is the call's, not the store's: it is not asked again
    /// and does not count against the breaker.
    async fn lease_once(
        &self,
        requests: &[&LeaseRequest],
        trade: script::TradeId<'_>,
        now: Option<Timestamp>,
    ) -> Result<Vec<Grant>, StoreError> {
        let calendar = requests
            .iter()
            .any(|request| request.check.limit.calendar().is_some());
        let spec_time = self.spec_time(calendar, now).await;
        let value = self
            .run_library(|dispatch| {
                script::lease_command(dispatch, requests, trade, now, spec_time)
            })
            .await?;
        self.inner.server_clock.observe_reply(&value);
        script::decode_lease(value, requests)?.ok_or_else(|| {
            StoreError::Protocol("a lease trade older than its node's trade record".into())
        })
    }

    /// One library call of `decisions`, and their replies.
    async fn call(
        &self,
        mode: Mode,
        decisions: &[script::Decision<'_>],
        now: Option<Timestamp>,
    ) -> Result<Vec<Reply>, StoreError> {
        let spec_time = self.spec_time(script::has_calendar(decisions), now).await;
        let value = self
            .run_library(|dispatch| script::command(dispatch, mode, decisions, now, spec_time))
            .await?;
        self.inner.server_clock.observe_reply(&value);
        script::decode(mode, value, decisions)
    }

    /// The time a call's calendar boundaries are computed around ([`server_clock`]): the
    /// caller's `now`, else the server's time as the last reply showed it, asked of the
    /// server (`TIME`) first when no reply has shown it yet and the call counts a
    /// `calendar` period. A `TIME` that fails leaves the node's own time, as before.
    pub(crate) async fn spec_time(&self, calendar: bool, now: Option<Timestamp>) -> Timestamp {
        let clock = &self.inner.server_clock;
        if now.is_none()
            && calendar
            && !clock.is_known()
            && let Ok(reply) = self.command(&redis::cmd("TIME")).await
        {
            clock.observe_reply(&reply);
        }
        clock.spec_time(now)
    }

    /// Indices of `checks` grouped into script calls, in order of first appearance.
    fn groups(&self, checks: &[Check]) -> Vec<Vec<usize>> {
        self.slot_groups(checks.iter().map(|check| &*check.key))
    }

    /// Indices of `keys` grouped into the calls they need, in order of first appearance: one
    /// group for all on a single node, one per hash slot where a call must stay on one; no
    /// group for no key.
    fn slot_groups<'k>(&self, keys: impl Iterator<Item = &'k str>) -> Vec<Vec<usize>> {
        if !self.inner.cluster_compatible {
            let all: Vec<usize> = (0..keys.count()).collect();
            return if all.is_empty() {
                Vec::new()
            } else {
                vec![all]
            };
        }
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (index, key) in keys.enumerate() {
            let slot = hash_slot(key);
            match groups
                .iter_mut()
                .find(|(group_slot, _)| *group_slot == slot)
            {
                Some((_, members)) => members.push(index),
                None => groups.push((slot, vec![index])),
            }
        }
        groups.into_iter().map(|(_, members)| members).collect()
    }
}

impl GroupedStore for RedisStore {
    fn node_groups(&self, checks: &[Check]) -> Vec<Group<'_>> {
        self.groups(checks)
            .into_iter()
            .map(|members| Group {
                node: self,
                members,
            })
            .collect()
    }
}

impl SyncTarget for RedisStore {
    fn sync<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Synced, StoreError>> {
        Box::pin(async move { sync_groups(&self.node_groups(checks), checks, now).await })
    }

    fn lease<'a>(
        &'a self,
        requests: &'a [LeaseRequest],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Leased> {
        Box::pin(async move {
            let groups: Vec<Group<'_>> = self
                .slot_groups(requests.iter().map(|request| &*request.check.key))
                .into_iter()
                .map(|members| Group {
                    node: self,
                    members,
                })
                .collect();
            lease_groups(&groups, requests, now).await
        })
    }

    fn is_refused(&self, key: &str) -> bool {
        RedisStore::is_refused(self, key)
    }

    fn on_reset(&self, listener: ResetListener) {
        self.inner.reset_listeners().push(listener);
        self.ensure_listening();
    }
}

impl Inner {
    fn reset_listeners(&self) -> std::sync::MutexGuard<'_, Vec<ResetListener>> {
        self.reset_listeners
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Forgets what a reset of `keys` (one per line), heard on the resets channel, undid.
    fn heard_reset(&self, keys: &str) {
        if let Some(cache) = &self.deny_cache {
            cache.forget_reset(keys.lines());
        }
        let mut listeners = self.reset_listeners();
        if !listeners.is_empty() {
            let keys: Vec<&str> = keys.lines().collect();
            listeners.retain(|listener| listener(&keys));
        }
    }
}

/// The value of a `CONFIG GET <name>` reply: a `[name, value]` array (RESP2) or a one-entry
/// map (RESP3); `None` for anything else (an unknown setting answers an empty one).
fn config_value(reply: Value) -> Option<String> {
    let value = match reply {
        Value::Array(mut items) if items.len() == 2 => items.pop()?,
        Value::Map(mut pairs) if pairs.len() == 1 => pairs.pop()?.1,
        _ => return None,
    };
    redis::from_redis_value::<String>(value).ok()
}

impl Store for RedisStore {
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        self.decide_grouped(Asking::Decide, checks, now)
    }

    fn release<'a>(&'a self, leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            // One call per hash slot where a call must stay on one (a request's leases may be
            // on several: a global or per-IP concurrency limit and the client's), concurrently.
            let by_slot = self.slot_groups(leases.iter().map(|lease| &*lease.key));
            let leases = &leases;
            let calls = by_slot.iter().map(|group| async move {
                let keys: Vec<&str> = group.iter().map(|&index| &*leases[index].key).collect();
                let members: Vec<script::LeaseToken> = group
                    .iter()
                    .map(|&index| script::LeaseToken::of(&leases[index]))
                    .collect();
                self.run_library(|dispatch| script::release_command(dispatch, &keys, &members))
                    .await
            });
            // Not through the breaker: a release is not a decision, and a failed one only
            // leaves a lease to expire.
            let released = futures_util::future::join_all(calls);
            match tokio::time::timeout(script::RELEASE_TIMEOUT, released).await {
                Ok(results) => results
                    .into_iter()
                    .find_map(Result::err)
                    .map_or(Ok(()), Err),
                Err(_) => Err(StoreError::Timeout(script::RELEASE_TIMEOUT)),
            }
        })
    }

    fn backend(&self) -> &'static str {
        "redis"
    }

    fn peek<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        self.decide_grouped(Asking::Peek, checks, now)
    }

    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.charge_grouped(checks, now)
    }

    fn refund<'a>(
        &'a self,
        checks: &'a [Check],
        charged_at: Timestamp,
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.refund_grouped(checks, charged_at, now)
    }

    /// `DEL`, one call per hash slot where calls must stay on one; outside the breaker. Then
    /// the keys are published on [`RESETS_CHANNEL`], so that every node's deny cache forgets
    /// them (this node's forgets them at once).
    fn reset<'a>(&'a self, keys: &'a [Arc<str>]) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            // Forgotten here at once, and again with the publish below.
            if let Some(cache) = self.deny_cache() {
                cache.forget_reset(keys.iter().map(|key| &**key));
            }
            let by_slot = self.slot_groups(keys.iter().map(|key| &**key));
            let mut removed = 0;
            for group in by_slot {
                let mut command = redis::cmd("DEL");
                for &index in &group {
                    command.arg(&*keys[index]);
                }
                match self.query(&command).await? {
                    Value::Int(count) => removed += u64::try_from(count).unwrap_or(0),
                    other => {
                        return Err(StoreError::Protocol(format!("DEL answered {other:?}")));
                    }
                }
                let reset: Vec<&str> = group.iter().map(|&index| &*keys[index]).collect();
                self.forget_denials(&reset).await;
            }
            Ok(removed)
        })
    }

    fn override_backend(&self) -> Option<Arc<dyn crate::store::override_backend::OverrideBackend>> {
        Some(Arc::new(overrides::RedisOverrides::single(self.clone())))
    }

    /// `PING`, outside the breaker.
    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move { self.query(&redis::cmd("PING")).await.map(drop) })
    }

    /// `CONFIG GET appendonly` and `save`: kept when either writes to disk. On a cluster, the
    /// answer of the node the commands reach (its masters are taken to be configured alike).
    fn persistence(&self) -> BoxFuture<'_, Option<bool>> {
        Box::pin(async move {
            let setting = |name: &'static str| async move {
                let mut get = redis::cmd("CONFIG");
                get.arg("GET").arg(name);
                config_value(self.query(&get).await.ok()?)
            };
            let appendonly = setting("appendonly").await?;
            let save = setting("save").await?;
            Some(appendonly.eq_ignore_ascii_case("yes") || !save.trim().is_empty())
        })
    }

    /// On a cluster: open if any master's breaker is not closed (its identities follow the
    /// failure policy).
    fn breaker_state(&self) -> Option<BreakerState> {
        let Some(breakers) = &self.inner.cluster_breakers else {
            return Some(self.inner.guard.state());
        };
        Some(
            breakers
                .states()
                .into_iter()
                .find(|state| *state != BreakerState::Closed)
                .unwrap_or(BreakerState::Closed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every decision's future holds room for the largest future it may await, and is moved
    /// (copied) at each level it is awaited through: when a rare path (connecting, a pool, a
    /// cluster's slot map) was awaited in place, a decision's future was 31 KB, and copying it
    /// took a tenth of the gateway's CPU on the Redis path. The rare paths are boxed; this
    /// keeps them so (2.4 KB today; the bound leaves room for dependency updates).
    #[test]
    fn a_decision_future_stays_small() {
        let store = RedisStore::builder("redis://127.0.0.1:1").build().unwrap();
        let limit = Arc::new(crate::Limit::gcra("l", 10, Duration::from_secs(1)).unwrap());
        let checks = [Check::new("fg:{ip:a}:r:l", limit, 1)];
        let groups = store.node_groups(&checks);
        let decision = groups::decide_groups(&groups, &checks, None);
        let size = std::mem::size_of_val(&decision);
        assert!(size <= 8 * 1024, "a decision's future takes {size} bytes");
    }
}

#[cfg(test)]
mod trade_tests {
    use super::*;
    use crate::Limit;
    use floodgate_test_support::RedisServer;

    fn trade(key: &str, limit: &Arc<Limit>, want: u64) -> LeaseRequest {
        LeaseRequest {
            check: Check::new(key.to_owned(), limit.clone(), 0),
            give_back: 0,
            leased_in: None,
            want,
            charge: 0,
        }
    }

    async fn remaining(store: &RedisStore, key: &str, limit: &Arc<Limit>) -> u64 {
        let check = [Check::new(key.to_owned(), limit.clone(), 0)];
        store.peek(&check, None).await.unwrap().limits()[0].remaining
    }

    /// A trade asked again by its number is answered its first run's grant (and time) and
    /// applied once, also when it came after a later trade of its node; one that a full record
    /// no longer holds (below all its numbers) is applied never.
    #[tokio::test]
    async fn a_trade_is_applied_once_by_its_number() {
        let server = RedisServer::start();
        let store = RedisStore::builder(server.url()).build().unwrap();
        let hours = Duration::from_secs(3600 * 100);
        let limit = Arc::new(Limit::token_bucket("l", 100, hours).unwrap());
        let key = "fg:{client:once}:r:l";
        let record = script::trade_record_key(key, "node");
        let lease = |number, want| {
            let request = trade(key, &limit, want);
            let trade = script::TradeId {
                number,
                record: &record,
            };
            let store = &store;
            async move { store.lease_once(&[&request], trade, None).await }
        };
        let first = lease(5, 10).await.unwrap();
        assert_eq!(first[0].granted, 10);
        assert_eq!(first[0].granted_at, first[0].now);
        assert_eq!(remaining(&store, key, &limit).await, 90);

        let again = lease(5, 10).await.unwrap();
        assert_eq!(again[0].granted, 10, "the first run's grant");
        assert_eq!(again[0].granted_at, first[0].granted_at, "granted then");
        assert!(again[0].now >= first[0].now);
        assert_eq!(remaining(&store, key, &limit).await, 90, "applied once");

        // Sent before 5, arrived after it (another connection): applied, once.
        assert_eq!(lease(4, 10).await.unwrap()[0].granted, 10);
        assert_eq!(lease(4, 10).await.unwrap()[0].granted, 10);
        assert_eq!(remaining(&store, key, &limit).await, 80);

        // The record keeps eight: 4 to 11.
        for number in 6..=11 {
            assert_eq!(lease(number, 1).await.unwrap()[0].granted, 1);
        }
        assert_eq!(remaining(&store, key, &limit).await, 74);
        let older = lease(3, 10).await;
        assert!(matches!(older, Err(StoreError::Protocol(_))), "{older:?}");
        assert_eq!(remaining(&store, key, &limit).await, 74, "never applied");

        // 12 takes 4's place: 4 asked again now may have been applied, so it is not.
        assert_eq!(lease(12, 1).await.unwrap()[0].granted, 1);
        let dropped = lease(4, 10).await;
        assert!(
            matches!(dropped, Err(StoreError::Protocol(_))),
            "{dropped:?}"
        );
        assert_eq!(remaining(&store, key, &limit).await, 73, "4 applied once");
        assert_eq!(lease(5, 10).await.unwrap()[0].granted, 10, "5 still held");
        assert_eq!(remaining(&store, key, &limit).await, 73);
    }

    /// The record shares its call's slot, whatever the first key looks like.
    #[test]
    fn a_trade_record_is_on_the_slot_of_its_call() {
        for key in [
            "fg:{client:a}:r:l",
            "plain",
            "foo{}{bar}",
            "a}b",
            "{}",
            "x{y}z{w}",
        ] {
            let record = script::trade_record_key(key, "0123456789abcdef");
            assert_eq!(
                slot::hash_slot(&record),
                slot::hash_slot(key),
                "{key} -> {record}"
            );
            assert!(record.ends_with(":trade:0123456789abcdef"), "{record}");
        }
        assert_eq!(
            script::trade_record_key("fg:{client:a}:r:l", "n"),
            "fg:{client:a}:trade:n"
        );
    }
}
