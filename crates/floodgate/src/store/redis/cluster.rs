//! The breakers of a Redis Cluster store: one per master, found through `CLUSTER SLOTS`, so
//! that a dead master trips one breaker for all of its identities while the other masters'
//! identities are still decided. For a slot the map does not (yet) name an owner for, a
//! breaker of its own stands in.
//!
//! The map is read before the first call and again after a failed call (at most once a
//! second), so that after a failover the promoted replica's slots get its own, closed breaker.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant};

use deadpool_redis::redis::Value;

use super::hash_slot;
use crate::store::StoreError;
use crate::store::resilience::{BreakerState, Guard, GuardConfig, StoreObserver};

const SLOTS: usize = 16384;
const UNKNOWN: u16 = u16::MAX;
/// The slot map is re-read at most this often.
const REFRESH_EVERY: Duration = Duration::from_secs(1);

/// A contiguous range of slots and the address (`host:port`) of the master serving it.
pub(super) type SlotRange = (u16, u16, String);

pub(super) struct ClusterBreakers {
    config: GuardConfig,
    observer: Arc<dyn StoreObserver>,
    map: RwLock<SlotMap>,
    by_slot: Mutex<HashMap<u16, Arc<Guard>>>,
    last_refresh: Mutex<Option<Instant>>,
}

struct SlotMap {
    /// Per slot, the index of its master in `masters`, or `UNKNOWN`.
    owners: Vec<u16>,
    /// Every master seen so far, with its breaker (kept across refreshes, state and all).
    masters: Vec<(String, Arc<Guard>)>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ClusterBreakers {
    pub(super) fn new(config: GuardConfig, observer: Arc<dyn StoreObserver>) -> Self {
        ClusterBreakers {
            config,
            observer,
            map: RwLock::new(SlotMap {
                owners: vec![UNKNOWN; SLOTS],
                masters: Vec::new(),
            }),
            by_slot: Mutex::new(HashMap::new()),
            last_refresh: Mutex::new(None),
        }
    }

    fn new_guard(&self) -> Arc<Guard> {
        Arc::new(Guard::new("redis", self.config, self.observer.clone()))
    }

    /// The breaker that calls on `key` go through: its master's, else its slot's.
    pub(super) fn guard_for(&self, key: &str) -> Arc<Guard> {
        let slot = hash_slot(key);
        {
            let map = self.map.read().unwrap_or_else(PoisonError::into_inner);
            if let Some((_, guard)) = map.masters.get(usize::from(map.owners[usize::from(slot)])) {
                return guard.clone();
            }
        }
        lock(&self.by_slot)
            .entry(slot)
            .or_insert_with(|| self.new_guard())
            .clone()
    }

    /// The state of every breaker.
    pub(super) fn states(&self) -> Vec<BreakerState> {
        let map = self.map.read().unwrap_or_else(PoisonError::into_inner);
        map.masters
            .iter()
            .map(|(_, guard)| guard.state())
            .chain(lock(&self.by_slot).values().map(|guard| guard.state()))
            .collect()
    }

    /// Whether the slot map has been read at least once.
    pub(super) fn is_known(&self) -> bool {
        lock(&self.last_refresh).is_some()
    }

    /// Claims the next refresh if one is due (never read, or last read a second ago or more).
    pub(super) fn claim_refresh(&self) -> bool {
        let mut last = lock(&self.last_refresh);
        match *last {
            Some(at) if at.elapsed() < REFRESH_EVERY => false,
            _ => {
                *last = Some(Instant::now());
                true
            }
        }
    }

    /// Installs a slot map read from the cluster.
    pub(super) fn apply(&self, ranges: &[SlotRange]) {
        let mut map = self.map.write().unwrap_or_else(PoisonError::into_inner);
        let mut owners = vec![UNKNOWN; SLOTS];
        for (start, end, address) in ranges {
            let index = match map.masters.iter().position(|(known, _)| known == address) {
                Some(index) => index,
                None => {
                    let guard = self.new_guard();
                    map.masters.push((address.clone(), guard));
                    map.masters.len() - 1
                }
            };
            let Ok(index) = u16::try_from(index) else {
                continue;
            };
            for slot in *start..=(*end).min(SLOTS as u16 - 1) {
                owners[usize::from(slot)] = index;
            }
        }
        map.owners = owners;
    }
}

/// Parses a `CLUSTER SLOTS` reply: `[[start, end, [host, port, id, ...], replicas...], ...]`.
pub(super) fn parse_slots(value: &Value) -> Result<Vec<SlotRange>, StoreError> {
    let invalid = || StoreError::Protocol(format!("unexpected CLUSTER SLOTS reply: {value:?}"));
    let Value::Array(ranges) = value else {
        return Err(invalid());
    };
    let number = |value: Option<&Value>| match value {
        Some(Value::Int(int)) => u16::try_from(*int).ok(),
        _ => None,
    };
    ranges
        .iter()
        .map(|range| {
            let Value::Array(range) = range else {
                return Err(invalid());
            };
            let (Some(start), Some(end), Some(Value::Array(master))) =
                (number(range.first()), number(range.get(1)), range.get(2))
            else {
                return Err(invalid());
            };
            let host = match master.first() {
                Some(Value::BulkString(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
                Some(Value::SimpleString(text)) => text.clone(),
                _ => return Err(invalid()),
            };
            let port = number(master.get(1)).ok_or_else(invalid)?;
            Ok((start, end, format!("{host}:{port}")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::resilience::LogObserver;

    fn breakers() -> ClusterBreakers {
        ClusterBreakers::new(GuardConfig::default(), Arc::new(LogObserver))
    }

    #[test]
    fn identities_of_one_master_share_its_breaker() {
        let breakers = breakers();
        let a = "fg:{ip:1}:r:m";
        let b = (0..)
            .map(|n| format!("fg:{{ip:{n}}}:r:m"))
            .find(|key| hash_slot(key) != hash_slot(a))
            .unwrap();
        // Before the map is known, each slot has its own breaker.
        assert!(!Arc::ptr_eq(
            &breakers.guard_for(a),
            &breakers.guard_for(&b)
        ));
        breakers.apply(&[(0, 16383, "10.0.0.1:6379".to_owned())]);
        assert!(Arc::ptr_eq(&breakers.guard_for(a), &breakers.guard_for(&b)));
        // A refresh that moves slots keeps each master's breaker.
        let before = breakers.guard_for(a);
        breakers.apply(&[
            (0, 8000, "10.0.0.2:6379".to_owned()),
            (8001, 16383, "10.0.0.1:6379".to_owned()),
        ]);
        let owner_of_a = if hash_slot(a) <= 8000 { 1 } else { 0 };
        assert_eq!(
            Arc::ptr_eq(&before, &breakers.guard_for(a)),
            owner_of_a == 0,
            "the old master keeps its breaker; a new one gets a fresh one"
        );
    }

    #[test]
    fn cluster_slots_replies_are_parsed() {
        let reply = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(5460),
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(7000),
                Value::BulkString(b"id".to_vec()),
            ]),
        ])]);
        assert_eq!(
            parse_slots(&reply).unwrap(),
            vec![(0, 5460, "127.0.0.1:7000".to_owned())]
        );
        assert!(parse_slots(&Value::Int(3)).is_err());
    }
}
