//! Metrics of SPEC §8, through the `metrics` facade: without an installed recorder they cost
//! next to nothing; the gateway installs a Prometheus one. No label ever carries a client
//! identity, so the number of series is bounded by the configuration, not by the traffic.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

// Only plain data types of the crate (a limit's status, the store's errors), so that the
// store's failure machinery can record here without a module cycle.
use crate::decision::LimitStatus;
use crate::derived::DerivedCache;
use crate::store::error::{BreakerState, StoreError};

/// `floodgate_decisions_total{rule,limit,decision}`.
pub const DECISIONS_TOTAL: &str = "floodgate_decisions_total";
/// `floodgate_check_duration_seconds{store}`.
pub const CHECK_DURATION_SECONDS: &str = "floodgate_check_duration_seconds";
/// `floodgate_store_errors_total{kind}`.
pub const STORE_ERRORS_TOTAL: &str = "floodgate_store_errors_total";
/// `floodgate_breaker_state{store}`: 0 closed, 1 open, 2 half-open.
pub const BREAKER_STATE: &str = "floodgate_breaker_state";

/// `floodgate_batched_syncs_total{result}`: batched-mode sync calls, `ok` or `error`.
pub const BATCHED_SYNCS_TOTAL: &str = "floodgate_batched_syncs_total";
/// `floodgate_batched_dropped_units_total`: admitted units never delivered to the shared store
/// (older than their window when it came back).
pub const BATCHED_DROPPED_UNITS_TOTAL: &str = "floodgate_batched_dropped_units_total";

/// Counts one batched sync call.
pub fn record_batched_sync(succeeded: bool) {
    let result = if succeeded { "ok" } else { "error" };
    metrics::counter!(BATCHED_SYNCS_TOTAL, "result" => result).increment(1);
}

/// `floodgate_region_trades_total{result}`: a region's trades with the global store, `ok`,
/// `failed` or `stale` (SPEC §5, `store.region`).
pub const REGION_TRADES_TOTAL: &str = "floodgate_region_trades_total";
/// `floodgate_region_last_trade_age_seconds`: time since the region's last good trade, on the
/// gateway that trades for it.
pub const REGION_LAST_TRADE_AGE_SECONDS: &str = "floodgate_region_last_trade_age_seconds";
/// `floodgate_region_trader`: 1 on the gateway that trades for its region, else 0.
pub const REGION_TRADER: &str = "floodgate_region_trader";

/// Counts one trade of a region with the global store.
pub fn record_region_trade(result: &'static str) {
    metrics::counter!(REGION_TRADES_TOTAL, "result" => result).increment(1);
}

/// `floodgate_post_charge_units_total`: units charged after the response (SPEC §9).
pub const POST_CHARGE_UNITS_TOTAL: &str = "floodgate_post_charge_units_total";
/// `floodgate_post_charge_skipped_total{reason}`: responses whose cost was `missing`,
/// `malformed`, or not recorded because of a `store_error`.
pub const POST_CHARGE_SKIPPED_TOTAL: &str = "floodgate_post_charge_skipped_total";

/// Counts units post-charged for one response.
pub fn record_post_charge_units(units: u64) {
    metrics::counter!(POST_CHARGE_UNITS_TOTAL).increment(units);
}

/// `floodgate_refunded_units_total`: units given back after the response, when it reported
/// less than the up-front estimate (SPEC §9).
pub const REFUNDED_UNITS_TOTAL: &str = "floodgate_refunded_units_total";

/// Counts units refunded for one response.
pub fn record_refunded_units(units: u64) {
    metrics::counter!(REFUNDED_UNITS_TOTAL).increment(units);
}

/// Counts a response whose cost charged nothing more, by reason.
pub fn record_post_charge_skipped(reason: &'static str) {
    metrics::counter!(POST_CHARGE_SKIPPED_TOTAL, "reason" => reason).increment(1);
}

/// `floodgate_local_denials_total`: requests denied by a node from what Redis denied before,
/// without a call.
pub const LOCAL_DENIALS_TOTAL: &str = "floodgate_local_denials_total";

/// Counts a request denied locally.
pub fn record_local_denial() {
    metrics::counter!(LOCAL_DENIALS_TOTAL).increment(1);
}

/// `floodgate_hot_identities`: identities this node decides from leases now
/// (`store::hot`).
pub const HOT_IDENTITIES: &str = "floodgate_hot_identities";

/// `floodgate_hot_identity_changes_total{change}`: promotions of identities to lease-based
/// decisions (`change="promoted"`) and demotions back to exact ones (`"demoted"`).
pub const HOT_IDENTITY_CHANGES_TOTAL: &str = "floodgate_hot_identity_changes_total";

/// `floodgate_overrides_total{action}`: operators' changes of per-client overrides
/// (`action="set"`, `"removed"`, or `"refused"` when the bound on overrides in force was
/// reached).
pub const OVERRIDES_TOTAL: &str = "floodgate_overrides_total";

/// `floodgate_overrides_active`: overrides in force in this node's copy.
pub const OVERRIDES_ACTIVE: &str = "floodgate_overrides_active";

/// Counts a promotion (or a demotion) and sets the gauge of hot identities.
pub fn record_hot_identity_change(promoted: bool, hot_now: usize) {
    let change = if promoted { "promoted" } else { "demoted" };
    metrics::counter!(HOT_IDENTITY_CHANGES_TOTAL, "change" => change).increment(1);
    metrics::gauge!(HOT_IDENTITIES).set(hot_now as f64);
}

/// Counts units dropped by batched mode.
pub fn record_batched_dropped(units: u64) {
    metrics::counter!(BATCHED_DROPPED_UNITS_TOTAL).increment(units);
}

/// What happened to a request, as the `decision` label says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecisionLabel {
    /// Admitted by the store.
    Allowed,
    /// Denied (429).
    Limited,
    /// Would have been denied; shadow mode let it through.
    ShadowLimited,
    /// Allowlisted or limiting switched off: no check at all.
    Bypassed,
    /// Denylisted (403).
    Denylisted,
    /// The store failed and the failure policy admitted.
    FallbackAllowed,
    /// The store failed and the failure policy refused.
    FallbackLimited,
}

impl DecisionLabel {
    /// Every outcome, in the order of [`decision_totals`].
    pub const ALL: [DecisionLabel; 7] = [
        DecisionLabel::Allowed,
        DecisionLabel::Limited,
        DecisionLabel::ShadowLimited,
        DecisionLabel::Bypassed,
        DecisionLabel::Denylisted,
        DecisionLabel::FallbackAllowed,
        DecisionLabel::FallbackLimited,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionLabel::Allowed => "allowed",
            DecisionLabel::Limited => "limited",
            DecisionLabel::ShadowLimited => "shadow_limited",
            DecisionLabel::Bypassed => "bypassed",
            DecisionLabel::Denylisted => "denylisted",
            DecisionLabel::FallbackAllowed => "fallback_allowed",
            DecisionLabel::FallbackLimited => "fallback_limited",
        }
    }
}

/// Decisions of this process by outcome, readable in place (the metrics recorder's counters
/// are not): what a status page shows without scraping itself.
static DECISION_TOTALS: [AtomicU64; 7] = [const { AtomicU64::new(0) }; 7];

/// Decisions made in this process so far, by outcome, in the order of [`DecisionLabel::ALL`].
pub fn decision_totals() -> [(DecisionLabel, u64); 7] {
    DecisionLabel::ALL.map(|label| (label, DECISION_TOTALS[label as usize].load(Relaxed)))
}

/// Counts one decision.
pub fn record_decision(rule: &str, limit: &str, decision: DecisionLabel) {
    DECISION_TOTALS[decision as usize].fetch_add(1, Relaxed);
    metrics::counter!(
        DECISIONS_TOTAL,
        "rule" => rule.to_owned(),
        "limit" => limit.to_owned(),
        "decision" => decision.as_str()
    )
    .increment(1);
}

/// Counts a request an allowlist let through without a limit: one spelling of the event,
/// `rule="allowlist", limit="allowlist", decision="bypassed"`, whether the layer's allowlist or
/// the gateway's let it through.
pub fn record_allowlisted() {
    record_decision("allowlist", "allowlist", DecisionLabel::Bypassed);
}

/// Counts a request a denylist refused (403): `rule="denylist", limit="denylist",
/// decision="denylisted"`, from the layer's denylist or the gateway's.
pub fn record_denylisted() {
    record_decision("denylist", "denylist", DecisionLabel::Denylisted);
}

/// Counts one decision of a limit whose rule and name are shared strings: the labels share
/// them instead of copying them.
pub fn record_limit_decision(rule: &Arc<str>, limit: &Arc<str>, decision: DecisionLabel) {
    DECISION_TOTALS[decision as usize].fetch_add(1, Relaxed);
    count(&decision_key(rule, limit, decision));
}

/// [`record_limit_decision`] for the limit of `binding`, with its cached metric keys (this
/// runs on every request: no label allocated, none hashed).
pub(crate) fn record_binding_decision(binding: &LimitStatus, decision: DecisionLabel) {
    DECISION_TOTALS[decision as usize].fetch_add(1, Relaxed);
    with_metric_keys(binding, |keys| count(&keys.decisions[decision as usize]));
}

/// What the `counter!` macro would register a counter of this module under.
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// Adds one to the counter of `key` in the recorder installed now (none: nothing).
fn count(key: &metrics::Key) {
    metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA)).increment(1);
}

fn decision_key(rule: &Arc<str>, limit: &Arc<str>, decision: DecisionLabel) -> metrics::Key {
    metrics::Key::from_parts(
        DECISIONS_TOTAL,
        vec![
            metrics::Label::new("rule", metrics::SharedString::from_shared(rule.clone())),
            metrics::Label::new("limit", metrics::SharedString::from_shared(limit.clone())),
            metrics::Label::from_static_parts("decision", decision.as_str()),
        ],
    )
}

fn near_limit_key(rule: &Arc<str>, limit: &Arc<str>) -> metrics::Key {
    metrics::Key::from_parts(
        NEAR_LIMIT_TOTAL,
        vec![
            metrics::Label::new("rule", metrics::SharedString::from_shared(rule.clone())),
            metrics::Label::new("limit", metrics::SharedString::from_shared(limit.clone())),
        ],
    )
}

/// The per-request metric keys of one limit in one rule, built the first time the limit
/// decides in this thread: counting then costs a registry lookup by a hash computed once, not
/// labels allocated and hashed per request. A recorder installed later still gets every
/// count: the keys are looked up in whichever recorder is installed at each count.
struct MetricKeys {
    /// `floodgate_decisions_total`, by [`DecisionLabel`] (`label as usize`).
    decisions: [metrics::Key; 7],
    /// `floodgate_near_limit_total`.
    near_limit: metrics::Key,
}

impl MetricKeys {
    fn new(rule: &Arc<str>, limit: &Arc<str>) -> MetricKeys {
        MetricKeys {
            decisions: DecisionLabel::ALL.map(|label| decision_key(rule, limit, label)),
            near_limit: near_limit_key(rule, limit),
        }
    }
}

/// The metric keys of (rule, limit name) pairs, by the addresses of their shared strings.
type MetricKeysCache = DerivedCache<(Arc<str>, Arc<str>), MetricKeys, 1024>;

/// Runs `count` with the metric keys of `binding`'s limit in its rule, from this thread's
/// cache (keyed by the rule's and the name's shared strings: a limit shared by several rules
/// has keys for each).
fn with_metric_keys(binding: &LimitStatus, count: impl FnOnce(&MetricKeys)) {
    thread_local! {
        /// 1,024 slots: enough for every (rule, limit) a deployment decides on, each derived
        /// again only when a colliding one evicted it.
        static KEYS: RefCell<MetricKeysCache> =
            RefCell::new(DerivedCache::new());
    }
    KEYS.with_borrow_mut(|cache| {
        let shared = (&binding.rule, &binding.name);
        count(cache.get_or_derive(shared, || MetricKeys::new(&binding.rule, &binding.name)));
    });
}

/// Records how long a store check took.
pub fn record_check_duration(store: &'static str, elapsed: Duration) {
    thread_local! {
        /// The key of the store this thread checked last (one store, almost always).
        static LAST: std::cell::RefCell<Option<(&'static str, metrics::Key)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| {
        let key = match last {
            Some((name, key)) if *name == store => key,
            _ => {
                let label = metrics::Label::from_static_parts("store", store);
                &last
                    .insert((
                        store,
                        metrics::Key::from_parts(CHECK_DURATION_SECONDS, vec![label]),
                    ))
                    .1
            }
        };
        metrics::with_recorder(|recorder| recorder.register_histogram(key, &METADATA))
            .record(elapsed.as_secs_f64());
    });
}

/// Counts a store error by kind.
pub fn record_store_error(error: &StoreError) {
    record_store_error_kind(error.kind());
}

/// Counts a store error by its `kind` label ([`StoreError::kind`]).
pub fn record_store_error_kind(kind: &'static str) {
    metrics::counter!(STORE_ERRORS_TOTAL, "kind" => kind).increment(1);
}

/// Live breakers of each store backend, counted by state: a sharded or clustered store has one
/// breaker per node or slot, and the gauge shows the worst of them (open, else half-open, else
/// closed), not whichever moved last.
static BREAKERS: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<&'static str, [u64; 3]>>,
> = std::sync::LazyLock::new(Default::default);

/// A breaker of `store` came into being (`from: None`), changed state, or went away
/// (`to: None`); sets `floodgate_breaker_state{store}` to the worst state of its live breakers.
pub(crate) fn record_breaker_change(
    store: &'static str,
    from: Option<BreakerState>,
    to: Option<BreakerState>,
) -> BreakerState {
    let mut breakers = BREAKERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let counts = breakers.entry(store).or_default();
    if let Some(from) = from {
        counts[from as usize] = counts[from as usize].saturating_sub(1);
    }
    if let Some(to) = to {
        counts[to as usize] += 1;
    }
    let worst = if counts[BreakerState::Open as usize] > 0 {
        BreakerState::Open
    } else if counts[BreakerState::HalfOpen as usize] > 0 {
        BreakerState::HalfOpen
    } else {
        BreakerState::Closed
    };
    metrics::gauge!(BREAKER_STATE, "store" => store).set(worst as u8 as f64);
    worst
}

/// `floodgate_near_limit_total{rule,limit}`: admitted with less than 20% of the limit left.
pub const NEAR_LIMIT_TOTAL: &str = "floodgate_near_limit_total";

/// Counts an admission that left less than 20% of the binding limit.
pub fn record_near_limit(rule: &str, limit: &str) {
    metrics::counter!(NEAR_LIMIT_TOTAL, "rule" => rule.to_owned(), "limit" => limit.to_owned())
        .increment(1);
}

/// [`record_near_limit`] for the limit of `binding`, with its cached metric keys.
pub(crate) fn record_binding_near_limit(binding: &LimitStatus) {
    with_metric_keys(binding, |keys| count(&keys.near_limit));
}

/// `floodgate_limited_ratio`: share of decisions denied in the last baseline interval.
pub const LIMITED_RATIO: &str = "floodgate_limited_ratio";
/// `floodgate_limited_ratio_anomaly`: 1 while that share is more than 2σ from its trailing
/// baseline (the seeds' early warning: a 429 spike on normal traffic is a limiter bug).
pub const LIMITED_RATIO_ANOMALY: &str = "floodgate_limited_ratio_anomaly";

/// The 429-rate baseline: decisions and denials are counted lock-free; every interval,
/// [`LimitedRateBaseline::tick`] turns them into a ratio and compares it with the mean and
/// standard deviation of the trailing intervals.
///
/// An interval with fewer than [`LimitedRateBaseline::MIN_DECISIONS`] decisions says nothing
/// about the 429 share (no traffic at night, a handful of requests): it is neither an anomaly
/// nor part of the baseline, so silence after a busy evening neither raises the alarm nor drags
/// the baseline towards zero.
#[derive(Debug)]
pub struct LimitedRateBaseline {
    decisions: std::sync::atomic::AtomicU64,
    limited: std::sync::atomic::AtomicU64,
    history: std::sync::Mutex<std::collections::VecDeque<f64>>,
    window: usize,
}

/// What [`LimitedRateBaseline::tick`] made of the interval it closed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LimitedInterval {
    /// Decisions in the interval.
    pub decisions: u64,
    /// Their 429 share, or `None` when they were too few to mean anything.
    pub ratio: Option<f64>,
    /// Whether the share is more than 2σ from the trailing baseline.
    pub anomaly: bool,
}

/// The trailing baseline the next interval is compared with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BaselineSummary {
    /// Intervals it holds.
    pub intervals: usize,
    /// Their mean 429 share.
    pub mean: f64,
    /// Their standard deviation.
    pub deviation: f64,
}

impl Default for LimitedRateBaseline {
    fn default() -> Self {
        // 30 intervals of 10 s: a five-minute baseline.
        LimitedRateBaseline::new(30)
    }
}

impl LimitedRateBaseline {
    /// Fewest decisions for an interval's 429 share to count (below it, one request more or
    /// less moves the share by several percent).
    pub const MIN_DECISIONS: u64 = 20;

    /// A baseline over `window` trailing intervals.
    pub fn new(window: usize) -> Self {
        LimitedRateBaseline {
            decisions: Default::default(),
            limited: Default::default(),
            history: Default::default(),
            window: window.max(2),
        }
    }

    /// Counts one decision.
    pub fn record(&self, limited: bool) {
        self.decisions.fetch_add(1, Relaxed);
        if limited {
            self.limited.fetch_add(1, Relaxed);
        }
    }

    /// Closes an interval: its limited ratio and whether it is an anomaly (more than 2σ from
    /// the mean of the trailing intervals, with at least 5 of them); sets the gauges. An
    /// interval of too few decisions leaves the baseline as it was and is no anomaly.
    pub fn tick(&self) -> LimitedInterval {
        let decisions = self.decisions.swap(0, Relaxed);
        let limited = self.limited.swap(0, Relaxed);
        if decisions < Self::MIN_DECISIONS {
            metrics::gauge!(LIMITED_RATIO_ANOMALY).set(0.0);
            return LimitedInterval {
                decisions,
                ratio: None,
                anomaly: false,
            };
        }
        let ratio = limited as f64 / decisions as f64;
        let mut history = self
            .history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let anomaly = summarize(&history).is_some_and(|baseline| {
            // A floor on σ keeps a perfectly flat baseline from flagging noise.
            baseline.intervals >= 5
                && (ratio - baseline.mean).abs() > 2.0 * baseline.deviation.max(0.005)
        });
        history.push_back(ratio);
        while history.len() > self.window {
            history.pop_front();
        }
        metrics::gauge!(LIMITED_RATIO).set(ratio);
        metrics::gauge!(LIMITED_RATIO_ANOMALY).set(if anomaly { 1.0 } else { 0.0 });
        LimitedInterval {
            decisions,
            ratio: Some(ratio),
            anomaly,
        }
    }

    /// The trailing baseline as it stands (`None` before the first interval that counted).
    pub fn summary(&self) -> Option<BaselineSummary> {
        summarize(
            &self
                .history
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

fn summarize(history: &std::collections::VecDeque<f64>) -> Option<BaselineSummary> {
    if history.is_empty() {
        return None;
    }
    let n = history.len() as f64;
    let mean = history.iter().sum::<f64>() / n;
    let variance = history
        .iter()
        .map(|value| (value - mean).powi(2))
        .sum::<f64>()
        / n;
    Some(BaselineSummary {
        intervals: history.len(),
        mean,
        deviation: variance.sqrt(),
    })
}

/// `floodgate_unidentified_requests_total`: requests whose client could not be identified.
pub const UNIDENTIFIED_REQUESTS_TOTAL: &str = "floodgate_unidentified_requests_total";

/// Histogram buckets (seconds) that resolve a store check: 100 µs to 1 s. Without buckets a
/// Prometheus recorder renders histograms as summaries.
pub const CHECK_DURATION_BUCKETS: &[f64] = &[
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// What kind of series a metric is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
    /// A distribution (`_bucket`, `_sum`, `_count`).
    Histogram,
}

/// A metric's name, kind and `# HELP` text: one table per crate lists every metric it records,
/// so that none goes undescribed.
#[derive(Clone, Copy, Debug)]
pub struct MetricDescription {
    /// The Prometheus name.
    pub name: &'static str,
    /// Its kind.
    pub kind: MetricKind,
    /// Whether it measures seconds (its unit).
    pub seconds: bool,
    /// The `# HELP` text.
    pub help: &'static str,
}

/// Every metric the library records.
pub const METRICS: &[MetricDescription] = &[
    MetricDescription {
        name: crate::adaptive::ADAPTIVE_LIMIT,
        kind: MetricKind::Gauge,
        seconds: false,
        help: "The adaptive concurrency limit in force, by limiter (in the gateway, its upstream)",
    },
    MetricDescription {
        name: crate::adaptive::ADAPTIVE_SHED_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Requests adaptive concurrency refused (mode enforce) or would have (mode shadow), by limiter and class",
    },
    MetricDescription {
        name: crate::adaptive::ADAPTIVE_PEAK_IN_FLIGHT,
        kind: MetricKind::Gauge,
        seconds: false,
        help: "The most requests adaptive concurrency had in flight at once in its last window, by limiter",
    },
    MetricDescription {
        name: crate::adaptive::ADAPTIVE_LATENCY_SECONDS,
        kind: MetricKind::Gauge,
        seconds: true,
        help: "The latency adaptive concurrency sampled in its last window (its percentile), by limiter",
    },
    MetricDescription {
        name: crate::adaptive::ADAPTIVE_MIN_RTT_SECONDS,
        kind: MetricKind::Gauge,
        seconds: true,
        help: "The minimum round trip adaptive concurrency learned, by limiter",
    },
    MetricDescription {
        name: crate::adaptive::ADAPTIVE_WAITED_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Requests adaptive concurrency admitted after they waited for a place, by limiter and class",
    },
    MetricDescription {
        name: DECISIONS_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Rate limit decisions by rule, limit and outcome (allowed, limited, shadow_limited, bypassed, denylisted, fallback_allowed, fallback_limited)",
    },
    MetricDescription {
        name: CHECK_DURATION_SECONDS,
        kind: MetricKind::Histogram,
        seconds: true,
        help: "Time of one check-and-consume against the store, by store backend",
    },
    MetricDescription {
        name: STORE_ERRORS_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Store calls that failed, by kind",
    },
    MetricDescription {
        name: BREAKER_STATE,
        kind: MetricKind::Gauge,
        seconds: false,
        help: "The store's circuit breaker: 0 closed, 1 open, 2 half-open (the worst of its nodes)",
    },
    MetricDescription {
        name: REGION_TRADES_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "A region's trades of its shares with the global store, by result",
    },
    MetricDescription {
        name: REGION_LAST_TRADE_AGE_SECONDS,
        kind: MetricKind::Gauge,
        seconds: true,
        help: "Time since the region's last good trade with the global store (on its trader)",
    },
    MetricDescription {
        name: REGION_TRADER,
        kind: MetricKind::Gauge,
        seconds: false,
        help: "1 on the gateway that trades for its region, else 0",
    },
    MetricDescription {
        name: BATCHED_SYNCS_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Batched-mode sync calls to the shared store, by result",
    },
    MetricDescription {
        name: BATCHED_DROPPED_UNITS_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Admitted units a batched node never delivered (older than their window when the store came back)",
    },
    MetricDescription {
        name: LOCAL_DENIALS_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Requests a node denied from what Redis denied before, without a store call",
    },
    MetricDescription {
        name: NEAR_LIMIT_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Admitted requests with under 20% of their binding limit left, by rule and limit",
    },
    MetricDescription {
        name: LIMITED_RATIO,
        kind: MetricKind::Gauge,
        seconds: false,
        help: "Share of decisions answered 429 over the last interval",
    },
    MetricDescription {
        name: LIMITED_RATIO_ANOMALY,
        kind: MetricKind::Gauge,
        seconds: false,
        help: "1 while the 429 share is more than 2 sigma from its trailing 5-minute baseline",
    },
    MetricDescription {
        name: POST_CHARGE_UNITS_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Units charged after the response, from the cost it reported",
    },
    MetricDescription {
        name: REFUNDED_UNITS_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Units given back after the response, which reported less than the up-front estimate",
    },
    MetricDescription {
        name: POST_CHARGE_SKIPPED_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Responses whose reported cost charged nothing more, by reason (missing, malformed, store_error)",
    },
    MetricDescription {
        name: HOT_IDENTITIES,
        kind: MetricKind::Gauge,
        seconds: false,
        help: "Identities this node decides from leases (hot identities), not one call per decision",
    },
    MetricDescription {
        name: HOT_IDENTITY_CHANGES_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Hot identity promotions to lease-based decisions and demotions back to exact ones, by change",
    },
    MetricDescription {
        name: OVERRIDES_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Operators' changes of per-client limit overrides, by action (set, removed, refused)",
    },
    MetricDescription {
        name: OVERRIDES_ACTIVE,
        kind: MetricKind::Gauge,
        seconds: false,
        help: "Per-client limit overrides in force in this node's copy",
    },
    MetricDescription {
        name: UNIDENTIFIED_REQUESTS_TOTAL,
        kind: MetricKind::Counter,
        seconds: false,
        help: "Requests whose client could not be identified (no API key, user or peer address)",
    },
];

/// Registers the unit and `# HELP` text of each of `metrics` with the installed recorder.
pub fn describe(metrics: &[MetricDescription]) {
    metrics::with_recorder(|recorder| {
        for metric in metrics {
            let unit = metric.seconds.then_some(metrics::Unit::Seconds);
            let key = metrics::KeyName::from_const_str(metric.name);
            let help = metrics::SharedString::const_str(metric.help);
            match metric.kind {
                MetricKind::Counter => recorder.describe_counter(key, unit, help),
                MetricKind::Gauge => recorder.describe_gauge(key, unit, help),
                MetricKind::Histogram => recorder.describe_histogram(key, unit, help),
            }
        }
    });
}

/// Gives every metric the library records its unit and `# HELP` text ([`METRICS`]). Call it
/// once after installing a recorder (the `prometheus` feature's `install_prometheus` does).
pub fn describe_metrics() {
    describe(METRICS);
}

/// Installs a Prometheus recorder for this process with the check-duration buckets and the
/// descriptions of [`describe_metrics`]; returns the handle whose `render()` is the
/// `/metrics` text. The caller still runs `handle.run_upkeep()` every few seconds.
///
/// ```no_run
/// let metrics = floodgate::telemetry::install_prometheus()?;
/// // axum: .route("/metrics", get(move || std::future::ready(metrics.render())))
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[cfg(feature = "prometheus")]
pub fn install_prometheus()
-> Result<metrics_exporter_prometheus::PrometheusHandle, metrics_exporter_prometheus::BuildError> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(CHECK_DURATION_BUCKETS)?
        .install_recorder()?;
    describe_metrics();
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breaker_gauge_shows_the_worst_live_breaker() {
        use BreakerState::{Closed, HalfOpen, Open};
        let store = "gauge-test";
        assert_eq!(record_breaker_change(store, None, Some(Closed)), Closed);
        assert_eq!(record_breaker_change(store, None, Some(Closed)), Closed);
        assert_eq!(record_breaker_change(store, Some(Closed), Some(Open)), Open);
        assert_eq!(
            record_breaker_change(store, Some(Closed), Some(HalfOpen)),
            Open,
            "one open breaker outweighs a half-open one"
        );
        assert_eq!(
            record_breaker_change(store, Some(Open), Some(Closed)),
            HalfOpen
        );
        assert_eq!(record_breaker_change(store, Some(HalfOpen), None), Closed);
    }

    #[test]
    fn a_429_spike_leaves_the_baseline() {
        let baseline = LimitedRateBaseline::new(30);
        for interval in 0..20 {
            for request in 0..1000 {
                // 1% to 2% limited, varying a little.
                baseline.record(request % 100 < 1 + interval % 2);
            }
            assert!(!baseline.tick().anomaly, "steady traffic is no anomaly");
        }
        for request in 0..1000 {
            baseline.record(request % 100 < 30);
        }
        let interval = baseline.tick();
        assert!((interval.ratio.unwrap() - 0.30).abs() < 1e-9);
        assert!(interval.anomaly, "30% limited against a 1-2% baseline");
    }

    /// Traffic with 429s, then silence (every night): the silent intervals are no anomaly, and
    /// the baseline afterwards is the one before them. Before, an interval without decisions
    /// was a 429 share of 0.0, flagged against a baseline of 20% and pushed into it.
    #[test]
    fn silence_after_traffic_is_no_anomaly_and_leaves_the_baseline() {
        let baseline = LimitedRateBaseline::new(30);
        for interval in 0..10 {
            for request in 0..500 {
                baseline.record(request % 100 < 19 + interval % 3);
            }
            assert!(!baseline.tick().anomaly);
        }
        let before = baseline.summary().expect("a baseline");
        for _ in 0..20 {
            let silent = baseline.tick();
            assert!(!silent.anomaly, "an interval without traffic is no anomaly");
            assert_eq!(silent.ratio, None);
        }
        // A handful of decisions, all limited, says nothing either.
        for _ in 0..LimitedRateBaseline::MIN_DECISIONS - 1 {
            baseline.record(true);
        }
        assert!(!baseline.tick().anomaly);
        assert_eq!(baseline.summary(), Some(before));
    }
}
