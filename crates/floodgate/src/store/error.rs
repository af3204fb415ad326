//! What a failing store says: [`StoreError`] and the breaker's [`BreakerState`].
//!
//! A leaf: it uses nothing else of the crate, so that the store, its failure machinery
//! (`resilience`) and the metrics (`telemetry`) can all name these types without depending on
//! one another.

use std::time::Duration;

/// Why a store could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store did not answer within its deadline.
    #[error("store call timed out after {0:?}")]
    Timeout(Duration),
    /// The store could not be reached or failed to answer.
    #[error("store unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store refused this client: wrong or missing credentials, or no permission (Redis
    /// `WRONGPASS`, `NOAUTH`, `NOPERM`). A configuration error, not an outage: readiness
    /// checks report it. Transient only in that a credential change may cure it.
    #[error("store refused the client: {0}")]
    Rejected(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The circuit breaker is open: the store is not being called.
    #[error("circuit breaker open; store not called")]
    BreakerOpen,
    /// The store answered something this version does not understand.
    #[error("unexpected store reply: {0}")]
    Protocol(String),
    /// The store's settings cannot work (a URL that does not parse, a zero deadline): found
    /// when the store is built, never transient. URLs in the message carry no password.
    #[error("invalid store settings: {0}")]
    Config(String),
    /// The store does not provide this operation (a custom store that implements only
    /// decisions is asked to [`Store::peek`](super::Store::peek), [`Store::reset`](super::Store::reset) or
    /// [`Store::charge`](super::Store::charge)).
    #[error("this store does not support {0}")]
    Unsupported(&'static str),
}

impl StoreError {
    /// Whether retrying later may succeed (connection trouble, timeouts), as opposed to a
    /// problem that repeats on every call.
    pub fn is_transient(&self) -> bool {
        !matches!(
            self,
            StoreError::Protocol(_) | StoreError::Config(_) | StoreError::Unsupported(_)
        )
    }
    /// The `kind` label of `floodgate_store_errors_total` for this error: `timeout`,
    /// `unavailable`, `rejected`, `breaker_open`, `protocol`, `config` or `unsupported`.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Rejected(_) => "rejected",
            StoreError::BreakerOpen => "breaker_open",
            StoreError::Protocol(_) => "protocol",
            StoreError::Config(_) => "config",
            StoreError::Unsupported(_) => "unsupported",
        }
    }
}

/// `url` with the password of its user-info replaced by `***` (`redis://:***@host:6379`,
/// `redis://user:***@host`); a URL without one is returned as it is. For logs and errors.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let (user_info, host) = authority.split_at(at);
    // A lone user-info may be a password too (some clients read `redis://secret@host` so).
    let user_info = match user_info.split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".to_owned(),
    };
    format!("{scheme}://{user_info}{host}{tail}")
}

/// The breaker's state, as reported to observers and metrics (0 closed, 1 open, 2 half-open).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go to the store.
    Closed = 0,
    /// Calls fail at once.
    Open = 1,
    /// One probe call is going to the store; the others fail at once.
    HalfOpen = 2,
}
