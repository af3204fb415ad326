//! Hot identities: which clients a node decides from leases instead of one call per decision.
//!
//! In exact mode every decision is a round trip to the client's Redis node (or slot). A single
//! heavy client then costs its shard a call per request, however far over its limit it is: the
//! design notes' hot key. [`HotIdentities`] measures each identity's decision rate on this node
//! over an interval; an identity above the threshold is *promoted*: its limits are decided from
//! a lease (see [`BatchedStore`](super::BatchedStore)), which costs about one call per interval,
//! and never admits more than the shared state holds. It is *demoted* back to exact decisions
//! when its rate falls below half the threshold (the gap keeps a client hovering at the
//! threshold from flapping), or when it goes quiet. Every other identity stays exact.
//!
//! An identity is its key's hash tag, `<scope>:<identity hash>` (`key::storage::hash_tag`):
//! one client's limits share it, and it never holds a raw API key.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::time::{Clock, SystemClock, duration_to_micros};

const SHARDS: usize = 32;

/// The identities tracked at most: beyond it a new identity is not measured, and stays exact
/// (10,000 ordinary clients take about a megabyte).
pub const DEFAULT_MAX_TRACKED: usize = 100_000;

/// A promotion or a demotion, as [`HotIdentities::record`] reports it to whoever logs it.
#[derive(Clone, Debug, PartialEq)]
pub enum HotChange {
    /// The identity is now decided from leases.
    Promoted {
        /// Its measured rate, decisions per second.
        rate: f64,
    },
    /// The identity is decided exactly again.
    Demoted {
        /// Its measured rate, decisions per second.
        rate: f64,
    },
}

/// Per-node decision rates of identities, and which of them are hot; see the
/// [module docs](self).
pub struct HotIdentities {
    /// Decisions per second above which an identity is promoted.
    above: u64,
    interval_micros: u64,
    max_tracked: usize,
    clock: Arc<dyn Clock>,
    shards: Box<[Mutex<Shard>]>,
    tracked: AtomicUsize,
    hot: AtomicUsize,
    promotions: AtomicU64,
    demotions: AtomicU64,
}

#[derive(Default)]
struct Shard {
    identities: HashMap<Box<str>, Tracked>,
    /// When this shard last dropped the identities that went quiet.
    swept_at: u64,
}

struct Tracked {
    /// Start of the interval being counted.
    since: u64,
    /// Decisions since then.
    count: u64,
    hot: bool,
}

impl std::fmt::Debug for HotIdentities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HotIdentities")
            .field("above", &self.above)
            .field("interval_micros", &self.interval_micros)
            .field("hot", &self.hot.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl HotIdentities {
    /// Identities above `above` decisions per second on this node, measured over `interval`,
    /// are hot. `above` and `interval` must not be zero (the gateway's config refuses them).
    pub fn new(above: u64, interval: Duration) -> Self {
        HotIdentities {
            above: above.max(1),
            interval_micros: duration_to_micros(interval).max(1),
            max_tracked: DEFAULT_MAX_TRACKED,
            clock: Arc::new(SystemClock),
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            tracked: AtomicUsize::new(0),
            hot: AtomicUsize::new(0),
            promotions: AtomicU64::new(0),
            demotions: AtomicU64::new(0),
        }
    }

    /// Measures time on `clock` (a fake clock in tests).
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Tracks at most `max` identities.
    pub fn with_max_tracked(mut self, max: usize) -> Self {
        self.max_tracked = max;
        self
    }

    /// The threshold, decisions per second.
    pub fn above(&self) -> u64 {
        self.above
    }

    /// The measuring interval.
    pub fn interval(&self) -> Duration {
        Duration::from_micros(self.interval_micros)
    }

    /// Counts one decision of `identity` (a key's hash tag) and says whether it is hot now,
    /// with the promotion or demotion this decision's interval ended in, if any.
    pub fn record(&self, identity: &str) -> (bool, Option<HotChange>) {
        let now = self.clock.now().as_micros();
        let mut shard = lock(self.shard(identity));
        self.sweep_if_due(&mut shard, now);
        let tracked = match shard.identities.get_mut(identity) {
            Some(tracked) => tracked,
            None => {
                if self.tracked.load(Ordering::Relaxed) >= self.max_tracked {
                    return (false, None);
                }
                self.tracked.fetch_add(1, Ordering::Relaxed);
                shard.identities.entry(identity.into()).or_insert(Tracked {
                    since: now,
                    count: 0,
                    hot: false,
                })
            }
        };
        let change = self.close_interval(tracked, now);
        tracked.count += 1;
        (tracked.hot, change)
    }

    /// Whether `identity` is hot now (without counting a decision).
    pub fn is_hot(&self, identity: &str) -> bool {
        lock(self.shard(identity))
            .identities
            .get(identity)
            .is_some_and(|tracked| tracked.hot)
    }

    /// The hot identities now (their hash tags).
    pub fn hot(&self) -> Vec<String> {
        let mut hot: Vec<String> = self
            .shards
            .iter()
            .flat_map(|shard| {
                lock(shard)
                    .identities
                    .iter()
                    .filter(|(_, tracked)| tracked.hot)
                    .map(|(identity, _)| identity.to_string())
                    .collect::<Vec<_>>()
            })
            .collect();
        hot.sort();
        hot
    }

    /// How many identities are hot.
    pub fn hot_count(&self) -> usize {
        self.hot.load(Ordering::Relaxed)
    }

    /// Promotions and demotions so far.
    pub fn changes(&self) -> (u64, u64) {
        (
            self.promotions.load(Ordering::Relaxed),
            self.demotions.load(Ordering::Relaxed),
        )
    }

    /// Demotes the hot identities that went quiet and forgets every quiet one, in every
    /// shard; returns the identities demoted. Recording does this shard by shard as it goes;
    /// a periodic call also covers a node whose traffic stopped.
    pub fn sweep(&self) -> Vec<String> {
        let now = self.clock.now().as_micros();
        let mut demoted = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            demoted.extend(self.sweep_shard(&mut shard, now));
        }
        demoted
    }

    fn shard(&self, identity: &str) -> &Mutex<Shard> {
        // FNV-1a: cheap, and the tag is already a hash.
        let hash = identity
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
                (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
            });
        &self.shards[(hash % SHARDS as u64) as usize]
    }

    /// Ends `tracked`'s interval if it is over: its rate decides a promotion or a demotion.
    fn close_interval(&self, tracked: &mut Tracked, now: u64) -> Option<HotChange> {
        let elapsed = now.saturating_sub(tracked.since);
        if elapsed < self.interval_micros {
            return None;
        }
        // Over the time since the interval began: an idle gap lowers the rate, as it should.
        let rate = tracked.count as f64 * 1_000_000.0 / elapsed as f64;
        tracked.since = now;
        tracked.count = 0;
        if !tracked.hot && rate > self.above as f64 {
            tracked.hot = true;
            self.hot.fetch_add(1, Ordering::Relaxed);
            self.promotions.fetch_add(1, Ordering::Relaxed);
            crate::telemetry::record_hot_identity_change(true, self.hot_count());
            return Some(HotChange::Promoted { rate });
        }
        if tracked.hot && rate < self.above as f64 / 2.0 {
            self.demote(tracked);
            return Some(HotChange::Demoted { rate });
        }
        None
    }

    fn demote(&self, tracked: &mut Tracked) {
        tracked.hot = false;
        self.hot.fetch_sub(1, Ordering::Relaxed);
        self.demotions.fetch_add(1, Ordering::Relaxed);
        crate::telemetry::record_hot_identity_change(false, self.hot_count());
    }

    fn sweep_if_due(&self, shard: &mut Shard, now: u64) {
        if now.saturating_sub(shard.swept_at) >= 2 * self.interval_micros {
            for identity in self.sweep_shard(shard, now) {
                tracing::info!(identity, "hot identity went quiet: decided exactly again");
            }
        }
    }

    /// Closes the intervals of identities not seen for two intervals: a quiet hot one is
    /// demoted, and a quiet one that is not hot is forgotten.
    fn sweep_shard(&self, shard: &mut Shard, now: u64) -> Vec<String> {
        shard.swept_at = now;
        let quiet_after = 2 * self.interval_micros;
        let mut demoted = Vec::new();
        shard.identities.retain(|identity, tracked| {
            if now.saturating_sub(tracked.since) < quiet_after {
                return true;
            }
            if tracked.hot {
                let _ = self.close_interval(tracked, now);
                if tracked.hot {
                    // Still above half the threshold over the quiet gap: it stays.
                    return true;
                }
                demoted.push(identity.to_string());
            }
            self.tracked.fetch_sub(1, Ordering::Relaxed);
            false
        });
        demoted
    }
}

/// A shard's lock; a panic elsewhere while it was held leaves counts that are still counts.
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::{FakeClock, Timestamp};

    fn tracker(clock: &FakeClock) -> HotIdentities {
        HotIdentities::new(100, Duration::from_millis(50)).with_clock(clock.clone())
    }

    /// Drives `rate` decisions per second of `identity` for `duration`, a millisecond apart at
    /// most; returns the changes seen.
    fn drive(
        hot: &HotIdentities,
        clock: &FakeClock,
        identity: &str,
        rate: u64,
        duration: Duration,
    ) -> Vec<HotChange> {
        let step = Duration::from_micros(1_000_000 / rate);
        let mut changes = Vec::new();
        let mut elapsed = Duration::ZERO;
        while elapsed < duration {
            changes.extend(hot.record(identity).1);
            clock.advance(step);
            elapsed += step;
        }
        changes
    }

    #[test]
    fn an_identity_above_the_threshold_is_promoted_and_one_below_is_not() {
        let clock = FakeClock::new(Timestamp::from_micros(1_000_000));
        let hot = tracker(&clock);
        let changes = drive(&hot, &clock, "key:busy", 400, Duration::from_millis(200));
        assert!(matches!(changes[..], [HotChange::Promoted { rate }] if rate > 300.0));
        assert!(hot.is_hot("key:busy"));
        assert!(drive(&hot, &clock, "key:calm", 80, Duration::from_millis(500)).is_empty());
        assert!(!hot.is_hot("key:calm"));
        assert_eq!(hot.hot(), vec!["key:busy".to_owned()]);
        assert_eq!(hot.hot_count(), 1);
    }

    #[test]
    fn a_hot_identity_stays_hot_above_half_the_threshold_and_is_demoted_below() {
        let clock = FakeClock::new(Timestamp::from_micros(1_000_000));
        let hot = tracker(&clock);
        drive(&hot, &clock, "key:a", 400, Duration::from_millis(100));
        assert!(hot.is_hot("key:a"));
        // 70/s: under the threshold, above half of it: no flapping.
        assert!(drive(&hot, &clock, "key:a", 70, Duration::from_millis(300)).is_empty());
        assert!(hot.is_hot("key:a"));
        let changes = drive(&hot, &clock, "key:a", 20, Duration::from_millis(300));
        assert!(
            matches!(changes[..], [HotChange::Demoted { .. }]),
            "{changes:?}"
        );
        assert!(!hot.is_hot("key:a"));
        assert_eq!(hot.changes(), (1, 1));
        assert_eq!(hot.hot_count(), 0);
    }

    #[test]
    fn a_hot_identity_that_goes_quiet_is_demoted_by_a_sweep_and_forgotten() {
        let clock = FakeClock::new(Timestamp::from_micros(1_000_000));
        let hot = tracker(&clock);
        drive(&hot, &clock, "key:a", 400, Duration::from_millis(100));
        drive(&hot, &clock, "key:b", 10, Duration::from_millis(100));
        clock.advance(Duration::from_millis(40));
        assert!(hot.sweep().is_empty(), "not quiet for two intervals yet");
        clock.advance(Duration::from_millis(200));
        assert_eq!(hot.sweep(), vec!["key:a".to_owned()]);
        assert_eq!(hot.hot_count(), 0);
        assert_eq!(hot.tracked.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn identities_beyond_the_cap_are_not_tracked_and_stay_exact() {
        let clock = FakeClock::new(Timestamp::from_micros(1_000_000));
        let hot = tracker(&clock).with_max_tracked(2);
        for _ in 0..200 {
            for identity in ["key:a", "key:b", "key:c"] {
                hot.record(identity);
            }
            clock.advance(Duration::from_millis(1));
        }
        assert_eq!(hot.hot(), vec!["key:a".to_owned(), "key:b".to_owned()]);
        assert!(!hot.is_hot("key:c"));
    }
}
