//! `concurrency`: at most `limit` units in flight per key. Admission takes a lease that the
//! caller releases when the response ends; a lease not released expires after `window`, so a
//! node that dies holding leases leaks nothing.

use super::LimitOutcome;
use crate::limit::Limit;

/// One request in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseEntry {
    /// The lease's identifier, unique within its key.
    pub id: u64,
    /// When it expires if never released, microseconds since the epoch.
    pub expires_at: u64,
    /// Units it holds.
    pub cost: u64,
}

/// The leases of one key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConcurrencyState {
    /// Leases, possibly including expired ones until the next write prunes them.
    pub leases: Vec<LeaseEntry>,
}

pub(super) fn evaluate(
    limit: &Limit,
    state: Option<&ConcurrencyState>,
    now: u64,
    cost: u64,
) -> LimitOutcome {
    let mut live: Vec<&LeaseEntry> = state
        .into_iter()
        .flat_map(|state| state.leases.iter())
        .filter(|lease| lease.expires_at > now)
        .collect();
    let in_flight: u64 = live.iter().map(|lease| lease.cost).sum();
    let remaining = limit.limit().saturating_sub(in_flight);
    let until_all_expired = live
        .iter()
        .map(|lease| lease.expires_at - now)
        .max()
        .unwrap_or(0);
    if cost > limit.limit() {
        return LimitOutcome::never(remaining, until_all_expired);
    }
    if cost <= remaining {
        return LimitOutcome::allowed(remaining - cost, limit.window_micros());
    }
    // Releases can only come sooner; expiry is the promise that holds even if none does.
    live.sort_by_key(|lease| lease.expires_at);
    let mut freed = 0;
    let retry_after = live
        .iter()
        .find(|lease| {
            freed += lease.cost;
            in_flight - freed + cost <= limit.limit()
        })
        .map_or(until_all_expired, |lease| lease.expires_at - now);
    LimitOutcome::denied(remaining, until_all_expired, retry_after)
}

pub(super) fn consume(
    limit: &Limit,
    state: &mut ConcurrencyState,
    now: u64,
    cost: u64,
    lease_id: u64,
) {
    state.leases.retain(|lease| lease.expires_at > now);
    state.leases.push(LeaseEntry {
        id: lease_id,
        expires_at: now + limit.window_micros(),
        cost,
    });
}

pub(super) fn release(state: &mut ConcurrencyState, lease_id: u64) -> bool {
    let before = state.leases.len();
    state.leases.retain(|lease| lease.id != lease_id);
    state.leases.len() != before
}

pub(super) fn idle_at(state: &ConcurrencyState) -> u64 {
    state
        .leases
        .iter()
        .map(|lease| lease.expires_at)
        .max()
        .unwrap_or(0)
}
