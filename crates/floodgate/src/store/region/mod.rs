//! Several regions, one limit: each region decides against its own store, on its share of
//! every limit, and the shares follow the demand through a global store, off the request path.
//!
//! **Shares.** A region may use its *fixed share* of a limit (`limit / regions`, at least 1)
//! without asking anyone: a region that meets a new client decides its first request at once.
//! [`RegionalStore`] wraps the region's store (any of them: exact, batched, cluster, sharded)
//! and decides each check under the region's share of its limit (`limit` and `burst` cut in
//! proportion, [`Limit::with_share`]). The algorithms that batch (token bucket, GCRA, fixed and
//! sliding window counter, on a plain window) trade their shares; the others keep the fixed one.
//!
//! **Trades.** Four times per `sync_interval` every gateway of a region syncs with the region's
//! own Redis (`lua/region_local.lua`): it adds the demand it saw, puts the region's *table* of
//! shares in force, and acknowledges the table's version. The one gateway that holds the
//! region's trader lock then trades every key whose share should move, in one call to the
//! global store (`lua/region_global.lua`): so a region makes one cross-region call per
//! interval, however many gateways and clients it has. A region asks for a quarter more than
//! its demand's rate; the global store grants it what the other regions leave (each counted at
//! its fixed share unless it promised less), never letting the shares together exceed the
//! limit, and, when regions want more than the limit holds, gives each a max-min fair part.
//! Regions learn which keys others want more of from every trade's reply, and lend from
//! their own share of those keys.
//!
//! **Order.** A share goes down on every gateway of the region (the table written, every live
//! gateway's acknowledgement seen, which a gateway gives once no decision it cut under an
//! older version is still on its way to the store) before the global store hears of it, and goes up only after
//! the global store granted it; a bucket's stored credit, kept as time, would be worth more
//! units under a larger share, so a raise is charged the difference first. A grant ends no
//! later than the promises it borrows from ([`RegionSettings::lease_lifetime`] after they were
//! made); a region's gateways drop a raised share by then without being told.
//!
//! **Partitions.** A region that cannot reach the global store keeps serving throughout: its
//! raised shares end when their grants do, its promises to stay low are not renewed and end
//! `timeout + lease_lifetime + sync_interval` after its last trade (a window more for a fixed
//! window, two for a sliding window counter), and every share is then the fixed one. So the regions together never hold more than the limit, partition or not: the
//! bound assumes clocks that advance at the same rate (no synchronised wall clocks: every
//! deadline is a duration measured by the process that keeps it), and a trade the global store
//! applies within `timeout` of its sending or not at all (a trade carries a deadline by the
//! global store's clock, from the offset each gateway measures when it starts and every answer
//! renews; no trade goes before a measurement).
//! A gateway whose syncs with its region's store fail for two intervals and a `timeout`
//! decides every tradeable limit at one unit until one succeeds (its region may have lowered
//! any share), and so does a gateway before its first sync.
//!
//! **Costs.** A limit of fewer units than there are regions gives each region 1 (their sum
//! exceeds the limit, as `store.share` does). A window algorithm lowers no further than its
//! window's count so far (read just before: admissions between the read and the write can
//! overshoot by that many). What the region wants is estimated from one interval of demand.

mod scripts;
mod shares;
mod spec;
mod trader;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use self::shares::Shares;
use self::trader::Trader;
use super::link::Link;
use super::resilience::BreakerState;
use super::{BoxFuture, Check, Lease, Store, StoreError};
use crate::decision::Decision;
use crate::limit::Limit;
use crate::time::Timestamp;

/// Whether a limit's share moves between regions: the algorithms that batch, on a plain window
/// (a calendar period keeps its fixed share).
pub fn trades(limit: &Limit) -> bool {
    shares::tradeable(limit)
}

/// Where a region trades, and how often.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionSettings {
    /// This region's name, one of `regions`.
    pub name: String,
    /// Every region sharing the limits (their number gives the fixed share).
    pub regions: Vec<String>,
    /// The global store's URL: any Redis every region reaches (one server: a trade's keys
    /// span slots).
    pub global_url: String,
    /// The region's own Redis, where its gateways share the table (one server).
    pub regional_url: String,
    /// How often each gateway syncs, and the trader trades.
    pub sync_interval: Duration,
    /// How long a grant or a promise lasts without being renewed.
    pub lease_lifetime: Duration,
    /// Deadline of each call to either store.
    pub timeout: Duration,
}

impl RegionSettings {
    /// Settings with a lease lifetime of three intervals and a timeout of 1 s (a trade over an
    /// ocean takes a few round trips when it has to connect or load its script).
    pub fn new(
        name: impl Into<String>,
        regions: Vec<String>,
        global_url: impl Into<String>,
        regional_url: impl Into<String>,
        sync_interval: Duration,
    ) -> RegionSettings {
        RegionSettings {
            name: name.into(),
            regions,
            global_url: global_url.into(),
            regional_url: regional_url.into(),
            sync_interval,
            lease_lifetime: sync_interval * 3,
            timeout: Duration::from_secs(1),
        }
    }
}

impl RegionSettings {
    /// Why these settings cannot run, if they cannot: the name among the regions, an interval
    /// of at least 10 ms (syncs run four times per interval), a lifetime of at least two
    /// intervals (a grant is renewed once per interval), a timeout greater than zero.
    pub fn check(&self) -> Result<(), String> {
        if !self.regions.contains(&self.name) {
            return Err(format!(
                "region {:?} is not among the regions {:?}",
                self.name, self.regions
            ));
        }
        if self.sync_interval < Duration::from_millis(10) {
            return Err(format!(
                "sync_interval must be at least 10ms, got {:?}",
                self.sync_interval
            ));
        }
        if self.lease_lifetime < self.sync_interval * 2 {
            return Err(format!(
                "lease_lifetime must be at least two sync intervals, got {:?} for {:?}",
                self.lease_lifetime, self.sync_interval
            ));
        }
        if self.timeout.is_zero() {
            return Err("timeout must be greater than 0".to_owned());
        }
        Ok(())
    }
}

/// How a trade with the global store ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TradeResult {
    /// Answered.
    Ok,
    /// Not answered (the global store unreachable, or too slow).
    Failed,
    /// Answered too late: the global store applied nothing.
    Stale,
}

impl TradeResult {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            TradeResult::Ok => "ok",
            TradeResult::Failed => "failed",
            TradeResult::Stale => "stale",
        }
    }
}

/// What a region's trading looks like from one gateway.
#[derive(Debug)]
pub struct RegionStatus {
    name: String,
    trader: AtomicBool,
    ok: AtomicU64,
    failed: AtomicU64,
    stale: AtomicU64,
    rows: AtomicU64,
    last_good: Mutex<Option<Instant>>,
    last_sync: Mutex<Option<Instant>>,
    started: Instant,
}

impl RegionStatus {
    fn new(name: String) -> RegionStatus {
        RegionStatus {
            name,
            trader: AtomicBool::new(false),
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            rows: AtomicU64::new(0),
            last_good: Mutex::new(None),
            last_sync: Mutex::new(None),
            started: Instant::now(),
        }
    }

    /// This region's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether this gateway is its region's trader.
    pub fn is_trader(&self) -> bool {
        self.trader.load(Ordering::Relaxed)
    }

    /// Trades this gateway made, by result.
    pub fn trades(&self, result: TradeResult) -> u64 {
        match result {
            TradeResult::Ok => &self.ok,
            TradeResult::Failed => &self.failed,
            TradeResult::Stale => &self.stale,
        }
        .load(Ordering::Relaxed)
    }

    /// Keys whose share is not the fixed one, as the trader last saw the table.
    pub fn moved_shares(&self) -> u64 {
        self.rows.load(Ordering::Relaxed)
    }

    /// Time since this gateway's last good trade (or since it started, if none); `None` when
    /// it is not the trader.
    pub fn since_last_good_trade(&self) -> Option<Duration> {
        if !self.is_trader() {
            return None;
        }
        let last = *self
            .last_good
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(last.unwrap_or(self.started).elapsed())
    }

    fn set_trader(&self, trader: bool) {
        self.trader.store(trader, Ordering::Relaxed);
        metrics::gauge!(crate::telemetry::REGION_TRADER).set(if trader { 1.0 } else { 0.0 });
    }

    fn set_rows(&self, rows: usize) {
        self.rows.store(rows as u64, Ordering::Relaxed);
    }

    fn traded(&self, result: TradeResult) {
        match result {
            TradeResult::Ok => &self.ok,
            TradeResult::Failed => &self.failed,
            TradeResult::Stale => &self.stale,
        }
        .fetch_add(1, Ordering::Relaxed);
        if result == TradeResult::Ok {
            *self
                .last_good
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
        }
        crate::telemetry::record_region_trade(result.as_str());
    }

    /// The age gauge: 0 on a gateway that does not trade.
    fn publish_age(&self) {
        let age = self
            .since_last_good_trade()
            .map_or(0.0, |age| age.as_secs_f64());
        metrics::gauge!(crate::telemetry::REGION_LAST_TRADE_AGE_SECONDS).set(age);
    }

    /// Time since this gateway's last good sync with its region's table (`None`: none yet).
    pub fn since_last_sync(&self) -> Option<Duration> {
        self.last_sync
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map(|at| at.elapsed())
    }

    fn synced(&self) {
        *self
            .last_sync
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
    }
}

/// The share of one limit key in force on this gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareInForce {
    /// Units of the limit this region decides under now.
    pub units: u64,
    /// The region's fixed share of the limit.
    pub fixed: u64,
    /// How long a share above the fixed one lasts unless renewed.
    pub raised_for: Option<Duration>,
}

/// A region's store: decisions against the region's own store on its shares of each limit,
/// shares traded with the other regions in the background. See the [module docs](self).
///
/// Clones, and the stores [`RegionalStore::sharing`] makes, share the shares and the rounds;
/// the rounds stop when the last of them is dropped.
#[derive(Clone)]
pub struct RegionalStore {
    inner: Arc<dyn Store>,
    core: Arc<Core>,
}

/// What every store of one region on one gateway shares.
struct Core {
    shares: Arc<Shares>,
    status: Arc<RegionStatus>,
    settings: Arc<RegionSettings>,
    rounds: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Set when the store is retired: the rounds stop between two rounds.
    stop: tokio::sync::watch::Sender<bool>,
    /// The region's own store, to give the trader's lock up on drop.
    regional: Arc<Link>,
    /// This gateway's id among its region's.
    gateway: String,
}

impl std::fmt::Debug for RegionalStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionalStore")
            .field("settings", &self.core.settings)
            .finish_non_exhaustive()
    }
}

/// Gives `region`'s trader lock up if `gateway` holds it, and its acknowledgements.
async fn release(regional: &Link, region: &str, gateway: &str) -> Result<(), StoreError> {
    let args = ["release".to_owned(), gateway.to_owned(), "0".to_owned()];
    regional
        .run(&scripts::REGIONAL, &trader::regional_keys(region), &args)
        .await
        .map(drop)
}

impl Drop for Core {
    fn drop(&mut self) {
        if let Some(rounds) = self
            .rounds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            rounds.abort();
        }
        // A gateway shutting down gives the trader's lock up, so that another trades at its
        // next sync rather than after the lock's lifetime (best effort: a crash cannot).
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (regional, gateway) = (self.regional.clone(), self.gateway.clone());
            let name = self.settings.name.clone();
            runtime.spawn(async move {
                let _ = release(&regional, &name, &gateway).await;
            });
        }
    }
}

/// Syncs of each gateway with its region's table per `sync_interval`.
const SYNCS_PER_INTERVAL: u32 = 4;

/// Keys tracked per gateway beyond those the table names.
const MAX_KEYS: usize = 100_000;

impl RegionalStore {
    /// A region's store over `inner` (the region's own store), trading as `settings` say.
    /// Spawns the rounds on the current Tokio runtime.
    pub fn new(
        inner: Arc<dyn Store>,
        settings: RegionSettings,
    ) -> Result<RegionalStore, StoreError> {
        settings.check().map_err(StoreError::Config)?;
        let settings = Arc::new(settings);
        let shares = Arc::new(Shares::new(settings.regions.len(), MAX_KEYS));
        let status = Arc::new(RegionStatus::new(settings.name.clone()));
        let regional = Arc::new(Link::new(&settings.regional_url, settings.timeout)?);
        let gateway = format!("{}-{:016x}", std::process::id(), fastrand::u64(..));
        let mut trader = Trader::new(
            settings.clone(),
            shares.clone(),
            inner.clone(),
            regional.clone(),
            Link::new(&settings.global_url, settings.timeout)?,
            gateway.clone(),
            status.clone(),
        );
        let interval = settings.sync_interval;
        let stop = tokio::sync::watch::Sender::new(false);
        let rounds = tokio::spawn({
            let status = status.clone();
            let mut stopped = stop.subscribe();
            async move {
                // Gateways sync four times per interval (acknowledging lowerings quickly);
                // the trader trades once per interval.
                // (Delayed ticks keep trades at least an interval apart.)
                let mut syncs = tokio::time::interval(interval / SYNCS_PER_INTERVAL);
                syncs.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut trades = tokio::time::interval(interval);
                trades.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    let trade = tokio::select! {
                        biased;
                        _ = stopped.wait_for(|stop| *stop) => return,
                        _ = trades.tick() => true,
                        _ = syncs.tick() => false,
                    };
                    trader.round(trade).await;
                    status.publish_age();
                }
            }
        });
        Ok(RegionalStore {
            inner,
            core: Arc::new(Core {
                shares,
                status,
                settings,
                rounds: Mutex::new(Some(rounds)),
                stop,
                regional,
                gateway,
            }),
        })
    }

    /// A store deciding through `inner` on this region's shares, with this store's rounds (a
    /// gateway's second path to the same regional store, for limits of other algorithms).
    /// The rounds trade `inner`'s keys' shares too, and charge a raise through this store's.
    pub fn sharing(&self, inner: Arc<dyn Store>) -> RegionalStore {
        RegionalStore {
            inner,
            core: self.core.clone(),
        }
    }

    /// The global store's eviction policy (`maxmemory-policy`), or `None` when it cannot be
    /// read (unreachable, or `CONFIG` refused). An `allkeys-*` policy may evict the records,
    /// `born` and the generation, which the regions detect only by settling (SPEC §5): a
    /// gateway warns of it at start.
    pub async fn global_eviction_policy(&self) -> Option<String> {
        let read = async {
            let client =
                deadpool_redis::redis::Client::open(self.core.settings.global_url.as_str()).ok()?;
            let mut connection = client.get_multiplexed_async_connection().await.ok()?;
            let answer: Vec<String> = deadpool_redis::redis::cmd("CONFIG")
                .arg("GET")
                .arg("maxmemory-policy")
                .query_async(&mut connection)
                .await
                .ok()?;
            answer.into_iter().nth(1)
        };
        let deadline = self.core.settings.timeout.max(Duration::from_millis(100));
        tokio::time::timeout(deadline, read).await.ok().flatten()
    }

    /// The settings this store trades by.
    pub fn settings(&self) -> &RegionSettings {
        &self.core.settings
    }

    /// Its trading, as this gateway sees it.
    pub fn status(&self) -> &Arc<RegionStatus> {
        &self.core.status
    }

    /// The share in force here for `key` under `limit`: the table's, or the fixed share.
    pub fn share_of(&self, key: &str, limit: &Limit) -> ShareInForce {
        let fixed = shares::fixed_share(limit.limit(), self.core.settings.regions.len());
        match self.core.shares.share_of(key) {
            Some((units, fixed, raised_until)) => ShareInForce {
                units,
                fixed,
                raised_for: raised_until
                    .and_then(|until| until.checked_duration_since(Instant::now())),
            },
            None => ShareInForce {
                units: fixed,
                fixed,
                raised_for: None,
            },
        }
    }
}

impl Store for RegionalStore {
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        let (scaled, ticket) = self.core.shares.scale(checks, self.core.settings.timeout);
        Box::pin(async move {
            let decided = self.inner.check_and_consume(&scaled, now).await;
            if decided.is_ok() {
                ticket.settled();
            }
            decided
        })
    }

    fn check_and_consume_ready(
        &self,
        checks: &[Check],
        now: Option<Timestamp>,
    ) -> Option<Result<Decision, StoreError>> {
        // Not counted as demand: a decision that is not ready here is counted when it runs.
        let _ = (checks, now);
        None
    }

    fn release<'a>(&'a self, leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.release(leases)
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn peek<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        let scaled = self.core.shares.scale_quietly(checks);
        Box::pin(async move { self.inner.peek(&scaled, now).await })
    }

    fn reset<'a>(&'a self, keys: &'a [Arc<str>]) -> BoxFuture<'a, Result<u64, StoreError>> {
        self.inner.reset(keys)
    }

    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let (scaled, ticket) = self
            .core
            .shares
            .scale_counted_quietly(checks, self.core.settings.timeout);
        Box::pin(async move {
            let charged = self.inner.charge(&scaled, now).await;
            if charged.is_ok() {
                ticket.settled();
            }
            charged
        })
    }

    fn refund<'a>(
        &'a self,
        checks: &'a [Check],
        charged_at: Timestamp,
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let scaled = self.core.shares.scale_quietly(checks);
        Box::pin(async move { self.inner.refund(&scaled, charged_at, now).await })
    }

    fn supports(&self, algorithm: crate::Algorithm) -> bool {
        self.inner.supports(algorithm)
    }

    fn breaker_state(&self) -> Option<BreakerState> {
        self.inner.breaker_state()
    }

    fn override_backend(&self) -> Option<Arc<dyn super::override_backend::OverrideBackend>> {
        self.inner.override_backend()
    }

    /// Waits (up to the region's `timeout`) for a first sync to put the region's table in force:
    /// until then every tradeable limit is decided at one unit (the region may have lowered
    /// any share). Then probes the region's store.
    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let timeout = self.core.settings.timeout;
            if tokio::time::timeout(timeout, self.core.shares.first_sync())
                .await
                .is_err()
            {
                return Err(StoreError::Timeout(timeout));
            }
            self.inner.probe().await
        })
    }

    /// Flushes the region's store, then gives the trader's lock up (a gateway shutting down,
    /// or a store a reload replaced): another gateway of the region trades at its next sync.
    ///
    /// From the flush on, this store decides tradeable limits at one unit (it is being
    /// retired); its rounds stop between two rounds (a trade in flight lands first), and the
    /// lock and its acknowledgement go once no decision it cut is still under way (up to the
    /// region's `timeout`).
    fn flush(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let flushed = self.inner.flush().await;
            let core = &self.core;
            core.shares.expire_current();
            core.stop.send_replace(true);
            let rounds = core
                .rounds
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let Some(rounds) = rounds {
                let longest_round = core.settings.timeout * 3 + core.settings.sync_interval;
                let _ = tokio::time::timeout(longest_round, rounds).await;
            }
            let waited = Instant::now();
            while !core.shares.is_idle() && waited.elapsed() < core.settings.timeout {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let _ = release(&core.regional, &core.settings.name, &core.gateway).await;
            flushed
        })
    }

    fn persistence(&self) -> BoxFuture<'_, Option<bool>> {
        self.inner.persistence()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> RegionSettings {
        RegionSettings::new(
            "eu",
            vec!["eu".into(), "us".into()],
            "redis://g:6379",
            "redis://r:6379",
            Duration::from_secs(1),
        )
    }

    #[test]
    fn settings_that_cannot_run_say_why() {
        assert_eq!(settings().check(), Ok(()));
        let mut outsider = settings();
        outsider.name = "ap".into();
        assert!(
            outsider
                .check()
                .unwrap_err()
                .contains("not among the regions")
        );
        let mut hasty = settings();
        hasty.sync_interval = Duration::ZERO;
        assert!(hasty.check().unwrap_err().contains("at least 10ms"));
        let mut brief = settings();
        brief.lease_lifetime = Duration::from_millis(1500);
        assert!(brief.check().unwrap_err().contains("two sync intervals"));
        let mut impatient = settings();
        impatient.timeout = Duration::ZERO;
        assert!(impatient.check().unwrap_err().contains("greater than 0"));
    }

    #[tokio::test]
    async fn a_store_refuses_settings_that_cannot_run() {
        let mut hasty = settings();
        hasty.sync_interval = Duration::ZERO;
        let store: Arc<dyn Store> = Arc::new(crate::MemoryStore::builder().build());
        assert!(matches!(
            RegionalStore::new(store, hasty),
            Err(StoreError::Config(_))
        ));
    }
}
