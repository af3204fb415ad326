//! Hot keys: some limits batched, the rest exact, in one store.
//!
//! A `global` ceiling is one counter that every request of every client writes. In exact mode
//! that single key lives on one Redis node (one Cluster slot) and takes every request's round
//! trip, so it saturates its shard long before the per-client keys do. [`SplitStore`] decides
//! the limits its predicate picks (the hot ones) from a [`BatchedStore`]'s local copies and
//! sends only the others to the exact store.
//!
//! Order and refund, as across Redis slots: the hot limits are decided first (they come first
//! in SPEC order); if they deny, the exact store is not called at all; if the exact store then
//! denies, what the hot limits took is given back locally.

use std::sync::Arc;

use super::batched::{self, BatchedStore, SyncTarget};
use super::resilience::BreakerState;
use super::{BoxFuture, Check, Lease, Store, StoreError};
use crate::decision::Decision;
use crate::time::Timestamp;

/// Picks the checks that run batched.
pub type HotKeyPredicate = dyn Fn(&Check) -> bool + Send + Sync;

/// Batched hot limits in front of an exact store; see the [module docs](self).
pub struct SplitStore<T> {
    hot: BatchedStore<T>,
    exact: Arc<dyn Store>,
    is_hot: Box<HotKeyPredicate>,
}

impl<T> std::fmt::Debug for SplitStore<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SplitStore")
            .field("hot", &self.hot)
            .finish_non_exhaustive()
    }
}

impl<T: SyncTarget> SplitStore<T> {
    /// Checks for which `is_hot` holds (and whose algorithm can run batched) go to `hot`; the
    /// others to `exact`.
    pub fn new(
        hot: BatchedStore<T>,
        exact: Arc<dyn Store>,
        is_hot: impl Fn(&Check) -> bool + Send + Sync + 'static,
    ) -> SplitStore<T> {
        SplitStore {
            hot,
            exact,
            is_hot: Box::new(is_hot),
        }
    }

    /// The batched half.
    pub fn hot(&self) -> &BatchedStore<T> {
        &self.hot
    }

    fn runs_batched(&self, check: &Check) -> bool {
        batched::supports(check.limit.algorithm()) && (self.is_hot)(check)
    }
}

impl<T: SyncTarget> Store for SplitStore<T> {
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        if !checks.iter().any(|check| self.runs_batched(check)) {
            return self.exact.check_and_consume(checks, now);
        }
        Box::pin(async move {
            let (hot, exact): (Vec<Check>, Vec<Check>) = checks
                .iter()
                .cloned()
                .partition(|check| self.runs_batched(check));
            let hot_decision = self.hot.check_and_consume(&hot, now).await?;
            if exact.is_empty() || !hot_decision.is_allowed() {
                // A saturated ceiling costs the exact store nothing.
                return Ok(hot_decision);
            }
            let exact_decision = match self.exact.check_and_consume(&exact, now).await {
                Ok(decision) => decision,
                Err(error) => {
                    self.hot.refund(&hot, now);
                    return Err(error);
                }
            };
            if !exact_decision.is_allowed() {
                self.hot.refund(&hot, now);
            }
            let decided_at = exact_decision.decided_at();
            Ok(Decision::joined(
                decided_at,
                vec![hot_decision, exact_decision],
            ))
        })
    }

    fn release<'a>(&'a self, leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        // Only the exact store takes leases.
        self.exact.release(leases)
    }

    fn backend(&self) -> &'static str {
        self.exact.backend()
    }

    /// The hot limits as this node sees them, then the exact ones.
    fn peek<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(async move {
            let (hot, exact): (Vec<Check>, Vec<Check>) = checks
                .iter()
                .cloned()
                .partition(|check| self.runs_batched(check));
            let hot = self.hot.peek(&hot, now).await?;
            let exact = self.exact.peek(&exact, now).await?;
            Ok(Decision::joined(exact.decided_at(), vec![hot, exact]))
        })
    }

    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let (hot, exact): (Vec<Check>, Vec<Check>) = checks
                .iter()
                .cloned()
                .partition(|check| self.runs_batched(check));
            self.hot.charge(&hot, now).await?;
            self.exact.charge(&exact, now).await
        })
    }

    /// Both halves: a hot key's local copy and its shared state, and the exact keys.
    fn reset<'a>(&'a self, keys: &'a [Arc<str>]) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let hot = self.hot.reset(keys).await?;
            let exact = self.exact.reset(keys).await?;
            Ok(hot.max(exact))
        })
    }

    fn breaker_state(&self) -> Option<BreakerState> {
        self.exact.breaker_state()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.exact.probe()
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.hot.flush()
    }
}
