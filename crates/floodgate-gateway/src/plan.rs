//! Which limits a request meets, in SPEC §1's fixed order: global ceilings, then per IP, then
//! the client's plan, then the plan's endpoint limits.

use std::sync::Arc;

use floodgate::key::storage_key;
use floodgate::{Check, Identity, LimitPlan, RequestInfo};

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

impl LimitPlan for GatewayPlan {
    fn checks(&self, request: &RequestInfo<'_>, identity: &Identity, cost: u64) -> Vec<Check> {
        let Some(client) = request.extensions.get::<ResolvedClient>() else {
            return Vec::new();
        };
        if client.bypass {
            return Vec::new();
        }
        let config = &self.config;
        let prefix = config.store.prefix.as_str();
        let path = request.uri.path();
        let mut checks = Vec::new();

        if let Some((endpoint, global)) = config.global.find(request.method, path) {
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
        if let Some(ip) = client.client_ip
            && !config.per_ip.is_empty()
        {
            let hash = Identity::Ip(ip).hash();
            for limit in &config.per_ip {
                let key = storage_key(prefix, "ip", &hash, PER_IP_RULE, limit.name());
                checks
                    .push(Check::new(key, limit.clone(), cost).with_rule(self.per_ip_rule.clone()));
            }
        }
        if let Some(plan) = config.plans.get(&*client.plan) {
            let endpoint = plan.endpoints.find(request.method, path);
            if plan.limits.is_empty() && endpoint.is_none() {
                return checks;
            }
            let hash = identity.hash();
            let scope = identity.scope();
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
