//! `server.*`: what the listener enforces on every client connection, whoever it is (against
//! slowloris, descriptor exhaustion, oversized heads). Defaults follow nginx's and Envoy's edge
//! settings; read at start (like `listen`), so a change needs a restart.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Errors, parse_duration};

/// The most `header_read_timeout` may be: a head that takes longer is an attack.
const MAX_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(60);
/// hyper's smallest read buffer; heads are capped by the buffer.
const MIN_HEAD_BYTES: usize = 8 * 1024;
const MAX_HEAD_BYTES: usize = 1024 * 1024;
/// The most `per_core` workers: more threads than this on one listener is a typo.
const MAX_WORKER_THREADS: usize = 1024;

/// `server:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawServer {
    /// Time for a request head to arrive in full (the HTTP/2 preface and first request on a new
    /// connection, each next head on an HTTP/1.1 keep-alive connection).
    pub header_read_timeout: String,
    /// A connection on which no byte moves either way for this long is closed.
    pub idle_timeout: String,
    /// The longest gap between two pieces of a client's request body: then 408.
    pub body_read_timeout: String,
    /// The largest request head (request line and headers), in bytes: then 431.
    pub max_head_bytes: usize,
    /// Client connections served at once; `null`: derived from the open-file limit.
    pub max_connections: Option<usize>,
    /// The serving model: `multi_thread` (one work-stealing runtime) or `per_core` (one
    /// single-threaded runtime per core, each with its own `SO_REUSEPORT` listener and upstream
    /// pool, like nginx's workers).
    pub workers: String,
    /// How many `per_core` workers; `null`: one per available core. Ignored by `multi_thread`.
    pub worker_threads: Option<usize>,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
            header_read_timeout: "30s".to_owned(),
            idle_timeout: "60s".to_owned(),
            body_read_timeout: "30s".to_owned(),
            max_head_bytes: 32 * 1024,
            max_connections: None,
            // It measured faster on memory and Redis stores (BENCHMARKS.md, "Gateway vs
            // nginx").
            workers: "per_core".to_owned(),
            worker_threads: None,
        }
    }
}

/// Validated `server:` settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ServerLimits {
    /// `server.header_read_timeout` (see `RawServer`).
    pub header_read_timeout: Duration,
    /// `server.idle_timeout` (see `RawServer`).
    pub idle_timeout: Duration,
    /// `server.body_read_timeout` (see `RawServer`).
    pub body_read_timeout: Duration,
    /// `server.max_head_bytes` (see `RawServer`).
    pub max_head_bytes: usize,
    /// `server.max_connections`; resolved by [`ServerLimits::max_connections`].
    pub max_connections: Option<usize>,
    /// `server.workers` (see `RawServer`).
    pub workers: Workers,
    /// `server.worker_threads`; resolved by [`ServerLimits::worker_threads`].
    pub worker_threads: Option<usize>,
}

/// How the proxy listener's connections are served (`server.workers`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Workers {
    /// One multi-threaded (work-stealing) runtime accepts and serves every connection.
    MultiThread,
    /// One current-thread runtime per core, each with its own `SO_REUSEPORT` listener on
    /// `listen` and its own upstream client pool: a request, its upstream connection and its
    /// response stay on one thread. The default: it measured faster.
    #[default]
    PerCore,
}

impl Workers {
    /// The name in the configuration file.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Workers::MultiThread => "multi_thread",
            Workers::PerCore => "per_core",
        }
    }
}

impl ServerLimits {
    /// How many client connections to serve at once: the configured number, or half of what
    /// the open-file limit leaves after a reserve (each client connection may need an
    /// upstream connection too; the reserve keeps room for the admin API, the store and files).
    pub(crate) fn max_connections(&self) -> usize {
        self.max_connections.unwrap_or_else(|| {
            let descriptors = open_file_limit().unwrap_or(1024);
            (descriptors.saturating_sub(DESCRIPTOR_RESERVE) / 2).max(1)
        })
    }

    /// How many `per_core` workers to run: the configured number, or one per available core.
    pub(crate) fn worker_threads(&self) -> usize {
        self.worker_threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        })
    }
}

/// Descriptors kept out of the client budget: listeners, admin connections, store
/// connections, the config watcher, logs.
pub(crate) const DESCRIPTOR_RESERVE: usize = 64;

/// The soft open-file limit of this process, from `/proc/self/limits`.
pub(crate) fn open_file_limit() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))?;
    let soft = line.split_whitespace().nth(3)?;
    // "unlimited" is not a number: no descriptor ceiling to stay under.
    Some(soft.parse().unwrap_or(usize::MAX / 4))
}

pub(super) fn validate(errors: &mut Errors, raw: &RawServer) -> Option<ServerLimits> {
    let duration = |errors: &mut Errors, field: &str, text: &str, max: Option<Duration>| {
        let parsed = parse_duration(text).and_then(|value| match max {
            _ if value.is_zero() => Err("must be greater than 0".into()),
            Some(max) if value > max => Err(problem!("must be at most {}s", max.as_secs())),
            _ => Ok(value),
        });
        errors.ok(format!("server.{field}"), parsed)
    };
    let header_read_timeout = duration(
        errors,
        "header_read_timeout",
        &raw.header_read_timeout,
        Some(MAX_HEADER_READ_TIMEOUT),
    );
    let idle_timeout = duration(errors, "idle_timeout", &raw.idle_timeout, None);
    let body_read_timeout = duration(errors, "body_read_timeout", &raw.body_read_timeout, None);
    if !(MIN_HEAD_BYTES..=MAX_HEAD_BYTES).contains(&raw.max_head_bytes) {
        errors.push(
            "server.max_head_bytes",
            format!("must be between {MIN_HEAD_BYTES} and {MAX_HEAD_BYTES}"),
        );
    }
    if raw.max_connections == Some(0) {
        errors.push("server.max_connections", "must be greater than 0");
    }
    let workers = match raw.workers.as_str() {
        "multi_thread" => Workers::MultiThread,
        "per_core" => Workers::PerCore,
        other => {
            errors.push(
                "server.workers",
                format!("`{other}` is not one of multi_thread, per_core"),
            );
            Workers::MultiThread
        }
    };
    if let Some(threads) = raw.worker_threads
        && !(1..=MAX_WORKER_THREADS).contains(&threads)
    {
        errors.push(
            "server.worker_threads",
            format!("must be between 1 and {MAX_WORKER_THREADS}"),
        );
    }
    Some(ServerLimits {
        header_read_timeout: header_read_timeout?,
        idle_timeout: idle_timeout?,
        body_read_timeout: body_read_timeout?,
        max_head_bytes: raw.max_head_bytes,
        max_connections: raw.max_connections,
        workers,
        worker_threads: raw.worker_threads,
    })
}
