//! What every clone of a layer and its services share (one store, one configuration), and
//! how it decides a request's checks, records the decision and answers a denial.

use std::sync::Arc;
use std::time::Duration;

use http::Response;
use http_body::Body;

use crate::body::RateLimitBody;
use crate::decision::Decision;
use crate::fallback::{DecidedBy, OnStoreError, decide_or_fall_back, settle_or_fall_back};
use crate::headers::{BindingHeaders, retry_after_secs};
use crate::key::Identity;
use crate::outcome::{Outcome, RequestOutcome};
use crate::planning::Planner;
use crate::post_charge::{Charged, CostInTrailers, PendingSettlement, ReportedCost, ResponseCost};
use crate::response::{
    Denial, LimitedResponseHook, ResponseSettings, default_limited_response,
    finish_limited_response,
};
use crate::store::resilience::StoreObserver;
use crate::store::{Check, Store};
use crate::telemetry::{self, LimitedRateBaseline};
use crate::top::TopClients;

/// What every clone of a layer and its services share: one store, one configuration.
pub(crate) struct Shared {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) planner: Planner,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) observer: Arc<dyn StoreObserver>,
    pub(crate) top: Option<Arc<TopClients>>,
    pub(crate) baseline: Option<Arc<LimitedRateBaseline>>,
    pub(crate) responses: ResponseSettings,
    pub(crate) limited_response: Option<LimitedResponseHook>,
    pub(crate) concurrency_retry_hint: Option<Duration>,
    pub(crate) response_cost: Option<Arc<dyn ResponseCost>>,
}

impl Shared {
    /// Near-limit metric, top clients and the 429 baseline, for a decision of the store.
    fn observe(&self, identity: &Identity, decision: &Decision, shadowed: bool) {
        let Some(binding) = decision.binding_limit() else {
            return;
        };
        let denied = !decision.is_allowed();
        if !denied && binding.remaining * 5 < binding.capacity {
            telemetry::record_binding_near_limit(binding);
        }
        if let Some(baseline) = &self.baseline {
            baseline.record(denied && !shadowed);
        }
        if let Some(top) = &self.top {
            let used = 1.0 - binding.remaining as f64 / binding.capacity.max(1) as f64;
            let closeness = if denied { 1.0 } else { used };
            if TopClients::interesting(denied, closeness) {
                top.record(
                    identity.hash(),
                    denied,
                    closeness,
                    decision.decided_at().as_micros() / 1_000_000,
                );
            }
        }
    }

    /// Whether `response` may report what its request cost, for [`Shared::settle_cost`] to
    /// read: the inner service said so in its extensions, or the layer reads a cost header.
    pub(crate) fn may_report_cost<B>(&self, response: &Response<B>) -> bool {
        self.response_cost.is_some()
            || response.extensions().get::<ReportedCost>().is_some()
            || response.extensions().get::<CostInTrailers>().is_some()
    }

    /// Reads what the response says the request cost (reported by the inner service in the
    /// response's extensions, or read, and removed, by the layer's [`ResponseCost`]) and, with
    /// `charge_to` (what admitted it), settles it: charges what it cost beyond the up-front
    /// estimate, refunds what it cost less. Runs on every response the inner service gives,
    /// so that the cost header never reaches the client, settled or not.
    ///
    /// A streamed response (a body of no known length) whose head reports no cost (the inner
    /// service said so with [`CostInTrailers`], or the layer's reader found none) is settled
    /// from its trailers: the settlement is returned, for the body to carry.
    pub(crate) async fn settle_cost<B: Body>(
        &self,
        response: &mut Response<B>,
        charge_to: Option<&Charged>,
    ) -> Option<PendingSettlement> {
        let (reported, trailer_reader) = match response.extensions_mut().remove::<ReportedCost>() {
            Some(reported) => (reported, None),
            None => match response.extensions_mut().remove::<CostInTrailers>() {
                Some(CostInTrailers(reader)) => (ReportedCost::Missing, Some(reader)),
                None => match &self.response_cost {
                    Some(cost) => (
                        cost.reported_cost(response.headers_mut()),
                        Some(cost.clone()),
                    ),
                    None => return None,
                },
            },
        };
        let charged = charge_to?;
        match (reported, trailer_reader) {
            // A body of a known length has no trailers to wait for.
            (ReportedCost::Missing, Some(reader))
                if response.body().size_hint().exact().is_none() =>
            {
                Some(PendingSettlement::new(
                    self.store.clone(),
                    charged.clone(),
                    reader,
                ))
            }
            (reported, _) => {
                charged.settle(&*self.store, reported).await;
                None
            }
        }
    }

    pub(crate) async fn limited_response<B>(
        &self,
        decision: &Decision,
        outcome: RequestOutcome,
    ) -> Response<RateLimitBody<B>> {
        let concurrency_bound = decision
            .binding_limit()
            .filter(|binding| binding.definition().algorithm() == crate::Algorithm::Concurrency);
        let wait = match (decision.retry_after(), self.concurrency_retry_hint) {
            (Some(wait), Some(hint)) if concurrency_bound.is_some() => Some(wait.min(hint)),
            (wait, _) => wait,
        };
        let denial = Denial {
            decision,
            retry_after_secs: wait.map(|wait| {
                retry_after_secs(wait, self.responses.retry_after_jitter, fastrand::f64())
            }),
        };
        let mut response = match &self.limited_response {
            Some(hook) => hook.make(&denial, &self.responses).await,
            None => default_limited_response(&denial, &self.responses),
        };
        finish_limited_response(&mut response, &denial, &self.responses);
        // An outer rate limit layer keeps these headers: the denial is the binding limit.
        response.extensions_mut().insert(BindingHeaders {
            remaining_share: 0.0,
            denied: true,
        });
        response.extensions_mut().insert(outcome);
        response.map(RateLimitBody::full)
    }
}

/// Why a request could not be decided: the store failed under `on_store_error: closed`.
pub(crate) struct Unavailable;

impl Shared {
    /// Decides `checks` on the store, recording the decision; when the store fails, under the
    /// failure policy (`Err` when it decides nothing).
    pub(crate) async fn decide(
        &self,
        checks: &[Check],
        shadowed: bool,
        identity: &Identity,
    ) -> Result<Decision, Unavailable> {
        let decided = decide_or_fall_back(&*self.store, self.store.backend(), checks, || {
            &self.on_store_error
        })
        .await;
        self.conclude(decided, checks, shadowed, identity)
    }

    /// [`Shared::decide`] when the store decides without waiting; `None` when it would wait.
    pub(crate) fn decide_ready(
        &self,
        checks: &[Check],
        shadowed: bool,
        identity: &Identity,
    ) -> Option<Result<Decision, Unavailable>> {
        let started = std::time::Instant::now();
        let result = self.store.check_and_consume_ready(checks, None)?;
        let decided = settle_or_fall_back(result, started, self.store.backend(), checks, || {
            &self.on_store_error
        });
        Some(self.conclude(decided, checks, shadowed, identity))
    }

    /// Records what was decided: the store's decision, or the failure policy's (`Err` when
    /// it decided nothing).
    fn conclude(
        &self,
        decided: DecidedBy,
        checks: &[Check],
        shadowed: bool,
        identity: &Identity,
    ) -> Result<Decision, Unavailable> {
        match decided {
            DecidedBy::Store(decision) => {
                self.record_decision(&decision, shadowed, identity);
                Ok(decision)
            }
            DecidedBy::Fallback { error, decision } => {
                let allowed = decision.as_ref().is_some_and(Decision::is_allowed);
                self.observer.fallback_decision(
                    self.store.backend(),
                    self.on_store_error.policy(),
                    &error,
                    allowed,
                );
                if let Some(label) = Outcome::of_fallback(allowed).decision_label() {
                    telemetry::record_decision(&checks[0].rule, checks[0].limit.name(), label);
                }
                decision.ok_or(Unavailable)
            }
        }
    }

    /// The metrics and observers of a decision of the store, and the shadow log.
    fn record_decision(&self, decision: &Decision, shadowed: bool, identity: &Identity) {
        let Some(binding) = decision.binding_limit() else {
            return;
        };
        let outcome = Outcome::of_store_decision(decision.is_allowed(), shadowed);
        if let Some(label) = outcome.decision_label() {
            telemetry::record_binding_decision(binding, label);
        }
        self.observe(identity, decision, shadowed);
        if outcome == Outcome::ShadowLimited && self.planner.rollout.may_log_shadow() {
            tracing::info!(
                rule = %binding.rule,
                limit = %binding.name,
                retry_after = ?decision.retry_after(),
                "shadow: this request would have been limited"
            );
        }
    }
}
