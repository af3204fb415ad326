//! Batched mode: each node decides locally from a lease of capacity the shared store granted
//! it, and trades leases with the shared store once per interval.
//!
//! A **lease** is a number of units of one limit that the shared store has counted as used the
//! moment it granted them (the script consumes them from the limit's state, as if admitted): a
//! node admits a request locally, with no round trip, as long as every limit of the request has
//! lease enough for its cost, and takes the cost from the leases. Since every unit a node
//! admits was granted before, and the shared store never grants more than a limit has left,
//! **the nodes together never admit more than the limit allows, however many there are**. The
//! error of local counting becomes a matter of fairness and idle units, not of overshoot.
//!
//! **Sizing.** A lease is sized by the node's demand for the identity: the units its requests
//! asked for per interval (a running estimate). Once per `sync_interval` the node trades every
//! active key in one script call per node (or slot): it gives back what its lease holds beyond
//! the estimate (an idle node's lease flows back to the others) and asks for what it lacks. A
//! request that finds its lease short asks for more at once (its concurrent requests wait for
//! that answer), asking for as much again as the interval asked so far, so that a burst costs a
//! logarithm of its size in calls and a lone node gets all the shared state has room for. Once
//! a call of the interval got less than it asked (the limit is short everywhere), the key's
//! requests short of lease are denied until the next trade, with the wait until then. The first
//! request of an identity on a node is such a request. Calls stay about one per node and
//! interval per active identity, plus the top-ups of a burst.
//!
//! **Outcomes.** A node keeps the shared state as the last trade left it (with every lease
//! counted as used) and evaluates each request on that state with its own unused lease given
//! back: exactly what the shared store would decide if this node's lease had never been
//! taken. Headers are therefore exact when this node's view is current, and up to one interval
//! behind the other nodes' admissions otherwise.
//!
//! **What leases cost.** Units leased to a node and not used (a client moving elsewhere) are
//! unavailable to the others until that node gives them back at its next trade, or, if the
//! node dies, until they refill (a bucket's) or their window ends: a lease is never larger than
//! the limit refills in [`LEASE_LIFETIME`], so a dead node's share returns within it. A lease
//! of a fixed or sliding window is of its window only: when the window changes the node forgets
//! it (the shared store counted it in the old window).
//!
//! **Partial failures.** A store of several nodes (or slots) answers each node's part of a
//! trade apart ([`Leased`]): the identities of the nodes that answered are traded as usual, and
//! only the others' are marked as failing (per key), so that only their requests short of lease
//! go to the failure policy. A trade whose answer was lost is asked again once by the store
//! (Redis's trades are numbered and applied once: SPEC §1); one still unanswered after that
//! ([`Unanswered::Lost`]: Redis may have applied it) has its given-back units and its grant
//! dropped, never spent or given back again,
//! and its debt sent again (counted twice at worst: capacity lost, never an admission above the
//! limit); a trade never sent ([`Unanswered::NotSent`]) is kept whole. A grant belongs to the
//! window of the shared store's time when it was granted. A reset heard from another node (the
//! store's resets channel, [`SyncTarget::on_reset`]) drops this node's leases of its keys.
//!
//! **When the shared store is unreachable**, a node keeps spending what its leases hold until
//! they expire ([`LEASE_LIFETIME`] after their grant); past that, and for any request that
//! needs more, decisions fail (with [`StoreError::BreakerOpen`] once the target's breaker opens
//! after its usual number of failures, else [`StoreError::Unavailable`]: counted as store
//! errors either way), so the layer's failure policy applies exactly as in exact mode. Post-charges beyond the lease are kept as a debt (one integer per key, so the buffer is
//! bounded by `max_keys`) and delivered at the next successful trade, except debts older than
//! their limit's window, which are dropped (by rounds, top-ups and the flush alike).
//!
//! **Files, by phase.** This one holds the types, the entries' state and the [`Store`] face;
//! `local.rs` the local decision on leases, `top_up.rs` first leases and top-ups on a
//! request's path, `trades.rs` the periodic rounds and the last trade on shutdown, `outage.rs`
//! what unanswered trades and a store that is down leave behind, `resets.rs` resets here and
//! heard from other nodes.

mod local;
mod outage;
mod resets;
mod top_up;
mod trades;

use local::Attempt;
use outage::Carried;
use top_up::{FetchClaim, TopUp};
use trades::{sync_check, sync_periodically};

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use smallvec::SmallVec;
use tokio::sync::watch;

use super::resilience::BreakerState;
use super::shards::{LockedShards, lock};
use super::{BoxFuture, Check, Lease, Scope, Store, StoreError};
use crate::algorithm::{self, LimitOutcome, State};
use crate::decision::{Decision, Folded};
use crate::limit::{Algorithm, Limit};
use crate::telemetry;
use crate::time::{Clock, MonotonicClock, Timestamp};

/// How long a lease may be spent after its grant, and the most a bucket's lease may take:
/// what the limit refills in this time (so that a dead node's lease comes back within it).
pub const LEASE_LIFETIME: Duration = Duration::from_secs(2);

/// What the shared store answers to a read or an unconditional charge: its time, and the
/// state of each limit (`None`: the key had expired and nothing was added).
#[derive(Debug)]
pub struct Synced {
    /// The shared store's clock when it answered.
    pub now: Timestamp,
    /// The state of each limit, in the order of the request.
    pub states: Vec<Option<State>>,
}

/// One limit's part of a lease trade.
#[derive(Clone, Debug)]
pub struct LeaseRequest {
    /// The limit and its key (`cost` is not used).
    pub check: Check,
    /// Unused units of this node's lease it gives back.
    pub give_back: u64,
    /// For a window algorithm, the start of the window (µs, by the shared store's clock) the
    /// given-back units were leased in: the shared store credits them only while that window
    /// is current, so that a trade that arrives after its window ended gives nothing back into
    /// the next one. `None` for a bucket's.
    pub leased_in: Option<u64>,
    /// Units this node wants for its lease.
    pub want: u64,
    /// Units to charge unconditionally (post-charges beyond the lease).
    pub charge: u64,
}

/// What the shared store answered to a lease trade, request by request: a store of several
/// nodes (or slots) trades each node's part by its own call, and one failing part leaves the
/// others' answers standing.
#[derive(Debug)]
pub struct Leased {
    /// Per request, in order: its grant, or why it went unanswered.
    pub grants: Vec<Result<Grant, Unanswered>>,
    /// The first error behind an unanswered request, for the caller to report.
    pub failure: Option<StoreError>,
}

impl Leased {
    /// A trade of `requests` requests that failed whole with `error`.
    pub fn failed(requests: usize, error: StoreError) -> Leased {
        let unanswered = Unanswered::after(&error);
        Leased {
            grants: (0..requests).map(|_| Err(unanswered)).collect(),
            failure: Some(error),
        }
    }

    /// The latest shared-store time among the answers, if any came.
    fn latest(&self) -> Option<Timestamp> {
        self.grants
            .iter()
            .filter_map(|grant| grant.as_ref().ok().map(|grant| grant.now))
            .max()
    }
}

/// The shared store's answer to one request of a lease trade.
#[derive(Debug)]
pub struct Grant {
    /// The shared store's clock when it answered (the call's own time).
    pub now: Timestamp,
    /// The shared store's clock when it granted: the window a window's lease belongs to, and
    /// the start of the lease's lifetime. The call's own time, except for a trade asked again
    /// after its answer was lost, which the store had applied the first time: its grant is
    /// of the first run.
    pub granted_at: Timestamp,
    /// The units granted.
    pub granted: u64,
    /// The limit's state after the trade (every lease counted as used).
    pub state: Option<State>,
}

/// Why a request of a lease trade has no answer, which says what its units may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unanswered {
    /// The call was never made (a breaker refused it, the store refused the credentials):
    /// nothing of the trade happened, and it may be sent again as it was.
    NotSent,
    /// The call was made and its answer lost (a reply after the deadline, a connection that
    /// broke): the shared store may have applied the trade. Its given-back units may have
    /// been credited, and its grant taken: neither may be counted on again.
    Lost,
}

impl Unanswered {
    /// What a call that failed with `error` may have done.
    pub fn after(error: &StoreError) -> Unanswered {
        match error {
            StoreError::BreakerOpen
            | StoreError::Rejected(_)
            | StoreError::Config(_)
            | StoreError::Unsupported(_) => Unanswered::NotSent,
            StoreError::Timeout(_) | StoreError::Unavailable(_) | StoreError::Protocol(_) => {
                Unanswered::Lost
            }
        }
    }
}

/// A shared store that batched nodes trade leases with. Every such store also decides exactly
/// (its [`Store`] side gives the backend name and breaker state).
pub trait SyncTarget: Store {
    /// Adds each check's `cost` to its limit unconditionally and returns the resulting states.
    /// A cost of 0 only reads.
    fn sync<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Synced, StoreError>>;

    /// Trades leases: per request, charges `charge`, takes back `give_back`, then grants up to
    /// `want` units of what the limit has left (consuming them), and returns the state. A
    /// store of several nodes answers each node's requests apart: one node's failure leaves
    /// the others' grants in the answer.
    fn lease<'a>(
        &'a self,
        requests: &'a [LeaseRequest],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Leased>;

    /// Calls `listener` with the keys of every reset this store hears of, made through any
    /// node (Redis: the resets channel), until it answers `false` (its owner is gone). A
    /// store that cannot hear resets ignores it (the default).
    fn on_reset(&self, listener: ResetListener) {
        let _ = listener;
    }

    /// Whether a call on `key` made now would be refused without going out (an open breaker
    /// not yet due for its probe): batched decisions that need a call then follow the failure
    /// policy, and rounds leave the key for later. An open breaker due for its probe refuses nothing
    /// (the next call is the probe that may close it; a store that answered `true` until a
    /// call were made would never be called again). Stores with one breaker per node or slot
    /// answer per key, so that one lost node does not stop the others' identities.
    fn is_refused(&self, key: &str) -> bool {
        // A store that cannot say without calling refuses nothing here: its call fails fast
        // on its own breaker. (Its breaker's state would not do: an open breaker stays `Open`
        // until a call makes it half-open, and a caller that asks first would never call.)
        let _ = key;
        false
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

    fn lease<'a>(
        &'a self,
        requests: &'a [LeaseRequest],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Leased> {
        (**self).lease(requests, now)
    }

    fn is_refused(&self, key: &str) -> bool {
        (**self).is_refused(key)
    }

    fn on_reset(&self, listener: ResetListener) {
        (**self).on_reset(listener);
    }
}

/// Hears resets made through other nodes ([`SyncTarget::on_reset`]): called with their keys,
/// it answers whether it still wants to hear of them.
pub type ResetListener = Arc<dyn Fn(&[&str]) -> bool + Send + Sync>;

/// Whether `algorithm` can be decided from batched counters ([`Algorithm::is_batchable`]).
pub fn supports(algorithm: Algorithm) -> bool {
    algorithm.is_batchable()
}

/// A state from the three integer fields the scripts export for `algorithm`.
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
    /// How often leases are traded with the shared store (default 100ms).
    pub fn sync_interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(1));
        self
    }

    /// How long an identity stays cached (and traded every interval) without traffic
    /// (default 2s). Its lease goes back first.
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

    /// The local clock (default: a [`MonotonicClock`], which a step of the host's wall clock
    /// does not reach). Decisions use it plus the offset to the shared store's clock measured
    /// at the last trade; leases expire by it. A clock that steps back between two trades
    /// holds the node's time behind the shared store's until the next.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Builds the store and, inside a Tokio runtime, starts its trading task, which ends when
    /// the last clone of the store is dropped. Without a runtime, call
    /// [`BatchedStore::sync_now`].
    pub fn build(self) -> BatchedStore<T> {
        let idle_rounds = (self.idle_after.as_micros() / self.interval.as_micros().max(1)).max(1);
        let shared = Arc::new(Shared {
            target: self.target,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: std::collections::hash_map::RandomState::new(),
            clock: self.clock,
            interval_micros: u64::try_from(self.interval.as_micros()).unwrap_or(u64::MAX),
            offset_micros: AtomicI64::new(0),
            floor_micros: AtomicU64::new(0),
            keys: AtomicU64::new(0),
            max_keys: self.max_keys as u64,
            idle_rounds: u32::try_from(idle_rounds).unwrap_or(u32::MAX),
            sync_lock: tokio::sync::Mutex::new(()),
            epochs: AtomicU64::new(0),
            own_resets: Mutex::default(),
            next_round_micros: AtomicU64::new(0),
            stats: Stats::default(),
        });
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(sync_periodically(Arc::downgrade(&shared), self.interval));
                let node = Arc::downgrade(&shared);
                shared
                    .target
                    .on_reset(Arc::new(move |keys| match node.upgrade() {
                        Some(shared) => {
                            shared.heard_reset(keys);
                            true
                        }
                        None => false,
                    }));
            }
            // Easy to do by mistake (a store built in `main` before the runtime starts), and
            // silent otherwise: no lease would ever be traded.
            Err(_) => tracing::warn!(
                "BatchedStore built outside a Tokio runtime: it will not sync on its own; \
                 build it inside the runtime, or call BatchedStore::sync_now periodically"
            ),
        }
        BatchedStore { shared }
    }
}

const SHARDS: usize = 64;
/// How long a node waits for the echo of its own reset on the resets channel.
const ECHO_WITHIN: Duration = Duration::from_secs(5);
/// Most limits sent in one script call, so that one call never holds Redis for long.
const SYNC_CHUNK: usize = 512;

/// Local decisions from leases, traded with a shared store; see the [module docs](self).
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
    interval_micros: u64,
    /// Shared-store clock minus local clock, as measured at the last call.
    offset_micros: AtomicI64,
    /// The latest shared-store time seen: local time never runs behind it, so that a state
    /// stamped by the shared store is never "in the future" of a decision.
    floor_micros: AtomicU64,
    keys: AtomicU64,
    max_keys: u64,
    idle_rounds: u32,
    /// One round at a time (the periodic task and [`BatchedStore::sync_now`]); a reset takes
    /// it too, so that no round carries units admitted before the reset past it.
    sync_lock: tokio::sync::Mutex<()>,
    /// The last entry's epoch: each entry gets a new one, so that an answer to a trade made
    /// for an entry that a reset (or a new algorithm) replaced since is not taken in by its
    /// replacement.
    epochs: AtomicU64,
    /// Keys this node reset itself, with the local time (µs): the resets channel echoes
    /// them back, and the echo must not drop what the node fetched since.
    own_resets: Mutex<Vec<(Arc<str>, u64)>>,
    /// Local time (µs) of the next periodic round: the wait a request short of lease is told.
    next_round_micros: AtomicU64,
    stats: Stats,
}

/// Counters of what the trading machinery did, for tests, benchmarks and metrics.
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
    /// Trade calls of the periodic rounds that succeeded (a round makes one per 512 keys).
    pub syncs: u64,
    /// Trade calls that failed (their debts and leases were kept for the next round).
    pub failed_syncs: u64,
    /// Calls made for requests: first sights of an identity and top-ups of a short lease.
    pub fetches: u64,
    /// Post-charged units dropped because they could not be delivered within their window.
    pub dropped_units: u64,
    /// Keys held now.
    pub keys: u64,
}

enum Slot {
    /// The first lease is being fetched; wait for the sender to finish.
    Fetching(watch::Receiver<bool>),
    Ready(Entry),
}

#[derive(Debug)]
struct Entry {
    limit: Arc<Limit>,
    /// The shared state as the last trade left it, every node's lease counted as used.
    shared: Option<State>,
    /// Units of this node's lease not used yet.
    lease: u64,
    /// Units of a lease granted under the limit's earlier settings (a reload changed them):
    /// worth more or less than the new settings say, so they are given back with the next
    /// trade, not spent.
    returning: u64,
    /// The time (the shared store's clock, as decisions see it) after which the lease is not
    /// spent any more: a bucket's lease held while the bucket refills would otherwise be worth
    /// more than the bucket holds.
    lease_expires: u64,
    /// For a window algorithm: the window the lease is of.
    lease_window: Option<u64>,
    /// Units post-charged here beyond the lease, sent with the next call, and the local time
    /// of the oldest of them.
    debt: u64,
    debt_since: u64,
    /// Units asked for (admitted or not) since the last round.
    demand: u64,
    /// Units an interval asks for, as estimated at the last round: the lease's size.
    estimate: u64,
    /// Whether this key had a call on demand (its first sight, or a top-up) since the last
    /// round: at most one per interval, and the next round makes none for it, so that a key
    /// costs at most one call per interval.
    topped_up: bool,
    /// Whether a call this interval got less than it asked: the limit is short everywhere, and
    /// asking again before the next round would only cost calls.
    starved: bool,
    /// Requests that waited for the last call on this key (a first sight, a top-up): the next
    /// top-up asks for them too, so that a burst arriving at once on a fresh key is served
    /// by two calls, not one request per interval.
    queued: u64,
    /// A top-up in flight, which requests on this key wait for.
    refreshing: Option<watch::Receiver<bool>>,
    /// Rounds since the last request touched this key.
    idle_rounds: u32,
    /// This entry's own number ([`Shared::epochs`]).
    epoch: u64,
    /// Whether the last trade of this key went unanswered (or was not sent, its node
    /// refusing calls): a request short of lease is then the failure policy's, since no trade
    /// brings more, not denied to wait for a round. Per key, so that one lost node or slot
    /// sends only its own identities to the policy.
    unanswered: bool,
}

impl Entry {
    fn new(limit: Arc<Limit>, epoch: u64) -> Entry {
        Entry {
            limit,
            epoch,
            shared: None,
            lease: 0,
            returning: 0,
            lease_expires: 0,
            lease_window: None,
            debt: 0,
            debt_since: 0,
            demand: 0,
            estimate: 0,
            topped_up: false,
            starved: false,
            queued: 0,
            refreshing: None,
            idle_rounds: 0,
            unanswered: false,
        }
    }

    /// The shared state with this node's unused lease given back: what the shared store would
    /// decide on if the lease had never been taken.
    fn virtual_state(&self, now: u64) -> Option<State> {
        let mut state = self.shared.clone();
        let unused = self.lease + self.returning;
        if unused > 0
            && let Some(state) = &mut state
        {
            algorithm::unconsume(&self.limit, state, now, unused);
        }
        state
    }

    /// Takes `units` of a refund ([`Store::refund`]) at `now`: from the debt not yet sent
    /// first; then, for a window, into the lease if it may still be spent. Returns what is
    /// left for the shared store to refund, which this node's view of it counts as given back
    /// already (the next trade reads the shared store's own).
    ///
    /// A bucket's units never go back into a lease, which is not capped as the shared bucket
    /// is (tried: the fault-schedule checker found 13 admitted where a bucket of 10 allowed
    /// 11.2, seed 5126). They go to the shared bucket, but no more than the room this node's
    /// view of it has below its capacity with this node's unused lease given back: the shared
    /// level does not count the leases nodes hold, and a bucket that refilled while this
    /// node held a lease would otherwise take the refund on top of it.
    fn take_back(&mut self, now: u64, units: u64) -> u64 {
        let from_debt = units.min(self.debt);
        self.debt -= from_debt;
        if let Some(state) = &mut self.shared {
            algorithm::unconsume(&self.limit, state, now, from_debt);
        }
        let rest = units - from_debt;
        self.expire_lease(now);
        let sent = if !self.limit.algorithm().counts_in_windows() {
            rest.min(self.room_below_capacity(now))
        } else if self.lease > 0 && now < self.lease_expires {
            self.lease += rest;
            0
        } else {
            rest
        };
        if let Some(state) = &mut self.shared {
            algorithm::unconsume(&self.limit, state, now, sent);
        }
        sent
    }

    /// Whole units this node's view of a bucket (the shared level with its unused lease
    /// given back) lacks of the bucket's capacity at `now`; none without a view.
    fn room_below_capacity(&self, now: u64) -> u64 {
        let Some(state) = self.virtual_state(now) else {
            return 0;
        };
        let level = algorithm::evaluate(&self.limit, Some(&state), now, 0).remaining;
        self.limit.capacity().saturating_sub(level)
    }

    /// Stops spending a lease that may not be spent any more. Past its lifetime it is given
    /// back with the next trade (the shared store still counts it as used, in the same
    /// window); of another window than `now`'s it is forgotten (the shared store counted it
    /// in its own window, which no longer counts).
    fn expire_lease(&mut self, now: u64) {
        let window_changed = self
            .lease_window
            .is_some_and(|window| window != window_of(&self.limit, now));
        if window_changed {
            self.lease = 0;
            self.returning = 0;
            // What the old window was short of says nothing of the new one.
            self.starved = false;
        } else if self.lease > 0 && now >= self.lease_expires {
            self.returning += std::mem::take(&mut self.lease);
        }
    }

    /// Takes in a trade's answer to a call that `wanted` units: the new shared state, and more
    /// units. The grant belongs to the shared store's time of the grant, not to this node's
    /// time when the answer arrived: a window's lease granted just before its window ended
    /// is of that window, and is not spent in the next one (`now`, the decisions' time).
    fn adopt(&mut self, grant: Grant, wanted: u64, now: u64) {
        let granted_at = grant.granted_at.as_micros();
        self.unanswered = false;
        self.starved |= grant.granted < wanted;
        self.shared = grant.state;
        // What is held of an earlier window than the grant's is of no use any more.
        self.expire_lease(granted_at);
        if grant.granted > 0 {
            self.lease += grant.granted;
            self.lease_expires = granted_at + duration_micros(LEASE_LIFETIME);
        }
        self.lease_window = self
            .limit
            .algorithm()
            .counts_in_windows()
            .then(|| window_of(&self.limit, granted_at));
        self.expire_lease(now);
    }

    /// Counts the requests queued behind a call just answered (`waiters`, each of `cost`) that
    /// its lease does not cover: the call's own request takes its `cost` first, the waiters
    /// the rest. Those covered are not asked for again: counting them (as the call's whole
    /// queue) made the next top-up ask for units no request was left to spend, held idle on
    /// one node while another's burst was refused.
    fn queue_behind(&mut self, waiters: usize, cost: u64) {
        let cost = cost.max(1);
        let covered = self.lease.saturating_sub(cost) / cost;
        self.queued = (waiters as u64).saturating_sub(covered);
    }

    /// Whether a request short of lease may ask for more now: always for the key's first call
    /// of an interval, and after it unless a call got less than it asked (the limit is short
    /// everywhere, and asking again before the next round would only cost calls). A lone node,
    /// or one whose client's other nodes are idle, so gets all the shared state has room for;
    /// each top-up asks for as much again as the interval asked so far
    /// ([`Entry::top_up_extra`]), so that a burst costs a logarithm of its size in calls, not
    /// one per request.
    fn may_top_up(&self) -> bool {
        !self.topped_up || !self.starved
    }

    /// Units a top-up asks for beyond what its requests lack: as much again as this interval
    /// asked so far, at least the estimate (a client whose rate rises gets a lease that
    /// doubles call by call).
    fn top_up_extra(&self) -> u64 {
        self.estimate.max(self.demand)
    }

    /// The most units a lease of this limit may hold: what it refills in the lease's lifetime
    /// for a bucket (a dead node's lease then comes back within it), its limit for a window.
    fn most_leased(&self) -> u64 {
        if self.limit.algorithm().counts_in_windows() {
            self.limit.limit()
        } else {
            (duration_micros(LEASE_LIFETIME) / self.limit.emission_micros().max(1)).max(1)
        }
    }
}

fn window_of(limit: &Limit, now: u64) -> u64 {
    limit.window_bounds(now).0
}

fn duration_micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
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
            clock: Arc::new(MonotonicClock::new()),
        }
    }

    /// The shared store.
    pub fn target(&self) -> &T {
        &self.shared.target
    }

    /// What the trading machinery has done so far.
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

    /// Units this node holds leased for `key` now (tests, benchmarks).
    pub fn leased(&self, key: &str) -> u64 {
        match self.shared.lock_shard_of(key).get(key) {
            Some(Slot::Ready(entry)) => entry.lease,
            _ => 0,
        }
    }

    /// Runs one trading round now (tests, shutdown); `now` overrides both clocks.
    pub async fn sync_now(&self, now: Option<Timestamp>) -> Result<(), StoreError> {
        self.shared.sync_round(now).await
    }

    /// Gives back every unused lease and delivers every debt ([`Store::flush`] does, with the
    /// store's clock); `now` overrides it (tests whose windows follow their own clock).
    pub async fn give_back(&self, now: Option<Timestamp>) -> Result<(), StoreError> {
        self.shared.give_back_everything(now).await
    }

    /// Gives back what an admitted `checks` took here a moment ago (a later store denied the
    /// request): the units return to this node's leases. (A settlement later on, when a lease
    /// may have ended, is [`Store::refund`].)
    pub fn return_to_leases(&self, checks: &[Check], now: Option<Timestamp>) {
        let _ = now;
        for check in checks {
            let mut shard = self.shared.lock_shard_of(&check.key);
            if let Some(Slot::Ready(entry)) = shard.get_mut(&*check.key) {
                entry.lease += check.cost;
                entry.demand = entry.demand.saturating_sub(check.cost);
            }
        }
    }
}

impl<T: SyncTarget> Shared<T> {
    /// What `checks` would decide on this node, changing nothing: a key this node holds is
    /// read from its view (up to one interval behind the others); any other key from the
    /// shared store, without adopting it.
    async fn peek(&self, checks: &[Check], now: Option<Timestamp>) -> Result<Decision, StoreError> {
        let decided_at = self.now(now);
        let mut states: Vec<Option<Option<State>>> = checks
            .iter()
            .map(
                |check| match self.lock_shard_of(&check.key).get(&*check.key) {
                    Some(Slot::Ready(entry)) => Some(entry.virtual_state(decided_at)),
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

    /// Post-charges `checks`: from this node's lease where it holds the key, the rest as a
    /// debt sent with the next call; straight to the shared store for keys it does not hold.
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
                    let from_lease = check.cost.min(entry.lease);
                    entry.lease -= from_lease;
                    let beyond = check.cost - from_lease;
                    if beyond > 0 {
                        let limit = entry.limit.clone();
                        algorithm::consume(&limit, &mut entry.shared, decided_at, beyond, 0);
                        if entry.debt == 0 {
                            entry.debt_since = self.clock.now().as_micros();
                        }
                        entry.debt += beyond;
                    }
                }
                _ => direct.push(sync_check(&check.key, &check.limit, check.cost)),
            }
        }
        if !direct.is_empty() {
            self.target.sync(&direct, now).await?;
        }
        Ok(())
    }

    /// Refunds `checks` ([`Store::refund`]): a key this node holds pays its unsent debt first;
    /// a window then takes the rest back into its lease while the lease may still be spent
    /// (the same window, within its lifetime), and the rest, and windows this node does not
    /// hold, are refunded in the shared store, whose own window decides whether anything is
    /// given back. A window's units counted in a window that has ended are not given back at
    /// all; a bucket's, past its unsent debt, are refunded in the shared bucket up to the room
    /// the node's view of it has below its capacity ([`Entry::take_back`]).
    async fn refund(
        &self,
        checks: &[Check],
        charged_at: Timestamp,
        now: Option<Timestamp>,
    ) -> Result<(), StoreError> {
        let decided_at = self.now(now);
        let mut direct = Vec::new();
        for check in checks {
            if check.cost == 0 || !supports(check.limit.algorithm()) {
                continue;
            }
            if check.limit.algorithm().counts_in_windows()
                && window_of(&check.limit, charged_at.as_micros())
                    != window_of(&check.limit, decided_at)
            {
                continue;
            }
            let mut shard = self.lock_shard_of(&check.key);
            let rest = match shard.get_mut(&*check.key) {
                Some(Slot::Ready(entry)) => entry.take_back(decided_at, check.cost),
                // A window this node does not hold is refunded where it is counted; a bucket's
                // units are not given back without a view of the leases (`Entry::take_back`).
                _ if check.limit.algorithm().counts_in_windows() => check.cost,
                _ => 0,
            };
            if rest > 0 {
                direct.push(Check {
                    cost: rest,
                    ..check.clone()
                });
            }
        }
        if !direct.is_empty() {
            self.target.refund(&direct, charged_at, now).await?;
        }
        Ok(())
    }

    /// A new entry of `limit`, with an epoch of its own.
    fn new_entry(&self, limit: Arc<Limit>) -> Entry {
        Entry::new(limit, self.epochs.fetch_add(1, Ordering::Relaxed) + 1)
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

    /// Local time until the next periodic round (what a request short of lease waits for).
    fn until_next_round(&self) -> u64 {
        let local_now = self.clock.now().as_micros();
        let next = self.next_round_micros.load(Ordering::Relaxed);
        if next > local_now {
            next - local_now
        } else {
            self.interval_micros
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
            if let Some(folded) = Folded::of(checks) {
                let decision = self.check_and_consume(&folded.checks, now).await?;
                return Ok(folded.unfold(checks, decision));
            }
            let shared = &self.shared;
            loop {
                match shared.decide_locally(checks, shared.now(now))? {
                    Attempt::Decided(decision) => return Ok(decision),
                    Attempt::Wait {
                        fetch,
                        top_up,
                        wait,
                    } => {
                        if !fetch.is_empty() || !top_up.is_empty() {
                            // A call is needed: the failure policy decides while the store
                            // refuses calls for a key it needs (what leases hold was spent
                            // above; the request's other keys do not matter).
                            let needed = fetch
                                .iter()
                                .map(|(index, _)| *index)
                                .chain(top_up.iter().map(|top| top.index));
                            if needed
                                .into_iter()
                                .any(|index| shared.target.is_refused(&checks[index].key))
                            {
                                shared.abandon(checks, fetch, &top_up);
                                return Err(shared.failed(StoreError::BreakerOpen));
                            }
                            shared.fetch(checks, fetch, top_up, now).await?;
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
        Box::pin(async move {
            match Folded::of(checks) {
                Some(folded) => {
                    Ok(folded.unfold(checks, self.shared.peek(&folded.checks, now).await?))
                }
                None => self.shared.peek(checks, now).await,
            }
        })
    }

    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.shared.charge(checks, now))
    }

    fn refund<'a>(
        &'a self,
        checks: &'a [Check],
        charged_at: Timestamp,
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.shared.refund(checks, charged_at, now))
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

    fn override_backend(&self) -> Option<Arc<dyn crate::store::override_backend::OverrideBackend>> {
        self.shared.target.override_backend()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.shared.target.probe()
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(self.shared.give_back_everything(None))
    }

    fn persistence(&self) -> BoxFuture<'_, Option<bool>> {
        self.shared.target.persistence()
    }
}
