//! When a trade goes unanswered or the store is down: what is kept for the next round, what is
//! dropped (units never spent twice, debts older than their window), and how the failure
//! reaches the requests.

use super::*;

impl<T: SyncTarget> Shared<T> {
    /// Gives up the slots a request took and the top-ups it started, without a call: the
    /// next request on those keys tries again.
    pub(super) fn abandon(
        &self,
        checks: &[Check],
        fetch: Vec<(usize, watch::Sender<bool>)>,
        top_up: &[TopUp],
    ) {
        drop(FetchClaim::new(self, checks, fetch));
        for top in top_up {
            let key = &checks[top.index].key;
            if let Some(Slot::Ready(entry)) = self.lock_shard_of(key).get_mut(&**key) {
                entry.refreshing = None;
                entry.topped_up = false;
            }
        }
    }

    /// `error`, counted as the store's (`floodgate_store_errors_total`): a decision this store
    /// fails without a guarded call (an open breaker asked beforehand, a lease spent while the
    /// store fails, the key table full) is a store error like the guard's.
    pub(super) fn failed(&self, error: StoreError) -> StoreError {
        telemetry::record_store_error(&error);
        error
    }

    /// Takes the debt of `entry` to send with a trade, dropping (and counting) what is older
    /// than its limit's window: it belongs to no window the limit still looks at.
    pub(super) fn take_debt(&self, entry: &mut Entry, local_now: u64) -> u64 {
        let debt = std::mem::take(&mut entry.debt);
        if debt > 0 && local_now.saturating_sub(entry.debt_since) > entry.limit.window_micros() {
            self.drop_stale_debt(debt, &entry.limit);
            return 0;
        }
        debt
    }

    /// Counts and logs a debt dropped for being older than its limit's window.
    pub(super) fn drop_stale_debt(&self, units: u64, limit: &Limit) {
        self.stats.dropped_units.fetch_add(units, Ordering::Relaxed);
        telemetry::record_batched_dropped(units);
        tracing::warn!(
            units,
            limit = limit.name(),
            "batched post-charges older than their window dropped after a store outage"
        );
    }

    /// Takes back onto the key's entry what an unanswered trade carried and may still owe
    /// ([`Carried::after`]), and marks the key as failing: a request short of lease is then
    /// the failure policy's, since no trade brings it more.
    pub(super) fn keep_for_later(&self, request: &LeaseRequest, epoch: u64, carried: Carried) {
        let key = &request.check.key;
        if let Some(Slot::Ready(entry)) = self.lock_shard_of(key).get_mut(&**key)
            && entry.epoch == epoch
        {
            carried.put_back(entry);
            entry.unanswered = true;
        }
    }
}

/// What a trade carried from a key's entry, for when it goes unanswered: its debt (with the
/// local time of the oldest of it) and the lease it gave back.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Carried {
    pub(super) debt: u64,
    pub(super) debt_since: u64,
    pub(super) returning: u64,
}

impl Carried {
    /// What is still owed after a trade that went `unanswered`. Units are never counted twice
    /// in the node's favour: a lost trade's given-back units may have been credited already,
    /// so they are not given back again (if they were not, they stay counted as used until
    /// they refill or their window ends: lost, not duplicated). Its debt is sent again: if the
    /// lost trade delivered it, the shared store counts it twice, which costs capacity and
    /// never admits above the limit.
    pub(super) fn after(self, unanswered: Unanswered) -> Carried {
        match unanswered {
            Unanswered::NotSent => self,
            Unanswered::Lost => Carried {
                returning: 0,
                ..self
            },
        }
    }

    /// Puts what is owed back on `entry`, the debt keeping its age: a debt that waits out an
    /// outage still ages out with its window.
    pub(super) fn put_back(self, entry: &mut Entry) {
        entry.returning += self.returning;
        if self.debt > 0 {
            entry.debt_since = if entry.debt == 0 {
                self.debt_since
            } else {
                entry.debt_since.min(self.debt_since)
            };
            entry.debt += self.debt;
        }
    }
}
