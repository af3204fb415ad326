//! One Envoy's stream: its reports read, its buckets assigned and kept fresh, its idle buckets
//! abandoned, and what it may still enforce handed to the board when it leaves.
//!
//! Every reported bucket is a *holding* of this stream. A holding under a limit claims its
//! share on the board at each report (its demand: what it allowed and denied over the time
//! elapsed, a quarter more) and when the board says some holder is short (then every second,
//! so that shares move within a second or two rather than a report interval). An assignment
//! is sent only for a bucket the Envoy reported (an action for any other is dropped by Envoy),
//! always with a whole-second time to live of three report intervals, re-sent before it ends.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use floodgate::FailurePolicy;
use floodgate::store::StoreError;
use floodgate::store::quota::{Claim, Grant, Held};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::assignment::{self, Strategy};
use super::buckets::{self, Target};
use super::counters::StreamCounters;
use super::{HoldingView, Shared};
use crate::config::{Config, QuotaSettings};
use crate::telemetry;
use crate::version::ConfigVersion;

/// How often a stream looks at its holdings between reports, and how long a lowered Envoy is
/// still counted at what it had (the lower assignment's way to it): a fifth of the report
/// interval, between 100 ms and a second.
fn step_of(config: &Config) -> Duration {
    quota_settings(config).map_or(Duration::from_secs(1), |settings| {
        (settings.report_interval / 5).clamp(Duration::from_millis(100), Duration::from_secs(1))
    })
}

/// An assignment sent, and when it ends at the Envoy.
#[derive(Clone, Copy, Debug)]
struct Sent {
    strategy: Strategy,
    /// The share it enforces on the board (0 for a blanket rule).
    share: u64,
    at: Instant,
    expires: Instant,
}

/// One reported bucket of this stream.
struct Holding {
    bucket: BucketId,
    /// The board's name for this Envoy's use of the bucket.
    holder: String,
    target: Target,
    /// The stream's epoch `target` was matched in (0: not yet).
    target_epoch: u64,
    /// Thousandths of a request per second: the larger of the last two reports' (a few
    /// requests per interval are a noisy count, and a drop that lasts one report is not worth
    /// a new assignment).
    demand_milli: u64,
    /// The last report's alone.
    last_demand_milli: u64,
    /// Reports in a row without a request.
    idle_reports: u32,
    sent: Option<Sent>,
    /// The assignment before `sent`, which the Envoy enforces until `sent` reaches it.
    earlier: Option<Sent>,
    /// The board said some holder of this limit is short (or the board failed): claim again
    /// at the next step.
    pressed: bool,
    fair_milli: u64,
    /// When the Envoy last reported it.
    reported: Instant,
}

impl Holding {
    /// What the Envoy may be enforcing at `now`: the share last sent until it ends, and the
    /// one before until the last has surely reached it.
    fn in_force(&self, now: Instant, settle: Duration) -> Held {
        let mut held = Held::default();
        if let Some(sent) = self.sent.filter(|sent| sent.expires > now) {
            held.share = sent.share;
            held.lifetime = sent.expires - now;
            let reached = sent.at + settle;
            if let Some(earlier) = self
                .earlier
                .filter(|earlier| earlier.expires > now && reached > now)
            {
                held.prior = earlier.share;
                held.prior_lifetime = Instant::min(earlier.expires, reached) - now;
            }
        }
        held
    }
}

/// A stream's holdings and what it needs to decide them.
pub(super) struct QuotaStream {
    shared: Arc<Shared>,
    id: u64,
    domain: String,
    holdings: HashMap<String, Holding>,
    next_holding: u64,
    /// See [`step_of`].
    step: Duration,
    /// The configuration the holdings are matched to their rules under, and the epoch it
    /// started (a reload or a new domain starts the next one).
    config: Option<Arc<ConfigVersion>>,
    epoch: u64,
    /// The epoch the last tick decided every holding in.
    ticked_epoch: u64,
    counters: StreamCounters,
    /// Holdings lowered by the last decisions, whose lower assignment is about to be sent.
    lowered: Vec<(String, String)>,
    /// The buckets this stream abandoned lately, and when. A report of one without a request
    /// is one the Envoy sent before it erased the bucket (still on its way, or queued here
    /// behind the report that abandoned it), not a subscription: an Envoy subscribes to a
    /// bucket it erased only with a request for it. Answered, it would be an action for a
    /// bucket the Envoy no longer has (dropped, with an error) and a holding nobody reports.
    abandoned: HashMap<String, Instant>,
}

/// The most buckets one stream holds: a report of more is answered for these only (the others
/// follow the Envoy's no-assignment behaviour), so that one client cannot hold the server's
/// memory without bound.
const MOST_HOLDINGS: usize = 50_000;

impl QuotaStream {
    pub(super) fn new(shared: Arc<Shared>, id: u64) -> QuotaStream {
        QuotaStream {
            step: step_of(&shared.gateway.current().config),
            shared,
            id,
            domain: String::new(),
            holdings: HashMap::new(),
            next_holding: 0,
            config: None,
            epoch: 0,
            ticked_epoch: 0,
            counters: StreamCounters::new(UNKNOWN_DOMAIN.to_owned()),
            lowered: Vec::new(),
            abandoned: HashMap::new(),
        }
    }

    /// The actions answering one report message: every reported bucket assigned (or, idle too
    /// long, abandoned).
    pub(super) async fn on_reports(
        &mut self,
        reports: RateLimitQuotaUsageReports,
    ) -> Vec<BucketAction> {
        let named = !reports.domain.is_empty() && reports.domain != self.domain;
        if named {
            self.domain = reports.domain;
        }
        let current = self.observe(named);
        let config = &current.config;
        let Some(settings) = quota_settings(config) else {
            return Vec::new();
        };
        let mut actions = Vec::new();
        let mut due = Vec::new();
        let mut seen = HashSet::new();
        for usage in reports.bucket_quota_usages {
            let Some(name) = self.record_usage(&usage) else {
                continue;
            };
            let Some(holding) = self.holdings.get(&name) else {
                continue;
            };
            if !seen.insert(name.clone()) {
                // The same bucket twice in one report: counted twice, answered once.
                continue;
            }
            if holding.idle_reports >= settings.abandon_after {
                let holding = self.holdings.remove(&name).expect("present above");
                actions.push(assignment::abandon(&holding.bucket));
                self.abandoned.insert(name, Instant::now());
                self.counters.abandoned();
                if let Some(key) = holding.target.key() {
                    self.release(key, &holding.holder).await;
                }
                continue;
            }
            due.push((name, true));
        }
        actions.extend(self.assign_all(due, config, settings).await);
        actions
    }

    /// The actions of a tick: holdings whose limit is pressed claim again (sent only if their
    /// assignment changes), any assignment about to end is renewed, every holding is decided
    /// again after a reload, and a bucket the Envoy stopped reporting is let go.
    pub(super) async fn on_tick(&mut self) -> Vec<BucketAction> {
        let current = self.observe(false);
        let config = &current.config;
        let Some(settings) = quota_settings(config) else {
            return Vec::new();
        };
        let now = Instant::now();
        self.forget_unreported(settings, now).await;
        // Reports sent before the abandon reached the Envoy arrive within an interval or two.
        let remembered = settings.report_interval * 3;
        self.abandoned
            .retain(|_, at| now.saturating_duration_since(*at) < remembered);
        let reloaded = std::mem::replace(&mut self.ticked_epoch, self.epoch) != self.epoch;
        let renew_within = settings.report_interval + self.step;
        let renewing = |holding: &Holding| {
            holding
                .sent
                .is_none_or(|sent| sent.expires.saturating_duration_since(now) < renew_within)
        };
        let due: Vec<(String, bool)> = self
            .holdings
            .iter()
            .filter(|(_, holding)| reloaded || holding.pressed || renewing(holding))
            .map(|(name, holding)| (name.clone(), renewing(holding)))
            .collect();
        let actions = self.assign_all(due, config, settings).await;
        self.publish();
        actions
    }

    /// Lets go of the buckets the Envoy has not reported for two intervals and a step (an
    /// Envoy reports every cached bucket every interval): they are no longer renewed, and the
    /// board counts what they were sent until it ends.
    async fn forget_unreported(&mut self, settings: &QuotaSettings, now: Instant) {
        let silence = settings.report_interval * 2 + self.step;
        let gone: Vec<String> = self
            .holdings
            .iter()
            .filter(|(_, holding)| now.saturating_duration_since(holding.reported) > silence)
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            if let Some(holding) = self.holdings.remove(&name) {
                self.hand_over_one(&holding, now).await;
            }
        }
    }

    /// Counts one bucket's usage: the holding created on its first report (its subscription),
    /// its demand and idleness updated. `None` for a usage without a bucket.
    fn record_usage(&mut self, usage: &BucketQuotaUsage) -> Option<String> {
        let bucket = usage.bucket_id.as_ref()?;
        let name = buckets::canonical(&borrowed(bucket));
        let requests = usage
            .num_requests_allowed
            .saturating_add(usage.num_requests_denied);
        let reported_elapsed = usage.time_elapsed.as_ref().map_or(1.0, |elapsed| {
            elapsed.seconds as f64 + f64::from(elapsed.nanos) / 1e9
        });
        self.counters
            .report(usage.num_requests_allowed, usage.num_requests_denied);
        let full = self.holdings.len() >= MOST_HOLDINGS;
        let holding = match self.holdings.entry(name.clone()) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::hash_map::Entry::Vacant(_) if full => {
                metrics::counter!(telemetry::RLQS_BUCKETS_REFUSED_TOTAL).increment(1);
                return None;
            }
            std::collections::hash_map::Entry::Vacant(_)
                if requests == 0 && self.abandoned.contains_key(&name) =>
            {
                return None;
            }
            std::collections::hash_map::Entry::Vacant(entry) => {
                self.abandoned.remove(entry.key());
                self.next_holding += 1;
                entry.insert(Holding {
                    bucket: bucket.clone(),
                    holder: format!("{}.{}.{}", self.shared.server, self.id, self.next_holding),
                    target: Target::Unmatched,
                    target_epoch: 0,
                    demand_milli: 0,
                    last_demand_milli: 0,
                    idle_reports: 0,
                    sent: None,
                    earlier: None,
                    pressed: false,
                    fair_milli: 0,
                    reported: Instant::now(),
                })
            }
        };
        // Envoy sends whole seconds (truncated: a 5 s interval is often 4), which would swing
        // the demand by a quarter from one report to the next, and every change of assignment
        // restarts the Envoy's bucket full. After the first report, the time since the last
        // one as this server measured it is the interval.
        let now = Instant::now();
        let elapsed = if holding.sent.is_none() {
            reported_elapsed
        } else {
            now.saturating_duration_since(holding.reported)
                .as_secs_f64()
        }
        .max(1.0);
        let demand = (requests as f64 * 1000.0 / elapsed) as u64;
        holding.demand_milli = demand.max(holding.last_demand_milli);
        holding.last_demand_milli = demand;
        holding.reported = now;
        if requests == 0 {
            holding.idle_reports += 1;
        } else {
            holding.idle_reports = 0;
        }
        Some(name)
    }

    /// Decides each holding of `due` and, for those to be sent (`always`, or their strategy
    /// changed), the actions that tell its Envoy. The claims on the board are made together
    /// ([`QuotaBoard::claim_all`](floodgate::store::quota::QuotaBoard::claim_all)).
    async fn assign_all(
        &mut self,
        due: Vec<(String, bool)>,
        config: &Config,
        settings: &QuotaSettings,
    ) -> Vec<BucketAction> {
        let now = Instant::now();
        for (name, _) in &due {
            self.match_rule(name, config, settings).await;
        }
        let lifetime = settings.assignment_ttl() + self.step;
        let (claimed, claims): (Vec<usize>, Vec<Claim<'_>>) = due
            .iter()
            .enumerate()
            .filter_map(|(index, (name, _))| {
                let claim = self.claim_of(self.holdings.get(name)?, lifetime, now)?;
                Some((index, claim))
            })
            .unzip();
        let mut grants: Vec<Option<Result<Grant, StoreError>>> = due.iter().map(|_| None).collect();
        for (index, grant) in claimed
            .into_iter()
            .zip(self.shared.board.claim_all(&claims).await)
        {
            grants[index] = Some(grant);
        }
        let mut actions = Vec::new();
        for ((name, always), grant) in due.into_iter().zip(grants) {
            let decided = match grant {
                Some(grant) => self.granted(&name, grant, config, settings, now),
                None => self
                    .holdings
                    .get(&name)
                    .and_then(|holding| match holding.target {
                        Target::Unmatched | Target::AllowAll { .. } => {
                            Some((Strategy::AllowAll, 0))
                        }
                        Target::DenyAll { .. } => Some((Strategy::DenyAll, 0)),
                        // A limit's holding always claims.
                        Target::Limit { .. } => None,
                    }),
            };
            if let Some(action) =
                decided.and_then(|decided| self.send_decided(&name, decided, settings, always, now))
            {
                actions.push(action);
            }
        }
        actions
    }

    /// Holding `name`'s new assignment, `decided` (a strategy and the share it holds on the
    /// board), recorded; the action that tells its Envoy if it is to be sent (`always`, or
    /// its strategy changed).
    fn send_decided(
        &mut self,
        name: &str,
        (strategy, share): (Strategy, u64),
        settings: &QuotaSettings,
        always: bool,
        now: Instant,
    ) -> Option<BucketAction> {
        let ttl = settings.assignment_ttl();
        let holding = self.holdings.get_mut(name)?;
        let changed = holding.sent.is_none_or(|sent| sent.strategy != strategy);
        let in_force = holding.in_force(now, self.step);
        if let Some(key) = holding.target.key()
            && share < in_force.share.max(in_force.prior)
        {
            self.lowered.push((key.to_owned(), holding.holder.clone()));
        }
        if !always && !changed {
            return None;
        }
        // An identical assignment only extends the one in force (Envoy keeps its tokens):
        // it is still the one sent at `at`.
        let at = match holding.sent {
            Some(sent) if !changed => sent.at,
            _ => now,
        };
        if changed {
            holding.earlier = holding.sent;
        }
        holding.sent = Some(Sent {
            strategy,
            share,
            at,
            expires: now + ttl,
        });
        self.counters.assigned(strategy);
        Some(assignment::assign(&holding.bucket, strategy, ttl))
    }

    /// Matches holding `name` to its rule, once per epoch (a reload or a new domain), and
    /// releases the limit it held if that is no longer its.
    async fn match_rule(&mut self, name: &str, config: &Config, settings: &QuotaSettings) {
        let Some(holding) = self.holdings.get_mut(name) else {
            return;
        };
        if holding.target_epoch == self.epoch {
            return;
        }
        let target = buckets::resolve(
            settings,
            &config.store.prefix,
            &self.domain,
            &borrowed(&holding.bucket),
        );
        holding.target_epoch = self.epoch;
        let previous = std::mem::replace(&mut holding.target, target);
        // The rules changed under a reload: the old limit is no longer this bucket's.
        let moved = previous
            .key()
            .is_some_and(|key| Some(key) != holding.target.key());
        if let (true, Some(key)) = (moved, previous.key()) {
            let holder = holding.holder.clone();
            self.release(key, &holder).await;
        }
    }

    /// The configuration in force, noting a new one (or a new domain, `named`) as a new epoch,
    /// in which every holding is matched to its rule again and the counters follow the
    /// domain's label.
    fn observe(&mut self, named: bool) -> Arc<ConfigVersion> {
        let current = self.shared.gateway.current();
        let reloaded = self
            .config
            .as_ref()
            .is_none_or(|seen| !Arc::ptr_eq(seen, &current));
        if reloaded || named {
            self.epoch += 1;
            self.config = Some(current.clone());
            let label = quota_settings(&current.config)
                .filter(|settings| settings.domains.contains_key(&self.domain))
                .map_or(UNKNOWN_DOMAIN, |_| self.domain.as_str());
            if label != self.counters.label() {
                self.counters = StreamCounters::new(label.to_owned());
            }
        }
        current
    }

    /// The claim of `holding` on the board, if its rule is a limit.
    fn claim_of<'a>(
        &self,
        holding: &'a Holding,
        lifetime: Duration,
        now: Instant,
    ) -> Option<Claim<'a>> {
        let Target::Limit { key, limit, .. } = &holding.target else {
            return None;
        };
        let held = holding.in_force(now, self.step);
        Some(Claim {
            key,
            holder: &holding.holder,
            limit: limit.rate_milli,
            floor: limit.rate_milli / 25,
            // Its demand as reported (denials included); the board adds room to grow from
            // what the others leave. An idle holder wants a thousandth of the limit: enough
            // to admit a request or so before its next report raises it.
            want: holding.demand_milli.max(limit.rate_milli / 1000).max(1),
            in_force: held.share.max(held.prior),
            lifetime,
            settle: self.step,
        })
    }

    /// The strategy (and the share it holds on the board) for holding `name` after its claim
    /// was answered with `grant`; `None` to keep what the Envoy has (the board failed and its
    /// assignment is still good).
    fn granted(
        &mut self,
        name: &str,
        grant: Result<Grant, StoreError>,
        config: &Config,
        settings: &QuotaSettings,
        now: Instant,
    ) -> Option<(Strategy, u64)> {
        let holding = self.holdings.get_mut(name)?;
        let Target::Limit { key, limit, .. } = &holding.target else {
            return None;
        };
        let limit = *limit;
        match grant {
            Ok(grant) => {
                holding.pressed = grant.pressed;
                holding.fair_milli = grant.fair;
                Some((Strategy::for_share(grant.share, limit), grant.share))
            }
            Err(error) => {
                metrics::counter!(telemetry::RLQS_STORE_ERRORS_TOTAL).increment(1);
                tracing::warn!(%error, "rlqs: the quota board failed");
                // Claim again at the next step: a claim that timed out may yet be applied.
                holding.pressed = true;
                // Keep what the Envoy has until it nears its end (SPEC §10a).
                if holding.sent.is_some_and(|sent| {
                    sent.expires.saturating_duration_since(now)
                        >= settings.report_interval + self.step
                }) {
                    return None;
                }
                let key = key.clone();
                Some(self.outage_strategy(&key, limit, config))
            }
        }
    }

    /// What a holding gets while the board fails and its assignment has run out: the failure
    /// policy in the quota service's terms.
    fn outage_strategy(
        &self,
        key: &str,
        limit: crate::config::QuotaLimit,
        config: &Config,
    ) -> (Strategy, u64) {
        match config.on_store_error {
            FailurePolicy::Open => (Strategy::AllowAll, 0),
            FailurePolicy::Closed => (Strategy::DenyAll, 0),
            FailurePolicy::Local => {
                // This server's part of the limit (`store.fallback_share`), split among its
                // Envoys holding the limit.
                let holders = self
                    .holdings
                    .values()
                    .filter(|holding| holding.target.key() == Some(key))
                    .count()
                    .max(1) as f64;
                let share =
                    (limit.rate_milli as f64 * config.store.fallback_share / holders) as u64;
                (Strategy::for_share(share, limit), share)
            }
        }
    }

    /// The graceful end: every bucket told its assignment ends now (TTL 0: the Envoy falls back
    /// at once and reconnects elsewhere), and the board told it holds nothing.
    pub(super) fn expire_all(&self) -> Vec<BucketAction> {
        let mut actions = Vec::new();
        for holding in self.holdings.values() {
            let strategy = holding
                .sent
                .map_or(Strategy::AllowAll, |sent| sent.strategy);
            actions.push(assignment::assign(
                &holding.bucket,
                strategy,
                Duration::ZERO,
            ));
        }
        actions
    }

    /// The stream ended: each Envoy keeps what it was last sent until that ends (told TTL 0 by
    /// `expire_all`, it falls back at once, but nothing says the message left), and the board
    /// counts it till then, and a step more.
    pub(super) async fn hand_over(&mut self) {
        let now = Instant::now();
        let holdings: Vec<Holding> = self.holdings.drain().map(|(_, holding)| holding).collect();
        for holding in &holdings {
            self.hand_over_one(holding, now).await;
        }
        self.shared.views.remove(self.id);
    }

    /// Hands one holding the Envoy no longer reports on this stream to the board.
    async fn hand_over_one(&self, holding: &Holding, now: Instant) {
        let Some(key) = holding.target.key() else {
            return;
        };
        let mut held = holding.in_force(now, self.step);
        held.lifetime += self.step;
        if held.share == 0 && held.prior == 0 {
            self.release(key, &holding.holder).await;
        } else if let Err(error) = self.shared.board.hold(key, &holding.holder, held).await {
            tracing::warn!(%error, "rlqs: could not hand a departed Envoy's share to the board");
        }
    }

    /// After the answer left: each holding lowered by it counts at what it had for a step from
    /// now (the claim's own settle ran from the claim).
    pub(super) async fn settle_lowered(&mut self) {
        for (key, holder) in std::mem::take(&mut self.lowered) {
            if let Err(error) = self.shared.board.settle(&key, &holder, self.step).await {
                tracing::debug!(%error, "rlqs: could not extend a lowered share's settle");
            }
        }
    }

    async fn release(&self, key: &str, holder: &str) {
        if let Err(error) = self.shared.board.release(key, holder).await {
            // Its record ends with its lifetime anyway.
            tracing::debug!(%error, "rlqs: could not release a share");
        }
    }

    /// Writes this stream's holdings where `GET /admin/rlqs` reads them, when it asked.
    fn publish(&self) {
        if !self.shared.views.wanted(self.id) {
            return;
        }
        let now = Instant::now();
        let views = self
            .holdings
            .values()
            .map(|holding| HoldingView {
                domain: self.domain.clone(),
                bucket: borrowed(&holding.bucket)
                    .into_iter()
                    .map(|(key, value)| (key.to_owned(), value.to_owned()))
                    .collect(),
                rule: holding.target.rule().map(str::to_owned),
                key: holding.target.key().map(str::to_owned),
                holder: holding.holder.clone(),
                demand_per_second: holding.demand_milli as f64 / 1000.0,
                share_per_second: holding.sent.map_or(0.0, |sent| sent.share as f64 / 1000.0),
                fair_per_second: holding.fair_milli as f64 / 1000.0,
                strategy: holding.sent.map(|sent| sent.strategy),
                expires_in_ms: holding.sent.map_or(0, |sent| {
                    sent.expires.saturating_duration_since(now).as_millis() as u64
                }),
            })
            .collect();
        self.shared.views.set(self.id, views);
    }
}

/// The metric label of a domain the configuration does not name (a client cannot make up label
/// values).
const UNKNOWN_DOMAIN: &str = "unknown";

fn quota_settings(config: &Config) -> Option<&QuotaSettings> {
    config.rls.as_ref()?.quota.as_ref()
}

/// A bucket's entries, sorted by key.
fn borrowed(bucket: &BucketId) -> BTreeMap<&str, &str> {
    bucket
        .bucket
        .iter()
        .map(|(key, value)| (key.as_str(), value.as_str()))
        .collect()
}

/// Runs one stream until the Envoy leaves or the server shuts down.
pub(super) async fn run(
    mut inbound: tonic::Streaming<RateLimitQuotaUsageReports>,
    outbound: mpsc::Sender<Result<RateLimitQuotaResponse, tonic::Status>>,
    shared: Arc<Shared>,
    id: u64,
) {
    let mut shutdown = shared.shutdown.subscribe();
    let mut stream = QuotaStream::new(shared.clone(), id);
    let mut ticks = tokio::time::interval(stream.step);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // An Envoy that does not read its answers within a report interval is let go, rather than
    // holding this task (and its shares' renewals) forever.
    let patience = quota_settings(&shared.gateway.current().config)
        .map_or(Duration::from_secs(5), |settings| settings.report_interval);
    let send = |actions: Vec<BucketAction>| {
        let outbound = outbound.clone();
        async move {
            if actions.is_empty() {
                return true;
            }
            let response = RateLimitQuotaResponse {
                bucket_action: actions,
            };
            matches!(
                tokio::time::timeout(patience, outbound.send(Ok(response))).await,
                Ok(Ok(()))
            )
        }
    };
    loop {
        if *shutdown.borrow() {
            send(stream.expire_all()).await;
            break;
        }
        let actions = tokio::select! {
            message = inbound.message() => match message {
                Ok(Some(reports)) => stream.on_reports(reports).await,
                Ok(None) | Err(_) => break,
            },
            _ = ticks.tick() => stream.on_tick().await,
            _ = shutdown.changed() => continue,
        };
        if !send(actions).await {
            break;
        }
        stream.settle_lowered().await;
    }
    stream.hand_over().await;
}
