//! The [`RateLimit`] service: decides in `call`, then answers 429 or calls the inner service.

pub use crate::body::RateLimitBody;
pub use crate::future::ResponseFuture;

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

pub use crate::planning::{RequestCost, UnknownIdentity};

use crate::admitted::{Admitted, finish};
use crate::decision::Decision;
use crate::key::Identity;
use crate::outcome::{Outcome, RequestOutcome};
use crate::planning::Route;
use crate::response::{forbidden_response, unavailable_response, unidentified_response};
use crate::rollout::Mode;
use crate::shared::{Shared, Unavailable};
use crate::store::Check;
use crate::telemetry;

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
    ResponseFuture::admitted(response, shared, Admitted::undecided(outcome))
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
