//! What happens to an admitted request once the inner service answers: its reported cost
//! settled, the rate limit headers set, its leases and any pending settlement carried by the
//! body.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::Response;
use http_body::Body;

use crate::body::{LeaseGuard, RateLimitBody};
use crate::decision::{Decision, DecisionSource};
use crate::headers::RateLimitHeaders;
use crate::outcome::{Outcome, RequestOutcome};
use crate::post_charge::{Charged, PendingSettlement};
use crate::shared::Shared;
use crate::store::Check;

/// A boxed future of the layer's answer.
pub(crate) type Boxed<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<RateLimitBody<B>>, E>> + Send>>;

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
    /// A request no limit decided (`outcome` says why): no headers, no leases, nothing to
    /// charge a reported cost to.
    pub(crate) fn undecided(outcome: Outcome) -> Admitted {
        Admitted {
            headers: None,
            outer_layer: false,
            leases: None,
            charge_to: None,
            outcome: RequestOutcome::undecided(outcome),
        }
    }

    /// Takes the leases out of `decision`; with its headers when the client may see them
    /// (not `shadowed`).
    pub(crate) fn new(
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
pub(crate) async fn finish<F, ResBody, E>(
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
) -> Boxed<ResBody, E>
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
    // its limit has less room left than ours). A request shed inside this layer is told as
    // shed, with our binding limit (the shedding decided against none).
    let inner = response.extensions().get::<RequestOutcome>();
    let shed_inside =
        inner.is_some_and(|inner| inner.outcome == Outcome::Shed && inner.binding.is_none());
    if shed_inside {
        let outcome = RequestOutcome {
            outcome: Outcome::Shed,
            binding: admitted.outcome.binding,
        };
        response.extensions_mut().insert(outcome);
    } else if inner.is_none_or(|inner| admitted.outcome.supersedes(inner)) {
        response.extensions_mut().insert(admitted.outcome);
    }
    response.map(|body| RateLimitBody::inner(body, admitted.leases, settlement))
}
