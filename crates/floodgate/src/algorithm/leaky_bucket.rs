//! `leaky_bucket`: shaping. Requests leave at `limit / window`; a request waits until the
//! requests ahead of it have left. One that would wait more than `burst` emission intervals
//! (burst / rate) is rejected; the others are admitted with a delay equal to their wait.

use super::LimitOutcome;
use crate::limit::Limit;

/// When the bucket can next let a request leave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeakyBucketState {
    /// Next free departure slot, microseconds since the epoch.
    pub next_free: u64,
}

fn max_wait(limit: &Limit) -> u64 {
    limit.capacity() * limit.emission_micros()
}

/// How many unit requests would be admitted right now behind a queue of `backlog` µs.
fn admissible(limit: &Limit, backlog: u64) -> u64 {
    match max_wait(limit).checked_sub(backlog) {
        Some(slack) => slack / limit.emission_micros() + 1,
        None => 0,
    }
}

pub(super) fn evaluate(
    limit: &Limit,
    state: Option<&LeakyBucketState>,
    now: u64,
    cost: u64,
) -> LimitOutcome {
    let departure = state.map_or(now, |state| state.next_free.max(now));
    let wait = departure - now;
    if cost > limit.capacity() {
        return LimitOutcome::never(admissible(limit, wait), wait);
    }
    if wait <= max_wait(limit) {
        let backlog_after = wait + cost * limit.emission_micros();
        LimitOutcome::allowed(admissible(limit, backlog_after), backlog_after).delayed_by(wait)
    } else {
        LimitOutcome::denied(0, wait, wait - max_wait(limit))
    }
}

pub(super) fn consume(
    limit: &Limit,
    state: Option<&LeakyBucketState>,
    now: u64,
    cost: u64,
) -> LeakyBucketState {
    let departure = state.map_or(now, |state| state.next_free.max(now));
    LeakyBucketState {
        next_free: departure + cost * limit.emission_micros(),
    }
}
