//! What a layer (or the gateway's Envoy rate limit service) does when its store fails: the
//! failure policy of SPEC §4 with the state it needs, decided in one place.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::decision::{Decision, DecisionSource};
use crate::limit::Limit;
use crate::store::resilience::FailurePolicy;
use crate::store::{Check, MemoryStore, Store, StoreError};
use crate::telemetry;
use crate::time::Timestamp;

/// What deciding a request's checks came to ([`decide_or_fall_back`]).
#[derive(Debug)]
pub enum DecidedBy {
    /// The store decided.
    Store(Decision),
    /// The store failed with `error`, and the failure policy decided: `None` under `closed`
    /// (answer that the limiter is unavailable).
    Fallback {
        /// Why the store could not decide.
        error: StoreError,
        /// The policy's decision.
        decision: Option<Decision>,
    },
}

/// Decides `checks` on `store`, timed in `floodgate_store_check_duration_seconds` under
/// `backend`, or by the failure policy when the store fails (`policy` is asked for only
/// then). The one "decide, time, fall back" path: the layer and the gateway's rate limit
/// service both go through it.
pub async fn decide_or_fall_back<P: Deref<Target = OnStoreError>>(
    store: &dyn Store,
    backend: &'static str,
    checks: &[Check],
    policy: impl FnOnce() -> P,
) -> DecidedBy {
    let started = Instant::now();
    let result = store.check_and_consume(checks, None).await;
    settle_or_fall_back(result, started, backend, checks, policy)
}

/// [`decide_or_fall_back`] for a store's answer already in hand (`started`: when the store
/// was asked), as from [`Store::check_and_consume_ready`].
pub fn settle_or_fall_back<P: Deref<Target = OnStoreError>>(
    result: Result<Decision, StoreError>,
    started: Instant,
    backend: &'static str,
    checks: &[Check],
    policy: impl FnOnce() -> P,
) -> DecidedBy {
    telemetry::record_check_duration(backend, started.elapsed());
    match result {
        Ok(decision) => DecidedBy::Store(decision),
        Err(error) => DecidedBy::Fallback {
            decision: policy().decide(checks),
            error,
        },
    }
}

/// The failure policy in force, with what it decides with: `local` holds the node's own
/// limiter. One value, so that the policy and its limiter cannot disagree.
#[derive(Debug)]
pub enum OnStoreError {
    /// Admit everything the store cannot decide ([`DecisionSource::FailOpen`]).
    Open,
    /// Decide nothing: the caller answers that the limiter is unavailable.
    Closed,
    /// This node's limiter decides, each limit scaled by its share.
    Local(LocalFallback),
}

impl OnStoreError {
    /// `policy`, with a node limiter enforcing `fallback_share` of every limit under `local`.
    pub fn new(policy: FailurePolicy, fallback_share: f64) -> Self {
        match policy {
            FailurePolicy::Open => OnStoreError::Open,
            FailurePolicy::Closed => OnStoreError::Closed,
            FailurePolicy::Local => OnStoreError::Local(LocalFallback::new(fallback_share)),
        }
    }

    /// The policy's name.
    pub fn policy(&self) -> FailurePolicy {
        match self {
            OnStoreError::Open => FailurePolicy::Open,
            OnStoreError::Closed => FailurePolicy::Closed,
            OnStoreError::Local(_) => FailurePolicy::Local,
        }
    }

    /// The share of each limit the node enforces under `local`.
    pub fn fallback_share(&self) -> Option<f64> {
        match self {
            OnStoreError::Local(fallback) => Some(fallback.share()),
            _ => None,
        }
    }

    /// What the policy decides for `checks` when the store failed: under `local`, the node's
    /// limiter decides (a decision of source [`DecisionSource::LocalFallback`]); under
    /// `closed`, nothing (`None`: answer that the limiter is unavailable); under `open`,
    /// everything is admitted ([`DecisionSource::FailOpen`]).
    pub fn decide(&self, checks: &[Check]) -> Option<Decision> {
        match self {
            OnStoreError::Local(fallback) => Some(
                fallback
                    .decide(checks)
                    .with_source(DecisionSource::LocalFallback),
            ),
            OnStoreError::Closed => None,
            OnStoreError::Open => Some(Decision::unlimited(
                Timestamp::now(),
                DecisionSource::FailOpen,
            )),
        }
    }
}

/// A limit, and the same limit scaled by the fallback share.
type OriginalAndScaled = (Arc<Limit>, Arc<Limit>);

/// Most scaled limits the local fallback keeps (a plan's limits, over a few reloads).
const FALLBACK_CACHE: usize = 1024;

/// The per-node limiter of [`FailurePolicy::Local`]: the same checks, on a memory store, with
/// every limit scaled by the fallback share.
pub struct LocalFallback {
    store: MemoryStore,
    share: f64,
    /// Scaled limits by the address of the original, which each entry holds, so that no other
    /// limit can take that address while the entry lives. At most [`FALLBACK_CACHE`]: past
    /// that it starts afresh (counters live in `store`, by key, and are kept).
    scaled: Mutex<HashMap<usize, OriginalAndScaled>>,
}

impl std::fmt::Debug for LocalFallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalFallback")
            .field("share", &self.share)
            .finish_non_exhaustive()
    }
}

impl LocalFallback {
    /// A fallback enforcing `share` (0 < share ≤ 1) of every limit on this node.
    pub fn new(share: f64) -> Self {
        LocalFallback {
            store: MemoryStore::builder()
                .evict_every(Duration::from_secs(10))
                .build(),
            share,
            scaled: Mutex::new(HashMap::new()),
        }
    }

    /// The share this fallback enforces.
    pub fn share(&self) -> f64 {
        self.share
    }

    fn decide(&self, checks: &[Check]) -> Decision {
        let scaled_checks: Vec<Check> = {
            let mut scaled = self.scaled.lock().unwrap_or_else(PoisonError::into_inner);
            if scaled.len() + checks.len() > FALLBACK_CACHE {
                scaled.clear();
            }
            checks
                .iter()
                .map(|check| {
                    let (_, limit) = scaled
                        .entry(Arc::as_ptr(&check.limit) as usize)
                        .or_insert_with(|| {
                            let scaled = Arc::new(check.limit.scaled(self.share));
                            (check.limit.clone(), scaled)
                        })
                        .clone();
                    Check {
                        limit,
                        ..check.clone()
                    }
                })
                .collect()
        };
        self.store.check_and_consume_now(&scaled_checks, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Limits made and dropped one after another (a plan building them per request, or
    /// reloads) often land at the same address; each must get its own scaled limit, and the
    /// cache must stay bounded.
    #[test]
    fn the_fallback_scales_each_limit_and_stays_bounded() {
        let fallback = LocalFallback::new(0.5);
        for round in 0..3 * FALLBACK_CACHE as u64 {
            let size = 10 + 2 * (round % 50);
            let limit = Arc::new(Limit::fixed_window("m", size, Duration::from_secs(60)).unwrap());
            let decision = fallback.decide(&[Check::new(format!("k{round}"), limit, 1)]);
            assert_eq!(decision.limits()[0].limit, size / 2, "round {round}");
        }
        let cached = fallback.scaled.lock().unwrap().len();
        assert!(cached <= FALLBACK_CACHE, "{cached} scaled limits cached");
    }

    #[test]
    fn each_policy_decides_as_it_says() {
        let limit = Arc::new(Limit::fixed_window("m", 4, Duration::from_secs(60)).unwrap());
        let checks = [Check::new("k", limit, 1)];
        let open = OnStoreError::new(FailurePolicy::Open, 1.0)
            .decide(&checks)
            .unwrap();
        assert_eq!(open.source(), DecisionSource::FailOpen);
        assert!(open.is_allowed());
        assert!(
            OnStoreError::new(FailurePolicy::Closed, 1.0)
                .decide(&checks)
                .is_none()
        );
        let local = OnStoreError::new(FailurePolicy::Local, 0.5);
        assert_eq!(local.policy(), FailurePolicy::Local);
        let decisions: Vec<bool> = (0..3)
            .map(|_| local.decide(&checks).unwrap().is_allowed())
            .collect();
        assert_eq!(decisions, [true, true, false], "half of 4 on this node");
    }
}
