//! The store a configuration asks for (`store:` in SPEC §5): memory, Redis in its deployments,
//! batched or with batched global ceilings; and whether a reload may keep the one in service.

use std::sync::Arc;
use std::time::Duration;

use floodgate::overrides::Overrides;
use floodgate::store::batched::SyncTarget;
use floodgate::store::quota::QuotaBoard;
use floodgate::store::region::RegionalStore;
use floodgate::store::{
    BatchedStore, Check, ConnectionMode, HotIdentities, RedisStore, RedisStoreBuilder,
    ShardedRedisStore, SplitStore,
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

/// The Redis a store's settings name, in its deployment.
enum SharedRedis {
    /// One server, a cluster, or a Sentinel's master.
    One(RedisStore),
    /// Servers each holding the keys placed on it.
    Sharded(ShardedRedisStore),
}

/// The Redis of `settings` (none for the memory store), its connections not yet made.
fn shared_redis(settings: &StoreSettings) -> Result<Option<SharedRedis>, StoreError> {
    let one = |builder, pool_size: &Option<usize>| {
        tuned(settings, builder, *pool_size).map(|store| Some(SharedRedis::One(store)))
    };
    match &settings.backend {
        Backend::Memory => Ok(None),
        Backend::Redis { url, pool_size } => one(RedisStore::builder(url.clone()), pool_size),
        Backend::RedisCluster { nodes, pool_size } => {
            one(RedisStore::cluster(nodes.clone()), pool_size)
        }
        Backend::RedisSentinel {
            master,
            sentinels,
            pool_size,
        } => one(
            RedisStore::sentinel(master.clone(), sentinels.clone()),
            pool_size,
        ),
        Backend::RedisSharded { nodes, pool_size } => {
            let nodes = nodes
                .iter()
                .map(|url| {
                    let node = tuned(settings, RedisStore::builder(url.clone()), *pool_size)?;
                    Ok((url.clone(), node))
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            Ok(Some(SharedRedis::Sharded(ShardedRedisStore::new(nodes)?)))
        }
    }
}

/// The shared store, as both an exact store and a target for batched sync.
fn shared_store(settings: &StoreSettings) -> Result<Option<Arc<dyn SyncTarget>>, StoreError> {
    Ok(shared_redis(settings)?.map(|redis| -> Arc<dyn SyncTarget> {
        match redis {
            SharedRedis::One(store) => Arc::new(store),
            SharedRedis::Sharded(store) => Arc::new(store),
        }
    }))
}

/// Where the quota service shares its limits among servers (SPEC §10a): in memory for one
/// server, else on the store's Redis in any deployment, with connections of its own.
pub(crate) fn quota_board(settings: &StoreSettings) -> Result<QuotaBoard, StoreError> {
    Ok(match shared_redis(settings)? {
        None => QuotaBoard::memory(),
        Some(SharedRedis::One(store)) => QuotaBoard::on_redis(store),
        Some(SharedRedis::Sharded(store)) => QuotaBoard::on_shards(store),
    })
}

/// Whether a store built from `new` would be the one built from `current`: then the reload keeps
/// it, and its counters. The memory store is built from nothing but its backend (and the
/// prefix its overrides are kept under); `fallback_share` is the layer's, not the store's.
pub(crate) fn builds_the_same_store(current: &StoreSettings, new: &StoreSettings) -> bool {
    match (&current.backend, &new.backend) {
        (Backend::Memory, Backend::Memory) => current.prefix == new.prefix,
        _ => {
            current.backend == new.backend
                && current.prefix == new.prefix
                && current.timeout == new.timeout
                && current.breaker_failures == new.breaker_failures
                && current.breaker_open_for == new.breaker_open_for
                && current.sync_interval == new.sync_interval
                && current.global_sync_interval == new.global_sync_interval
                && current.max_keys == new.max_keys
                && current.deny_cache == new.deny_cache
                && current.coalesce == new.coalesce
                && current.hot_identities == new.hot_identities
                && current.region == new.region
        }
    }
}

/// A store built from `settings`, and its hot identity tracker if `store.hot_identities` is set
/// (the admin API says which identities are decided locally).
#[derive(Clone)]
pub(crate) struct BuiltStore {
    /// What decisions go to.
    pub store: Arc<dyn Store>,
    /// Which identities this node decides from leases now.
    pub hot_identities: Option<Arc<HotIdentities>>,
    /// The per-client overrides kept in this store (under the key prefix), this node's copy.
    pub overrides: Option<Arc<Overrides>>,
    /// What decisions on limits of any algorithm go to: the rate limit service's descriptors,
    /// which the configuration's checks do not see (their files load apart, and may name
    /// `sliding_window_log` or `leaky_bucket`). `store` itself, except in batched mode, where
    /// a [`SplitStore`] in front of the same batched store decides the limits that cannot run
    /// batched exactly on the shared store.
    pub for_any_algorithm: Arc<dyn Store>,
    /// With `store.region`: the region's trading, and the share in force of each key.
    pub region: Option<RegionalStore>,
}

impl BuiltStore {
    fn new(
        store: Arc<dyn Store>,
        hot_identities: Option<Arc<HotIdentities>>,
        prefix: &str,
    ) -> Self {
        let overrides = store.override_backend().map(|backend| {
            let overrides = Arc::new(Overrides::new(backend, prefix));
            // Fresh whether requests come or not (the status page, /admin/clients).
            overrides.keep_fresh();
            overrides
        });
        BuiltStore {
            for_any_algorithm: store.clone(),
            store,
            hot_identities,
            overrides,
            region: None,
        }
    }
}

/// The store `settings` describe, ready to serve (Redis connects lazily).
///
/// In exact mode, `global` ceilings and hot identities are the same mechanism: a
/// [`SplitStore`] deciding them from leases of a [`BatchedStore`], each on its own interval
/// (the ceilings outermost, so that a saturated ceiling costs nothing further).
pub(crate) fn build_store(settings: &StoreSettings) -> Result<BuiltStore, StoreError> {
    let mut built = build_regional_store(settings)?;
    if let Some(region) = &settings.region {
        // Every mode decides against the region's own store, on the region's shares.
        let regional = RegionalStore::new(built.store.clone(), region.settings.clone())?;
        built.for_any_algorithm = Arc::new(regional.sharing(built.for_any_algorithm.clone()));
        built.store = Arc::new(regional.clone());
        built.region = Some(regional);
    }
    Ok(built)
}

/// The store of one region (of the only one, without `store.region`).
fn build_regional_store(settings: &StoreSettings) -> Result<BuiltStore, StoreError> {
    let Some(shared) = shared_store(settings)? else {
        let memory = MemoryStore::builder()
            .evict_every(Duration::from_secs(10))
            .build();
        return Ok(BuiltStore::new(Arc::new(memory), None, &settings.prefix));
    };
    let batched = |interval: Duration| {
        BatchedStore::builder(shared.clone())
            .sync_interval(interval)
            .max_keys(settings.max_keys)
            .build()
    };
    if let Some(interval) = settings.sync_interval {
        let batched = batched(interval);
        // The split shares the batched store's state (its clones do): the same leases and
        // counts whichever of the two a decision goes through.
        let exact_where_needed = SplitStore::new(batched.clone(), shared.clone(), |_: &Check| true);
        let mut built = BuiltStore::new(Arc::new(batched), None, &settings.prefix);
        built.for_any_algorithm = Arc::new(exact_where_needed);
        return Ok(built);
    }
    let mut exact: Arc<dyn Store> = shared.clone();
    let hot_identities = settings
        .hot_identities
        .map(|hot| Arc::new(HotIdentities::new(hot.above_per_second, hot.interval)));
    if let (Some(tracker), Some(hot)) = (&hot_identities, settings.hot_identities) {
        exact = Arc::new(
            SplitStore::new(
                batched(hot.interval),
                exact,
                |_: &floodgate::store::Check| false,
            )
            .with_hot_identities(tracker.clone()),
        );
    }
    if let Some(interval) = settings.global_sync_interval {
        exact = Arc::new(SplitStore::new(batched(interval), exact, is_global_ceiling));
    }
    Ok(BuiltStore::new(exact, hot_identities, &settings.prefix))
}
