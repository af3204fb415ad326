//! A gateway's round, four times per interval: sync with its region's table (its demand in, the
//! table out), and, once per interval on the one gateway of the region that holds the trader's
//! lock, trade every key whose share should move with the global store.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_redis::redis::Value;

use super::scripts::{GLOBAL, REGIONAL};
use super::shares::{Shares, TableEntry, fixed_share, floor_share, tradeable};
use super::spec::LimitSpec;
use super::{RegionSettings, RegionStatus, TradeResult};
use crate::limit::{Algorithm, Limit};
use crate::store::link::{Link, reply};
use crate::store::{Check, Store, StoreError};

/// The keys of the regional script, all under the region's hash tag.
pub(super) fn regional_keys(region: &str) -> Vec<String> {
    let tag = format!("floodgate:region:{{{region}}}");
    [
        "table",
        "version",
        "acks",
        "demand",
        "specs",
        "trader",
        "generation",
    ]
    .iter()
    .map(|part| format!("{tag}:{part}"))
    .collect()
}

/// A row of the region's table: `"units,ends_ms,version,previous,spec"`.
#[derive(Clone, Debug)]
struct Row {
    /// The share, in units of the limit.
    units: u64,
    /// By the regional store's clock (ms): when a raised share ends, when a lowered one goes
    /// back to the fixed share; 0 for neither.
    ends_ms: i64,
    /// The table version that wrote the row.
    version: i64,
    /// The most a gateway may still have in force until every live one has the row's version.
    previous: u64,
    spec: LimitSpec,
}

impl Row {
    fn parse(text: &str) -> Option<Row> {
        let mut parts = text.splitn(5, ',');
        Some(Row {
            units: parts.next()?.parse().ok()?,
            ends_ms: parts.next()?.parse().ok()?,
            version: parts.next()?.parse().ok()?,
            previous: parts.next()?.parse().ok()?,
            spec: LimitSpec(parts.next()?.to_owned()),
        })
    }

    /// The row as the write script stores it, `#` standing for the version it writes.
    fn encode(&self) -> String {
        format!(
            "{},{},#,{},{}",
            self.units, self.ends_ms, self.previous, self.spec.0
        )
    }
}

/// What the trader knows of a key between rounds.
struct Estimate {
    limit: Arc<Limit>,
    spec: LimitSpec,
    /// Units the region asked for per interval (a running estimate).
    per_interval: u64,
    /// Units asked in the last interval.
    last_round: u64,
    /// Units asked this interval so far.
    this_round: u64,
    /// Trades since the key's demand was first seen: the first interval is partial.
    rounds: u32,
}

/// The global store's answer for one key: the grant, the ms a grant above the fixed share
/// lasts, the key's fair cap.
type Granted = (u64, i64, u64);

/// One key's part of a trade.
struct Item {
    key: Arc<str>,
    limit: Arc<Limit>,
    spec: LimitSpec,
    /// The share in force after this round's lowering.
    units: u64,
    report: u64,
    want: u64,
}

/// The region's round on one gateway.
pub(super) struct Trader {
    pub(super) settings: Arc<RegionSettings>,
    pub(super) shares: Arc<Shares>,
    pub(super) inner: Arc<dyn Store>,
    pub(super) regional: Arc<Link>,
    pub(super) global: Link,
    pub(super) gateway: String,
    pub(super) status: Arc<RegionStatus>,
    loaded_version: i64,
    estimates: HashMap<Arc<str>, Estimate>,
    /// The fair part the global store last gave each key.
    caps: HashMap<Arc<str>, u64>,
    /// Keys some region wants more of, with their specs: this region lends from them.
    pressure: HashMap<Arc<str>, LimitSpec>,
    /// The global store's clock minus this process's (ms), from the last good trade.
    offset_ms: Option<i64>,
    /// The highest generation the global store replied with: a store found behind it lost
    /// writes it had acknowledged (`lua/region_global.lua`).
    generation_seen: i64,
    /// The last trade failed: promises to stay low are not renewed until one succeeds.
    failing: bool,
    /// Trades since this gateway became its region's trader.
    rounds_as_trader: u32,
    /// Until when this gateway puts no table in force (its region's store lost its table).
    distrust_until: Option<Instant>,
    epoch: Instant,
}

/// How long a region keeps a promise to stay low after it last told the global store so:
/// as long as the global store may hold it (its deadline, a lifetime), an interval more,
/// and for a window algorithm as long as a borrower's count of its window may stand on it
/// (a window, two for a sliding window counter).
fn promise_ms(settings: &RegionSettings, limit: &Limit) -> i64 {
    let windows = match limit.algorithm() {
        Algorithm::FixedWindow => 1,
        Algorithm::SlidingWindowCounter => 2,
        _ => 0,
    };
    (settings.timeout + settings.lease_lifetime + settings.sync_interval).as_millis() as i64
        + windows * (limit.window_micros() / 1000) as i64
}

fn ms_between(from: Instant, to: Instant) -> i64 {
    if to >= from {
        to.duration_since(from).as_millis() as i64
    } else {
        -(from.duration_since(to).as_millis() as i64)
    }
}

fn shifted(at: Instant, ms: i64) -> Instant {
    if ms >= 0 {
        at + Duration::from_millis(ms as u64)
    } else {
        at.checked_sub(Duration::from_millis(ms.unsigned_abs()))
            .unwrap_or(at)
    }
}

impl Trader {
    pub(super) fn new(
        settings: Arc<RegionSettings>,
        shares: Arc<Shares>,
        inner: Arc<dyn Store>,
        regional: Arc<Link>,
        global: Link,
        gateway: String,
        status: Arc<RegionStatus>,
    ) -> Trader {
        Trader {
            settings,
            shares,
            inner,
            regional,
            global,
            gateway,
            status,
            loaded_version: 0,
            estimates: HashMap::new(),
            caps: HashMap::new(),
            pressure: HashMap::new(),
            offset_ms: None,
            generation_seen: 0,
            failing: false,
            rounds_as_trader: 0,
            distrust_until: None,
            epoch: Instant::now(),
        }
    }

    fn keys(&self) -> Vec<String> {
        regional_keys(&self.settings.name)
    }

    /// How long a gateway counts as live after its last sync (and the lock lasts): an interval
    /// beyond how long its table stays current ([`Trader::current_for`]), so that a gateway the
    /// trader stops waiting for has stopped deciding above one unit.
    fn live_ms(&self) -> u64 {
        (self.current_for() + self.settings.sync_interval).as_millis() as u64
    }

    /// How long a sync keeps this gateway's table current: two intervals, and a trade's
    /// deadline (the trader syncs again only once its trade is over).
    fn current_for(&self) -> Duration {
        self.settings.sync_interval * 2 + self.settings.timeout
    }

    /// One round: sync with the region's table, then, if `trade_due` and this gateway holds
    /// the region's trader lock, trade.
    pub(super) async fn round(&mut self, trade_due: bool) {
        let view = match self.sync().await {
            Ok(view) => view,
            Err(error) => {
                tracing::warn!(%error, region = %self.settings.name, "region sync failed");
                self.status.set_trader(false);
                return;
            }
        };
        if self.offset_ms.is_none() {
            // Every gateway measures the global store's clock when it starts, and at every
            // round until a measurement succeeds (every trade measures it again), so that a
            // trader's trades always carry a deadline: without one none is sent (`trade`).
            let _ = self.call_global(&[], Instant::now(), false).await;
        }
        if !view.trader {
            self.estimates.clear();
            self.caps.clear();
            self.pressure.clear();
            self.rounds_as_trader = 0;
            return;
        }
        // A gateway that just became its region's trader trades at once: the shares its
        // predecessor was granted need renewing.
        let due = trade_due || self.rounds_as_trader == 0;
        if due && let Err(error) = self.trade(view).await {
            tracing::warn!(%error, region = %self.settings.name, "region trade round failed");
        }
    }

    /// The arguments of a `sync` (`lua/region_local.lua`): this gateway, how long it stays
    /// live, the table version it acknowledges, the demand it saw since the last sync (taken
    /// here), and the highest global generation it has seen.
    fn sync_arguments(&mut self) -> Vec<String> {
        let demand = self.shares.take_demand();
        let mut args = vec![
            "sync".to_owned(),
            self.gateway.clone(),
            self.live_ms().to_string(),
            // A gateway that distrusts its region's table acknowledges nothing of it.
            if self.distrust_until.is_some() {
                "0".to_owned()
            } else {
                self.shares.acknowledgeable().to_string()
            },
            demand.len().to_string(),
        ];
        for (key, units, spec) in &demand {
            args.extend([
                key.to_string(),
                units.min(&(i64::MAX as u64 / 4)).to_string(),
                spec.0.clone(),
            ]);
        }
        // Kept in the region's store, so that the next trader (a restarted gateway among them)
        // still finds a global store that went back behind it.
        args.push(self.generation_seen.to_string());
        args
    }

    /// Adds this gateway's demand to the region's, puts the region's table in force here and
    /// acknowledges it; on the trader, takes the region's demand into the estimates.
    async fn sync(&mut self) -> Result<View, StoreError> {
        let sent = Instant::now();
        let args = self.sync_arguments();
        let synced = self.regional.run(&REGIONAL, &self.keys(), &args).await?;
        let received = Instant::now();
        let mut parts = reply::array(synced, "sync")?.into_iter();
        let mut next = |what: &str| {
            parts
                .next()
                .ok_or_else(|| StoreError::Protocol(format!("region sync reply: no {what}")))
        };
        let regional_now = reply::int(&next("now")?, "now")?;
        let version = reply::int(&next("version")?, "version")?;
        let trader = reply::int(&next("trader")?, "trader")? == 1;
        let mut table = HashMap::new();
        let pairs = reply::array(next("table")?, "table")?;
        for pair in pairs.chunks(2) {
            let [key, value] = pair else { continue };
            let key: Arc<str> = reply::text(key, "table key")?.into();
            if let Some(row) = Row::parse(&reply::text(value, "table row")?) {
                table.insert(key, row);
            }
        }
        if version < self.loaded_version {
            // The region's store lost its table (a restart without its data): the promises it
            // held may still stand at the global store. Distrust every share until they lapse.
            tracing::warn!(region = %self.settings.name, "the region's table went back a version: \
                deciding tradeable limits at one unit until its promises lapse");
            self.distrust_until = Some(
                sent + self.settings.timeout
                    + self.settings.lease_lifetime
                    + self.settings.sync_interval
                    + self.shares.longest_window_span(),
            );
            // At once: the shares in force came from a table that no longer exists.
            self.shares.expire_current();
        }
        if self
            .distrust_until
            .is_none_or(|until| Instant::now() >= until)
        {
            self.distrust_until = None;
            self.put_in_force(&table, regional_now, sent);
        }
        self.loaded_version = version;
        self.shares.set_version(version);
        self.status.set_trader(trader);
        self.status.synced();
        let mut view = View {
            regional_now,
            sent,
            received,
            trader,
            oldest_acked: version,
            table,
        };
        if !trader {
            return Ok(view);
        }
        view.oldest_acked = reply::int(&next("oldest acknowledged")?, "oldest")?;
        let taken = reply::array(next("demand")?, "demand")?;
        let generation = reply::int(&next("generation")?, "generation")?;
        self.generation_seen = self.generation_seen.max(generation);
        for triple in taken.chunks(3) {
            let [key, units, spec] = triple else { continue };
            let key: Arc<str> = reply::text(key, "demand key")?.into();
            let units = reply::int(units, "demand units")?.max(0) as u64;
            let spec = LimitSpec(reply::text(spec, "demand spec")?);
            let Some(limit) = spec.limit() else { continue };
            let estimate = self.estimates.entry(key).or_insert_with(|| Estimate {
                limit: Arc::new(limit),
                spec,
                per_interval: 0,
                last_round: 0,
                this_round: 0,
                rounds: 0,
            });
            estimate.this_round = estimate.this_round.saturating_add(units);
        }
        Ok(view)
    }

    /// The table in force on this gateway: rows' ends by this process's clock, measured from
    /// when the sync was sent (earlier than the regional store read its clock: a raised share
    /// ends here no later than the table says).
    fn put_in_force(&self, table: &HashMap<Arc<str>, Row>, regional_now: i64, sent: Instant) {
        let regions = self.settings.regions.len();
        let entries: HashMap<Arc<str>, (TableEntry, LimitSpec)> = table
            .iter()
            .filter_map(|(key, row)| {
                Some((
                    key.clone(),
                    (row.entry(regions, regional_now, sent)?, row.spec.clone()),
                ))
            })
            .collect();
        self.shares.apply(&entries, regions);
        self.shares.mark_current(sent + self.current_for());
    }

    /// What `key`'s window has counted so far (`units` when the store cannot say), for the
    /// algorithms that count in windows; 0 for the others, whose stored credit shrinks with
    /// their share by itself.
    async fn used(&self, key: &Arc<str>, limit: &Arc<Limit>, units: u64) -> u64 {
        if !limit.algorithm().counts_in_windows() {
            return 0;
        }
        // Read under the whole limit: a count above the share (a grant that lapsed) shows.
        let check = Check::new(key.clone(), limit.clone(), 0);
        match self.inner.peek(&[check], None).await {
            Ok(decision) => decision.limits().first().map_or(units, |status| {
                limit.limit().saturating_sub(status.remaining)
            }),
            // Not knowing, lower nothing.
            Err(_) => units,
        }
    }

    /// Before a share rises from `from` to `to`: a bucket's stored credit would be worth more
    /// units under the larger share (its level is kept in time), so the units it would gain are
    /// charged first, and the key holds as many units as before. Windows gain nothing.
    /// Whether the raise may go ahead (charged, or nothing to charge).
    async fn charge_for_raise(
        &self,
        key: &Arc<str>,
        limit: &Arc<Limit>,
        from: u64,
        to: u64,
    ) -> bool {
        if !matches!(limit.algorithm(), Algorithm::TokenBucket | Algorithm::Gcra) || to <= from {
            return true;
        }
        let before = Check::new(key.clone(), Arc::new(limit.with_share(from)), 0);
        let Ok(peeked) = self.inner.peek(&[before], None).await else {
            return false;
        };
        let tokens = peeked.limits().first().map_or(0, |status| status.remaining);
        let gained = (u128::from(tokens) * u128::from(to - from)).div_ceil(u128::from(from.max(1)));
        if gained == 0 {
            return true;
        }
        let charge = Check::new(key.clone(), Arc::new(limit.with_share(to)), gained as u64);
        match self.inner.charge(&[charge], None).await {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, "region: charging a raised share failed: not raised");
                false
            }
        }
    }

    /// The share a demand of `per_interval` units calls for: a quarter more than its rate, in
    /// units of the limit's window, between 1 and the whole limit.
    fn target(&self, limit: &Limit, per_interval: u64) -> u64 {
        let interval = self.settings.sync_interval.as_micros().max(1);
        let per_window =
            u128::from(per_interval) * u128::from(limit.window_micros()) * 5 / (interval * 4);
        (per_window.min(u128::from(u64::MAX)) as u64).clamp(1, limit.limit())
    }

    /// What the region wants of `key`, holding `units`: under pressure (some region wants
    /// more than it has), what its last interval's demand calls for, down to its floor (a
    /// tenth of its fixed share, [`floor_share`], which it never lends); otherwise what
    /// its running estimate calls for, and never less than its fixed share. Until the demand
    /// is known (a trader in its first two rounds, a demand first seen an interval ago: its
    /// first interval was partial), never less than it holds.
    fn want(&self, key: &Arc<str>, limit: &Limit, fixed: u64, units: u64) -> u64 {
        let estimate = self.estimates.get(key);
        let wanted = if self.pressure.contains_key(key) {
            self.target(limit, estimate.map_or(0, |e| e.last_round))
                .max(floor_share(fixed))
        } else {
            self.target(limit, estimate.map_or(0, |e| e.per_interval))
                .max(fixed)
        };
        let known = self.rounds_as_trader >= 2 && estimate.is_none_or(|e| e.rounds >= 2);
        if known { wanted } else { wanted.max(units) }
    }

    /// The limit of a key to trade: the one its demand came with, else its spec's.
    fn limit_of(&self, key: &Arc<str>, spec: &LimitSpec) -> Option<Arc<Limit>> {
        self.estimates
            .get(key)
            .map(|estimate| estimate.limit.clone())
            .or_else(|| spec.limit().map(Arc::new))
            .filter(|limit| tradeable(limit))
    }

    /// One trade, in phases: the estimates aged, the keys that trade chosen, lowerings put in
    /// force in the region first, the items reported, promises renewed in the region, the one
    /// call to the global store, its grants written to the region's table, and rows that no
    /// trade renewed let go.
    async fn trade(&mut self, view: View) -> Result<(), StoreError> {
        self.age_estimates(&view);
        let keys = self.keys_to_trade(&view);
        let round_synced = view.sent;
        let Some(mut view) = self.lower_first(&keys, view).await? else {
            // No longer the region's trader.
            return Ok(());
        };
        let items = self.items(keys, &view).await;
        self.renew_promises(&items, &mut view).await?;
        // The trade must be applied while this gateway still holds the trader's lock (taken
        // at the round's sync), so that two traders never overlap: else it waits a round.
        let lock_left =
            Duration::from_millis(self.live_ms()).saturating_sub(round_synced.elapsed());
        if lock_left < self.settings.timeout + self.settings.sync_interval / 2 {
            tracing::warn!(region = %self.settings.name, "region round too slow: trade skipped");
            return Ok(());
        }
        let global_sent = Instant::now();
        // Without a deadline a trade could be applied late, and no report is safe then: a
        // promise renewed late outlives the region's, and one given up (the fixed share
        // reported, as this did before) is granted beside a borrower whose window still
        // counts (seeds 5092 and 5218: 87 admitted of 60 after a restarted gateway's first
        // trades). So none goes: the round fails as a trade that found no store does.
        let traded = match self.offset_ms {
            Some(_) => self.call_global(&items, global_sent, true).await,
            None => Err(TradeResult::Failed),
        };
        let replies = match traded {
            Ok(replies) => {
                self.failing = false;
                self.status.traded(TradeResult::Ok);
                replies
            }
            Err(result) => {
                self.failing = true;
                self.status.traded(result);
                Vec::new()
            }
        };
        let traded: HashSet<Arc<str>> = if replies.is_empty() {
            HashSet::new()
        } else {
            items.iter().map(|item| item.key.clone()).collect()
        };
        let mut changes = self
            .granted(&items, replies, &traded, &view, global_sent)
            .await;
        self.let_go_unrenewed(&traded, &view, &mut changes).await;
        self.status.set_rows(view.table.len());
        if !changes.is_empty() {
            self.write(&mut changes, &mut view).await?;
        }
        Ok(())
    }

    /// A round's estimates: this round's demand becomes the last, decaying by half a round
    /// without any; keys with neither demand nor a row are forgotten.
    fn age_estimates(&mut self, view: &View) {
        self.rounds_as_trader = self.rounds_as_trader.saturating_add(1);
        for estimate in self.estimates.values_mut() {
            estimate.last_round = estimate.this_round;
            estimate.rounds = estimate.rounds.saturating_add(1);
            estimate.per_interval = estimate.this_round.max(estimate.per_interval / 2);
            estimate.this_round = 0;
        }
        let table = &view.table;
        self.estimates
            .retain(|key, estimate| estimate.per_interval > 0 || table.contains_key(key));
    }

    /// Which keys trade: every row, every key the region wants more of than its fixed share,
    /// every key others want more of (this region lends from it); each under its limit as
    /// configured now (a reload may have changed it since its row was written).
    fn keys_to_trade(&self, view: &View) -> Vec<(Arc<str>, Arc<Limit>, LimitSpec)> {
        let regions = self.settings.regions.len();
        let mut keys: Vec<(Arc<str>, LimitSpec)> = Vec::new();
        let mut seen = HashSet::new();
        for (key, row) in &view.table {
            if seen.insert(key.clone()) {
                keys.push((key.clone(), row.spec.clone()));
            }
        }
        for (key, estimate) in &self.estimates {
            let fixed = fixed_share(estimate.limit.limit(), regions);
            let units = view.units(key, fixed);
            if self.want(key, &estimate.limit, fixed, units) > fixed && seen.insert(key.clone()) {
                keys.push((key.clone(), estimate.spec.clone()));
            }
        }
        for (key, spec) in &self.pressure {
            if seen.insert(key.clone()) {
                keys.push((key.clone(), spec.clone()));
            }
        }
        keys.into_iter()
            .filter_map(|(key, spec)| {
                let limit = self.limit_of(&key, &spec)?;
                let spec = LimitSpec::of(&limit);
                Some((key, limit, spec))
            })
            .collect()
    }

    /// Until when, by the regional clock, a promise renewed now holds in the region.
    fn revert_ms(&self, view: &View, limit: &Limit) -> i64 {
        view.at_most(Instant::now()) + promise_ms(&self.settings, limit)
    }

    /// Lowerings first: in force on every gateway of the region before the global store hears
    /// of them. Each gateway acknowledges them at its next sync; the trade waits for that up to
    /// half an interval (a gateway that has not acknowledged by then is reported at what it may
    /// still have in force). The region's view after, or `None` if this gateway is no longer
    /// its trader.
    async fn lower_first(
        &mut self,
        keys: &[(Arc<str>, Arc<Limit>, LimitSpec)],
        mut view: View,
    ) -> Result<Option<View>, StoreError> {
        let regions = self.settings.regions.len();
        let mut changes: Vec<(Arc<str>, Option<Row>)> = Vec::new();
        for (key, limit, spec) in keys {
            let fixed = fixed_share(limit.limit(), regions);
            let units = view.units(key, fixed);
            let cap = self.caps.get(key).copied().unwrap_or(limit.limit());
            // Never below the floor: a client that moves here is served from its first second.
            let hold = self
                .want(key, limit, fixed, units)
                .min(cap)
                .max(floor_share(fixed));
            if hold >= units {
                continue;
            }
            let lowered = hold.max(self.used(key, limit, units).await).max(1);
            if lowered >= units {
                continue;
            }
            let row = view.table.get(key);
            changes.push((
                key.clone(),
                Some(Row {
                    units: lowered,
                    ends_ms: if lowered < fixed {
                        self.revert_ms(&view, limit)
                    } else {
                        row.map_or(0, |row| row.ends_ms)
                    },
                    version: 0,
                    previous: view.most_in_force(key, fixed),
                    spec: spec.clone(),
                }),
            ));
        }
        if !changes.is_empty() {
            let written = self.write(&mut changes, &mut view).await?;
            let waited = Instant::now();
            while view.oldest_acked < written && waited.elapsed() < self.settings.sync_interval / 2
            {
                tokio::time::sleep(self.settings.sync_interval / 20).await;
                view = self.sync().await?;
                if !view.trader {
                    return Ok(None);
                }
            }
        }
        Ok(Some(view))
    }

    /// The trade's items: per key, its share, what the region reports it may hold and what it
    /// wants.
    async fn items(&self, keys: Vec<(Arc<str>, Arc<Limit>, LimitSpec)>, view: &View) -> Vec<Item> {
        let regions = self.settings.regions.len();
        let mut items: Vec<Item> = Vec::new();
        // The longest the global store may hold a record this trade leaves, from now: its
        // deadline, a lifetime, and an interval of margin.
        let record_ms =
            (self.settings.timeout + self.settings.lease_lifetime + self.settings.sync_interval)
                .as_millis() as i64;
        for (key, limit, spec) in keys {
            let fixed = fixed_share(limit.limit(), regions);
            let units = view.units(&key, fixed);
            // A window's count outlives the share it was admitted under (a grant that lapsed
            // while the region was cut off): the region holds at least what its window counts.
            let most = view
                .most_in_force(&key, fixed)
                .max(self.used(&key, &limit, units).await.min(limit.limit()));
            // While the global store is unreachable, promises to stay low are not renewed: a
            // trade that arrives late says this region may hold its fixed share, unless the
            // promise in force outlasts any record this trade can leave (a window's promise
            // lasts the window): claiming the fixed share then would be granted it, beside a
            // borrower whose window still counts.
            let promise_holds = view.table.get(&key).is_some_and(|row| {
                row.units < fixed && row.ends_ms >= view.at_most(Instant::now()) + record_ms
            });
            let report = if self.failing && !promise_holds {
                most.max(fixed)
            } else {
                most
            };
            let want = self.want(&key, &limit, fixed, units);
            items.push(Item {
                key,
                limit,
                spec,
                units,
                report,
                want,
            });
        }
        items
    }

    /// Promises renewed by this trade last, in the region, at least as long as the global
    /// store may hold them from it: written before it hears of them.
    async fn renew_promises(&mut self, items: &[Item], view: &mut View) -> Result<(), StoreError> {
        let regions = self.settings.regions.len();
        let mut changes: Vec<(Arc<str>, Option<Row>)> = Vec::new();
        for item in items {
            let fixed = fixed_share(item.limit.limit(), regions);
            if item.report < fixed
                && !self.failing
                && let Some(row) = view.table.get(&item.key)
            {
                let mut row = row.clone();
                row.ends_ms = row.ends_ms.max(self.revert_ms(view, &item.limit));
                row.previous = if view.is_pending(&item.key) {
                    row.previous.max(row.units)
                } else {
                    0
                };
                changes.push((item.key.clone(), Some(row)));
            }
        }
        if !changes.is_empty() {
            self.write(&mut changes, view).await?;
        }
        Ok(())
    }

    /// The rows the global store's grants make, one per item answered: back to the fixed
    /// share, or the grant (no more than the region wants and its fair part, a bucket's raise
    /// charged first). Grants end by the regional clock no later than the global store said:
    /// measured from the least the regional clock can read when the trade was sent.
    async fn granted(
        &mut self,
        items: &[Item],
        replies: Vec<Granted>,
        traded: &HashSet<Arc<str>>,
        view: &View,
        global_sent: Instant,
    ) -> Vec<(Arc<str>, Option<Row>)> {
        let regions = self.settings.regions.len();
        let granted_at = view.at_least(global_sent);
        if !replies.is_empty() {
            self.caps.retain(|key, _| traded.contains(key));
        }
        let mut changes = Vec::new();
        for (item, (grant, left_ms, cap)) in items.iter().zip(replies) {
            self.caps.insert(item.key.clone(), cap);
            let fixed = fixed_share(item.limit.limit(), regions);
            let row = view.table.get(&item.key);
            let pending = view.is_pending(&item.key);
            let pressured = self.pressure.contains_key(&item.key);
            if grant == fixed && item.want <= fixed && !pressured && !pending {
                // Back to the fixed share: a lender's bucket is charged what it would gain.
                if row.is_some()
                    && (item.units >= fixed
                        || self
                            .charge_for_raise(&item.key, &item.limit, item.units, fixed)
                            .await)
                {
                    changes.push((item.key.clone(), None));
                }
                continue;
            }
            // A grant is what the region may hold; it takes no more than it wants and its fair
            // part (a grant at its report while a lowering is pending is not a raise).
            let mut units = grant
                .min(item.want)
                .min(cap)
                .max(item.units)
                .min(item.limit.limit());
            if units > item.units
                && !self
                    .charge_for_raise(&item.key, &item.limit, item.units, units)
                    .await
            {
                // Not charged: not raised.
                units = item.units;
            }
            let ends_ms = if units > fixed {
                granted_at + left_ms
            } else if units < fixed {
                self.revert_ms(view, &item.limit)
            } else {
                0
            };
            let previous = match row {
                Some(row) if pending => row.previous.max(row.units),
                _ => 0,
            };
            changes.push((
                item.key.clone(),
                Some(Row {
                    units,
                    ends_ms,
                    version: 0,
                    previous,
                    spec: item.spec.clone(),
                }),
            ));
        }
        changes
    }

    /// Rows no trade renewed: a raised share that ended is gone; a lowered one whose promise
    /// may have lapsed at the global store goes back to the fixed share (a bucket charged what
    /// it would gain first).
    async fn let_go_unrenewed(
        &self,
        traded: &HashSet<Arc<str>>,
        view: &View,
        changes: &mut Vec<(Arc<str>, Option<Row>)>,
    ) {
        let regions = self.settings.regions.len();
        let now_ms = view.at_least(Instant::now());
        for (key, row) in &view.table {
            if traded.contains(key) || row.ends_ms == 0 || row.ends_ms > now_ms {
                continue;
            }
            if let Some(limit) = row.spec.limit() {
                let fixed = fixed_share(limit.limit(), regions);
                if row.units < fixed
                    && !self
                        .charge_for_raise(key, &Arc::new(limit), row.units, fixed)
                        .await
                {
                    continue;
                }
            }
            changes.push((key.clone(), None));
        }
    }

    /// The trade: one call for every key. Per item: the grant, the ms its raise lasts, the
    /// fair cap. Keys others want more of are kept for the next round. `reports`: the call
    /// says all the region holds above its fixed shares (the trader's trade, not a gateway's
    /// reading of the clock), which ends a window's settling after a loss (SPEC §5).
    async fn call_global(
        &mut self,
        items: &[Item],
        sent: Instant,
        reports: bool,
    ) -> Result<Vec<Granted>, TradeResult> {
        let deadline = match self.offset_ms {
            Some(offset) => {
                ms_between(self.epoch, sent) + offset + self.settings.timeout.as_millis() as i64
            }
            None => 0,
        };
        let mut keys: Vec<String> = items
            .iter()
            .map(|item| format!("floodgate:regions:{}", item.key))
            .collect();
        keys.push("floodgate:regions:pressure".to_owned());
        keys.push("floodgate:regions:born".to_owned());
        keys.push("floodgate:regions:generation".to_owned());
        keys.push("floodgate:regions:reported".to_owned());
        let mut args = vec![
            self.settings.name.clone(),
            self.settings.regions.join(","),
            self.settings.lease_lifetime.as_millis().to_string(),
            deadline.to_string(),
            self.settings.timeout.as_millis().to_string(),
            items.len().to_string(),
        ];
        for item in items {
            args.extend([
                item.key.to_string(),
                item.spec.0.clone(),
                item.limit.limit().to_string(),
                item.report.to_string(),
                item.want.to_string(),
            ]);
        }
        args.push(self.generation_seen.to_string());
        args.push(if reports { "1" } else { "0" }.to_owned());
        let value = self
            .global
            .run(&GLOBAL, &keys, &args)
            .await
            .map_err(|error| {
                tracing::warn!(%error, region = %self.settings.name, "region trade failed");
                TradeResult::Failed
            })?;
        let received = Instant::now();
        let parsed = (|| -> Result<Option<Vec<Granted>>, StoreError> {
            let parts = reply::array(value, "trade")?;
            let global_now = reply::int(parts.first().unwrap_or(&Value::Nil), "now")?;
            // Measured from stale answers too: a global clock that stepped forward would
            // otherwise make every later trade stale.
            self.offset_ms = Some(global_now - ms_between(self.epoch, received));
            if reply::text(parts.get(1).unwrap_or(&Value::Nil), "result")? != "ok" {
                return Ok(None);
            }
            let generation = reply::int(parts.get(2).unwrap_or(&Value::Nil), "generation")?;
            self.generation_seen = self.generation_seen.max(generation);
            let mut grants = Vec::with_capacity(items.len());
            for index in 0..items.len() {
                let at = 3 + index * 3;
                let field = |offset: usize| {
                    reply::int(parts.get(at + offset).unwrap_or(&Value::Nil), "grant")
                };
                grants.push((
                    field(0)?.max(0) as u64,
                    field(1)?.max(0),
                    field(2)?.max(0) as u64,
                ));
            }
            self.pressure.clear();
            for pair in parts[3 + items.len() * 3..].chunks(2) {
                let [key, spec] = pair else { continue };
                self.pressure.insert(
                    reply::text(key, "pressured key")?.into(),
                    LimitSpec(reply::text(spec, "pressured spec")?),
                );
            }
            Ok(Some(grants))
        })();
        match parsed {
            Ok(Some(grants)) => Ok(grants),
            Ok(None) => Err(TradeResult::Stale),
            Err(error) => {
                tracing::warn!(%error, "region trade reply");
                Err(TradeResult::Failed)
            }
        }
    }

    /// Writes `changes` to the region's table, puts them in force here at once and in `view`;
    /// returns the version written.
    async fn write(
        &mut self,
        changes: &mut Vec<(Arc<str>, Option<Row>)>,
        view: &mut View,
    ) -> Result<i64, StoreError> {
        let mut args = vec![
            "write".to_owned(),
            self.gateway.clone(),
            self.live_ms().to_string(),
            changes.len().to_string(),
        ];
        for (key, row) in changes.iter() {
            args.push(key.to_string());
            args.push(row.as_ref().map(Row::encode).unwrap_or_default());
        }
        let sent = Instant::now();
        let value = self.regional.run(&REGIONAL, &self.keys(), &args).await?;
        let parts = reply::array(value, "write")?;
        let regional_now = reply::int(parts.first().unwrap_or(&Value::Nil), "now")?;
        let version = reply::int(parts.get(1).unwrap_or(&Value::Nil), "version")?;
        let regions = self.settings.regions.len();
        let mut entries = Vec::with_capacity(changes.len());
        for (key, row) in changes.drain(..) {
            match row {
                Some(mut row) => {
                    row.version = version;
                    entries.push((
                        key.clone(),
                        row.entry(regions, regional_now, sent)
                            .map(|entry| (entry, row.spec.clone())),
                    ));
                    view.table.insert(key, row);
                }
                None => {
                    view.table.remove(&key);
                    entries.push((key, None));
                }
            }
        }
        self.shares.overlay(&entries);
        self.loaded_version = version;
        self.shares.set_version(version);
        Ok(version)
    }
}

/// The region's table as the last sync (and this gateway's writes since) left it.
struct View {
    /// The regional store's clock at the sync (ms).
    regional_now: i64,
    /// When the sync was sent, by this process's clock.
    sent: Instant,
    /// When its answer came back.
    received: Instant,
    trader: bool,
    /// The oldest table version a live gateway of the region has in force.
    oldest_acked: i64,
    table: HashMap<Arc<str>, Row>,
}

impl View {
    /// The least the regional store's clock can read at `at` (ms): its reading was taken
    /// before the sync's answer came back. For ends that must not come late.
    fn at_least(&self, at: Instant) -> i64 {
        self.regional_now + ms_between(self.received, at)
    }

    /// The most the regional store's clock can read at `at` (ms): its reading was taken after
    /// the sync was sent. For ends that must not come early.
    fn at_most(&self, at: Instant) -> i64 {
        self.regional_now + ms_between(self.sent, at)
    }

    /// The share of `key` in force by the table (the fixed share once a raise ended).
    fn units(&self, key: &str, fixed: u64) -> u64 {
        match self.table.get(key) {
            Some(row) if row.units <= fixed || row.ends_ms > self.at_least(Instant::now()) => {
                row.units
            }
            _ => fixed,
        }
    }

    /// Whether some live gateway may not have `key`'s row in force yet.
    fn is_pending(&self, key: &str) -> bool {
        self.table
            .get(key)
            .is_some_and(|row| row.version > self.oldest_acked)
    }

    /// The most any gateway of the region may have in force for `key`.
    fn most_in_force(&self, key: &str, fixed: u64) -> u64 {
        let units = self.units(key, fixed);
        match self.table.get(key) {
            Some(row) if self.is_pending(key) => units.max(row.previous),
            _ => units,
        }
    }
}

impl Row {
    /// The row as a gateway puts it in force: a raised share's end by this process's clock,
    /// from a reading of the regional clock (`regional_now`) taken after `sent`.
    fn entry(&self, regions: usize, regional_now: i64, sent: Instant) -> Option<TableEntry> {
        let limit = self.spec.limit()?;
        let raised = self.units > fixed_share(limit.limit(), regions);
        Some(TableEntry {
            units: self.units,
            raised_until: raised.then(|| shifted(sent, self.ends_ms - regional_now)),
        })
    }
}
