//! `redis_sharded`: independent Redis nodes, each identity on one of them by rendezvous
//! hashing of its key's `{…}` tag. One identity's limits stay on one node (one atomic call);
//! losing a node affects only its share of identities, under the failure policy, and adding or
//! removing a node moves only the identities that land on or came from it.

use std::sync::Arc;

use super::RedisStore;
use super::groups::{Asking, Group, GroupedStore, lease_groups, sync_groups};
use crate::decision::Decision;
use crate::key::storage::hash_tag;
use crate::store::batched::{LeaseRequest, Leased, ResetListener, SyncTarget, Synced};
use crate::store::resilience::BreakerState;
use crate::store::{BoxFuture, Check, Lease, Store, StoreError};
use crate::time::Timestamp;

/// FNV-1a, then a SplitMix64 finaliser: stable across processes and versions, so that every
/// gateway picks the same node.
fn stable_hash(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &byte in *part {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        hash ^= 0xff;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash = (hash ^ (hash >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash = (hash ^ (hash >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

/// The node (index into `nodes`) that owns `key`: the highest score of (node, tag).
pub fn rendezvous(key: &str, nodes: &[String]) -> usize {
    let tag = hash_tag(key).as_bytes();
    (0..nodes.len())
        .max_by_key(|&index| stable_hash(&[nodes[index].as_bytes(), tag]))
        .unwrap_or(0)
}

/// Several independent Redis nodes behind one store.
#[derive(Clone, Debug)]
pub struct ShardedRedisStore {
    names: Vec<String>,
    nodes: Vec<RedisStore>,
}

impl ShardedRedisStore {
    /// A store over `nodes`, each named (its URL, usually): names decide placement, so every
    /// gateway must list the same names.
    pub fn new(nodes: Vec<(String, RedisStore)>) -> Result<ShardedRedisStore, StoreError> {
        if nodes.is_empty() {
            return Err(StoreError::Protocol(
                "redis_sharded needs at least one node".into(),
            ));
        }
        let (names, nodes) = nodes.into_iter().unzip();
        Ok(ShardedRedisStore { names, nodes })
    }

    /// The node that owns `key`.
    pub fn node_of(&self, key: &str) -> usize {
        rendezvous(key, &self.names)
    }

    /// The store of node `index` (in the order given to [`ShardedRedisStore::new`]).
    pub fn node(&self, index: usize) -> &RedisStore {
        &self.nodes[index]
    }
}

impl GroupedStore for ShardedRedisStore {
    /// `checks` grouped by owning node, in order of first appearance.
    fn node_groups(&self, checks: &[Check]) -> Vec<Group<'_>> {
        let mut groups: Vec<(usize, Group<'_>)> = Vec::new();
        for (index, check) in checks.iter().enumerate() {
            let node = self.node_of(&check.key);
            match groups.iter_mut().find(|(owner, _)| *owner == node) {
                Some((_, group)) => group.members.push(index),
                None => groups.push((
                    node,
                    Group {
                        node: &self.nodes[node],
                        members: vec![index],
                    },
                )),
            }
        }
        groups.into_iter().map(|(_, group)| group).collect()
    }
}

impl SyncTarget for ShardedRedisStore {
    fn sync<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Synced, StoreError>> {
        Box::pin(async move { sync_groups(&self.node_groups(checks), checks, now).await })
    }

    fn lease<'a>(
        &'a self,
        requests: &'a [LeaseRequest],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Leased> {
        Box::pin(async move {
            let mut groups: Vec<Group<'_>> = Vec::new();
            for (index, request) in requests.iter().enumerate() {
                let node = &self.nodes[self.node_of(&request.check.key)];
                match groups
                    .iter_mut()
                    .find(|group| std::ptr::eq(group.node, node))
                {
                    Some(group) => group.members.push(index),
                    None => groups.push(Group {
                        node,
                        members: vec![index],
                    }),
                }
            }
            lease_groups(&groups, requests, now).await
        })
    }

    fn is_refused(&self, key: &str) -> bool {
        SyncTarget::is_refused(&self.nodes[self.node_of(key)], key)
    }

    fn on_reset(&self, listener: ResetListener) {
        // Each node publishes the resets of its own identities.
        for node in &self.nodes {
            node.on_reset(listener.clone());
        }
    }
}

impl Store for ShardedRedisStore {
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        self.decide_grouped(Asking::Decide, checks, now)
    }

    fn release<'a>(&'a self, leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut by_node: Vec<Vec<Lease>> = vec![Vec::new(); self.nodes.len()];
            for lease in leases {
                by_node[self.node_of(&lease.key)].push(lease);
            }
            let mut result = Ok(());
            for (node, leases) in self.nodes.iter().zip(by_node) {
                if !leases.is_empty()
                    && let Err(error) = node.release(leases).await
                {
                    result = Err(error);
                }
            }
            result
        })
    }

    fn backend(&self) -> &'static str {
        "redis_sharded"
    }

    fn peek<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        self.decide_grouped(Asking::Peek, checks, now)
    }

    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.charge_grouped(checks, now)
    }

    fn refund<'a>(
        &'a self,
        checks: &'a [Check],
        charged_at: Timestamp,
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.refund_grouped(checks, charged_at, now)
    }

    fn reset<'a>(&'a self, keys: &'a [Arc<str>]) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let mut by_node: Vec<Vec<Arc<str>>> = vec![Vec::new(); self.nodes.len()];
            for key in keys {
                by_node[self.node_of(key)].push(key.clone());
            }
            let mut removed = 0;
            for (node, keys) in self.nodes.iter().zip(by_node) {
                if !keys.is_empty() {
                    removed += node.reset(&keys).await?;
                }
            }
            Ok(removed)
        })
    }

    /// Every node answers, or the first failure.
    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let probes = self.nodes.iter().map(Store::probe);
            futures_util::future::try_join_all(probes).await.map(drop)
        })
    }

    /// Kept only if every node keeps its part; lost if any node loses its part.
    fn persistence(&self) -> BoxFuture<'_, Option<bool>> {
        Box::pin(async move {
            let answers = self.nodes.iter().map(Store::persistence);
            let answers = futures_util::future::join_all(answers).await;
            if answers.contains(&Some(false)) {
                return Some(false);
            }
            answers
                .into_iter()
                .collect::<Option<Vec<bool>>>()
                .map(|_| true)
        })
    }

    /// Open if any node's breaker is not closed: that node's identities follow the policy.
    fn override_backend(&self) -> Option<Arc<dyn crate::store::override_backend::OverrideBackend>> {
        Some(Arc::new(super::overrides::RedisOverrides::sharded(
            self.clone(),
        )))
    }

    fn breaker_state(&self) -> Option<BreakerState> {
        self.nodes
            .iter()
            .filter_map(Store::breaker_state)
            .find(|state| *state != BreakerState::Closed)
            .or(Some(BreakerState::Closed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(count: usize) -> Vec<String> {
        (0..count)
            .map(|index| format!("redis://10.0.0.{index}:6379"))
            .collect()
    }

    fn key(identity: u64) -> String {
        format!("fg:{{key:{identity:032x}}}:plan.free:per-second")
    }

    #[test]
    fn a_hundred_thousand_identities_spread_evenly() {
        let nodes = names(3);
        let mut counts = [0u32; 3];
        for identity in 0..100_000 {
            counts[rendezvous(&key(identity), &nodes)] += 1;
        }
        let ideal = 100_000.0 / 3.0;
        for count in counts {
            assert!(
                (f64::from(count) - ideal).abs() / ideal < 0.05,
                "within ±5%: {counts:?}"
            );
        }
    }

    #[test]
    fn removing_a_node_moves_only_its_identities() {
        let three = names(3);
        let two: Vec<String> = vec![three[0].clone(), three[2].clone()];
        for identity in 0..20_000 {
            let before = rendezvous(&key(identity), &three);
            let after = rendezvous(&key(identity), &two);
            if before != 1 {
                assert_eq!(
                    two[after], three[before],
                    "identity {identity} moved needlessly"
                );
            }
        }
    }

    #[test]
    fn one_identity_stays_on_one_node() {
        let nodes = names(5);
        let a = "fg:{ip:0123}:plan.free:per-second";
        let b = "fg:{ip:0123}:plan.free.POST/x:export";
        assert_eq!(rendezvous(a, &nodes), rendezvous(b, &nodes));
    }
}
