//! Test support for floodgate's crates (dev-only, not published): real `redis-server`
//! processes and clusters on free ports, owned by the test that starts them and killed when it
//! ends (even on panic), and stores that keep their servers alive; a fault-injecting proxy
//! ([`faults`]) to put between a store and a server.

pub mod chaos;
mod cluster;
pub mod failover;
pub mod faults;
pub mod fleet;
pub mod regions;
/// An RLQS client that behaves as Envoy's `rate_limit_quota` filter, to drive an RLQS server.
pub mod rlqs;

pub use cluster::{ClusterNode, RedisCluster};

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use floodgate::store::{BoxFuture, RedisStore, ShardedRedisStore};
use floodgate::{Decision, Store, StoreError, store::Check, store::Lease, time::Timestamp};

/// A `redis-server` child process: no persistence, loopback only.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    extra: Vec<String>,
    /// Stopped by [`RedisServer::freeze`] and not yet thawed.
    frozen: bool,
}

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free loopback port")
}

impl RedisServer {
    /// Starts a server on a free port (retrying if another process takes the port first).
    pub fn start() -> RedisServer {
        let mut last_error = String::new();
        for _ in 0..10 {
            match RedisServer::start_on(free_port()) {
                Ok(server) => return server,
                Err(error) => last_error = error,
            }
        }
        panic!("could not start redis-server: {last_error}");
    }

    /// Starts a server on `port`; returns once it accepts connections (it says so on stdout).
    pub fn start_on(port: u16) -> Result<RedisServer, String> {
        RedisServer::spawn(port, &[])
    }

    /// Starts `redis-server` on `port` with `extra` arguments after the defaults (no
    /// persistence, loopback only); returns once it accepts connections. As on redis-server's
    /// own command line, a first `extra` argument not starting with `--` is a config file.
    pub fn spawn(port: u16, extra: &[String]) -> Result<RedisServer, String> {
        let (config_file, options) = match extra.split_first() {
            Some((file, rest)) if !file.starts_with("--") => (Some(file), rest),
            _ => (None, extra),
        };
        // Replicas write the RDB of a full resync into their working directory, even without
        // persistence: keep it out of the source tree.
        let dir = working_dir(port);
        let _ = std::fs::create_dir_all(&dir);
        let mut child = Command::new("redis-server")
            .args(config_file)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(&dir)
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--protected-mode", "no", "--logfile", ""])
            .args(options)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|error| {
                format!(
                    "redis-server is not runnable ({error}); install Debian's redis-server package"
                )
            })?;
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut log = Vec::new();
        let ready = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    // Sentinels announce their id instead of readiness.
                    let ready = line.contains("Ready to accept connections")
                        || line.contains("Sentinel ID is");
                    log.push(line);
                    if ready {
                        break true;
                    }
                }
                _ => break false,
            }
        };
        if !ready {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "redis-server on port {port} did not start:\n{}",
                log.join("\n")
            ));
        }
        // Keep draining its output so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Ok(RedisServer {
            child: Some(child),
            port,
            extra: extra.to_vec(),
            frozen: false,
        })
    }

    /// Starts a server on a free port with `extra` arguments, retrying on port races.
    pub fn start_with(extra: impl Fn(u16) -> Vec<String>) -> RedisServer {
        let mut last_error = String::new();
        for _ in 0..10 {
            let port = free_port();
            match RedisServer::spawn(port, &extra(port)) {
                Ok(server) => return server,
                Err(error) => last_error = error,
            }
        }
        panic!("could not start redis-server: {last_error}");
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the server (SIGKILL: a crash, not a shutdown) and waits for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.frozen = false;
    }

    /// Whether the process runs (it was not killed, or was restarted since).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Whether the process is stopped by [`freeze`](Self::freeze).
    pub fn is_frozen(&self) -> bool {
        self.frozen
    }

    /// Stops the process (SIGSTOP): a node gone silent to everyone at once (clients, its
    /// replicas, the cluster bus), its connections left open, until [`thaw`](Self::thaw).
    pub fn freeze(&mut self) {
        self.signal("-STOP");
        self.frozen = true;
    }

    /// Resumes a process stopped by [`freeze`](Self::freeze) (SIGCONT).
    pub fn thaw(&mut self) {
        self.signal("-CONT");
        self.frozen = false;
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("the server runs");
        let status = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .expect("kill(1) is installed");
        assert!(status.success(), "kill {signal} {} failed", child.id());
    }

    /// Starts a new server on the same port after [`kill`](Self::kill).
    pub fn restart(&mut self) {
        self.kill();
        let mut last_error = String::new();
        for _ in 0..50 {
            match RedisServer::spawn(self.port, &self.extra) {
                Ok(mut server) => {
                    self.child = server.child.take();
                    return;
                }
                Err(error) => {
                    last_error = error;
                    // The port may linger briefly after the kill; this is a retry, not a wait
                    // for a condition we could observe.
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        panic!("could not restart redis-server: {last_error}");
    }

    /// A plain synchronous connection, for setup and fault injection.
    pub fn connection(&self) -> deadpool_redis::redis::Connection {
        deadpool_redis::redis::Client::open(self.url())
            .and_then(|client| client.get_connection())
            .expect("connect to the test redis-server")
    }

    /// Runs a command and returns its reply.
    pub fn command<T: deadpool_redis::redis::FromRedisValue>(&self, args: &[&str]) -> T {
        self.try_command(args).expect("command succeeds")
    }

    /// Runs a command; the error if the server refuses it or is unreachable.
    pub fn try_command<T: deadpool_redis::redis::FromRedisValue>(
        &self,
        args: &[&str],
    ) -> Result<T, deadpool_redis::redis::RedisError> {
        let mut command = deadpool_redis::redis::cmd(args[0]);
        for arg in &args[1..] {
            command.arg(*arg);
        }
        let client = deadpool_redis::redis::Client::open(self.url())?;
        let mut connection = client.get_connection_with_timeout(Duration::from_secs(2))?;
        // A frozen server accepts (the kernel does) but never answers.
        connection.set_read_timeout(Some(Duration::from_secs(2)))?;
        command.query(&mut connection)
    }

    /// A server whose `FUNCTION` command is disabled (`rename-command FUNCTION ""`).
    pub fn without_functions() -> RedisServer {
        RedisServer::start_with(|_| {
            vec![
                "--rename-command".to_owned(),
                "FUNCTION".to_owned(),
                String::new(),
            ]
        })
    }

    /// Calls of `command` (`evalsha`, `fcall`, ...) this server has run since its last
    /// `CONFIG RESETSTAT`.
    pub fn command_calls(&self, command: &str) -> u64 {
        let info: String = self.command(&["INFO", "commandstats"]);
        let stat = format!("cmdstat_{command}:");
        info.lines()
            .find(|line| line.starts_with(&stat))
            .and_then(|line| line.split("calls=").nth(1)?.split(',').next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Script and function calls (EVALSHA, EVAL, FCALL) this server has run since its last
    /// `CONFIG RESETSTAT`.
    pub fn script_calls(&self) -> u64 {
        script_calls_in(&self.command::<String>(&["INFO", "commandstats"]))
    }
}

/// `urls` as the items of a YAML flow list: `"redis://a", "redis://b"`.
pub fn yaml_items(urls: &[String]) -> String {
    urls.iter()
        .map(|url| format!("\"{url}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Script and function calls (EVALSHA, EVAL, FCALL) counted in an `INFO commandstats` reply.
pub fn script_calls_in(info: &str) -> u64 {
    ["cmdstat_evalsha:", "cmdstat_eval:", "cmdstat_fcall:"]
        .iter()
        .filter_map(|stat| info.lines().find(|line| line.starts_with(stat)))
        .filter_map(|line| {
            line.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Polls `condition` every 50 ms until it holds or `within` passes: for states that Redis only
/// exposes by being asked (cluster and sentinel convergence), with no event to wait on.
pub fn wait_until(within: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + within;
    while !condition() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} did not happen within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A fixed-offset IANA zone where the local time is now between 12:00 and 13:00, so that a
/// calendar day counted there is hours from either of its ends, and its offset east of UTC in
/// hours: "Etc/GMT-<hours east>" (the IANA sign is inverted), or "Etc/GMT" itself.
pub fn zone_near_noon() -> (String, i64) {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is after 1970");
    let utc_hour = (since_epoch.as_secs() / 3600 % 24) as i64;
    let offset = 12 - utc_hour;
    let zone = match offset {
        0 => "Etc/GMT".to_owned(),
        east if east > 0 => format!("Etc/GMT-{east}"),
        west => format!("Etc/GMT+{}", -west),
    };
    (zone, offset)
}

/// Returns once the current fixed window of length `window` has at least `needed` left,
/// waiting for the next window to begin if it has not. Fixed windows are aligned to multiples
/// of their length since the epoch (by the same clock on loopback as Redis's), so a test that
/// counts in one window and runs across its end would see the count restart.
pub fn clear_of_window_end(window: Duration, needed: Duration) {
    assert!(
        needed < window,
        "{needed:?} cannot fit in a window of {window:?}"
    );
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is after 1970");
    let into_window = since_epoch.as_nanos() % window.as_nanos();
    let left = Duration::from_nanos((window.as_nanos() - into_window) as u64);
    if left < needed {
        // The clock is the only signal a window's end has; a margin past it keeps the
        // server's clock (read a moment later) in the new window too.
        std::thread::sleep(left + Duration::from_millis(50));
    }
}

/// A master, one replica and three sentinels (quorum 2) watching it as `fgmaster`, with
/// failover tuned to seconds.
pub struct SentinelGroup {
    /// The master the sentinels watch.
    pub master: RedisServer,
    /// Its replica, promoted on failover.
    pub replica: RedisServer,
    /// The sentinels.
    pub sentinels: Vec<RedisServer>,
    config_dir: std::path::PathBuf,
}

/// The name the sentinels know the master by.
pub const SENTINEL_MASTER: &str = "fgmaster";

impl SentinelGroup {
    /// Starts a master, a replica and the sentinels, and waits until they agree.
    pub fn start() -> SentinelGroup {
        let master = RedisServer::start();
        let master_port = master.port();
        let replica = RedisServer::start_with(|_| {
            vec![
                "--replicaof".into(),
                "127.0.0.1".into(),
                master_port.to_string(),
            ]
        });
        wait_until(Duration::from_secs(20), "the replica to sync", || {
            replica
                .try_command::<String>(&["INFO", "replication"])
                .is_ok_and(|info| info.contains("master_link_status:up"))
        });
        let config_dir = unique_temp_path("sentinel");
        std::fs::create_dir_all(&config_dir).expect("sentinel config dir");
        let sentinels: Vec<RedisServer> = (0..3)
            .map(|_| {
                let dir = config_dir.clone();
                RedisServer::start_with(move |port| {
                    let file = dir.join(format!("sentinel-{port}.conf"));
                    std::fs::write(
                        &file,
                        format!(
                            "sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {master_port} 2\n\
                             sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
                             sentinel failover-timeout {SENTINEL_MASTER} 5000\n\
                             sentinel parallel-syncs {SENTINEL_MASTER} 1\n"
                        ),
                    )
                    .expect("sentinel config");
                    vec![file.display().to_string(), "--sentinel".into()]
                })
            })
            .collect();
        let group = SentinelGroup {
            master,
            replica,
            sentinels,
            config_dir,
        };
        for sentinel in &group.sentinels {
            wait_until(
                Duration::from_secs(20),
                "sentinels to see each other",
                || {
                    sentinel
                        .try_command::<Vec<Vec<String>>>(&[
                            "SENTINEL",
                            "SENTINELS",
                            SENTINEL_MASTER,
                        ])
                        .is_ok_and(|others| others.len() == 2)
                },
            );
        }
        group
    }

    /// `redis://` URLs of the sentinels.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// The port of the master the sentinels currently name.
    pub fn current_master_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|sentinel| {
            let address: Vec<String> = sentinel
                .try_command(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER])
                .ok()?;
            address.get(1)?.parse().ok()
        })
    }
}

impl Drop for SentinelGroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.config_dir);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(working_dir(self.port));
    }
}

/// A path under the system's temporary directory that no other call gets, in this process or
/// another: `floodgate-<what>-<pid>-<n>`. (A free port is no such name: the kernel hands the
/// same port out again while the first directory named after it is still in use, and the
/// first test to finish would delete the other's.)
pub fn unique_temp_path(what: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "floodgate-{what}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// The working directory of the server on `port` (kept across its restarts).
fn working_dir(port: u16) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("floodgate-redis-{port}"))
}

/// A store together with the servers it talks to, so the servers live as long as the store:
/// what the conformance suite gets.
pub struct ServedStore<S = RedisStore> {
    /// The servers, kept alive as long as the store.
    pub servers: Vec<RedisServer>,
    /// The store.
    pub store: S,
}

impl ServedStore {
    /// A fresh server and a store on it with generous deadlines (tests measure semantics here,
    /// not latency; the fault tests set their own).
    pub fn start() -> ServedStore {
        ServedStore::on(RedisServer::start())
    }

    /// A fresh server whose `FUNCTION` command is renamed away (as an operator may disable it),
    /// and a store on it: the store must find out and decide by `EVALSHA`.
    pub fn without_functions() -> ServedStore {
        ServedStore::on(RedisServer::without_functions())
    }

    /// A store on `server`, with generous deadlines.
    pub fn on(server: RedisServer) -> ServedStore {
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(5))
            .build()
            .expect("store");
        ServedStore {
            servers: vec![server],
            store,
        }
    }
}

impl ServedStore<ShardedRedisStore> {
    /// `count` fresh servers as the nodes of a sharded store (identities placed by rendezvous
    /// hashing), with generous deadlines.
    pub fn sharded(count: usize) -> ServedStore<ShardedRedisStore> {
        let servers: Vec<RedisServer> = (0..count).map(|_| RedisServer::start()).collect();
        let nodes = servers
            .iter()
            .map(|server| {
                let store = RedisStore::builder(server.url())
                    .timeout(Duration::from_secs(5))
                    .build()
                    .expect("store");
                (server.url(), store)
            })
            .collect();
        ServedStore {
            servers,
            store: ShardedRedisStore::new(nodes).expect("nodes"),
        }
    }
}

impl<S: Store> Store for ServedStore<S> {
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        self.store.check_and_consume(checks, now)
    }

    fn release<'a>(&'a self, leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        self.store.release(leases)
    }

    fn backend(&self) -> &'static str {
        self.store.backend()
    }

    fn peek<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        self.store.peek(checks, now)
    }

    fn reset<'a>(
        &'a self,
        keys: &'a [std::sync::Arc<str>],
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        self.store.reset(keys)
    }

    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.store.charge(checks, now)
    }

    fn refund<'a>(
        &'a self,
        checks: &'a [Check],
        charged_at: Timestamp,
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.store.refund(checks, charged_at, now)
    }

    fn override_backend(
        &self,
    ) -> Option<std::sync::Arc<dyn floodgate::overrides::OverrideBackend>> {
        self.store.override_backend()
    }
}
