//! Denied traffic for free: a node's memory of what Redis denied.
//!
//! When Redis denies a request, no key of it can admit that request before the decision's
//! `retry_after` has passed, unless a reset or a refund gives something back: other nodes'
//! admissions only take more. The script returns, with a denial, the state of every limit as it
//! decided on it; the node keeps those states until the wait is over, and decides the next
//! requests on the same keys from them with the algorithms Redis runs (the differential test
//! holds the Lua and the Rust to identical outcomes). A request those states deny is denied
//! here, with the outcomes (and so the headers) Redis would give at that moment, and no round
//! trip; one they would admit goes to Redis, which then decides as usual, while the memory
//! counts it as admitted meanwhile, so that the requests arriving before its answer are denied
//! here too rather than all sent after it. A client hammering at 100× its limit costs Redis
//! about one decision per retry window per node.
//!
//! The memory's clock is Redis's at the last reply plus the time since that reply arrived:
//! behind Redis's own by the reply's way back, so a wait may end here a few tens of
//! microseconds after it ends in Redis (never before).
//!
//! **What gives capacity back.** A reset through any node is published on [`RESETS_CHANNEL`]
//! and every node forgets those keys when it hears it (within one round trip); a node forgets
//! its own at once. While a node is not subscribed (before its subscription is up, or after it
//! was lost) it denies nothing locally, and when the subscription comes (back) it forgets
//! everything, since a reset may have gone unheard. A refund on another node (a later Redis
//! slot denied its request) is not published: what it frees may stay denied here until the
//! denial's wait is over, at most. Neither is what batched nodes give back of their leases (a
//! hot identity is decided from leases on some nodes and exactly on others): so that it is seen,
//! a denial is decided on for [`LEASE_LIFETIME`] at most after Redis read it (a bound on how
//! stale it may be, of the order of how long batched nodes take to give back what they do not
//! use). A client far over a long window's limit costs one call per node every two seconds,
//! not one per request. Concurrency limits never use this (a lease can come back at
//! any moment), nor do the log and the leaky bucket (their state is not exported), nor
//! decisions with an explicit `now` (tests that move time by hand).

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use crate::algorithm::{self, LimitOutcome, State};
use crate::decision::{Check, Decision};
use crate::limit::Algorithm;
use crate::store::batched::LEASE_LIFETIME;
use crate::time::Timestamp;

/// The channel resets are published on: each message is the reset keys, one per line.
pub const RESETS_CHANNEL: &str = "floodgate:resets";

const SHARDS: usize = 16;

/// The longest a denial is remembered, in microseconds: [`LEASE_LIFETIME`].
const LONGEST_MEMORY_MICROS: u64 = LEASE_LIFETIME.as_micros() as u64;

/// Most keys remembered at once (a node denying more distinct keys within their waits asks
/// Redis for the rest).
const CAPACITY: usize = 100_000;

/// One key's state as a denial read it.
#[derive(Clone, Debug)]
struct Entry {
    algorithm: Algorithm,
    /// `None`: a fresh key.
    state: Option<State>,
    /// Redis's clock when the state was read, and the local instant its reply arrived: the
    /// state's time now is `read_at + (Instant::now() - arrived)`, behind Redis's own by the
    /// reply's way back (tens of microseconds on a LAN). Anchored to the sending instant
    /// instead, a decision that waited for a place in a call would be ahead by its wait and
    /// every wait would end early, in a burst of calls that Redis denies.
    read_at: u64,
    arrived: Instant,
    /// Redis's time at which the wait its state imposes is over: past it the entry is swept.
    until: u64,
}

impl Entry {
    fn time_now(&self) -> u64 {
        self.read_at
            .saturating_add(u64::try_from(self.arrived.elapsed().as_micros()).unwrap_or(u64::MAX))
    }

    /// Whether the state is recent enough to decide on: read less than a lease's lifetime
    /// ago, so that what batched nodes gave back since is seen.
    fn is_recent(&self) -> bool {
        self.time_now() < self.read_at.saturating_add(LONGEST_MEMORY_MICROS)
    }

    /// Whether the entry is still of use: recent, and its wait not over.
    fn is_kept(&self) -> bool {
        self.is_recent() && self.time_now() < self.until
    }
}

/// One shard of the cache: key → entry.
type Shard = HashMap<Arc<str>, Entry>;

/// What a node remembers of Redis's denials; see the [module docs](self).
pub(super) struct DenyCache {
    shards: Box<[Mutex<Shard>]>,
    hasher: std::collections::hash_map::RandomState,
    len: AtomicUsize,
    /// Whether resets are heard now: nothing is denied locally otherwise.
    listening: AtomicBool,
    /// Keys forgotten by a reset so far: a denial whose call was sent before one is not
    /// remembered (it may have read the state the reset removed).
    resets: AtomicU64,
    /// Requests denied here without a call.
    pub(super) local_denials: AtomicU64,
}

impl DenyCache {
    pub(super) fn new() -> DenyCache {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: std::collections::hash_map::RandomState::new(),
            len: AtomicUsize::new(0),
            listening: AtomicBool::new(false),
            resets: AtomicU64::new(0),
            local_denials: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, Shard> {
        let index = (self.hasher.hash_one(key) >> 40) as usize % SHARDS;
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a local decision may be tried at all: resets are heard and something is kept.
    pub(super) fn is_usable(&self) -> bool {
        self.listening.load(Ordering::Acquire) && self.len.load(Ordering::Relaxed) > 0
    }

    /// The entry of `check`'s key, if it is of the check's algorithm.
    fn entry(&self, check: &Check) -> Option<Entry> {
        self.shard(&check.key)
            .get(&*check.key)
            .filter(|entry| entry.algorithm == check.limit.algorithm() && entry.is_recent())
            .cloned()
    }

    /// Resets so far (taken before a call, compared by [`DenyCache::remember`]).
    pub(super) fn resets(&self) -> u64 {
        self.resets.load(Ordering::Acquire)
    }

    /// Keeps `states` (one per check, as a denial read them at `read_at`, its reply arrived at
    /// `arrived`) until `until`.
    pub(super) fn remember(
        &self,
        checks: impl Iterator<Item = (Arc<str>, Algorithm, Option<State>)>,
        read_at: u64,
        arrived: Instant,
        until: u64,
    ) {
        for (key, algorithm, state) in checks {
            let mut shard = self.shard(&key);
            if !shard.contains_key(&key) && self.len.load(Ordering::Relaxed) >= CAPACITY {
                // Full: make room from what is over, or keep nothing more.
                let before = shard.len();
                shard.retain(|_, entry| entry.is_kept());
                self.len.fetch_sub(before - shard.len(), Ordering::Relaxed);
                if self.len.load(Ordering::Relaxed) >= CAPACITY {
                    continue;
                }
            }
            let entry = Entry {
                algorithm,
                state,
                read_at,
                arrived,
                until,
            };
            if shard.insert(key, entry).is_none() {
                self.len.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Applies an admission of `check` at `now` to its remembered state (`entry`, as read):
    /// still a state no more restrictive than Redis's once Redis admits it too.
    fn count_as_admitted(&self, check: &Check, mut entry: Entry, now: u64) {
        algorithm::consume(&check.limit, &mut entry.state, now, check.cost, 0);
        let wait = algorithm::evaluate(&check.limit, entry.state.as_ref(), now, check.cost)
            .retry_after_micros
            .unwrap_or(0);
        entry.until = now.saturating_add(wait);
        if let Some(kept) = self.shard(&check.key).get_mut(&*check.key) {
            *kept = entry;
        }
    }

    /// Forgets `keys` (an admission changed them, or a reset).
    pub(super) fn forget<'k>(&self, keys: impl Iterator<Item = &'k str>) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        for key in keys {
            if self.shard(key).remove(key).is_some() {
                self.len.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Forgets `keys` because they were reset: also keeps a denial already under way from
    /// bringing back what it read before.
    pub(super) fn forget_reset<'k>(&self, keys: impl Iterator<Item = &'k str>) {
        self.resets.fetch_add(1, Ordering::AcqRel);
        self.forget(keys);
    }

    /// Forgets everything.
    pub(super) fn clear(&self) {
        self.resets.fetch_add(1, Ordering::AcqRel);
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            self.len.fetch_sub(shard.len(), Ordering::Relaxed);
            shard.clear();
        }
    }

    /// Resets are heard (`true`), or no longer (`false`; everything is forgotten either way:
    /// one may have gone unheard).
    pub(super) fn set_listening(&self, listening: bool) {
        self.listening.store(false, Ordering::Release);
        self.clear();
        self.listening.store(listening, Ordering::Release);
    }

    /// Drops what is over (called now and then).
    pub(super) fn sweep(&self) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            let before = shard.len();
            shard.retain(|_, entry| entry.is_kept());
            self.len.fetch_sub(before - shard.len(), Ordering::Relaxed);
        }
    }
}

/// Whether a limit of `algorithm` can be denied locally.
pub(super) fn applies_to(algorithm: Algorithm) -> bool {
    algorithm.is_batchable()
}

/// What the nodes' memories make of a decision.
pub(super) enum Local {
    /// Denied here: the decision Redis would give now.
    Denied(Decision),
    /// Every key is remembered and the states would admit it (a wait just ended): it goes to
    /// Redis, and the memories count it as admitted meanwhile, so that the requests arriving
    /// while it is out are denied here rather than all sent after it. The caller forgets the
    /// keys if the call fails or never ends.
    Probing,
    /// Some key is not remembered: Redis decides.
    Unknown,
}

/// Decides `checks` from the caches of the nodes their keys live on (`cache_of(index)`), if
/// every key has an entry; see [`Local`].
pub(super) fn decide_locally<'c>(
    checks: &[Check],
    cache_of: impl Fn(usize) -> Option<&'c DenyCache>,
) -> Local {
    let mut entries = Vec::with_capacity(checks.len());
    for (index, check) in checks.iter().enumerate() {
        let Some(cache) = cache_of(index) else {
            return Local::Unknown;
        };
        if !cache.is_usable() || !applies_to(check.limit.algorithm()) {
            return Local::Unknown;
        }
        let Some(entry) = cache.entry(check) else {
            return Local::Unknown;
        };
        entries.push(entry);
    }
    // One instant for the whole decision, as Redis decides it.
    let Some(now) = entries.iter().map(Entry::time_now).max() else {
        return Local::Unknown;
    };
    let mut outcomes: Vec<LimitOutcome> = checks
        .iter()
        .zip(&entries)
        .map(|(check, entry)| {
            algorithm::evaluate(&check.limit, entry.state.as_ref(), now, check.cost)
        })
        .collect();
    if outcomes.iter().all(|outcome| outcome.allowed) {
        for (index, (check, entry)) in checks.iter().zip(entries).enumerate() {
            if let Some(cache) = cache_of(index) {
                cache.count_as_admitted(check, entry, now);
            }
        }
        return Local::Probing;
    }
    for ((check, entry), outcome) in checks.iter().zip(&entries).zip(&mut outcomes) {
        if outcome.allowed {
            // Not charged, since another limit denied: reported as it stands, as Redis does.
            *outcome = algorithm::evaluate(&check.limit, entry.state.as_ref(), now, 0);
        }
    }
    if let Some(cache) = cache_of(0) {
        cache.local_denials.fetch_add(1, Ordering::Relaxed);
    }
    crate::telemetry::record_local_denial();
    Local::Denied(Decision::from_outcomes(
        Timestamp::from_micros(now),
        checks,
        &outcomes,
        Vec::new(),
    ))
}

/// The state of `fields` for `check`'s algorithm (`None`: a fresh key).
pub(super) fn state_of(check: &Check, fields: Option<[u64; 3]>) -> Option<State> {
    fields.and_then(|fields| algorithm::import(check.limit.algorithm(), fields))
}
