//! Which limits apply to a request, and under which storage keys.

use std::sync::Arc;

pub use crate::key::storage::check_key_prefix;

use crate::error::BuildError;
use crate::key::storage::RecentKeys;
use crate::key::{Identity, IdentityScope, RequestInfo, storage_key};
use crate::limit::{Limit, is_valid_name};
use crate::route::{RoutePattern, RouteTable};
use crate::store::Check;

/// Checks a rule name: 1 to 64 characters among `A-Z a-z 0-9 - _ .` (rules name counters in
/// keys, metric labels and logs), as limit names are.
pub fn check_rule_name(rule: &str) -> Result<(), BuildError> {
    if is_valid_name(rule) {
        Ok(())
    } else {
        Err(BuildError::InvalidRule(rule.to_owned()))
    }
}

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
    keys: Arc<RecentKeys>,
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
            keys: Arc::new(RecentKeys::new()),
        }
    }

    /// The limits.
    pub fn limits(&self) -> &[Arc<Limit>] {
        &self.limits
    }
}

impl LimitPlan for StaticPlan {
    fn checks(&self, _request: &RequestInfo<'_>, identity: &Identity, cost: u64) -> Vec<Check> {
        let keys = self.keys.get_or_make(identity, || {
            let hash = identity.hash();
            self.limits
                .iter()
                .map(|limit| {
                    storage_key(
                        &self.prefix,
                        identity.scope(),
                        &hash,
                        &self.rule,
                        limit.name(),
                    )
                })
                .collect()
        });
        self.limits
            .iter()
            .zip(keys.iter())
            .map(|(limit, key)| {
                Check::new(key.clone(), limit.clone(), cost).with_rule(self.rule.clone())
            })
            .collect()
    }
}

/// Whom a per-route limit counts: the client's identity, or its IP address whatever key it
/// presents (a login limit keyed by IP cannot be dodged by inventing API keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteKey {
    /// The request's identity (API key, user, or IP for anonymous clients).
    Client,
    /// The client's IP address (grouped as the identifier groups IPv6).
    Ip,
}

/// Why a [`TieredPlan`] could not be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A route pattern is not `"METHOD /path"` or `"/path"` ([`crate::route`]), or could
    /// match the same requests as an earlier route.
    #[error("routes[{index}]: {reason}")]
    InvalidRoute {
        /// Position of the route.
        index: usize,
        /// The pattern.
        pattern: String,
        /// What is wrong with it (naming the pattern, or the part of it at fault).
        reason: String,
    },
    /// An API key names a tier that was not declared with `tier`.
    #[error("api_keys: tier `{0}` is not declared (TieredPlanBuilder::tier)")]
    UnknownTier(String),
    /// Two limits of one group share a name (names key the counters).
    #[error("{group}: limit `{name}` appears twice")]
    DuplicateLimitName {
        /// `per_ip`, `anonymous`, `keyed`, `tiers.<name>` or `routes[<index>]`.
        group: String,
        /// The name.
        name: String,
    },
    /// Nothing would ever be limited.
    #[error("plan: no limits at all")]
    Empty,
}

type TierOf = dyn Fn(&Identity) -> Option<String> + Send + Sync;

/// Tiers of clients, per-route limits and per-IP ceilings in one all-or-nothing decision: the
/// shape of most public APIs, and the gateway's semantics, without a hand-written
/// [`LimitPlan`]. Checks go in SPEC §1's order: per IP, then the client's tier, then the route.
///
/// ```
/// use std::time::Duration;
/// use floodgate::key::DefaultIdentifier;
/// use floodgate::plan::{RouteKey, TieredPlan};
/// use floodgate::{Limit, RateLimitLayer};
///
/// let second = Duration::from_secs(1);
/// let identifier = DefaultIdentifier::new().trusted_proxies(["10.0.0.0/8"])?;
/// let plan = TieredPlan::builder()
///     // Every request, whatever key it carries: caps clients that invent keys.
///     .per_ip([Limit::token_bucket("ip", 100, second)?])
///     // Clients identified by IP only.
///     .anonymous([Limit::token_bucket("anonymous", 5, second)?])
///     // Clients with an API key (or user id) and no tier of their own.
///     .keyed([Limit::token_bucket("free", 10, second)?])
///     .tier("pro", [Limit::gcra("pro", 1_000, second)?])
///     .api_key("pk_live_example", "pro")
///     // Five login attempts a minute per IP address.
///     .route("POST /login", RouteKey::Ip, [Limit::fixed_window("login", 5, Duration::from_secs(60))?])
///     .identifier(identifier.clone())
///     .build()?;
/// let layer = RateLimitLayer::builder().identify(identifier).plan(plan).build()?;
/// # let _ = layer;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct TieredPlan {
    prefix: Arc<str>,
    per_ip: Vec<Arc<Limit>>,
    anonymous: Vec<Arc<Limit>>,
    keyed: Vec<Arc<Limit>>,
    tiers: std::collections::HashMap<String, Vec<Arc<Limit>>>,
    api_keys: std::collections::HashMap<[u8; 32], String>,
    tier_of: Option<Arc<TierOf>>,
    routes: RouteTable<Route>,
    identifier: crate::key::DefaultIdentifier,
    rules: Rules,
}

/// The rule names of the groups, made once.
struct Rules {
    per_ip: Arc<str>,
    anonymous: Arc<str>,
    keyed: Arc<str>,
    tiers: std::collections::HashMap<String, Arc<str>>,
}

struct Route {
    key: RouteKey,
    limits: Vec<Arc<Limit>>,
    rule: Arc<str>,
}

impl std::fmt::Debug for TieredPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredPlan")
            .field("per_ip", &self.per_ip.len())
            .field("anonymous", &self.anonymous.len())
            .field("keyed", &self.keyed.len())
            .field("tiers", &self.tiers.keys().collect::<Vec<_>>())
            .field("routes", &self.routes.len())
            .finish_non_exhaustive()
    }
}

impl TieredPlan {
    /// Starts describing a plan.
    pub fn builder() -> TieredPlanBuilder {
        TieredPlanBuilder::default()
    }

    fn tier(&self, identity: &Identity) -> Option<&str> {
        if let Some(tier_of) = &self.tier_of
            && let Some(tier) = tier_of(identity)
            && let Some((name, _)) = self.tiers.get_key_value(&tier)
        {
            return Some(name);
        }
        match identity {
            Identity::ApiKey(key) => self
                .api_keys
                .get(&crate::lists::api_key_digest(key))
                .map(String::as_str),
            _ => None,
        }
    }

    fn push(
        &self,
        checks: &mut Vec<Check>,
        scope: &str,
        hash: &crate::key::IdentityHash,
        rule: &Arc<str>,
        limits: &[Arc<Limit>],
        cost: u64,
    ) {
        for limit in limits {
            let key = storage_key(&self.prefix, scope, hash, rule, limit.name());
            checks.push(Check::new(key, limit.clone(), cost).with_rule(rule.clone()));
        }
    }
}

impl LimitPlan for TieredPlan {
    fn checks(&self, request: &RequestInfo<'_>, identity: &Identity, cost: u64) -> Vec<Check> {
        let mut checks = Vec::new();
        let ip = self.identifier.client_ip_of(request);
        let ip_hash = ip.map(|ip| Identity::Ip(ip).hash());
        if let Some(ip_hash) = &ip_hash {
            self.push(
                &mut checks,
                IdentityScope::Ip.as_str(),
                ip_hash,
                &self.rules.per_ip,
                &self.per_ip,
                cost,
            );
        }
        let hash = identity.hash();
        let scope = identity.scope();
        let (rule, limits) = match identity {
            Identity::Ip(_) | Identity::Unknown => (&self.rules.anonymous, &self.anonymous),
            _ => match self.tier(identity) {
                Some(tier) => (&self.rules.tiers[tier], &self.tiers[tier]),
                None => (&self.rules.keyed, &self.keyed),
            },
        };
        self.push(&mut checks, scope, &hash, rule, limits, cost);
        let path = request.uri.path();
        if let Some((_, route)) = self.routes.find(request.method, path) {
            match (route.key, &ip_hash) {
                (RouteKey::Ip, Some(ip_hash)) => self.push(
                    &mut checks,
                    IdentityScope::Ip.as_str(),
                    ip_hash,
                    &route.rule,
                    &route.limits,
                    cost,
                ),
                _ => self.push(&mut checks, scope, &hash, &route.rule, &route.limits, cost),
            }
        }
        checks
    }
}

/// Describes a [`TieredPlan`]; [`build`](Self::build) checks it.
#[must_use]
#[derive(Default)]
pub struct TieredPlanBuilder {
    prefix: Option<String>,
    per_ip: Vec<Limit>,
    anonymous: Vec<Limit>,
    keyed: Vec<Limit>,
    tiers: Vec<(String, Vec<Limit>)>,
    api_keys: Vec<(String, String)>,
    tier_of: Option<Arc<TierOf>>,
    routes: Vec<(String, RouteKey, Vec<Limit>)>,
    identifier: Option<crate::key::DefaultIdentifier>,
}

impl TieredPlanBuilder {
    /// Limits on every request, counted per client IP (the gateway's `per_ip`).
    pub fn per_ip(mut self, limits: impl IntoIterator<Item = Limit>) -> Self {
        self.per_ip.extend(limits);
        self
    }

    /// Limits of clients identified by IP only.
    pub fn anonymous(mut self, limits: impl IntoIterator<Item = Limit>) -> Self {
        self.anonymous.extend(limits);
        self
    }

    /// Limits of clients with an API key or user id and no tier of their own.
    pub fn keyed(mut self, limits: impl IntoIterator<Item = Limit>) -> Self {
        self.keyed.extend(limits);
        self
    }

    /// A tier and its limits.
    pub fn tier(
        mut self,
        name: impl Into<String>,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Self {
        self.tiers.push((name.into(), limits.into_iter().collect()));
        self
    }

    /// Puts an API key in a tier (kept as its SHA-256 only).
    pub fn api_key(mut self, key: impl Into<String>, tier: impl Into<String>) -> Self {
        self.api_keys.push((key.into(), tier.into()));
        self
    }

    /// Picks a client's tier by code (a database lookup cached by the app, a key prefix...):
    /// consulted before the API keys; a tier it names must be declared. Closures
    /// `Fn(&Identity) -> Option<String>`.
    pub fn tier_of(
        mut self,
        tier_of: impl Fn(&Identity) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.tier_of = Some(Arc::new(tier_of));
        self
    }

    /// Limits on one route: `"POST /login"`, `"/login"` (any method) or a pattern such as
    /// `"GET /v1/orders/{id}"`, as [`crate::route`] reads and matches them.
    pub fn route(
        mut self,
        pattern: impl Into<String>,
        key: RouteKey,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Self {
        self.routes
            .push((pattern.into(), key, limits.into_iter().collect()));
        self
    }

    /// How client IPs are found (trusted proxies, IPv6 grouping) for `per_ip` and
    /// [`RouteKey::Ip`]: pass the identifier the layer uses (default: the socket peer).
    pub fn identifier(mut self, identifier: crate::key::DefaultIdentifier) -> Self {
        self.identifier = Some(identifier);
        self
    }

    /// The storage key prefix (default `fg`).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Some(prefix.into());
        self
    }

    /// Checks the description and builds the plan.
    pub fn build(self) -> Result<TieredPlan, PlanError> {
        fn group(name: String, limits: Vec<Limit>) -> Result<Vec<Arc<Limit>>, PlanError> {
            let mut seen = std::collections::HashSet::new();
            for limit in &limits {
                if !seen.insert(limit.name().to_owned()) {
                    return Err(PlanError::DuplicateLimitName {
                        group: name,
                        name: limit.name().to_owned(),
                    });
                }
            }
            Ok(limits.into_iter().map(Arc::new).collect())
        }
        let mut tiers = std::collections::HashMap::new();
        let mut tier_rules = std::collections::HashMap::new();
        for (name, limits) in self.tiers {
            tier_rules.insert(name.clone(), Arc::from(format!("tier.{name}")));
            tiers.insert(name.clone(), group(format!("tiers.{name}"), limits)?);
        }
        let mut api_keys = std::collections::HashMap::new();
        for (key, tier) in self.api_keys {
            if !tiers.contains_key(&tier) {
                return Err(PlanError::UnknownTier(tier));
            }
            api_keys.insert(crate::lists::api_key_digest(&key), tier);
        }
        let mut routes = RouteTable::default();
        for (index, (pattern, key, limits)) in self.routes.into_iter().enumerate() {
            let invalid = |reason: String| PlanError::InvalidRoute {
                index,
                pattern: pattern.clone(),
                reason,
            };
            let parsed =
                RoutePattern::parse(&pattern).map_err(|error| invalid(error.to_string()))?;
            let route = Route {
                key,
                limits: group(format!("routes[{index}]"), limits)?,
                rule: Arc::from(format!("route.{index}")),
            };
            routes
                .insert(parsed, route)
                .map_err(|error| invalid(error.to_string()))?;
        }
        let plan = TieredPlan {
            prefix: Arc::from(self.prefix.as_deref().unwrap_or("fg")),
            per_ip: group("per_ip".to_owned(), self.per_ip)?,
            anonymous: group("anonymous".to_owned(), self.anonymous)?,
            keyed: group("keyed".to_owned(), self.keyed)?,
            tiers,
            api_keys,
            tier_of: self.tier_of,
            routes,
            identifier: self.identifier.unwrap_or_default(),
            rules: Rules {
                per_ip: Arc::from("per_ip"),
                anonymous: Arc::from("anonymous"),
                keyed: Arc::from("keyed"),
                tiers: tier_rules,
            },
        };
        let empty = plan.per_ip.is_empty()
            && plan.anonymous.is_empty()
            && plan.keyed.is_empty()
            && plan.tiers.values().all(Vec::is_empty)
            && plan
                .routes
                .entries()
                .all(|(_, route)| route.limits.is_empty());
        if empty {
            return Err(PlanError::Empty);
        }
        Ok(plan)
    }
}
