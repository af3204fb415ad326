//! Which limits apply to a request, and under which storage keys.

use std::sync::Arc;

use crate::key::{Identity, RequestInfo, storage_key};
use crate::limit::Limit;
use crate::store::Check;

/// Decides which limits a request is checked against. The layer's builder makes a
/// [`StaticPlan`]; the gateway plugs in its own (plans, endpoints, global ceilings).
pub trait LimitPlan: Send + Sync + 'static {
    /// The checks for a request from `identity` costing `cost`; none means unlimited.
    fn checks(&self, request: &RequestInfo<'_>, identity: &Identity, cost: u64) -> Vec<Check>;
}

/// The same limits for every request, counted per identity.
#[derive(Clone, Debug)]
pub struct StaticPlan {
    prefix: Arc<str>,
    rule: Arc<str>,
    limits: Vec<Arc<Limit>>,
}

impl StaticPlan {
    /// `limits` under rule `rule`, keys prefixed with `prefix`.
    pub fn new(
        prefix: impl Into<Arc<str>>,
        rule: impl Into<Arc<str>>,
        limits: Vec<Arc<Limit>>,
    ) -> Self {
        StaticPlan {
            prefix: prefix.into(),
            rule: rule.into(),
            limits,
        }
    }

    /// The limits.
    pub fn limits(&self) -> &[Arc<Limit>] {
        &self.limits
    }
}

impl LimitPlan for StaticPlan {
    fn checks(&self, _request: &RequestInfo<'_>, identity: &Identity, cost: u64) -> Vec<Check> {
        let hash = identity.hash();
        self.limits
            .iter()
            .map(|limit| {
                let key = storage_key(
                    &self.prefix,
                    identity.scope(),
                    &hash,
                    &self.rule,
                    limit.name(),
                );
                Check::new(key, limit.clone(), cost).with_rule(self.rule.clone())
            })
            .collect()
    }
}
