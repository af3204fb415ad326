//! Which limits a request meets, in SPEC §1's fixed order: global ceilings, then per IP, then
//! the client's plan, then the plan's endpoint limits.

use std::net::IpAddr;
use std::sync::Arc;

use floodgate::key::{IdentityScope, storage_key};
use floodgate::{
    Identity, Limit, RequestInfo,
    key::IdentityHash,
    plan::LimitPlan,
    store::{Check, Scope},
};
use http::Method;

use crate::client::ResolvedClient;
use crate::config::{Config, EndpointLimits, PlanLimits};

/// The rule of `per_ip` limits.
const PER_IP_RULE: &str = "per_ip";

/// The gateway's limit plan for one configuration version.
#[derive(Debug)]
pub(crate) struct GatewayPlan {
    config: Arc<Config>,
    per_ip_rule: Arc<str>,
}

impl GatewayPlan {
    /// The plan of `config`.
    pub(crate) fn new(config: Arc<Config>) -> Self {
        GatewayPlan {
            config,
            per_ip_rule: Arc::from(PER_IP_RULE),
        }
    }
}

/// Who a client is as far as storage keys go.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ClientKeys<'a> {
    /// Its identity (hashed only if a plan limit needs it).
    Identity(&'a Identity),
    /// The hash and scope (`key`, `user`, `ip`, `unknown`) of an identity known only by them.
    Hashed {
        /// The identity's hash.
        hash: IdentityHash,
        /// The identity's scope.
        scope: &'a str,
    },
}

impl ClientKeys<'_> {
    fn hash_and_scope(&self) -> (IdentityHash, &str) {
        match self {
            ClientKeys::Identity(identity) => (identity.hash(), identity.scope()),
            ClientKeys::Hashed { hash, scope } => (*hash, scope),
        }
    }
}

impl GatewayPlan {
    /// The checks of a request `method path` from a client of `plan` at `client_ip`, in SPEC
    /// §1's order: the request path and the admin API's client inspection share it.
    pub(crate) fn client_checks(
        &self,
        method: &Method,
        path: &str,
        client_ip: Option<IpAddr>,
        plan: &str,
        client: ClientKeys<'_>,
        cost: u64,
    ) -> Vec<Check> {
        let config = &self.config;
        let mut checks = Vec::new();
        if let Some((endpoint, global)) = config.global.find(method, path) {
            // One counter for all clients: the endpoint is the identity.
            let hash = Identity::Custom {
                scope: Arc::from("global"),
                value: endpoint.key_id(),
            }
            .hash();
            self.push(
                &mut checks,
                (Scope::Shared, "global", &hash),
                &global.rule,
                &global.limits,
                cost,
            );
        }
        self.push_per_ip(&mut checks, client_ip, cost);
        if let Some(plan) = config.plans.get(plan) {
            let endpoint = plan.endpoints.find(method, path);
            if plan.limits.is_empty() && endpoint.is_none() {
                return checks;
            }
            let endpoints = endpoint.map(|(_, limits)| limits);
            self.push_plan(&mut checks, plan, endpoints, client, cost);
        }
        checks
    }

    /// Every check a client of `plan` at `client_ip` can meet, on any endpoint: its `per_ip`
    /// limits (when the IP is known), its plan's limits and every endpoint limit of its plan, at
    /// cost 1. Global ceilings are every client's, and not among them. What an operator's reset
    /// of a client clears.
    pub(crate) fn all_client_checks(
        &self,
        client_ip: Option<IpAddr>,
        plan: &str,
        client: ClientKeys<'_>,
    ) -> Vec<Check> {
        let mut checks = Vec::new();
        self.push_per_ip(&mut checks, client_ip, 1);
        if let Some(plan) = self.config.plans.get(plan) {
            let endpoints = plan.endpoints.entries().map(|(_, limits)| limits);
            self.push_plan(&mut checks, plan, endpoints, client, 1);
        }
        checks
    }

    /// The checks of `plan`'s own limits, then of `endpoints`' limits, counted for `client`.
    fn push_plan<'p>(
        &self,
        checks: &mut Vec<Check>,
        plan: &PlanLimits,
        endpoints: impl IntoIterator<Item = &'p EndpointLimits>,
        client: ClientKeys<'_>,
        cost: u64,
    ) {
        let (hash, scope) = client.hash_and_scope();
        let counter = (Scope::Client, scope, &hash);
        self.push(checks, counter, &plan.rule, &plan.limits, cost);
        for endpoint in endpoints {
            self.push(checks, counter, &endpoint.rule, &endpoint.limits, cost);
        }
    }

    /// The `per_ip` checks of a client at `client_ip`, when it is known.
    fn push_per_ip(&self, checks: &mut Vec<Check>, client_ip: Option<IpAddr>, cost: u64) {
        if let Some(ip) = client_ip
            && !self.config.per_ip.is_empty()
        {
            let hash = Identity::Ip(ip).hash();
            let rule = &self.per_ip_rule;
            self.push(
                checks,
                (Scope::Client, IdentityScope::Ip.as_str(), &hash),
                rule,
                &self.config.per_ip,
                cost,
            );
        }
    }

    /// One check per limit of `rule`, of a counter in `counter`'s scope, keyed by the
    /// identity's scope and hash.
    fn push(
        &self,
        checks: &mut Vec<Check>,
        (counter, scope, hash): (Scope, &str, &IdentityHash),
        rule: &Arc<str>,
        limits: &[Arc<Limit>],
        cost: u64,
    ) {
        let prefix = self.config.store.prefix.as_str();
        for limit in limits {
            let key = storage_key(prefix, scope, hash, rule, limit.name());
            let check = Check::new(key, limit.clone(), cost).with_rule(rule.clone());
            checks.push(check.with_scope(counter));
        }
    }
}

/// Whether `check` is a `global` ceiling: one counter every client writes.
pub(crate) fn is_global_ceiling(check: &Check) -> bool {
    check.scope == Scope::Shared
}

impl LimitPlan for GatewayPlan {
    fn checks(&self, request: &RequestInfo<'_>, identity: &Identity, cost: u64) -> Vec<Check> {
        let Some(client) = request.extensions.get::<ResolvedClient>() else {
            return Vec::new();
        };
        if client.bypass {
            return Vec::new();
        }
        self.client_checks(
            request.method,
            request.uri.path(),
            client.client_ip,
            &client.plan,
            ClientKeys::Identity(identity),
            cost,
        )
    }
}
