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
    /// The highest count evicted so far: what a newcomer may already have had.
    denials_floor: u64,
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
    /// How far back the rankings look: the most recent one-minute slots.
    pub const WINDOW: std::time::Duration =
        std::time::Duration::from_secs(SLOTS as u64 * SLOT_SECONDS);

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
                space_saving_increment(slot, identity, capacity);
            }
            if closeness > 0.0 {
                let entry = slot.closeness.entry(identity).or_insert(0.0);
                *entry = entry.max(closeness);
                if slot.closeness.len() >= 2 * capacity {
                    keep_largest(&mut slot.closeness, capacity, |value| *value);
                }
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

/// Space-saving, evicting in batches: count `identity`; a newcomer starts from the highest
/// count ever evicted (so estimates never fall below the truth); when the table reaches twice
/// its capacity, the smaller half goes. Amortised O(1) per call, at most 2 × capacity entries.
fn space_saving_increment(slot: &mut Slot, identity: IdentityHash, capacity: usize) {
    let floor = slot.denials_floor;
    let (count, _) = slot.denials.entry(identity).or_insert((floor, floor));
    *count += 1;
    if slot.denials.len() >= 2 * capacity {
        let evicted = keep_largest(&mut slot.denials, capacity, |(count, _)| *count as f64);
        slot.denials_floor = slot.denials_floor.max(evicted as u64);
    }
}

/// Keeps the `keep` entries with the largest `score`; returns the largest score removed.
fn keep_largest<V>(
    map: &mut HashMap<IdentityHash, V>,
    keep: usize,
    score: impl Fn(&V) -> f64,
) -> f64 {
    let mut scores: Vec<f64> = map.values().map(&score).collect();
    let cut = scores.len().saturating_sub(keep);
    if cut == 0 {
        return 0.0;
    }
    let (_, threshold, _) = scores.select_nth_unstable_by(cut - 1, f64::total_cmp);
    let threshold = *threshold;
    let mut removed = 0;
    let mut largest_removed: f64 = 0.0;
    map.retain(|_, value| {
        let value = score(value);
        if removed < cut && value <= threshold {
            removed += 1;
            largest_removed = largest_removed.max(value);
            false
        } else {
            true
        }
    });
    largest_removed
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
        // Two rankings, each at most twice the capacity between batch evictions.
        assert!(top.tracked() <= 4 * 64, "bounded: {}", top.tracked());
    }

    #[test]
    fn memory_stays_bounded_under_a_million_identities() {
        let top = TopClients::new(256);
        let now = 1_700_000_000;
        for client in 0..1_000_000u64 {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&client.to_be_bytes());
            top.record(IdentityHash(bytes), true, 0.9, now);
            // 1% of the denials: above the sketch's guarantee of N / capacity (0.4%).
            if client % 100 == 0 {
                top.record(hash("persistent"), true, 1.0, now);
            }
        }
        assert!(top.tracked() <= 4 * 256, "{} entries", top.tracked());
        let (by_denials, _) = top.top(1, now);
        assert_eq!(
            by_denials[0].identity,
            hash("persistent"),
            "the heavy hitter survives"
        );
    }

    #[test]
    fn the_window_is_five_minutes() {
        let top = TopClients::new(8);
        top.record(hash("old"), true, 0.5, 1_000_000);
        assert_eq!(top.top(5, 1_000_000 + 4 * 60).0.len(), 1);
        assert!(top.top(5, 1_000_000 + 6 * 60).0.is_empty());
    }
}
