//! One gateway's view of its region's shares: the share of each limit key in force here, the
//! limit each check is decided under, and the demand seen since the last sync.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::spec::LimitSpec;
use crate::limit::Limit;
use crate::store::Check;

/// Shards of the map, so that concurrent decisions seldom wait on one another.
const SHARDS: usize = 16;

/// A region's fixed share of a limit of `limit` units among `regions`: at least 1.
pub(crate) fn fixed_share(limit: u64, regions: usize) -> u64 {
    (limit / regions.max(1) as u64).max(1)
}

/// The part of its fixed share a region never lends, in tenths: a client whose traffic moves
/// to a region that lent its share is served from its first second (at this floor) while the
/// shares follow it. Every other region keeping its floor, a region whose client is
/// concentrated there can still hold `limit - (regions - 1) × floor`: 93 % of the limit with
/// three regions.
const FLOOR_TENTHS: u64 = 1;

/// The least of `fixed` (a region's fixed share) that a region keeps, lending or not: a tenth,
/// at least 1.
pub(crate) fn floor_share(fixed: u64) -> u64 {
    (fixed * FLOOR_TENTHS / 10).max(1)
}

/// Whether a limit's share moves between regions: the algorithms that batch, on a plain window
/// (a calendar period keeps its fixed share).
pub(crate) fn tradeable(limit: &Limit) -> bool {
    limit.algorithm().is_batchable() && limit.calendar().is_none()
}

/// The share of one key as the region's table has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct InForce {
    /// Units of the limit.
    pub(crate) units: u64,
    /// When a share above the fixed one ends here (by this process's clock).
    pub(crate) raised_until: Option<Instant>,
}

/// One key this gateway decided, or that its region's table names.
struct Tracked {
    /// The limit as configured, whose share `scaled` is.
    original: Arc<Limit>,
    /// The share in the table (`None`: the fixed share).
    in_force: Option<InForce>,
    /// The units `scaled` was built for.
    scaled_units: u64,
    /// `original` cut to the share.
    scaled: Arc<Limit>,
    /// Units asked for since the last sync (admitted or not).
    demand: u64,
    /// Syncs since the key was last asked for.
    idle_syncs: u8,
}

/// Syncs a key no row names stays tracked without being asked for (two intervals).
const FORGET_AFTER_SYNCS: u8 = 8;

/// What a region's table says of one key, for a gateway to put in force.
#[derive(Clone, Debug)]
pub(crate) struct TableEntry {
    /// The share, in units of the limit.
    pub(crate) units: u64,
    /// For a share above the fixed one, when it ends here.
    pub(crate) raised_until: Option<Instant>,
}

/// A row just written to the region's table: its key, and its entry with its limit's spec
/// (`None`: removed, the fixed share).
pub(crate) type Written = (Arc<str>, Option<(TableEntry, LimitSpec)>);

/// The shares in force on this gateway. See the [module docs](self).
pub(crate) struct Shares {
    regions: AtomicU64,
    shards: [Mutex<HashMap<Arc<str>, Tracked>>; SHARDS],
    hasher: hashbrown::DefaultHashBuilder,
    /// The most keys tracked; beyond it, keys the table does not name are decided at their
    /// fixed share without their demand being counted.
    max_keys: usize,
    keys: AtomicU64,
    /// Until when this gateway's table is current: past it (its syncs failing), every
    /// tradeable key is decided at one unit, since its region may have lowered any share.
    current_until: Mutex<Option<Instant>>,
    /// Whether a sync ever put the table in force.
    synced: tokio::sync::watch::Sender<bool>,
    /// The version of the table in force.
    version: std::sync::atomic::AtomicI64,
    /// Decisions under way, by the version of the table they were cut under: a version is
    /// acknowledged only once no decision cut under an older one is still on its way to the
    /// store (a lowering must be in force for every decision the store will apply).
    in_flight: Mutex<std::collections::BTreeMap<i64, usize>>,
}

/// A decision under way, cut under one version of the table; counted until dropped, and
/// until `linger` after that unless it was [`Ticket::settled`]: a call that failed or was
/// cancelled may still be applied by its store (a timeout does not take a sent command back).
pub(crate) struct Ticket {
    shares: Arc<Shares>,
    version: i64,
    linger: Duration,
    settled: bool,
}

impl Ticket {
    /// The store answered: nothing of the decision is still on its way.
    pub(crate) fn settled(mut self) {
        self.settled = true;
    }
}

impl Shares {
    fn leave(&self, version: i64) {
        let mut in_flight = self
            .in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = in_flight.get_mut(&version) {
            *count -= 1;
            if *count == 0 {
                in_flight.remove(&version);
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let (shares, version) = (self.shares.clone(), self.version);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if !self.settled => {
                let linger = self.linger;
                runtime.spawn(async move {
                    tokio::time::sleep(linger).await;
                    shares.leave(version);
                });
            }
            _ => shares.leave(version),
        }
    }
}

impl Shares {
    pub(crate) fn new(regions: usize, max_keys: usize) -> Shares {
        Shares {
            regions: AtomicU64::new(regions as u64),
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            hasher: hashbrown::DefaultHashBuilder::default(),
            max_keys,
            keys: AtomicU64::new(0),
            current_until: Mutex::new(None),
            synced: tokio::sync::watch::Sender::new(false),
            version: std::sync::atomic::AtomicI64::new(0),
            in_flight: Mutex::new(std::collections::BTreeMap::new()),
        }
    }

    pub(crate) fn regions(&self) -> usize {
        self.regions.load(Ordering::Relaxed) as usize
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, HashMap<Arc<str>, Tracked>> {
        let index = self.hasher.hash_one(key) as usize % SHARDS;
        self.shards[index]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn is_current(&self, now: Instant) -> bool {
        self.current_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|until| now < until)
    }

    /// The table is current until `until` (a sync succeeded).
    pub(crate) fn mark_current(&self, until: Instant) {
        *self
            .current_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(until);
        self.synced.send_replace(true);
    }

    /// Waits until a first sync put the region's table in force.
    pub(crate) async fn first_sync(&self) {
        let mut synced = self.synced.subscribe();
        let _ = synced.wait_for(|synced| *synced).await;
    }

    /// The units of `limit` in force for `key` now.
    fn units(&self, limit: &Limit, in_force: Option<InForce>, current: bool, now: Instant) -> u64 {
        let fixed = fixed_share(limit.limit(), self.regions());
        if !tradeable(limit) {
            return fixed;
        }
        if !current {
            return 1;
        }
        match in_force {
            Some(share) if share.raised_until.is_none_or(|until| now < until) => share.units,
            _ => fixed,
        }
    }

    /// `checks` with each limit cut to this region's share of it, counting their demand, and
    /// the ticket that counts the decision as under way until it is dropped.
    pub(crate) fn scale(
        self: &Arc<Self>,
        checks: &[Check],
        linger: Duration,
    ) -> (Vec<Check>, Ticket) {
        let ticket = self.enter(linger);
        (self.cut(checks, true), ticket)
    }

    /// `checks` cut without counting demand (a post-charge), with their ticket.
    pub(crate) fn scale_counted_quietly(
        self: &Arc<Self>,
        checks: &[Check],
        linger: Duration,
    ) -> (Vec<Check>, Ticket) {
        let ticket = self.enter(linger);
        (self.cut(checks, false), ticket)
    }

    fn enter(self: &Arc<Self>, linger: Duration) -> Ticket {
        let mut in_flight = self
            .in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Read under the lock: `acknowledgeable` then sees either the ticket or a newer version.
        let version = self.version.load(Ordering::Acquire);
        *in_flight.entry(version).or_default() += 1;
        Ticket {
            shares: self.clone(),
            version,
            linger,
            settled: false,
        }
    }

    /// Decisions from now on are at one unit until a sync puts a table in force again (the
    /// region's table was lost, or the store is being retired).
    pub(crate) fn expire_current(&self) {
        *self
            .current_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }

    /// Whether no decision is under way.
    pub(crate) fn is_idle(&self) -> bool {
        self.in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_empty()
    }

    /// How long a window algorithm's promise may outlast a bucket's, among the keys tracked
    /// here: a window (two for a sliding window counter) of the longest.
    pub(crate) fn longest_window_span(&self) -> Duration {
        let mut longest = Duration::ZERO;
        for shard in &self.shards {
            let shard = shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for tracked in shard.values() {
                let windows = match tracked.original.algorithm() {
                    crate::limit::Algorithm::FixedWindow => 1,
                    crate::limit::Algorithm::SlidingWindowCounter => 2,
                    _ => 0,
                };
                longest = longest.max(tracked.original.window() * windows);
            }
        }
        longest
    }

    /// The table version this gateway may acknowledge: the one in force, or the oldest a
    /// decision still under way was cut under.
    pub(crate) fn acknowledgeable(&self) -> i64 {
        let in_flight = self
            .in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let current = self.version.load(Ordering::Acquire);
        // A decision cut under a version beyond the table's (cut before the table was lost)
        // says nothing of this table's versions: nothing is acknowledged until it is done.
        if in_flight
            .keys()
            .next_back()
            .is_some_and(|&newest| newest > current)
        {
            return 0;
        }
        in_flight
            .keys()
            .next()
            .map_or(current, |&oldest| oldest.min(current))
    }

    /// The table of `version` is in force from now on.
    pub(crate) fn set_version(&self, version: i64) {
        let _in_flight = self
            .in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.version.store(version, Ordering::Release);
    }

    /// `checks` cut as [`Shares::scale`] does, their demand not counted (a peek, a charge
    /// after the response, a refund).
    pub(crate) fn scale_quietly(&self, checks: &[Check]) -> Vec<Check> {
        self.cut(checks, false)
    }

    fn cut(&self, checks: &[Check], count: bool) -> Vec<Check> {
        let now = Instant::now();
        let current = self.is_current(now);
        checks
            .iter()
            .map(|check| {
                let mut shard = self.shard(&check.key);
                let tracked = match shard.get_mut(&*check.key) {
                    Some(tracked) => tracked,
                    None if (self.keys.load(Ordering::Relaxed) as usize) < self.max_keys => {
                        self.keys.fetch_add(1, Ordering::Relaxed);
                        shard.entry(check.key.clone()).or_insert_with(|| Tracked {
                            original: check.limit.clone(),
                            in_force: None,
                            scaled_units: check.limit.limit(),
                            scaled: check.limit.clone(),
                            demand: 0,
                            idle_syncs: 0,
                        })
                    }
                    None => {
                        let units = self.units(&check.limit, None, current, now);
                        return Check {
                            limit: Arc::new(check.limit.with_share(units)),
                            ..check.clone()
                        };
                    }
                };
                if !Arc::ptr_eq(&tracked.original, &check.limit) {
                    // A reload rebuilt the limit.
                    tracked.original = check.limit.clone();
                    tracked.scaled_units = 0;
                }
                let units = self.units(&check.limit, tracked.in_force, current, now);
                if units != tracked.scaled_units {
                    tracked.scaled = Arc::new(check.limit.with_share(units));
                    tracked.scaled_units = units;
                }
                if count && tradeable(&check.limit) {
                    tracked.demand = tracked.demand.saturating_add(check.cost);
                }
                Check {
                    limit: tracked.scaled.clone(),
                    ..check.clone()
                }
            })
            .collect()
    }

    /// The share in force for `key` (`None`: the key is not tracked here).
    pub(crate) fn share_of(&self, key: &str) -> Option<(u64, u64, Option<Instant>)> {
        let now = Instant::now();
        let current = self.is_current(now);
        let shard = self.shard(key);
        let tracked = shard.get(key)?;
        let units = self.units(&tracked.original, tracked.in_force, current, now);
        let fixed = fixed_share(tracked.original.limit(), self.regions());
        Some((
            units,
            fixed,
            tracked.in_force.and_then(|share| share.raised_until),
        ))
    }

    /// Takes the demand seen since the last call: per tradeable key, its units and its limit.
    pub(crate) fn take_demand(&self) -> Vec<(Arc<str>, u64, LimitSpec)> {
        let mut taken = Vec::new();
        for shard in &self.shards {
            let mut shard = shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (key, tracked) in shard.iter_mut() {
                let demand = std::mem::take(&mut tracked.demand);
                tracked.idle_syncs = if demand > 0 {
                    0
                } else {
                    tracked.idle_syncs.saturating_add(1)
                };
                if demand > 0 {
                    taken.push((key.clone(), demand, LimitSpec::of(&tracked.original)));
                }
            }
        }
        taken
    }

    /// Puts the region's table in force: the keys it names at their shares, every other key
    /// at its fixed share (and forgotten, once idle).
    pub(crate) fn apply(&self, table: &HashMap<Arc<str>, (TableEntry, LimitSpec)>, regions: usize) {
        self.regions.store(regions as u64, Ordering::Relaxed);
        let mut forgotten = 0;
        for shard in &self.shards {
            let mut shard = shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            shard.retain(|key, tracked| {
                tracked.in_force = table.get(key).map(|(entry, _)| entry.in_force());
                let keep = tracked.in_force.is_some()
                    || tracked.demand > 0
                    || tracked.idle_syncs < FORGET_AFTER_SYNCS;
                forgotten += usize::from(!keep);
                keep
            });
        }
        self.keys.fetch_sub(forgotten as u64, Ordering::Relaxed);
        for (key, (entry, spec)) in table {
            self.put(key, entry, spec);
        }
    }

    /// Puts rows just written in force (`None`: the fixed share) over the table in force.
    pub(crate) fn overlay(&self, rows: &[Written]) {
        for (key, row) in rows {
            match row {
                Some((entry, spec)) => self.put(key, entry, spec),
                None => {
                    if let Some(tracked) = self.shard(key).get_mut(key) {
                        tracked.in_force = None;
                    }
                }
            }
        }
    }

    /// Puts `entry` in force for `key`, tracking the key (a table row is tracked even beyond
    /// `max_keys`: the table is bounded by what regions trade).
    fn put(&self, key: &Arc<str>, entry: &TableEntry, spec: &LimitSpec) {
        let mut shard = self.shard(key);
        if let Some(tracked) = shard.get_mut(key) {
            tracked.in_force = Some(entry.in_force());
            return;
        }
        let Some(original) = spec.limit() else {
            return;
        };
        let original = Arc::new(original);
        self.keys.fetch_add(1, Ordering::Relaxed);
        shard.insert(
            key.clone(),
            Tracked {
                scaled_units: original.limit(),
                scaled: original.clone(),
                original,
                in_force: Some(entry.in_force()),
                demand: 0,
                idle_syncs: 0,
            },
        );
    }
}

impl TableEntry {
    fn in_force(&self) -> InForce {
        InForce {
            units: self.units,
            raised_until: self.raised_until,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_is_acknowledged_once_no_decision_cut_under_an_older_one_is_under_way() {
        let shares = Arc::new(Shares::new(3, 10));
        shares.set_version(1);
        let ticket = shares.enter(Duration::ZERO);
        shares.set_version(2);
        assert_eq!(
            shares.acknowledgeable(),
            1,
            "a decision of version 1 is under way"
        );
        let newer = shares.enter(Duration::ZERO);
        ticket.settled();
        assert_eq!(shares.acknowledgeable(), 2);
        newer.settled();
        shares.set_version(3);
        assert_eq!(shares.acknowledgeable(), 3);
        // The table lost: a decision of version 3 still under way holds every acknowledgement.
        let lost = shares.enter(Duration::ZERO);
        shares.set_version(1);
        assert_eq!(shares.acknowledgeable(), 0);
        lost.settled();
        assert_eq!(shares.acknowledgeable(), 1);
    }

    #[tokio::test]
    async fn a_decision_that_failed_is_counted_until_its_store_could_have_applied_it() {
        tokio::time::pause();
        let shares = Arc::new(Shares::new(3, 10));
        shares.set_version(1);
        let failed = shares.enter(Duration::from_secs(1));
        shares.set_version(2);
        drop(failed);
        tokio::task::yield_now().await;
        assert_eq!(shares.acknowledgeable(), 1, "it may still land");
        tokio::time::sleep(Duration::from_millis(1100)).await;
        assert_eq!(shares.acknowledgeable(), 2);
    }
}
