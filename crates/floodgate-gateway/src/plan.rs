//! Which limits a request meets, in SPEC §1's fixed order: global ceilings, then per IP, then
//! the client's plan, then the plan's endpoint limits.

use std::sync::Arc;

use floodgate::key::storage_key;
use floodgate::{Check, Identity, LimitPlan, RequestInfo};

use crate::client::ResolvedClient;
use crate::config::Config;

/// The gateway's limit plan for one configuration version.
#[derive(Debug)]
pub struct GatewayPlan {
    config: Arc<Config>,
}

impl GatewayPlan {
    /// The plan of `config`.
    pub fn new(config: Arc<Config>) -> Self {
        GatewayPlan { config }
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

        if let Some((endpoint, limits)) = config.global.find(request.method, path) {
            let id = endpoint.key_id();
            let hash = Identity::Custom {
                scope: Arc::from("global"),
                value: id.clone(),
            }
            .hash();
            let rule: Arc<str> = Arc::from(format!("global.{id}"));
            for limit in limits {
                let key = storage_key(prefix, "global", &hash, &rule, limit.name());
                checks.push(Check::new(key, limit.clone(), cost).with_rule(rule.clone()));
            }
        }
        if let Some(ip) = client.client_ip {
            let ip_identity = Identity::Ip(ip);
            let hash = ip_identity.hash();
            let rule: Arc<str> = Arc::from("per_ip");
            for limit in &config.per_ip {
                let key = storage_key(prefix, "ip", &hash, &rule, limit.name());
                checks.push(Check::new(key, limit.clone(), cost).with_rule(rule.clone()));
            }
        }
        if let Some(plan) = config.plans.get(&*client.plan) {
            let hash = identity.hash();
            let scope = identity.scope();
            let rule: Arc<str> = Arc::from(format!("plan.{}", client.plan));
            for limit in &plan.limits {
                let key = storage_key(prefix, scope, &hash, &rule, limit.name());
                checks.push(Check::new(key, limit.clone(), cost).with_rule(rule.clone()));
            }
            if let Some((endpoint, limits)) = plan.endpoints.find(request.method, path) {
                let rule: Arc<str> =
                    Arc::from(format!("plan.{}.{}", client.plan, endpoint.key_id()));
                for limit in limits {
                    let key = storage_key(prefix, scope, &hash, &rule, limit.name());
                    checks.push(Check::new(key, limit.clone(), cost).with_rule(rule.clone()));
                }
            }
        }
        checks
    }
}
