//! `store`: the backend and its URLs, deadlines, breaker and batched mode.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::errors::{Errors, Problem};
use super::limits::RawLimit;
use super::{positive_duration, redact_url};

/// `store:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawStore {
    /// `memory`, `redis` (with `sentinel`, the master Sentinel elects), `redis_cluster` or
    /// `redis_sharded`.
    pub backend: String,
    /// The Redis server's URL (`redis` backend).
    pub url: String,
    /// The servers' URLs (`redis_cluster`'s seeds, `redis_sharded`'s shards).
    pub nodes: Vec<String>,
    /// `multiplexed` (one pipelined connection, the default: measured faster) or `pool`.
    pub connection: String,
    /// Connections in the pool when `connection` is `pool`.
    pub pool_size: usize,
    /// How long one call to the store may take before the failure policy decides.
    pub timeout: String,
    /// The first part of every storage key.
    pub prefix: String,
    /// When to stop calling a store that keeps failing.
    pub breaker: RawBreaker,
    /// Batched mode: how often a node trades its leases with the store (absent: exact mode).
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
    /// The share of each limit a node keeps deciding alone under `on_store_error: local`.
    pub fallback_share: f64,
    /// This deployment's share of every limit (a region's fixed share of a global limit).
    pub share: f64,
    /// Several regions sharing the limits, shares traded through a global store.
    pub region: Option<RawRegion>,
}

/// `store.region:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRegion {
    /// This region's name, one of `regions`.
    pub name: String,
    /// Every region sharing the limits.
    pub regions: Vec<String>,
    /// The global store's URL: where regions trade their shares.
    pub global: String,
    /// The region's own Redis where its gateways share their table (default: `store.url`;
    /// needed with a cluster, sharded or Sentinel store).
    #[serde(default)]
    pub local: Option<String>,
    /// How often the region trades.
    #[serde(default = "default_region_interval")]
    pub sync_interval: String,
    /// How long a grant or a promise lasts unless renewed (default: three intervals).
    #[serde(default)]
    pub lease_lifetime: Option<String>,
    /// Deadline of a call to the global store or the region's table.
    #[serde(default = "default_region_timeout")]
    pub timeout: String,
}

fn default_region_interval() -> String {
    "1s".to_owned()
}

fn default_region_timeout() -> String {
    "1s".to_owned()
}

/// `store.region`, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RegionConfig {
    /// The library's settings, URLs included.
    pub settings: floodgate::store::region::RegionSettings,
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
            region: None,
        }
    }
}

/// `store.sentinel:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawSentinel {
    /// The name the sentinels know the master by.
    pub master: String,
    /// The sentinels' URLs.
    pub nodes: Vec<String>,
}

/// `store.hot_identities`: `{ above: 500/s, interval: 50ms }`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawHotIdentities {
    /// A decision rate on one node, `<n>/s`, `<n>/m` or `<n>/<duration>`.
    pub above: String,
    /// How long a rate is measured over (and the leases' trading interval).
    #[serde(default = "default_hot_interval")]
    pub interval: String,
}

/// `above` has no default, so the section cannot be `#[serde(default)]` as a whole.
fn default_hot_interval() -> String {
    "50ms".to_owned()
}

/// `store.breaker:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawBreaker {
    /// Failures in a row that open the breaker.
    pub failures: u32,
    /// How long an open breaker keeps calls away from the store.
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

/// Which store backs the limits.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Backend {
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
    pub(crate) fn is_shared(&self) -> bool {
        !matches!(self, Backend::Memory)
    }
}

/// `store.*`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct StoreSettings {
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
    /// Exact mode on Redis: denials remembered and repeated locally until their wait is over.
    pub deny_cache: bool,
    /// Exact mode on Redis: most calls out per node before decisions are coalesced (0: never).
    pub coalesce: usize,
    /// Exact mode on a shared store: identities decided from leases while their decision rate
    /// on this node is above a threshold.
    pub hot_identities: Option<HotIdentitySettings>,
    /// Several regions sharing the limits (`store.region`).
    pub region: Option<RegionConfig>,
}

/// `store.hot_identities`, checked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct HotIdentitySettings {
    /// Decisions per second on one node above which an identity is hot.
    pub above_per_second: u64,
    /// The measuring interval, and the leases' trading interval.
    pub interval: Duration,
}

/// The shortest and longest region sync intervals: trades cross oceans (a round trip of
/// 100 ms or more), and a share that moves once a minute follows no demand.
const REGION_INTERVALS: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(60));

/// Whether `name` can name a region: 1 to 32 letters, digits, `-` or `_` (it is part of
/// Redis keys and metrics).
fn is_region_name(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_')
}

/// Whether `url` looks like a Redis server's URL: `redis://` or `rediss://` and a host.
fn looks_like_redis_url(url: &str) -> bool {
    let rest = url
        .strip_prefix("redis://")
        .or_else(|| url.strip_prefix("rediss://"));
    rest.is_some_and(|rest| {
        let authority = rest.split('/').next().unwrap_or("");
        let host = authority.rsplit('@').next().unwrap_or("");
        !host.is_empty() && !host.starts_with(':')
    })
}

/// `store.region`, checked against the rest of `store`.
fn region(
    errors: &mut Errors,
    store: &RawStore,
    backend: Option<&Backend>,
) -> Option<RegionConfig> {
    let raw = store.region.as_ref()?;
    let mut check = RegionCheck {
        errors,
        valid: true,
    };
    region_placement(&mut check, store, raw, backend);
    let local = region_urls(&mut check, raw, backend);
    let (interval, lifetime, timeout) = region_timing(&mut check, raw);
    if !check.valid {
        return None;
    }
    let mut settings = floodgate::store::region::RegionSettings::new(
        raw.name.clone(),
        raw.regions.clone(),
        raw.global.clone(),
        local?,
        interval?,
    );
    settings.lease_lifetime = lifetime?;
    settings.timeout = timeout?;
    Some(RegionConfig { settings })
}

/// The errors of `store.region`, and whether there were none.
struct RegionCheck<'e> {
    errors: &'e mut Errors,
    valid: bool,
}

impl RegionCheck<'_> {
    fn fail(&mut self, path: &str, problem: impl Into<String>) {
        self.errors.push(path, problem);
        self.valid = false;
    }
}

/// `store.region`'s place in `store`: a shared backend, no `store.share`, and its regions,
/// each named once, this one among them.
fn region_placement(
    check: &mut RegionCheck<'_>,
    store: &RawStore,
    raw: &RawRegion,
    backend: Option<&Backend>,
) {
    if backend.is_some_and(|backend| !backend.is_shared()) {
        check.fail(
            "store.region",
            "needs a shared store (redis, redis_cluster or redis_sharded): each region decides \
             against its own Redis"
                .to_owned(),
        );
    }
    if store.share != 1.0 {
        check.fail(
            "store.share",
            "cannot be combined with store.region, whose fixed share is 1 / regions and moves \
             with the demand"
                .to_owned(),
        );
    }
    if raw.regions.is_empty() {
        check.fail(
            "store.region.regions",
            "needs at least one region".to_owned(),
        );
    }
    for (index, name) in raw.regions.iter().enumerate() {
        if !is_region_name(name) {
            check.fail(
                &format!("store.region.regions[{index}]"),
                format!("`{name}` is not a region name (1 to 32 letters, digits, - or _)"),
            );
        } else if raw.regions[..index].contains(name) {
            check.fail(
                &format!("store.region.regions[{index}]"),
                format!("`{name}` is listed twice"),
            );
        }
    }
    if !raw.regions.contains(&raw.name) {
        check.fail(
            "store.region.name",
            format!(
                "`{}` is not among store.region.regions ({})",
                raw.name,
                raw.regions.join(", ")
            ),
        );
    }
}

/// `store.region`'s URLs: the global store (a redis:// URL, not the region's own store) and
/// the region's own (`local`, or the backend's single URL); the latter, when there is one.
fn region_urls(
    check: &mut RegionCheck<'_>,
    raw: &RawRegion,
    backend: Option<&Backend>,
) -> Option<String> {
    if !looks_like_redis_url(&raw.global) {
        check.fail(
            "store.region.global",
            format!(
                "`{}` is not a redis:// URL of a server every region reaches",
                redact_url(&raw.global)
            ),
        );
    }
    let local = match (&raw.local, backend) {
        (Some(local), _) => Some(local.clone()),
        (None, Some(Backend::Redis { url, .. })) => Some(url.clone()),
        (None, Some(_)) => {
            check.fail(
                "store.region.local",
                "needed with this backend: the URL of one Redis in this region where its \
                 gateways share their table of shares"
                    .to_owned(),
            );
            None
        }
        (None, None) => None,
    };
    if let Some(local) = &local
        && !looks_like_redis_url(local)
    {
        check.fail(
            "store.region.local",
            format!("`{}` is not a redis:// URL", redact_url(local)),
        );
    }
    let own_urls: Vec<&str> = match backend {
        Some(Backend::Redis { url, .. }) => vec![url.as_str()],
        Some(Backend::RedisCluster { nodes, .. } | Backend::RedisSharded { nodes, .. }) => {
            nodes.iter().map(String::as_str).collect()
        }
        _ => Vec::new(),
    };
    if local.as_deref() == Some(raw.global.as_str()) || own_urls.contains(&raw.global.as_str()) {
        check.fail(
            "store.region.global",
            "must not be the region's own store: a region that cannot reach the global store \
             must still reach its own"
                .to_owned(),
        );
    }
    local
}

/// `store.region`'s durations: the sync interval (within [`REGION_INTERVALS`]), the lease
/// lifetime (two intervals to 10m; three intervals by default) and the timeout (at most 30s).
fn region_timing(
    check: &mut RegionCheck<'_>,
    raw: &RawRegion,
) -> (Option<Duration>, Option<Duration>, Option<Duration>) {
    let (shortest, longest) = REGION_INTERVALS;
    let interval = match positive_duration(&raw.sync_interval) {
        Ok(interval) if interval < shortest || interval > longest => {
            check.fail(
                "store.region.sync_interval",
                format!("must be between {shortest:?} and {longest:?}"),
            );
            None
        }
        Ok(interval) => Some(interval),
        Err(problem) => {
            check.fail("store.region.sync_interval", problem.to_string());
            None
        }
    };
    let lifetime = match (&raw.lease_lifetime, interval) {
        (None, interval) => interval.map(|interval| interval * 3),
        (Some(text), interval) => match positive_duration(text) {
            Ok(lifetime) if interval.is_some_and(|interval| lifetime < interval * 2) => {
                check.fail(
                    "store.region.lease_lifetime",
                    "must be at least two sync intervals (a grant is renewed once per interval)"
                        .to_owned(),
                );
                None
            }
            Ok(lifetime) if lifetime > Duration::from_secs(600) => {
                check.fail(
                    "store.region.lease_lifetime",
                    "must be at most 10m".to_owned(),
                );
                None
            }
            Ok(lifetime) => Some(lifetime),
            Err(problem) => {
                check.fail("store.region.lease_lifetime", problem.to_string());
                None
            }
        },
    };
    let timeout = match positive_duration(&raw.timeout) {
        Ok(timeout) if timeout > Duration::from_secs(30) => {
            check.fail("store.region.timeout", "must be at most 30s".to_owned());
            None
        }
        Ok(timeout) => Some(timeout),
        Err(problem) => {
            check.fail("store.region.timeout", problem.to_string());
            None
        }
    };
    (interval, lifetime, timeout)
}

/// A decision rate, `<n>/s`, `<n>/m`, `<n>/h` or `<n>/<duration>` (`3000/10s`), as decisions
/// per second (at least one).
fn per_second(text: &str) -> Result<u64, Problem> {
    let expected = || {
        Problem::from(format!(
            "expected a rate like 500/s or 30000/1m, got `{text}`"
        ))
    };
    let (count, per) = text.split_once('/').ok_or_else(expected)?;
    let count: u64 = count.trim().parse().map_err(|_| expected())?;
    let per = per.trim();
    let per = if per.starts_with(|c: char| c.is_ascii_digit()) {
        positive_duration(per)?
    } else {
        positive_duration(&format!("1{per}")).map_err(|_| expected())?
    };
    let rate = (count as f64 / per.as_secs_f64()).floor();
    if rate < 1.0 {
        return Err("must be at least 1 decision per second".into());
    }
    Ok(rate.min(u64::MAX as f64) as u64)
}

/// `store.hot_identities`, checked against the rest of `store`.
fn hot_identities(
    errors: &mut Errors,
    store: &RawStore,
    backend: Option<&Backend>,
    batched: bool,
) -> Option<HotIdentitySettings> {
    let raw = store.hot_identities.as_ref()?;
    if backend.is_some_and(|backend| !backend.is_shared()) {
        errors.push(
            "store.hot_identities",
            "needs a shared store (redis, redis_cluster or redis_sharded); the memory store \
             decides every identity locally already",
        );
    }
    if batched {
        errors.push(
            "store.hot_identities",
            "applies to exact mode; with store.sync_interval every identity is decided from \
             leases already",
        );
    }
    let above = errors.ok("store.hot_identities.above", per_second(&raw.above));
    let interval = errors.ok(
        "store.hot_identities.interval",
        bounded_sync_interval(&raw.interval),
    );
    Some(HotIdentitySettings {
        above_per_second: above?,
        interval: interval?,
    })
}

/// The longest batched sync interval: beyond it the overshoot bound (a node's admissions until
/// the next sync) stops meaning anything, and a huge value would overflow the timer.
pub(super) const MAX_SYNC_INTERVAL: Duration = Duration::from_secs(60);

/// A positive duration no longer than [`MAX_SYNC_INTERVAL`].
pub(super) fn bounded_sync_interval(text: &str) -> Result<Duration, Problem> {
    let value = positive_duration(text)?;
    if value > MAX_SYNC_INTERVAL {
        return Err("must be at most 1m".into());
    }
    Ok(value)
}

/// `store.backend` with its URLs, checked.
pub(super) fn store_backend(errors: &mut Errors, store: &RawStore) -> Option<Backend> {
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

pub(super) fn indexed<'a>(path: &str, urls: &'a [String]) -> Vec<(String, &'a String)> {
    urls.iter()
        .enumerate()
        .map(|(index, url)| (format!("{path}[{index}]"), url))
        .collect()
}

/// `store`, checked against the file's lists of limits (`limit_lists`, with their paths: a
/// batched store counts only some algorithms); `None` if any of it is invalid (the errors say
/// why).
pub(super) fn store(
    errors: &mut Errors,
    store: &RawStore,
    limit_lists: &[(String, &[RawLimit])],
) -> Option<StoreSettings> {
    let backend = store_backend(errors, store);
    let sync_interval = store
        .sync_interval
        .as_deref()
        .and_then(|text| errors.ok("store.sync_interval", bounded_sync_interval(text)));
    if sync_interval.is_some() {
        if backend.as_ref().is_some_and(|backend| !backend.is_shared()) {
            errors.push(
                "store.sync_interval",
                "needs a shared store (redis, redis_cluster or redis_sharded); the memory store \
                 is local already",
            );
        }
        for (path, raws) in limit_lists {
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
    let hot_identities = hot_identities(errors, store, backend.as_ref(), sync_interval.is_some());
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
    // The library's rule for the keys it lays out: the gateway's plan builds keys the same way.
    if floodgate::plan::check_key_prefix(&store.prefix).is_err() {
        errors.push(
            "store.prefix",
            "must be 1 to 64 characters, without braces or colons",
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
    let region = region(errors, store, backend.as_ref());
    Some(StoreSettings {
        backend: backend?,
        timeout: store_timeout?,
        prefix: store.prefix.clone(),
        breaker_failures: store.breaker.failures,
        breaker_open_for: open_for?,
        fallback_share: store.fallback_share,
        sync_interval,
        global_sync_interval,
        max_keys: store.max_keys,
        deny_cache: store.deny_cache,
        coalesce: store.coalesce,
        hot_identities,
        region,
    })
}

#[cfg(test)]
mod tests {
    use super::HotIdentitySettings;
    use crate::config::tests::errors_of;
    use crate::config::*;

    #[test]
    fn hot_identities_take_a_rate_and_an_interval_in_exact_mode_on_a_shared_store() {
        let config = parse(
            r#"
store: { backend: redis, hot_identities: { above: 30000/1m } }
plans:
  free:
    limits:
      - { name: s, algorithm: gcra, limit: 10, window: 1s }
      - { name: log, algorithm: sliding_window_log, limit: 10, window: 1s }
    endpoints: { "POST /x": [ { name: c, algorithm: concurrency, limit: 2 } ] }
  anonymous: {}
"#,
        )
        .unwrap();
        assert_eq!(
            config.store.hot_identities,
            Some(HotIdentitySettings {
                above_per_second: 500,
                interval: Duration::from_millis(50),
            })
        );
        let warnings = config.warnings(true);
        assert!(
            warnings
                .iter()
                .any(|warning| warning.starts_with("store.hot_identities:")
                    && warning.contains("plans.free.limits `log` (sliding_window_log)")
                    && warning.contains("`c` (concurrency)")
                    && !warning.contains("`s`")),
            "{warnings:?}"
        );
        for (store, path, problem) in [
            (
                "backend: redis, hot_identities: { above: 500/s, interval: 10ms }",
                "",
                "",
            ),
            (
                "backend: redis, hot_identities: { above: fast }",
                "store.hot_identities.above",
                "expected a rate like 500/s",
            ),
            (
                "backend: redis, hot_identities: { above: 1/1m }",
                "store.hot_identities.above",
                "at least 1 decision per second",
            ),
            (
                "backend: redis, hot_identities: { above: 5/s, interval: 2m }",
                "store.hot_identities.interval",
                "at most 1m",
            ),
            (
                "backend: redis, hot_identities: { above: 5/s, every: 1s }",
                "store.hot_identities",
                "unknown field `every`",
            ),
            (
                "backend: memory, hot_identities: { above: 5/s }",
                "store.hot_identities",
                "needs a shared store",
            ),
            (
                "backend: redis, sync_interval: 100ms, hot_identities: { above: 5/s }",
                "store.hot_identities",
                "applies to exact mode",
            ),
        ] {
            assert_store_problem(store, path, problem);
        }
    }

    /// That `store: { <store> }` is refused at `path` for `problem`, or accepted when `path`
    /// is empty.
    fn assert_store_problem(store: &str, path: &str, problem: &str) {
        let errors = errors_of(&format!(
            "store: {{ {store} }}\nplans: {{ free: {{}}, anonymous: {{}} }}\n"
        ));
        if path.is_empty() {
            assert!(errors.is_empty(), "{store}: {errors:?}");
            return;
        }
        assert!(
            errors
                .iter()
                .any(|error| error.starts_with(path) && error.contains(problem)),
            "{store}: {errors:?}"
        );
    }

    #[test]
    fn a_region_trades_through_a_global_store_it_names() {
        let config = parse(
            r#"
store:
  backend: redis
  url: "redis://redis.eu:6379"
  region: { name: eu, regions: [eu, us, ap], global: "redis://redis.us:6379", sync_interval: 500ms }
plans:
  free:
    limits:
      - { name: s, algorithm: token_bucket, limit: 300, window: 1s }
      - { name: log, algorithm: sliding_window_log, limit: 10, window: 1s }
      - { name: month, algorithm: fixed_window, limit: 10000, period: month }
  anonymous: {}
global:
  "GET /search": [ { name: searches, algorithm: sliding_window_log, limit: 50, window: 1s } ]
"#,
        )
        .unwrap();
        let region = &config.store.region.as_ref().unwrap().settings;
        assert_eq!(region.name, "eu");
        assert_eq!(region.regions, ["eu", "us", "ap"]);
        assert_eq!(region.global_url, "redis://redis.us:6379");
        assert_eq!(region.regional_url, "redis://redis.eu:6379");
        assert_eq!(region.sync_interval, Duration::from_millis(500));
        assert_eq!(region.lease_lifetime, Duration::from_millis(1500));
        let warnings = config.warnings(true);
        assert!(
            warnings
                .iter()
                .any(|warning| warning.starts_with("store.region:")
                    && warning.contains("1/3")
                    && warning.contains("`log` (sliding_window_log)")
                    && warning.contains("`month` (fixed_window)")
                    && warning.contains("global rule")
                    && warning.contains("`searches` (sliding_window_log)")
                    && !warning.contains("`s`")),
            "{warnings:?}"
        );
        let region = "name: eu, regions: [eu, us], global: \"redis://g:6379\"";
        for (store, path, problem) in [
            (
                format!("backend: redis, region: {{ {region} }}"),
                "",
                "",
            ),
            (
                format!("backend: memory, region: {{ {region} }}"),
                "store.region",
                "needs a shared store",
            ),
            (
                format!("backend: redis, share: 0.5, region: {{ {region} }}"),
                "store.share",
                "cannot be combined with store.region",
            ),
            (
                "backend: redis, region: { name: asia, regions: [eu, us], global: \"redis://g\" }"
                    .to_owned(),
                "store.region.name",
                "`asia` is not among store.region.regions (eu, us)",
            ),
            (
                "backend: redis, region: { name: eu, regions: [eu, \"u s\", eu], global: \"redis://g\" }"
                    .to_owned(),
                "store.region.regions[1]",
                "not a region name",
            ),
            (
                "backend: redis, region: { name: eu, regions: [eu, us, eu], global: \"redis://g\" }"
                    .to_owned(),
                "store.region.regions[2]",
                "listed twice",
            ),
            (
                "backend: redis, region: { name: eu, regions: [eu], global: \"http://g\" }"
                    .to_owned(),
                "store.region.global",
                "not a redis:// URL",
            ),
            (
                "backend: redis, region: { name: eu, regions: [eu], global: \"redis://:6379\" }"
                    .to_owned(),
                "store.region.global",
                "not a redis:// URL",
            ),
            (
                "backend: redis, url: \"redis://r:1\", region: { name: eu, regions: [eu], global: \"redis://r:1\" }"
                    .to_owned(),
                "store.region.global",
                "must not be the region's own store",
            ),
            (
                format!("backend: redis, region: {{ {region}, sync_interval: 10ms }}"),
                "store.region.sync_interval",
                "between 100ms and 60s",
            ),
            (
                format!("backend: redis, region: {{ {region}, sync_interval: 1s, lease_lifetime: 1s }}"),
                "store.region.lease_lifetime",
                "at least two sync intervals",
            ),
            (
                format!("backend: redis, region: {{ {region}, timeout: 0s }}"),
                "store.region.timeout",
                "greater than 0",
            ),
            (
                format!("backend: redis_cluster, nodes: [\"redis://c:1\"], region: {{ {region} }}"),
                "store.region.local",
                "needed with this backend",
            ),
            (
                format!("backend: redis_cluster, nodes: [\"redis://c:1\"], region: {{ {region}, local: \"redis://t:1\" }}"),
                "",
                "",
            ),
            (
                "backend: redis, region: { name: eu, regions: [], global: \"redis://g\" }"
                    .to_owned(),
                "store.region.regions",
                "needs at least one region",
            ),
            (
                format!("backend: redis, region: {{ {region}, local: \"tcp://t:1\" }}"),
                "store.region.local",
                "not a redis:// URL",
            ),
            (
                format!("backend: redis, region: {{ {region}, lease_lifetime: 11m }}"),
                "store.region.lease_lifetime",
                "at most 10m",
            ),
            (
                format!("backend: redis, region: {{ {region}, timeout: 31s }}"),
                "store.region.timeout",
                "at most 30s",
            ),
            (
                format!(
                    "backend: redis_cluster, nodes: [\"redis://g:6379\"], region: {{ {region}, local: \"redis://t:1\" }}"
                ),
                "store.region.global",
                "must not be the region's own store",
            ),
            (
                format!("backend: redis, region: {{ {region}, every: 1s }}"),
                "store.region",
                "unknown field `every`",
            ),
        ] {
            assert_store_problem(&store, path, problem);
        }
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
    fn the_prefix_follows_the_library_rule_for_keys() {
        let long = "p".repeat(65);
        let errors = errors_of(&format!("store: {{ prefix: \"{long}\" }}\n"));
        assert!(
            errors
                .iter()
                .any(|error| error.starts_with("store.prefix:")),
            "{errors:?}"
        );
        assert!(errors_of(&format!("store: {{ prefix: \"{}\" }}\n", "p".repeat(64))).is_empty());
    }
}
