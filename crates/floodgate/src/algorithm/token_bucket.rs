//! `token_bucket`: capacity `burst`, refilled continuously at `limit / window`.
//!
//! The level is kept as *credit time*: tokens × emission interval, in microseconds. Refill is
//! then plain elapsed time, every value is an integer, and the Lua script computes the same
//! numbers bit for bit.

use super::LimitOutcome;
use crate::limit::Limit;

/// Bucket state: credit in microseconds (tokens × emission interval) at `updated_at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBucketState {
    /// Credit, in microseconds of emission time.
    pub level: u64,
    /// When `level` was computed, microseconds since the epoch.
    pub updated_at: u64,
}

fn full_credit(limit: &Limit) -> u64 {
    limit.capacity() * limit.emission_micros()
}

/// The credit available at `now`: refilled by the time elapsed, capped at the capacity.
fn level_at(limit: &Limit, state: Option<&TokenBucketState>, now: u64) -> u64 {
    let full = full_credit(limit);
    match state {
        None => full,
        Some(state) => full.min(state.level + now.saturating_sub(state.updated_at)),
    }
}

pub(super) fn evaluate(
    limit: &Limit,
    state: Option<&TokenBucketState>,
    now: u64,
    cost: u64,
) -> LimitOutcome {
    let emission = limit.emission_micros();
    let full = full_credit(limit);
    let level = level_at(limit, state, now);
    // Refill starts again only at `updated_at`: a batched debt (or a clock that stepped back)
    // puts it in the future, and every wait starts with it.
    let debt = state.map_or(0, |state| state.updated_at.saturating_sub(now));
    if cost > limit.capacity() {
        return LimitOutcome::never(level / emission, debt + full - level);
    }
    let needed = cost * emission;
    if needed <= level {
        let after = level - needed;
        LimitOutcome::allowed(after / emission, debt + full - after)
    } else {
        LimitOutcome::denied(level / emission, debt + full - level, debt + needed - level)
    }
}

pub(super) fn consume(
    limit: &Limit,
    state: Option<&TokenBucketState>,
    now: u64,
    cost: u64,
) -> TokenBucketState {
    let level = level_at(limit, state, now);
    let needed = cost * limit.emission_micros();
    // A clock that stepped back must not refill the same interval twice.
    let updated_at = state.map_or(now, |state| state.updated_at.max(now));
    match level.checked_sub(needed) {
        Some(level) => TokenBucketState { level, updated_at },
        // Only a batched sync charges more than the level (units other nodes already
        // admitted): the debt is kept as refill time still to come, so the bucket stays empty
        // until it is paid.
        None => TokenBucketState {
            level: 0,
            updated_at: updated_at + (needed - level),
        },
    }
}

pub(super) fn idle_at(limit: &Limit, state: &TokenBucketState) -> u64 {
    state.updated_at + full_credit(limit).saturating_sub(state.level)
}

#[cfg(feature = "redis")]
/// The state from the fields `export` in `lua/token_bucket.lua` sends to batched mode.
pub(super) fn import([level, updated_at, _]: [u64; 3]) -> TokenBucketState {
    TokenBucketState { level, updated_at }
}

/// Gives `credit` (units × emission interval) back to a batched node's local copy.
pub(super) fn unconsume(limit: &Limit, bucket: &mut TokenBucketState, now: u64, credit: u64) {
    // Debt (refill still to come) is paid back first.
    let debt = bucket.updated_at.saturating_sub(now).min(credit);
    bucket.updated_at -= debt;
    let full = limit.capacity() * limit.emission_micros();
    bucket.level = (bucket.level + credit - debt).min(full);
}
