//! Test support: real `redis-server` processes on free ports, owned by the test that starts
//! them and killed when it ends (even on panic).

#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use floodgate::store::{BoxFuture, RedisStore};
use floodgate::{Check, Decision, Lease, Store, StoreError, Timestamp};

/// A `redis-server` child process: no persistence, loopback only.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
}

fn free_port() -> u16 {
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
        let mut child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--protected-mode", "no", "--logfile", ""])
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
                    let ready = line.contains("Ready to accept connections");
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
        })
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
    }

    /// Starts a new server on the same port after [`kill`](Self::kill).
    pub fn restart(&mut self) {
        self.kill();
        let mut last_error = String::new();
        for _ in 0..50 {
            match RedisServer::start_on(self.port) {
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
        let mut command = deadpool_redis::redis::cmd(args[0]);
        for arg in &args[1..] {
            command.arg(*arg);
        }
        command
            .query(&mut self.connection())
            .expect("command succeeds")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A store together with the servers it talks to, so the servers live as long as the store:
/// what the conformance suite gets.
pub struct ServedStore<S = RedisStore> {
    pub servers: Vec<RedisServer>,
    pub store: S,
}

impl ServedStore {
    /// A fresh server and a store on it with generous deadlines (tests measure semantics here,
    /// not latency; the fault tests set their own).
    pub fn start() -> ServedStore {
        let server = RedisServer::start();
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
}
