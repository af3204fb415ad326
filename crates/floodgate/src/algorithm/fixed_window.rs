//! `fixed_window`: at most `limit` per window, windows aligned to multiples of `window` since
//! the Unix epoch, or the periods of a calendar ([`Limit::window_bounds`]). Cheap, with the
//! known flaw that a client may send `limit` at the end of one window and `limit` again at the
//! start of the next.

use super::LimitOutcome;
use crate::limit::Limit;

/// Counter of the window starting at `window_start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedWindowState {
    /// Start of the counted window, microseconds since the epoch.
    pub window_start: u64,
    /// Units admitted in that window.
    pub count: u64,
}

fn current(limit: &Limit, state: Option<&FixedWindowState>, now: u64) -> FixedWindowState {
    let (window_start, _) = limit.window_bounds(now);
    let count = match state {
        Some(state) if state.window_start == window_start => state.count,
        _ => 0,
    };
    FixedWindowState {
        window_start,
        count,
    }
}

pub(super) fn evaluate(
    limit: &Limit,
    state: Option<&FixedWindowState>,
    now: u64,
    cost: u64,
) -> LimitOutcome {
    let window = current(limit, state, now);
    let until_next_window = limit.window_bounds(now).1 - now;
    let remaining = limit.limit() - window.count.min(limit.limit());
    if cost > limit.limit() {
        return LimitOutcome::never(remaining, until_next_window);
    }
    if cost <= remaining {
        LimitOutcome::allowed(remaining - cost, until_next_window)
    } else {
        LimitOutcome::denied(remaining, until_next_window, until_next_window)
    }
}

pub(super) fn consume(
    limit: &Limit,
    state: Option<&FixedWindowState>,
    now: u64,
    cost: u64,
) -> FixedWindowState {
    let window = current(limit, state, now);
    FixedWindowState {
        count: window.count + cost,
        ..window
    }
}

pub(super) fn idle_at(limit: &Limit, state: &FixedWindowState) -> u64 {
    limit.window_bounds(state.window_start).1
}

#[cfg(feature = "redis")]
/// The state from the fields `export` in `lua/fixed_window.lua` sends to batched mode.
pub(super) fn import([window_start, count, _]: [u64; 3]) -> FixedWindowState {
    FixedWindowState {
        window_start,
        count,
    }
}

/// Gives `units` back to a batched node's local copy, if its window is still the current one.
pub(super) fn unconsume(limit: &Limit, window: &mut FixedWindowState, now: u64, units: u64) {
    if window.window_start == limit.window_bounds(now).0 {
        window.count = window.count.saturating_sub(units);
    }
}
