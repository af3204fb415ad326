//! Top-ups: a request short of lease fetches a key's first lease or asks for more at once,
//! while its concurrent requests wait for that answer.

use super::*;

impl<T: SyncTarget> Shared<T> {
    /// The trade of one top-up of `check`'s key: what it asks for, the key and the epoch of
    /// the entry it is made for, and what it takes from the entry (its debt, the lease it gives
    /// back), carried until the answer arrives.
    pub(super) fn top_up_request(
        &self,
        check: &Check,
        top: &TopUp,
        local_now: u64,
    ) -> (LeaseRequest, (Arc<str>, u64), Carried) {
        let mut shard = self.lock_shard_of(&check.key);
        let Some(Slot::Ready(entry)) = shard.get_mut(&*check.key) else {
            // Forgotten (a reset) since the request saw it: asks for nothing.
            let request = LeaseRequest {
                check: sync_check(&check.key, &check.limit, 0),
                give_back: 0,
                leased_in: None,
                want: 0,
                charge: 0,
            };
            return (request, (check.key.clone(), 0), Carried::default());
        };
        let taken = Carried {
            debt: self.take_debt(entry, local_now),
            debt_since: entry.debt_since,
            returning: std::mem::take(&mut entry.returning),
        };
        let extra = if top.for_queued {
            0
        } else {
            entry.top_up_extra()
        };
        // Never more than a lease may hold, with what it holds counted.
        let room = entry.most_leased().saturating_sub(entry.lease);
        let request = LeaseRequest {
            check: sync_check(&check.key, &check.limit, 0),
            give_back: taken.returning,
            leased_in: entry.lease_window,
            want: (top.need + extra).min(room.max(top.need)),
            charge: taken.debt,
        };
        (request, (check.key.clone(), entry.epoch), taken)
    }

    /// Makes `key` ready with the grant of its first sight (`request`), if the slot is still
    /// the one `sender` was made for: a reset that took it while the grant was on its way
    /// leaves the grant (maybe of the state before the reset) uninstalled.
    pub(super) fn install_first_sight(
        &self,
        key: &Arc<str>,
        sender: &watch::Sender<bool>,
        request: &LeaseRequest,
        grant: Grant,
        decided_at: u64,
    ) {
        let mut entry = self.new_entry(request.check.limit.clone());
        entry.adopt(grant, request.want, decided_at);
        let mut shard = self.lock_shard_of(key);
        let ours = matches!(
            shard.get(&**key),
            Some(Slot::Fetching(receiver)) if receiver.same_channel(&sender.subscribe())
        );
        if ours {
            // The slot's own receiver goes with this insert: what is left are the waiters'.
            shard.insert(key.clone(), Slot::Ready(entry));
            if let Some(Slot::Ready(entry)) = shard.get_mut(&**key) {
                entry.queue_behind(sender.receiver_count(), request.want);
                // A first sight is this interval's call, unless requests queued behind it:
                // then one top-up serves them all.
                entry.topped_up = entry.queued == 0;
            }
        }
    }

    /// Takes a top-up's answer (the grant, what was asked, the decisions' time) into the entry
    /// it was made for, if that entry (`epoch`) is still there; the requests that waited on it,
    /// of `cost` each, queue behind what it covers.
    pub(super) fn adopt_top_up(
        &self,
        key: &Arc<str>,
        epoch: u64,
        (grant, wanted, decided_at): (Grant, u64, u64),
        top: &TopUp,
        cost: u64,
    ) {
        let mut shard = self.lock_shard_of(key);
        if let Some(Slot::Ready(entry)) = shard.get_mut(&**key)
            && entry.epoch == epoch
        {
            entry.adopt(grant, wanted, decided_at);
            entry.refreshing = None;
            entry.queue_behind(top.sender.receiver_count(), cost);
        }
    }

    /// Fetches the first lease of the keys this request found missing, and tops up the ones
    /// it found short, in one call; makes them ready and wakes their waiters. Fails when any
    /// of them went unanswered (the request needs them all).
    pub(super) async fn fetch(
        &self,
        checks: &[Check],
        fetch: Vec<(usize, watch::Sender<bool>)>,
        top_up: Vec<TopUp>,
        now: Option<Timestamp>,
    ) -> Result<(), StoreError> {
        self.stats.fetches.fetch_add(1, Ordering::Relaxed);
        let local_now = self.clock.now().as_micros();
        let mut requests = Vec::with_capacity(fetch.len() + top_up.len());
        for &(index, _) in &fetch {
            requests.push(first_sight_request(&checks[index]));
        }
        // Per top-up: its key and entry, and what it takes from the entry.
        let mut topped: Vec<(Arc<str>, u64)> = Vec::with_capacity(top_up.len());
        let mut carried = Vec::with_capacity(top_up.len());
        for top in &top_up {
            let (request, key, taken) = self.top_up_request(&checks[top.index], top, local_now);
            requests.push(request);
            topped.push(key);
            carried.push(taken);
        }
        // The senders of unanswered top-ups, dropped (waking their waiters) only after the
        // claim has given their keys up: declared before it, dropped after it.
        let mut unanswered_senders = Vec::new();
        // Until the states are in, the fetched slots are this call's: if it fails, or its
        // request goes away mid-way, they go, and the key count with them; a top-up that does
        // not finish lets the next request try again.
        let mut claim = FetchClaim::new(self, checks, fetch);
        claim.top_ups = topped.clone();
        // A request that goes away mid-call leaves its top-ups' trades unanswered, and maybe
        // applied.
        claim.carried = carried
            .iter()
            .map(|carried| carried.after(Unanswered::Lost))
            .collect();
        let first_sights = claim.slots.len();
        let local_at_send = self.clock.now().as_micros();
        let leased = self.target.lease(&requests, now).await;
        if let Some(latest) = leased.latest() {
            self.observe_shared_time(latest, local_at_send);
        }
        let decided_at = self.now(now);
        let mut grants = leased.grants.into_iter();
        let mut slots = std::mem::take(&mut claim.slots).into_iter();
        for request in &requests[..first_sights] {
            let (key, sender) = slots.next().expect("one slot per first sight");
            let Some(Ok(grant)) = grants.next() else {
                // Unanswered: the slot goes, and its waiters decide for themselves.
                claim.slots.push((key, sender));
                continue;
            };
            self.install_first_sight(&key, &sender, request, grant, decided_at);
            // Waiters retry: they find the key ready, or fetch it anew.
            let _ = sender.send(true);
        }
        // The unanswered top-ups are given up as the claim's (their waiters wake and decide
        // for themselves), with what they carried as it may still be owed.
        claim.carried.clear();
        claim.top_ups.clear();
        for ((((key, epoch), carried), top), request) in topped
            .into_iter()
            .zip(carried)
            .zip(top_up)
            .zip(&requests[first_sights..])
        {
            match grants.next() {
                Some(Ok(grant)) => {
                    let answered = (grant, request.want, decided_at);
                    self.adopt_top_up(&key, epoch, answered, &top, checks[top.index].cost);
                    let _ = top.sender.send(true);
                }
                unanswered => {
                    let unanswered = match unanswered {
                        Some(Err(unanswered)) => unanswered,
                        _ => Unanswered::Lost,
                    };
                    claim.top_ups.push((key, epoch));
                    claim.carried.push(carried.after(unanswered));
                    claim.unanswered = true;
                    unanswered_senders.push(top.sender);
                }
            }
        }
        match leased.failure {
            Some(error) => Err(error),
            None if !claim.slots.is_empty() || !claim.top_ups.is_empty() => Err(
                StoreError::Protocol("a lease trade left requests unanswered".into()),
            ),
            None => Ok(()),
        }
    }
}

/// A top-up a request starts for one of its keys.
pub(super) struct TopUp {
    /// The check's index in the request.
    pub(super) index: usize,
    /// Units the request (and those queued behind the last call) lack.
    pub(super) need: u64,
    /// Whether requests queued behind the last call are in `need`: the burst is then known,
    /// and the top-up asks for it alone (asking more would leave units idle here that other
    /// nodes' bursts lack).
    pub(super) for_queued: bool,
    /// Wakes the requests that wait for this top-up.
    pub(super) sender: watch::Sender<bool>,
}

/// The slots and top-ups one fetch holds. Dropped while it still holds them (the fetch
/// failed, or was abandoned), it removes the fetched slots still its own and uncounts their
/// keys, and lets the topped-up keys be topped up again, with what they carried put back as
/// it may still be owed; its senders go with it, which wakes the waiters, who then decide for
/// themselves.
pub(super) struct FetchClaim<'s, T: SyncTarget> {
    shared: &'s Shared<T>,
    slots: Vec<(Arc<str>, watch::Sender<bool>)>,
    /// The topped-up keys, with the epoch of the entry each was made for.
    top_ups: Vec<(Arc<str>, u64)>,
    /// Per top-up, what it carries.
    carried: Vec<Carried>,
    /// Whether a top-up went unanswered: its key is marked as failing.
    unanswered: bool,
}

impl<'s, T: SyncTarget> FetchClaim<'s, T> {
    /// The claim of a request on the slots it took (`fetch`), with no top-up yet.
    pub(super) fn new(
        shared: &'s Shared<T>,
        checks: &[Check],
        fetch: Vec<(usize, watch::Sender<bool>)>,
    ) -> Self {
        FetchClaim {
            shared,
            slots: fetch
                .into_iter()
                .map(|(index, sender)| (checks[index].key.clone(), sender))
                .collect(),
            top_ups: Vec::new(),
            carried: Vec::new(),
            unanswered: false,
        }
    }
}

impl<T: SyncTarget> Drop for FetchClaim<'_, T> {
    fn drop(&mut self) {
        for (key, sender) in self.slots.drain(..) {
            let mut shard = self.shared.lock_shard_of(&key);
            let ours = matches!(
                shard.get(&*key),
                Some(Slot::Fetching(receiver)) if receiver.same_channel(&sender.subscribe())
            );
            if ours && shard.remove(&*key).is_some() {
                self.shared.keys.fetch_sub(1, Ordering::Relaxed);
            }
        }
        for ((key, epoch), carried) in self.top_ups.drain(..).zip(self.carried.drain(..)) {
            if let Some(Slot::Ready(entry)) = self.shared.lock_shard_of(&key).get_mut(&*key)
                && entry.epoch == epoch
            {
                entry.refreshing = None;
                entry.topped_up = false;
                carried.put_back(entry);
                entry.unanswered |= self.unanswered;
            }
        }
    }
}

/// The trade of a key's first sight: nothing is known of this node's demand yet, so it asks
/// for what the request needs. A grant of more would lock up capacity on every node a client
/// touches once.
fn first_sight_request(check: &Check) -> LeaseRequest {
    LeaseRequest {
        check: sync_check(&check.key, &check.limit, 0),
        give_back: 0,
        leased_in: None,
        want: check.cost,
        charge: 0,
    }
}
