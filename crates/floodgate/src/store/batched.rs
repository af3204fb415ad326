//! Batched mode: local counters, synchronised with a shared store once per interval.
//!
//! Every node decides from its own copy of each limit's state, with no round trip on the hot
//! path, and counts what it admitted. Once per `sync_interval` it sends those counts to the
//! shared store in one script call per node (or slot), which adds them unconditionally (they
//! were already admitted) and answers with the resulting state: the sum of what every node
//! sent. The node adopts that state and re-applies what it admitted while the call was out.
//!
//! The first request of an identity on a node waits for one fetch of its state (without it, a
//! new key would start full on every node at once); afterwards the identity is decided locally
//! as long as it stays active, and is dropped after `idle_after` without traffic.
//!
//! **Accuracy.** Between two syncs each node sees the others' admissions late. With `N` nodes,
//! interval `T` and a limit refilling at rate `r` (units per second; `limit / window`), a node
//! can admit at most what its stale copy shows plus what refills locally during `T`, and the
//! debt it creates is charged to everyone at the next sync. The overshoot of any window is
//! therefore bounded by
//!
//! ```text
//! overshoot ≤ (N − 1) × (r × 2T + c)
//! ```
//!
//! where `c` is the most one node can admit from a state that the others have already used up:
//! the capacity (`burst`) for `token_bucket` and `gcra`, the whole `limit` for the window
//! counters (a fixed window that has just started is fresh on every node). The term `c` is only
//! reached when traffic starts on every node at once; under steady traffic the overshoot is
//! about `(N − 1) × r × 2T`. What was over-admitted is recorded in the shared state as a debt (a
//! bucket whose refill is pushed into the future, a count above the limit) that every node sees
//! at its next sync, so a bucket pays it back before admitting again and over time the average
//! converges to the limit; a window counter's excess ends with its window. `BENCHMARKS.md` and
//! the README give the measured figures.
//!
//! **When the shared store is unreachable** the breaker of the target opens after its usual
//! number of failures and decisions return [`StoreError::BreakerOpen`], so the layer's failure
//! policy applies exactly as in exact mode. Unsent counts stay in their entry (one integer per
//! key, so the buffer is bounded by the number of keys, itself capped by `max_keys`) and are
//! replayed at the next successful sync, except counts older than their limit's window, which
//! are dropped: they no longer belong to any window the limit looks at.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use smallvec::SmallVec;
use tokio::sync::watch;

use super::resilience::BreakerState;
use super::shards::{LockedShards, lock};
use super::{BoxFuture, Check, Lease, Store, StoreError};
use crate::algorithm::{self, LimitOutcome, State};
use crate::decision::Decision;
use crate::limit::{Algorithm, Limit};
use crate::telemetry;
use crate::time::{Clock, SystemClock, Timestamp};

/// What the shared store answers to a sync: its time, and the state of each synced limit
/// (`None`: the key had expired and nothing was added).
#[derive(Debug)]
pub struct Synced {
    /// The shared store's clock when it answered.
    pub now: Timestamp,
    /// The state of each limit, in the order of the request.
    pub states: Vec<Option<State>>,
}

/// A shared store that batched nodes synchronise with. Every such store also decides exactly
/// (its [`Store`] side gives the backend name and breaker state).
pub trait SyncTarget: Store {
    /// Adds each check's `cost` to its limit unconditionally (the units were admitted already)
    /// and returns the resulting states. A cost of 0 only reads.
    fn sync<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Synced, StoreError>>;

    /// Whether calls on `key` are refused by an open breaker: batched decisions on it then
    /// follow the failure policy. Stores with one breaker per node or slot answer per key, so
    /// that one lost node does not stop the others' identities.
    fn is_refused(&self, key: &str) -> bool {
        let _ = key;
        self.breaker_state() == Some(BreakerState::Open)
    }
}

impl<T: SyncTarget + ?Sized> SyncTarget for Arc<T> {
    fn sync<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Synced, StoreError>> {
        (**self).sync(checks, now)
    }

    fn is_refused(&self, key: &str) -> bool {
        (**self).is_refused(key)
    }
}

/// Whether `algorithm` can be decided from batched counters ([`Algorithm::is_batchable`]).
pub fn supports(algorithm: Algorithm) -> bool {
    algorithm.is_batchable()
}

/// A state from the three integer fields the sync script exports for `algorithm`.
pub fn state_from_fields(algorithm: Algorithm, fields: [u64; 3]) -> Option<State> {
    algorithm::import(algorithm, fields)
}

/// Configures a [`BatchedStore`].
#[must_use]
pub struct BatchedStoreBuilder<T> {
    target: T,
    interval: Duration,
    idle_after: Duration,
    max_keys: usize,
    clock: Arc<dyn Clock>,
}

impl<T: SyncTarget> BatchedStoreBuilder<T> {
    /// How often counts are sent to the shared store (default 100ms).
    pub fn sync_interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(1));
        self
    }

    /// How long an identity stays cached (and synced every interval) without traffic
    /// (default 2s). After that its next request fetches its state again.
    pub fn idle_after(mut self, idle_after: Duration) -> Self {
        self.idle_after = idle_after;
        self
    }

    /// Most keys held at once (default 1,000,000). A new key beyond it is a store error, so the
    /// failure policy decides it rather than memory growing without bound.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self
    }

    /// The local clock (default: the system clock). Decisions use it plus the measured offset
    /// to the shared store's clock.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Builds the store and, inside a Tokio runtime, starts its sync task, which ends when the
    /// last clone of the store is dropped. Without a runtime, call [`BatchedStore::sync_now`].
    pub fn build(self) -> BatchedStore<T> {
        let idle_rounds = (self.idle_after.as_micros() / self.interval.as_micros().max(1)).max(1);
        let shared = Arc::new(Shared {
            target: self.target,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: std::collections::hash_map::RandomState::new(),
            clock: self.clock,
            offset_micros: AtomicI64::new(0),
            floor_micros: AtomicU64::new(0),
            keys: AtomicU64::new(0),
            max_keys: self.max_keys as u64,
            idle_rounds: u32::try_from(idle_rounds).unwrap_or(u32::MAX),
            sync_lock: tokio::sync::Mutex::new(()),
            resets: AtomicU64::new(0),
            stats: Stats::default(),
        });
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(sync_periodically(Arc::downgrade(&shared), self.interval));
            }
            // Easy to do by mistake (a store built in `main` before the runtime starts), and
            // silent otherwise: the counts would never reach the shared store.
            Err(_) => tracing::warn!(
                "BatchedStore built outside a Tokio runtime: it will not sync on its own; \
                 build it inside the runtime, or call BatchedStore::sync_now periodically"
            ),
        }
        BatchedStore { shared }
    }
}

const SHARDS: usize = 64;
/// Most limits sent in one script call, so that one call never holds Redis for long.
const SYNC_CHUNK: usize = 512;

/// Local counters synchronised with a shared store; see the [module docs](self).
pub struct BatchedStore<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Clone for BatchedStore<T> {
    fn clone(&self) -> Self {
        BatchedStore {
            shared: self.shared.clone(),
        }
    }
}

impl<T> std::fmt::Debug for BatchedStore<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchedStore")
            .field("keys", &self.shared.keys.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

struct Shared<T> {
    target: T,
    shards: Box<[Mutex<Shard>]>,
    hasher: std::collections::hash_map::RandomState,
    clock: Arc<dyn Clock>,
    /// Shared-store clock minus local clock, as measured at the last sync.
    offset_micros: AtomicI64,
    /// The latest shared-store time seen: local time never runs behind it, so that a state
    /// stamped by the shared store is never "in the future" of a decision.
    floor_micros: AtomicU64,
    keys: AtomicU64,
    max_keys: u64,
    idle_rounds: u32,
    /// One sync round at a time (the periodic task and [`BatchedStore::sync_now`]); a reset
    /// takes it too, so that no round carries units admitted before the reset past it.
    sync_lock: tokio::sync::Mutex<()>,
    /// Resets so far: a fetch that began before one does not install what it read.
    resets: AtomicU64,
    stats: Stats,
}

/// Counters of what the sync machinery did, for tests, benchmarks and metrics.
#[derive(Debug, Default)]
struct Stats {
    syncs: AtomicU64,
    failed_syncs: AtomicU64,
    fetches: AtomicU64,
    dropped_units: AtomicU64,
}

/// A snapshot of a batched store's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchedStats {
    /// Sync calls that succeeded (a round makes one per 512 keys).
    pub syncs: u64,
    /// Sync calls that failed (their counts were kept for the next round).
    pub failed_syncs: u64,
    /// First-sight fetches (one per identity and node while it stays active).
    pub fetches: u64,
    /// Units dropped because they could not be delivered within their limit's window.
    pub dropped_units: u64,
    /// Keys held now.
    pub keys: u64,
}

enum Slot {
    /// The state is being fetched; wait for the sender to finish.
    Fetching(watch::Receiver<bool>),
    Ready(Entry),
}

#[derive(Debug)]
struct Entry {
    limit: Arc<Limit>,
    /// This node's copy: the shared state at the last sync plus what was admitted here since.
    state: Option<State>,
    /// Units admitted here and not yet sent.
    pending: u64,
    /// Local time of the oldest unsent unit.
    pending_since: u64,
    /// Units of the sync call now in flight.
    in_flight: u64,
    /// Sync rounds since the last request touched this key.
    idle_rounds: u32,
}

type Shard = HashMap<Arc<str>, Slot>;

impl<T: SyncTarget> BatchedStore<T> {
    /// Configures a batched store over `target`.
    pub fn builder(target: T) -> BatchedStoreBuilder<T> {
        BatchedStoreBuilder {
            target,
            interval: Duration::from_millis(100),
            idle_after: Duration::from_secs(2),
            max_keys: 1_000_000,
            clock: Arc::new(SystemClock),
        }
    }

    /// The shared store.
    pub fn target(&self) -> &T {
        &self.shared.target
    }

    /// What the sync machinery has done so far.
    pub fn stats(&self) -> BatchedStats {
        let stats = &self.shared.stats;
        BatchedStats {
            syncs: stats.syncs.load(Ordering::Relaxed),
            failed_syncs: stats.failed_syncs.load(Ordering::Relaxed),
            fetches: stats.fetches.load(Ordering::Relaxed),
            dropped_units: stats.dropped_units.load(Ordering::Relaxed),
            keys: self.shared.keys.load(Ordering::Relaxed),
        }
    }

    /// Runs one sync round now (tests, shutdown); `now` overrides both clocks.
    pub async fn sync_now(&self, now: Option<Timestamp>) -> Result<(), StoreError> {
        self.shared.sync_round(now).await
    }

    /// Gives back what an admitted `checks` took here (a later store denied the request).
    /// Units already sent stay charged: the refund is local and best effort.
    pub fn refund(&self, checks: &[Check], now: Option<Timestamp>) {
        let now = self.shared.now(now);
        for check in checks {
            let mut shard = self.shared.lock_shard_of(&check.key);
            if let Some(Slot::Ready(entry)) = shard.get_mut(&*check.key) {
                let units = check.cost.min(entry.pending);
                entry.pending -= units;
                if let Some(state) = &mut entry.state {
                    algorithm::unconsume(&check.limit, state, now, units);
                }
            }
        }
    }
}

impl<T: SyncTarget> Shared<T> {
    /// What `checks` would decide on this node, changing nothing: a key this node holds is
    /// read from its local copy (this node's view, up to one interval behind the others); any
    /// other key from the shared store, without adopting it.
    async fn peek(&self, checks: &[Check], now: Option<Timestamp>) -> Result<Decision, StoreError> {
        let decided_at = self.now(now);
        let mut states: Vec<Option<Option<State>>> = checks
            .iter()
            .map(
                |check| match self.lock_shard_of(&check.key).get(&*check.key) {
                    Some(Slot::Ready(entry)) => Some(entry.state.clone()),
                    _ => None,
                },
            )
            .collect();
        let missing: Vec<usize> = (0..checks.len())
            .filter(|&index| states[index].is_none())
            .collect();
        if !missing.is_empty() {
            let reads: Vec<Check> = missing
                .iter()
                .map(|&index| sync_check(&checks[index].key, &checks[index].limit, 0))
                .collect();
            let synced = self.target.sync(&reads, now).await?;
            for (&index, state) in missing.iter().zip(synced.states) {
                states[index] = Some(state);
            }
        }
        let outcomes: Vec<LimitOutcome> = checks
            .iter()
            .zip(&states)
            .map(|(check, state)| {
                let state = state.as_ref().and_then(Option::as_ref);
                let outcome = algorithm::evaluate(&check.limit, state, decided_at, check.cost);
                if outcome.allowed {
                    algorithm::evaluate(&check.limit, state, decided_at, 0)
                } else {
                    outcome
                }
            })
            .collect();
        Ok(Decision::from_outcomes(
            Timestamp::from_micros(decided_at),
            checks,
            &outcomes,
            Vec::new(),
        ))
    }

    /// Post-charges `checks`: on this node's copy, sent with the next sync, for keys it holds;
    /// straight to the shared store for the others.
    async fn charge(&self, checks: &[Check], now: Option<Timestamp>) -> Result<(), StoreError> {
        let decided_at = self.now(now);
        let mut direct = Vec::new();
        for check in checks {
            if check.cost == 0 || !supports(check.limit.algorithm()) {
                continue;
            }
            let mut shard = self.lock_shard_of(&check.key);
            match shard.get_mut(&*check.key) {
                Some(Slot::Ready(entry)) => {
                    algorithm::consume(
                        &entry.limit.clone(),
                        &mut entry.state,
                        decided_at,
                        check.cost,
                        0,
                    );
                    if entry.pending == 0 {
                        entry.pending_since = self.clock.now().as_micros();
                    }
                    entry.pending += check.cost;
                }
                _ => direct.push(sync_check(&check.key, &check.limit, check.cost)),
            }
        }
        if !direct.is_empty() {
            self.target.sync(&direct, now).await?;
        }
        Ok(())
    }

    /// Drops this node's copies of `keys` and their unsent counts, then resets them in the
    /// shared store. No sync round of this node runs meanwhile, and a first-sight fetch that
    /// read the old state does not install it. Other nodes adopt the fresh state at their next
    /// sync; what they admitted in their last interval before it still arrives after the
    /// reset (at most one interval's worth).
    async fn reset(&self, keys: &[Arc<str>]) -> Result<u64, StoreError> {
        let _no_sync_meanwhile = self.sync_lock.lock().await;
        self.resets.fetch_add(1, Ordering::SeqCst);
        for key in keys {
            let mut shard = self.lock_shard_of(key);
            if matches!(shard.get(&**key), Some(Slot::Ready(_))) {
                shard.remove(&**key);
                self.keys.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.target.reset(keys).await
    }

    fn shard_index(&self, key: &str) -> usize {
        (self.hasher.hash_one(key) >> 40) as usize % SHARDS
    }

    fn lock_shard_of(&self, key: &str) -> MutexGuard<'_, Shard> {
        lock(&self.shards[self.shard_index(key)])
    }

    /// The decision time: local clock plus offset, never behind the shared store's last time.
    fn now(&self, now: Option<Timestamp>) -> u64 {
        if let Some(now) = now {
            return now.as_micros();
        }
        let local = self.clock.now().as_micros() as i64;
        let shared = (local + self.offset_micros.load(Ordering::Relaxed)).max(0) as u64;
        shared.max(self.floor_micros.load(Ordering::Relaxed))
    }

    fn observe_shared_time(&self, shared_now: Timestamp, local_at_send: u64) {
        let local_now = self.clock.now().as_micros();
        // The answer was stamped about half-way through the round trip.
        let local_mid = local_at_send + local_now.saturating_sub(local_at_send) / 2;
        self.offset_micros.store(
            shared_now.as_micros() as i64 - local_mid as i64,
            Ordering::Relaxed,
        );
        self.floor_micros
            .fetch_max(shared_now.as_micros(), Ordering::Relaxed);
    }

    /// Decides `checks` from local state, or says which keys must be fetched first.
    fn decide_locally(&self, checks: &[Check], now: u64) -> Result<Attempt, StoreError> {
        let check_shards: SmallVec<[usize; 8]> = checks
            .iter()
            .map(|check| self.shard_index(&check.key))
            .collect();
        let mut guards = LockedShards::lock(&self.shards, &check_shards);

        // Refused before any slot is taken, so that a refusal leaves nothing behind.
        if let Some(check) = checks
            .iter()
            .find(|check| !supports(check.limit.algorithm()))
        {
            return Err(StoreError::Protocol(format!(
                "{} limit {:?} cannot run batched",
                check.limit.algorithm().as_str(),
                check.limit.name()
            )));
        }
        let mut fetch: Vec<(usize, watch::Sender<bool>)> = Vec::new();
        let mut wait = Vec::new();
        for (index, check) in checks.iter().enumerate() {
            let shard = guards.get(check_shards[index]);
            let slot = shard.get(&*check.key);
            match slot {
                Some(Slot::Ready(_)) => continue,
                // A fetch whose requester went away (its future was dropped) is taken over.
                Some(Slot::Fetching(receiver)) if receiver.has_changed().is_ok() => {
                    wait.push(receiver.clone());
                    continue;
                }
                Some(Slot::Fetching(_)) => {}
                None => {
                    if self.keys.load(Ordering::Relaxed) >= self.max_keys {
                        // The slots this request already took for its earlier keys would have
                        // no fetch behind them: give them up (each was counted once).
                        for (taken, _sender) in fetch {
                            guards.get(check_shards[taken]).remove(&*checks[taken].key);
                            self.keys.fetch_sub(1, Ordering::Relaxed);
                        }
                        return Err(StoreError::Unavailable(
                            format!("batched store holds its maximum of {} keys", self.max_keys)
                                .into(),
                        ));
                    }
                    self.keys.fetch_add(1, Ordering::Relaxed);
                }
            }
            let (sender, receiver) = watch::channel(false);
            shard.insert(check.key.clone(), Slot::Fetching(receiver));
            fetch.push((index, sender));
        }
        if !fetch.is_empty() || !wait.is_empty() {
            return Ok(Attempt::Wait { fetch, wait });
        }

        let mut outcomes: SmallVec<[LimitOutcome; 8]> = checks
            .iter()
            .zip(&check_shards)
            .map(|(check, &shard)| {
                let entry = ready(guards.get(shard), &check.key);
                algorithm::evaluate(&check.limit, entry.state.as_ref(), now, check.cost)
            })
            .collect();
        let admitted = outcomes.iter().all(|outcome| outcome.allowed);
        // Read only when a key starts a new batch of unsent units.
        let mut local_now = None;
        for ((check, &shard), outcome) in checks.iter().zip(&check_shards).zip(&mut outcomes) {
            let entry = ready(guards.get(shard), &check.key);
            entry.idle_rounds = 0;
            if !Arc::ptr_eq(&entry.limit, &check.limit) {
                // A reload changed the limit's settings: syncs use the new ones. A new algorithm
                // starts from fresh state (SPEC §3): the units not yet sent belong to the old
                // one and are not charged to it.
                if entry.limit.algorithm() != check.limit.algorithm() {
                    entry.state = None;
                    entry.pending = 0;
                }
                entry.limit = check.limit.clone();
            }
            if admitted {
                algorithm::consume(&check.limit, &mut entry.state, now, check.cost, 0);
                if entry.pending == 0 {
                    entry.pending_since =
                        *local_now.get_or_insert_with(|| self.clock.now().as_micros());
                }
                entry.pending += check.cost;
            } else if outcome.allowed {
                // Not charged, since another limit denied: report it as it stands.
                *outcome = algorithm::evaluate(&check.limit, entry.state.as_ref(), now, 0);
            }
        }
        Ok(Attempt::Decided(Decision::from_outcomes(
            Timestamp::from_micros(now),
            checks,
            &outcomes,
            Vec::new(),
        )))
    }

    /// Fetches the state of the keys this request found missing and makes them ready.
    async fn fetch(
        &self,
        checks: &[Check],
        fetch: Vec<(usize, watch::Sender<bool>)>,
        now: Option<Timestamp>,
    ) -> Result<(), StoreError> {
        self.stats.fetches.fetch_add(1, Ordering::Relaxed);
        let reads: Vec<Check> = fetch
            .iter()
            .map(|&(index, _)| sync_check(&checks[index].key, &checks[index].limit, 0))
            .collect();
        // Until the states are in, the slots are this fetch's: if it fails, or its request goes
        // away mid-way (the future is dropped), they go, and the key count with them.
        let mut claim = FetchClaim {
            shared: self,
            slots: fetch
                .into_iter()
                .map(|(index, sender)| (checks[index].key.clone(), sender))
                .collect(),
        };
        let resets_before = self.resets.load(Ordering::SeqCst);
        let local_at_send = self.clock.now().as_micros();
        let synced = self.target.sync(&reads, now).await?;
        self.observe_shared_time(synced.now, local_at_send);
        if self.resets.load(Ordering::SeqCst) != resets_before {
            // What was read may predate a reset: the claim gives the slots up, and this
            // request and the waiters fetch again.
            return Ok(());
        }
        for (position, (key, sender)) in std::mem::take(&mut claim.slots).into_iter().enumerate() {
            let check = &reads[position];
            self.lock_shard_of(&key).insert(
                key,
                Slot::Ready(Entry {
                    limit: check.limit.clone(),
                    state: synced.states.get(position).cloned().flatten(),
                    pending: 0,
                    pending_since: 0,
                    in_flight: 0,
                    idle_rounds: 0,
                }),
            );
            // Waiters retry: they find the key ready.
            let _ = sender.send(true);
        }
        Ok(())
    }

    /// Sends every active key's unsent units and adopts the states the shared store returns.
    async fn sync_round(&self, now: Option<Timestamp>) -> Result<(), StoreError> {
        let _one_round_at_a_time = self.sync_lock.lock().await;
        let local_now = self.clock.now().as_micros();
        let mut batch = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            shard.retain(|key, slot| {
                let entry = match slot {
                    Slot::Ready(entry) => entry,
                    // A fetch in progress stays; one whose fetcher is gone without giving its
                    // slot up (it cannot happen by the paths above, and must not pile up if
                    // it ever does) goes with its count.
                    Slot::Fetching(receiver) => {
                        let abandoned = receiver.has_changed().is_err();
                        if abandoned {
                            self.keys.fetch_sub(1, Ordering::Relaxed);
                        }
                        return !abandoned;
                    }
                };
                if entry.pending == 0 && entry.idle_rounds >= self.idle_rounds {
                    self.keys.fetch_sub(1, Ordering::Relaxed);
                    return false;
                }
                entry.idle_rounds = entry.idle_rounds.saturating_add(1);
                let mut units = entry.pending;
                if units > 0
                    && local_now.saturating_sub(entry.pending_since) > entry.limit.window_micros()
                {
                    // Too old to belong to any window the limit still looks at.
                    self.stats.dropped_units.fetch_add(units, Ordering::Relaxed);
                    telemetry::record_batched_dropped(units);
                    tracing::warn!(
                        units,
                        limit = entry.limit.name(),
                        "batched counts older than their window dropped after a store outage"
                    );
                    units = 0;
                }
                entry.pending = 0;
                entry.in_flight = units;
                batch.push(sync_check(key, &entry.limit, units));
                true
            });
        }
        let mut outcome = Ok(());
        for chunk in batch.chunks(SYNC_CHUNK) {
            let local_at_send = self.clock.now().as_micros();
            match self.target.sync(chunk, now).await {
                Ok(synced) => {
                    self.observe_shared_time(synced.now, local_at_send);
                    let decided_at = self.now(now);
                    for (check, state) in chunk.iter().zip(synced.states) {
                        self.adopt(check, state, decided_at);
                    }
                    self.stats.syncs.fetch_add(1, Ordering::Relaxed);
                    telemetry::record_batched_sync(true);
                }
                Err(error) => {
                    for check in chunk {
                        self.keep_for_later(check);
                    }
                    self.stats.failed_syncs.fetch_add(1, Ordering::Relaxed);
                    telemetry::record_batched_sync(false);
                    outcome = Err(error);
                }
            }
        }
        outcome
    }

    /// Replaces a key's local copy by the shared state, then re-applies what was admitted here
    /// while the sync call was out.
    fn adopt(&self, check: &Check, state: Option<State>, now: u64) {
        let mut shard = self.lock_shard_of(&check.key);
        if let Some(Slot::Ready(entry)) = shard.get_mut(&*check.key) {
            entry.state = state;
            entry.in_flight = 0;
            if entry.pending > 0 {
                let limit = entry.limit.clone();
                algorithm::consume(&limit, &mut entry.state, now, entry.pending, 0);
            }
        }
    }

    /// Puts a failed call's units back with the key's unsent ones.
    fn keep_for_later(&self, check: &Check) {
        let mut shard = self.lock_shard_of(&check.key);
        if let Some(Slot::Ready(entry)) = shard.get_mut(&*check.key) {
            entry.pending += entry.in_flight;
            entry.in_flight = 0;
        }
    }
}

/// The "fetching" slots one fetch created. Dropped while it still holds them (the fetch failed,
/// or was abandoned), it removes those still its own and uncounts their keys; its senders go
/// with it, which wakes the waiters, who then fetch for themselves.
struct FetchClaim<'s, T: SyncTarget> {
    shared: &'s Shared<T>,
    slots: Vec<(Arc<str>, watch::Sender<bool>)>,
}

impl<T: SyncTarget> Drop for FetchClaim<'_, T> {
    fn drop(&mut self) {
        for (key, sender) in self.slots.drain(..) {
            let mut shard = self.shared.lock_shard_of(&key);
            let ours = matches!(
                shard.get(&*key),
                Some(Slot::Fetching(receiver)) if receiver.same_channel(&sender.subscribe())
            );
            if ours && shard.remove(&*key).is_some() {
                self.shared.keys.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

enum Attempt {
    Decided(Decision),
    /// Keys this request must fetch (with the sender that wakes other waiters), and fetches by
    /// other requests to wait for.
    Wait {
        fetch: Vec<(usize, watch::Sender<bool>)>,
        wait: Vec<watch::Receiver<bool>>,
    },
}

/// The ready entry of `key`, which the caller has seen ready under the same lock.
fn ready<'s>(shard: &'s mut Shard, key: &str) -> &'s mut Entry {
    match shard.get_mut(key) {
        Some(Slot::Ready(entry)) => entry,
        _ => unreachable!("every key was seen ready under the same locks"),
    }
}

fn sync_check(key: &Arc<str>, limit: &Arc<Limit>, units: u64) -> Check {
    Check {
        key: key.clone(),
        rule: limit.shared_name().clone(),
        limit: limit.clone(),
        cost: units,
    }
}

async fn sync_periodically<T: SyncTarget>(shared: Weak<Shared<T>>, interval: Duration) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if let Err(error) = shared.sync_round(None).await {
            tracing::debug!(%error, "batched sync failed; counts kept for the next round");
        }
    }
}

impl<T: SyncTarget> Store for BatchedStore<T> {
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(async move {
            let shared = &self.shared;
            loop {
                if checks
                    .iter()
                    .any(|check| shared.target.is_refused(&check.key))
                {
                    return Err(StoreError::BreakerOpen);
                }
                match shared.decide_locally(checks, shared.now(now))? {
                    Attempt::Decided(decision) => return Ok(decision),
                    Attempt::Wait { fetch, wait } => {
                        if !fetch.is_empty() {
                            shared.fetch(checks, fetch, now).await?;
                        }
                        for mut receiver in wait {
                            // A dropped sender (its request went away) is taken over on retry.
                            let _ = receiver.wait_for(|done| *done).await;
                        }
                    }
                }
            }
        })
    }

    fn release<'a>(&'a self, _leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        // Batched limits never take leases (concurrency cannot run batched).
        Box::pin(std::future::ready(Ok(())))
    }

    fn backend(&self) -> &'static str {
        "batched"
    }

    fn peek<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(self.shared.peek(checks, now))
    }

    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.shared.charge(checks, now))
    }

    fn reset<'a>(&'a self, keys: &'a [Arc<str>]) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(self.shared.reset(keys))
    }

    fn supports(&self, algorithm: Algorithm) -> bool {
        supports(algorithm)
    }

    fn breaker_state(&self) -> Option<BreakerState> {
        self.shared.target.breaker_state()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.shared.target.probe()
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(self.shared.sync_round(None))
    }
}
