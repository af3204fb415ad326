//! The configuration file as written (SPEC §5): every field has a default, unknown fields are
//! errors. Values that need checking stay strings here and are validated, with their field
//! path, in `config/mod.rs`.

// Each field mirrors SPEC §5 one to one (same name, same meaning), where it is documented, and
// `config/gateway.example.yaml` comments every one of them.
#![allow(missing_docs)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The upstream when `upstream` is absent (and the proxy served).
pub(super) const DEFAULT_UPSTREAM: &str = "http://127.0.0.1:3000";

/// The whole file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    pub listen: String,
    pub admin: RawAdmin,
    pub server: super::server::RawServer,
    /// Absent in an RLS-only deployment: then the proxy is not served (its `listen` is not
    /// bound), unless `routes` name upstreams of their own.
    pub upstream: Option<String>,
    pub upstream_timeout: String,
    pub listen_tls: Option<super::tls::RawListenTls>,
    pub upstream_tls: Option<super::tls::RawUpstreamTls>,
    pub upstream_protocol: String,
    pub routes: Vec<RawRoute>,
    pub store: RawStore,
    pub on_store_error: String,
    pub identity: RawIdentity,
    pub clients: RawClients,
    pub plans: BTreeMap<String, RawPlan>,
    pub per_ip: Vec<RawLimit>,
    pub global: BTreeMap<String, Vec<RawLimit>>,
    pub rollout: RawRollout,
    pub allowlist: RawLists,
    pub denylist: RawLists,
    pub response: RawResponse,
    pub rls: Option<super::rls::RawRls>,
    pub access_log: Option<super::operations::RawAccessLog>,
}

impl Default for RawConfig {
    fn default() -> Self {
        RawConfig {
            listen: "0.0.0.0:8080".to_owned(),
            admin: RawAdmin::default(),
            server: Default::default(),
            upstream: None,
            upstream_timeout: "30s".to_owned(),
            listen_tls: None,
            upstream_tls: None,
            upstream_protocol: "auto".to_owned(),
            routes: Vec::new(),
            store: RawStore::default(),
            on_store_error: "open".to_owned(),
            identity: RawIdentity::default(),
            clients: RawClients::default(),
            plans: BTreeMap::new(),
            per_ip: Vec::new(),
            global: BTreeMap::new(),
            rollout: RawRollout::default(),
            allowlist: RawLists::default(),
            denylist: RawLists::default(),
            response: RawResponse::default(),
            rls: None,
            access_log: None,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawAdmin {
    pub listen: String,
    pub overrides: super::operations::RawOverrides,
}

impl Default for RawAdmin {
    fn default() -> Self {
        RawAdmin {
            listen: "127.0.0.1:9090".to_owned(),
            overrides: Default::default(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    #[serde(rename = "match")]
    pub pattern: String,
    #[serde(default)]
    pub upstream: Option<String>,
    #[serde(default)]
    pub cost: Option<u64>,
    /// A response header holding the request's real cost (SPEC §9), post-charged.
    #[serde(default)]
    pub cost_header: Option<String>,
    /// Whether the client still sees `cost_header` (default false: removed).
    #[serde(default)]
    pub cost_header_visible: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawStore {
    pub backend: String,
    pub url: String,
    pub nodes: Vec<String>,
    /// `multiplexed` (one pipelined connection, the default: measured faster) or `pool`.
    pub connection: String,
    pub pool_size: usize,
    pub timeout: String,
    pub prefix: String,
    pub breaker: RawBreaker,
    pub sync_interval: Option<String>,
    /// Sync interval of the `global` ceilings (hot keys) when the rest is exact, or `exact`.
    pub global_sync_interval: String,
    /// Batched mode: most identities' limits cached at once (a bounded buffer while Redis is
    /// unreachable).
    pub max_keys: usize,
    /// Exact mode: a denial remembered and repeated locally until its wait is over.
    pub deny_cache: bool,
    /// Exact mode: most calls out per node before decisions are coalesced (0: never).
    pub coalesce: usize,
    /// Exact mode: identities above a decision rate on a node decided from leases.
    pub hot_identities: Option<RawHotIdentities>,
    /// Redis Sentinel: the master's name and the sentinels' URLs (replaces `url`).
    pub sentinel: Option<RawSentinel>,
    pub fallback_share: f64,
    /// This deployment's share of every limit (a region's fixed share of a global limit).
    pub share: f64,
}

impl Default for RawStore {
    fn default() -> Self {
        RawStore {
            backend: "memory".to_owned(),
            url: "redis://127.0.0.1:6379".to_owned(),
            nodes: Vec::new(),
            connection: "multiplexed".to_owned(),
            pool_size: 16,
            timeout: "50ms".to_owned(),
            prefix: "fg".to_owned(),
            breaker: RawBreaker::default(),
            sync_interval: None,
            global_sync_interval: "100ms".to_owned(),
            max_keys: 1_000_000,
            deny_cache: true,
            coalesce: 2,
            hot_identities: None,
            sentinel: None,
            fallback_share: 1.0,
            share: 1.0,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawSentinel {
    pub master: String,
    pub nodes: Vec<String>,
}

/// `store.hot_identities`: `{ above: 500/s, interval: 50ms }`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawHotIdentities {
    /// A decision rate on one node, `<n>/s`, `<n>/m` or `<n>/<duration>`.
    pub above: String,
    /// How long a rate is measured over (and the leases' trading interval).
    #[serde(default = "default_hot_interval")]
    pub interval: String,
}

fn default_hot_interval() -> String {
    "50ms".to_owned()
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawBreaker {
    pub failures: u32,
    pub open_for: String,
}

impl Default for RawBreaker {
    fn default() -> Self {
        RawBreaker {
            failures: 5,
            open_for: "2s".to_owned(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawIdentity {
    pub api_key: RawApiKey,
    /// Off unless configured: a header that lets a client pick its user is opt-in.
    pub user_header: Option<String>,
    /// Off unless configured, like `user_header`.
    pub plan_header: Option<String>,
    pub trusted_proxies: Vec<String>,
    pub forwarded: String,
    pub ipv6_prefix: u8,
}

impl Default for RawIdentity {
    fn default() -> Self {
        RawIdentity {
            api_key: RawApiKey::default(),
            user_header: None,
            plan_header: None,
            trusted_proxies: Vec::new(),
            forwarded: "x-forwarded-for".to_owned(),
            ipv6_prefix: 64,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawApiKey {
    pub header: String,
    pub bearer: bool,
}

impl Default for RawApiKey {
    fn default() -> Self {
        RawApiKey {
            header: "x-api-key".to_owned(),
            bearer: true,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawClients {
    pub default_plan: String,
    pub anonymous_plan: String,
    pub unknown_keys: String,
    pub api_keys: BTreeMap<String, String>,
}

impl Default for RawClients {
    fn default() -> Self {
        RawClients {
            default_plan: "free".to_owned(),
            anonymous_plan: "anonymous".to_owned(),
            unknown_keys: "default_plan".to_owned(),
            api_keys: BTreeMap::new(),
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawPlan {
    pub limits: Vec<RawLimit>,
    pub endpoints: BTreeMap<String, Vec<RawLimit>>,
    /// Overrides the top-level `on_store_error` for this plan's rules.
    pub on_store_error: Option<String>,
    /// Overrides the top-level `rollout` for this plan (shadow one plan while enforcing others).
    pub rollout: Option<RawRollout>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    pub name: String,
    pub algorithm: String,
    pub limit: u64,
    #[serde(default)]
    pub window: Option<String>,
    #[serde(default)]
    pub burst: Option<u64>,
    #[serde(default)]
    pub cost: Option<u64>,
    /// A response header holding the request's real cost (SPEC §9), post-charged.
    #[serde(default)]
    pub cost_header: Option<String>,
    /// Whether the client still sees `cost_header` (default false: removed).
    #[serde(default)]
    pub cost_header_visible: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRollout {
    pub mode: String,
    pub enforce_percent: f64,
}

impl Default for RawRollout {
    fn default() -> Self {
        RawRollout {
            mode: "enforce".to_owned(),
            enforce_percent: 100.0,
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLists {
    pub ips: Vec<String>,
    pub api_keys: Vec<String>,
    pub users: Vec<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawResponse {
    pub headers: String,
    pub retry_after_jitter: f64,
    pub docs_url: Option<String>,
    pub problem_json: bool,
}

impl Default for RawResponse {
    fn default() -> Self {
        RawResponse {
            headers: "both".to_owned(),
            retry_after_jitter: 0.2,
            docs_url: None,
            problem_json: false,
        }
    }
}
