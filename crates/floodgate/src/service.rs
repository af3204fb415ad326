//! The [`RateLimit`] service: decides in `call`, then answers 429 or calls the inner service.

pub use crate::body::RateLimitBody;
pub use crate::future::ResponseFuture;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::FailurePolicy;
use crate::body::LeaseGuard;
use crate::decision::{Decision, DecisionSource};
use crate::headers::{BindingHeaders, RateLimitHeaders, retry_after_secs};
use crate::key::Identity;
use crate::key::{IdentifyClient, RequestInfo};
use crate::limit::Limit;
use crate::lists::ClientList;
use crate::overrides::Overrides;
use crate::plan::LimitPlan;
use crate::post_charge::{self, ReportedCost, ResponseCost};
use crate::response::{
    Denial, LimitedResponseHook, ResponseSettings, default_limited_response,
    finish_limited_response, unavailable_response,
};
use crate::response::{forbidden_response, unidentified_response};
use crate::rollout::{Mode, Rollout};
use crate::store::resilience::StoreObserver;
use crate::store::{Check, MemoryStore, Store};
use crate::telemetry::{self, DecisionLabel, LimitedRateBaseline};
use crate::time::Timestamp;
use crate::top::TopClients;

/// How much a request costs; closures `Fn(&RequestInfo) -> u64` implement it.
pub trait RequestCost: Send + Sync + 'static {
    /// The cost of `request`; 0 counts as 1.
    fn cost(&self, request: &RequestInfo<'_>) -> u64;
}

impl<F> RequestCost for F
where
    F: Fn(&RequestInfo<'_>) -> u64 + Send + Sync + 'static,
{
    fn cost(&self, request: &RequestInfo<'_>) -> u64 {
        self(request)
    }
}

/// What every clone of a layer and its services share: one store, one configuration.
pub(crate) struct Shared {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) plan: Arc<dyn LimitPlan>,
    pub(crate) identify: Arc<dyn IdentifyClient>,
    pub(crate) cost: Option<Arc<dyn RequestCost>>,
    pub(crate) on_store_error: FailurePolicy,
    pub(crate) fallback: Option<LocalFallback>,
    pub(crate) observer: Arc<dyn StoreObserver>,
    pub(crate) rollout: Rollout,
    pub(crate) top: Option<Arc<TopClients>>,
    pub(crate) allowlist: ClientList,
    pub(crate) denylist: ClientList,
    pub(crate) baseline: Option<Arc<LimitedRateBaseline>>,
    pub(crate) responses: ResponseSettings,
    pub(crate) limited_response: Option<LimitedResponseHook>,
    pub(crate) on_unknown_identity: UnknownIdentity,
    pub(crate) concurrency_retry_hint: Option<Duration>,
    pub(crate) unidentified: Unidentified,
    pub(crate) response_cost: Option<Arc<dyn ResponseCost>>,
    pub(crate) overrides: Option<Arc<Overrides>>,
}

/// What happens to a request whose client cannot be identified: no API key, no user, and no
/// peer address (a server that inserts neither [`PeerAddr`](crate::PeerAddr) nor axum's
/// `ConnectInfo`). Either way it is logged (once) and counted in
/// `floodgate_unidentified_requests_total`, never pooled in silence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnknownIdentity {
    /// All unidentified requests share one `unknown` budget (the default): limited, not free,
    /// but one such client can exhaust it for every other.
    #[default]
    SharedBudget,
    /// Answer 500 `{"error":"client_unidentified"}`, as tower_governor does: a deployment
    /// mistake is loud instead of pooling clients.
    Reject,
}

/// A request answered before any limit is checked.
pub(crate) enum EarlyAnswer {
    /// 403.
    Denylisted,
    /// 500 under [`UnknownIdentity::Reject`].
    Unidentified,
}

/// Counts unidentified requests, and warns about the first one.
#[derive(Debug, Default)]
pub(crate) struct Unidentified {
    warned: std::sync::atomic::AtomicBool,
}

impl Unidentified {
    fn record(&self) {
        metrics::counter!(telemetry::UNIDENTIFIED_REQUESTS_TOTAL).increment(1);
        if !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "a request could not be identified (no API key, no user, no peer address): \
                 insert PeerAddr or serve with axum's into_make_service_with_connect_info; \
                 such requests share one `unknown` budget (see RateLimitLayerBuilder::on_unknown_identity)"
            );
        }
    }
}

impl Shared {
    /// The checks for a request, whether it is shadowed (counted, never blocked), and who it is;
    /// or the answer it gets without any check (403 denylisted, 500 unidentified under
    /// [`UnknownIdentity::Reject`]). Allowlisted clients get no checks.
    pub(crate) fn checks<B>(
        &self,
        request: &Request<B>,
    ) -> Result<(Vec<Check>, bool, Identity), EarlyAnswer> {
        self.checks_of(request, true)
    }

    /// [`Shared::checks`]; with `record` false (an operator looking a client up), nothing is
    /// counted or logged.
    pub(crate) fn checks_of<B>(
        &self,
        request: &Request<B>,
        record: bool,
    ) -> Result<(Vec<Check>, bool, Identity), EarlyAnswer> {
        let mut planned = self.configured_checks_of(request, record)?;
        if let Some(overrides) = &self.overrides {
            overrides.apply(&mut planned.0);
        }
        Ok(planned)
    }

    /// [`Shared::checks_of`] with the limits as configured: no override applied.
    pub(crate) fn configured_checks_of<B>(
        &self,
        request: &Request<B>,
        record: bool,
    ) -> Result<(Vec<Check>, bool, Identity), EarlyAnswer> {
        let info = RequestInfo::new(request);
        let identity = self.identify.identify(&info);
        if identity == Identity::Unknown {
            if record {
                self.unidentified.record();
            }
            if self.on_unknown_identity == UnknownIdentity::Reject {
                return Err(EarlyAnswer::Unidentified);
            }
        }
        if !self.denylist.is_empty() || !self.allowlist.is_empty() {
            let client_addr = self.identify.client_addr(&info);
            if self.denylist.contains_identity(&identity, client_addr) {
                if record {
                    telemetry::record_decision("denylist", "denylist", DecisionLabel::Denylisted);
                }
                return Err(EarlyAnswer::Denylisted);
            }
            if self.allowlist.contains_identity(&identity, client_addr) {
                if record {
                    telemetry::record_decision("allowlist", "allowlist", DecisionLabel::Bypassed);
                }
                return Ok((Vec::new(), false, identity));
            }
        }
        let cost = self.cost.as_ref().map_or(1, |cost| cost.cost(&info).max(1));
        let checks = self.plan.checks(&info, &identity, cost);
        let shadowed = !checks.is_empty()
            && (self.rollout.mode() == Mode::Shadow
                || (!self.rollout.enforces_everyone() && !self.rollout.enforces(&identity.hash())));
        Ok((checks, shadowed, identity))
    }

    /// Near-limit metric, top clients and the 429 baseline, for a decision of the store.
    fn observe(&self, identity: &Identity, decision: &Decision, shadowed: bool) {
        let Some(binding) = decision.binding_limit() else {
            return;
        };
        let denied = !decision.is_allowed();
        if !denied && binding.remaining * 5 < binding.capacity {
            telemetry::record_near_limit(&binding.rule, &binding.name);
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

    /// Reads what the response says the request cost (reported by the inner service in the
    /// response's extensions, or read, and removed, by the layer's [`ResponseCost`]) and, with
    /// `charge_to` (the checks that admitted it), post-charges it. Runs on every response the
    /// inner service gives, so that the cost header never reaches the client, charged or not.
    async fn settle_cost<B>(&self, response: &mut Response<B>, charge_to: Option<&[Check]>) {
        let reported = match response.extensions_mut().remove::<ReportedCost>() {
            Some(reported) => reported,
            None => match &self.response_cost {
                Some(cost) => cost.reported_cost(response.headers_mut()),
                None => return,
            },
        };
        if let Some(checks) = charge_to {
            post_charge::charge(&*self.store, checks, reported).await;
        }
    }

    async fn limited_response<B>(&self, decision: &Decision) -> Response<RateLimitBody<B>> {
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
        response.map(RateLimitBody::full)
    }
}

/// A limit, and the same limit scaled by the fallback share.
type OriginalAndScaled = (Arc<Limit>, Arc<Limit>);

/// Most scaled limits the local fallback keeps (a plan's limits, over a few reloads).
const FALLBACK_CACHE: usize = 1024;

/// The per-node limiter of [`FailurePolicy::Local`]: the same checks, on a memory store, with
/// every limit scaled by the fallback share. The layer keeps one; a service deciding through
/// its own path (the gateway's Envoy rate limit service) keeps its own and decides with
/// [`decide_on_store_error`].
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
                        key: check.key.clone(),
                        rule: check.rule.clone(),
                        limit,
                        cost: check.cost,
                    }
                })
                .collect()
        };
        self.store.check_and_consume_now(&scaled_checks, None)
    }
}

/// What the failure policy decides for `checks` when the store failed: under `local`, the
/// node's `fallback` decides (a decision of source [`DecisionSource::LocalFallback`]); under
/// `closed`, nothing (`None`: the caller answers that the limiter is unavailable); under `open`
/// (or `local` without a fallback), everything is admitted ([`DecisionSource::FailOpen`]).
/// The one place the policy is decided, for the layer and for the gateway's rate limit service.
pub fn decide_on_store_error(
    policy: FailurePolicy,
    fallback: Option<&LocalFallback>,
    checks: &[Check],
) -> Option<Decision> {
    match (policy, fallback) {
        (FailurePolicy::Local, Some(fallback)) => Some(
            fallback
                .decide(checks)
                .with_source(DecisionSource::LocalFallback),
        ),
        (FailurePolicy::Closed, _) => None,
        _ => Some(Decision::unlimited(
            Timestamp::now(),
            DecisionSource::FailOpen,
        )),
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
    type Future = ResponseFuture<ResBody, S::Error>;

    /// Only the inner service's readiness: limiting happens in `call`, so an over-limit
    /// client gets a 429 instead of being queued.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The ready service goes into the future; a fresh clone waits for the next poll_ready.
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let shared = self.shared.clone();
        if shared.rollout.mode() == Mode::Off {
            // Kill switch: not even a store call.
            telemetry::record_decision("rollout", "off", DecisionLabel::Bypassed);
            let response = inner.call(request);
            return ResponseFuture::new(Box::pin(async move {
                let mut response = response.await?;
                shared.settle_cost(&mut response, None).await;
                Ok(response.map(|body| RateLimitBody::inner(body, None)))
            }));
        }
        let (checks, shadowed, identity) = match shared.checks(&request) {
            Ok(checks) => checks,
            Err(early) => {
                let answer = match early {
                    EarlyAnswer::Denylisted => forbidden_response(),
                    EarlyAnswer::Unidentified => unidentified_response(),
                }
                .map(RateLimitBody::full);
                return ResponseFuture::new(Box::pin(async move { Ok(answer) }));
            }
        };
        ResponseFuture::new(Box::pin(decide_then_call(
            shared, inner, request, checks, shadowed, identity,
        )))
    }
}

async fn decide_then_call<S, ReqBody, ResBody>(
    shared: Arc<Shared>,
    mut inner: S,
    mut request: Request<ReqBody>,
    checks: Vec<Check>,
    shadowed: bool,
    identity: Identity,
) -> Result<Response<RateLimitBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    if checks.is_empty() {
        let mut response = inner.call(request).await?;
        shared.settle_cost(&mut response, None).await;
        return Ok(response.map(|body| RateLimitBody::inner(body, None)));
    }
    let started = std::time::Instant::now();
    let result = shared.store.check_and_consume(&checks, None).await;
    telemetry::record_check_duration(shared.store.backend(), started.elapsed());
    let mut decision = match result {
        Ok(decision) => {
            if let Some(binding) = decision.binding_limit() {
                let label = match (decision.is_allowed(), shadowed) {
                    (true, _) => DecisionLabel::Allowed,
                    (false, false) => DecisionLabel::Limited,
                    (false, true) => DecisionLabel::ShadowLimited,
                };
                telemetry::record_limit_decision(&binding.rule, &binding.name, label);
                shared.observe(&identity, &decision, shadowed);
                if label == DecisionLabel::ShadowLimited && shared.rollout.may_log_shadow() {
                    tracing::info!(
                        rule = %binding.rule,
                        limit = %binding.name,
                        retry_after = ?decision.retry_after(),
                        "shadow: this request would have been limited"
                    );
                }
            }
            decision
        }
        Err(error) => {
            let backend = shared.store.backend();
            let policy = shared.on_store_error;
            let decision = decide_on_store_error(policy, shared.fallback.as_ref(), &checks);
            let allowed = decision.as_ref().is_some_and(Decision::is_allowed);
            shared
                .observer
                .fallback_decision(backend, policy, &error, allowed);
            let label = if allowed {
                DecisionLabel::FallbackAllowed
            } else {
                DecisionLabel::FallbackLimited
            };
            telemetry::record_decision(&checks[0].rule, checks[0].limit.name(), label);
            match decision {
                Some(decision) => decision,
                None => return Ok(unavailable_response().map(RateLimitBody::full)),
            }
        }
    };
    // Only what the store admitted is post-charged: a fallback decision, or a shadow denial
    // (which consumed nothing), has nothing to add to.
    let post_charged = decision.source() == DecisionSource::Store && decision.is_allowed();
    let charge_to = post_charged.then_some(&checks[..]);
    if shadowed {
        // Invisible to the client: no denial, no delay, no rate limit headers.
        let leases = LeaseGuard::new(shared.store.clone(), decision.take_leases());
        request.extensions_mut().insert(decision);
        let mut response = inner.call(request).await?;
        shared.settle_cost(&mut response, charge_to).await;
        return Ok(response.map(|body| RateLimitBody::inner(body, leases)));
    }
    if !decision.is_allowed() {
        let mut response = shared.limited_response(&decision).await;
        // What was decided, for whoever logs the answer (the gateway's access log).
        response.extensions_mut().insert(decision);
        return Ok(response);
    }
    // Held from here: if the client goes away mid-request, dropping the future releases them.
    let leases = LeaseGuard::new(shared.store.clone(), decision.take_leases());
    if !decision.delay().is_zero() {
        tokio::time::sleep(decision.delay()).await;
    }
    let headers = RateLimitHeaders::new(&decision, shared.responses.headers);
    request.extensions_mut().insert(decision);
    let mut response = inner.call(request).await?;
    // Before the head goes out, so that the client's next request sees the charge.
    shared.settle_cost(&mut response, charge_to).await;
    headers.apply_to_response(&mut response);
    Ok(response.map(|body| RateLimitBody::inner(body, leases)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 11 item 10: limits made and dropped one after another (a plan building them per
    /// request, or reloads) often land at the same address; each must get its own scaled limit,
    /// and the cache must stay bounded.
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
}
