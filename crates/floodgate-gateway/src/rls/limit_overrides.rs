//! The limits of Envoy's per-descriptor `limit` overrides (SPEC §10), built once per distinct
//! value and kept in a table of bounded size that evicts the least recently used.
//!
//! The bound is on memory only: an override's counter lives in the store under a key made of
//! its value (`override_<n>_per_<unit>`), so a limit evicted here and seen again is rebuilt
//! with the same key and finds its count where it left it. Evicting, rather than refusing new
//! values once the table is full, keeps a long-lived process applying every override it is
//! sent, however many distinct ones it saw before.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use super::rules::{DescriptorLimit, Unit};
use crate::telemetry::{RLS_LIMIT_OVERRIDES_TOTAL, RLS_OVERRIDE_EVICTIONS_TOTAL};

/// Distinct `limit` overrides (requests per unit and unit) whose limits are kept at once; past
/// it, the least recently used is evicted (and counted in
/// `floodgate_rls_override_evictions_total`).
pub(crate) const MAX_OVERRIDES: usize = 1024;

/// An override's value as Envoy sends it: requests per unit, and the unit's protocol number.
type OverrideValue = (u32, i32);

/// The limits of the overrides seen recently; see the [module docs](self).
pub(crate) struct LimitOverrides {
    capacity: usize,
    table: Mutex<Table>,
}

/// Each value's limit and when it was last used, and the values in order of last use, so that
/// a hit and an eviction each cost O(log n) however full the table is.
#[derive(Default)]
struct Table {
    limits: HashMap<OverrideValue, (Arc<DescriptorLimit>, u64)>,
    /// Last use (a tick that only grows) to value: the first entry is the least recent.
    by_last_use: BTreeMap<u64, OverrideValue>,
    next_tick: u64,
}

impl Default for LimitOverrides {
    fn default() -> Self {
        LimitOverrides::with_capacity(MAX_OVERRIDES)
    }
}

impl LimitOverrides {
    /// A table keeping the limits of at most `capacity` distinct overrides (at least one).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        LimitOverrides {
            capacity: capacity.max(1),
            table: Mutex::new(Table::default()),
        }
    }

    /// The limit of the override `requests_per_unit` per `unit` (the protocol's unit number),
    /// or `None` when the unit or the value cannot make one. Counts the outcome in
    /// `floodgate_rls_limit_overrides_total{outcome}` (`applied` or `invalid`).
    pub(crate) fn limit_for(
        &self,
        requests_per_unit: u32,
        unit: i32,
    ) -> Option<Arc<DescriptorLimit>> {
        let limit = self.lookup(requests_per_unit, unit);
        let outcome = if limit.is_some() {
            "applied"
        } else {
            "invalid"
        };
        metrics::counter!(RLS_LIMIT_OVERRIDES_TOTAL, "outcome" => outcome).increment(1);
        limit
    }

    /// How many overrides' limits are kept now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().limits.len()
    }

    /// Whether no override's limit is kept.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lookup(&self, requests_per_unit: u32, unit: i32) -> Option<Arc<DescriptorLimit>> {
        let unit_of_value = Unit::from_proto(unit)?;
        let value = (requests_per_unit, unit);
        let mut table = self.lock();
        let table = &mut *table;
        let tick = table.next_tick;
        table.next_tick += 1;
        if let Some((limit, last_use)) = table.limits.get_mut(&value) {
            table.by_last_use.remove(last_use);
            *last_use = tick;
            table.by_last_use.insert(tick, value);
            return Some(limit.clone());
        }
        let limit = Arc::new(DescriptorLimit::from_override(
            requests_per_unit,
            unit_of_value,
        )?);
        if table.limits.len() >= self.capacity
            && let Some((_, least_recent)) = table.by_last_use.pop_first()
        {
            table.limits.remove(&least_recent);
            metrics::counter!(RLS_OVERRIDE_EVICTIONS_TOTAL).increment(1);
        }
        table.limits.insert(value, (limit.clone(), tick));
        table.by_last_use.insert(tick, value);
        Some(limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i32 = 4;

    /// Past the bound, the newest override applies and the least recently used one is
    /// evicted: seen again, it is rebuilt (a new limit object, the same counter name, so the
    /// same count in the store). One used recently survives. Before, a process that had seen
    /// 1,024 distinct values ignored every new one for the rest of its life.
    #[test]
    fn past_the_bound_the_least_recently_used_override_is_evicted() {
        let overrides = LimitOverrides::default();
        let first = overrides.limit_for(1, DAY).unwrap();
        let second = overrides.limit_for(2, DAY).unwrap();
        for requests_per_unit in 3..=MAX_OVERRIDES as u32 {
            overrides.limit_for(requests_per_unit, DAY).unwrap();
        }
        assert_eq!(overrides.len(), MAX_OVERRIDES);
        // The first is used again: the second is now the least recent.
        assert!(Arc::ptr_eq(&overrides.limit_for(1, DAY).unwrap(), &first));

        let newest = overrides
            .limit_for(MAX_OVERRIDES as u32 + 1, DAY)
            .expect("a new override past the bound applies");
        assert_eq!(newest.requests_per_unit, MAX_OVERRIDES as u32 + 1);
        assert_eq!(overrides.len(), MAX_OVERRIDES, "one evicted for it");
        assert!(
            Arc::ptr_eq(&overrides.limit_for(1, DAY).unwrap(), &first),
            "the recently used one is kept"
        );

        let rebuilt = overrides.limit_for(2, DAY).unwrap();
        assert!(
            !Arc::ptr_eq(&rebuilt, &second),
            "the least recently used one was evicted and is rebuilt"
        );
        assert_eq!(
            rebuilt.counter_name(),
            second.counter_name(),
            "same counter"
        );
        assert_eq!(rebuilt.counter_name(), Some("override_2_per_day"));
        assert_eq!(overrides.len(), MAX_OVERRIDES);
    }

    #[test]
    fn an_unknown_unit_makes_no_limit_and_takes_no_room() {
        let overrides = LimitOverrides::with_capacity(2);
        assert!(overrides.limit_for(5, 99).is_none());
        assert!(overrides.is_empty());
    }
}
