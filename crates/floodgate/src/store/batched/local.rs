//! The local decision: a request decided on this node's leases, with no round trip, or told
//! which keys it must fetch or top up first (and whose calls to wait for).

use super::*;

impl<T: SyncTarget> Shared<T> {
    /// Decides `checks` from the leases, or says which keys must be fetched first.
    pub(super) fn decide_locally(&self, checks: &[Check], now: u64) -> Result<Attempt, StoreError> {
        // Refused before any slot is taken, so that a refusal leaves nothing behind.
        if let Some(check) = checks
            .iter()
            .find(|check| !supports(check.limit.algorithm()))
        {
            return Err(StoreError::Protocol(format!(
                "{} limit {:?} cannot run batched",
                check.limit.algorithm().as_str(),
                check.limit.name()
            )));
        }
        let check_shards: SmallVec<[usize; 8]> = checks
            .iter()
            .map(|check| self.shard_index(&check.key))
            .collect();
        let mut guards = LockedShards::lock(&self.shards, &check_shards);

        if let Some(wait) = self.claim_unready(checks, &check_shards, &mut guards)? {
            return Ok(wait);
        }
        self.decide_on_leases(checks, &check_shards, &mut guards, now)
    }

    /// Takes the slot of every key of `checks` this node does not hold yet (its first sight:
    /// this request fetches it), and collects the calls under way that the request must wait
    /// for (other requests' fetches and top-ups): `Some` of them, `None` when every key is
    /// ready.
    pub(super) fn claim_unready(
        &self,
        checks: &[Check],
        check_shards: &[usize],
        guards: &mut LockedShards<'_, Mutex<Shard>>,
    ) -> Result<Option<Attempt>, StoreError> {
        let mut fetch: Vec<(usize, watch::Sender<bool>)> = Vec::new();
        let mut wait = Vec::new();
        for (index, check) in checks.iter().enumerate() {
            let shard = guards.get(check_shards[index]);
            match shard.get(&*check.key) {
                Some(Slot::Ready(entry)) => {
                    if let Some(receiver) = &entry.refreshing
                        && receiver.has_changed().is_ok()
                    {
                        wait.push(receiver.clone());
                    }
                    continue;
                }
                // A fetch whose requester went away (its future was dropped) is taken over.
                Some(Slot::Fetching(receiver)) if receiver.has_changed().is_ok() => {
                    wait.push(receiver.clone());
                    continue;
                }
                Some(Slot::Fetching(_)) => {}
                None => {
                    if self.keys.load(Ordering::Relaxed) >= self.max_keys {
                        // The slots this request already took for its earlier keys would have
                        // no fetch behind them: give them up (each was counted once).
                        for (taken, _sender) in fetch {
                            guards.get(check_shards[taken]).remove(&*checks[taken].key);
                            self.keys.fetch_sub(1, Ordering::Relaxed);
                        }
                        return Err(self.failed(StoreError::Unavailable(
                            format!("batched store holds its maximum of {} keys", self.max_keys)
                                .into(),
                        )));
                    }
                    self.keys.fetch_add(1, Ordering::Relaxed);
                }
            }
            let (sender, receiver) = watch::channel(false);
            shard.insert(check.key.clone(), Slot::Fetching(receiver));
            fetch.push((index, sender));
        }
        if !fetch.is_empty() || !wait.is_empty() {
            return Ok(Some(Attempt::Wait {
                fetch,
                top_up: Vec::new(),
                wait,
            }));
        }
        Ok(None)
    }

    /// Decides `checks`, every key ready, on this node's leases: admitted when they cover the
    /// request, a top-up when one may bring what they lack, denied otherwise.
    pub(super) fn decide_on_leases(
        &self,
        checks: &[Check],
        check_shards: &[usize],
        guards: &mut LockedShards<'_, Mutex<Shard>>,
        now: u64,
    ) -> Result<Attempt, StoreError> {
        // Each limit as the shared store would decide it without this node's lease, and
        // whether the lease covers the request.
        let mut outcomes: SmallVec<[LimitOutcome; 8]> = SmallVec::new();
        let mut covered = true;
        for (check, &shard) in checks.iter().zip(check_shards) {
            let entry = ready(guards.get(shard), &check.key);
            entry.idle_rounds = 0;
            if !Arc::ptr_eq(&entry.limit, &check.limit) {
                // A reload rebuilt the limit: trades use the new one. A new algorithm starts
                // from fresh state (SPEC §3): the old one's lease and debt are not carried
                // over; new settings of the same algorithm give the lease back.
                if entry.limit.algorithm() != check.limit.algorithm() {
                    *entry = self.new_entry(check.limit.clone());
                } else if *entry.limit != *check.limit {
                    entry.returning += std::mem::take(&mut entry.lease);
                }
                entry.limit = check.limit.clone();
            }
            entry.expire_lease(now);
            let state = entry.virtual_state(now);
            outcomes.push(algorithm::evaluate(
                &check.limit,
                state.as_ref(),
                now,
                check.cost,
            ));
            covered &= entry.lease >= check.cost;
        }
        if covered {
            for (check, &shard) in checks.iter().zip(check_shards) {
                let entry = ready(guards.get(shard), &check.key);
                entry.lease -= check.cost;
                entry.demand += check.cost;
            }
            return Ok(Attempt::Decided(Decision::from_outcomes(
                Timestamp::from_micros(now),
                checks,
                &outcomes,
                Vec::new(),
            )));
        }
        // Short of lease where the shared store may have more: ask for it.
        let mut top_up = Vec::new();
        for (index, (check, &shard)) in checks.iter().zip(check_shards).enumerate() {
            let entry = ready(guards.get(shard), &check.key);
            if entry.lease < check.cost && outcomes[index].allowed && entry.may_top_up() {
                entry.topped_up = true;
                let (sender, receiver) = watch::channel(false);
                entry.refreshing = Some(receiver);
                let need = check.cost - entry.lease;
                // The requests that waited for the last call, this one among them.
                let others_queued = std::mem::take(&mut entry.queued).saturating_sub(1);
                top_up.push(TopUp {
                    index,
                    need: need + others_queued * check.cost,
                    for_queued: others_queued > 0,
                    sender,
                });
            }
        }
        if !top_up.is_empty() {
            return Ok(Attempt::Wait {
                fetch: Vec::new(),
                top_up,
                wait: Vec::new(),
            });
        }
        self.deny(checks, check_shards, guards, outcomes, now)
    }

    /// Denies `checks`, which their leases do not cover and no top-up may serve: by a limit
    /// that has nothing left (`outcomes` as the shared store would decide), or for want of
    /// lease until the next round; the failure policy's when a key it lacks lease for cannot
    /// be traded.
    pub(super) fn deny(
        &self,
        checks: &[Check],
        check_shards: &[usize],
        guards: &mut LockedShards<'_, Mutex<Shard>>,
        mut outcomes: SmallVec<[LimitOutcome; 8]>,
        now: u64,
    ) -> Result<Attempt, StoreError> {
        let admitted_nowhere = outcomes.iter().all(|outcome| outcome.allowed);
        // The policy's when a key the request lacks lease for cannot be traded (its node
        // fails); keys covered by their lease, or on healthy nodes, do not send it there.
        let unanswered = checks.iter().zip(check_shards).any(|(check, &shard)| {
            let entry = ready(guards.get(shard), &check.key);
            entry.unanswered && entry.lease < check.cost
        });
        if admitted_nowhere && unanswered {
            return Err(self.failed(StoreError::Unavailable(
                "batched lease spent while the shared store fails".into(),
            )));
        }
        let wait_for_lease = self.until_next_round();
        for ((check, &shard), outcome) in checks.iter().zip(check_shards).zip(&mut outcomes) {
            let entry = ready(guards.get(shard), &check.key);
            entry.demand += check.cost;
            if outcome.allowed && entry.lease < check.cost && admitted_nowhere {
                outcome.allowed = false;
                outcome.retry_after_micros = Some(wait_for_lease);
                outcome.remaining = entry.lease;
            } else if outcome.allowed {
                // Not charged, since another limit denied: report it as it stands.
                let state = entry.virtual_state(now);
                *outcome = algorithm::evaluate(&check.limit, state.as_ref(), now, 0);
            }
        }
        Ok(Attempt::Decided(Decision::from_outcomes(
            Timestamp::from_micros(now),
            checks,
            &outcomes,
            Vec::new(),
        )))
    }
}

pub(super) enum Attempt {
    Decided(Decision),
    /// Keys this request must fetch or top up (with the sender that wakes other waiters),
    /// and calls by other requests to wait for.
    Wait {
        fetch: Vec<(usize, watch::Sender<bool>)>,
        top_up: Vec<TopUp>,
        wait: Vec<watch::Receiver<bool>>,
    },
}

/// The ready entry of `key`, which the caller has seen ready under the same lock.
fn ready<'s>(shard: &'s mut Shard, key: &str) -> &'s mut Entry {
    match shard.get_mut(key) {
        Some(Slot::Ready(entry)) => entry,
        _ => unreachable!("every key was seen ready under the same locks"),
    }
}
