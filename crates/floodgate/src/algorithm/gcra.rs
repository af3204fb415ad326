//! `gcra`: the generic cell rate algorithm. One timestamp per key, the theoretical arrival time
//! (TAT); a request is admitted if the TAT it would leave behind is within `burst` emission
//! intervals of now. Admission equals `token_bucket` with the same capacity.

use super::LimitOutcome;
use crate::limit::Limit;

/// GCRA state: the theoretical arrival time, microseconds since the epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GcraState {
    /// Theoretical arrival time.
    pub tat: u64,
}

fn tolerance(limit: &Limit) -> u64 {
    limit.capacity() * limit.emission_micros()
}

pub(crate) fn evaluate(
    limit: &Limit,
    state: Option<&GcraState>,
    now: u64,
    cost: u64,
) -> LimitOutcome {
    let emission = limit.emission_micros();
    let tolerance = tolerance(limit);
    let tat = state.map_or(now, |state| state.tat.max(now));
    let backlog = tat - now;
    // A batched sync can leave the TAT beyond the tolerance (a debt): nothing remains then.
    let spare = tolerance.saturating_sub(backlog);
    if cost > limit.capacity() {
        return LimitOutcome::never(spare / emission, backlog);
    }
    let backlog_after = backlog + cost * emission;
    if backlog_after <= tolerance {
        LimitOutcome::allowed((tolerance - backlog_after) / emission, backlog_after)
    } else {
        LimitOutcome::denied(spare / emission, backlog, backlog_after - tolerance)
    }
}

pub(crate) fn consume(limit: &Limit, state: Option<&GcraState>, now: u64, cost: u64) -> GcraState {
    let tat = state.map_or(now, |state| state.tat.max(now));
    GcraState {
        tat: tat + cost * limit.emission_micros(),
    }
}

#[cfg(feature = "redis")]
/// The state from the fields `export` in `lua/gcra.lua` sends to batched mode.
pub(super) fn import([tat, _, _]: [u64; 3]) -> GcraState {
    GcraState { tat }
}

/// Gives `credit` (units × emission interval) back to a batched node's local copy.
pub(super) fn unconsume(gcra: &mut GcraState, credit: u64) {
    gcra.tat = gcra.tat.saturating_sub(credit);
}
