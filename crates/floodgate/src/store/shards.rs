//! Locking several shards of a sharded table for one request: the memory store and the batched
//! store both decide a request's limits atomically under all the locks its keys need.

use std::ops::DerefMut;
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use smallvec::SmallVec;

/// A shard's lock, taken exclusively by [`lock`] and [`LockedShards`]: a `Mutex`, or a
/// `RwLock` whose shared side some other path uses (the memory store's atomic GCRA path).
pub(crate) trait ShardLock {
    /// What the lock guards.
    type Shard;
    /// Exclusive access to it.
    type Guard<'a>: DerefMut<Target = Self::Shard>
    where
        Self: 'a;

    /// Takes the lock exclusively. Entries are replaced whole, so a shard poisoned by a panic
    /// elsewhere is still consistent and is used as is.
    fn exclusive(&self) -> Self::Guard<'_>;
}

impl<S> ShardLock for Mutex<S> {
    type Shard = S;
    type Guard<'a>
        = MutexGuard<'a, S>
    where
        S: 'a;

    fn exclusive(&self) -> MutexGuard<'_, S> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<S> ShardLock for RwLock<S> {
    type Shard = S;
    type Guard<'a>
        = RwLockWriteGuard<'a, S>
    where
        S: 'a;

    fn exclusive(&self) -> RwLockWriteGuard<'_, S> {
        self.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Locks one shard exclusively.
pub(crate) fn lock<L: ShardLock>(shard: &L) -> L::Guard<'_> {
    shard.exclusive()
}

/// Shares one shard's lock with other readers (poison ignored, as by [`lock`]).
pub(crate) fn read<S>(shard: &RwLock<S>) -> RwLockReadGuard<'_, S> {
    shard.read().unwrap_or_else(PoisonError::into_inner)
}

/// The shards a request touches, all locked.
pub(crate) struct LockedShards<'a, L: ShardLock + 'a> {
    guards: SmallVec<[(usize, L::Guard<'a>); 8]>,
}

impl<'a, L: ShardLock> LockedShards<'a, L> {
    /// Locks `shards[id]` for every id in `ids` (repeats allowed), in ascending order: every
    /// request takes its locks in the same global order, so two requests never deadlock.
    pub(crate) fn lock(shards: &'a [L], ids: &[usize]) -> Self {
        let mut ids: SmallVec<[usize; 8]> = ids.iter().copied().collect();
        ids.sort_unstable();
        ids.dedup();
        LockedShards {
            guards: ids.iter().map(|&id| (id, lock(&shards[id]))).collect(),
        }
    }

    /// Shard `id`, which must be one of the ids locked.
    pub(crate) fn get(&mut self, id: usize) -> &mut L::Shard {
        let position = self
            .guards
            .iter()
            .position(|(locked, _)| *locked == id)
            .unwrap_or_default();
        &mut self.guards[position].1
    }

    /// Every locked shard.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut L::Shard> {
        self.guards.iter_mut().map(|(_, guard)| &mut **guard)
    }
}
