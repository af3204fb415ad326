//! The periodic trades: once per interval every active key gives back what its lease holds
//! beyond the node's demand, asks for what it lacks and delivers its debt; and the last trade
//! on shutdown.

use super::*;

impl<T: SyncTarget> Shared<T> {
    /// What this round does with one key: forgets it (idle and holding nothing, or a fetch
    /// abandoned), keeps it as it is, or trades it (the trade, with the local time of its
    /// oldest debt and the entry's epoch). Updates the key's estimate for the next interval.
    fn plan_round(
        &self,
        key: &Arc<str>,
        slot: &mut Slot,
        decided_at: u64,
        local_now: u64,
    ) -> RoundPlan {
        let entry = match slot {
            Slot::Ready(entry) => entry,
            // A fetch in progress stays; one whose fetcher is gone without giving its
            // slot up (it cannot happen by the paths above, and must not pile up if
            // it ever does) goes with its count.
            Slot::Fetching(receiver) => {
                let abandoned = receiver.has_changed().is_err();
                if abandoned {
                    self.keys.fetch_sub(1, Ordering::Relaxed);
                }
                return if abandoned {
                    RoundPlan::Forget
                } else {
                    RoundPlan::Keep
                };
            }
        };
        if entry.refreshing.is_some() {
            // A top-up is out: this round leaves the key to it.
            return RoundPlan::Keep;
        }
        entry.expire_lease(decided_at);
        let idle = entry.demand == 0 && entry.idle_rounds >= self.idle_rounds;
        if idle && entry.lease == 0 && entry.returning == 0 && entry.debt == 0 {
            self.keys.fetch_sub(1, Ordering::Relaxed);
            return RoundPlan::Forget;
        }
        entry.idle_rounds = entry.idle_rounds.saturating_add(1);
        let active = entry.demand > 0;
        // What the next interval will ask: the last one's demand if it rose, else half
        // the estimate (it follows a rise at once and a fall within a few rounds).
        entry.estimate = if idle {
            0
        } else {
            entry.demand.max(entry.estimate / 2)
        }
        .min(entry.most_leased());
        entry.demand = 0;
        entry.starved = false;
        // Who waited for the last call is news for one interval at most.
        entry.queued = 0;
        if std::mem::take(&mut entry.topped_up) {
            // It had its call this interval.
            return RoundPlan::Keep;
        }
        if self.target.is_refused(key) {
            // Its node is down: nothing is sent, so nothing is put at risk.
            entry.unanswered = true;
            return RoundPlan::Keep;
        }
        // A quarter more than the estimate, so that a steady client is not short: a node
        // that sees a client rarely keeps (almost) nothing of its capacity.
        let target = (entry.estimate + entry.estimate / 4).min(entry.most_leased());
        let beyond_target = entry.lease.saturating_sub(target);
        entry.lease -= beyond_target;
        let give_back = beyond_target + std::mem::take(&mut entry.returning);
        let want = target.saturating_sub(entry.lease);
        let charge = self.take_debt(entry, local_now);
        // An active key is traded even with nothing to give or take: its view of the
        // shared state (what its headers say) stays at most an interval behind.
        if active || give_back > 0 || want > 0 || charge > 0 {
            let request = LeaseRequest {
                check: sync_check(key, &entry.limit, 0),
                give_back,
                leased_in: entry.lease_window,
                want,
                charge,
            };
            return RoundPlan::Trade(request, entry.debt_since, entry.epoch);
        }
        RoundPlan::Keep
    }

    /// Trades every active key's lease: gives back what it holds beyond its estimate, asks for
    /// what it lacks, delivers debts. A key whose node refuses calls (its breaker is open) is
    /// left as it is for a later round.
    pub(super) async fn sync_round(&self, now: Option<Timestamp>) -> Result<(), StoreError> {
        let _one_round_at_a_time = self.sync_lock.lock().await;
        let local_now = self.clock.now().as_micros();
        self.next_round_micros
            .store(local_now + self.interval_micros, Ordering::Relaxed);
        let decided_at = self.now(now);
        let mut batch = Vec::new();
        let mut debts_since = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            shard.retain(
                |key, slot| match self.plan_round(key, slot, decided_at, local_now) {
                    RoundPlan::Forget => false,
                    RoundPlan::Keep => true,
                    RoundPlan::Trade(request, debt_since, epoch) => {
                        batch.push(request);
                        debts_since.push((debt_since, epoch));
                        true
                    }
                },
            );
        }
        let mut outcome = Ok(());
        for (chunk, debts_since) in batch.chunks(SYNC_CHUNK).zip(debts_since.chunks(SYNC_CHUNK)) {
            let local_at_send = self.clock.now().as_micros();
            let leased = self.target.lease(chunk, now).await;
            if let Some(latest) = leased.latest() {
                self.observe_shared_time(latest, local_at_send);
            }
            let decided_at = self.now(now);
            for ((request, grant), &(debt_since, epoch)) in
                chunk.iter().zip(leased.grants).zip(debts_since)
            {
                let key = &request.check.key;
                match grant {
                    Ok(grant) => {
                        if let Some(Slot::Ready(entry)) = self.lock_shard_of(key).get_mut(&**key)
                            && entry.epoch == epoch
                        {
                            entry.adopt(grant, request.want, decided_at);
                        }
                    }
                    Err(unanswered) => self.keep_for_later(
                        request,
                        epoch,
                        Carried {
                            debt: request.charge,
                            debt_since,
                            returning: request.give_back,
                        }
                        .after(unanswered),
                    ),
                }
            }
            match leased.failure {
                None => {
                    self.stats.syncs.fetch_add(1, Ordering::Relaxed);
                    telemetry::record_batched_sync(true);
                }
                Some(error) => {
                    self.stats.failed_syncs.fetch_add(1, Ordering::Relaxed);
                    telemetry::record_batched_sync(false);
                    outcome = Err(error);
                }
            }
        }
        outcome
    }
}

/// What a round does with one key ([`Shared::plan_round`]).
enum RoundPlan {
    Forget,
    Keep,
    Trade(LeaseRequest, u64, u64),
}

pub(super) fn sync_check(key: &Arc<str>, limit: &Arc<Limit>, units: u64) -> Check {
    Check {
        key: key.clone(),
        rule: limit.shared_name().clone(),
        limit: limit.clone(),
        cost: units,
        // Only the store behind reads this check, and it decides by key.
        scope: Scope::Client,
    }
}

pub(super) async fn sync_periodically<T: SyncTarget>(shared: Weak<Shared<T>>, interval: Duration) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if let Err(error) = shared.sync_round(None).await {
            tracing::debug!(%error, "batched trade failed; leases and debts kept for the next round");
        }
    }
}

impl<T: SyncTarget> Shared<T> {
    /// On shutdown: gives back every lease and delivers every debt, so that a stopping node
    /// takes nothing with it.
    pub(super) async fn give_back_everything(
        &self,
        now: Option<Timestamp>,
    ) -> Result<(), StoreError> {
        let _one_round_at_a_time = self.sync_lock.lock().await;
        let local_now = self.clock.now().as_micros();
        let decided_at = self.now(now);
        let mut batch = Vec::new();
        let mut debts_since = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            for (key, slot) in shard.iter_mut() {
                let Slot::Ready(entry) = slot else {
                    continue;
                };
                // What may not be spent any more is not given back either.
                entry.expire_lease(decided_at);
                if entry.lease > 0 || entry.returning > 0 || entry.debt > 0 {
                    debts_since.push((entry.debt_since, entry.epoch));
                    let give_back =
                        std::mem::take(&mut entry.lease) + std::mem::take(&mut entry.returning);
                    batch.push(LeaseRequest {
                        check: sync_check(key, &entry.limit, 0),
                        give_back,
                        leased_in: entry.lease_window,
                        want: 0,
                        charge: self.take_debt(entry, local_now),
                    });
                }
            }
        }
        let mut outcome = Ok(());
        for (chunk, debts_since) in batch.chunks(SYNC_CHUNK).zip(debts_since.chunks(SYNC_CHUNK)) {
            let leased = self.target.lease(chunk, now).await;
            for ((request, grant), &(debt_since, epoch)) in
                chunk.iter().zip(leased.grants).zip(debts_since)
            {
                if let Err(unanswered) = grant {
                    let carried = Carried {
                        debt: request.charge,
                        debt_since,
                        returning: request.give_back,
                    };
                    self.keep_for_later(request, epoch, carried.after(unanswered));
                }
            }
            if let Some(error) = leased.failure {
                outcome = Err(error);
            }
        }
        outcome
    }
}
