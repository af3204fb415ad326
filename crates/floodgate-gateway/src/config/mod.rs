//! The gateway configuration (SPEC §5): parsed from YAML, then validated into library types.
//! Every error carries its field path (`plans.free.limits[1].window: must be greater than 0`);
//! `load` returns all of them, never a partial configuration, and never panics.
//!
//! One module per section of the file: `routes` (upstreams), `store`, `limits` (plans,
//! `per_ip`, `global`), `clients` (identity, API keys, lists), `rollout` (rollout and failure
//! policies), `response`, `server`, `tls` and `rls`; each validates its section and
//! returns it. This module reads the file and assembles the sections into a [`Config`].

/// A [`Problem`] from `format!` arguments.
macro_rules! problem {
    ($($argument:tt)*) => {
        $crate::config::Problem(format!($($argument)*))
    };
}

mod adaptive;
mod clients;
mod duration;
mod errors;
mod jwt;
mod limits;
mod operations;
mod quota;
mod raw;
mod response;
mod rls;
mod rollout;
mod routes;
mod server;
mod store;
mod tls;

pub(crate) use adaptive::AdaptiveSettings;
pub(crate) use clients::{IdentitySettings, UnknownKeys};
pub(crate) use duration::parse_duration;
pub(crate) use errors::Problem;
pub use errors::{ConfigError, ConfigErrors};
pub(crate) use floodgate::response::ResponseSettings;
pub(crate) use floodgate::rollout::Rollout;
pub(crate) use floodgate::route::{RoutePattern, RouteTable};
pub(crate) use limits::{EndpointLimits, PlanLimits};
pub(crate) use operations::{AccessLogFormat, AccessLogSettings, AccessLogTarget, OverrideBounds};
pub(crate) use quota::{BucketMatch, BucketRule, QuotaLimit, QuotaSettings, RuleAction};
pub(crate) use raw::RawConfig;
pub(crate) use rls::RlsSettings;
pub(crate) use routes::{RouteTarget, Upstream};
pub(crate) use server::{ServerLimits, Workers};
pub(crate) use store::{Backend, StoreSettings};
pub(crate) use tls::{ListenTls, UpstreamProtocol};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use floodgate::{FailurePolicy, Limit, lists::ClientList};

use clients::{hex, key_entry};
use errors::Errors;

/// A validated configuration.
#[derive(Debug)]
pub(crate) struct Config {
    /// Proxy listen address.
    pub listen: SocketAddr,
    /// Admin listen address.
    pub admin_listen: SocketAddr,
    /// Default upstream.
    pub upstream: Upstream,
    /// Whether the proxy is served on `listen`: not in an RLS-only deployment (`rls` set,
    /// no `upstream`, no routes).
    pub serves_proxy: bool,
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
    pub routes: RouteTable<RouteTarget>,
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
    pub global: RouteTable<EndpointLimits>,
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
    /// The bounds on the admin API's per-client overrides (`admin.overrides`).
    pub overrides: OverrideBounds,
    /// The access log (`access_log`), when configured.
    pub access_log: Option<AccessLogSettings>,
    /// Shedding when an upstream slows down (`adaptive_concurrency`), when configured.
    pub adaptive: Option<AdaptiveSettings>,
    /// The configuration as JSON with API keys replaced by their hashes and passwords in URLs
    /// by `***`, for `/admin/config`.
    pub redacted: serde_json::Value,
}

pub(crate) use floodgate::lists::api_key_digest as key_digest;

pub(crate) use floodgate::store::redact_url;

impl Config {
    /// The failure policy of `plan`'s clients: its own `on_store_error`, else the top-level one.
    pub(crate) fn store_error_policy(&self, plan: &str) -> FailurePolicy {
        self.plans
            .get(plan)
            .and_then(|plan| plan.on_store_error)
            .unwrap_or(self.on_store_error)
    }

    /// Whether the gateway should leave its load balancer's pool while the store is down:
    /// when the plan of clients it knows nothing of beforehand (`default_plan`, for keys and
    /// users, or `anonymous_plan`, for IP-only clients) fails closed. A closed plan of named
    /// keys alone does not: its clients get 503 per request, and leaving the pool would take
    /// every other client's traffic with it (SPEC §7 `/readyz`).
    pub(crate) fn unready_without_store(&self) -> bool {
        [&self.default_plan, &self.anonymous_plan]
            .into_iter()
            .any(|plan| self.store_error_policy(plan) == FailurePolicy::Closed)
    }

    /// Settings that are valid but probably not what a deployment wants: `floodgate check`
    /// prints them and `serve` logs them at start.
    /// Every configured limit for which `matches` holds, as `<path> `<name>` (<algorithm>)`,
    /// sorted.
    fn limits_where(&self, matches: impl Fn(&Limit) -> bool) -> Vec<String> {
        let mut found: Vec<String> = self
            .plans
            .iter()
            .flat_map(|(name, plan)| {
                let endpoints = plan.endpoints.entries().flat_map(|(_, limits)| {
                    limits
                        .limits
                        .iter()
                        .map(|limit| (format!("endpoint rule {}", limits.rule), limit))
                });
                plan.limits
                    .iter()
                    .map(move |limit| (format!("plans.{name}.limits"), limit))
                    .chain(endpoints)
            })
            .chain(self.per_ip.iter().map(|limit| ("per_ip".to_owned(), limit)))
            .chain(self.global.entries().flat_map(|(_, limits)| {
                limits
                    .limits
                    .iter()
                    .map(|limit| (format!("global rule {}", limits.rule), limit))
            }))
            .filter(|(_, limit)| matches(limit))
            .map(|(path, limit)| {
                format!("{path} `{}` ({})", limit.name(), limit.algorithm().as_str())
            })
            .collect();
        found.sort();
        found
    }

    pub(crate) fn warnings(&self, admin_token_set: bool) -> Vec<String> {
        let mut warnings = Vec::new();
        let keyed_plans_limit = self.unknown_keys == UnknownKeys::DefaultPlan
            && self
                .plans
                .get(&self.default_plan)
                .is_some_and(|plan| !plan.limits.is_empty());
        if keyed_plans_limit && self.identity.jwt.is_some() {
            // A tenant at its limit sends a request without its token and with an invented
            // key: counted on a fresh budget, per_ip or not.
            warnings.push(format!(
                "clients.unknown_keys: default_plan gives every invented API key a fresh `{}` budget beside identity.jwt's tenants (a tenant at its limit can leave its token out and send a new key){}; set unknown_keys to anonymous or reject, or list the keys in clients.api_keys",
                self.default_plan,
                if self.per_ip.is_empty() {
                    ", and no per_ip limit caps it"
                } else {
                    ""
                }
            ));
        } else if keyed_plans_limit && self.per_ip.is_empty() {
            warnings.push(format!(
                "clients.unknown_keys: default_plan gives every invented API key a fresh `{}` budget and no per_ip limit caps it; add a per_ip limit or set unknown_keys to anonymous or reject",
                self.default_plan
            ));
        }
        if self.store.hot_identities.is_some() {
            let exact =
                self.limits_where(|limit| !floodgate::store::batched::supports(limit.algorithm()));
            if !exact.is_empty() {
                warnings.push(format!(
                    "store.hot_identities: these limits stay exact even for hot identities (only token_bucket, gcra, fixed_window and sliding_window_counter can be leased): {}",
                    exact.join(", ")
                ));
            }
        }
        if let Some(region) = &self.store.region {
            let fixed = self.limits_where(|limit| !floodgate::store::region::trades(limit));
            if !fixed.is_empty() {
                warnings.push(format!(
                    "store.region: these limits keep the fixed share of each region (1/{}) and never trade it (only token_bucket, gcra, fixed_window and sliding_window_counter on a plain window trade): {}",
                    region.settings.regions.len(),
                    fixed.join(", ")
                ));
            }
        }
        for (pattern, route) in self.routes.entries() {
            // SPEC §9: a route with an estimate reserves estimate_max on every request.
            let Some(reserved) = route.estimate.as_ref().map(|estimate| estimate.reserved()) else {
                continue;
            };
            // A concurrency limit counts the cost as well, as leases in flight.
            let smaller = self.limits_where(|limit| {
                limit.cost_override().is_none() && limit.capacity() < reserved
            });
            if !smaller.is_empty() {
                warnings.push(format!(
                    "routes `{pattern}`: every request reserves estimate_max ({reserved}) up front, and these limits hold less, so where they apply they deny every request of the route (give them a cost of their own, such as cost: 1 on a concurrency limit): {}",
                    smaller.join(", ")
                ));
            }
        }
        let no_trusted_proxy = self
            .identity
            .identifier
            .client_ip()
            .trusted_proxies()
            .is_empty();
        if no_trusted_proxy
            && self
                .adaptive
                .as_ref()
                .is_some_and(|adaptive| adaptive.class_header.is_some())
        {
            warnings.push(
                "adaptive_concurrency.class_header: read only from identity.trusted_proxies, and none is set: the header is never read".to_owned(),
            );
        }
        if !self.admin_listen.ip().is_loopback() && !admin_token_set {
            warnings.push(format!(
                "admin.listen: {} is not a loopback address; `serve` refuses it unless FLOODGATE_ADMIN_TOKEN is set",
                self.admin_listen
            ));
        }
        if let Some(jwt) = &self.identity.jwt {
            let unchecked = jwt.unchecked_claims();
            if !unchecked.is_empty() {
                warnings.push(format!(
                    "identity.jwt: no {} is set; a token these keys signed for another service is trusted here too",
                    unchecked.join(" nor ")
                ));
            }
        }
        warnings
    }
}

/// The shortest window a counter must outlive a store's restart for: a day. A limit of a day or
/// more (a daily or monthly quota) restarted from nothing is a client's quota given again.
pub(crate) const QUOTA_WINDOW: std::time::Duration = std::time::Duration::from_secs(86_400);

impl Config {
    /// Every limit whose window is [`QUOTA_WINDOW`] or longer, named by where it is configured
    /// (`plans.<plan>.limits`, `plans.<plan>.endpoints."<pattern>"`, `per_ip`, `global."<pattern>"`)
    /// and its name, sorted.
    pub(crate) fn quota_limits(&self) -> Vec<String> {
        let named = |place: String, limits: &[std::sync::Arc<floodgate::Limit>]| {
            limits
                .iter()
                .filter(|limit| limit.window() >= QUOTA_WINDOW)
                .map(|limit| format!("{place} `{}`", limit.name()))
                .collect::<Vec<_>>()
        };
        let mut found = named("per_ip".to_owned(), &self.per_ip);
        for (name, plan) in &self.plans {
            found.extend(named(format!("plans.{name}.limits"), &plan.limits));
            for (pattern, endpoint) in plan.endpoints.entries() {
                let place = format!("plans.{name}.endpoints.\"{pattern}\"");
                found.extend(named(place, &endpoint.limits));
            }
        }
        for (pattern, endpoint) in self.global.entries() {
            let place = format!("global.\"{pattern}\"");
            found.extend(named(place, &endpoint.limits));
        }
        found.sort();
        found
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

/// Checks the configuration `text` as `floodgate check` does, keeping nothing of it: every
/// error, with its field path.
pub fn check_text(text: &str) -> Result<(), ConfigErrors> {
    parse(text).map(drop)
}

/// Parses and validates a configuration file's text; files it names by relative paths
/// (`identity.jwt`'s keys) are read from the working directory.
pub(crate) fn parse(text: &str) -> Result<Config, ConfigErrors> {
    parse_in(text, std::path::Path::new(""))
}

/// Parses and validates the text of a configuration file in the directory `base`, from
/// which the files it names by relative paths are read.
pub(crate) fn parse_in(text: &str, base: &std::path::Path) -> Result<Config, ConfigErrors> {
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
    validate(raw, base)
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
pub(crate) fn load(path: &std::path::Path) -> Result<Config, ConfigErrors> {
    let text = std::fs::read_to_string(path).map_err(|error| {
        ConfigErrors(vec![ConfigError {
            path: String::new(),
            message: format!("cannot read {}: {error}", path.display()),
        }])
    })?;
    parse_in(&text, directory_of(path))
}

/// The directory of the configuration file at `path`, where the files it names by relative
/// paths are.
pub(crate) fn directory_of(path: &std::path::Path) -> &std::path::Path {
    path.parent().unwrap_or(std::path::Path::new(""))
}

fn socket_addr(text: &str) -> Result<SocketAddr, Problem> {
    text.parse()
        .map_err(|_| problem!("`{text}` is not an address such as 0.0.0.0:8080"))
}

fn positive_duration(text: &str) -> Result<Duration, Problem> {
    let value = parse_duration(text)?;
    if value.is_zero() {
        return Err("must be greater than 0".into());
    }
    Ok(value)
}

fn redact(raw: &RawConfig) -> serde_json::Value {
    let mut redacted = raw.clone();
    // Passwords in store and upstream URLs (SPEC §7: every secret).
    redacted.store.url = redact_url(&raw.store.url);
    redacted.store.nodes = raw.store.nodes.iter().map(|url| redact_url(url)).collect();
    if let Some(sentinel) = &mut redacted.store.sentinel {
        sentinel.nodes = sentinel.nodes.iter().map(|url| redact_url(url)).collect();
    }
    redacted.upstream = raw.upstream.as_deref().map(redact_url);
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

/// A section `validate` checked: `Some` once no error was found (an `Err` only if a check
/// returned `None` without saying why).
fn checked<T>(section: Option<T>) -> Result<T, ConfigErrors> {
    section.ok_or_else(|| {
        ConfigErrors(vec![ConfigError {
            path: String::new(),
            message: "invalid configuration".to_owned(),
        }])
    })
}

/// Validates a parsed file into a [`Config`], collecting every error.
/// The classes routes and verified tokens name ([`adaptive::classes_named`]).
fn classes_named(errors: &mut Errors, raw: &RawConfig) {
    let class_claim = raw
        .identity
        .jwt
        .as_ref()
        .and_then(|jwt| jwt.class_claim.as_deref());
    let adaptive = raw.adaptive_concurrency.as_ref();
    adaptive::classes_named(errors, adaptive, &raw.routes, class_claim);
}

pub(crate) fn validate(raw: RawConfig, base: &std::path::Path) -> Result<Config, ConfigErrors> {
    let mut errors = Errors::default();
    let listen = errors.ok("listen", socket_addr(&raw.listen));
    let admin_listen = errors.ok("admin.listen", socket_addr(&raw.admin.listen));
    let upstream = errors.ok(
        "upstream",
        routes::upstream(raw.upstream.as_deref().unwrap_or(raw::DEFAULT_UPSTREAM)),
    );
    // An RLS-only deployment names no upstream: nothing to proxy, no `listen` to bind.
    let serves_proxy = raw.upstream.is_some() || raw.rls.is_none() || !raw.routes.is_empty();
    let upstream_timeout = errors.ok("upstream_timeout", positive_duration(&raw.upstream_timeout));
    let server_limits = server::validate(&mut errors, &raw.server);
    let listen_tls = tls::listen_tls(&mut errors, raw.listen_tls.as_ref());
    let upstream_tls = tls::upstream_tls(&mut errors, raw.upstream_tls.as_ref());
    let upstream_protocol = tls::upstream_protocol(&mut errors, &raw.upstream_protocol);
    let routes = routes::routes(&mut errors, &raw.routes);
    let store = store::store(&mut errors, &raw.store, &raw.limit_lists());
    let on_store_error = errors.ok("on_store_error", rollout::policy(&raw.on_store_error));
    let identity = clients::identity(&mut errors, &raw.identity, base);
    let plans = limits::plans(&mut errors, &raw.plans);
    clients::default_plans(&mut errors, &raw.clients, &raw.plans);
    let api_keys = clients::api_keys(&mut errors, &raw.clients, &raw.plans);
    let unknown_keys = errors.ok("clients.unknown_keys", raw.clients.unknown_keys.parse());
    let per_ip = limits::limits(&mut errors, "per_ip", &raw.per_ip);
    let global = limits::endpoint_limits(&mut errors, "global", "global", &raw.global);
    let rollout_settings = rollout::rollout(&mut errors, "rollout", &raw.rollout);
    let allowlist = clients::client_list(&mut errors, "allowlist", &raw.allowlist);
    let denylist = clients::client_list(&mut errors, "denylist", &raw.denylist);
    let response = response::response(&mut errors, &raw.response);
    let proxy_listen = listen.filter(|_| serves_proxy);
    let rls_settings = rls::rls(
        &mut errors,
        raw.rls.as_ref(),
        &[("listen", proxy_listen), ("admin.listen", admin_listen)],
    );
    let override_bounds = operations::overrides(&mut errors, &raw.admin.overrides);
    let access_log = operations::access_log(&mut errors, raw.access_log.as_ref());
    let adaptive = adaptive::adaptive(&mut errors, raw.adaptive_concurrency.as_ref(), &raw.plans);
    classes_named(&mut errors, &raw);

    if !errors.0.is_empty() {
        return Err(ConfigErrors(errors.0));
    }
    // Every section below was checked above: an error there returned before this point.
    let listen = checked(listen)?;
    let admin_listen = checked(admin_listen)?;
    let upstream = checked(upstream)?;
    let upstream_timeout = checked(upstream_timeout)?;
    let server_limits = checked(server_limits)?;
    let store = checked(store)?;
    let on_store_error = checked(on_store_error)?;
    let identity = checked(identity)?;
    let rollout_settings = checked(rollout_settings)?;
    let response = checked(response)?;
    let unknown_keys = checked(unknown_keys)?;
    let override_bounds = checked(override_bounds)?;
    let access_log = checked(access_log)?;
    let redacted = redact(&raw);
    let share = raw.store.share;
    let plans = plans
        .into_iter()
        .map(|(name, plan)| (name, limits::scaled_plan(plan, share)))
        .collect();
    let global = limits::scaled_endpoints(global, share);
    Ok(Config {
        listen,
        admin_listen,
        upstream,
        serves_proxy,
        upstream_timeout,
        server: server_limits,
        listen_tls,
        upstream_tls,
        upstream_protocol,
        routes,
        store,
        on_store_error,
        identity,
        default_plan: raw.clients.default_plan,
        anonymous_plan: raw.clients.anonymous_plan,
        unknown_keys,
        api_keys,
        plans,
        per_ip: limits::scaled(per_ip, share),
        global,
        rollout: rollout_settings,
        allowlist,
        denylist,
        response,
        rls: rls_settings,
        overrides: override_bounds,
        access_log,
        adaptive,
        redacted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_workers_is_validated_with_its_field_path() {
        let config = parse("server:\n  workers: per_core\n  worker_threads: 3\n").unwrap();
        assert_eq!(config.server.workers, Workers::PerCore);
        assert_eq!(config.server.worker_threads(), 3);
        let default = parse("").unwrap();
        assert_eq!(
            default.server.workers,
            Workers::PerCore,
            "per_core measured faster"
        );
        let shared = parse("server:\n  workers: multi_thread\n").unwrap();
        assert_eq!(shared.server.workers, Workers::MultiThread);
        let errors = parse("server:\n  workers: forked\n  worker_threads: 0\n")
            .err()
            .unwrap()
            .to_string();
        assert!(errors.contains("server.workers"), "{errors}");
        assert!(errors.contains("`forked` is not one of"), "{errors}");
        assert!(errors.contains("server.worker_threads"), "{errors}");
        let unknown = parse("server:\n  worker: per_core\n")
            .err()
            .unwrap()
            .to_string();
        assert!(unknown.contains("server"), "{unknown}");
    }

    #[test]
    fn yaml_errors_never_quote_the_source() {
        // Regression: a typo next to the Redis URL or api_keys put the password
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
        // Regression: past ~125,000 keys the parser's node budget refused the
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

    pub(crate) fn errors_of(text: &str) -> Vec<String> {
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

    /// Regression: after the configuration was split into modules, a missing default or
    /// anonymous plan was reported twice (by the plans and by the top-level validation).
    #[test]
    fn a_missing_default_plan_is_reported_once() {
        let errors = errors_of(
            "plans:\n  anonymous:\n    limits: [ { name: a, algorithm: gcra, limit: 1, window: 1s } ]\n",
        );
        let missing: Vec<_> = errors
            .iter()
            .filter(|error| error.starts_with("clients.default_plan: "))
            .collect();
        assert_eq!(missing.len(), 1, "{errors:?}");
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
