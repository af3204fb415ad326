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
        ServedStore { server, store }
    }

    crate::conformance_suite!(fresh_store());
}
