//! Locking several shards of a sharded table for one request: the memory store and the batched
//! store both decide a request's limits atomically under all the locks its keys need.

use std::sync::{Mutex, MutexGuard, PoisonError};

use smallvec::SmallVec;

/// Locks one shard. Entries are replaced whole, so a shard poisoned by a panic elsewhere is
/// still consistent and is used as is.
pub(crate) fn lock<S>(shard: &Mutex<S>) -> MutexGuard<'_, S> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The shards a request touches, all locked.
pub(crate) struct LockedShards<'a, S> {
    guards: SmallVec<[(usize, MutexGuard<'a, S>); 8]>,
}

impl<'a, S> LockedShards<'a, S> {
    /// Locks `shards[id]` for every id in `ids` (repeats allowed), in ascending order: every
    /// request takes its locks in the same global order, so two requests never deadlock.
    pub(crate) fn lock(shards: &'a [Mutex<S>], ids: &[usize]) -> Self {
        let mut ids: SmallVec<[usize; 8]> = ids.iter().copied().collect();
        ids.sort_unstable();
        ids.dedup();
        LockedShards {
            guards: ids.iter().map(|&id| (id, lock(&shards[id]))).collect(),
        }
    }

    /// Shard `id`, which must be one of the ids locked.
    pub(crate) fn get(&mut self, id: usize) -> &mut S {
        let position = self
            .guards
            .iter()
            .position(|(locked, _)| *locked == id)
            .unwrap_or_default();
        &mut self.guards[position].1
    }

    /// Every locked shard.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut S> {
        self.guards.iter_mut().map(|(_, guard)| &mut **guard)
    }
}
