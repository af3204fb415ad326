//! Hot keys: some limits batched, the rest exact, in one store.
//!
//! A `global` ceiling is one counter that every request of every client writes. In exact mode
//! that single key lives on one Redis node (one Cluster slot) and takes every request's round
//! trip, so it saturates its shard long before the per-client keys do. [`SplitStore`] decides
//! the limits its predicate picks (the hot ones) from a [`BatchedStore`]'s local copies and
//! sends only the others to the exact store.
//!
//! The same goes for a heavy client: with [`SplitStore::with_hot_identities`], an identity
//! whose decision rate on this node crosses a threshold ([`HotIdentities`]) has its limits
//! decided from leases too, until it cools down; every other identity stays exact. A global
//! ceiling is then simply an identity that is always hot.
//!
//! Order and refund, as across Redis slots: the hot limits are decided first (they come first
//! in SPEC order); if they deny, the exact store is not called at all; if the exact store then
//! denies, what the hot limits took is given back locally.

use std::sync::Arc;

use smallvec::SmallVec;

use super::batched::{self, BatchedStore, SyncTarget};
use super::hot::{HotChange, HotIdentities};
use super::resilience::BreakerState;
use super::{BoxFuture, Check, Lease, Store, StoreError};
use crate::decision::Decision;
use crate::key::storage::hash_tag;
use crate::time::Timestamp;

/// Picks the checks that run batched.
pub type HotKeyPredicate = dyn Fn(&Check) -> bool + Send + Sync;

/// Batched hot limits in front of an exact store; see the [module docs](self).
pub struct SplitStore<T> {
    hot: BatchedStore<T>,
    exact: Arc<dyn Store>,
    is_hot: Box<HotKeyPredicate>,
    /// Identities promoted by their rate on this node: their limits run batched too.
    hot_identities: Option<Arc<HotIdentities>>,
}

/// The hot identities (hash tags) among a request's keys: a request has one or two.
type HotTags<'c> = SmallVec<[&'c str; 2]>;

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
            hot_identities: None,
        }
    }

    /// Also runs batched the limits of identities that `hot_identities` finds hot: every
    /// decision through this store counts toward its identity's rate.
    pub fn with_hot_identities(mut self, hot_identities: Arc<HotIdentities>) -> Self {
        self.hot_identities = Some(hot_identities);
        self
    }

    /// The hot identity tracker, if any.
    pub fn hot_identities(&self) -> Option<&Arc<HotIdentities>> {
        self.hot_identities.as_ref()
    }

    /// The batched half.
    pub fn hot(&self) -> &BatchedStore<T> {
        &self.hot
    }

    fn runs_batched(&self, check: &Check, hot_tags: &HotTags<'_>) -> bool {
        batched::supports(check.limit.algorithm())
            && ((self.is_hot)(check) || hot_tags.contains(&hash_tag(&check.key)))
    }

    /// Counts a decision for each identity of `checks` (once per request) and returns those
    /// that are hot; logs a promotion or demotion that this decision brought.
    fn record_identities<'c>(&self, checks: &'c [Check]) -> HotTags<'c> {
        let mut hot_tags = HotTags::new();
        let Some(tracker) = &self.hot_identities else {
            return hot_tags;
        };
        let mut seen = HotTags::new();
        for check in checks.iter().filter(|check| !(self.is_hot)(check)) {
            let tag = hash_tag(&check.key);
            if seen.contains(&tag) {
                continue;
            }
            seen.push(tag);
            let (hot, change) = tracker.record(tag);
            match change {
                Some(HotChange::Promoted { rate }) => tracing::info!(
                    identity = tag,
                    rate = rate.round(),
                    above = tracker.above(),
                    "hot identity: decided from leases on this node"
                ),
                Some(HotChange::Demoted { rate }) => tracing::info!(
                    identity = tag,
                    rate = rate.round(),
                    "hot identity cooled down: decided exactly again"
                ),
                None => {}
            }
            if hot {
                hot_tags.push(tag);
            }
        }
        hot_tags
    }

    /// The hot identities of `checks`, without counting a decision.
    fn hot_tags<'c>(&self, checks: &'c [Check]) -> HotTags<'c> {
        let mut hot_tags = HotTags::new();
        if let Some(tracker) = &self.hot_identities {
            for check in checks {
                let tag = hash_tag(&check.key);
                if !hot_tags.contains(&tag) && tracker.is_hot(tag) {
                    hot_tags.push(tag);
                }
            }
        }
        hot_tags
    }

    /// `checks` split into those that run batched and the exact ones.
    fn partition(&self, checks: &[Check], hot_tags: &HotTags<'_>) -> (Vec<Check>, Vec<Check>) {
        checks
            .iter()
            .cloned()
            .partition(|check| self.runs_batched(check, hot_tags))
    }
}

impl<T: SyncTarget> Store for SplitStore<T> {
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        let hot_tags = self.record_identities(checks);
        if !checks
            .iter()
            .any(|check| self.runs_batched(check, &hot_tags))
        {
            return self.exact.check_and_consume(checks, now);
        }
        let (hot, exact) = self.partition(checks, &hot_tags);
        Box::pin(async move {
            let hot_decision = self.hot.check_and_consume(&hot, now).await?;
            if exact.is_empty() || !hot_decision.is_allowed() {
                // A saturated ceiling costs the exact store nothing.
                return Ok(hot_decision);
            }
            let exact_decision = match self.exact.check_and_consume(&exact, now).await {
                Ok(decision) => decision,
                Err(error) => {
                    self.hot.return_to_leases(&hot, now);
                    return Err(error);
                }
            };
            if !exact_decision.is_allowed() {
                self.hot.return_to_leases(&hot, now);
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
        let (hot, exact) = self.partition(checks, &self.hot_tags(checks));
        Box::pin(async move {
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
        let (hot, exact) = self.partition(checks, &self.hot_tags(checks));
        Box::pin(async move {
            self.hot.charge(&hot, now).await?;
            self.exact.charge(&exact, now).await
        })
    }

    fn refund<'a>(
        &'a self,
        checks: &'a [Check],
        charged_at: Timestamp,
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let (hot, exact) = self.partition(checks, &self.hot_tags(checks));
        Box::pin(async move {
            // Both halves, whichever fails: the first error is the answer.
            let hot = self.hot.refund(&hot, charged_at, now).await;
            let exact = self.exact.refund(&exact, charged_at, now).await;
            hot.and(exact)
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

    fn override_backend(&self) -> Option<Arc<dyn crate::store::override_backend::OverrideBackend>> {
        self.exact.override_backend()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.exact.probe()
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let hot = self.hot.flush().await;
            // The exact store may hold counts back too (a batched one).
            let exact = self.exact.flush().await;
            hot.and(exact)
        })
    }

    fn supports(&self, algorithm: crate::Algorithm) -> bool {
        // A limit the batched half cannot run goes to the exact store: it decides whether the
        // algorithm can run here at all.
        self.exact.supports(algorithm)
    }

    fn check_and_consume_ready(
        &self,
        _checks: &[Check],
        _now: Option<Timestamp>,
    ) -> Option<Result<Decision, StoreError>> {
        // The exact half is a networked store: a decision may always wait on it.
        None
    }

    fn persistence(&self) -> BoxFuture<'_, Option<bool>> {
        self.exact.persistence()
    }
}
