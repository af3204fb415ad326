//! What the layer made of one request: the [`Outcome`], set once on every path and read by
//! whatever logs or counts requests, so that none of them re-derives it from the answer.

use crate::decision::{Decision, DecisionSource, LimitStatus};
use crate::telemetry::DecisionLabel;

/// What became of a request at the rate limit layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The store admitted it.
    Allowed,
    /// The store denied it: 429 (or a gRPC call's `RESOURCE_EXHAUSTED`).
    Limited,
    /// The store denied it, but the client did not see the denial (shadow mode, or a canary
    /// outside its share): let through.
    ShadowLimited,
    /// The store failed and the failure policy admitted it.
    FallbackAllowed,
    /// The store failed and the failure policy (a local limiter) refused it.
    FallbackLimited,
    /// The store failed under `on_store_error: closed`: 503, nothing decided.
    Unavailable,
    /// An allowlist let it through, or limiting is switched off: no check at all.
    Bypassed,
    /// A denylist refused it: 403.
    Denylisted,
    /// No identity could be found and the layer refuses unidentified requests.
    Unidentified,
    /// No limit applies to it.
    Unlimited,
    /// Adaptive concurrency ([`crate::adaptive`]) refused it, 503, after any rate limits let
    /// it through: the rate limits counted their own decision (`allowed`), the shedding counts
    /// it in `floodgate_adaptive_shed_total`. A rate limit layer around the shedding keeps its
    /// binding limit on the outcome.
    Shed,
}

impl Outcome {
    /// A decision of the store (not of the failure policy): `shadowed` when the client was not
    /// to see a denial.
    pub fn of_store_decision(allowed: bool, shadowed: bool) -> Outcome {
        match (allowed, shadowed) {
            (true, _) => Outcome::Allowed,
            (false, false) => Outcome::Limited,
            (false, true) => Outcome::ShadowLimited,
        }
    }

    /// A decision of the failure policy, which admitted the request or not.
    pub fn of_fallback(allowed: bool) -> Outcome {
        if allowed {
            Outcome::FallbackAllowed
        } else {
            Outcome::FallbackLimited
        }
    }

    /// `decision`'s outcome, `shadowed` when the client was not to see a denial.
    pub fn of_decision(decision: &Decision, shadowed: bool) -> Outcome {
        match decision.source() {
            DecisionSource::Store => Outcome::of_store_decision(decision.is_allowed(), shadowed),
            DecisionSource::FailOpen | DecisionSource::LocalFallback => {
                Outcome::of_fallback(decision.is_allowed())
            }
        }
    }

    /// The name the access log writes (`decision`), in snake case.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Limited => "limited",
            Outcome::ShadowLimited => "shadow_limited",
            Outcome::FallbackAllowed => "fallback_allowed",
            Outcome::FallbackLimited => "fallback_limited",
            Outcome::Unavailable => "unavailable",
            Outcome::Bypassed => "bypassed",
            Outcome::Denylisted => "denylisted",
            Outcome::Unidentified => "unidentified",
            Outcome::Unlimited => "unlimited",
            Outcome::Shed => "shed",
        }
    }

    /// Whether the client was refused because of the limiter (a 429, 403 or 503 of its own).
    pub fn is_refused(self) -> bool {
        matches!(
            self,
            Outcome::Limited
                | Outcome::FallbackLimited
                | Outcome::Unavailable
                | Outcome::Denylisted
                | Outcome::Unidentified
                | Outcome::Shed
        )
    }

    /// The `decision` label `floodgate_decisions_total` counts it under; `None` for the
    /// outcomes that series does not count (nothing was decided).
    pub fn decision_label(self) -> Option<DecisionLabel> {
        Some(match self {
            Outcome::Allowed => DecisionLabel::Allowed,
            Outcome::Limited => DecisionLabel::Limited,
            Outcome::ShadowLimited => DecisionLabel::ShadowLimited,
            Outcome::FallbackAllowed => DecisionLabel::FallbackAllowed,
            Outcome::FallbackLimited => DecisionLabel::FallbackLimited,
            Outcome::Bypassed => DecisionLabel::Bypassed,
            Outcome::Denylisted => DecisionLabel::Denylisted,
            Outcome::Unavailable | Outcome::Unidentified | Outcome::Unlimited | Outcome::Shed => {
                return None;
            }
        })
    }
}

/// The layer's [`Outcome`] of a request with the limit that bound it: put in the extensions of
/// every response the layer returns (its own 429, 403, 500 and 503, and the inner service's
/// answer), for the access log and whatever else reports on requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestOutcome {
    /// What became of the request.
    pub outcome: Outcome,
    /// The limit that bound the decision (the one that denied, or the one with the least room
    /// left), when the request was decided against limits.
    pub binding: Option<LimitStatus>,
}

impl RequestOutcome {
    /// An outcome without a decision against limits.
    pub fn undecided(outcome: Outcome) -> RequestOutcome {
        RequestOutcome {
            outcome,
            binding: None,
        }
    }

    /// `decision`'s outcome and binding limit, `shadowed` when the client was not to see a
    /// denial.
    pub fn of_decision(decision: &Decision, shadowed: bool) -> RequestOutcome {
        RequestOutcome {
            outcome: Outcome::of_decision(decision, shadowed),
            binding: decision.binding_limit().cloned(),
        }
    }

    /// Whether this outcome, of a layer around another, says more of the request than the
    /// `inner` layer's: never over an inner refusal (the inner layer answered the request
    /// itself) nor when this layer applied no limit; over an inner layer that applied none;
    /// between two admissions, when this layer's binding limit has less room left; a shadow
    /// denial or a fallback here over an inner admission.
    pub fn supersedes(&self, inner: &RequestOutcome) -> bool {
        use Outcome::{Allowed, Bypassed, Unlimited};
        match (self.outcome, inner.outcome) {
            (_, inner) if inner.is_refused() => false,
            (Unlimited | Bypassed, _) => false,
            (_, Unlimited | Bypassed) => true,
            (Allowed, Allowed) => match (&self.binding, &inner.binding) {
                (Some(ours), Some(theirs)) => ours.has_less_room_than(theirs),
                (ours, _) => ours.is_some(),
            },
            // An inner shadow denial or fallback says more than an admission here.
            (Allowed, _) => false,
            _ => true,
        }
    }

    /// When the binding limit denied: the wait until it would admit the request.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        self.binding
            .as_ref()
            .and_then(|binding| binding.retry_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Outcome; 11] = [
        Outcome::Allowed,
        Outcome::Limited,
        Outcome::ShadowLimited,
        Outcome::FallbackAllowed,
        Outcome::FallbackLimited,
        Outcome::Unavailable,
        Outcome::Bypassed,
        Outcome::Denylisted,
        Outcome::Unidentified,
        Outcome::Unlimited,
        Outcome::Shed,
    ];

    #[test]
    fn each_outcome_has_its_own_name_and_the_metric_spells_it_the_same() {
        let names: std::collections::HashSet<_> = ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(names.len(), ALL.len());
        for outcome in ALL {
            if let Some(label) = outcome.decision_label() {
                assert_eq!(label.as_str(), outcome.as_str(), "{outcome:?}");
            }
        }
        // Every metric label is some outcome's.
        for label in DecisionLabel::ALL {
            assert!(
                ALL.iter().any(|o| o.decision_label() == Some(label)),
                "{label:?}"
            );
        }
    }

    #[test]
    fn refusals_are_the_answers_the_limiter_gave_in_place_of_the_service() {
        let refused: Vec<_> = ALL.into_iter().filter(|o| o.is_refused()).collect();
        assert_eq!(
            refused,
            [
                Outcome::Limited,
                Outcome::FallbackLimited,
                Outcome::Unavailable,
                Outcome::Denylisted,
                Outcome::Unidentified,
                Outcome::Shed
            ]
        );
    }

    #[test]
    fn a_decision_is_named_by_its_source_and_whether_it_was_shown() {
        let at = crate::time::Timestamp::from_micros(0);
        let open = Decision::unlimited(at, DecisionSource::FailOpen);
        assert_eq!(Outcome::of_decision(&open, false), Outcome::FallbackAllowed);
        let store = Decision::unlimited(at, DecisionSource::Store);
        assert_eq!(Outcome::of_decision(&store, true), Outcome::Allowed);
        assert_eq!(
            Outcome::of_store_decision(false, true),
            Outcome::ShadowLimited
        );
        assert_eq!(Outcome::of_store_decision(false, false), Outcome::Limited);
        assert_eq!(Outcome::of_fallback(false), Outcome::FallbackLimited);
        assert_eq!(RequestOutcome::of_decision(&store, false).binding, None);
    }
}
