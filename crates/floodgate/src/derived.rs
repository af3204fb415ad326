//! A small cache of values derived from shared values (a limit's header values, the metric
//! keys of a limit in a rule), found by the address of the `Arc`s they derive from.
//!
//! A [`Limit`](crate::Limit) is a plain value: what it limits, how much, how often. Whoever
//! derives something from it on every request (the headers, telemetry) keeps what it derived
//! here, in a thread-local cache of its own, so that a request finds it with a hash of two
//! addresses and no lock. The cache holds a clone of each `Arc` it is keyed by: an address
//! cannot be reused by another value while it is cached, so comparing addresses is exact.
//! It is direct-mapped and bounded: a value evicted by a colliding one is derived again.

use std::sync::Arc;

/// What a [`DerivedCache`] is keyed by: shared values compared by address, looked up by
/// reference (a hit clones nothing).
pub(crate) trait SharedKey {
    /// The key as a lookup borrows it.
    type Ref<'a>: Copy
    where
        Self: 'a;
    /// A hash of the addresses.
    fn address_hash(key: Self::Ref<'_>) -> usize;
    /// Whether `key` is the very same shared values.
    fn is(&self, key: Self::Ref<'_>) -> bool;
    /// The key to keep (clones of the `Arc`s).
    fn owned(key: Self::Ref<'_>) -> Self;
}

fn address<T: ?Sized>(shared: &Arc<T>) -> usize {
    Arc::as_ptr(shared).cast::<()>() as usize
}

impl<T: ?Sized> SharedKey for Arc<T> {
    type Ref<'a>
        = &'a Arc<T>
    where
        T: 'a;

    fn address_hash(key: &Arc<T>) -> usize {
        address(key)
    }

    fn is(&self, key: &Arc<T>) -> bool {
        Arc::ptr_eq(self, key)
    }

    fn owned(key: &Arc<T>) -> Self {
        key.clone()
    }
}

impl<A: ?Sized, B: ?Sized> SharedKey for (Arc<A>, Arc<B>) {
    type Ref<'a>
        = (&'a Arc<A>, &'a Arc<B>)
    where
        A: 'a,
        B: 'a;

    fn address_hash((a, b): Self::Ref<'_>) -> usize {
        address(a).rotate_left(17) ^ address(b)
    }

    fn is(&self, (a, b): Self::Ref<'_>) -> bool {
        Arc::ptr_eq(&self.0, a) && Arc::ptr_eq(&self.1, b)
    }

    fn owned((a, b): Self::Ref<'_>) -> Self {
        (a.clone(), b.clone())
    }
}

/// A direct-mapped cache of `SLOTS` (a power of two) values derived from `K`.
pub(crate) struct DerivedCache<K, V, const SLOTS: usize> {
    slots: Box<[Option<(K, V)>]>,
}

impl<K: SharedKey, V, const SLOTS: usize> DerivedCache<K, V, SLOTS> {
    /// An empty cache.
    pub(crate) fn new() -> Self {
        const { assert!(SLOTS.is_power_of_two()) };
        DerivedCache {
            slots: (0..SLOTS).map(|_| None).collect(),
        }
    }

    /// The value derived from `key`, derived with `derive` (and kept) unless it is here.
    pub(crate) fn get_or_derive(&mut self, key: K::Ref<'_>, derive: impl FnOnce() -> V) -> &V {
        // Fibonacci hashing: the top bits of the product mix every bit of the addresses
        // (which share their low, aligned bits).
        let mixed = (K::address_hash(key) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let index = mixed.checked_shr(64 - SLOTS.trailing_zeros()).unwrap_or(0) as usize;
        let slot = &mut self.slots[index];
        if !slot.as_ref().is_some_and(|(cached, _)| cached.is(key)) {
            *slot = None;
        }
        &slot.get_or_insert_with(|| (K::owned(key), derive())).1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derives_once_per_shared_value_and_again_for_an_equal_but_distinct_one() {
        let mut cache = DerivedCache::<Arc<str>, String, 16>::new();
        let mut derived = 0;
        let a: Arc<str> = Arc::from("a");
        let mut derive = |of: &Arc<str>| {
            derived += 1;
            format!("<{of}>")
        };
        assert_eq!(cache.get_or_derive(&a, || derive(&a)), "<a>");
        assert_eq!(cache.get_or_derive(&a.clone(), || derive(&a)), "<a>");
        // Equal contents, another allocation: the cache knows values by address only.
        let other: Arc<str> = Arc::from("a");
        assert_eq!(cache.get_or_derive(&other, || derive(&other)), "<a>");
        assert_eq!(derived, 2);
    }

    fn lookup(key: &(Arc<str>, Arc<str>)) -> (&Arc<str>, &Arc<str>) {
        (&key.0, &key.1)
    }

    #[test]
    fn a_colliding_value_evicts_and_is_derived_again_correctly() {
        // One slot: every key collides.
        let mut cache = DerivedCache::<(Arc<str>, Arc<str>), String, 1>::new();
        let rule: Arc<str> = Arc::from("rule");
        let (x, y): (Arc<str>, Arc<str>) = (Arc::from("x"), Arc::from("y"));
        let key_x = (rule.clone(), x);
        let key_y = (rule, y);
        let join = |key: &(Arc<str>, Arc<str>)| format!("{}/{}", key.0, key.1);
        assert_eq!(
            cache.get_or_derive(lookup(&key_x), || join(&key_x)),
            "rule/x"
        );
        assert_eq!(
            cache.get_or_derive(lookup(&key_y), || join(&key_y)),
            "rule/y"
        );
        assert_eq!(
            cache.get_or_derive(lookup(&key_x), || join(&key_x)),
            "rule/x"
        );
    }

    #[test]
    fn the_cache_holds_its_keys_so_that_their_addresses_are_not_reused() {
        let mut cache = DerivedCache::<Arc<u64>, u64, 4>::new();
        let first = Arc::new(1);
        cache.get_or_derive(&first, || 1);
        assert_eq!(Arc::strong_count(&first), 2, "the cache keeps a clone");
        drop(first);
        // A new value cannot take the first one's address, so it is never mistaken for it.
        let second = Arc::new(2);
        assert_eq!(*cache.get_or_derive(&second, || 2), 2);
    }
}
