//! Reaching Redis: the connection of each deployment and mode (single server, cluster,
//! sentinel; multiplexed or pooled), running commands and scripts on it, and sorting Redis's
//! errors into the store's failure classes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;

use deadpool_redis::redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use deadpool_redis::redis::cluster::ClusterClient;
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::redis::sentinel::{SentinelClient, SentinelServerType};
use deadpool_redis::redis::{self, Client, RedisError, Value};

use super::silence::{SilenceWatch, silence_limit};
use super::{ConnectionMode, Deployment};
use crate::store::StoreError;
use crate::store::resilience::GuardConfig;

/// The connection a store opens on `deployment`: nothing is dialled yet (lazy connections and
/// pools connect on first use), so a Redis that is down at start-up is not an error here.
pub(super) fn connect(
    deployment: &Deployment,
    mode: ConnectionMode,
    guard: &GuardConfig,
) -> Result<Connection, StoreError> {
    let pool_size = match mode {
        ConnectionMode::Multiplexed => 1,
        ConnectionMode::Pool(size) => size.max(1),
    };
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
    let connection = match (deployment, mode) {
        (Deployment::Single(url), ConnectionMode::Multiplexed) => {
            let client = Client::open(url.as_str()).map_err(invalid_url)?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(guard.timeout.max(Duration::from_millis(100))))
                .set_response_timeout(None)
                // Reconnection attempts: the manager never sends a call again itself.
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(200));
            Connection::Multiplexed(Box::new(LazyManager {
                client,
                config,
                manager: tokio::sync::OnceCell::new(),
                silence: SilenceWatch::new(silence_limit(guard.timeout)),
            }))
        }
        (Deployment::Single(url), ConnectionMode::Pool(_)) => Connection::Pool(tuned!(
            deadpool_redis::Config::from_url(url.as_str()).builder()
        )),
        (Deployment::Cluster(nodes), mode) => {
            // No retries: redis-rs would send a call again after a connection broke, without
            // knowing whether Redis ran it (a decision counted twice). Calls refused unrun are
            // sent again by `Connection::run_again`.
            let client = ClusterClient::builder(nodes.clone())
                .connection_timeout(guard.timeout.max(Duration::from_millis(100)))
                .retries(0)
                .build()
                .map_err(invalid_url)?;
            let connections = match mode {
                ConnectionMode::Multiplexed => 1,
                ConnectionMode::Pool(size) => size.max(1),
            };
            Connection::Cluster(Box::new(LazyCluster {
                client,
                connections: (0..connections)
                    .map(|_| tokio::sync::OnceCell::new())
                    .collect(),
                next: AtomicUsize::new(0),
            }))
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
                silence: SilenceWatch::new(silence_limit(guard.timeout)),
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
    Ok(connection)
}

fn unavailable(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

/// A pool that could not hand out a connection: a refusal or error of Redis keeps its class.
fn pool_store_error(error: deadpool_redis::PoolError) -> StoreError {
    match error {
        deadpool_redis::PoolError::Backend(error) => classify(error),
        other => unavailable(other),
    }
}

fn invalid_url(error: RedisError) -> StoreError {
    StoreError::Config(error.to_string())
}

/// How a store reaches Redis, by deployment and connection mode.
pub(super) enum Connection {
    Multiplexed(Box<LazyManager>),
    Pool(deadpool_redis::Pool),
    /// Multiplexed cluster connections (one, or a pool's size taken in turn): each routes a
    /// call by its first key's slot and refreshes the slot map when nodes change; redirections
    /// are followed by [`Connection::run`].
    Cluster(Box<LazyCluster>),
    /// The master the sentinels name, re-asked after any connection failure.
    Sentinel(Box<SentinelMaster>),
    /// deadpool-redis's sentinel pool: new connections ask the sentinels for the master.
    SentinelPool(deadpool_redis::sentinel::Pool),
}

/// Cluster connections, each created on first use, taken in turn. Not deadpool-redis's cluster
/// pool: it builds its client with redis-rs's default of 16 retries, which re-send a call
/// whose connection broke after Redis may have run it.
pub(super) struct LazyCluster {
    client: ClusterClient,
    connections: Vec<tokio::sync::OnceCell<ClusterConnection>>,
    next: AtomicUsize,
}

impl LazyCluster {
    /// A handle on the next cluster connection (multiplexed: clones share it).
    async fn connection(&self) -> Result<ClusterConnection, StoreError> {
        let turn = match self.connections.len() {
            1 => 0,
            count => self.next.fetch_add(1, Ordering::Relaxed) % count,
        };
        self.connections[turn]
            .get_or_try_init(|| self.client.get_async_connection())
            .await
            .cloned()
            .map_err(classify)
    }
}

/// A multiplexed connection to the master the sentinels name. A failed call drops it, and so
/// does a connection gone silent (a master whose host vanished or froze answers nothing and
/// closes nothing), so the next call asks the sentinels again and, after a failover, reaches
/// the promoted replica.
pub(super) struct SentinelMaster {
    client: tokio::sync::Mutex<SentinelClient>,
    current: std::sync::Mutex<Option<MultiplexedConnection>>,
    silence: SilenceWatch,
}

impl SentinelMaster {
    async fn connection(&self) -> Result<MultiplexedConnection, StoreError> {
        if self.silence.take_given_up() {
            tracing::warn!(
                "the Redis master's connection went silent: asking the sentinels for the master again"
            );
            self.forget();
        }
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

/// A multiplexed connection created on first use, inside the runtime that will drive it, and
/// replaced by a new one when it goes silent (redis-rs's manager reconnects only when the
/// connection breaks, and a host that vanished breaks nothing).
pub(super) struct LazyManager {
    client: Client,
    config: ConnectionManagerConfig,
    manager: tokio::sync::OnceCell<ArcSwap<ConnectionManager>>,
    silence: SilenceWatch,
}

impl LazyManager {
    /// A handle on the shared connection (multiplexed: clones share it). Before the first
    /// one, a plain connection is opened and dropped, so that a refusal (a wrong password) is
    /// the caller's error, with its reason, rather than a deadline running out while the
    /// manager's own connection retries.
    async fn manager(&self) -> Result<ConnectionManager, StoreError> {
        if let Some(manager) = self.manager.get() {
            if self.silence.take_given_up() {
                self.replace(manager);
            }
            return Ok(ConnectionManager::clone(&manager.load()));
        }
        // Boxed: connecting is a future of kilobytes that only the first call awaits, and
        // every decision's future would otherwise carry (and move) room for it.
        Box::pin(self.manager.get_or_try_init(|| async {
            drop(self.client.get_multiplexed_async_connection().await?);
            ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone())
                .map(ArcSwap::from_pointee)
        }))
        .await
        .map(|manager| ConnectionManager::clone(&manager.load()))
        .map_err(classify)
    }

    /// Puts a new connection (dialled on its first call) in place of the silent one. Calls
    /// still waiting on the old one end at their deadlines; it closes when the last is gone.
    fn replace(&self, manager: &ArcSwap<ConnectionManager>) {
        match ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone()) {
            Ok(fresh) => {
                manager.store(Arc::new(fresh));
                tracing::warn!("the Redis connection went silent: replaced by a new one");
            }
            Err(error) => {
                tracing::warn!(%error, "the Redis connection went silent and could not be replaced");
            }
        }
    }

    /// Runs `command` on the shared connection, watching it for silence.
    async fn run(&self, command: &redis::Cmd) -> Result<Value, ConnectionError> {
        let mut connection = self.manager().await.map_err(ConnectionError::Store)?;
        self.silence.watch(run_on(&mut connection, command)).await
    }
}

impl Connection {
    /// Runs a command outside the decisions (slot map, probes): within `deadline`, outside the
    /// breaker. In multiplexed mode on a connection of its own, since the
    /// shared one may be retrying in the background and would hide why it fails.
    pub(super) async fn query(
        &self,
        command: &redis::Cmd,
        deadline: Duration,
    ) -> Result<Value, StoreError> {
        let query = async {
            match self {
                Connection::Multiplexed(lazy) => {
                    let mut connection = lazy
                        .client
                        .get_multiplexed_async_connection()
                        .await
                        .map_err(classify)?;
                    command.query_async::<Value>(&mut connection).await
                }
                Connection::Pool(pool) => {
                    let mut connection = pool.get().await.map_err(pool_store_error)?;
                    command.query_async::<Value>(&mut *connection).await
                }
                Connection::Cluster(lazy) => {
                    command
                        .query_async::<Value>(&mut lazy.connection().await?)
                        .await
                }
                Connection::Sentinel(master) => {
                    let mut connection = master.connection().await?;
                    command.query_async::<Value>(&mut connection).await
                }
                Connection::SentinelPool(pool) => {
                    let mut connection = pool.get().await.map_err(pool_store_error)?;
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

    /// Runs `command` (a library call, or the loading of the library) on the decisions'
    /// connection, and gives Redis's error as it is, for the caller to tell a missing function
    /// or script from a failure.
    ///
    /// This future is inside every decision's: the default (multiplexed) connection is awaited
    /// in place, the others behind a box, so that the decision's future is sized for the
    /// multiplexed call alone (the largest arm sized all of them: ~10 KB, moved several times
    /// per decision, a tenth of the gateway's CPU on the Redis path).
    ///
    /// At most once: no client library here sends a call again (their retries are off), and
    /// this sends it again only when Redis's answer proves that it did not run it
    /// ([`not_run`]): a redirection, a cluster or server not ready, a connection refused.
    pub(super) async fn run(&self, command: &redis::Cmd) -> Result<Value, ConnectionError> {
        let result = match self {
            Connection::Multiplexed(lazy) => lazy.run(command).await,
            other => Box::pin(other.run_elsewhere(command)).await,
        };
        match result {
            Err(ConnectionError::Redis(error)) if not_run(&error) => {
                // Boxed: rare, and its future would size every decision's.
                Box::pin(self.run_again(command, error)).await
            }
            other => other,
        }
    }

    /// Sends `command` again after Redis refused it unrun with `error`, up to
    /// [`NOT_RUN_RETRIES`] times: to the node a redirection names (with `ASKING` for an
    /// `ASK`), else as before once a short pause has let the slot map, a failover or a load
    /// progress. The caller's deadline bounds the whole.
    async fn run_again(
        &self,
        command: &redis::Cmd,
        mut error: RedisError,
    ) -> Result<Value, ConnectionError> {
        for attempt in 1..=NOT_RUN_RETRIES {
            let redirected = match (self, Redirection::of(&error)) {
                (Connection::Cluster(lazy), Some(redirection)) => {
                    let connection = lazy.connection().await.map_err(ConnectionError::Store)?;
                    Some(redirection.follow(connection, command).await)
                }
                _ => None,
            };
            let result = match redirected {
                Some(result) => result,
                None => {
                    tokio::time::sleep(NOT_RUN_PAUSE * attempt).await;
                    Box::pin(self.run_elsewhere(command)).await
                }
            };
            match result {
                Err(ConnectionError::Redis(again)) if not_run(&again) => error = again,
                other => return other,
            }
        }
        Err(ConnectionError::Redis(error))
    }

    /// [`Connection::run`]'s one sending of `command`, on any connection (the multiplexed one
    /// is served in place by `run`).
    async fn run_elsewhere(&self, command: &redis::Cmd) -> Result<Value, ConnectionError> {
        match self {
            Connection::Multiplexed(lazy) => lazy.run(command).await,
            Connection::Pool(pool) => {
                let mut connection = pool.get().await.map_err(pool_error)?;
                run_on(&mut *connection, command).await
            }
            Connection::Cluster(lazy) => {
                let mut connection = lazy.connection().await.map_err(ConnectionError::Store)?;
                run_on(&mut connection, command).await
            }
            Connection::Sentinel(master) => {
                let mut connection = master.connection().await.map_err(ConnectionError::Store)?;
                let result = master.silence.watch(run_on(&mut connection, command)).await;
                if result.is_err() {
                    // Maybe a failover: ask the sentinels again next time.
                    master.forget();
                }
                result
            }
            Connection::SentinelPool(pool) => {
                let mut connection = pool.get().await.map_err(pool_error)?;
                run_on(&mut *connection, command).await
            }
        }
    }
}

/// Why [`Connection::run`] failed: no connection to run on (already a store error), or Redis
/// answered with an error (the caller may recover from some: a missing function or script).
#[derive(Debug)]
pub(super) enum ConnectionError {
    /// No connection could be had.
    Store(StoreError),
    /// Redis's error.
    Redis(RedisError),
}

impl ConnectionError {
    /// The store error this is.
    pub(super) fn into_store_error(self) -> StoreError {
        match self {
            ConnectionError::Store(error) => error,
            ConnectionError::Redis(error) => classify(error),
        }
    }

    /// Redis's error, if Redis answered.
    pub(super) fn redis(&self) -> Option<&RedisError> {
        match self {
            ConnectionError::Redis(error) => Some(error),
            ConnectionError::Store(_) => None,
        }
    }
}

/// How many times [`Connection::run`] sends a call again that Redis refused without running it.
const NOT_RUN_RETRIES: u32 = 3;

/// The pause before sending such a call again, times the attempt: a slot map being refreshed,
/// a replica being promoted, a server loading its data.
const NOT_RUN_PAUSE: Duration = Duration::from_millis(10);

/// Whether `error` proves that the call did not run, so that sending it again cannot apply it
/// twice: a redirection (`MOVED`, `ASK`), a cluster or server not ready (`TRYAGAIN`,
/// `CLUSTERDOWN`, `MASTERDOWN`, `LOADING`, `READONLY`: refused before the script starts), no
/// connection for the call's node, or a connect refused (nothing was written). A connection
/// that broke after the call was written proves nothing, and is never a reason to send again.
/// (`NOSCRIPT` and a missing function are answered where the library is loaded.)
fn not_run(error: &RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    match error.kind() {
        ErrorKind::Server(kind) => matches!(
            kind,
            ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ReadOnly
        ),
        ErrorKind::ClusterConnectionNotFound => true,
        _ => error.is_connection_refusal(),
    }
}

/// A cluster node's redirection of a call: where to send it, and whether as an `ASK` (the
/// slot is migrating: `ASKING` first, on the same connection) or a `MOVED`.
struct Redirection {
    host: String,
    port: u16,
    asking: bool,
}

impl Redirection {
    fn of(error: &RedisError) -> Option<Redirection> {
        let (node, _slot) = error.redirect_node()?;
        let (host, port) = node.rsplit_once(':')?;
        Some(Redirection {
            host: host.to_owned(),
            port: port.parse().ok()?,
            asking: error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::Ask),
        })
    }

    /// Sends `command` to the node named, on `connection`.
    async fn follow(
        self,
        mut connection: ClusterConnection,
        command: &redis::Cmd,
    ) -> Result<Value, ConnectionError> {
        use deadpool_redis::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        let node = SingleNodeRoutingInfo::ByAddress {
            host: self.host,
            port: self.port,
        };
        let answer = if self.asking {
            let mut pipeline = redis::pipe();
            pipeline.cmd("ASKING").add_command(command.clone());
            connection
                .route_pipeline(pipeline, 1, 1, node)
                .await
                .and_then(|mut values| values.pop().unwrap_or(Value::Nil).extract_error())
        } else {
            connection
                .route_command(command.clone(), RoutingInfo::SingleNode(node))
                .await
                .and_then(Value::extract_error)
        };
        answer.map_err(ConnectionError::Redis)
    }
}

fn pool_error(error: deadpool_redis::PoolError) -> ConnectionError {
    ConnectionError::Store(pool_store_error(error))
}

async fn run_on<C: ConnectionLike + Send>(
    connection: &mut C,
    command: &redis::Cmd,
) -> Result<Value, ConnectionError> {
    command
        .query_async(connection)
        .await
        .map_err(ConnectionError::Redis)
}

/// Whether the store is failing (transient: connections, timeouts, a cluster or a server in
/// trouble, refused credentials) or the call itself is at fault. The latter repeats on every
/// call however healthy Redis is, so it is not transient and never opens the breaker (SPEC §3):
/// a Lua error (the script's bug, or corrupted data), `WRONGTYPE`, a call across slots.
fn classify(error: RedisError) -> StoreError {
    use redis::{ErrorKind, ServerErrorKind};
    let is_script_error = error.detail().is_some_and(|detail| {
        detail.contains("user_script")
            || detail.contains("user_function")
            || detail.starts_with("floodgate:")
    });
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
