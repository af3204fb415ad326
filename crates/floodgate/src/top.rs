//! The heaviest clients of the last five minutes, in bounded memory: by denials (a
//! space-saving sketch: at most `capacity` counters, counts over-estimated by at most the
//! smallest counter) and by closeness to their limit (the highest used fraction seen).
//!
//! Time is cut into one-minute slots; the five most recent make the window. Identities are
//! hashes, never raw values.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::key::IdentityHash;

const SLOTS: usize = 5;
const SLOT_SECONDS: u64 = 60;

/// One client in a top-N answer.
#[derive(Clone, Debug, PartialEq)]
pub struct TopEntry {
    /// The identity's hash.
    pub identity: IdentityHash,
    /// Denials in the window that are certain: the sketch's count minus its possible
    /// overestimate, so a client that arrived late over an evicted counter does not outrank
    /// one that was denied all along.
    pub denials: u64,
    /// The highest share of a limit the client used in the window (0 to 1).
    pub closeness: f64,
}

#[derive(Default)]
struct Slot {
    minute: u64,
    /// identity → (estimated denials, overestimation bound).
    denials: HashMap<IdentityHash, (u64, u64)>,
    /// identity → highest used fraction.
    closeness: HashMap<IdentityHash, f64>,
}

/// Tracks the top clients; share one `Arc<TopClients>` between layers and the admin API.
pub struct TopClients {
    capacity: usize,
    slots: Mutex<[Slot; SLOTS]>,
}

impl std::fmt::Debug for TopClients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TopClients")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl Default for TopClients {
    fn default() -> Self {
        TopClients::new(1024)
    }
}

impl TopClients {
    /// A tracker keeping at most `capacity` identities per minute in each ranking.
    pub fn new(capacity: usize) -> Self {
        TopClients {
            capacity: capacity.max(1),
            slots: Mutex::new(Default::default()),
        }
    }

    fn with_slot<R>(&self, now_secs: u64, f: impl FnOnce(&mut Slot) -> R) -> R {
        let minute = now_secs / SLOT_SECONDS;
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = &mut slots[(minute % SLOTS as u64) as usize];
        if slot.minute != minute {
            *slot = Slot {
                minute,
                ..Slot::default()
            };
        }
        f(slot)
    }

    /// Whether a decision is worth recording: denied, or at least half of a limit used. The
    /// rest (most traffic) never takes the tracker's lock.
    pub fn interesting(denied: bool, closeness: f64) -> bool {
        denied || closeness >= 0.5
    }

    /// Records one decision for `identity` at `now_secs` (Unix seconds): whether it was denied,
    /// and the used fraction of its binding limit.
    pub fn record(&self, identity: IdentityHash, denied: bool, closeness: f64, now_secs: u64) {
        let capacity = self.capacity;
        self.with_slot(now_secs, |slot| {
            if denied {
                space_saving_increment(&mut slot.denials, identity, capacity);
            }
            if closeness > 0.0 {
                let full =
                    slot.closeness.len() >= capacity && !slot.closeness.contains_key(&identity);
                if full {
                    // Replace the least close client if this one is closer.
                    let weakest = slot
                        .closeness
                        .iter()
                        .min_by(|a, b| a.1.total_cmp(b.1))
                        .map(|(hash, value)| (*hash, *value));
                    match weakest {
                        Some((hash, value)) if value < closeness => {
                            slot.closeness.remove(&hash);
                        }
                        _ => return,
                    }
                }
                let entry = slot.closeness.entry(identity).or_insert(0.0);
                *entry = entry.max(closeness);
            }
        });
    }

    /// The `n` clients with the most denials, and the `n` closest to their limit, over the
    /// five minutes before `now_secs`.
    pub fn top(&self, n: usize, now_secs: u64) -> (Vec<TopEntry>, Vec<TopEntry>) {
        let current = now_secs / SLOT_SECONDS;
        let slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let mut merged: HashMap<IdentityHash, TopEntry> = HashMap::new();
        for slot in slots
            .iter()
            .filter(|slot| slot.minute + (SLOTS as u64) > current && slot.minute <= current)
        {
            for (identity, (count, overestimate)) in &slot.denials {
                let entry = merged.entry(*identity).or_insert_with(|| TopEntry {
                    identity: *identity,
                    denials: 0,
                    closeness: 0.0,
                });
                entry.denials += count - overestimate;
            }
            for (identity, closeness) in &slot.closeness {
                let entry = merged.entry(*identity).or_insert_with(|| TopEntry {
                    identity: *identity,
                    denials: 0,
                    closeness: 0.0,
                });
                entry.closeness = entry.closeness.max(*closeness);
            }
        }
        drop(slots);
        let mut by_denials: Vec<TopEntry> = merged
            .values()
            .filter(|entry| entry.denials > 0)
            .cloned()
            .collect();
        by_denials.sort_by(|a, b| b.denials.cmp(&a.denials).then(a.identity.cmp(&b.identity)));
        by_denials.truncate(n);
        let mut by_closeness: Vec<TopEntry> = merged
            .into_values()
            .filter(|entry| entry.closeness > 0.0)
            .collect();
        by_closeness.sort_by(|a, b| {
            b.closeness
                .total_cmp(&a.closeness)
                .then(a.identity.cmp(&b.identity))
        });
        by_closeness.truncate(n);
        (by_denials, by_closeness)
    }

    /// Identities held, all slots together (for memory bounds).
    pub fn tracked(&self) -> usize {
        let slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        slots
            .iter()
            .map(|slot| slot.denials.len() + slot.closeness.len())
            .sum()
    }
}

/// Space-saving: count `identity`; when full, the smallest counter is taken over, its count
/// inherited (so estimates never fall below the truth).
fn space_saving_increment(
    counters: &mut HashMap<IdentityHash, (u64, u64)>,
    identity: IdentityHash,
    capacity: usize,
) {
    if let Some((count, _)) = counters.get_mut(&identity) {
        *count += 1;
        return;
    }
    if counters.len() < capacity {
        counters.insert(identity, (1, 0));
        return;
    }
    let smallest = counters
        .iter()
        .min_by_key(|(_, (count, _))| *count)
        .map(|(hash, (count, _))| (*hash, *count));
    if let Some((evicted, count)) = smallest {
        counters.remove(&evicted);
        counters.insert(identity, (count + 1, count));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Identity;

    fn hash(name: &str) -> IdentityHash {
        Identity::ApiKey(name.to_owned()).hash()
    }

    #[test]
    fn heavy_hitters_come_out_in_order_despite_a_long_tail() {
        let top = TopClients::new(64);
        let now = 1_700_000_000;
        // Skewed mix: heavy-a 500 denials, heavy-b 300, heavy-c 100, 20,000 one-off clients.
        for round in 0..20_000u64 {
            top.record(hash(&format!("tail-{round}")), true, 0.1, now);
            // heavy-a's 500 denials are spread through the tail, not bunched at the end.
            if round % 40 == 0 {
                top.record(hash("heavy-a"), true, 1.0, now);
            }
        }
        for _ in 0..300 {
            top.record(hash("heavy-b"), true, 0.9, now);
        }
        for _ in 0..100 {
            top.record(hash("heavy-c"), true, 0.5, now);
        }
        let (by_denials, by_closeness) = top.top(3, now + 10);
        let order: Vec<IdentityHash> = by_denials.iter().map(|entry| entry.identity).collect();
        assert_eq!(order, [hash("heavy-a"), hash("heavy-b"), hash("heavy-c")]);
        assert!(by_denials[0].denials >= 500);
        assert_eq!(by_closeness[0].identity, hash("heavy-a"));
        assert!(top.tracked() <= 2 * 64, "bounded: {}", top.tracked());
    }

    #[test]
    fn the_window_is_five_minutes() {
        let top = TopClients::new(8);
        top.record(hash("old"), true, 0.5, 1_000_000);
        assert_eq!(top.top(5, 1_000_000 + 4 * 60).0.len(), 1);
        assert!(top.top(5, 1_000_000 + 6 * 60).0.is_empty());
    }
}
