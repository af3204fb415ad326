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
mod script;
mod sharded;
mod slot;

pub use sharded::{ShardedRedisStore, rendezvous};
pub use slot::hash_slot;

/// The source of the check script that the store calls by EVALSHA (the files of `lua/`,
/// joined), for tooling such as benchmarks that must run the very same script.
pub fn check_script_source() -> String {
    script::check_source()
}

use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use deadpool_redis::redis::cluster::ClusterClient;
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::redis::sentinel::{SentinelClient, SentinelServerType};
use deadpool_redis::redis::{self, Client, RedisError, Value};

use super::batched::{SyncTarget, Synced};
use super::resilience::{BreakerState, Guard, GuardConfig, LogObserver, StoreObserver};
use super::{BoxFuture, Check, Lease, Store, StoreError};
use crate::algorithm::LimitOutcome;
use crate::decision::Decision;
use crate::limit::Algorithm;
use crate::time::Timestamp;
use cluster::ClusterBreakers;
use script::{Mode, Reply};

/// How the store talks to Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectionMode {
    /// One multiplexed connection shared by all callers (pipelined, reconnects by itself).
    /// The default: it measured faster (see BENCHMARKS.md).
    Multiplexed,
    /// A deadpool-redis pool of this many connections, one call per connection at a time.
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
}

impl RedisStoreBuilder {
    /// Multiplexed connection or pool (default multiplexed). Cluster and Sentinel stores always
    /// use a pool, of one connection unless a pool size is given (their connections are
    /// multiplexed too).
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

    /// Builds the store. Connects lazily: a Redis that is down at start-up is a store error on
    /// the first calls (handled by the failure policy), not a start-up failure.
    pub fn build(self) -> Result<RedisStore, StoreError> {
        self.check_settings()?;
        let pool_size = match self.mode {
            ConnectionMode::Multiplexed => 1,
            ConnectionMode::Pool(size) => size.max(1),
        };
        let guard = &self.guard;
        // The three pools share their tuning: waits and creation bounded by the deadline.
        macro_rules! tuned {
            ($builder:expr) => {
                $builder
                    .map_err(|error| StoreError::Unavailable(error.into()))?
                    .max_size(pool_size)
                    .runtime(deadpool_redis::Runtime::Tokio1)
                    .wait_timeout(Some(guard.timeout))
                    .create_timeout(Some(guard.timeout.max(Duration::from_millis(100))))
                    .recycle_timeout(Some(guard.timeout))
                    .build()
                    .map_err(|error| StoreError::Unavailable(error.into()))?
            };
        }
        let mut cluster_compatible = self.cluster_compatible;
        let connection = match (&self.deployment, self.mode) {
            (Deployment::Single(url), ConnectionMode::Multiplexed) => {
                let client = Client::open(url.as_str()).map_err(invalid_url)?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(guard.timeout.max(Duration::from_millis(100))))
                    .set_response_timeout(None)
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(200));
                Connection::Multiplexed(Box::new(LazyManager {
                    client,
                    config,
                    manager: tokio::sync::OnceCell::new(),
                }))
            }
            (Deployment::Single(url), ConnectionMode::Pool(_)) => Connection::Pool(tuned!(
                deadpool_redis::Config::from_url(url.as_str()).builder()
            )),
            (Deployment::Cluster(nodes), mode) => {
                // Every call must stay on one slot.
                cluster_compatible = true;
                match mode {
                    ConnectionMode::Multiplexed => {
                        let client = ClusterClient::builder(nodes.clone())
                            .connection_timeout(guard.timeout.max(Duration::from_millis(100)))
                            .retries(1)
                            .build()
                            .map_err(invalid_url)?;
                        Connection::Cluster(Box::new(LazyCluster {
                            client,
                            connection: tokio::sync::OnceCell::new(),
                        }))
                    }
                    ConnectionMode::Pool(_) => Connection::ClusterPool(tuned!(
                        deadpool_redis::cluster::Config::from_urls(nodes.clone()).builder()
                    )),
                }
            }
            (Deployment::Sentinel { master, sentinels }, mode) => match mode {
                ConnectionMode::Multiplexed => Connection::Sentinel(Box::new(SentinelMaster {
                    client: tokio::sync::Mutex::new(
                        SentinelClient::build(
                            sentinels.clone(),
                            master.clone(),
                            None,
                            SentinelServerType::Master,
                        )
                        .map_err(invalid_url)?,
                    ),
                    current: std::sync::Mutex::new(None),
                })),
                ConnectionMode::Pool(_) => Connection::SentinelPool(tuned!(
                    deadpool_redis::sentinel::Config::from_urls(
                        sentinels.clone(),
                        master.clone(),
                        deadpool_redis::sentinel::SentinelServerType::Master,
                    )
                    .builder()
                )),
            },
        };
        let cluster_breakers = matches!(self.deployment, Deployment::Cluster(_))
            .then(|| ClusterBreakers::new(self.guard, self.observer.clone()));
        Ok(RedisStore {
            inner: Arc::new(Inner {
                connection,
                guard: Arc::new(Guard::new("redis", self.guard, self.observer)),
                cluster_compatible,
                cluster_breakers,
            }),
        })
    }
}

fn unavailable(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

/// A pool that could not hand out a connection: a refusal or error of Redis keeps its class.
fn pool_error(error: deadpool_redis::PoolError) -> StoreError {
    match error {
        deadpool_redis::PoolError::Backend(error) => classify(error),
        other => unavailable(other),
    }
}

fn invalid_url(error: RedisError) -> StoreError {
    StoreError::Config(error.to_string())
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

enum Connection {
    Multiplexed(Box<LazyManager>),
    Pool(deadpool_redis::Pool),
    /// One multiplexed cluster connection: routes each call by its first key's slot, follows
    /// MOVED / ASK redirections and refreshes the slot map when nodes change.
    Cluster(Box<LazyCluster>),
    /// deadpool-redis's cluster pool: the same, n connections.
    ClusterPool(deadpool_redis::cluster::Pool),
    /// The master the sentinels name, re-asked after any connection failure.
    Sentinel(Box<SentinelMaster>),
    /// deadpool-redis's sentinel pool: new connections ask the sentinels for the master.
    SentinelPool(deadpool_redis::sentinel::Pool),
}

/// A cluster connection created on first use.
struct LazyCluster {
    client: ClusterClient,
    connection: tokio::sync::OnceCell<ClusterConnection>,
}

impl LazyCluster {
    /// A handle on the shared cluster connection (multiplexed: clones share it).
    async fn connection(&self) -> Result<ClusterConnection, StoreError> {
        self.connection
            .get_or_try_init(|| self.client.get_async_connection())
            .await
            .cloned()
            .map_err(classify)
    }
}

/// A multiplexed connection to the master the sentinels name. A failed call drops it, so the
/// next call asks the sentinels again and, after a failover, reaches the promoted replica.
struct SentinelMaster {
    client: tokio::sync::Mutex<SentinelClient>,
    current: std::sync::Mutex<Option<MultiplexedConnection>>,
}

impl SentinelMaster {
    async fn connection(&self) -> Result<MultiplexedConnection, StoreError> {
        if let Some(connection) = self.current() {
            return Ok(connection);
        }
        let mut client = self.client.lock().await;
        // Another call may have connected while this one waited for the client.
        if let Some(connection) = self.current() {
            return Ok(connection);
        }
        let connection = client.get_async_connection().await.map_err(classify)?;
        *self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(connection.clone());
        Ok(connection)
    }

    fn current(&self) -> Option<MultiplexedConnection> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn forget(&self) {
        *self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

/// A multiplexed connection created on first use, inside the runtime that will drive it.
struct LazyManager {
    client: Client,
    config: ConnectionManagerConfig,
    manager: tokio::sync::OnceCell<ConnectionManager>,
}

impl LazyManager {
    /// A handle on the shared connection (multiplexed: clones share it). Before the first
    /// one, a plain connection is opened and dropped, so that a refusal (a wrong password) is
    /// the caller's error, with its reason, rather than a deadline running out while the
    /// manager's own connection retries.
    async fn manager(&self) -> Result<ConnectionManager, StoreError> {
        self.manager
            .get_or_try_init(|| async {
                drop(self.client.get_multiplexed_async_connection().await?);
                ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone())
            })
            .await
            .cloned()
            .map_err(classify)
    }
}

struct Inner {
    connection: Connection,
    guard: Arc<Guard>,
    cluster_compatible: bool,
    /// On a cluster, one breaker per master (see [`cluster`]), so that a dead master trips
    /// the breaker of its identities only.
    cluster_breakers: Option<ClusterBreakers>,
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

/// Whether the store is failing (transient: connections, timeouts, a cluster or a server in
/// trouble, refused credentials) or the call itself is at fault. The latter repeats on every
/// call however healthy Redis is, so it is not transient and never opens the breaker (SPEC §3):
/// a Lua error (the script's bug, or corrupted data), `WRONGTYPE`, a call across slots.
fn classify(error: RedisError) -> StoreError {
    use redis::{ErrorKind, ServerErrorKind};
    let is_script_error = error
        .detail()
        .is_some_and(|detail| detail.contains("user_script") || detail.starts_with("floodgate:"));
    let the_call_is_at_fault = match error.kind() {
        ErrorKind::Server(ServerErrorKind::CrossSlot | ServerErrorKind::ExecAbort) => true,
        ErrorKind::Server(ServerErrorKind::ResponseError) => is_script_error,
        ErrorKind::Extension => error.code() == Some("WRONGTYPE") || is_script_error,
        ErrorKind::UnexpectedReturnType => true,
        _ => false,
    };
    let refused = matches!(
        error.kind(),
        ErrorKind::AuthenticationFailed | ErrorKind::Server(ServerErrorKind::NoPerm)
    ) || matches!(error.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM"));
    if the_call_is_at_fault {
        StoreError::Protocol(error.to_string())
    } else if refused {
        StoreError::Rejected(Box::new(error))
    } else {
        StoreError::Unavailable(Box::new(error))
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
        }
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
            self.refresh_slot_map().await;
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
        // Asked on every batched decision: a single node's breaker is read in place.
        let state = match &self.inner.cluster_breakers {
            None => self.inner.guard.state(),
            Some(breakers) => breakers.guard_for(key).state(),
        };
        state == BreakerState::Open
    }

    /// Runs a command outside the decisions (slot map, probes): within the deadline (at least
    /// 100ms), outside the breaker. In multiplexed mode on a connection of its own, since the
    /// shared one may be retrying in the background and would hide why it fails.
    async fn query(&self, command: &redis::Cmd) -> Result<Value, StoreError> {
        let deadline = self
            .inner
            .guard
            .config()
            .timeout
            .max(Duration::from_millis(100));
        let query = async {
            match &self.inner.connection {
                Connection::Multiplexed(lazy) => {
                    let mut connection = lazy
                        .client
                        .get_multiplexed_async_connection()
                        .await
                        .map_err(classify)?;
                    command.query_async::<Value>(&mut connection).await
                }
                Connection::Pool(pool) => {
                    let mut connection = pool.get().await.map_err(pool_error)?;
                    command.query_async::<Value>(&mut *connection).await
                }
                Connection::Cluster(lazy) => {
                    command
                        .query_async::<Value>(&mut lazy.connection().await?)
                        .await
                }
                Connection::ClusterPool(pool) => {
                    let mut connection = pool.get().await.map_err(pool_error)?;
                    command.query_async::<Value>(&mut *connection).await
                }
                Connection::Sentinel(master) => {
                    let mut connection = master.connection().await?;
                    command.query_async::<Value>(&mut connection).await
                }
                Connection::SentinelPool(pool) => {
                    let mut connection = pool.get().await.map_err(pool_error)?;
                    command.query_async::<Value>(&mut *connection).await
                }
            }
            .map_err(classify)
        };
        match tokio::time::timeout(deadline, query).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(deadline)),
        }
    }

    /// Runs one script invocation on a connection.
    async fn invoke(&self, invocation: &redis::ScriptInvocation<'_>) -> Result<Value, StoreError> {
        match &self.inner.connection {
            Connection::Multiplexed(lazy) => {
                let mut connection = lazy.manager().await?;
                invoke_on(&mut connection, invocation).await
            }
            Connection::Pool(pool) => {
                let mut connection = pool.get().await.map_err(pool_error)?;
                invoke_on(&mut *connection, invocation).await
            }
            Connection::Cluster(lazy) => invoke_on(&mut lazy.connection().await?, invocation).await,
            Connection::ClusterPool(pool) => {
                let mut connection = pool.get().await.map_err(pool_error)?;
                invoke_on(&mut *connection, invocation).await
            }
            Connection::Sentinel(master) => {
                let mut connection = master.connection().await?;
                let result = invoke_on(&mut connection, invocation).await;
                if result.is_err() {
                    // Maybe a failover: ask the sentinels again next time.
                    master.forget();
                }
                result
            }
            Connection::SentinelPool(pool) => {
                let mut connection = pool.get().await.map_err(pool_error)?;
                invoke_on(&mut *connection, invocation).await
            }
        }
    }

    /// One script call under this store's deadline and breaker.
    async fn guarded_call(
        &self,
        mode: Mode,
        checks: &[&Check],
        tokens: &[String],
        now: Option<Timestamp>,
    ) -> Result<Reply, StoreError> {
        let key = checks.first().map_or("", |check| &*check.key);
        self.guarded(key, self.call(mode, checks, tokens, now))
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
            let invocation = script::invocation(Mode::Sync, checks, &[], now);
            let value = self.invoke(&invocation).await?;
            script::decode_sync(value, checks)
        })
        .await
    }

    async fn call(
        &self,
        mode: Mode,
        checks: &[&Check],
        tokens: &[String],
        now: Option<Timestamp>,
    ) -> Result<Reply, StoreError> {
        let invocation = script::invocation(mode, checks, tokens, now);
        let value = self.invoke(&invocation).await?;
        script::decode(value, checks.len())
    }

    /// Indices of `checks` grouped into script calls, in order of first appearance.
    fn groups(&self, checks: &[Check]) -> Vec<Vec<usize>> {
        if !self.inner.cluster_compatible {
            return vec![(0..checks.len()).collect()];
        }
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (index, check) in checks.iter().enumerate() {
            let slot = hash_slot(&check.key);
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

/// Decides `checks` by one script call per group, in group order; a group's node is the store
/// that runs its call. When a group denies, what earlier groups took is refunded, and every
/// group not charged is reported as it stands (SPEC §1's order-and-refund rule).
async fn decide_groups(
    groups: &[Group<'_>],
    checks: &[Check],
    now: Option<Timestamp>,
) -> Result<Decision, StoreError> {
    if checks.is_empty() {
        return Ok(Decision::from_outcomes(
            now.unwrap_or_else(Timestamp::now),
            checks,
            &[],
            Vec::new(),
        ));
    }
    let mut outcomes: Vec<Option<LimitOutcome>> = vec![None; checks.len()];
    let mut tokens: Vec<String> = vec![String::new(); checks.len()];
    // Every lease a script may take, released unless this decision ends: on an error (a
    // deadline that fired after the script ran) or a drop (the request went away) mid-way.
    let mut taken = TakenLeases::default();
    // Later calls use the first call's server time, so every group decides at one instant.
    let mut decided_at = now;
    let mut denied_group = None;
    for (
        position,
        Group {
            node,
            members: group,
        },
    ) in groups.iter().enumerate()
    {
        let group_checks: Vec<&Check> = group.iter().map(|&index| &checks[index]).collect();
        // Concurrency limits take a lease under a fresh random id; a log entry is made unique
        // by one (its position in the log is not: a refund can remove an older entry).
        let lease_ids: Vec<String> = group_checks
            .iter()
            .map(|check| match check.limit.algorithm() {
                Algorithm::Concurrency => {
                    let id = fastrand::u64(1..);
                    taken.add(node, check, id);
                    id.to_string()
                }
                Algorithm::SlidingWindowLog => fastrand::u64(1..).to_string(),
                _ => String::new(),
            })
            .collect();
        let reply = node
            .guarded_call(Mode::Check, &group_checks, &lease_ids, decided_at)
            .await?;
        decided_at.get_or_insert(reply.now);
        for ((&index, outcome), token) in group.iter().zip(reply.outcomes).zip(reply.tokens) {
            outcomes[index] = Some(outcome);
            tokens[index] = token;
        }
        if !reply.admitted {
            denied_group = Some(position);
            break;
        }
    }
    if let Some(denied) = denied_group {
        // Give back what earlier groups took, then report them (and the groups never
        // reached) as they stand.
        for Group {
            node,
            members: group,
        } in groups[..denied].iter().chain(&groups[denied + 1..])
        {
            let group_checks: Vec<&Check> = group.iter().map(|&index| &checks[index]).collect();
            let was_charged = outcomes[group[0]].is_some();
            let group_tokens: Vec<String> =
                group.iter().map(|&index| tokens[index].clone()).collect();
            let (mode, tokens) = if was_charged {
                (Mode::Refund, group_tokens)
            } else {
                // Never reached: evaluated at the request's cost, so that one that would deny
                // too reports its (perhaps longer) wait, as on a single call.
                (Mode::Peek, vec![String::new(); group.len()])
            };
            let reply = node
                .guarded_call(mode, &group_checks, &tokens, decided_at)
                .await?;
            for (&index, outcome) in group.iter().zip(reply.outcomes) {
                // A refunded limit had admitted the request.
                let allowed = was_charged || outcome.allowed;
                outcomes[index] = Some(LimitOutcome { allowed, ..outcome });
            }
        }
    }
    let outcomes: Vec<LimitOutcome> = outcomes
        .into_iter()
        .map(|outcome| {
            outcome.ok_or_else(|| StoreError::Protocol("a limit went unanswered".into()))
        })
        .collect::<Result<_, _>>()?;
    let admitted = denied_group.is_none();
    // Decided: an admission's leases go to the caller; a denial's were refunded.
    taken.hand_over();
    let leases = if admitted {
        checks
            .iter()
            .zip(&tokens)
            .filter(|(check, _)| check.limit.algorithm() == Algorithm::Concurrency)
            .filter_map(|(check, token)| {
                let (id, _) = token.split_once(':')?;
                Some(Lease {
                    key: check.key.clone(),
                    id: id.parse().ok()?,
                    cost: check.cost,
                })
            })
            .collect()
    } else {
        Vec::new()
    };
    let decided_at = decided_at.unwrap_or_else(Timestamp::now);
    Ok(Decision::from_outcomes(
        decided_at, checks, &outcomes, leases,
    ))
}

/// Reads `checks` by one peek call per group, changing nothing.
async fn peek_groups(
    groups: &[Group<'_>],
    checks: &[Check],
    now: Option<Timestamp>,
) -> Result<Decision, StoreError> {
    let mut outcomes: Vec<Option<LimitOutcome>> = vec![None; checks.len()];
    let mut decided_at = now;
    for Group { node, members } in groups {
        let group_checks: Vec<&Check> = members.iter().map(|&index| &checks[index]).collect();
        let tokens = vec![String::new(); members.len()];
        let reply = node
            .guarded_call(Mode::Peek, &group_checks, &tokens, decided_at)
            .await?;
        decided_at.get_or_insert(reply.now);
        for (&index, outcome) in members.iter().zip(reply.outcomes) {
            outcomes[index] = Some(outcome);
        }
    }
    let outcomes: Vec<LimitOutcome> = outcomes
        .into_iter()
        .map(|outcome| {
            outcome.ok_or_else(|| StoreError::Protocol("a limit went unanswered".into()))
        })
        .collect::<Result<_, _>>()?;
    Ok(Decision::from_outcomes(
        decided_at.unwrap_or_else(Timestamp::now),
        checks,
        &outcomes,
        Vec::new(),
    ))
}

/// Post-charges `checks` by one call per group, concurrently.
async fn charge_groups(
    groups: &[Group<'_>],
    checks: &[Check],
    now: Option<Timestamp>,
) -> Result<(), StoreError> {
    let calls = groups.iter().map(|Group { node, members }| async move {
        let group_checks: Vec<&Check> = members.iter().map(|&index| &checks[index]).collect();
        // A log entry is made unique by a random id, as on admission.
        let tokens: Vec<String> = group_checks
            .iter()
            .map(|check| match check.limit.algorithm() {
                Algorithm::SlidingWindowLog => fastrand::u64(1..).to_string(),
                _ => String::new(),
            })
            .collect();
        node.guarded_call(Mode::Charge, &group_checks, &tokens, now)
            .await
            .map(drop)
    });
    futures_util::future::try_join_all(calls).await.map(drop)
}

/// The leases a decision's scripts may have taken, by node. Dropped before
/// [`TakenLeases::hand_over`], it releases them in the background: releasing a lease that was
/// never taken does nothing.
#[derive(Default)]
struct TakenLeases {
    leases: Vec<(RedisStore, Lease)>,
}

impl TakenLeases {
    fn add(&mut self, node: &RedisStore, check: &Check, id: u64) {
        let lease = Lease {
            key: check.key.clone(),
            id,
            cost: check.cost,
        };
        self.leases.push((node.clone(), lease));
    }

    fn hand_over(&mut self) {
        self.leases.clear();
    }
}

impl Drop for TakenLeases {
    fn drop(&mut self) {
        if self.leases.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut by_node: Vec<(RedisStore, Vec<Lease>)> = Vec::new();
        for (node, lease) in self.leases.drain(..) {
            match by_node
                .iter_mut()
                .find(|(known, _)| Arc::ptr_eq(&known.inner, &node.inner))
            {
                Some((_, leases)) => leases.push(lease),
                None => by_node.push((node, vec![lease])),
            }
        }
        for (node, leases) in by_node {
            runtime.spawn(async move {
                if let Err(error) = node.release(leases).await {
                    tracing::warn!(%error, "could not release the leases of an abandoned decision; they expire with their window");
                }
            });
        }
    }
}

/// Syncs `checks` by one call per group, concurrently (pipelined on a multiplexed
/// connection), and puts the states back in the order of `checks`.
async fn sync_groups(
    groups: &[Group<'_>],
    checks: &[Check],
    now: Option<Timestamp>,
) -> Result<Synced, StoreError> {
    let calls = groups.iter().map(|group| async move {
        let members: Vec<&Check> = group.members.iter().map(|&index| &checks[index]).collect();
        group.node.guarded_sync(&members, now).await
    });
    let replies = futures_util::future::try_join_all(calls).await?;
    let mut states = vec![None; checks.len()];
    let mut latest = now.unwrap_or(Timestamp::EPOCH);
    for (group, reply) in groups.iter().zip(replies) {
        latest = latest.max(reply.now);
        for (&index, state) in group.members.iter().zip(reply.states) {
            states[index] = state;
        }
    }
    Ok(Synced {
        now: latest,
        states,
    })
}

/// Checks decided together by one script call on `node`.
struct Group<'s> {
    node: &'s RedisStore,
    members: Vec<usize>,
}

async fn invoke_on<C: ConnectionLike + Send>(
    connection: &mut C,
    invocation: &redis::ScriptInvocation<'_>,
) -> Result<Value, StoreError> {
    invocation.invoke_async(connection).await.map_err(classify)
}

impl RedisStore {
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

    fn is_refused(&self, key: &str) -> bool {
        RedisStore::is_refused(self, key)
    }
}

impl Store for RedisStore {
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(async move { decide_groups(&self.node_groups(checks), checks, now).await })
    }

    fn release<'a>(&'a self, leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            // One call per hash slot where a call must stay on one (a request's leases may be
            // on several: a global or per-IP concurrency limit and the client's), concurrently.
            let mut by_slot: Vec<Vec<&Lease>> = Vec::new();
            for lease in &leases {
                let slot = hash_slot(&lease.key);
                match by_slot.iter_mut().find(|group| {
                    !self.inner.cluster_compatible || hash_slot(&group[0].key) == slot
                }) {
                    Some(group) => group.push(lease),
                    None => by_slot.push(vec![lease]),
                }
            }
            let calls = by_slot.iter().map(|group| async move {
                let mut invocation = script::RELEASE.prepare_invoke();
                for lease in group {
                    invocation
                        .key(&*lease.key)
                        .arg(format!("{}:{}", lease.id, lease.cost));
                }
                self.invoke(&invocation).await
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
        Box::pin(async move { peek_groups(&self.node_groups(checks), checks, now).await })
    }

    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move { charge_groups(&self.node_groups(checks), checks, now).await })
    }

    /// `DEL`, one call per hash slot where calls must stay on one; outside the breaker.
    fn reset<'a>(&'a self, keys: &'a [Arc<str>]) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let mut by_slot: Vec<Vec<&str>> = Vec::new();
            for key in keys {
                let slot = hash_slot(key);
                match by_slot
                    .iter_mut()
                    .find(|group| !self.inner.cluster_compatible || hash_slot(group[0]) == slot)
                {
                    Some(group) => group.push(key),
                    None => by_slot.push(vec![key]),
                }
            }
            let mut removed = 0;
            for group in by_slot {
                let mut command = redis::cmd("DEL");
                for key in group {
                    command.arg(key);
                }
                match self.query(&command).await? {
                    Value::Int(count) => removed += u64::try_from(count).unwrap_or(0),
                    other => {
                        return Err(StoreError::Protocol(format!("DEL answered {other:?}")));
                    }
                }
            }
            Ok(removed)
        })
    }

    /// `PING`, outside the breaker.
    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move { self.query(&redis::cmd("PING")).await.map(drop) })
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
