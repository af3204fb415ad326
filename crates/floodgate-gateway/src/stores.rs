//! The store a configuration asks for (`store:` in SPEC §5): memory, Redis in its deployments,
//! batched or with batched global ceilings; and whether a reload may keep the one in service.

use std::sync::Arc;
use std::time::Duration;

use floodgate::store::batched::SyncTarget;
use floodgate::store::{
    BatchedStore, ConnectionMode, RedisStore, RedisStoreBuilder, ShardedRedisStore, SplitStore,
};
use floodgate::{MemoryStore, Store, StoreError};

use crate::config::{Backend, StoreSettings};
use crate::plan::is_global_ceiling;

/// A Redis store with the settings' deadline and breaker, before its deployment is chosen.
fn tuned(
    settings: &StoreSettings,
    builder: RedisStoreBuilder,
    pool_size: Option<usize>,
) -> Result<RedisStore, StoreError> {
    builder
        .connection_mode(pool_size.map_or(ConnectionMode::Multiplexed, ConnectionMode::Pool))
        .timeout(settings.timeout)
        .breaker(settings.breaker_failures, settings.breaker_open_for)
        .deny_cache(settings.deny_cache)
        .coalesce(settings.coalesce)
        .build()
}

/// The shared store, as both an exact store and a target for batched sync.
fn shared_store(settings: &StoreSettings) -> Result<Option<Arc<dyn SyncTarget>>, StoreError> {
    Ok(Some(match &settings.backend {
        Backend::Memory => return Ok(None),
        Backend::Redis { url, pool_size } => Arc::new(tuned(
            settings,
            RedisStore::builder(url.clone()),
            *pool_size,
        )?),
        Backend::RedisCluster { nodes, pool_size } => Arc::new(tuned(
            settings,
            RedisStore::cluster(nodes.clone()),
            *pool_size,
        )?),
        Backend::RedisSentinel {
            master,
            sentinels,
            pool_size,
        } => Arc::new(tuned(
            settings,
            RedisStore::sentinel(master.clone(), sentinels.clone()),
            *pool_size,
        )?),
        Backend::RedisSharded { nodes, pool_size } => {
            let nodes = nodes
                .iter()
                .map(|url| {
                    let node = tuned(settings, RedisStore::builder(url.clone()), *pool_size)?;
                    Ok((url.clone(), node))
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            Arc::new(ShardedRedisStore::new(nodes)?)
        }
    }))
}

/// Whether a store built from `new` would be the one built from `current`: then the reload keeps
/// it, and its counters. The memory store is built from nothing but its backend; the prefix and
/// `fallback_share` are the layer's, not the store's.
pub fn builds_the_same_store(current: &StoreSettings, new: &StoreSettings) -> bool {
    match (&current.backend, &new.backend) {
        (Backend::Memory, Backend::Memory) => true,
        _ => {
            current.backend == new.backend
                && current.timeout == new.timeout
                && current.breaker_failures == new.breaker_failures
                && current.breaker_open_for == new.breaker_open_for
                && current.sync_interval == new.sync_interval
                && current.global_sync_interval == new.global_sync_interval
                && current.max_keys == new.max_keys
                && current.deny_cache == new.deny_cache
                && current.coalesce == new.coalesce
        }
    }
}

/// The store `settings` describe, ready to serve (Redis connects lazily).
pub fn build_store(settings: &StoreSettings) -> Result<Arc<dyn Store>, StoreError> {
    let Some(shared) = shared_store(settings)? else {
        return Ok(Arc::new(
            MemoryStore::builder()
                .evict_every(Duration::from_secs(10))
                .build(),
        ));
    };
    let batched = |interval: Duration| {
        BatchedStore::builder(shared.clone())
            .sync_interval(interval)
            .max_keys(settings.max_keys)
            .build()
    };
    Ok(
        match (settings.sync_interval, settings.global_sync_interval) {
            (Some(interval), _) => Arc::new(batched(interval)),
            (None, Some(interval)) => Arc::new(SplitStore::new(
                batched(interval),
                shared.clone() as Arc<dyn Store>,
                is_global_ceiling,
            )),
            (None, None) => shared,
        },
    )
}
