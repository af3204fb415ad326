//! `Store::persistence`: whether a store keeps its counters across its own restart, asked of
//! real Redis servers with and without persistence, a sharded store over them, a Redis that
//! refuses `CONFIG`, and the memory store.

use floodgate_test_support as support;

use std::time::Duration;

use floodgate::store::{RedisStore, ShardedRedisStore};
use floodgate::{MemoryStore, Store};
use support::RedisServer;

fn store(server: &RedisServer) -> RedisStore {
    RedisStore::builder(server.url())
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn server_with(options: &'static [&'static str]) -> RedisServer {
    RedisServer::start_with(|_| options.iter().map(|option| option.to_string()).collect())
}

#[tokio::test]
async fn each_store_says_whether_a_restart_keeps_its_counters() {
    let volatile = RedisServer::start();
    let append_only = server_with(&["--appendonly", "yes"]);
    let snapshots = server_with(&["--save", "60 1000"]);
    let no_config = server_with(&["--rename-command", "CONFIG", ""]);

    assert_eq!(store(&volatile).persistence().await, Some(false));
    assert_eq!(store(&append_only).persistence().await, Some(true));
    assert_eq!(store(&snapshots).persistence().await, Some(true));
    assert_eq!(
        store(&no_config).persistence().await,
        None,
        "a Redis that refuses CONFIG cannot tell"
    );
    assert_eq!(MemoryStore::new().persistence().await, Some(false));

    let sharded = |servers: [&RedisServer; 2]| {
        let nodes = servers.map(|server| (server.url(), store(server)));
        ShardedRedisStore::new(nodes.into_iter().collect()).unwrap()
    };
    assert_eq!(
        sharded([&append_only, &snapshots]).persistence().await,
        Some(true)
    );
    assert_eq!(
        sharded([&append_only, &volatile]).persistence().await,
        Some(false),
        "one node that forgets loses its part of the counters"
    );
    assert_eq!(
        sharded([&append_only, &no_config]).persistence().await,
        None
    );
}
