//! The algorithms as pure functions of `(state, now, limit, cost)`.
//!
//! Each algorithm is split in two steps so that several limits can be decided all-or-nothing:
//! [`evaluate`] computes the outcome without changing anything, and [`consume`] applies an
//! admission once every limit of the request has admitted it. [`check`] chains both for one
//! limit. Times are microseconds since the epoch; a missing state is a fresh key.
//!
//! Every function here is mirrored by a script in `lua/`, and a differential test holds the two
//! to identical outcomes.

mod concurrency;
mod fixed_window;
pub(crate) mod gcra;
mod leaky_bucket;
mod sliding_window_counter;
mod sliding_window_log;
mod token_bucket;

pub use concurrency::{ConcurrencyState, LeaseEntry};
pub use fixed_window::FixedWindowState;
pub use gcra::GcraState;
pub use leaky_bucket::LeakyBucketState;
pub use sliding_window_counter::SlidingWindowCounterState;
pub use sliding_window_log::{LogEntry, SlidingWindowLogState};
pub use token_bucket::TokenBucketState;

use crate::limit::{Algorithm, Limit};

/// The outcome of one limit for one request. Durations are in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitOutcome {
    /// Whether this limit admits the request.
    pub allowed: bool,
    /// Whole units still available right after this decision.
    pub remaining: u64,
    /// Time until the limit is fully available again (or its window ends).
    pub reset_after_micros: u64,
    /// When denied: the exact time until the request, sent alone, would be admitted. `None`
    /// when allowed, or when the cost exceeds the capacity and it can never be admitted.
    pub retry_after_micros: Option<u64>,
    /// For `leaky_bucket`: how long the admitted request must wait before it leaves.
    pub delay_micros: u64,
}

impl LimitOutcome {
    fn allowed(remaining: u64, reset_after_micros: u64) -> Self {
        LimitOutcome {
            allowed: true,
            remaining,
            reset_after_micros,
            retry_after_micros: None,
            delay_micros: 0,
        }
    }

    fn denied(remaining: u64, reset_after_micros: u64, retry_after_micros: u64) -> Self {
        LimitOutcome {
            allowed: false,
            remaining,
            reset_after_micros,
            retry_after_micros: Some(retry_after_micros),
            delay_micros: 0,
        }
    }

    /// Denied because the cost exceeds what the limit can ever hold.
    fn never(remaining: u64, reset_after_micros: u64) -> Self {
        LimitOutcome {
            allowed: false,
            remaining,
            reset_after_micros,
            retry_after_micros: None,
            delay_micros: 0,
        }
    }

    fn delayed_by(self, delay_micros: u64) -> Self {
        LimitOutcome {
            delay_micros,
            ..self
        }
    }

    /// Whether the request was denied for good: its cost exceeds the limit's capacity.
    pub fn is_never_admissible(&self) -> bool {
        !self.allowed && self.retry_after_micros.is_none()
    }
}

/// The state of one key under one algorithm.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// See [`Algorithm::TokenBucket`].
    TokenBucket(TokenBucketState),
    /// See [`Algorithm::Gcra`].
    Gcra(GcraState),
    /// See [`Algorithm::FixedWindow`].
    FixedWindow(FixedWindowState),
    /// See [`Algorithm::SlidingWindowLog`].
    SlidingWindowLog(SlidingWindowLogState),
    /// See [`Algorithm::SlidingWindowCounter`].
    SlidingWindowCounter(SlidingWindowCounterState),
    /// See [`Algorithm::LeakyBucket`].
    LeakyBucket(LeakyBucketState),
    /// See [`Algorithm::Concurrency`].
    Concurrency(ConcurrencyState),
}

/// Decides one limit without changing its state.
///
/// A state of another algorithm (the limit was reconfigured) counts as a fresh key.
pub fn evaluate(limit: &Limit, state: Option<&State>, now: u64, cost: u64) -> LimitOutcome {
    match limit.algorithm() {
        Algorithm::TokenBucket => {
            token_bucket::evaluate(limit, state.and_then(State::as_token_bucket), now, cost)
        }
        Algorithm::Gcra => gcra::evaluate(limit, state.and_then(State::as_gcra), now, cost),
        Algorithm::FixedWindow => {
            fixed_window::evaluate(limit, state.and_then(State::as_fixed_window), now, cost)
        }
        Algorithm::SlidingWindowLog => {
            sliding_window_log::evaluate(limit, state.and_then(State::as_log), now, cost)
        }
        Algorithm::SlidingWindowCounter => {
            sliding_window_counter::evaluate(limit, state.and_then(State::as_counter), now, cost)
        }
        Algorithm::LeakyBucket => {
            leaky_bucket::evaluate(limit, state.and_then(State::as_leaky_bucket), now, cost)
        }
        Algorithm::Concurrency => {
            concurrency::evaluate(limit, state.and_then(State::as_concurrency), now, cost)
        }
    }
}

/// Applies an admission that [`evaluate`] allowed. `lease_id` names the lease a `concurrency`
/// limit takes; other algorithms ignore it.
pub fn consume(limit: &Limit, state: &mut Option<State>, now: u64, cost: u64, lease_id: u64) {
    let previous = state.as_ref();
    let next = match limit.algorithm() {
        Algorithm::TokenBucket => State::TokenBucket(token_bucket::consume(
            limit,
            previous.and_then(State::as_token_bucket),
            now,
            cost,
        )),
        Algorithm::Gcra => State::Gcra(gcra::consume(
            limit,
            previous.and_then(State::as_gcra),
            now,
            cost,
        )),
        Algorithm::FixedWindow => State::FixedWindow(fixed_window::consume(
            limit,
            previous.and_then(State::as_fixed_window),
            now,
            cost,
        )),
        Algorithm::SlidingWindowCounter => State::SlidingWindowCounter(
            sliding_window_counter::consume(limit, previous.and_then(State::as_counter), now, cost),
        ),
        Algorithm::LeakyBucket => State::LeakyBucket(leaky_bucket::consume(
            limit,
            previous.and_then(State::as_leaky_bucket),
            now,
            cost,
        )),
        // The two logs are updated in place: copying them per request would cost O(limit).
        Algorithm::SlidingWindowLog => {
            if !matches!(state, Some(State::SlidingWindowLog(_))) {
                *state = Some(State::SlidingWindowLog(SlidingWindowLogState::default()));
            }
            if let Some(State::SlidingWindowLog(log)) = state {
                sliding_window_log::consume(limit, log, now, cost);
            }
            return;
        }
        Algorithm::Concurrency => {
            if !matches!(state, Some(State::Concurrency(_))) {
                *state = Some(State::Concurrency(ConcurrencyState::default()));
            }
            if let Some(State::Concurrency(leases)) = state {
                concurrency::consume(limit, leases, now, cost, lease_id);
            }
            return;
        }
    };
    *state = Some(next);
}

/// Evaluates one limit and, if it admits, consumes: the single-limit form of the algorithm.
pub fn check(
    limit: &Limit,
    mut state: Option<State>,
    now: u64,
    cost: u64,
    lease_id: u64,
) -> (LimitOutcome, Option<State>) {
    let outcome = evaluate(limit, state.as_ref(), now, cost);
    if outcome.allowed {
        consume(limit, &mut state, now, cost, lease_id);
    }
    (outcome, state)
}

/// Releases a `concurrency` lease; returns whether the lease was held.
pub fn release(state: &mut State, lease_id: u64) -> bool {
    match state {
        State::Concurrency(leases) => concurrency::release(leases, lease_id),
        _ => false,
    }
}

/// The time from which `state` is indistinguishable from a fresh key, so that it can be dropped.
pub fn idle_at(limit: &Limit, state: &State) -> u64 {
    match state {
        State::TokenBucket(bucket) => token_bucket::idle_at(limit, bucket),
        State::Gcra(gcra) => gcra.tat,
        State::FixedWindow(window) => fixed_window::idle_at(limit, window),
        State::SlidingWindowLog(log) => sliding_window_log::idle_at(limit, log),
        State::SlidingWindowCounter(counters) => sliding_window_counter::idle_at(limit, counters),
        State::LeakyBucket(bucket) => bucket.next_free,
        State::Concurrency(leases) => concurrency::idle_at(leases),
    }
}

#[cfg(feature = "redis")]
/// A state from the three integer fields the batched sync exports for `algorithm` (the
/// `export` of its script in `lua/`); `None` for an algorithm that cannot run batched.
pub(crate) fn import(algorithm: Algorithm, fields: [u64; 3]) -> Option<State> {
    Some(match algorithm {
        Algorithm::TokenBucket => State::TokenBucket(token_bucket::import(fields)),
        Algorithm::Gcra => State::Gcra(gcra::import(fields)),
        Algorithm::FixedWindow => State::FixedWindow(fixed_window::import(fields)),
        Algorithm::SlidingWindowCounter => {
            State::SlidingWindowCounter(sliding_window_counter::import(fields))
        }
        _ => return None,
    })
}

/// Gives `units` back to `state`: what a batched node does to its local copy when a later store
/// denied the request, what the Redis scripts' `refund` does to the shared state (the
/// differential test holds the two to the same result), and the memory store's settlement of
/// an estimate (`Store::refund`). A token bucket in debt pays the debt first, and is never
/// filled above its capacity; a window gives back only within the window the state is of. Only
/// [`Algorithm::is_batchable`] algorithms give anything back.
pub fn unconsume(limit: &Limit, state: &mut State, now: u64, units: u64) {
    let credit = units * limit.emission_micros();
    match state {
        State::TokenBucket(bucket) => token_bucket::unconsume(limit, bucket, now, credit),
        State::Gcra(gcra) => gcra::unconsume(gcra, credit),
        State::FixedWindow(window) => fixed_window::unconsume(limit, window, now, units),
        State::SlidingWindowCounter(counters) => {
            sliding_window_counter::unconsume(limit, counters, now, units)
        }
        _ => {}
    }
}

impl State {
    fn as_token_bucket(&self) -> Option<&TokenBucketState> {
        match self {
            State::TokenBucket(state) => Some(state),
            _ => None,
        }
    }

    fn as_gcra(&self) -> Option<&GcraState> {
        match self {
            State::Gcra(state) => Some(state),
            _ => None,
        }
    }

    fn as_fixed_window(&self) -> Option<&FixedWindowState> {
        match self {
            State::FixedWindow(state) => Some(state),
            _ => None,
        }
    }

    fn as_log(&self) -> Option<&SlidingWindowLogState> {
        match self {
            State::SlidingWindowLog(state) => Some(state),
            _ => None,
        }
    }

    fn as_counter(&self) -> Option<&SlidingWindowCounterState> {
        match self {
            State::SlidingWindowCounter(state) => Some(state),
            _ => None,
        }
    }

    fn as_leaky_bucket(&self) -> Option<&LeakyBucketState> {
        match self {
            State::LeakyBucket(state) => Some(state),
            _ => None,
        }
    }

    fn as_concurrency(&self) -> Option<&ConcurrencyState> {
        match self {
            State::Concurrency(state) => Some(state),
            _ => None,
        }
    }
}
