//! Planning a request: who it is from, whether a list or the identity answers it before any
//! limit, and otherwise the checks it meets (with the overrides in force). Planning records
//! nothing, so that an operator's lookup and a served request plan alike; the service records
//! what a served request's plan says ([`Planner::record_plan`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::Request;

use crate::key::{IdentifyClient, Identity, RequestInfo};
use crate::lists::ClientList;
use crate::overrides::Overrides;
use crate::plan::LimitPlan;
use crate::rollout::{Mode, Rollout};
use crate::store::Check;
use crate::telemetry;

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

/// A request, planned.
pub(crate) struct Planned {
    /// Who it is from.
    pub(crate) identity: Identity,
    /// What happens to it.
    pub(crate) route: Route,
}

/// What happens to a planned request.
pub(crate) enum Route {
    /// Denylisted: 403.
    Denylisted,
    /// Unidentified under [`UnknownIdentity::Reject`]: 500.
    Unidentified,
    /// Allowlisted: no limit applies, no store call.
    Allowlisted,
    /// The checks it meets (none: no limit applies); `shadowed` ones are counted, never
    /// blocked (shadow mode, or a canary that does not enforce this identity).
    Checks { checks: Vec<Check>, shadowed: bool },
}

/// Counts unidentified requests, and warns about the first one.
#[derive(Debug, Default)]
pub(crate) struct Unidentified {
    warned: AtomicBool,
}

impl Unidentified {
    fn record(&self) {
        metrics::counter!(telemetry::UNIDENTIFIED_REQUESTS_TOTAL).increment(1);
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "a request could not be identified (no API key, no user, no peer address): \
                 insert PeerAddr or serve with axum's into_make_service_with_connect_info; \
                 such requests share one `unknown` budget (see RateLimitLayerBuilder::on_unknown_identity)"
            );
        }
    }
}

/// What plans a request: who it is from, the lists, the limits and the overrides in force,
/// the rollout. One per layer, shared by its services and its operator handle.
pub(crate) struct Planner {
    pub(crate) plan: Arc<dyn LimitPlan>,
    pub(crate) identify: Arc<dyn IdentifyClient>,
    pub(crate) cost: Option<Arc<dyn RequestCost>>,
    pub(crate) rollout: Rollout,
    pub(crate) allowlist: ClientList,
    pub(crate) denylist: ClientList,
    pub(crate) on_unknown_identity: UnknownIdentity,
    pub(crate) unidentified: Unidentified,
    pub(crate) overrides: Option<Arc<Overrides>>,
}

impl Planner {
    /// Plans `request`, with the overrides in force applied to its checks.
    pub(crate) fn plan<B>(&self, request: &Request<B>) -> Planned {
        let mut planned = self.plan_as_configured(request);
        if let (Some(overrides), Route::Checks { checks, .. }) =
            (&self.overrides, &mut planned.route)
        {
            overrides.apply(checks);
        }
        planned
    }

    /// Plans `request` with the limits as configured: no override applied (what an override
    /// is made from).
    pub(crate) fn plan_as_configured<B>(&self, request: &Request<B>) -> Planned {
        let info = RequestInfo::new(request);
        let identity = self.identify.identify(&info);
        let route = self.route(&info, &identity);
        Planned { identity, route }
    }

    fn route(&self, info: &RequestInfo<'_>, identity: &Identity) -> Route {
        if *identity == Identity::Unknown && self.on_unknown_identity == UnknownIdentity::Reject {
            return Route::Unidentified;
        }
        if !self.denylist.is_empty() || !self.allowlist.is_empty() {
            let client_addr = self.identify.client_addr(info);
            if self.denylist.contains_identity(identity, client_addr) {
                return Route::Denylisted;
            }
            if self.allowlist.contains_identity(identity, client_addr) {
                return Route::Allowlisted;
            }
        }
        let cost = self.cost.as_ref().map_or(1, |cost| cost.cost(info).max(1));
        let checks = self.plan.checks(info, identity, cost);
        let shadowed = !checks.is_empty()
            && (self.rollout.mode() == Mode::Shadow
                || (!self.rollout.enforces_everyone() && !self.rollout.enforces(&identity.hash())));
        Route::Checks { checks, shadowed }
    }

    /// Records what a served request's plan says: an unidentified client (counted, the first
    /// one logged), a list's decision.
    pub(crate) fn record_plan(&self, planned: &Planned) {
        if planned.identity == Identity::Unknown {
            self.unidentified.record();
        }
        match planned.route {
            Route::Denylisted => {
                telemetry::record_denylisted();
            }
            Route::Allowlisted => {
                telemetry::record_allowlisted();
            }
            Route::Unidentified | Route::Checks { .. } => {}
        }
    }
}
