//! The gateway configuration (SPEC §5): parsed from YAML, then validated into library types.
//! Every error carries its field path (`plans.free.limits[1].window: must be greater than 0`);
//! `load` returns all of them, never a partial configuration, and never panics.

mod duration;
mod endpoints;
mod raw;
mod rls;
mod server;
mod tls;

pub use duration::{format_duration, parse_duration};
pub use endpoints::{Endpoint, EndpointTable};
pub use raw::RawConfig;
pub use rls::RlsSettings;
pub use server::{DESCRIPTOR_RESERVE, ServerLimits, open_file_limit};
pub use tls::{ListenTls, UpstreamProtocol};

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use floodgate::key::DefaultIdentifier;
use floodgate::{ClientList, FailurePolicy, HeaderStyle, Limit};
use http::Uri;
use http::header::HeaderName;
use ipnet::IpNet;

use raw::{RawLimit, RawLists};

/// One problem in a configuration file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// Where: `plans.free.limits[1].window`, or empty for the file as a whole.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Every problem found in a configuration file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, error) in self.0.iter().enumerate() {
            if index > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Where requests go upstream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upstream {
    /// `http` or `https`.
    pub scheme: http::uri::Scheme,
    /// `host:port`.
    pub authority: http::uri::Authority,
}

/// What a route sets for matching requests.
#[derive(Clone, Debug)]
pub struct RouteTarget {
    /// The upstream, if not the default.
    pub upstream: Option<Upstream>,
    /// The request cost, if not 1.
    pub cost: Option<u64>,
    /// The upstream's response header that reports the request's real cost (SPEC §9), and
    /// whether the client still sees it.
    pub cost_header: Option<(http::HeaderName, bool)>,
}

/// Which store backs the limits.
#[derive(Clone, Debug, PartialEq)]
pub enum Backend {
    /// In-process memory (one node).
    Memory,
    /// One Redis server shared by all gateways.
    Redis {
        /// `redis://host:port/db`.
        url: String,
        /// `None`: one multiplexed connection; `Some(n)`: a pool of n connections.
        pool_size: Option<usize>,
    },
    /// Independent Redis nodes, identities placed by rendezvous hashing.
    RedisSharded {
        /// `redis://` URLs; every gateway must list the same ones.
        nodes: Vec<String>,
        /// As for `Redis`, per node.
        pool_size: Option<usize>,
    },
    /// A Redis Cluster, reached through these seed nodes.
    RedisCluster {
        /// `redis://` URLs of some of its masters.
        nodes: Vec<String>,
        /// `None`: one multiplexed cluster connection; `Some(n)`: deadpool's cluster pool.
        pool_size: Option<usize>,
    },
    /// The master that Redis Sentinel elects (`store.sentinel`).
    RedisSentinel {
        /// The monitored master's name.
        master: String,
        /// `redis://` URLs of the sentinels.
        sentinels: Vec<String>,
        /// As for `Redis`.
        pool_size: Option<usize>,
    },
}

impl Backend {
    /// Whether the state is shared between gateways (everything but `memory`).
    pub fn is_shared(&self) -> bool {
        !matches!(self, Backend::Memory)
    }
}

/// `store.*`.
#[derive(Clone, Debug, PartialEq)]
pub struct StoreSettings {
    /// The backend.
    pub backend: Backend,
    /// Deadline of every store call.
    pub timeout: Duration,
    /// Storage key prefix.
    pub prefix: String,
    /// Failures that open the breaker.
    pub breaker_failures: u32,
    /// How long the breaker stays open.
    pub breaker_open_for: Duration,
    /// Share of each limit a node enforces alone under `on_store_error: local`.
    pub fallback_share: f64,
    /// Batched mode: every limit decided from local counters synced on this interval.
    pub sync_interval: Option<Duration>,
    /// In exact mode on a shared store: the interval on which `global` ceilings (hot keys)
    /// run batched; `None` keeps them exact.
    pub global_sync_interval: Option<Duration>,
    /// Batched mode: most keys cached at once.
    pub max_keys: usize,
}

/// `rollout.mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RolloutMode {
    /// Limits are enforced (for `enforce_percent` of identities).
    Enforce,
    /// Counted and reported, never enforced.
    Shadow,
    /// Kill switch: no limiting and no store calls at all.
    Off,
}

/// `rollout`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rollout {
    /// The mode.
    pub mode: RolloutMode,
    /// Share of identities enforced, by stable hash; the rest are shadowed.
    pub enforce_percent: f64,
}

/// Limits on one endpoint, with the rule name their counters are kept under.
#[derive(Debug)]
pub struct EndpointLimits {
    /// `plan.<plan>.<endpoint>` or `global.<endpoint>`.
    pub rule: Arc<str>,
    /// The limits.
    pub limits: Vec<Arc<Limit>>,
}

/// One plan's limits.
#[derive(Debug, Default)]
pub struct PlanLimits {
    /// `plan.<name>`: the rule of the plan's limits in keys, metrics and logs.
    pub rule: Arc<str>,
    /// Limits on every request of the plan's clients.
    pub limits: Vec<Arc<Limit>>,
    /// Limits on particular endpoints.
    pub endpoints: EndpointTable<EndpointLimits>,
    /// The plan's own failure policy, if it overrides the global one.
    pub on_store_error: Option<FailurePolicy>,
    /// The plan's own rollout, if it overrides the global one.
    pub rollout: Option<Rollout>,
}

/// `response.*`.
#[derive(Clone, Debug)]
pub struct ResponseSettings {
    /// Header style.
    pub headers: HeaderStyle,
    /// Retry-After jitter.
    pub retry_after_jitter: f64,
    /// Docs link in 429 bodies.
    pub docs_url: Option<String>,
    /// RFC 9457 bodies.
    pub problem_json: bool,
}

/// `clients.unknown_keys`: what an API key not in `clients.api_keys` gets (SPEC §3).
///
/// Any string in the key header is an identity, so under `default_plan` a client can invent a
/// key, and a fresh budget, per request; `per_ip` limits still cap it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnknownKeys {
    /// Limited under `clients.default_plan`, as its own identity (the default).
    #[default]
    DefaultPlan,
    /// Limited as its client IP, under `clients.anonymous_plan`.
    Anonymous,
    /// Answered 401 `{"error":"unknown_api_key"}`.
    Reject,
}

impl std::str::FromStr for UnknownKeys {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "default_plan" => Ok(UnknownKeys::DefaultPlan),
            "anonymous" => Ok(UnknownKeys::Anonymous),
            "reject" => Ok(UnknownKeys::Reject),
            other => Err(format!(
                "`{other}` is not one of default_plan, anonymous, reject"
            )),
        }
    }
}

/// `identity.*` beyond what the identifier holds.
#[derive(Debug)]
pub struct IdentitySettings {
    /// The identifier (API key, user header, trusted proxies, IPv6 grouping).
    pub identifier: Arc<DefaultIdentifier>,
    /// The header a trusted proxy uses to name the client's plan.
    pub plan_header: Option<HeaderName>,
}

/// A validated configuration.
#[derive(Debug)]
pub struct Config {
    /// Proxy listen address.
    pub listen: SocketAddr,
    /// Admin listen address.
    pub admin_listen: SocketAddr,
    /// Default upstream.
    pub upstream: Upstream,
    /// Time allowed for the upstream's response head.
    pub upstream_timeout: Duration,
    /// What the listener enforces on every connection (`server.*`, read at start).
    pub server: ServerLimits,
    /// HTTPS on `listen` (read at start; the files are re-read when they change).
    pub listen_tls: Option<ListenTls>,
    /// Trust and client certificate for https upstreams.
    pub upstream_tls: crate::tls::UpstreamTls,
    /// The HTTP version spoken to upstreams.
    pub upstream_protocol: UpstreamProtocol,
    /// Per-endpoint upstream and cost.
    pub routes: EndpointTable<RouteTarget>,
    /// The store.
    pub store: StoreSettings,
    /// The failure policy.
    pub on_store_error: FailurePolicy,
    /// Identity settings.
    pub identity: IdentitySettings,
    /// Plan of clients identified by key or user id without a plan of their own.
    pub default_plan: String,
    /// Plan of clients identified by IP only.
    pub anonymous_plan: String,
    /// What keys not in `api_keys` get.
    pub unknown_keys: UnknownKeys,
    /// Plan by SHA-256 of the API key.
    pub api_keys: HashMap<[u8; 32], String>,
    /// Plans by name.
    pub plans: HashMap<String, PlanLimits>,
    /// Limits on every request, by client IP.
    pub per_ip: Vec<Arc<Limit>>,
    /// Ceilings across all clients, per endpoint.
    pub global: EndpointTable<EndpointLimits>,
    /// Rollout.
    pub rollout: Rollout,
    /// Clients that bypass all limits.
    pub allowlist: ClientList,
    /// Clients refused with 403.
    pub denylist: ClientList,
    /// Responses.
    pub response: ResponseSettings,
    /// Envoy's rate limit service (`rls:`), when configured.
    pub rls: Option<RlsSettings>,
    /// The configuration as JSON with API keys replaced by their hashes and passwords in URLs
    /// by `***`, for `/admin/config`.
    pub redacted: serde_json::Value,
}

pub use floodgate::api_key_digest as key_digest;
pub use floodgate::store::redact_url;

impl Config {
    /// Settings that are valid but probably not what a deployment wants: `floodgate check`
    /// prints them and `serve` logs them at start.
    pub fn warnings(&self, admin_token_set: bool) -> Vec<String> {
        let mut warnings = Vec::new();
        let keyed_plans_limit = self.unknown_keys == UnknownKeys::DefaultPlan
            && self
                .plans
                .get(&self.default_plan)
                .is_some_and(|plan| !plan.limits.is_empty());
        if keyed_plans_limit && self.per_ip.is_empty() {
            warnings.push(format!(
                "clients.unknown_keys: default_plan gives every invented API key a fresh `{}` budget and no per_ip limit caps it; add a per_ip limit or set unknown_keys to anonymous or reject",
                self.default_plan
            ));
        }
        if !self.admin_listen.ip().is_loopback() && !admin_token_set {
            warnings.push(format!(
                "admin.listen: {} is not a loopback address; `serve` refuses it unless FLOODGATE_ADMIN_TOKEN is set",
                self.admin_listen
            ));
        }
        warnings
    }
}

/// Parses `sha256:<64 hex>`, or hashes a raw key.
fn key_entry(text: &str) -> Result<[u8; 32], String> {
    let Some(hex) = text.strip_prefix("sha256:") else {
        return Ok(key_digest(text));
    };
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("`sha256:` must be followed by 64 hex digits".to_owned());
    }
    let mut digest = [0u8; 32];
    for (index, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * index..2 * index + 2], 16)
            .map_err(|_| "bad hex".to_owned())?;
    }
    Ok(digest)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Collects errors with their paths.
#[derive(Default)]
struct Errors(Vec<ConfigError>);

impl Errors {
    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError {
            path: path.into(),
            message: message.into(),
        });
    }

    fn ok<T>(&mut self, path: impl Into<String>, result: Result<T, String>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(message) => {
                self.push(path, message);
                None
            }
        }
    }
}

/// The largest configuration file read: far above any real one (a million API keys fit),
/// small enough that a runaway file is refused before it is parsed.
pub const MAX_CONFIG_BYTES: usize = 128 * 1024 * 1024;

/// The YAML parser's limits: its defaults (alias bombs and deep nesting stay refused), with
/// room for 1,000,000 API keys (two nodes each) instead of 125,000; and no source snippets in
/// errors, since the lines around a typo may hold a Redis password or raw API keys, and errors
/// reach logs, `/admin/reload` answers and `floodgate check`'s output.
fn yaml_options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_nodes = 2_100_000;
    budget.max_events = 5_000_000;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options.with_snippet = false;
    options
}

/// Parses and validates a configuration file's text.
pub fn parse(text: &str) -> Result<Config, ConfigErrors> {
    if text.len() > MAX_CONFIG_BYTES {
        return Err(ConfigErrors(vec![ConfigError {
            path: String::new(),
            message: format!(
                "the file is {} bytes; the most a configuration may hold is {MAX_CONFIG_BYTES}",
                text.len()
            ),
        }]));
    }
    let raw = parse_yaml::<RawConfig>(text).map_err(|error| ConfigErrors(vec![error]))?;
    validate(raw)
}

/// Deserializes YAML `text` with the gateway's parser limits; an error carries the field path
/// of a type error and never quotes the source (see [`yaml_options`]).
pub(crate) fn parse_yaml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, ConfigError> {
    // The field path of a type error, kept aside: the YAML layer only passes its own error up.
    let mut path = None;
    serde_saphyr::with_deserializer_from_str_with_options(text, yaml_options(), |deserializer| {
        serde_path_to_error::deserialize::<_, T>(deserializer).map_err(|error| {
            let at = error.path().to_string();
            path = Some(if at == "." { String::new() } else { at });
            error.into_inner()
        })
    })
    .map_err(|error| ConfigError {
        path: path.unwrap_or_default(),
        message: error.to_string(),
    })
}

/// Reads, parses and validates a configuration file.
pub fn load(path: &std::path::Path) -> Result<Config, ConfigErrors> {
    let text = std::fs::read_to_string(path).map_err(|error| {
        ConfigErrors(vec![ConfigError {
            path: String::new(),
            message: format!("cannot read {}: {error}", path.display()),
        }])
    })?;
    parse(&text)
}

fn socket_addr(text: &str) -> Result<SocketAddr, String> {
    text.parse()
        .map_err(|_| format!("`{text}` is not an address such as 0.0.0.0:8080"))
}

fn upstream(url: &str) -> Result<Upstream, String> {
    // Messages quote the URL without its password.
    let text = redact_url(url);
    let uri: Uri = url
        .parse()
        .map_err(|_| format!("`{text}` is not a URL such as http://127.0.0.1:3000"))?;
    let scheme = uri
        .scheme()
        .cloned()
        .ok_or_else(|| format!("`{text}` has no scheme; write http://..."))?;
    if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
        return Err(format!("`{text}`: an upstream is http:// or https://"));
    }
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| format!("`{text}` has no host"))?;
    if authority.as_str().contains('@') {
        return Err(format!(
            "`{text}`: credentials in an upstream URL are not supported"
        ));
    }
    if uri.path() != "/" && !uri.path().is_empty() {
        return Err(format!(
            "`{text}`: an upstream is scheme://host:port, without a path"
        ));
    }
    Ok(Upstream { scheme, authority })
}

fn positive_duration(text: &str) -> Result<Duration, String> {
    let value = parse_duration(text)?;
    if value.is_zero() {
        return Err("must be greater than 0".to_owned());
    }
    Ok(value)
}

/// The longest batched sync interval: beyond it the overshoot bound (a node's admissions until
/// the next sync) stops meaning anything, and a huge value would overflow the timer.
const MAX_SYNC_INTERVAL: Duration = Duration::from_secs(60);

/// A positive duration no longer than [`MAX_SYNC_INTERVAL`].
fn bounded_sync_interval(text: &str) -> Result<Duration, String> {
    let value = positive_duration(text)?;
    if value > MAX_SYNC_INTERVAL {
        return Err("must be at most 1m".to_owned());
    }
    Ok(value)
}

fn policy(text: &str) -> Result<FailurePolicy, String> {
    text.parse::<FailurePolicy>()
        .map_err(|_| format!("unknown policy `{text}`; expected open, closed or local"))
}

fn limit(
    errors: &mut Errors,
    path: &str,
    raw: &RawLimit,
    names: &mut HashSet<String>,
) -> Option<Arc<Limit>> {
    let mut builder = Limit::builder(raw.name.clone())
        .algorithm_name(&raw.algorithm)
        .limit(raw.limit);
    if let Some(window) = &raw.window {
        match positive_duration(window) {
            Ok(window) => builder = builder.window(window),
            Err(message) => {
                errors.push(format!("{path}.window"), message);
                return None;
            }
        }
    }
    if let Some(burst) = raw.burst {
        builder = builder.burst(burst);
    }
    if let Some(cost) = raw.cost {
        builder = builder.cost(cost);
    }
    if !names.insert(raw.name.clone()) {
        errors.push(
            format!("{path}.name"),
            format!("`{}` is used twice in this list", raw.name),
        );
        return None;
    }
    match builder.build() {
        Ok(limit) => Some(Arc::new(limit)),
        Err(error) => {
            errors.push(
                format!("{path}.{}", error.field()),
                error
                    .to_string()
                    .split_once(": ")
                    .map_or(error.to_string(), |(_, message)| message.to_owned()),
            );
            None
        }
    }
}

fn limits(errors: &mut Errors, path: &str, raws: &[RawLimit]) -> Vec<Arc<Limit>> {
    let mut names = HashSet::new();
    raws.iter()
        .enumerate()
        .filter_map(|(index, raw)| limit(errors, &format!("{path}[{index}]"), raw, &mut names))
        .collect()
}

fn endpoint_limits(
    errors: &mut Errors,
    path: &str,
    rule_prefix: &str,
    raw: &std::collections::BTreeMap<String, Vec<RawLimit>>,
) -> EndpointTable<EndpointLimits> {
    let mut table = EndpointTable::default();
    for (pattern, raws) in raw {
        let entry_path = format!("{path}.\"{pattern}\"");
        let parsed = limits(errors, &entry_path, raws);
        if let Some(endpoint) = errors.ok(entry_path.clone(), Endpoint::parse(pattern)) {
            let entry = EndpointLimits {
                rule: Arc::from(format!("{rule_prefix}.{}", endpoint.key_id())),
                limits: parsed,
            };
            errors.ok(entry_path, table.insert(endpoint, entry));
        }
    }
    table
}

/// `store.backend` with its URLs, checked.
fn store_backend(errors: &mut Errors, store: &raw::RawStore) -> Option<Backend> {
    let urls: Vec<(String, &String)> = match store.backend.as_str() {
        "memory" => Vec::new(),
        "redis" => match &store.sentinel {
            Some(sentinel) => {
                if sentinel.master.is_empty() {
                    errors.push("store.sentinel.master", "must not be empty");
                }
                if sentinel.nodes.is_empty() {
                    errors.push("store.sentinel.nodes", "needs at least one sentinel");
                }
                indexed("store.sentinel.nodes", &sentinel.nodes)
            }
            None => vec![("store.url".to_owned(), &store.url)],
        },
        "redis_sharded" | "redis_cluster" => {
            if store.nodes.is_empty() {
                errors.push(
                    "store.nodes",
                    format!("{} needs at least one node", store.backend),
                );
            }
            indexed("store.nodes", &store.nodes)
        }
        other => {
            errors.push(
                "store.backend",
                format!(
                    "unknown backend `{other}`; expected memory, redis, redis_cluster or \
                     redis_sharded"
                ),
            );
            return None;
        }
    };
    if store.sentinel.is_some() && store.backend != "redis" {
        errors.push(
            "store.sentinel",
            "only applies to backend: redis (Sentinel elects one master)",
        );
    }
    for (path, url) in &urls {
        if !url.starts_with("redis://") && !url.starts_with("rediss://") {
            errors.push(
                path.clone(),
                format!("`{}` is not a redis:// URL", redact_url(url)),
            );
        }
    }
    let pool_size = match store.connection.as_str() {
        "multiplexed" => None,
        "pool" if store.pool_size >= 1 => Some(store.pool_size),
        "pool" => {
            errors.push("store.pool_size", "must be at least 1");
            return None;
        }
        other => {
            errors.push(
                "store.connection",
                format!("unknown connection `{other}`; expected multiplexed or pool"),
            );
            return None;
        }
    };
    Some(match (store.backend.as_str(), &store.sentinel) {
        ("memory", _) => Backend::Memory,
        ("redis", Some(sentinel)) => Backend::RedisSentinel {
            master: sentinel.master.clone(),
            sentinels: sentinel.nodes.clone(),
            pool_size,
        },
        ("redis", None) => Backend::Redis {
            url: store.url.clone(),
            pool_size,
        },
        ("redis_cluster", _) => Backend::RedisCluster {
            nodes: store.nodes.clone(),
            pool_size,
        },
        _ => Backend::RedisSharded {
            nodes: store.nodes.clone(),
            pool_size,
        },
    })
}

fn indexed<'a>(path: &str, urls: &'a [String]) -> Vec<(String, &'a String)> {
    urls.iter()
        .enumerate()
        .map(|(index, url)| (format!("{path}[{index}]"), url))
        .collect()
}

/// Every list of limits in the file, with its path: plans, their endpoints, per IP, global.
fn all_limit_lists(raw: &RawConfig) -> Vec<(String, &[RawLimit])> {
    let mut lists: Vec<(String, &[RawLimit])> = Vec::new();
    for (name, plan) in &raw.plans {
        lists.push((format!("plans.{name}.limits"), &plan.limits));
        for (pattern, limits) in &plan.endpoints {
            lists.push((format!("plans.{name}.endpoints.\"{pattern}\""), limits));
        }
    }
    lists.push(("per_ip".to_owned(), &raw.per_ip));
    for (pattern, limits) in &raw.global {
        lists.push((format!("global.\"{pattern}\""), limits));
    }
    lists
}

fn client_list(errors: &mut Errors, path: &str, raw: &RawLists) -> ClientList {
    let mut list = ClientList::new();
    for (index, text) in raw.ips.iter().enumerate() {
        let parsed = text
            .parse::<IpNet>()
            .ok()
            .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from));
        match parsed {
            Some(net) => list = list.ip(net),
            None => errors.push(
                format!("{path}.ips[{index}]"),
                format!("`{text}` is not an IP address or CIDR"),
            ),
        }
    }
    for (index, key) in raw.api_keys.iter().enumerate() {
        if let Some(digest) = errors.ok(format!("{path}.api_keys[{index}]"), key_entry(key)) {
            list = list.api_key_digest(digest);
        }
    }
    raw.users
        .iter()
        .fold(list, |list, user| list.user(user.clone()))
}

fn redact(raw: &RawConfig) -> serde_json::Value {
    let mut redacted = raw.clone();
    // Passwords in store and upstream URLs (SPEC §7: every secret).
    redacted.store.url = redact_url(&raw.store.url);
    redacted.store.nodes = raw.store.nodes.iter().map(|url| redact_url(url)).collect();
    if let Some(sentinel) = &mut redacted.store.sentinel {
        sentinel.nodes = sentinel.nodes.iter().map(|url| redact_url(url)).collect();
    }
    redacted.upstream = redact_url(&raw.upstream);
    for route in &mut redacted.routes {
        route.upstream = route.upstream.as_deref().map(redact_url);
    }
    redacted.clients.api_keys = raw
        .clients
        .api_keys
        .iter()
        .map(|(key, plan)| {
            let digest = key_entry(key).unwrap_or_else(|_| key_digest(key));
            (format!("sha256:{}", hex(&digest)), plan.clone())
        })
        .collect();
    let redact_list = |keys: &[String]| -> Vec<String> {
        keys.iter()
            .map(|key| {
                format!(
                    "sha256:{}",
                    hex(&key_entry(key).unwrap_or_else(|_| key_digest(key)))
                )
            })
            .collect()
    };
    redacted.allowlist.api_keys = redact_list(&raw.allowlist.api_keys);
    redacted.denylist.api_keys = redact_list(&raw.denylist.api_keys);
    serde_json::to_value(&redacted).unwrap_or(serde_json::Value::Null)
}

fn rollout(errors: &mut Errors, path: &str, raw: &raw::RawRollout) -> Option<Rollout> {
    let mode = match raw.mode.as_str() {
        "enforce" => Some(RolloutMode::Enforce),
        "shadow" => Some(RolloutMode::Shadow),
        "off" => Some(RolloutMode::Off),
        other => {
            errors.push(
                format!("{path}.mode"),
                format!("unknown mode `{other}`; expected enforce, shadow or off"),
            );
            None
        }
    };
    if !(0.0..=100.0).contains(&raw.enforce_percent) {
        errors.push(
            format!("{path}.enforce_percent"),
            "must be between 0 and 100",
        );
        return None;
    }
    mode.map(|mode| Rollout {
        mode,
        enforce_percent: raw.enforce_percent,
    })
}

/// Validates a parsed file into a [`Config`], collecting every error.
pub fn validate(raw: RawConfig) -> Result<Config, ConfigErrors> {
    let mut errors = Errors::default();
    let listen = errors.ok("listen", socket_addr(&raw.listen));
    let admin_listen = errors.ok("admin.listen", socket_addr(&raw.admin.listen));
    let default_upstream = errors.ok("upstream", upstream(&raw.upstream));
    let upstream_timeout = errors.ok("upstream_timeout", positive_duration(&raw.upstream_timeout));
    let server_limits = server::validate(&mut errors, &raw.server);
    let listen_tls = tls::listen_tls(&mut errors, raw.listen_tls.as_ref());
    let upstream_tls = tls::upstream_tls(&mut errors, raw.upstream_tls.as_ref());
    let upstream_protocol = tls::upstream_protocol(&mut errors, &raw.upstream_protocol);

    let mut routes = EndpointTable::default();
    for (index, route) in raw.routes.iter().enumerate() {
        let path = format!("routes[{index}]");
        let target_upstream = match &route.upstream {
            Some(text) => errors
                .ok(format!("{path}.upstream"), upstream(text))
                .map(Some),
            None => Some(None),
        };
        if route.cost == Some(0) {
            errors.push(format!("{path}.cost"), "must be at least 1");
        }
        let cost_header = match &route.cost_header {
            Some(name) => errors
                .ok(
                    format!("{path}.cost_header"),
                    http::HeaderName::try_from(name.as_str())
                        .map_err(|_| format!("`{name}` is not a valid header name")),
                )
                .map(|name| Some((name, route.cost_header_visible))),
            None => Some(None),
        };
        let endpoint = errors.ok(format!("{path}.match"), Endpoint::parse(&route.pattern));
        if let (Some(endpoint), Some(target_upstream), Some(cost_header)) =
            (endpoint, target_upstream, cost_header)
        {
            let target = RouteTarget {
                upstream: target_upstream,
                cost: route.cost,
                cost_header,
            };
            errors.ok(format!("{path}.match"), routes.insert(endpoint, target));
        }
    }

    let store = &raw.store;
    let backend = store_backend(&mut errors, store);
    let sync_interval = store
        .sync_interval
        .as_deref()
        .and_then(|text| errors.ok("store.sync_interval", bounded_sync_interval(text)));
    if sync_interval.is_some() {
        if store.backend == "memory" {
            errors.push(
                "store.sync_interval",
                "needs a shared store (redis, redis_cluster or redis_sharded); the memory store \
                 is local already",
            );
        }
        for (path, raws) in all_limit_lists(&raw) {
            for (index, limit) in raws.iter().enumerate() {
                if let Ok(algorithm) = limit.algorithm.parse::<floodgate::Algorithm>()
                    && !floodgate::store::batched::supports(algorithm)
                {
                    errors.push(
                        format!("{path}[{index}].algorithm"),
                        format!(
                            "{} cannot run with store.sync_interval (batched counters keep \
                             counts, not each request); use token_bucket, gcra, fixed_window or \
                             sliding_window_counter, or remove store.sync_interval",
                            algorithm.as_str()
                        ),
                    );
                }
            }
        }
    }
    if store.max_keys == 0 {
        errors.push("store.max_keys", "must be at least 1");
    }
    let global_sync_interval = match store.global_sync_interval.as_str() {
        "exact" => Some(None),
        text => errors
            .ok("store.global_sync_interval", bounded_sync_interval(text))
            .map(Some),
    }
    .flatten();
    let store_timeout = errors.ok("store.timeout", positive_duration(&store.timeout));
    let open_for = errors.ok(
        "store.breaker.open_for",
        positive_duration(&store.breaker.open_for),
    );
    if store.breaker.failures == 0 {
        errors.push("store.breaker.failures", "must be at least 1");
    }
    if store.prefix.is_empty() || store.prefix.contains(['{', '}', ':']) {
        errors.push(
            "store.prefix",
            "must be non-empty, without braces or colons",
        );
    }
    if !(store.fallback_share > 0.0 && store.fallback_share <= 1.0) {
        errors.push(
            "store.fallback_share",
            "must be greater than 0 and at most 1",
        );
    }
    if !(store.share > 0.0 && store.share <= 1.0) {
        errors.push("store.share", "must be greater than 0 and at most 1");
    }
    let on_store_error = errors.ok("on_store_error", policy(&raw.on_store_error));

    let identity = &raw.identity;
    let identifier = match DefaultIdentifier::new()
        .bearer(identity.api_key.bearer)
        .api_key_header(Some(&identity.api_key.header))
        .and_then(|next| next.user_header(identity.user_header.as_deref()))
        .and_then(|next| next.trusted_proxies(&identity.trusted_proxies))
        .and_then(|next| next.ipv6_prefix(identity.ipv6_prefix))
    {
        Ok(built) => match identity
            .forwarded
            .parse::<floodgate::key::ForwardedHeader>()
        {
            Ok(forwarded) => Some(built.forwarded(forwarded)),
            Err(problem) => {
                errors.push("identity.forwarded", problem);
                None
            }
        },
        Err(error) => {
            let message = error.to_string();
            let (field, problem) = message.split_once(": ").unwrap_or(("", &message));
            errors.push(
                format!("identity.{}", field.trim_start_matches("identity.")),
                problem.to_owned(),
            );
            None
        }
    };
    let plan_header = match &identity.plan_header {
        Some(name) => errors
            .ok(
                "identity.plan_header",
                HeaderName::try_from(name.as_str())
                    .map_err(|_| format!("`{name}` is not a header name")),
            )
            .map(Some),
        None => Some(None),
    };

    let mut plans = HashMap::new();
    for (name, raw_plan) in &raw.plans {
        let path = format!("plans.{name}");
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            || name.is_empty()
        {
            errors.push(path.clone(), "plan names are made of A-Z a-z 0-9 - _ .");
        }
        let rule = format!("plan.{name}");
        let plan = PlanLimits {
            limits: limits(&mut errors, &format!("{path}.limits"), &raw_plan.limits),
            endpoints: endpoint_limits(
                &mut errors,
                &format!("{path}.endpoints"),
                &rule,
                &raw_plan.endpoints,
            ),
            rule: Arc::from(rule),
            on_store_error: raw_plan
                .on_store_error
                .as_deref()
                .and_then(|text| errors.ok(format!("{path}.on_store_error"), policy(text))),
            rollout: raw_plan
                .rollout
                .as_ref()
                .and_then(|raw| rollout(&mut errors, &format!("{path}.rollout"), raw)),
        };
        plans.insert(name.clone(), plan);
    }
    if !raw.plans.is_empty() {
        for (field, plan) in [
            ("clients.default_plan", &raw.clients.default_plan),
            ("clients.anonymous_plan", &raw.clients.anonymous_plan),
        ] {
            if !raw.plans.contains_key(plan) {
                errors.push(field, format!("plan `{plan}` is not defined under plans"));
            }
        }
    }
    let mut api_keys = HashMap::new();
    for (key, plan) in &raw.clients.api_keys {
        // The path names the key by its hash: error messages must not print secrets.
        let shown = if key.starts_with("sha256:") {
            key.clone()
        } else {
            format!("sha256:{}…", &hex(&key_digest(key))[..12])
        };
        let path = format!("clients.api_keys[{shown}]");
        if let Some(digest) = errors.ok(path.clone(), key_entry(key)) {
            api_keys.insert(digest, plan.clone());
        }
        if !raw.plans.contains_key(plan) {
            errors.push(path, format!("plan `{plan}` is not defined under plans"));
        }
    }

    let unknown_keys = errors.ok("clients.unknown_keys", raw.clients.unknown_keys.parse());

    let per_ip = limits(&mut errors, "per_ip", &raw.per_ip);
    let global = endpoint_limits(&mut errors, "global", "global", &raw.global);

    let rollout_settings = rollout(&mut errors, "rollout", &raw.rollout);
    let allowlist = client_list(&mut errors, "allowlist", &raw.allowlist);
    let denylist = client_list(&mut errors, "denylist", &raw.denylist);

    let headers = errors.ok(
        "response.headers",
        raw.response
            .headers
            .parse::<HeaderStyle>()
            .map_err(|error| error.to_string()),
    );
    let rls_settings = rls::rls(&mut errors, raw.rls.as_ref());
    if !(0.0..=10.0).contains(&raw.response.retry_after_jitter) {
        errors.push("response.retry_after_jitter", "must be between 0 and 10");
    }

    if !errors.0.is_empty() {
        return Err(ConfigErrors(errors.0));
    }
    // Every value below was checked above: an error there returned before this point.
    let (
        Some(listen),
        Some(admin_listen),
        Some(upstream),
        Some(upstream_timeout),
        Some(server_limits),
        Some(backend),
        Some(timeout),
        Some(open_for),
        Some(on_store_error),
        Some(identifier),
        Some(plan_header),
        Some(rollout_settings),
        Some(headers),
        Some(unknown_keys),
    ) = (
        listen,
        admin_listen,
        default_upstream,
        upstream_timeout,
        server_limits,
        backend,
        store_timeout,
        open_for,
        on_store_error,
        identifier,
        plan_header,
        rollout_settings,
        headers,
        unknown_keys,
    )
    else {
        return Err(ConfigErrors(vec![ConfigError {
            path: String::new(),
            message: "invalid configuration".to_owned(),
        }]));
    };
    let redacted = redact(&raw);
    let share = raw.store.share;
    let scale = |limits: Vec<Arc<Limit>>| -> Vec<Arc<Limit>> {
        if share >= 1.0 {
            return limits;
        }
        limits
            .into_iter()
            .map(|limit| Arc::new(limit.scaled(share)))
            .collect()
    };
    let per_ip = scale(per_ip);
    let plans = plans
        .into_iter()
        .map(|(name, plan)| {
            let endpoints = plan.endpoints.map(|entry| EndpointLimits {
                rule: entry.rule,
                limits: scale(entry.limits),
            });
            (
                name,
                PlanLimits {
                    limits: scale(plan.limits),
                    endpoints,
                    ..plan
                },
            )
        })
        .collect();
    let global = global.map(|entry| EndpointLimits {
        rule: entry.rule,
        limits: scale(entry.limits),
    });
    Ok(Config {
        listen,
        admin_listen,
        upstream,
        upstream_timeout,
        server: server_limits,
        listen_tls,
        upstream_tls,
        upstream_protocol,
        routes,
        store: StoreSettings {
            backend,
            timeout,
            prefix: raw.store.prefix,
            breaker_failures: raw.store.breaker.failures,
            breaker_open_for: open_for,
            fallback_share: raw.store.fallback_share,
            sync_interval,
            global_sync_interval,
            max_keys: raw.store.max_keys,
        },
        on_store_error,
        identity: IdentitySettings {
            identifier: Arc::new(identifier),
            plan_header,
        },
        default_plan: raw.clients.default_plan,
        anonymous_plan: raw.clients.anonymous_plan,
        unknown_keys,
        api_keys,
        plans,
        per_ip,
        global,
        rollout: rollout_settings,
        allowlist,
        denylist,
        response: ResponseSettings {
            headers,
            retry_after_jitter: raw.response.retry_after_jitter,
            docs_url: raw.response.docs_url,
            problem_json: raw.response.problem_json,
        },
        rls: rls_settings,
        redacted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_errors_never_quote_the_source() {
        // Regression (issue 10.11): a typo next to the Redis URL or api_keys put the password
        // or raw keys into the error, which reaches logs, /admin/reload and `check`.
        let text = "store:\n  url: \"redis://:hunter2@127.0.0.1:6379\"\n  timeout: [oops\nclients:\n  api_keys: { \"raw-secret-key\": free }\n";
        let errors = parse(text).err().unwrap().to_string();
        for secret in ["hunter2", "raw-secret-key"] {
            assert!(!errors.contains(secret), "{secret} in: {errors}");
        }
        let typed = "store:\n  url: \"redis://:hunter2@127.0.0.1:6379\"\n  pool_size: many\n";
        let errors = parse(typed).err().unwrap().to_string();
        assert!(!errors.contains("hunter2"), "{errors}");
        assert!(errors.contains("store.pool_size"), "{errors}");
    }

    #[test]
    fn many_api_keys_fit_in_the_yaml_budget() {
        // Regression (issue 10.16): past ~125,000 keys the parser's node budget refused the
        // file ("budget breached: Nodes").
        let mut text = String::from(
            "plans: { free: { limits: [] }, anonymous: { limits: [] } }\nclients:\n  api_keys:\n",
        );
        for index in 0..130_000 {
            text.push_str(&format!("    \"key-{index}\": free\n"));
        }
        let config = parse(&text).unwrap();
        assert_eq!(config.api_keys.len(), 130_000);
    }

    #[test]
    fn passwords_in_urls_are_redacted() {
        for (url, shown) in [
            ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
            ("redis://user:pw@host", "redis://user:***@host"),
            ("rediss://lonely@host", "rediss://***@host"),
            ("redis://host:6379", "redis://host:6379"),
            ("redis://host/x@y", "redis://host/x@y"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
        let config = parse(
            "store:\n  backend: redis\n  sentinel: { master: m, nodes: [\"redis://:sentinel-pass@127.0.0.1:3\"] }\nupstream: \"http://127.0.0.1:9\"\n",
        )
        .unwrap();
        let text = config.redacted.to_string();
        assert!(!text.contains("sentinel-pass"), "{text}");
        let errors = parse("upstream: \"http://user:upstream-pass@127.0.0.1:9\"\n")
            .err()
            .unwrap()
            .to_string();
        assert!(
            errors.contains("credentials in an upstream URL"),
            "{errors}"
        );
        assert!(!errors.contains("upstream-pass"), "{errors}");
    }

    fn errors_of(text: &str) -> Vec<String> {
        match parse(text) {
            Ok(_) => Vec::new(),
            Err(errors) => errors.0.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn a_minimal_file_is_a_few_lines() {
        let config = parse("upstream: \"http://127.0.0.1:3000\"\n").unwrap();
        assert_eq!(config.listen, "0.0.0.0:8080".parse().unwrap());
        assert_eq!(config.store.backend, Backend::Memory);
        assert_eq!(config.store.timeout, Duration::from_millis(50));
        assert!(config.plans.is_empty());
        assert!(parse("").is_ok(), "every field has a default");
    }

    #[test]
    fn unknown_fields_are_errors_with_their_path() {
        let errors = errors_of("store:\n  backend: memory\n  colour: blue\n");
        assert_eq!(errors.len(), 1);
        assert!(errors[0].starts_with("store.colour: "), "{errors:?}");
        assert!(errors[0].contains("unknown field `colour`"), "{errors:?}");
        assert!(
            errors[0].contains("line 3"),
            "the YAML position too: {errors:?}"
        );
        let errors = errors_of(
            "plans:\n  free:\n    limits:\n      - { name: a, algorithm: gcra, limit: 1, window: 1s, brust: 2 }\n",
        );
        assert!(
            errors[0].starts_with("plans.free.limits[0].brust: "),
            "{errors:?}"
        );
        assert!(errors[0].contains("unknown field `brust`"), "{errors:?}");
    }

    #[test]
    fn every_semantic_error_is_reported_with_its_path() {
        let errors = errors_of(
            r#"
listen: "nowhere"
upstream_timeout: 0s
store: { backend: etcd, timeout: soon }
on_store_error: maybe
plans:
  free:
    limits:
      - { name: per-second, algorithm: token_bucket, limit: 10, window: 1s }
      - { name: daily, algorithm: fixed_window, limit: 10000, window: 0s }
      - { name: burst, algorithm: leaky, limit: 1, window: 1s }
      - { name: per-second, algorithm: gcra, limit: 0, window: 1s }
  anonymous: {}
clients:
  api_keys: { "k1": gold, "sha256:abc": free }
per_ip:
  - { name: ip, algorithm: token_bucket, limit: 5, window: 1s, burst: 0 }
global:
  "GET search": [ { name: g, algorithm: gcra, limit: 1, window: 1s } ]
rollout: { mode: maybe, enforce_percent: 150 }
allowlist: { ips: ["10.0.0.300"] }
response: { headers: all }
"#,
        );
        let expected = [
            "listen: ",
            "upstream_timeout: must be greater than 0",
            "store.backend: unknown backend `etcd`",
            "store.timeout: ",
            "on_store_error: unknown policy `maybe`",
            "plans.free.limits[1].window: must be greater than 0",
            "plans.free.limits[2].algorithm: unknown algorithm `leaky`",
            "plans.free.limits[3].name: `per-second` is used twice",
            "clients.api_keys[sha256:abc]: `sha256:` must be followed by 64 hex digits",
            "plan `gold` is not defined under plans",
            "per_ip[0].burst: must be at least 1",
            "global.\"GET search\": ",
            "rollout.mode: unknown mode `maybe`",
            "rollout.enforce_percent: must be between 0 and 100",
            "allowlist.ips[0]: ",
            "response.headers: unknown header style `all`",
        ];
        for prefix in expected {
            assert!(
                errors.iter().any(|error| error.contains(prefix)),
                "missing `{prefix}` in {errors:#?}"
            );
        }
        assert!(
            !errors
                .iter()
                .any(|error| error.contains("\"k1\"") || error.contains(": k1")),
            "no raw key in errors: {errors:#?}"
        );
    }

    #[test]
    fn keys_may_be_given_as_hashes_and_are_redacted() {
        let config = parse(
            "plans: { free: {}, anonymous: {}, gold: {} }\nclients:\n  api_keys:\n    \"secret-1\": gold\n    \"sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\": gold\n",
        )
        .unwrap();
        assert_eq!(
            config
                .api_keys
                .get(&key_digest("secret-1"))
                .map(String::as_str),
            Some("gold")
        );
        assert_eq!(
            config.api_keys.get(&key_digest("test")).map(String::as_str),
            Some("gold"),
            "sha256 of `test`"
        );
        let redacted = config.redacted.to_string();
        assert!(!redacted.contains("secret-1"), "{redacted}");
    }

    #[test]
    fn batched_mode_needs_a_shared_store_and_countable_limits() {
        let config = parse(
            r#"
store: { backend: redis, sync_interval: 100ms }
plans: { free: { limits: [ { name: s, algorithm: gcra, limit: 10, window: 1s } ] }, anonymous: {} }
"#,
        )
        .unwrap();
        assert_eq!(config.store.sync_interval, Some(Duration::from_millis(100)));
        let errors = errors_of(
            r#"
store: { backend: memory, sync_interval: 100ms }
plans:
  free:
    limits:
      - { name: ok, algorithm: token_bucket, limit: 10, window: 1s }
      - { name: log, algorithm: sliding_window_log, limit: 10, window: 1s }
    endpoints: { "POST /x": [ { name: c, algorithm: concurrency, limit: 2 } ] }
  anonymous: {}
"#,
        );
        assert!(errors[0].starts_with("store.sync_interval: needs a shared store"));
        assert!(
            errors.iter().any(|error| error
                .starts_with("plans.free.limits[1].algorithm: sliding_window_log cannot run")),
            "{errors:?}"
        );
        assert!(
            errors.iter().any(|error| error
                .starts_with("plans.free.endpoints.\"POST /x\"[0].algorithm: concurrency")),
            "{errors:?}"
        );
        assert!(
            errors_of("store: { backend: redis, sync_interval: 0s }")
                .iter()
                .any(|error| error.starts_with("store.sync_interval: "))
        );
    }

    #[test]
    fn sync_intervals_are_bounded() {
        for field in ["sync_interval", "global_sync_interval"] {
            let errors = errors_of(&format!(
                "store: {{ backend: redis, {field}: 999999999999999d }}"
            ));
            assert!(
                errors
                    .iter()
                    .any(|error| error == &format!("store.{field}: must be at most 1m")),
                "{errors:?}"
            );
            let config = parse(&format!("store: {{ backend: redis, {field}: 1m }}")).unwrap();
            assert!(
                config.store.sync_interval.is_some()
                    || config.store.global_sync_interval == Some(Duration::from_secs(60))
            );
        }
    }

    #[test]
    fn global_ceilings_are_batched_by_default_unless_exact() {
        let config = parse("store: { backend: redis }").unwrap();
        assert_eq!(
            config.store.global_sync_interval,
            Some(Duration::from_millis(100))
        );
        assert_eq!(config.store.max_keys, 1_000_000);
        assert!(
            errors_of("store: { max_keys: 0 }")
                .iter()
                .any(|error| error.starts_with("store.max_keys: "))
        );
        let config = parse("store: { backend: redis, global_sync_interval: exact }").unwrap();
        assert_eq!(config.store.global_sync_interval, None);
        assert!(
            errors_of("store: { global_sync_interval: soon }")
                .iter()
                .any(|error| error.starts_with("store.global_sync_interval: "))
        );
    }

    #[test]
    fn cluster_and_sentinel_backends() {
        let config = parse(
            "store: { backend: redis_cluster, nodes: [\"redis://10.0.0.1:7000\", \"redis://10.0.0.2:7000\"] }",
        )
        .unwrap();
        assert!(
            matches!(config.store.backend, Backend::RedisCluster { ref nodes, .. } if nodes.len() == 2)
        );
        let config = parse(
            "store: { backend: redis, sentinel: { master: mymaster, nodes: [\"redis://10.0.0.1:26379\"] } }",
        )
        .unwrap();
        assert!(matches!(
            config.store.backend,
            Backend::RedisSentinel { ref master, .. } if master == "mymaster"
        ));
        let errors = errors_of(
            "store: { backend: redis_sharded, nodes: [\"redis://a:1\"], sentinel: { master: m, nodes: [\"tcp://b\"] } }",
        );
        assert!(
            errors
                .iter()
                .any(|error| error.starts_with("store.sentinel: only applies")),
            "{errors:?}"
        );
        let errors = errors_of("store: { backend: redis_cluster }");
        assert_eq!(
            errors,
            vec!["store.nodes: redis_cluster needs at least one node"]
        );
        let errors = errors_of(
            "store: { backend: redis, sentinel: { master: m, nodes: [\"http://s:1\"] } }",
        );
        assert_eq!(
            errors,
            vec!["store.sentinel.nodes[0]: `http://s:1` is not a redis:// URL"]
        );
    }

    #[test]
    fn a_regional_share_scales_every_limit() {
        let config = parse(
            r#"
store: { share: 0.25 }
plans:
  free:
    limits: [ { name: per-second, algorithm: token_bucket, limit: 100, window: 1s, burst: 200 } ]
    endpoints: { "POST /x": [ { name: x, algorithm: fixed_window, limit: 8, window: 60s } ] }
  anonymous: {}
per_ip: [ { name: ip, algorithm: gcra, limit: 40, window: 1s } ]
global: { "/search": [ { name: g, algorithm: sliding_window_counter, limit: 1000, window: 1s } ] }
"#,
        )
        .unwrap();
        let free = &config.plans["free"];
        assert_eq!((free.limits[0].limit(), free.limits[0].burst()), (25, 50));
        let (_, endpoint) = free.endpoints.find(&http::Method::POST, "/x").unwrap();
        assert_eq!(endpoint.limits[0].limit(), 2);
        assert_eq!(config.per_ip[0].limit(), 10);
        let (_, global) = config.global.find(&http::Method::GET, "/search").unwrap();
        assert_eq!(global.limits[0].limit(), 250);
        assert!(
            errors_of("store: { share: 0 }")
                .iter()
                .any(|error| error.starts_with("store.share:"))
        );
    }

    #[test]
    fn garbage_never_panics() {
        for text in [
            "{",
            "- - -",
            "plans: 3",
            "plans: { free: { limits: [ 1, 2 ] } }",
            "\u{0}\u{1}",
            "listen: [1, 2]",
            "routes: { a: b }",
            "store: { pool_size: -1 }",
            "&a [*a, *a]",
            "per_ip: [ { name: x, algorithm: gcra, limit: 99999999999999999999999 } ]",
        ] {
            assert!(parse(text).is_err(), "{text}");
        }
    }
}
