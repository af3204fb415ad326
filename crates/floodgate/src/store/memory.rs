//! The in-memory store: a sharded hash table of per-key state behind short locks.
//!
//! A request's checks may live in several shards; their locks are taken exclusively in
//! ascending shard order (so two requests never deadlock), which makes a multi-limit check
//! atomic without the refund dance that Redis needs across slots.
//!
//! One path takes a shard's lock shared instead: a single GCRA limit on a key that already
//! exists. GCRA's whole state is one timestamp, kept in an atomic, so that decision is a
//! compare-and-swap, and requests for one hot key from several threads no longer queue on a
//! mutex (governor's approach). Every other decision excludes it by holding the lock
//! exclusively, so all-or-nothing multi-limit decisions stay atomic.
//!
//! Memory stays bounded under rotating keys: every entry records when it becomes
//! indistinguishable from a fresh key, and a shard drops such entries when it is next touched
//! after its sweep interval, or when [`MemoryStore::evict_expired`] runs (periodically, if the
//! store was built inside a Tokio runtime with [`MemoryStoreBuilder::evict_every`]).

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use hashbrown::{DefaultHashBuilder, HashTable};
use smallvec::SmallVec;

use super::shards::{LockedShards, lock, read};
use super::{BoxFuture, Check, Lease, Store, StoreError};
use crate::algorithm::gcra::{self, GcraState};
use crate::algorithm::{self, LimitOutcome, State};
use crate::decision::{Decision, Folded};
use crate::limit::Limit;
use crate::time::{Clock, SystemClock, Timestamp, duration_to_micros};

/// The in-memory store. Clones share the same state.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[RwLock<Shard>]>,
    hasher: DefaultHashBuilder,
    clock: Arc<dyn Clock>,
    next_lease_id: AtomicU64,
    sweep_interval_micros: u64,
    /// The overrides of this store's clients: in this process, like the counters.
    overrides: Arc<crate::store::override_backend::MemoryOverrides>,
}

/// Aligned to two cache lines, so that the lock around it (which this alignment carries) and
/// the table's header are its own: threads working on neighbouring shards do not invalidate
/// each other's lines (adjacent-line prefetch pairs lines, hence two).
#[repr(align(128))]
struct Shard {
    entries: HashTable<Entry>,
    next_sweep_at: u64,
}

struct Entry {
    key: Arc<str>,
    hash: u64,
    slot: Slot,
}

/// A key's state.
enum Slot {
    /// A GCRA limit's theoretical arrival time, changed by compare-and-swap under the shard's
    /// shared lock (and plainly under its exclusive lock). It is also the time from which the
    /// entry equals a fresh key's.
    Gcra(AtomicU64),
    /// Any other algorithm's state, changed only under the shard's exclusive lock.
    Other {
        state: Option<State>,
        /// From this time on, `state` equals a fresh key's and the entry can go.
        idle_at: u64,
    },
}

impl Entry {
    fn new(key: Arc<str>, hash: u64) -> Entry {
        Entry {
            key,
            hash,
            slot: Slot::Other {
                state: None,
                idle_at: 0,
            },
        }
    }

    /// Calls `with` on the entry's state.
    fn read<R>(&self, with: impl FnOnce(Option<&State>) -> R) -> R {
        match &self.slot {
            Slot::Gcra(tat) => with(Some(&State::Gcra(GcraState {
                tat: tat.load(Ordering::Relaxed),
            }))),
            Slot::Other { state, .. } => with(state.as_ref()),
        }
    }

    /// Applies an admission (see [`algorithm::consume`]).
    fn consume(&mut self, limit: &Limit, now: u64, cost: u64, lease_id: u64) {
        self.update(limit, |state| {
            algorithm::consume(limit, state, now, cost, lease_id);
        });
    }

    /// Changes the entry's state with `change`, keeping its slot's form (a GCRA's atomic TAT)
    /// and its idle time.
    fn update(&mut self, limit: &Limit, change: impl FnOnce(&mut Option<State>)) {
        let mut state = match &mut self.slot {
            Slot::Gcra(tat) => Some(State::Gcra(GcraState {
                tat: *tat.get_mut(),
            })),
            Slot::Other { state, .. } => state.take(),
        };
        change(&mut state);
        self.slot = match state {
            Some(State::Gcra(GcraState { tat })) => Slot::Gcra(AtomicU64::new(tat)),
            state => Slot::Other {
                idle_at: state
                    .as_ref()
                    .map_or(0, |state| algorithm::idle_at(limit, state)),
                state,
            },
        };
    }

    /// Gives `units` back ([`algorithm::unconsume`]).
    fn unconsume(&mut self, limit: &Limit, now: u64, units: u64) {
        self.update(limit, |state| {
            if let Some(state) = state {
                algorithm::unconsume(limit, state, now, units);
            }
        });
    }

    /// From this time on, the entry equals a fresh key's.
    fn idle_at(&self) -> u64 {
        match &self.slot {
            Slot::Gcra(tat) => tat.load(Ordering::Relaxed),
            Slot::Other { idle_at, .. } => *idle_at,
        }
    }

    /// The atomic TAT of a GCRA entry.
    fn gcra_tat(&self) -> Option<&AtomicU64> {
        match &self.slot {
            Slot::Gcra(tat) => Some(tat),
            Slot::Other { .. } => None,
        }
    }
}

/// Decides a single GCRA limit on its atomic TAT: the TAT an admission leaves is installed only
/// if no other thread changed it since it was read; otherwise the decision is made again on the
/// TAT that thread left. A denial writes nothing.
fn decide_gcra(limit: &Limit, tat: &AtomicU64, now: u64, cost: u64) -> LimitOutcome {
    // The TAT is the only shared datum: `Relaxed` still orders every change to it.
    let mut current = tat.load(Ordering::Relaxed);
    loop {
        let state = GcraState { tat: current };
        let outcome = gcra::evaluate(limit, Some(&state), now, cost);
        if !outcome.allowed {
            return outcome;
        }
        let next = gcra::consume(limit, Some(&state), now, cost).tat;
        match tat.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return outcome,
            Err(changed) => current = changed,
        }
    }
}

/// Configures a [`MemoryStore`].
#[must_use]
pub struct MemoryStoreBuilder {
    clock: Arc<dyn Clock>,
    shards: usize,
    sweep_interval: Duration,
    evict_every: Option<Duration>,
}

impl MemoryStoreBuilder {
    /// The clock (default: the system clock). Tests pass a [`crate::time::FakeClock`].
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Number of shards, rounded up to a power of two (default: 16 per CPU, at least 64).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.clamp(1, 1 << 16);
        self
    }

    /// How often a shard that is being used drops its idle entries (default 1s).
    pub fn sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = interval;
        self
    }

    /// Also sweep every shard on this period from a background task, so that memory is
    /// returned even when traffic stops. Needs a Tokio runtime at `build`; without one the
    /// setting is ignored. The task ends when the last clone of the store is dropped.
    pub fn evict_every(mut self, period: Duration) -> Self {
        self.evict_every = Some(period);
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let shard_count = self.shards.next_power_of_two();
        let shards = (0..shard_count)
            .map(|_| {
                RwLock::new(Shard {
                    entries: HashTable::new(),
                    next_sweep_at: 0,
                })
            })
            .collect();
        let store = MemoryStore {
            inner: Arc::new(Inner {
                shards,
                hasher: DefaultHashBuilder::default(),
                clock: self.clock,
                next_lease_id: AtomicU64::new(1),
                sweep_interval_micros: duration_to_micros(self.sweep_interval).max(1),
                overrides: Arc::default(),
            }),
        };
        if let (Some(period), Ok(runtime)) =
            (self.evict_every, tokio::runtime::Handle::try_current())
        {
            runtime.spawn(evict_periodically(Arc::downgrade(&store.inner), period));
        }
        store
    }
}

async fn evict_periodically(store: Weak<Inner>, period: Duration) {
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(inner) = store.upgrade() else { return };
        let evicted = inner.evict_expired();
        if evicted > 0 {
            tracing::debug!(evicted, "memory store evicted idle keys");
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// A store on the system clock with default settings.
    pub fn new() -> MemoryStore {
        MemoryStore::builder().build()
    }

    /// Configures a store.
    pub fn builder() -> MemoryStoreBuilder {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        MemoryStoreBuilder {
            clock: Arc::new(SystemClock),
            shards: (cpus * 16).max(64),
            sweep_interval: Duration::from_secs(1),
            evict_every: None,
        }
    }

    /// The synchronous form of [`Store::check_and_consume`]: the memory store never waits.
    pub fn check_and_consume_now(&self, checks: &[Check], now: Option<Timestamp>) -> Decision {
        let now = now.unwrap_or_else(|| self.inner.clock.now());
        self.inner.decide(checks, now, false)
    }

    /// The synchronous form of [`Store::peek`].
    pub fn peek_now(&self, checks: &[Check], now: Option<Timestamp>) -> Decision {
        let now = now.unwrap_or_else(|| self.inner.clock.now());
        self.inner.decide(checks, now, true)
    }

    /// The synchronous form of [`Store::refund`].
    pub fn refund_now(&self, checks: &[Check], charged_at: Timestamp, now: Option<Timestamp>) {
        let now = now.unwrap_or_else(|| self.inner.clock.now());
        self.inner
            .refund(checks, charged_at.as_micros(), now.as_micros());
    }

    /// The synchronous form of [`Store::charge`].
    pub fn charge_now(&self, checks: &[Check], now: Option<Timestamp>) {
        let now = now.unwrap_or_else(|| self.inner.clock.now());
        self.inner.charge(checks, now.as_micros());
    }

    /// Decides a single limit for a single key and returns just its outcome (and the lease id
    /// of a `concurrency` admission): the allocation-free path, the memory store's equivalent
    /// of a keyed limiter's `check_key`.
    pub fn check_one(&self, check: &Check, now: Option<Timestamp>) -> (LimitOutcome, Option<u64>) {
        let now = now.unwrap_or_else(|| self.inner.clock.now());
        self.inner.check_one(check, now.as_micros())
    }

    /// Drops every entry that is idle at the clock's current time; returns how many went.
    pub fn evict_expired(&self) -> usize {
        self.inner.evict_expired()
    }

    /// Number of keys currently held (idle ones included until swept).
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|shard| lock(shard).entries.len())
            .sum()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Inner {
    fn shard_of(&self, hash: u64) -> usize {
        // The table uses the hash's low bits for buckets and top 7 bits for tags; the shard
        // takes bits from the middle so the two do not correlate.
        (hash >> 32) as usize & (self.shards.len() - 1)
    }

    /// One limit, one key: a single lock, no allocation unless the key is new; for a GCRA
    /// key that exists, the lock shared and one compare-and-swap.
    fn check_one(&self, check: &Check, now: u64) -> (LimitOutcome, Option<u64>) {
        let hash = self.hasher.hash_one(&*check.key);
        let shard = &self.shards[self.shard_of(hash)];
        if check.limit.algorithm() == crate::Algorithm::Gcra {
            let shared = read(shard);
            let tat = shared
                .entries
                .find(hash, |entry| *entry.key == *check.key)
                .and_then(Entry::gcra_tat);
            if let Some(tat) = tat {
                return (decide_gcra(&check.limit, tat, now, check.cost), None);
            }
        }
        let mut shard = lock(shard);
        // A key that exists is found once, decided and charged in place.
        let (outcome, lease) = match shard
            .entries
            .find_mut(hash, |entry| *entry.key == *check.key)
        {
            Some(entry) => {
                let outcome =
                    entry.read(|state| algorithm::evaluate(&check.limit, state, now, check.cost));
                let lease = outcome
                    .allowed
                    .then(|| self.consume_entry(entry, check, now))
                    .flatten();
                (outcome, lease)
            }
            None => {
                let outcome = algorithm::evaluate(&check.limit, None, now, check.cost);
                let lease = outcome
                    .allowed
                    .then(|| {
                        let entry = shard.entries.insert_unique(
                            hash,
                            Entry::new(check.key.clone(), hash),
                            |entry| entry.hash,
                        );
                        self.consume_entry(entry.into_mut(), check, now)
                    })
                    .flatten();
                (outcome, lease)
            }
        };
        self.sweep_if_due(&mut shard, now);
        (outcome, lease)
    }

    /// Applies an admission to `check`'s entry, made if it is new; returns the lease id if it
    /// took one.
    fn consume(&self, shard: &mut Shard, check: &Check, hash: u64, now: u64) -> Option<u64> {
        let entry = shard
            .entries
            .entry(hash, |entry| *entry.key == *check.key, |entry| entry.hash)
            .or_insert_with(|| Entry::new(check.key.clone(), hash))
            .into_mut();
        self.consume_entry(entry, check, now)
    }

    /// Applies an admission to `entry`, `check`'s; returns the lease id if it took one.
    fn consume_entry(&self, entry: &mut Entry, check: &Check, now: u64) -> Option<u64> {
        let lease_id = match check.limit.algorithm() {
            crate::Algorithm::Concurrency => self.next_lease_id.fetch_add(1, Ordering::Relaxed),
            _ => 0,
        };
        entry.consume(&check.limit, now, check.cost, lease_id);
        (lease_id != 0).then_some(lease_id)
    }

    fn sweep_if_due(&self, shard: &mut Shard, now: u64) {
        if now >= shard.next_sweep_at {
            shard.sweep(now);
            shard.next_sweep_at = now + self.sweep_interval_micros;
        }
    }

    /// Decides `checks` all-or-nothing; with `peek`, reports the same outcomes and changes
    /// nothing.
    fn decide(&self, checks: &[Check], now: Timestamp, peek: bool) -> Decision {
        if let Some(folded) = Folded::of(checks) {
            return folded.unfold(checks, self.decide(&folded.checks, now, peek));
        }
        let now_micros = now.as_micros();
        if let ([check], false) = (checks, peek) {
            let (outcome, lease) = self.check_one(check, now_micros);
            let leases = lease
                .map(|id| Lease {
                    key: check.key.clone(),
                    id,
                    cost: check.cost,
                })
                .into_iter()
                .collect();
            return Decision::from_outcomes(now, checks, &[outcome], leases);
        }
        let hashes: SmallVec<[u64; 8]> = checks
            .iter()
            .map(|check| self.hasher.hash_one(&*check.key))
            .collect();
        let shard_ids: SmallVec<[usize; 8]> =
            hashes.iter().map(|&hash| self.shard_of(hash)).collect();
        let mut guards = LockedShards::lock(&self.shards, &shard_ids);

        let mut evaluate = |check: &Check, hash: u64, cost: u64| {
            let shard = guards.get(self.shard_of(hash));
            match shard.entries.find(hash, |entry| *entry.key == *check.key) {
                Some(entry) => {
                    entry.read(|state| algorithm::evaluate(&check.limit, state, now_micros, cost))
                }
                None => algorithm::evaluate(&check.limit, None, now_micros, cost),
            }
        };
        let mut outcomes: SmallVec<[LimitOutcome; 8]> = checks
            .iter()
            .zip(&hashes)
            .map(|(check, &hash)| evaluate(check, hash, check.cost))
            .collect();
        let admitted = !peek && outcomes.iter().all(|outcome| outcome.allowed);
        if !admitted {
            // The limits that would have admitted were not charged: report them as they stand.
            for ((check, &hash), outcome) in checks.iter().zip(&hashes).zip(&mut outcomes) {
                if outcome.allowed {
                    *outcome = evaluate(check, hash, 0);
                }
            }
        }

        let mut leases = Vec::new();
        if admitted {
            for (check, &hash) in checks.iter().zip(&hashes) {
                let shard = guards.get(self.shard_of(hash));
                if let Some(id) = self.consume(shard, check, hash, now_micros) {
                    leases.push(Lease {
                        key: check.key.clone(),
                        id,
                        cost: check.cost,
                    });
                }
            }
        }
        for shard in guards.iter_mut() {
            self.sweep_if_due(shard, now_micros);
        }
        Decision::from_outcomes(now, checks, &outcomes, leases)
    }

    /// Adds each check's cost unconditionally (a post-charge); `concurrency` limits are left
    /// alone.
    fn charge(&self, checks: &[Check], now: u64) {
        for check in checks {
            if check.cost == 0 || check.limit.algorithm() == crate::Algorithm::Concurrency {
                continue;
            }
            let hash = self.hasher.hash_one(&*check.key);
            let mut shard = lock(&self.shards[self.shard_of(hash)]);
            self.consume(&mut shard, check, hash, now);
        }
    }

    /// Gives each check's cost back to its entry ([`Store::refund`]); a key with no entry
    /// (idle, swept, or reset since) has nothing to give back to. A window's units are given
    /// back as of `charged_at`, only while `now` is still in that window and the entry holds
    /// it.
    fn refund(&self, checks: &[Check], charged_at: u64, now: u64) {
        for check in checks {
            let algorithm = check.limit.algorithm();
            if check.cost == 0 || !algorithm.is_batchable() {
                continue;
            }
            let now = if algorithm.counts_in_windows() {
                // Units of a window that has ended belong to it (and a sliding counter's
                // next window weighs them): nothing is given back.
                if check.limit.window_bounds(charged_at).0 != check.limit.window_bounds(now).0 {
                    continue;
                }
                charged_at
            } else {
                now
            };
            let hash = self.hasher.hash_one(&*check.key);
            let mut shard = lock(&self.shards[self.shard_of(hash)]);
            if let Some(entry) = shard
                .entries
                .find_mut(hash, |entry| *entry.key == *check.key)
            {
                entry.unconsume(&check.limit, now, check.cost);
            }
        }
    }

    /// Drops the entries of `keys`; returns how many there were.
    fn reset(&self, keys: &[Arc<str>]) -> u64 {
        let mut removed = 0;
        for key in keys {
            let hash = self.hasher.hash_one(&**key);
            let mut shard = lock(&self.shards[self.shard_of(hash)]);
            if let Ok(entry) = shard.entries.find_entry(hash, |entry| *entry.key == **key) {
                entry.remove();
                removed += 1;
            }
        }
        removed
    }

    fn release(&self, leases: &[Lease]) {
        for lease in leases {
            let hash = self.hasher.hash_one(&*lease.key);
            let mut shard = lock(&self.shards[self.shard_of(hash)]);
            if let Ok(mut entry) = shard
                .entries
                .find_entry(hash, |entry| *entry.key == *lease.key)
            {
                let emptied = match &mut entry.get_mut().slot {
                    Slot::Gcra(_) => false,
                    Slot::Other { state: None, .. } => true,
                    Slot::Other {
                        state: Some(state), ..
                    } => {
                        algorithm::release(state, lease.id);
                        matches!(state, State::Concurrency(leases) if leases.leases.is_empty())
                    }
                };
                if emptied {
                    entry.remove();
                }
            }
        }
    }

    fn evict_expired(&self) -> usize {
        let now = self.clock.now().as_micros();
        self.shards
            .iter()
            .map(|shard| {
                let mut shard = lock(shard);
                let evicted = shard.sweep(now);
                shard.next_sweep_at = now + self.sweep_interval_micros;
                evicted
            })
            .sum()
    }
}

impl Shard {
    /// Drops idle entries and gives memory back once the table is mostly empty.
    fn sweep(&mut self, now: u64) -> usize {
        let before = self.entries.len();
        self.entries.retain(|entry| entry.idle_at() > now);
        let len = self.entries.len();
        if self.entries.capacity() > 4 * len + 16 {
            self.entries.shrink_to(len * 2, |entry| entry.hash);
        }
        before - len
    }
}

impl Store for MemoryStore {
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        let decision = self.check_and_consume_now(checks, now);
        Box::pin(std::future::ready(Ok(decision)))
    }

    fn check_and_consume_ready(
        &self,
        checks: &[Check],
        now: Option<Timestamp>,
    ) -> Option<Result<Decision, StoreError>> {
        Some(Ok(self.check_and_consume_now(checks, now)))
    }

    fn release<'a>(&'a self, leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.release(&leases);
        Box::pin(std::future::ready(Ok(())))
    }

    fn backend(&self) -> &'static str {
        "memory"
    }

    /// Its counters live in this process: a restart forgets them.
    fn persistence(&self) -> BoxFuture<'_, Option<bool>> {
        Box::pin(std::future::ready(Some(false)))
    }

    fn override_backend(&self) -> Option<Arc<dyn crate::store::override_backend::OverrideBackend>> {
        Some(self.inner.overrides.clone())
    }

    fn peek<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(std::future::ready(Ok(self.peek_now(checks, now))))
    }

    fn reset<'a>(&'a self, keys: &'a [Arc<str>]) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(std::future::ready(Ok(self.inner.reset(keys))))
    }

    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.charge_now(checks, now);
        Box::pin(std::future::ready(Ok(())))
    }

    fn refund<'a>(
        &'a self,
        checks: &'a [Check],
        charged_at: Timestamp,
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.refund_now(checks, charged_at, now);
        Box::pin(std::future::ready(Ok(())))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::time::FakeClock;

    /// The hot-key path takes the shard's lock shared: while another thread reads the shard, a
    /// GCRA key that exists is still decided (an exclusive lock would wait for the reader), and
    /// a key that does not exist yet waits for it.
    #[test]
    fn an_existing_gcra_key_is_decided_while_its_shard_is_read() {
        let store = MemoryStore::builder()
            .clock(FakeClock::new(Timestamp::from_secs(1_700_000_000)))
            .shards(1)
            .build();
        let limit = Arc::new(Limit::gcra("per-hour", 3, Duration::from_secs(3600)).unwrap());
        let existing = Check::new("fg:{ip:a}:r:per-hour", limit.clone(), 1);
        let new = Check::new("fg:{ip:b}:r:per-hour", limit, 1);
        assert!(store.check_one(&existing, None).0.allowed);

        let reader = read(&store.inner.shards[0]);
        let (decided, decisions) = mpsc::channel();
        std::thread::scope(|scope| {
            let (store, decided) = (&store, decided.clone());
            scope.spawn(move || {
                for check in [&existing, &new] {
                    let (outcome, _) = store.check_one(check, None);
                    decided
                        .send((check.key.clone(), outcome.remaining))
                        .unwrap();
                }
            });
            // Generous bound: a decision is microseconds; a blocked one never comes.
            let first = decisions.recv_timeout(Duration::from_secs(10));
            assert_eq!(
                first,
                Ok((Arc::from("fg:{ip:a}:r:per-hour"), 1)),
                "decided under the shared lock"
            );
            assert!(
                decisions.recv_timeout(Duration::from_millis(100)).is_err(),
                "a new key needs the exclusive lock"
            );
            drop(reader);
            assert_eq!(
                decisions.recv_timeout(Duration::from_secs(10)),
                Ok((Arc::from("fg:{ip:b}:r:per-hour"), 2))
            );
        });
    }
}
