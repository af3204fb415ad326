//! Stores: where limit state lives, and the one atomic operation every store provides.
//!
//! A [`Store`] checks a request against all its limits and, only if every limit admits it,
//! consumes from all of them, in one atomic step. The memory store ([`MemoryStore`]) is the
//! default; the Redis store shares this trait and the conformance suite in `tests/`.

#[cfg(feature = "redis")]
pub mod batched;
mod memory;
#[cfg(feature = "redis")]
pub mod redis;
pub mod resilience;
mod shards;
#[cfg(feature = "redis")]
pub mod split;

#[cfg(feature = "redis")]
pub use batched::{BatchedStore, BatchedStoreBuilder};
pub use memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "redis")]
pub use redis::{ConnectionMode, RedisStore, RedisStoreBuilder, ShardedRedisStore};
#[cfg(feature = "redis")]
pub use split::SplitStore;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::decision::Decision;
use crate::limit::Limit;
use crate::time::Timestamp;

/// A boxed future, as returned by [`Store`] methods so that stores can be trait objects.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The rule of checks that were not given one.
static DEFAULT_RULE: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| Arc::from("default"));

/// One limit to check for one request: which counter, under which limit, at what cost.
#[derive(Clone, Debug)]
pub struct Check {
    /// The storage key, as laid out by [`crate::key::storage_key`].
    pub key: Arc<str>,
    /// The rule the limit belongs to (metrics and logs label decisions with it).
    pub rule: Arc<str>,
    /// The limit.
    pub limit: Arc<Limit>,
    /// Units this request costs against this limit.
    pub cost: u64,
}

impl Check {
    /// A check of `limit` under `key` for a request costing `request_cost` (the limit's own
    /// cost override wins).
    pub fn new(key: impl Into<Arc<str>>, limit: Arc<Limit>, request_cost: u64) -> Check {
        let cost = limit.cost_for(request_cost);
        Check {
            key: key.into(),
            rule: DEFAULT_RULE.clone(),
            limit,
            cost,
        }
    }
}

impl Check {
    /// The same check, labelled with `rule`.
    pub fn with_rule(self, rule: Arc<str>) -> Check {
        Check { rule, ..self }
    }
}

/// A concurrency lease held by an admitted request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The key of the `concurrency` limit.
    pub key: Arc<str>,
    /// The lease's identifier within that key.
    pub id: u64,
    /// Units the lease holds.
    pub cost: u64,
}

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
    /// decisions is asked to [`Store::peek`], [`Store::reset`] or [`Store::charge`]).
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

/// Where limit state lives.
///
/// `check_and_consume` is atomic over all its checks: either every limit admits the request
/// and each consumes its cost, or none consumes anything.
pub trait Store: Send + Sync + 'static {
    /// Checks `checks` and consumes from all of them if all admit. `now` overrides the store's
    /// clock (tests); `None` uses the store's own time.
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>>;

    /// Releases concurrency leases. A lease that cannot be released (the store is down)
    /// expires with its window, so a failure here loses nothing for good.
    fn release<'a>(&'a self, leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>>;

    /// A short name for logs and metrics (`memory`, `redis`).
    fn backend(&self) -> &'static str;

    /// Reads what `checks` would decide, changing nothing (operators inspecting a client).
    ///
    /// Each limit reports `remaining` and `reset_after` as the limit stands now, as if nothing
    /// were charged; a limit that would deny a request of the check's cost reports
    /// `retry_after`, the wait before it would admit one. No lease is taken, no log entry
    /// written, no expiry touched.
    fn peek<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        let _ = (checks, now);
        Box::pin(std::future::ready(Err(StoreError::Unsupported("peek"))))
    }

    /// Forgets the state of `keys` (operators unblocking a client): each starts again as a
    /// fresh key, and a `concurrency` key's leases are all freed (their holders' later
    /// releases find nothing, which is harmless). Returns how many keys held state.
    fn reset<'a>(&'a self, keys: &'a [Arc<str>]) -> BoxFuture<'a, Result<u64, StoreError>> {
        let _ = keys;
        Box::pin(std::future::ready(Err(StoreError::Unsupported("reset"))))
    }

    /// Adds each check's `cost` to its limit unconditionally: a post-charge for a request
    /// already admitted whose real cost was known only from its response (SPEC §9). It never
    /// denies; a limit charged beyond what it holds is left in debt, which later requests wait
    /// out (their `retry_after` includes it). `concurrency` limits are not charged.
    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let _ = (checks, now);
        Box::pin(std::future::ready(Err(StoreError::Unsupported("charge"))))
    }

    /// Whether this store can decide limits of `algorithm` (all of them, unless a store says
    /// otherwise: a batched store only counts). Layers check their limits at build time.
    fn supports(&self, algorithm: crate::Algorithm) -> bool {
        let _ = algorithm;
        true
    }

    /// The circuit breaker's state, for stores that have one (readiness checks).
    fn breaker_state(&self) -> Option<resilience::BreakerState> {
        None
    }

    /// Asks the store whether it answers this client, without deciding anything (start-up
    /// and readiness checks). Stores that are always there answer at once.
    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(Ok(())))
    }

    /// Sends whatever the store holds back (batched counts) to where it belongs; called on
    /// shutdown, so that a stopping node does not take its last interval's counts with it.
    /// Stores that hold nothing back return at once.
    fn flush(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        (**self).check_and_consume(checks, now)
    }

    fn release<'a>(&'a self, leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        (**self).release(leases)
    }

    fn backend(&self) -> &'static str {
        (**self).backend()
    }

    fn peek<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        (**self).peek(checks, now)
    }

    fn reset<'a>(&'a self, keys: &'a [Arc<str>]) -> BoxFuture<'a, Result<u64, StoreError>> {
        (**self).reset(keys)
    }

    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        (**self).charge(checks, now)
    }

    fn supports(&self, algorithm: crate::Algorithm) -> bool {
        (**self).supports(algorithm)
    }

    fn breaker_state(&self) -> Option<resilience::BreakerState> {
        (**self).breaker_state()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        (**self).probe()
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        (**self).flush()
    }
}
