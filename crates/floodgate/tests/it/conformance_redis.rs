//! The store conformance suite, unchanged, against a real redis-server.

use crate::conformance;
use floodgate_test_support as support;

use std::time::Duration;

use support::ServedStore;

/// A fixed window of 2 an hour, once at least a minute of the hour is left. The tests below count
/// a key's admissions over several calls; in a window of a minute (aligned to the epoch) the
/// calls could straddle its end and the count restart (a suite run admitted 4 of 2).
fn two_per_hour() -> std::sync::Arc<floodgate::Limit> {
    support::clear_of_window_end(Duration::from_secs(3600), Duration::from_secs(60));
    std::sync::Arc::new(floodgate::Limit::fixed_window("m", 2, Duration::from_secs(3600)).unwrap())
}

async fn fresh_store() -> ServedStore {
    ServedStore::start()
}

conformance_suite!(fresh_store());

/// The same suite with one script call per hash slot (as Redis Cluster needs), so that the
/// order-and-refund path is held to the same semantics as the single atomic call.
mod cluster_compatible {
    use super::conformance;
    use super::support::{RedisServer, ServedStore};

    async fn fresh_store() -> ServedStore {
        let server = RedisServer::start();
        let store = floodgate::store::RedisStore::builder(server.url())
            .timeout(std::time::Duration::from_secs(5))
            .cluster_compatible(true)
            .build()
            .expect("store");
        ServedStore {
            servers: vec![server],
            store,
        }
    }

    crate::conformance_suite!(fresh_store());
}

/// The same suite on a server whose `FUNCTION` command is disabled: the store finds out on its
/// first call and decides by `EVALSHA`, with the same code and the same results.
mod without_functions {
    use super::conformance;
    use super::support::ServedStore;

    async fn fresh_store() -> ServedStore {
        ServedStore::without_functions()
    }

    crate::conformance_suite!(fresh_store());
}

/// The same suite on `redis_sharded`: three independent servers, identities placed by
/// rendezvous hashing.
mod sharded {
    use floodgate::store::ShardedRedisStore;
    use floodgate::{Store, store::Check};

    use super::conformance;
    use super::support::ServedStore;

    async fn fresh_store() -> ServedStore<ShardedRedisStore> {
        ServedStore::sharded(3)
    }

    crate::conformance_suite!(fresh_store());

    /// One node dies: identities on the others are still enforced; those on the dead node get
    /// errors, for the failure policy to handle.
    #[tokio::test]
    async fn losing_a_node_affects_only_its_identities() {
        let mut sharded = fresh_store().await;
        let limit = super::two_per_hour();
        let keys: Vec<String> = (0..30)
            .map(|client| format!("fg:{{ip:{client}}}:r:m"))
            .collect();
        // Placement follows the node names (random ports): the victim is the node that owns
        // the most of these identities, so that both outcomes are surely exercised.
        let mut owned = [0usize; 3];
        for key in &keys {
            owned[sharded.store.node_of(key)] += 1;
        }
        let victim = (0..3).max_by_key(|&node| owned[node]).unwrap_or(0);
        sharded.servers[victim].kill();
        let (mut enforced, mut failed) = (0, 0);
        for key in &keys {
            let checks = [Check::new(key.clone(), limit.clone(), 1)];
            let on_victim = sharded.store.node_of(key) == victim;
            let mut admitted = 0;
            let mut errors = 0;
            for _ in 0..3 {
                match sharded.check_and_consume(&checks, None).await {
                    Ok(decision) => admitted += u32::from(decision.is_allowed()),
                    Err(_) => errors += 1,
                }
            }
            if on_victim {
                assert_eq!(errors, 3, "{key} lives on the dead node");
                failed += 1;
            } else {
                assert_eq!((admitted, errors), (2, 0), "{key} is still enforced");
                enforced += 1;
            }
        }
        assert!(
            enforced > 0 && failed >= 10,
            "{enforced} enforced, {failed} on the dead node"
        );
    }
}

/// The same suite on a real 3-master Redis Cluster that the test creates
/// (`--cluster-enabled yes`, `redis-cli --cluster create`): one call per slot, routed by the
/// cluster client, MOVED / ASK followed by it.
mod cluster {
    use std::sync::Arc;
    use std::time::Duration;

    use floodgate::store::RedisStore;
    use floodgate::{Limit, Store, store::Check};

    use super::conformance;
    use super::support::RedisCluster;

    struct ClusterStore {
        cluster: RedisCluster,
        store: RedisStore,
    }

    impl Store for ClusterStore {
        fn check_and_consume<'a>(
            &'a self,
            checks: &'a [Check],
            now: Option<floodgate::time::Timestamp>,
        ) -> floodgate::store::BoxFuture<'a, Result<floodgate::Decision, floodgate::StoreError>>
        {
            self.store.check_and_consume(checks, now)
        }

        fn release<'a>(
            &'a self,
            leases: Vec<floodgate::store::Lease>,
        ) -> floodgate::store::BoxFuture<'a, Result<(), floodgate::StoreError>> {
            self.store.release(leases)
        }

        fn backend(&self) -> &'static str {
            "redis_cluster"
        }

        fn peek<'a>(
            &'a self,
            checks: &'a [Check],
            now: Option<floodgate::time::Timestamp>,
        ) -> floodgate::store::BoxFuture<'a, Result<floodgate::Decision, floodgate::StoreError>>
        {
            self.store.peek(checks, now)
        }

        fn reset<'a>(
            &'a self,
            keys: &'a [Arc<str>],
        ) -> floodgate::store::BoxFuture<'a, Result<u64, floodgate::StoreError>> {
            self.store.reset(keys)
        }

        fn charge<'a>(
            &'a self,
            checks: &'a [Check],
            now: Option<floodgate::time::Timestamp>,
        ) -> floodgate::store::BoxFuture<'a, Result<(), floodgate::StoreError>> {
            self.store.charge(checks, now)
        }

        fn refund<'a>(
            &'a self,
            checks: &'a [Check],
            charged_at: floodgate::time::Timestamp,
            now: Option<floodgate::time::Timestamp>,
        ) -> floodgate::store::BoxFuture<'a, Result<(), floodgate::StoreError>> {
            self.store.refund(checks, charged_at, now)
        }
    }

    fn on(cluster: RedisCluster) -> ClusterStore {
        let store = RedisStore::cluster(cluster.urls())
            .timeout(Duration::from_secs(5))
            .build()
            .expect("store");
        ClusterStore { cluster, store }
    }

    /// One cluster for the whole suite would be faster, but every test wants fresh keys: the
    /// suite's keys are fixed, so each test gets its own cluster.
    async fn fresh_store() -> ClusterStore {
        on(RedisCluster::start(3))
    }

    crate::conformance_suite!(fresh_store());

    /// Identities land on all three masters, and a request's limits spanning two identities
    /// (two slots) are still all-or-nothing.
    #[tokio::test]
    async fn identities_spread_over_the_masters() {
        let store = fresh_store().await;
        let keys: Vec<String> = (0..30)
            .map(|client| format!("fg:{{ip:{client}}}:r:m"))
            .collect();
        let mut masters: Vec<usize> = keys
            .iter()
            .map(|key| store.cluster.master_of(key))
            .collect();
        masters.sort_unstable();
        masters.dedup();
        assert_eq!(masters, vec![0, 1, 2], "keys on every master");
        let limit = super::two_per_hour();
        for key in &keys {
            let checks = [Check::new(key.clone(), limit.clone(), 1)];
            let admitted = futures_admitted(&store, &checks, 4).await;
            assert_eq!(admitted, 2, "{key}");
        }
    }

    async fn futures_admitted(store: &ClusterStore, checks: &[Check], tries: u32) -> u32 {
        let mut admitted = 0;
        for _ in 0..tries {
            admitted += u32::from(
                store
                    .check_and_consume(checks, None)
                    .await
                    .expect("decision")
                    .is_allowed(),
            );
        }
        admitted
    }

    /// One master dies: identities on the other two keep being enforced; those on the dead
    /// master get errors, for the failure policy.
    #[tokio::test]
    async fn losing_a_master_affects_only_its_identities() {
        let mut store = fresh_store().await;
        let limit = super::two_per_hour();
        let keys: Vec<String> = (0..30)
            .map(|client| format!("fg:{{ip:{client}}}:r:m"))
            .collect();
        let owners: Vec<usize> = keys
            .iter()
            .map(|key| store.cluster.master_of(key))
            .collect();
        // Warm the client's slot map, then kill a master.
        let warm = [Check::new(keys[0].clone(), limit.clone(), 0)];
        store.check_and_consume(&warm, None).await.expect("warm");
        let victim = 1;
        store.cluster.masters[victim].kill();
        let (mut enforced, mut failed) = (0, 0);
        let (mut victim_calls, mut refused_at_once) = (0, 0);
        for (key, &owner) in keys.iter().zip(&owners) {
            let checks = [Check::new(key.clone(), limit.clone(), 1)];
            let mut admitted = 0;
            let mut errors = 0;
            for _ in 0..3 {
                match store.check_and_consume(&checks, None).await {
                    Ok(decision) => admitted += u32::from(decision.is_allowed()),
                    Err(floodgate::StoreError::BreakerOpen) => {
                        errors += 1;
                        refused_at_once += 1;
                    }
                    Err(_) => errors += 1,
                }
            }
            if owner == victim {
                victim_calls += 3;
            }
            if owner == victim {
                assert_eq!(errors, 3, "{key} lives on the dead master");
                failed += 1;
            } else {
                assert_eq!((admitted, errors), (2, 0), "{key} is still enforced");
                enforced += 1;
            }
        }
        assert!(
            enforced > 10 && failed > 3,
            "{enforced} enforced, {failed} on the dead master"
        );
        // One breaker for the whole dead master (not one per slot): after its 5 failures,
        // every other identity on it is refused at once.
        assert!(
            refused_at_once >= victim_calls - 5,
            "{refused_at_once} of {victim_calls} refused by the open breaker"
        );
    }

    /// Resharding moves an identity's slot (and its keys, by MIGRATE) to another master while
    /// the store holds a stale slot map: the cluster answers MOVED, the client follows it, and
    /// the identity's count moves with it.
    #[tokio::test]
    async fn a_resharded_identity_keeps_its_count() {
        let store = fresh_store().await;
        let limit = Arc::new(Limit::fixed_window("m", 3, Duration::from_secs(3600)).unwrap());
        let key = "fg:{ip:resharded}:r:m".to_owned();
        let checks = [Check::new(key.clone(), limit.clone(), 1)];
        assert_eq!(futures_admitted(&store, &checks, 2).await, 2);
        let from = store.cluster.master_of(&key);
        let to = (from + 1) % 3;
        let id =
            |index: usize| -> String { store.cluster.masters[index].command(&["CLUSTER", "MYID"]) };
        // Every slot `from` serves goes, so the key's slot surely moves.
        let slots = store.cluster.slots_served_by(from);
        let output = std::process::Command::new("redis-cli")
            .args(["--cluster", "reshard"])
            .arg(format!("127.0.0.1:{}", store.cluster.masters[from].port()))
            .args(["--cluster-from", &id(from), "--cluster-to", &id(to)])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli runs");
        assert!(output.status.success(), "reshard failed");
        super::support::wait_until(Duration::from_secs(20), "the slot to move", || {
            store.cluster.master_of(&key) == to
        });
        // The store's slot map still points at `from`: MOVED, followed, and the count of 2
        // came along with the key.
        assert_eq!(futures_admitted(&store, &checks, 3).await, 1);
    }

    /// A slot caught mid-migration: the key already moved to the importing master, the slot
    /// still owned by the migrating one, which answers ASK. The client must follow it (ASKING)
    /// and the script must find the moved count there.
    #[tokio::test]
    async fn an_identity_in_a_migrating_slot_is_followed_by_ask() {
        let store = fresh_store().await;
        let limit = Arc::new(Limit::fixed_window("m", 3, Duration::from_secs(3600)).unwrap());
        let key = "fg:{ip:migrating}:r:m".to_owned();
        let checks = [Check::new(key.clone(), limit.clone(), 1)];
        assert_eq!(futures_admitted(&store, &checks, 2).await, 2);
        let slot = floodgate::store::redis::hash_slot(&key).to_string();
        let from = store.cluster.master_of(&key);
        let to = (from + 1) % 3;
        let (source, target) = (&store.cluster.masters[from], &store.cluster.masters[to]);
        let source_id: String = source.command(&["CLUSTER", "MYID"]);
        let target_id: String = target.command(&["CLUSTER", "MYID"]);
        let _: () = target.command(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &source_id]);
        let _: () = source.command(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &target_id]);
        let port = target.port().to_string();
        let _: String =
            source.command(&["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS", &key]);
        // The migrating master no longer has it: it answers ASK (or 0) instead of 1.
        let still_there = source.try_command::<i64>(&["EXISTS", &key]);
        assert!(
            !matches!(still_there, Ok(1)),
            "the key left the migrating master"
        );
        // The slot still belongs to `from`: the call goes there, gets ASK, follows it.
        assert_eq!(futures_admitted(&store, &checks, 3).await, 1);
        let count: Vec<String> = target
            .try_command(&["HMGET", &key, "c"])
            .or_else(|_| {
                // A plain connection must say ASKING too while the slot is importing.
                let mut connection = target.connection();
                deadpool_redis::redis::cmd("ASKING").exec(&mut connection)?;
                deadpool_redis::redis::cmd("HMGET")
                    .arg(&key)
                    .arg("c")
                    .query(&mut connection)
            })
            .unwrap();
        assert_eq!(
            count,
            vec!["3".to_owned()],
            "charged on the importing master"
        );
    }
}
