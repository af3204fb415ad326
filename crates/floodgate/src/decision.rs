//! The decision for one request across all the limits that apply to it, and what it is made
//! from: the [`Check`]s a plan asks a store for, and the [`Lease`]s an admission holds.

use std::sync::Arc;
use std::time::Duration;

use crate::algorithm::LimitOutcome;
use crate::limit::Limit;
use crate::time::Timestamp;

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
    /// Whose counter the key names: one client's (the default) or one every client shares.
    pub scope: Scope,
}

/// Whose counter a [`Check`] writes, said by the plan that builds it so that nothing has to
/// read it back from the key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Scope {
    /// The counter of the identity the request counts against.
    #[default]
    Client,
    /// One counter every client writes, such as a gateway's `global` ceiling: stores may
    /// decide it apart from the clients' own (see [`crate::store::SplitStore`]).
    Shared,
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
            scope: Scope::Client,
        }
    }

    /// The same check, labelled with `rule`.
    pub fn with_rule(self, rule: Arc<str>) -> Check {
        Check { rule, ..self }
    }

    /// The same check, of a counter in `scope`.
    pub fn with_scope(self, scope: Scope) -> Check {
        Check { scope, ..self }
    }
}

/// A request's checks with every repeated key folded into its first check, their costs added:
/// a request that names one counter twice (an Envoy request carrying a descriptor twice)
/// costs the counter both, and is admitted only if the counter has room for both, as
/// envoyproxy/ratelimit counts each descriptor (SPEC §3). Every store decides the folded
/// checks and unfolds the decision, so that one meaning holds in every mode.
#[derive(Debug)]
pub(crate) struct Folded {
    /// One check per distinct key, in order of first appearance.
    pub(crate) checks: Vec<Check>,
    /// For each original check, the index of the folded check that stands for it.
    of: Vec<usize>,
}

impl Folded {
    /// The folded form of `checks`, or `None` when no key repeats (the common case: no
    /// allocation).
    pub(crate) fn of(checks: &[Check]) -> Option<Folded> {
        let repeats = checks.iter().enumerate().any(|(index, check)| {
            checks[..index]
                .iter()
                .any(|earlier| same_key(&earlier.key, &check.key))
        });
        if !repeats {
            return None;
        }
        let mut folded: Vec<Check> = Vec::with_capacity(checks.len());
        let mut of = Vec::with_capacity(checks.len());
        for check in checks {
            match folded
                .iter()
                .position(|earlier| same_key(&earlier.key, &check.key))
            {
                Some(index) => {
                    folded[index].cost = folded[index].cost.saturating_add(check.cost);
                    of.push(index);
                }
                None => {
                    of.push(folded.len());
                    folded.push(check.clone());
                }
            }
        }
        Some(Folded { checks: folded, of })
    }

    /// The decision on the folded checks, told in the order of the original ones: each check
    /// reports its counter as the decision left it (a counter named twice reports the same
    /// status twice, under each check's rule).
    pub(crate) fn unfold(&self, checks: &[Check], decision: Decision) -> Decision {
        let limits = checks
            .iter()
            .zip(&self.of)
            .map(|(check, &index)| LimitStatus {
                rule: check.rule.clone(),
                ..decision.limits[index].clone()
            })
            .collect();
        let decided =
            Decision::from_statuses(decision.decided_at, limits, decision.delay, decision.leases);
        decided.with_source(decision.source)
    }
}

fn same_key(a: &Arc<str>, b: &Arc<str>) -> bool {
    Arc::ptr_eq(a, b) || **a == **b
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

/// Where a decision came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecisionSource {
    /// The configured store decided.
    Store,
    /// The store failed and the failure policy let the request through undecided.
    FailOpen,
    /// The store failed and the per-node fallback limiter decided (`on_store_error: local`).
    LocalFallback,
}

/// One applied limit as it stands after the decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitStatus {
    /// The rule the limit belongs to.
    pub rule: Arc<str>,
    /// The limit's name.
    pub name: Arc<str>,
    /// Requests (or units) per window.
    pub limit: u64,
    /// The window.
    pub window: Duration,
    /// The most units available at once (the burst for bucket algorithms).
    pub capacity: u64,
    /// Whether this limit admitted the request.
    pub allowed: bool,
    /// Whole units still available.
    pub remaining: u64,
    /// Time until the limit is fully available again, or its window ends.
    pub reset_after: Duration,
    /// When this limit denied: the exact wait until it would admit the request.
    pub retry_after: Option<Duration>,
    definition: Arc<Limit>,
}

impl LimitStatus {
    /// The limit this status is about.
    pub fn definition(&self) -> &Arc<Limit> {
        &self.definition
    }

    /// Remaining as a fraction of capacity, compared without rounding: `a < b` as
    /// `a.remaining / a.capacity < b.remaining / b.capacity`.
    pub(crate) fn has_less_room_than(&self, other: &LimitStatus) -> bool {
        u128::from(self.remaining) * u128::from(other.capacity)
            < u128::from(other.remaining) * u128::from(self.capacity)
    }
}

/// The outcome of checking a request against every limit that applies to it.
///
/// Placed in the request's extensions by the layer, so handlers can read it.
#[derive(Clone, Debug)]
pub struct Decision {
    allowed: bool,
    decided_at: Timestamp,
    limits: Vec<LimitStatus>,
    binding: Option<usize>,
    retry_after: Option<Duration>,
    delay: Duration,
    leases: Vec<Lease>,
    source: DecisionSource,
}

impl Decision {
    /// Assembles the decision from each limit's outcome, in the order of `checks`. Every store
    /// uses this, so that binding-limit selection is the same everywhere.
    pub fn from_outcomes(
        decided_at: Timestamp,
        checks: &[Check],
        outcomes: &[LimitOutcome],
        leases: Vec<Lease>,
    ) -> Decision {
        debug_assert_eq!(checks.len(), outcomes.len());
        let limits: Vec<LimitStatus> = checks
            .iter()
            .zip(outcomes)
            .map(|(check, outcome)| LimitStatus {
                rule: check.rule.clone(),
                name: check.limit.shared_name().clone(),
                limit: check.limit.limit(),
                window: check.limit.window(),
                capacity: check.limit.capacity(),
                allowed: outcome.allowed,
                remaining: outcome.remaining,
                reset_after: Duration::from_micros(outcome.reset_after_micros),
                retry_after: outcome.retry_after_micros.map(Duration::from_micros),
                definition: check.limit.clone(),
            })
            .collect();
        let delay = outcomes
            .iter()
            .map(|outcome| outcome.delay_micros)
            .max()
            .map_or(Duration::ZERO, Duration::from_micros);
        Decision::from_statuses(decided_at, limits, delay, leases)
    }

    /// Joins decisions on disjoint parts of one request's checks, in the order given (the
    /// request's check order): admitted if every part admitted.
    #[cfg(feature = "redis")]
    pub(crate) fn joined(decided_at: Timestamp, parts: Vec<Decision>) -> Decision {
        let mut limits = Vec::new();
        let mut leases = Vec::new();
        let mut delay = Duration::ZERO;
        for part in parts {
            limits.extend(part.limits);
            leases.extend(part.leases);
            delay = delay.max(part.delay);
        }
        Decision::from_statuses(decided_at, limits, delay, leases)
    }

    fn from_statuses(
        decided_at: Timestamp,
        limits: Vec<LimitStatus>,
        delay: Duration,
        leases: Vec<Lease>,
    ) -> Decision {
        let allowed = limits.iter().all(|limit| limit.allowed);
        let (binding, retry_after) = if allowed {
            let tightest = (0..limits.len()).reduce(|best, index| {
                if limits[index].has_less_room_than(&limits[best]) {
                    index
                } else {
                    best
                }
            });
            (tightest, None)
        } else {
            // Each algorithm only becomes more permissive while no traffic arrives, so the
            // request is admitted once the slowest denying limit admits it; a limit it can
            // never pass dominates.
            let wait = |index: usize| match limits[index].retry_after {
                None => Duration::MAX,
                Some(wait) => wait,
            };
            let slowest = (0..limits.len())
                .filter(|&index| !limits[index].allowed)
                .max_by_key(|&index| wait(index));
            (slowest, slowest.and_then(|index| limits[index].retry_after))
        };
        Decision {
            allowed,
            decided_at,
            limits,
            binding,
            retry_after,
            delay: if allowed { delay } else { Duration::ZERO },
            leases,
            source: DecisionSource::Store,
        }
    }

    /// A decision that admits the request without consulting any store (store failure under
    /// `on_store_error: open`, or no limit applies).
    pub fn unlimited(decided_at: Timestamp, source: DecisionSource) -> Decision {
        Decision {
            allowed: true,
            decided_at,
            limits: Vec::new(),
            binding: None,
            retry_after: None,
            delay: Duration::ZERO,
            leases: Vec::new(),
            source,
        }
    }

    /// Whether the request is admitted.
    pub fn is_allowed(&self) -> bool {
        self.allowed
    }

    /// When the decision was made, by the store's clock.
    pub fn decided_at(&self) -> Timestamp {
        self.decided_at
    }

    /// Every applied limit, in check order.
    pub fn limits(&self) -> &[LimitStatus] {
        &self.limits
    }

    /// The limit that binds: the one that denied (the slowest to recover, if several did), or
    /// else the one with the least remaining fraction.
    pub fn binding_limit(&self) -> Option<&LimitStatus> {
        self.binding.map(|index| &self.limits[index])
    }

    /// When denied, the exact wait until the request sent alone would be admitted; `None` when
    /// allowed or when the request can never be admitted (its cost exceeds a capacity).
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Whether the request was denied because its cost exceeds a limit's capacity.
    pub fn is_never_admissible(&self) -> bool {
        !self.allowed && self.retry_after.is_none()
    }

    /// How long the request must wait before it proceeds (`leaky_bucket` shaping).
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// Concurrency leases taken by this decision; release them when the response ends.
    pub fn leases(&self) -> &[Lease] {
        &self.leases
    }

    /// Takes the leases out, leaving none (the layer hands them to the response body).
    pub fn take_leases(&mut self) -> Vec<Lease> {
        std::mem::take(&mut self.leases)
    }

    /// Where the decision came from.
    pub fn source(&self) -> DecisionSource {
        self.source
    }

    /// The same decision, marked as coming from `source`.
    pub fn with_source(self, source: DecisionSource) -> Decision {
        Decision { source, ..self }
    }
}
