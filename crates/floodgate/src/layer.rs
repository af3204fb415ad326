//! [`RateLimitLayer`] and its builder.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use crate::error::BuildError;
use crate::fallback::OnStoreError;
use crate::headers::HeaderStyle;
use crate::key::storage::check_key_prefix;
use crate::key::{DefaultIdentifier, IdentifyClient, RequestInfo};
use crate::limit::Limit;
use crate::lists::ClientList;
use crate::overrides::Overrides;
use crate::plan::{LimitPlan, StaticPlan, check_rule_name};
use crate::planning::Planner;
use crate::post_charge::ResponseCost;
use crate::response::{LimitedResponseHook, MakeLimitedResponse, ResponseSettings};
use crate::rollout::Rollout;
use crate::service::{RateLimit, RequestCost, UnknownIdentity};
use crate::shared::Shared;
use crate::store::resilience::FailurePolicy;
use crate::store::resilience::{LogObserver, StoreObserver};
use crate::store::{MemoryStore, Store};
use crate::telemetry::LimitedRateBaseline;
use crate::top::TopClients;

/// Applies rate limiting to a service. Clones (and the services they make) share one state.
///
/// ```
/// use std::time::Duration;
/// use floodgate::{Limit, RateLimitLayer};
///
/// let layer = RateLimitLayer::builder()
///     .limit(Limit::token_bucket("per-second", 10, Duration::from_secs(1))?)
///     .limit(Limit::fixed_window("daily", 10_000, Duration::from_secs(86_400))?)
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// **Nested layers** (a global limit with `Router::layer`, a login limit with `route_layer`):
/// all-or-nothing holds within one layer, not across layers. The outer layer decides first
/// and has counted the request by the time an inner one denies it. The response carries the
/// binding limit's headers (an inner denial's, or else the limit with the smaller remaining
/// share), and `RateLimit-Policy` lists the limits of every layer. Put limits that must be
/// decided together in one layer (a [`LimitPlan`] picks them per request).
#[derive(Clone)]
pub struct RateLimitLayer {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("store", &self.shared.store.backend())
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// Starts configuring a layer.
    pub fn builder() -> RateLimitLayerBuilder {
        RateLimitLayerBuilder::default()
    }

    /// The rollout controls (shadow, canary, kill switch), live.
    pub fn rollout(&self) -> &Rollout {
        &self.shared.planner.rollout
    }

    /// The store the layer decides against.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.shared.store
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, self.shared.clone())
    }
}

/// Configures a [`RateLimitLayer`]; every setting is checked in [`build`](Self::build).
#[must_use]
pub struct RateLimitLayerBuilder {
    limits: Vec<Limit>,
    rule: String,
    prefix: String,
    plan: Option<Arc<dyn LimitPlan>>,
    store: Option<Arc<dyn Store>>,
    identify: Option<Arc<dyn IdentifyClient>>,
    cost: Option<Arc<dyn RequestCost>>,
    on_store_error: FailurePolicy,
    fallback_share: f64,
    observer: Arc<dyn StoreObserver>,
    rollout: Rollout,
    top: Option<Arc<TopClients>>,
    baseline: Option<Arc<LimitedRateBaseline>>,
    allowlist: ClientList,
    denylist: ClientList,
    responses: ResponseSettings,
    limited_response: Option<LimitedResponseHook>,
    on_unknown_identity: UnknownIdentity,
    concurrency_retry_hint: Option<Duration>,
    response_cost: Option<Arc<dyn ResponseCost>>,
    overrides: Option<Arc<Overrides>>,
    /// Which of `rule` and `key_prefix` were set (they conflict with a plan).
    rule_set: bool,
    prefix_set: bool,
}

impl Default for RateLimitLayerBuilder {
    fn default() -> Self {
        RateLimitLayerBuilder {
            limits: Vec::new(),
            rule: "default".to_owned(),
            prefix: "fg".to_owned(),
            plan: None,
            store: None,
            identify: None,
            cost: None,
            on_store_error: FailurePolicy::Open,
            fallback_share: 1.0,
            observer: Arc::new(LogObserver),
            rollout: Rollout::default(),
            top: None,
            baseline: None,
            allowlist: ClientList::default(),
            denylist: ClientList::default(),
            responses: ResponseSettings::default(),
            limited_response: None,
            on_unknown_identity: UnknownIdentity::default(),
            concurrency_retry_hint: None,
            response_cost: None,
            overrides: None,
            rule_set: false,
            prefix_set: false,
        }
    }
}

impl RateLimitLayerBuilder {
    /// Adds a limit; every request is checked against all of them, all-or-nothing.
    pub fn limit(mut self, limit: Limit) -> Self {
        self.limits.push(limit);
        self
    }

    /// Adds several limits.
    pub fn limits(mut self, limits: impl IntoIterator<Item = Limit>) -> Self {
        self.limits.extend(limits);
        self
    }

    /// The rule name in storage keys (default `default`). Counters survive a restart or a
    /// reconfiguration as long as the rule and limit names stay the same.
    pub fn rule(mut self, rule: impl Into<String>) -> Self {
        self.rule = rule.into();
        self.rule_set = true;
        self
    }

    /// The storage key prefix (default `fg`).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self.prefix_set = true;
        self
    }

    /// Replaces the fixed limits with a custom plan that picks limits per request (its own
    /// limits, rule and key prefix: setting those too is a [`BuildError::IgnoredWithPlan`]).
    pub fn plan(mut self, plan: impl LimitPlan) -> Self {
        self.plan = Some(Arc::new(plan));
        self
    }

    /// The store (default: a [`MemoryStore`] that evicts idle keys every 10 s).
    pub fn store(mut self, store: impl Store) -> Self {
        self.store = Some(Arc::new(store));
        self
    }

    /// A shared store, e.g. one used by several layers.
    pub fn shared_store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = Some(store);
        self
    }

    /// How clients are identified (default: [`DefaultIdentifier::new`]). Closures
    /// `Fn(&RequestInfo) -> Identity` work.
    pub fn identify(mut self, identify: impl IdentifyClient) -> Self {
        self.identify = Some(Arc::new(identify));
        self
    }

    /// [`identify`](Self::identify) for a closure, with its argument type inferred:
    /// `.identify_with(|request| ...)` (`.identify` needs `|request: &RequestInfo<'_>|`).
    pub fn identify_with<F>(self, identify: F) -> Self
    where
        F: Fn(&RequestInfo<'_>) -> crate::Identity + Send + Sync + 'static,
    {
        self.identify(identify)
    }

    /// [`cost`](Self::cost) for a closure, with its argument type inferred:
    /// `.cost_with(|request| if request.method == Method::POST { 5 } else { 1 })`.
    pub fn cost_with<F>(self, cost: F) -> Self
    where
        F: Fn(&RequestInfo<'_>) -> u64 + Send + Sync + 'static,
    {
        self.cost(cost)
    }

    /// The cost of each request (default 1). Closures `Fn(&RequestInfo) -> u64` work.
    pub fn cost(mut self, cost: impl RequestCost) -> Self {
        self.cost = Some(Arc::new(cost));
        self
    }

    /// `Retry-After` for a request denied by a **concurrency** limit: at most `hint`.
    ///
    /// Without it, a concurrency denial promises the time until enough leases *expire* (up to
    /// the limit's window, 30 s by default): the only wait that holds if no request in flight
    /// ever finishes, but far too long for streams that end in seconds. With a hint, clients are
    /// told to come back sooner, at the risk of another 429 if nothing has finished by then.
    /// (For such limits `RateLimit-Policy`'s `w` is the lease lifetime and `remaining` the free
    /// slots.)
    pub fn concurrency_retry_hint(mut self, hint: Duration) -> Self {
        self.concurrency_retry_hint = Some(hint);
        self
    }

    /// What to do with a request whose client cannot be identified (default
    /// [`UnknownIdentity::SharedBudget`]; it is logged once and counted either way).
    pub fn on_unknown_identity(mut self, policy: UnknownIdentity) -> Self {
        self.on_unknown_identity = policy;
        self
    }

    /// What to do when the store fails (default [`FailurePolicy::Open`]).
    pub fn on_store_error(mut self, policy: FailurePolicy) -> Self {
        self.on_store_error = policy;
        self
    }

    /// Under [`FailurePolicy::Local`], the share of each limit one node enforces alone
    /// (default 1.0; with N nodes behind a load balancer, 1/N keeps the total near the limit).
    pub fn fallback_share(mut self, share: f64) -> Self {
        self.fallback_share = share;
        self
    }

    /// Who hears about store failures and fallback decisions (default: logs). Pass the same
    /// observer to the store to see its breaker transitions too.
    pub fn observer(mut self, observer: Arc<dyn StoreObserver>) -> Self {
        self.observer = observer;
        self
    }

    /// Rollout controls: shadow mode, canary share, kill switch (default: enforce all). Keep a
    /// clone to switch them while the service runs.
    pub fn rollout(mut self, rollout: Rollout) -> Self {
        self.rollout = rollout;
        self
    }

    /// Clients that bypass every limit, without a store call.
    pub fn allowlist(mut self, list: ClientList) -> Self {
        self.allowlist = list;
        self
    }

    /// Clients refused with 403 `{"error":"forbidden"}`.
    pub fn denylist(mut self, list: ClientList) -> Self {
        self.denylist = list;
        self
    }

    /// Track the top clients (by denials and closeness to their limit) in `top`.
    pub fn top_clients(mut self, top: Arc<TopClients>) -> Self {
        self.top = Some(top);
        self
    }

    /// Count decisions into a 429-rate baseline (someone must call its `tick` periodically).
    pub fn limited_rate_baseline(mut self, baseline: Arc<LimitedRateBaseline>) -> Self {
        self.baseline = Some(baseline);
        self
    }

    /// Which rate limit headers to send (default [`HeaderStyle::Both`]).
    pub fn headers(mut self, style: HeaderStyle) -> Self {
        self.responses.headers = style;
        self
    }

    /// The largest random extra added to `Retry-After`, as a fraction of the wait (default
    /// 0.2); whatever the fraction, the extra is at most
    /// [`MAX_RETRY_AFTER_JITTER`](crate::headers::MAX_RETRY_AFTER_JITTER) (60 s).
    pub fn retry_after_jitter(mut self, jitter: f64) -> Self {
        self.responses.retry_after_jitter = jitter;
        self
    }

    /// A link to the API's rate limit documentation, put in 429 bodies.
    pub fn docs_url(mut self, url: impl Into<String>) -> Self {
        self.responses.docs_url = Some(url.into().into());
        self
    }

    /// Answer 429 with RFC 9457 `application/problem+json` (default false).
    pub fn problem_json(mut self, enabled: bool) -> Self {
        self.responses.problem_json = enabled;
        self
    }

    /// Replaces the 429 response. Closures `Fn(&Denial) -> Response<Bytes>` work.
    pub fn limited_response(mut self, make: impl MakeLimitedResponse) -> Self {
        self.limited_response = Some(LimitedResponseHook::Bytes(Arc::new(make)));
        self
    }

    /// Replaces the 429 response with anything axum turns into a response (`Json(...)`, a
    /// tuple of status, headers and body, `Html`, ...). Its body is read (up to 64 KiB) before
    /// it is sent; the layer still adds the rate limit headers and `Retry-After`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum::http::{StatusCode, header};
    /// use floodgate::{Denial, Limit, RateLimitLayer};
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .limit(Limit::token_bucket("per-second", 10, Duration::from_secs(1))?)
    ///     .limited_response_with(|denial: &Denial<'_>| {
    ///         let body = format!("{{\"message\":\"slow down\",\"retry_in\":{:?}}}", denial.retry_after_secs);
    ///         (StatusCode::TOO_MANY_REQUESTS, [(header::CONTENT_TYPE, "application/json")], body)
    ///     })
    ///     .build()?;
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(feature = "axum")]
    pub fn limited_response_with<F, R>(mut self, make: F) -> Self
    where
        F: Fn(&crate::Denial<'_>) -> R + Send + Sync + 'static,
        R: axum::response::IntoResponse,
    {
        self.limited_response = Some(LimitedResponseHook::Axum(Arc::new(move |denial| {
            make(denial).into_response()
        })));
        self
    }

    /// Charges each request's real cost once its response tells it (SPEC §9): the request
    /// is admitted at its up-front cost, and what the response reports beyond it is charged
    /// to the same limits without denying anything; a client left in debt waits it out. See
    /// [`crate::post_charge`]. Costs one more store call per response that reports a cost.
    pub fn charge_from_response(mut self, cost: impl ResponseCost) -> Self {
        self.response_cost = Some(Arc::new(cost));
        self
    }

    /// The per-client overrides to apply (default: those of the store, under the key prefix,
    /// with [`Overrides`]' default bounds). Give the same `Overrides` to several layers on one
    /// store, or keep it across rebuilds, so that one copy serves them all.
    pub fn overrides(mut self, overrides: Arc<Overrides>) -> Self {
        self.overrides = Some(overrides);
        self
    }

    /// All of the built-in responses' settings at once (headers, jitter, docs link, body
    /// format), as a configuration file gives them; checked by [`build`](Self::build).
    pub fn responses(mut self, settings: ResponseSettings) -> Self {
        self.responses = settings;
        self
    }

    /// Validates the configuration and builds the layer.
    pub fn build(self) -> Result<RateLimitLayer, BuildError> {
        check_rule_name(&self.rule)?;
        check_key_prefix(&self.prefix)?;
        let jitter = self.responses.retry_after_jitter;
        if !(0.0..=10.0).contains(&jitter) {
            return Err(BuildError::InvalidJitter(jitter));
        }
        if !(self.fallback_share > 0.0 && self.fallback_share <= 1.0) {
            return Err(BuildError::InvalidFallbackShare(self.fallback_share));
        }
        let plan = match self.plan {
            Some(plan) => {
                let ignored = [
                    (!self.limits.is_empty(), "limit"),
                    (self.rule_set, "rule"),
                    (self.prefix_set, "key_prefix"),
                ];
                if let Some((_, name)) = ignored.into_iter().find(|(set, _)| *set) {
                    return Err(BuildError::IgnoredWithPlan(name));
                }
                plan
            }
            None => {
                if self.limits.is_empty() {
                    return Err(BuildError::NoLimits);
                }
                let mut seen = HashSet::new();
                for (index, limit) in self.limits.iter().enumerate() {
                    if !seen.insert(limit.name()) {
                        return Err(BuildError::DuplicateLimitName {
                            index,
                            name: limit.name().to_owned(),
                        });
                    }
                }
                if let Some(store) = &self.store {
                    for (index, limit) in self.limits.iter().enumerate() {
                        if !store.supports(limit.algorithm()) {
                            return Err(BuildError::UnsupportedAlgorithm {
                                index,
                                algorithm: limit.algorithm(),
                                store: store.backend(),
                            });
                        }
                    }
                }
                let limits = self.limits.into_iter().map(Arc::new).collect();
                Arc::new(StaticPlan::new(self.prefix.clone(), self.rule, limits))
            }
        };
        let store = self.store.unwrap_or_else(|| {
            // Easy to ship to several servers by mistake: each would count alone.
            tracing::info!(
                "rate limit layer without a store: counting in this process's memory \
                 (RateLimitLayerBuilder::store for a store shared by several servers)"
            );
            Arc::new(
                MemoryStore::builder()
                    .evict_every(Duration::from_secs(10))
                    .build(),
            )
        });
        let overrides = self.overrides.or_else(|| {
            let backend = store.override_backend()?;
            Some(Arc::new(Overrides::new(backend, self.prefix.clone())))
        });
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                planner: Planner {
                    plan,
                    identify: self
                        .identify
                        .unwrap_or_else(|| Arc::new(DefaultIdentifier::new())),
                    cost: self.cost,
                    rollout: self.rollout,
                    allowlist: self.allowlist,
                    denylist: self.denylist,
                    on_unknown_identity: self.on_unknown_identity,
                    unidentified: Default::default(),
                    overrides,
                },
                store,
                on_store_error: OnStoreError::new(self.on_store_error, self.fallback_share),
                observer: self.observer,
                top: self.top,
                baseline: self.baseline,
                responses: self.responses,
                limited_response: self.limited_response,
                concurrency_retry_hint: self.concurrency_retry_hint,
                response_cost: self.response_cost,
            }),
        })
    }
}
