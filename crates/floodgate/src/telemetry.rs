//! Metrics of SPEC §8, through the `metrics` facade: without an installed recorder they cost
//! next to nothing; the gateway installs a Prometheus one. No label ever carries a client
//! identity, so the number of series is bounded by the configuration, not by the traffic.

use std::time::Duration;

use crate::store::StoreError;
use crate::store::resilience::BreakerState;

/// `floodgate_decisions_total{rule,limit,decision}`.
pub const DECISIONS_TOTAL: &str = "floodgate_decisions_total";
/// `floodgate_check_duration_seconds{store}`.
pub const CHECK_DURATION_SECONDS: &str = "floodgate_check_duration_seconds";
/// `floodgate_store_errors_total{kind}`.
pub const STORE_ERRORS_TOTAL: &str = "floodgate_store_errors_total";
/// `floodgate_breaker_state{store}`: 0 closed, 1 open, 2 half-open.
pub const BREAKER_STATE: &str = "floodgate_breaker_state";

/// What happened to a request, as the `decision` label says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecisionLabel {
    /// Admitted by the store.
    Allowed,
    /// Denied (429).
    Limited,
    /// Would have been denied; shadow mode let it through.
    ShadowLimited,
    /// Allowlisted or limiting switched off: no check at all.
    Bypassed,
    /// Denylisted (403).
    Denylisted,
    /// The store failed and the failure policy admitted.
    FallbackAllowed,
    /// The store failed and the failure policy refused.
    FallbackLimited,
}

impl DecisionLabel {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionLabel::Allowed => "allowed",
            DecisionLabel::Limited => "limited",
            DecisionLabel::ShadowLimited => "shadow_limited",
            DecisionLabel::Bypassed => "bypassed",
            DecisionLabel::Denylisted => "denylisted",
            DecisionLabel::FallbackAllowed => "fallback_allowed",
            DecisionLabel::FallbackLimited => "fallback_limited",
        }
    }
}

/// Counts one decision.
pub fn record_decision(rule: &str, limit: &str, decision: DecisionLabel) {
    metrics::counter!(
        DECISIONS_TOTAL,
        "rule" => rule.to_owned(),
        "limit" => limit.to_owned(),
        "decision" => decision.as_str()
    )
    .increment(1);
}

/// Records how long a store check took.
pub fn record_check_duration(store: &'static str, elapsed: Duration) {
    metrics::histogram!(CHECK_DURATION_SECONDS, "store" => store).record(elapsed.as_secs_f64());
}

/// Counts a store error by kind.
pub fn record_store_error(error: &StoreError) {
    let kind = match error {
        StoreError::Timeout(_) => "timeout",
        StoreError::Unavailable(_) => "unavailable",
        StoreError::BreakerOpen => "breaker_open",
        StoreError::Protocol(_) => "protocol",
    };
    metrics::counter!(STORE_ERRORS_TOTAL, "kind" => kind).increment(1);
}

/// Sets the breaker gauge.
pub fn record_breaker_state(store: &'static str, state: BreakerState) {
    metrics::gauge!(BREAKER_STATE, "store" => store).set(state as u8 as f64);
}
