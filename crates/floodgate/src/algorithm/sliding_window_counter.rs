//! `sliding_window_counter`: two fixed-window counters; the previous window's count is weighted
//! by how much of it the trailing window still overlaps. An estimate, with O(1) memory.
//!
//! The weighted estimate is a double, computed with the same operations in the same order as in
//! `lua/sliding_window_counter.lua`, so that both give identical results.

use super::LimitOutcome;
use crate::limit::Limit;

/// Counters of the current window and the one before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlidingWindowCounterState {
    /// Start of the current window, microseconds since the epoch.
    pub window_start: u64,
    /// Units admitted in the current window.
    pub current: u64,
    /// Units admitted in the previous window.
    pub previous: u64,
}

/// The counters as seen at `now`, rotated into now's window.
fn rotate(
    limit: &Limit,
    state: Option<&SlidingWindowCounterState>,
    now: u64,
) -> SlidingWindowCounterState {
    let window = limit.window_micros();
    let window_start = now - now % window;
    let (current, previous) = match state {
        Some(state) if state.window_start == window_start => (state.current, state.previous),
        Some(state) if state.window_start + window == window_start => (0, state.current),
        _ => (0, 0),
    };
    SlidingWindowCounterState {
        window_start,
        current,
        previous,
    }
}

/// previous × (overlap fraction) + current.
fn estimate(limit: &Limit, counters: &SlidingWindowCounterState, now: u64) -> f64 {
    let window = limit.window_micros();
    let elapsed = now - counters.window_start;
    counters.previous as f64 * ((window - elapsed) as f64 / window as f64) + counters.current as f64
}

fn admits(limit: &Limit, counters: &SlidingWindowCounterState, now: u64, cost: u64) -> bool {
    estimate(limit, counters, now) + cost as f64 <= limit.limit() as f64
}

fn remaining(limit: &Limit, estimate: f64) -> u64 {
    (limit.limit() as f64 - estimate).floor().max(0.0) as u64
}

/// Time until the estimate reaches zero.
fn until_empty(limit: &Limit, counters: &SlidingWindowCounterState, now: u64) -> u64 {
    let window = limit.window_micros();
    let elapsed = now - counters.window_start;
    if counters.current > 0 {
        2 * window - elapsed
    } else if counters.previous > 0 {
        window - elapsed
    } else {
        0
    }
}

/// The earliest wait after which a request of `cost` alone is admitted. Solved in closed form,
/// then nudged forward by whole microseconds should rounding have left it a hair early.
fn retry_after(limit: &Limit, counters: &SlidingWindowCounterState, now: u64, cost: u64) -> u64 {
    let window = limit.window_micros();
    let elapsed = now - counters.window_start;
    let limit_units = limit.limit();
    let wait = if counters.current + cost <= limit_units {
        // The previous window's weight must decay enough within the current window.
        let spare = (limit_units - counters.current - cost) as f64;
        let needed = (window - elapsed) as f64 - (spare * window as f64) / counters.previous as f64;
        needed.ceil().max(0.0) as u64
    } else {
        // Only after the current window has become the previous one.
        let spare = (limit_units - cost) as f64;
        let needed = window as f64 - (spare * window as f64) / counters.current as f64;
        (window - elapsed) + needed.ceil().max(0.0) as u64
    };
    for candidate in wait..wait + 16 {
        let then = now + candidate;
        if admits(limit, &rotate(limit, Some(counters), then), then, cost) {
            return candidate;
        }
    }
    // Both windows have fully passed: always admitted, since cost ≤ limit.
    2 * window - elapsed
}

pub(super) fn evaluate(
    limit: &Limit,
    state: Option<&SlidingWindowCounterState>,
    now: u64,
    cost: u64,
) -> LimitOutcome {
    let counters = rotate(limit, state, now);
    let estimate_now = estimate(limit, &counters, now);
    if cost > limit.limit() {
        return LimitOutcome::never(
            remaining(limit, estimate_now),
            until_empty(limit, &counters, now),
        );
    }
    if admits(limit, &counters, now, cost) {
        let after = SlidingWindowCounterState {
            current: counters.current + cost,
            ..counters
        };
        LimitOutcome::allowed(
            remaining(limit, estimate_now + cost as f64),
            until_empty(limit, &after, now),
        )
    } else {
        LimitOutcome::denied(
            remaining(limit, estimate_now),
            until_empty(limit, &counters, now),
            retry_after(limit, &counters, now, cost),
        )
    }
}

pub(super) fn consume(
    limit: &Limit,
    state: Option<&SlidingWindowCounterState>,
    now: u64,
    cost: u64,
) -> SlidingWindowCounterState {
    let counters = rotate(limit, state, now);
    SlidingWindowCounterState {
        current: counters.current + cost,
        ..counters
    }
}

pub(super) fn idle_at(limit: &Limit, state: &SlidingWindowCounterState) -> u64 {
    state.window_start + 2 * limit.window_micros()
}

#[cfg(feature = "redis")]
/// The state from the fields `export` in `lua/sliding_window_counter.lua` sends to batched mode.
pub(super) fn import([window_start, current, previous]: [u64; 3]) -> SlidingWindowCounterState {
    SlidingWindowCounterState {
        window_start,
        current,
        previous,
    }
}

/// Gives `units` back to a batched node's local copy, if its window is still the current one.
pub(super) fn unconsume(
    limit: &Limit,
    counters: &mut SlidingWindowCounterState,
    now: u64,
    units: u64,
) {
    if counters.window_start == now - now % limit.window_micros() {
        counters.current = counters.current.saturating_sub(units);
    }
}
