//! The admin API's answers (SPEC §7) as types: every JSON body the API sends is one of these,
//! serialized, so that a body's fields are named once and checked by the compiler.

use std::collections::BTreeMap;

use floodgate::decision::LimitStatus;
use floodgate::key::ClientTag;
use floodgate::overrides::Override;
use floodgate::store::Check;
use floodgate::time::Timestamp;
use serde::Serialize;

use crate::admin::inspect::Selected;
use crate::plan::is_global_ceiling;

/// A refusal or a failure: `{"error": "<what>", "detail": "<why>"}` (`detail` when there is
/// more to say).
#[derive(Debug, Serialize)]
pub(crate) struct Failure {
    error: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

impl Failure {
    /// A failure named by `error` alone.
    pub(crate) fn new(error: impl Into<String>) -> Failure {
        Failure {
            error: error.into(),
            detail: None,
        }
    }

    /// A failure named by `error`, with what went wrong.
    pub(crate) fn with_detail(error: impl Into<String>, detail: impl Into<String>) -> Failure {
        Failure {
            error: error.into(),
            detail: Some(detail.into()),
        }
    }
}

/// `/readyz` when the store refuses this gateway (a configuration error).
#[derive(Debug, Serialize)]
pub(crate) struct StoreRejected {
    pub(crate) status: &'static str,
    pub(crate) error: String,
}

/// `/readyz`: whether this gateway serves, and each plan's policy while the store is down.
#[derive(Debug, Serialize)]
pub(crate) struct Readiness<'a> {
    pub(crate) status: &'static str,
    pub(crate) version: u64,
    pub(crate) store_reachable: bool,
    pub(crate) plans: BTreeMap<&'a str, PlanReadiness>,
}

/// One plan in [`Readiness`].
#[derive(Debug, Serialize)]
pub(crate) struct PlanReadiness {
    pub(crate) on_store_error: &'static str,
    pub(crate) serving: bool,
}

/// `POST /admin/reload`, applied.
#[derive(Debug, Serialize)]
pub(crate) struct Reloaded {
    pub(crate) status: &'static str,
    pub(crate) version: u64,
}

/// `GET /admin/config`: the version in service, redacted.
#[derive(Debug, Serialize)]
pub(crate) struct ActiveConfig<'a> {
    pub(crate) version: u64,
    pub(crate) loaded_at: u64,
    pub(crate) config: &'a serde_json::Value,
}

/// `GET /admin/top`.
#[derive(Debug, Serialize)]
pub(crate) struct TopClients<'a> {
    pub(crate) window_seconds: u64,
    pub(crate) local_identities: &'a [String],
    pub(crate) by_denials: Vec<TopClient>,
    pub(crate) by_closeness: Vec<TopClient>,
}

/// One client of [`TopClients`].
#[derive(Debug, Serialize)]
pub(crate) struct TopClient {
    /// Decided from this node's leases (a hot identity).
    pub(crate) local: bool,
    pub(crate) identity: String,
    pub(crate) denials: u64,
    /// To three decimals.
    pub(crate) closeness: f64,
}

/// `GET /admin/status`: the status page's poll, the observations of
/// [`crate::status::StatusBoard::report`] with the version, store and overrides beside them.
#[derive(Debug, Serialize)]
pub(crate) struct Status {
    #[serde(flatten)]
    pub(crate) observed: crate::status::Observed,
    pub(crate) version: u64,
    pub(crate) loaded_at: u64,
    pub(crate) mode: &'static str,
    pub(crate) store: StoreState,
    pub(crate) overrides_in_force: usize,
    /// The first 100.
    pub(crate) overrides: Vec<OverrideView>,
}

/// The store in [`Status`].
#[derive(Debug, Serialize)]
pub(crate) struct StoreState {
    pub(crate) backend: &'static str,
    pub(crate) breaker: Option<&'static str>,
    /// With `store.region`: the region and its trades with the global store.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) region: Option<RegionState>,
}

/// A region's trading as this gateway sees it. `global` is `healthy` (the last good trade
/// within two intervals; a trader that has not traded yet counts from its start),
/// `unreachable` (none since: shares lapse to the fixed ones), `other_gateway` (another
/// gateway of the region trades; this one syncs), or `region_store_unreachable` (this gateway's
/// syncs with its region's table fail: it decides tradeable limits at one unit).
#[derive(Debug, Serialize)]
pub(crate) struct RegionState {
    name: String,
    regions: Vec<String>,
    global: &'static str,
    trader: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    since_last_good_trade_seconds: Option<f64>,
    trades_ok: u64,
    trades_failed: u64,
    trades_stale: u64,
    moved_shares: u64,
}

impl RegionState {
    /// `region`'s state now.
    pub(crate) fn of(region: &floodgate::store::region::RegionalStore) -> RegionState {
        use floodgate::store::region::TradeResult;
        let status = region.status();
        let settings = region.settings();
        let since = status.since_last_good_trade();
        let fresh = |age: Option<std::time::Duration>| {
            age.is_some_and(|age| age <= settings.sync_interval * 2)
        };
        let global = match since {
            // Not the trader: because another gateway is, or because this one cannot reach
            // its region's store.
            None if fresh(status.since_last_sync()) => "other_gateway",
            None => "region_store_unreachable",
            Some(since) if fresh(Some(since)) => "healthy",
            Some(_) => "unreachable",
        };
        RegionState {
            name: settings.name.clone(),
            regions: settings.regions.clone(),
            global,
            trader: status.is_trader(),
            since_last_good_trade_seconds: since.map(seconds),
            trades_ok: status.trades(TradeResult::Ok),
            trades_failed: status.trades(TradeResult::Failed),
            trades_stale: status.trades(TradeResult::Stale),
            moved_shares: status.moved_shares(),
        }
    }
}

/// `GET /admin/clients`: a client's limits as they stand.
#[derive(Debug, Serialize)]
pub(crate) struct InspectedClient {
    pub(crate) identity: String,
    pub(crate) scope: String,
    /// Decided from this node's leases (a hot identity).
    pub(crate) local: bool,
    pub(crate) plan: String,
    pub(crate) listed: Option<&'static str>,
    pub(crate) store: &'static str,
    pub(crate) limits: Vec<LimitView>,
}

impl InspectedClient {
    /// `selected`'s answer, with its `limits`.
    pub(crate) fn new(
        selected: &Selected,
        local: bool,
        store: &'static str,
        limits: Vec<LimitView>,
    ) -> InspectedClient {
        InspectedClient {
            identity: selected.hash.to_string(),
            scope: selected.scope.clone(),
            local,
            plan: selected.plan.to_string(),
            listed: selected.listed,
            store,
            limits,
        }
    }
}

/// One limit of an inspected client. `view` says whose state it is: `shared` (every
/// gateway's) or `node` (this gateway's batched copy, up to one sync interval behind the
/// others).
#[derive(Debug, Serialize)]
pub(crate) struct LimitView {
    rule: String,
    name: String,
    algorithm: &'static str,
    limit: u64,
    window_seconds: f64,
    remaining: u64,
    reset_after: f64,
    retry_after: Option<f64>,
    allowed: bool,
    shared_by_all_clients: bool,
    view: &'static str,
    /// The override in force on this limit, if any.
    #[serde(rename = "override", skip_serializing_if = "Option::is_none")]
    pub(crate) in_force: Option<OverrideView>,
    /// For a quota (a fixed window of a day or longer): what the period has used and left.
    #[serde(skip_serializing_if = "Option::is_none")]
    quota: Option<QuotaView>,
    /// With `store.region`: this region's share of the limit in force here (`limit` and
    /// `remaining` above are of the share).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) region_share: Option<RegionShareView>,
}

/// A region's share of one limit: `units` of the configured `of`, its `fixed` share, whether
/// it `trades`, and how long a raised share lasts unless renewed.
#[derive(Debug, Serialize)]
pub(crate) struct RegionShareView {
    region: String,
    units: u64,
    of: u64,
    fixed: u64,
    trades: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    raised_for_seconds: Option<f64>,
}

impl RegionShareView {
    /// `region`'s share of `check`'s limit as it stands on this gateway.
    pub(crate) fn of(region: &floodgate::store::region::RegionalStore, check: &Check) -> Self {
        let share = region.share_of(&check.key, &check.limit);
        RegionShareView {
            region: region.settings().name.clone(),
            units: share.units,
            of: check.limit.limit(),
            fixed: share.fixed,
            trades: floodgate::store::region::trades(&check.limit),
            raised_for_seconds: share.raised_for.map(seconds),
        }
    }
}

/// A quota's period as it stands: `used` and `left` of its `limit`, and when the period ends
/// (RFC 3339, UTC), when its count starts again.
#[derive(Debug, Serialize)]
pub(crate) struct QuotaView {
    used: u64,
    left: u64,
    period_ends_at: String,
}

impl LimitView {
    /// `status` of `check` as read at `read_at`, as this node sees it (`batched`) or as every
    /// node does.
    pub(crate) fn new(
        status: &LimitStatus,
        check: &Check,
        batched: bool,
        read_at: Timestamp,
    ) -> LimitView {
        let definition = status.definition();
        let quota = (definition.algorithm() == floodgate::Algorithm::FixedWindow
            && definition.window() >= crate::config::QUOTA_WINDOW)
            .then(|| QuotaView {
                used: status.limit.saturating_sub(status.remaining),
                left: status.remaining,
                period_ends_at: crate::access_log::rfc3339(
                    std::time::UNIX_EPOCH
                        + std::time::Duration::from_micros(read_at.as_micros())
                        + status.reset_after,
                ),
            });
        LimitView {
            rule: status.rule.to_string(),
            name: status.name.to_string(),
            algorithm: status.definition().algorithm().as_str(),
            limit: status.limit,
            window_seconds: seconds(status.window),
            remaining: status.remaining,
            reset_after: seconds(status.reset_after),
            retry_after: status.retry_after.map(seconds),
            allowed: status.allowed,
            shared_by_all_clients: is_global_ceiling(check),
            view: if batched { "node" } else { "shared" },
            in_force: None,
            quota,
            region_share: None,
        }
    }
}

/// An override as the admin API shows it.
#[derive(Debug, Serialize)]
pub(crate) struct OverrideView {
    identity: String,
    scope: String,
    rule: String,
    name: String,
    limit: u64,
    window_seconds: f64,
    burst: Option<u64>,
    expires_in: u64,
    expires_at: u64,
    set_at: u64,
    /// The plan of the client it was set for (`PUT` answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) plan: Option<String>,
}

impl OverrideView {
    /// `entry` as it stands at `now`.
    pub(crate) fn new(entry: &Override, now: Timestamp) -> OverrideView {
        let ClientTag { scope, hash } = ClientTag::parse(entry.client()).unwrap_or(ClientTag {
            scope: "",
            hash: entry.client(),
        });
        OverrideView {
            identity: hash.to_owned(),
            scope: scope.to_owned(),
            rule: entry.rule.to_string(),
            name: entry.name.to_string(),
            limit: entry.limit,
            window_seconds: seconds(entry.window),
            burst: entry.burst,
            expires_in: entry.remaining_secs(now),
            expires_at: entry.expires_at.as_secs_ceil(),
            set_at: entry.set_at.as_micros() / 1_000_000,
            plan: None,
        }
    }
}

/// `DELETE /admin/clients`: the limits reset.
#[derive(Debug, Serialize)]
pub(crate) struct Reset {
    pub(crate) identity: String,
    pub(crate) plan: String,
    pub(crate) reset: Vec<LimitName>,
    /// Keys the store held state for.
    pub(crate) keys_with_state: u64,
}

/// A limit by its rule and name.
#[derive(Debug, Serialize)]
pub(crate) struct LimitName {
    pub(crate) rule: String,
    pub(crate) name: String,
}

/// `GET /admin/clients/overrides` without a client: a page of every override.
#[derive(Debug, Serialize)]
pub(crate) struct OverridePage {
    pub(crate) total: usize,
    pub(crate) overrides: Vec<OverrideView>,
    /// What to pass as `after` for the next page; `null` on the last.
    pub(crate) next: Option<String>,
}

/// `GET /admin/clients/overrides` for a client.
#[derive(Debug, Serialize)]
pub(crate) struct ClientOverrides {
    pub(crate) identity: String,
    pub(crate) scope: String,
    pub(crate) plan: String,
    pub(crate) overrides: Vec<OverrideView>,
}

/// `DELETE /admin/clients/overrides`: the limits whose override ended.
#[derive(Debug, Serialize)]
pub(crate) struct OverridesRemoved {
    pub(crate) identity: String,
    pub(crate) plan: String,
    pub(crate) removed: Vec<String>,
}

/// Seconds with millisecond precision.
pub(crate) fn seconds(duration: std::time::Duration) -> f64 {
    (duration.as_secs_f64() * 1000.0).round() / 1000.0
}

/// `GET /admin/adaptive`: each upstream's adaptive limiter (`adaptive_concurrency`).
#[derive(Debug, Serialize)]
pub(crate) struct AdaptiveUpstreams {
    /// Whether `adaptive_concurrency` is configured.
    pub configured: bool,
    /// One entry per upstream that has had a request since the settings were applied.
    pub upstreams: Vec<AdaptiveUpstream>,
}

/// One upstream's limiter.
#[derive(Debug, Serialize)]
pub(crate) struct AdaptiveUpstream {
    /// `scheme://host:port`.
    pub upstream: String,
    /// The concurrency limit in force.
    pub limit: u32,
    /// Requests in flight to it.
    pub in_flight: u32,
    /// The minimum round trip learned, in milliseconds.
    pub min_rtt_ms: Option<f64>,
    /// The last window's sampled latency, in milliseconds.
    pub sample_latency_ms: Option<f64>,
    /// Each class, highest first.
    pub classes: Vec<AdaptiveClass>,
}

/// One class's counts.
#[derive(Debug, Serialize)]
pub(crate) struct AdaptiveClass {
    /// Its name.
    pub name: String,
    /// Its requests in flight.
    pub in_flight: u32,
    /// Requests admitted since the settings were applied.
    pub admitted: u64,
    /// Requests shed (or, in shadow, that would have been) since then.
    pub refused: u64,
    /// Requests waiting for a place now (`classes[].wait`).
    pub waiting: u32,
    /// Requests admitted after a wait since then (also in `admitted`).
    pub waited: u64,
}

impl AdaptiveUpstream {
    pub(crate) fn of(upstream: String, snapshot: &floodgate::adaptive::AdaptiveSnapshot) -> Self {
        let millis = |duration: std::time::Duration| duration.as_secs_f64() * 1_000.0;
        AdaptiveUpstream {
            upstream,
            limit: snapshot.gate.limit,
            in_flight: snapshot.gate.in_flight,
            min_rtt_ms: snapshot.min_rtt.map(millis),
            sample_latency_ms: snapshot.sample_latency.map(millis),
            classes: snapshot
                .gate
                .classes
                .iter()
                .map(|class| AdaptiveClass {
                    name: class.name.to_string(),
                    in_flight: class.in_flight,
                    admitted: class.admitted,
                    refused: class.refused,
                    waiting: class.waiting,
                    waited: class.waited,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_names_its_detail_only_when_it_has_one() {
        let plain = serde_json::to_value(Failure::new("unauthorized")).unwrap();
        assert_eq!(plain, serde_json::json!({"error": "unauthorized"}));
        let detailed = serde_json::to_value(Failure::with_detail("a", "b")).unwrap();
        assert_eq!(detailed, serde_json::json!({"error": "a", "detail": "b"}));
    }

    #[test]
    fn an_override_names_its_client_by_tag_and_its_times_in_seconds() {
        let entry = Override {
            target: "fg:key:0123:api:hour".into(),
            rule: "api".into(),
            name: "hour".into(),
            limit: 500,
            window: std::time::Duration::from_millis(1500),
            burst: None,
            set_at: Timestamp::from_secs(100),
            expires_at: Timestamp::from_secs(160),
        };
        let view = serde_json::to_value(OverrideView::new(&entry, Timestamp::from_secs(130)));
        let view = view.unwrap();
        assert_eq!(view["window_seconds"], 1.5);
        assert_eq!(view["expires_in"], 30);
        assert_eq!(view["set_at"], 100);
        assert_eq!(view["burst"], serde_json::Value::Null);
        assert!(view.get("plan").is_none(), "{view}");
    }
}
