//! The store conformance suite, unchanged, against a real redis-server.

mod conformance;
mod support;

use support::ServedStore;

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

/// The same suite on `redis_sharded`: three independent servers, identities placed by
/// rendezvous hashing.
mod sharded {
    use std::time::Duration;

    use floodgate::store::{RedisStore, ShardedRedisStore};
    use floodgate::{Check, Store};

    use super::conformance;
    use super::support::{RedisServer, ServedStore};

    async fn fresh_store() -> ServedStore<ShardedRedisStore> {
        let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
        let nodes = servers
            .iter()
            .map(|server| {
                let store = RedisStore::builder(server.url())
                    .timeout(Duration::from_secs(5))
                    .build()
                    .expect("store");
                (server.url(), store)
            })
            .collect();
        ServedStore {
            servers,
            store: ShardedRedisStore::new(nodes).expect("nodes"),
        }
    }

    crate::conformance_suite!(fresh_store());

    /// One node dies: identities on the others are still enforced; those on the dead node get
    /// errors, for the failure policy to handle.
    #[tokio::test]
    async fn losing_a_node_affects_only_its_identities() {
        let mut sharded = fresh_store().await;
        let limit = std::sync::Arc::new(
            floodgate::Limit::fixed_window("m", 2, Duration::from_secs(60)).unwrap(),
        );
        let keys: Vec<String> = (0..30)
            .map(|client| format!("fg:{{ip:{client}}}:r:m"))
            .collect();
        let victim = 1;
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
            enforced > 10 && failed > 3,
            "{enforced} enforced, {failed} on the dead node"
        );
    }
}
