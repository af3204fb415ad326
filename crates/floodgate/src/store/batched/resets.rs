//! Resets: a key's counters forgotten here and on the shared store, and the resets other
//! nodes announce on the store's channel.

use super::*;

impl<T: SyncTarget> Shared<T> {
    /// Drops this node's entries of `keys` (their leases and debts), then resets them in the
    /// shared store, then drops again what a request fetched meanwhile (it may have been
    /// granted from the old state before the reset reached the store). No round of this node
    /// runs meanwhile, and a fetch that read the old state does not install it. Other nodes
    /// drop theirs when they hear the reset.
    pub(super) async fn reset(&self, keys: &[Arc<str>]) -> Result<u64, StoreError> {
        let _no_sync_meanwhile = self.sync_lock.lock().await;
        let now = self.clock.now().as_micros();
        lock(&self.own_resets).extend(keys.iter().map(|key| (key.clone(), now)));
        self.forget(keys);
        let reset = self.target.reset(keys).await;
        self.forget(keys);
        reset
    }

    /// A reset heard on the store's resets channel: forgets its keys, except the echoes of
    /// this node's own resets (it forgot those when it made them).
    pub(super) fn heard_reset(&self, keys: &[&str]) {
        let now = self.clock.now().as_micros();
        let others: Vec<&str> = {
            let mut own = lock(&self.own_resets);
            // An echo comes within a round trip; one that never came (no subscription) is
            // not waited for long.
            own.retain(|(_, at)| now.saturating_sub(*at) < duration_micros(ECHO_WITHIN));
            keys.iter()
                .copied()
                .filter(|key| match own.iter().position(|(own, _)| &**own == *key) {
                    Some(echo) => {
                        own.swap_remove(echo);
                        false
                    }
                    None => true,
                })
                .collect()
        };
        if !others.is_empty() {
            self.forget(&others);
        }
    }

    /// Drops this node's entries of `keys`, reset here or on another node: their leases are
    /// of the state before the reset, and are not spent, nor given back by a trade made after
    /// this; their debts go with them. A first sight being fetched loses its slot, so that
    /// it installs nothing; an answer to a trade made for a dropped entry is not taken in by
    /// the entry that replaces it (epochs). A round already on its way may still give the old
    /// lease back into the fresh state: at most that lease, once.
    pub(super) fn forget<K: AsRef<str>>(&self, keys: &[K]) {
        for key in keys {
            let key = key.as_ref();
            let mut shard = self.lock_shard_of(key);
            if shard.remove(key).is_some() {
                self.keys.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}
