//! The [`RateLimit`] service: decides in `call`, then answers 429 or calls the inner service.

pub use crate::body::RateLimitBody;
pub use crate::future::ResponseFuture;

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

pub use crate::planning::{RequestCost, UnknownIdentity};

use crate::body::LeaseGuard;
use crate::decision::{Decision, DecisionSource};
use crate::fallback::{DecidedBy, OnStoreError, decide_or_fall_back, settle_or_fall_back};
use crate::headers::{BindingHeaders, RateLimitHeaders, retry_after_secs};
use crate::key::Identity;
use crate::outcome::{Outcome, RequestOutcome};
use crate::planning::{Planner, Route};
use crate::post_charge::{Charged, CostInTrailers, PendingSettlement, ReportedCost, ResponseCost};
use crate::response::{
    Denial, LimitedResponseHook, ResponseSettings, default_limited_response,
    finish_limited_response, unavailable_response,
};
use crate::response::{forbidden_response, unidentified_response};
use crate::rollout::Mode;
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
    async fn settle_cost<B: Body>(
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

    async fn limited_response<B>(
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

/// Rate limits requests to the inner service. Made by [`crate::RateLimitLayer`]; clones share
/// the same state, so the limit holds however the service is cloned, buffered or spread.
pub struct RateLimit<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> RateLimit<S> {
    pub(crate) fn new(inner: S, shared: Arc<Shared>) -> Self {
        RateLimit { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone> Clone for RateLimit<S> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for RateLimit<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<RateLimitBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    /// Only the inner service's readiness: limiting happens in `call`, so an over-limit
    /// client gets a 429 instead of being queued.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let shared = self.shared.clone();
        if shared.planner.rollout.mode() == Mode::Off {
            // Kill switch: not even a store call.
            telemetry::record_decision("rollout", "off", telemetry::DecisionLabel::Bypassed);
            return pass_through(shared, self.inner.call(request), Outcome::Bypassed);
        }
        let planned = shared.planner.plan(&request);
        shared.planner.record_plan(&planned);
        let (checks, shadowed) = match planned.route {
            Route::Checks { checks, shadowed } if !checks.is_empty() => (checks, shadowed),
            Route::Checks { .. } => {
                return pass_through(shared, self.inner.call(request), Outcome::Unlimited);
            }
            Route::Allowlisted => {
                return pass_through(shared, self.inner.call(request), Outcome::Bypassed);
            }
            Route::Denylisted | Route::Unidentified => {
                let (answer, outcome) = match planned.route {
                    Route::Denylisted => (forbidden_response(), Outcome::Denylisted),
                    _ => (unidentified_response(), Outcome::Unidentified),
                };
                let answer = with_outcome(answer, outcome).map(RateLimitBody::full);
                return ResponseFuture::boxed(Box::pin(async move { Ok(answer) }));
            }
        };
        // A store that decides without waiting (the memory store): an admitted request goes
        // to the inner service now, with no future of ours around the decision.
        let decided = match shared.decide_ready(&checks, shadowed, &planned.identity) {
            Some(Ok(decision))
                if !shadowed && decision.is_allowed() && decision.delay().is_zero() =>
            {
                return admit(shared, &mut self.inner, request, checks, decision);
            }
            decided => decided,
        };
        // The ready service goes into the future; a fresh clone waits for the next poll_ready.
        let fresh = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, fresh);
        ResponseFuture::boxed(Box::pin(decide_then_call(
            shared,
            inner,
            request,
            Decide {
                checks,
                shadowed,
                identity: planned.identity,
                decided,
            },
        )))
    }
}

/// Why a request could not be decided: the store failed under `on_store_error: closed`.
struct Unavailable;

/// A request's checks, and what the store decided of them if it could decide at once.
struct Decide {
    checks: Vec<Check>,
    shadowed: bool,
    identity: Identity,
    decided: Option<Result<Decision, Unavailable>>,
}

/// A request no limit applies to (`outcome` says why): the inner service's answer, with its
/// reported cost read (and removed) but charged to nothing.
fn pass_through<F, ResBody, E>(
    shared: Arc<Shared>,
    response: F,
    outcome: Outcome,
) -> ResponseFuture<F, ResBody, E> {
    let admitted = Admitted {
        headers: None,
        outer_layer: false,
        leases: None,
        charge_to: None,
        outcome: RequestOutcome::undecided(outcome),
    };
    ResponseFuture::admitted(response, shared, admitted)
}

/// One of the layer's own answers, with its `outcome` for whoever reports on it.
fn with_outcome<B>(mut response: Response<B>, outcome: Outcome) -> Response<B> {
    response
        .extensions_mut()
        .insert(RequestOutcome::undecided(outcome));
    response
}

/// Calls the ready `inner` with a request the store admitted (enforced, not delayed).
fn admit<S, ReqBody, ResBody>(
    shared: Arc<Shared>,
    inner: &mut S,
    mut request: Request<ReqBody>,
    checks: Vec<Check>,
    mut decision: Decision,
) -> ResponseFuture<S::Future, ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    let outer_layer = has_outer_layer(&request);
    let admitted = Admitted::new(&shared, &mut decision, checks, false, outer_layer);
    request.extensions_mut().insert(decision);
    ResponseFuture::admitted(inner.call(request), shared, admitted)
}

/// Whether a rate limit layer around this one decided `request` (each layer puts its decision
/// in the request's extensions before it calls the service it wraps).
fn has_outer_layer<B>(request: &Request<B>) -> bool {
    request.extensions().get::<Decision>().is_some()
}

/// What an admitted request's response gets once the inner service answers.
pub(crate) struct Admitted {
    /// The rate limit headers.
    headers: Option<RateLimitHeaders>,
    /// Whether a rate limit layer is around this one (it reads which headers bind).
    outer_layer: bool,
    /// Held until the body ends: if the client goes away mid-request, dropping the future
    /// releases them.
    leases: Option<LeaseGuard>,
    /// The checks a reported cost is post-charged to: only what the store admitted (a
    /// fallback decision, or a shadow denial, which consumed nothing, has nothing to add to).
    charge_to: Option<Charged>,
    /// What the layer made of the request.
    outcome: RequestOutcome,
}

impl Admitted {
    /// Takes the leases out of `decision`; with its headers when the client may see them
    /// (not `shadowed`).
    fn new(
        shared: &Shared,
        decision: &mut Decision,
        checks: Vec<Check>,
        shadowed: bool,
        outer_layer: bool,
    ) -> Admitted {
        let post_charged = decision.source() == DecisionSource::Store && decision.is_allowed();
        Admitted {
            headers: (!shadowed).then(|| RateLimitHeaders::new(decision, shared.responses.headers)),
            outer_layer,
            leases: LeaseGuard::new(&shared.store, decision.take_leases()),
            charge_to: post_charged.then(|| Charged {
                checks,
                at: decision.decided_at(),
            }),
            outcome: RequestOutcome::of_decision(decision, shadowed),
        }
    }
}

/// Awaits the inner service's `response`, settles its reported cost and sets the headers.
async fn finish<F, ResBody, E>(
    shared: Arc<Shared>,
    response: F,
    admitted: Admitted,
) -> Result<Response<RateLimitBody<ResBody>>, E>
where
    F: Future<Output = Result<Response<ResBody>, E>>,
    ResBody: Body,
{
    let response = response.await?;
    Ok(settle_and_complete(shared, response, admitted).await)
}

/// [`finish`] for a response that has come and may report its cost (which the store may wait
/// to settle), boxed for [`ResponseFuture`].
pub(crate) fn finish_boxed<ResBody, E>(
    shared: Arc<Shared>,
    response: Response<ResBody>,
    admitted: Admitted,
) -> crate::future::Boxed<ResBody, E>
where
    ResBody: Body<Data = Bytes> + Send + 'static,
    E: 'static,
{
    Box::pin(async move { Ok(settle_and_complete(shared, response, admitted).await) })
}

/// Settles the reported cost of an admitted request's `response`, then [`complete`]s it.
async fn settle_and_complete<ResBody: Body>(
    shared: Arc<Shared>,
    mut response: Response<ResBody>,
    admitted: Admitted,
) -> Response<RateLimitBody<ResBody>> {
    // Before the head goes out, so that the client's next request sees the charge.
    let settlement = shared
        .settle_cost(&mut response, admitted.charge_to.as_ref())
        .await;
    complete(response, admitted, settlement)
}

/// Sets the rate limit headers and the outcome on the inner service's answer to an admitted
/// request, and wraps its body around the leases and the cost `settlement` it carries.
pub(crate) fn complete<ResBody>(
    mut response: Response<ResBody>,
    admitted: Admitted,
    settlement: Option<PendingSettlement>,
) -> Response<RateLimitBody<ResBody>> {
    if let Some(headers) = admitted.headers {
        headers.apply_within(&mut response, admitted.outer_layer);
    }
    // A nested rate limit layer's outcome stays when it binds (it refused the request, or
    // its limit has less room left than ours).
    let inner = response.extensions().get::<RequestOutcome>();
    if inner.is_none_or(|inner| admitted.outcome.supersedes(inner)) {
        response.extensions_mut().insert(admitted.outcome);
    }
    response.map(|body| RateLimitBody::inner(body, admitted.leases, settlement))
}

async fn decide_then_call<S, ReqBody, ResBody>(
    shared: Arc<Shared>,
    mut inner: S,
    mut request: Request<ReqBody>,
    decide: Decide,
) -> Result<Response<RateLimitBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body,
{
    let Decide {
        checks,
        shadowed,
        identity,
        decided,
    } = decide;
    let decided = match decided {
        Some(decided) => decided,
        None => shared.decide(&checks, shadowed, &identity).await,
    };
    let Ok(mut decision) = decided else {
        let answer = with_outcome(unavailable_response(), Outcome::Unavailable);
        return Ok(answer.map(RateLimitBody::full));
    };
    if shadowed {
        // Invisible to the client: no denial, no delay, no rate limit headers.
        let outer_layer = has_outer_layer(&request);
        let admitted = Admitted::new(&shared, &mut decision, checks, true, outer_layer);
        request.extensions_mut().insert(decision);
        request.extensions_mut().insert(crate::rollout::Shadowed);
        return finish(shared, inner.call(request), admitted).await;
    }
    if !decision.is_allowed() {
        let outcome = RequestOutcome::of_decision(&decision, false);
        let mut response = shared.limited_response(&decision, outcome).await;
        // The whole decision too, for a logging layer outside this one (as documented).
        response.extensions_mut().insert(decision);
        return Ok(response);
    }
    let outer_layer = has_outer_layer(&request);
    let admitted = Admitted::new(&shared, &mut decision, checks, false, outer_layer);
    if !decision.delay().is_zero() {
        tokio::time::sleep(decision.delay()).await;
    }
    request.extensions_mut().insert(decision);
    finish(shared, inner.call(request), admitted).await
}

impl Shared {
    /// Decides `checks` on the store, recording the decision; when the store fails, under the
    /// failure policy (`Err` when it decides nothing).
    async fn decide(
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
    fn decide_ready(
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
