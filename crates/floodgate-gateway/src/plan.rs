//! Which limits a request meets, in SPEC §1's fixed order: global ceilings, then per IP, then
//! the client's plan, then the plan's endpoint limits.

use std::net::IpAddr;
use std::sync::Arc;

use floodgate::key::storage_key;
use floodgate::{Check, Identity, IdentityHash, LimitPlan, RequestInfo};
use http::Method;

use crate::client::ResolvedClient;
use crate::config::Config;

/// The rule of `per_ip` limits.
const PER_IP_RULE: &str = "per_ip";

/// The gateway's limit plan for one configuration version.
#[derive(Debug)]
pub struct GatewayPlan {
    config: Arc<Config>,
    per_ip_rule: Arc<str>,
}

impl GatewayPlan {
    /// The plan of `config`.
    pub fn new(config: Arc<Config>) -> Self {
        GatewayPlan {
            config,
            per_ip_rule: Arc::from(PER_IP_RULE),
        }
    }
}

/// Who a client is as far as storage keys go.
#[derive(Clone, Copy, Debug)]
pub enum ClientKeys<'a> {
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
    pub fn client_checks(
        &self,
        method: &Method,
        path: &str,
        client_ip: Option<IpAddr>,
        plan: &str,
        client: ClientKeys<'_>,
        cost: u64,
    ) -> Vec<Check> {
        let config = &self.config;
        let prefix = config.store.prefix.as_str();
        let mut checks = Vec::new();

        if let Some((endpoint, global)) = config.global.find(method, path) {
            // One counter for all clients: the endpoint is the identity.
            let hash = Identity::Custom {
                scope: Arc::from("global"),
                value: endpoint.key_id(),
            }
            .hash();
            for limit in &global.limits {
                let key = storage_key(prefix, "global", &hash, &global.rule, limit.name());
                checks.push(Check::new(key, limit.clone(), cost).with_rule(global.rule.clone()));
            }
        }
        if let Some(ip) = client_ip
            && !config.per_ip.is_empty()
        {
            let hash = Identity::Ip(ip).hash();
            for limit in &config.per_ip {
                let key = storage_key(prefix, "ip", &hash, PER_IP_RULE, limit.name());
                checks
                    .push(Check::new(key, limit.clone(), cost).with_rule(self.per_ip_rule.clone()));
            }
        }
        if let Some(plan) = config.plans.get(plan) {
            let endpoint = plan.endpoints.find(method, path);
            if plan.limits.is_empty() && endpoint.is_none() {
                return checks;
            }
            let (hash, scope) = client.hash_and_scope();
            for limit in &plan.limits {
                let key = storage_key(prefix, scope, &hash, &plan.rule, limit.name());
                checks.push(Check::new(key, limit.clone(), cost).with_rule(plan.rule.clone()));
            }
            if let Some((_, endpoint)) = endpoint {
                for limit in &endpoint.limits {
                    let key = storage_key(prefix, scope, &hash, &endpoint.rule, limit.name());
                    checks.push(
                        Check::new(key, limit.clone(), cost).with_rule(endpoint.rule.clone()),
                    );
                }
            }
        }
        checks
    }
}

impl GatewayPlan {
    /// Every check a client of `plan` at `client_ip` can meet, on any endpoint: its `per_ip`
    /// limits (when the IP is known), its plan's limits and every endpoint limit of its plan, at
    /// cost 1. Global ceilings are every client's, and not among them. What an operator's reset
    /// of a client clears.
    pub fn all_client_checks(
        &self,
        client_ip: Option<IpAddr>,
        plan: &str,
        client: ClientKeys<'_>,
    ) -> Vec<Check> {
        let config = &self.config;
        let prefix = config.store.prefix.as_str();
        let mut checks = Vec::new();
        if let Some(ip) = client_ip {
            let hash = Identity::Ip(ip).hash();
            for limit in &config.per_ip {
                let key = storage_key(prefix, "ip", &hash, PER_IP_RULE, limit.name());
                checks.push(Check::new(key, limit.clone(), 1).with_rule(self.per_ip_rule.clone()));
            }
        }
        let Some(plan) = config.plans.get(plan) else {
            return checks;
        };
        let (hash, scope) = client.hash_and_scope();
        let endpoint_limits = plan.endpoints.entries().flat_map(|(_, endpoint)| {
            endpoint
                .limits
                .iter()
                .map(move |limit| (&endpoint.rule, limit))
        });
        for (rule, limit) in plan
            .limits
            .iter()
            .map(|limit| (&plan.rule, limit))
            .chain(endpoint_limits)
        {
            let key = storage_key(prefix, scope, &hash, rule, limit.name());
            checks.push(Check::new(key, limit.clone(), 1).with_rule(rule.clone()));
        }
        checks
    }
}

/// Whether `check` is a `global` ceiling: one counter every client writes.
pub fn is_global_ceiling(check: &Check) -> bool {
    floodgate::key::storage::scope(&check.key) == Some("global")
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
