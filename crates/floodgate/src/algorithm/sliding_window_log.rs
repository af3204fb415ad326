//! `sliding_window_log`: at most `limit` units in any trailing `window`. Every admitted request
//! is logged with its cost (denied ones are not, so a client hammering a closed limit costs no
//! memory). Exact, at O(limit) memory per key.

use std::collections::VecDeque;

use super::LimitOutcome;
use crate::limit::Limit;

/// One admitted request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// When it was admitted, microseconds since the epoch.
    pub at: u64,
    /// Units it cost.
    pub cost: u64,
}

/// The log of admitted requests, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlidingWindowLogState {
    /// Entries, oldest first. May hold expired entries until the next write prunes them.
    pub entries: VecDeque<LogEntry>,
}

/// An entry admitted at `at` counts during `(at, at + window)`: it stops counting at `at + window`.
fn is_live(limit: &Limit, entry: &LogEntry, now: u64) -> bool {
    entry.at + limit.window_micros() > now
}

pub(super) fn evaluate(
    limit: &Limit,
    state: Option<&SlidingWindowLogState>,
    now: u64,
    cost: u64,
) -> LimitOutcome {
    let window = limit.window_micros();
    let live = || {
        state
            .into_iter()
            .flat_map(|state| state.entries.iter())
            .filter(move |entry| is_live(limit, entry, now))
    };
    let used: u64 = live().map(|entry| entry.cost).sum();
    let remaining = limit.limit().saturating_sub(used);
    let until_empty = live()
        .next_back()
        .map_or(0, |newest| newest.at + window - now);
    if cost > limit.limit() {
        return LimitOutcome::never(remaining, until_empty);
    }
    if cost <= remaining {
        return LimitOutcome::allowed(remaining - cost, window);
    }
    // Wait for the oldest entries to leave the window until the request fits.
    let mut freed = 0;
    let retry_after = live()
        .find(|entry| {
            freed += entry.cost;
            used - freed + cost <= limit.limit()
        })
        .map_or(until_empty, |entry| entry.at + window - now);
    LimitOutcome::denied(remaining, until_empty, retry_after)
}

pub(super) fn consume(limit: &Limit, state: &mut SlidingWindowLogState, now: u64, cost: u64) {
    while state
        .entries
        .front()
        .is_some_and(|entry| !is_live(limit, entry, now))
    {
        state.entries.pop_front();
    }
    // Keep the log sorted even if the clock stepped back.
    let at = state
        .entries
        .back()
        .map_or(now, |newest| newest.at.max(now));
    state.entries.push_back(LogEntry { at, cost });
}

pub(super) fn idle_at(limit: &Limit, state: &SlidingWindowLogState) -> u64 {
    state
        .entries
        .back()
        .map_or(0, |newest| newest.at + limit.window_micros())
}
