//! Stores: where limit state lives, and the one atomic operation every store provides.
//!
//! A [`Store`] checks a request against all its limits and, only if every limit admits it,
//! consumes from all of them, in one atomic step. The memory store ([`MemoryStore`]) is the
//! default; the Redis store shares this trait and the conformance suite in `tests/`.

#[cfg(feature = "redis")]
pub mod batched;
pub(crate) mod error;
pub mod hot;
#[cfg(feature = "redis")]
pub(crate) mod link;
mod memory;
pub(crate) mod override_backend;
pub mod quota;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
pub mod region;
pub mod resilience;
mod shards;
#[cfg(feature = "redis")]
pub mod split;

#[cfg(feature = "redis")]
pub use batched::{BatchedStore, BatchedStoreBuilder};
pub use hot::HotIdentities;
pub use memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "redis")]
pub use redis::{ConnectionMode, RedisStore, RedisStoreBuilder, ShardedRedisStore};
#[cfg(feature = "redis")]
pub use split::SplitStore;

// Defined where the store's dependencies can reach them without a cycle (a decision is made
// of checks; the error module imports nothing), and re-exported at the paths apps know.
pub use crate::decision::{Check, Lease, Scope};
pub use error::{StoreError, redact_url};

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::decision::Decision;
use crate::time::Timestamp;

/// A boxed future, as returned by [`Store`] methods so that stores can be trait objects.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where limit state lives.
///
/// `check_and_consume` is atomic over all its checks: either every limit admits the request
/// and each consumes its cost, or none consumes anything.
///
/// Who relies on what: the layer calls `check_and_consume` (or `check_and_consume_ready`),
/// `release`, `charge`, `refund` and, when it is built, `supports`; the gateway's admin API
/// `peek`, `reset` and `override_backend`; its readiness `probe` and `breaker_state`; its
/// start-up `persistence`; its shutdown and store replacement `flush`; logs and metrics
/// `backend`. Eleven methods have defaults (a store without the capability: `Unsupported`,
/// `None`, always there). **A store that wraps another** ([`split::SplitStore`] around its
/// exact store, [`region::RegionalStore`] around its own, `Arc<S>`) must forward every one of
/// them: a default would silently answer in the wrapped store's place (its breaker, its
/// overrides, its pending counts at shutdown). The library's `tests/it/store_wrappers.rs`
/// asks each of these wrappers every method and checks that the wrapped store answered; a
/// method added here belongs there too.
pub trait Store: Send + Sync + 'static {
    /// Checks `checks` and consumes from all of them if all admit. `now` overrides the store's
    /// clock (tests); `None` uses the store's own time.
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>>;

    /// [`Store::check_and_consume`] at once, for a store that decides without waiting (the
    /// memory store); `None` from a store that must wait (a networked one), whose callers then
    /// use `check_and_consume`. The layer answers a request decided here without a future of
    /// its own for the decision. A store that returns `Some` has decided: calling
    /// `check_and_consume` as well would consume twice.
    fn check_and_consume_ready(
        &self,
        checks: &[Check],
        now: Option<Timestamp>,
    ) -> Option<Result<Decision, StoreError>> {
        let _ = (checks, now);
        None
    }

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

    /// Gives each check's `cost` back to its limit: the settlement of a request admitted at
    /// `charged_at` (its decision's time) at an estimate that its response showed too high
    /// (SPEC §9). A refund never gives more than the check's own cost and never fills a limit
    /// above its capacity; a window's units are given back only to the window they were
    /// counted in, as long as it is the one the key holds (once the next window has begun,
    /// nothing is given back: the units are the past window's). Only `token_bucket`, `gcra`,
    /// `fixed_window` and `sliding_window_counter` limits are refunded
    /// ([`crate::Algorithm::is_batchable`]); others are left as they are.
    fn refund<'a>(
        &'a self,
        checks: &'a [Check],
        charged_at: Timestamp,
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let _ = (checks, charged_at, now);
        Box::pin(std::future::ready(Err(StoreError::Unsupported("refund"))))
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

    /// Where this store keeps per-client overrides (the `overrides` module), shared by every
    /// node on the store: the memory store in its process, the Redis stores beside the
    /// counters. `None`: this store keeps none.
    fn override_backend(&self) -> Option<Arc<dyn override_backend::OverrideBackend>> {
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

    /// Whether the store keeps its counters across its own restart: `Some(false)` when it
    /// would lose them (the memory store; a Redis with neither append-only file nor RDB
    /// snapshots), `Some(true)` when it writes them to disk, `None` when it cannot tell (the
    /// default, or a Redis that refuses `CONFIG GET`, as some managed services do). A limit
    /// of a day or a month kept where a restart forgets it starts again from nothing.
    fn persistence(&self) -> BoxFuture<'_, Option<bool>> {
        Box::pin(std::future::ready(None))
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

    fn check_and_consume_ready(
        &self,
        checks: &[Check],
        now: Option<Timestamp>,
    ) -> Option<Result<Decision, StoreError>> {
        (**self).check_and_consume_ready(checks, now)
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

    fn refund<'a>(
        &'a self,
        checks: &'a [Check],
        charged_at: Timestamp,
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        (**self).refund(checks, charged_at, now)
    }

    fn supports(&self, algorithm: crate::Algorithm) -> bool {
        (**self).supports(algorithm)
    }

    fn breaker_state(&self) -> Option<resilience::BreakerState> {
        (**self).breaker_state()
    }

    fn override_backend(&self) -> Option<Arc<dyn override_backend::OverrideBackend>> {
        (**self).override_backend()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        (**self).probe()
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        (**self).flush()
    }

    fn persistence(&self) -> BoxFuture<'_, Option<bool>> {
        (**self).persistence()
    }
}
