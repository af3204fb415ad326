//! The configuration file as written (SPEC §5): every field has a default, unknown fields are
//! errors. Values that need checking stay strings here and are validated, with their field
//! path, in `config/mod.rs`.

// Each field mirrors SPEC §5 one to one (same name, same meaning), where it is documented, and
// `config/gateway.example.yaml` comments every one of them.
#![allow(missing_docs)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

fn default_listen() -> String {
    "0.0.0.0:8080".to_owned()
}
fn default_admin_listen() -> String {
    "127.0.0.1:9090".to_owned()
}
/// The upstream when `upstream` is absent (and the proxy served).
pub(super) const DEFAULT_UPSTREAM: &str = "http://127.0.0.1:3000";
fn default_upstream_timeout() -> String {
    "30s".to_owned()
}
fn default_backend() -> String {
    "memory".to_owned()
}
fn default_redis_url() -> String {
    "redis://127.0.0.1:6379".to_owned()
}
fn default_connection() -> String {
    "multiplexed".to_owned()
}
fn default_pool_size() -> usize {
    16
}
fn default_store_timeout() -> String {
    "50ms".to_owned()
}
fn default_prefix() -> String {
    "fg".to_owned()
}
fn default_failures() -> u32 {
    5
}
fn default_open_for() -> String {
    "2s".to_owned()
}
fn default_share() -> f64 {
    1.0
}
fn default_policy() -> String {
    "open".to_owned()
}
fn default_api_key_header() -> String {
    "x-api-key".to_owned()
}
fn default_true() -> bool {
    true
}
fn default_upstream_protocol() -> String {
    "auto".to_owned()
}
fn default_forwarded() -> String {
    "x-forwarded-for".to_owned()
}
fn default_unknown_keys() -> String {
    "default_plan".to_owned()
}
fn default_ipv6_prefix() -> u8 {
    64
}
fn default_plan() -> String {
    "free".to_owned()
}
fn default_anonymous_plan() -> String {
    "anonymous".to_owned()
}
fn default_mode() -> String {
    "enforce".to_owned()
}
fn default_percent() -> f64 {
    100.0
}
fn default_headers() -> String {
    "both".to_owned()
}
fn default_jitter() -> f64 {
    0.2
}

/// The whole file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default = "default_listen")]
    pub listen: String,
    #[serde(default)]
    pub admin: RawAdmin,
    #[serde(default)]
    pub server: super::server::RawServer,
    /// Absent in an RLS-only deployment: then the proxy is not served (its `listen` is not
    /// bound), unless `routes` name upstreams of their own.
    #[serde(default)]
    pub upstream: Option<String>,
    #[serde(default = "default_upstream_timeout")]
    pub upstream_timeout: String,
    #[serde(default)]
    pub listen_tls: Option<super::tls::RawListenTls>,
    #[serde(default)]
    pub upstream_tls: Option<super::tls::RawUpstreamTls>,
    #[serde(default = "default_upstream_protocol")]
    pub upstream_protocol: String,
    #[serde(default)]
    pub routes: Vec<RawRoute>,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default = "default_policy")]
    pub on_store_error: String,
    #[serde(default)]
    pub identity: RawIdentity,
    #[serde(default)]
    pub clients: RawClients,
    #[serde(default)]
    pub plans: BTreeMap<String, RawPlan>,
    #[serde(default)]
    pub per_ip: Vec<RawLimit>,
    #[serde(default)]
    pub global: BTreeMap<String, Vec<RawLimit>>,
    #[serde(default)]
    pub rollout: RawRollout,
    #[serde(default)]
    pub allowlist: RawLists,
    #[serde(default)]
    pub denylist: RawLists,
    #[serde(default)]
    pub response: RawResponse,
    #[serde(default)]
    pub rls: Option<super::rls::RawRls>,
    #[serde(default)]
    pub access_log: Option<super::operations::RawAccessLog>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmin {
    #[serde(default = "default_admin_listen")]
    pub listen: String,
    #[serde(default)]
    pub overrides: super::operations::RawOverrides,
}

impl Default for RawAdmin {
    fn default() -> Self {
        RawAdmin {
            listen: default_admin_listen(),
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
#[serde(deny_unknown_fields)]
pub struct RawStore {
    #[serde(default = "default_backend")]
    pub backend: String,
    #[serde(default = "default_redis_url")]
    pub url: String,
    #[serde(default)]
    pub nodes: Vec<String>,
    /// `multiplexed` (one pipelined connection, the default: measured faster) or `pool`.
    #[serde(default = "default_connection")]
    pub connection: String,
    #[serde(default = "default_pool_size")]
    pub pool_size: usize,
    #[serde(default = "default_store_timeout")]
    pub timeout: String,
    #[serde(default = "default_prefix")]
    pub prefix: String,
    #[serde(default)]
    pub breaker: RawBreaker,
    #[serde(default)]
    pub sync_interval: Option<String>,
    /// Sync interval of the `global` ceilings (hot keys) when the rest is exact, or `exact`.
    #[serde(default = "default_global_sync_interval")]
    pub global_sync_interval: String,
    /// Batched mode: most identities' limits cached at once (a bounded buffer while Redis is
    /// unreachable).
    #[serde(default = "default_max_keys")]
    pub max_keys: usize,
    /// Exact mode: a denial remembered and repeated locally until its wait is over.
    #[serde(default = "default_true")]
    pub deny_cache: bool,
    /// Exact mode: most calls out per node before decisions are coalesced (0: never).
    #[serde(default = "default_coalesce")]
    pub coalesce: usize,
    /// Exact mode: identities above a decision rate on a node decided from leases.
    #[serde(default)]
    pub hot_identities: Option<RawHotIdentities>,
    /// Redis Sentinel: the master's name and the sentinels' URLs (replaces `url`).
    #[serde(default)]
    pub sentinel: Option<RawSentinel>,
    #[serde(default = "default_share")]
    pub fallback_share: f64,
    /// This deployment's share of every limit (a region's fixed share of a global limit).
    #[serde(default = "default_share")]
    pub share: f64,
}

impl Default for RawStore {
    fn default() -> Self {
        RawStore {
            backend: default_backend(),
            url: default_redis_url(),
            nodes: Vec::new(),
            connection: default_connection(),
            pool_size: default_pool_size(),
            timeout: default_store_timeout(),
            prefix: default_prefix(),
            breaker: RawBreaker::default(),
            sync_interval: None,
            global_sync_interval: default_global_sync_interval(),
            max_keys: default_max_keys(),
            deny_cache: true,
            coalesce: default_coalesce(),
            hot_identities: None,
            sentinel: None,
            fallback_share: default_share(),
            share: default_share(),
        }
    }
}

fn default_max_keys() -> usize {
    1_000_000
}

fn default_coalesce() -> usize {
    2
}

fn default_global_sync_interval() -> String {
    "100ms".to_owned()
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
#[serde(deny_unknown_fields)]
pub struct RawBreaker {
    #[serde(default = "default_failures")]
    pub failures: u32,
    #[serde(default = "default_open_for")]
    pub open_for: String,
}

impl Default for RawBreaker {
    fn default() -> Self {
        RawBreaker {
            failures: default_failures(),
            open_for: default_open_for(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawIdentity {
    #[serde(default)]
    pub api_key: RawApiKey,
    /// Off unless configured: a header that lets a client pick its user is opt-in.
    #[serde(default)]
    pub user_header: Option<String>,
    /// Off unless configured, like `user_header`.
    #[serde(default)]
    pub plan_header: Option<String>,
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    #[serde(default = "default_forwarded")]
    pub forwarded: String,
    #[serde(default = "default_ipv6_prefix")]
    pub ipv6_prefix: u8,
}

impl Default for RawIdentity {
    fn default() -> Self {
        RawIdentity {
            api_key: RawApiKey::default(),
            user_header: None,
            plan_header: None,
            trusted_proxies: Vec::new(),
            forwarded: default_forwarded(),
            ipv6_prefix: default_ipv6_prefix(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawApiKey {
    #[serde(default = "default_api_key_header")]
    pub header: String,
    #[serde(default = "default_true")]
    pub bearer: bool,
}

impl Default for RawApiKey {
    fn default() -> Self {
        RawApiKey {
            header: default_api_key_header(),
            bearer: true,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawClients {
    #[serde(default = "default_plan")]
    pub default_plan: String,
    #[serde(default = "default_anonymous_plan")]
    pub anonymous_plan: String,
    #[serde(default = "default_unknown_keys")]
    pub unknown_keys: String,
    #[serde(default)]
    pub api_keys: BTreeMap<String, String>,
}

impl Default for RawClients {
    fn default() -> Self {
        RawClients {
            default_plan: default_plan(),
            anonymous_plan: default_anonymous_plan(),
            unknown_keys: default_unknown_keys(),
            api_keys: BTreeMap::new(),
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlan {
    #[serde(default)]
    pub limits: Vec<RawLimit>,
    #[serde(default)]
    pub endpoints: BTreeMap<String, Vec<RawLimit>>,
    /// Overrides the top-level `on_store_error` for this plan's rules.
    #[serde(default)]
    pub on_store_error: Option<String>,
    /// Overrides the top-level `rollout` for this plan (shadow one plan while enforcing others).
    #[serde(default)]
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
#[serde(deny_unknown_fields)]
pub struct RawRollout {
    #[serde(default = "default_mode")]
    pub mode: String,
    #[serde(default = "default_percent")]
    pub enforce_percent: f64,
}

impl Default for RawRollout {
    fn default() -> Self {
        RawRollout {
            mode: default_mode(),
            enforce_percent: default_percent(),
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLists {
    #[serde(default)]
    pub ips: Vec<String>,
    #[serde(default)]
    pub api_keys: Vec<String>,
    #[serde(default)]
    pub users: Vec<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawResponse {
    #[serde(default = "default_headers")]
    pub headers: String,
    #[serde(default = "default_jitter")]
    pub retry_after_jitter: f64,
    #[serde(default)]
    pub docs_url: Option<String>,
    #[serde(default)]
    pub problem_json: bool,
}

impl Default for RawResponse {
    fn default() -> Self {
        RawResponse {
            headers: default_headers(),
            retry_after_jitter: default_jitter(),
            docs_url: None,
            problem_json: false,
        }
    }
}
