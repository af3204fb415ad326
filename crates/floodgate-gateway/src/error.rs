//! Why the gateway could not start, or could not put a configuration in service.

use std::net::SocketAddr;
use std::path::PathBuf;

use floodgate::{BuildError, StoreError};

use crate::config::ConfigErrors;
use crate::tls::TlsError;

/// Why a configuration was not put in service (at start, or on a reload: then the previous
/// rules stay active).
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The file cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The configuration file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds nothing but blank lines and comments: what a truncating writer leaves
    /// for a moment, never a replacement.
    #[error("{} is empty: an empty file never replaces the configuration", path.display())]
    Empty {
        /// The configuration file.
        path: PathBuf,
    },
    /// The file is invalid; every error names its field.
    #[error("{0}")]
    Invalid(#[from] ConfigErrors),
    /// The store the file asks for cannot be built.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// The rate limit layer refused the settings.
    #[error("{0}")]
    Layer(#[from] BuildError),
    /// The TLS settings cannot be loaded.
    #[error("{context}: {source}")]
    Tls {
        /// Which settings (`listen_tls`, `upstream_tls`).
        context: &'static str,
        /// Why (boxed: rustls' errors are large, and this one is rare).
        source: Box<TlsError>,
    },
    /// The Prometheus recorder cannot be installed.
    #[error("metrics: {0}")]
    Metrics(String),
    /// An address cannot be listened on.
    #[error("cannot listen on {address}: {source}")]
    Bind {
        /// The address.
        address: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// A file or directory cannot be watched for changes.
    #[error("cannot watch {}: {reason}", path.display())]
    Watch {
        /// What was to be watched.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The admin API would be reachable from other hosts without a token.
    #[error(
        "admin.listen {0} is not a loopback address: set FLOODGATE_ADMIN_TOKEN to protect the admin API"
    )]
    AdminUnprotected(SocketAddr),
    /// The rate limit service's rules are invalid.
    #[error("{}: invalid rate limit service rules:\n{errors}", directory.display())]
    RlsRules {
        /// The rules directory.
        directory: PathBuf,
        /// Every error, with its file and field.
        errors: ConfigErrors,
    },
    /// The `per_core` workers cannot be started (a thread or a runtime cannot be made).
    #[error("cannot start the per_core workers: {0}")]
    Workers(std::io::Error),
    /// The access log cannot be opened.
    #[error("access_log.path: cannot open {}: {source}", path.display())]
    AccessLog {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// SIGHUP or SIGUSR1 cannot be handled.
    #[error("signals (SIGHUP, SIGUSR1): {0}")]
    Signal(std::io::Error),
}
