//! Regions on one machine: a `redis-server` per region and one global, gateways per region
//! (each a [`RegionalStore`] with its own connections and its own rounds, as separate
//! processes would have), and a [`FaultProxy`] between each region and the global store, so
//! that a test can give the ocean its round trip or cut a region off. Traffic is driven per
//! region in real time; the report says what each region admitted, when, how fast it
//! answered and which share it held.
//!
//! Fixed shares (`store.share`, the design notes' partition) run on the same setup and the
//! same load (fresh servers for each run) for comparison ([`Mode::Fixed`]): each region
//! decides under `limit / regions` against its own Redis and never talks to the global store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate::store::region::{RegionSettings, RegionalStore, TradeResult};
use floodgate::store::{BatchedStore, RedisStore, ShardedRedisStore, StoreError};
use floodgate::{Limit, Store, store::Check};

use crate::RedisServer;
use crate::cluster::RedisCluster;
use crate::faults::FaultProxy;

/// How the regions share the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Shares traded through the global store, every gateway exact against its region's store.
    Traded,
    /// Shares traded through the global store, every gateway batched in its region (leasing
    /// from its region's store on this interval).
    TradedBatched(Duration),
    /// Shares traded through the global store, every gateway exact against two Redis servers
    /// of its region sharded by key (`store.mode: sharded`); the table on the first.
    TradedSharded,
    /// Shares traded through the global store, every gateway exact against a Redis Cluster
    /// of three masters in its region (`backend: redis_cluster`); the table on the region's
    /// own server (`store.region.local`).
    TradedCluster,
    /// Each region its fixed share, no global store.
    Fixed,
}

/// The width of a report's time buckets.
pub const BUCKET: Duration = Duration::from_millis(100);

/// One region's part of a run.
#[derive(Clone, Debug, Default)]
pub struct RegionReport {
    /// Requests sent.
    pub sent: u64,
    /// Requests admitted.
    pub admitted: u64,
    /// Decisions that failed (a store error).
    pub errors: u64,
    /// Admitted per [`BUCKET`] since the run's start.
    pub admitted_per_bucket: Vec<u64>,
    /// Each decision's latency, sorted.
    pub latencies: Vec<Duration>,
    /// The share in force on the region's first gateway at the end of each [`BUCKET`].
    pub share_per_bucket: Vec<u64>,
    /// Trades with the global store during the run, all gateways and results.
    pub trades: u64,
    /// Admitted per second of the wall clock (seconds since the epoch, as the answer came:
    /// the windows of a window algorithm on one second).
    pub admitted_per_epoch_second: std::collections::BTreeMap<u64, u64>,
}

impl RegionReport {
    /// The `q` quantile of the latencies (0 to 1).
    pub fn latency(&self, q: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let index = ((self.latencies.len() - 1) as f64 * q).round() as usize;
        self.latencies[index]
    }

    /// Admitted between `from` and `to` (from the run's start; whole buckets).
    pub fn admitted_between(&self, from: Duration, to: Duration) -> u64 {
        let first = (from.as_millis() / BUCKET.as_millis()) as usize;
        let last = (to.as_millis() / BUCKET.as_millis()) as usize;
        self.admitted_per_bucket.iter().take(last).skip(first).sum()
    }
}

/// What a run admitted, region by region.
#[derive(Clone, Debug)]
pub struct Report {
    /// Per region, in order.
    pub regions: Vec<RegionReport>,
    /// How long the run lasted.
    pub elapsed: Duration,
    /// The limit's allowance over the run: its capacity plus its refill while it lasted.
    pub allowance: f64,
}

impl Report {
    /// Admitted by every region.
    pub fn admitted(&self) -> u64 {
        self.regions.iter().map(|region| region.admitted).sum()
    }

    /// Admitted by every region between `from` and `to`.
    pub fn admitted_between(&self, from: Duration, to: Duration) -> u64 {
        self.regions
            .iter()
            .map(|region| region.admitted_between(from, to))
            .sum()
    }

    /// Admitted by every region in each second of the wall clock.
    pub fn admitted_per_epoch_second(&self) -> std::collections::BTreeMap<u64, u64> {
        let mut total = std::collections::BTreeMap::new();
        for region in &self.regions {
            for (second, admitted) in &region.admitted_per_epoch_second {
                *total.entry(*second).or_default() += admitted;
            }
        }
        total
    }

    /// Store errors in every region.
    pub fn errors(&self) -> u64 {
        self.regions.iter().map(|region| region.errors).sum()
    }
}

/// A snapshot of the global store ([`Regions::snapshot_global`]); its file is removed when
/// this is dropped.
pub struct GlobalSnapshot {
    file: String,
    path: std::path::PathBuf,
}

impl Drop for GlobalSnapshot {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The regions, their stores and the links between them. See the [module docs](self).
pub struct Regions {
    /// The global store (behind every region's link).
    pub global: RedisServer,
    /// Each region's link to the global store.
    pub links: Vec<FaultProxy>,
    /// Each region's own store.
    pub stores: Vec<RedisServer>,
    /// Each region's gateways.
    pub gateways: Vec<Vec<Arc<RegionalStore>>>,
    /// Each region's name.
    pub names: Vec<String>,
    /// The rounds' interval.
    pub interval: Duration,
    /// Each region's second server ([`Mode::TradedSharded`]), or none.
    pub second_shards: Vec<RedisServer>,
    /// Each region's cluster ([`Mode::TradedCluster`]), or none.
    pub clusters: Vec<RedisCluster>,
    mode: Mode,
}

/// The region names: `r0`, `r1`, ...
fn names(count: usize) -> Vec<String> {
    (0..count).map(|index| format!("r{index}")).collect()
}

impl Regions {
    /// `regions` regions of `gateways` gateways each, syncing every `interval`. Call from
    /// inside a Tokio runtime.
    pub fn start(mode: Mode, regions: usize, gateways: usize, interval: Duration) -> Regions {
        let global = RedisServer::start();
        let links: Vec<FaultProxy> = (0..regions)
            .map(|_| FaultProxy::start(global.port()))
            .collect();
        let stores: Vec<RedisServer> = (0..regions).map(|_| RedisServer::start()).collect();
        let second_shards = match mode {
            Mode::TradedSharded => (0..regions).map(|_| RedisServer::start()).collect(),
            _ => Vec::new(),
        };
        let clusters = match mode {
            Mode::TradedCluster => (0..regions).map(|_| RedisCluster::start(3)).collect(),
            _ => Vec::new(),
        };
        let mut set = Regions {
            global,
            links,
            stores,
            gateways: Vec::new(),
            names: names(regions),
            interval,
            second_shards,
            clusters,
            mode,
        };
        // Fixed shares decide against each region's store directly: no gateway trades.
        let gateways = if mode == Mode::Fixed { 0 } else { gateways };
        set.gateways = (0..regions)
            .map(|region| {
                (0..gateways)
                    .map(|_| Arc::new(set.gateway(region, &set.names)))
                    .collect()
            })
            .collect();
        set
    }

    /// The settings of a gateway of `region` among `regions`.
    pub fn settings(&self, region: usize, regions: &[String]) -> RegionSettings {
        RegionSettings::new(
            self.names[region].clone(),
            regions.to_vec(),
            self.links[region].url(),
            self.stores[region].url(),
            self.interval,
        )
    }

    /// A new gateway of `region` (not added to the set).
    pub fn gateway(&self, region: usize, regions: &[String]) -> RegionalStore {
        let store = |url: String| {
            RedisStore::builder(url)
                .timeout(Duration::from_secs(2))
                .build()
                .expect("a Redis store")
        };
        let inner: Arc<dyn Store> = match self.mode {
            Mode::TradedBatched(interval) => Arc::new(
                BatchedStore::builder(store(self.stores[region].url()))
                    .sync_interval(interval)
                    .build(),
            ),
            Mode::TradedSharded => {
                let nodes = [&self.stores[region], &self.second_shards[region]]
                    .map(|server| (server.url(), store(server.url())));
                Arc::new(ShardedRedisStore::new(nodes.into()).expect("a sharded store"))
            }
            Mode::TradedCluster => Arc::new(
                RedisStore::cluster(self.clusters[region].urls())
                    .timeout(Duration::from_secs(2))
                    .build()
                    .expect("a cluster store"),
            ),
            Mode::Traded | Mode::Fixed => Arc::new(store(self.stores[region].url())),
        };
        RegionalStore::new(inner, self.settings(region, regions)).expect("a region")
    }

    /// Replaces every gateway of `region` with a new one (a region restarting; its store
    /// keeps the table).
    pub fn restart_region(&mut self, region: usize) {
        let count = self.gateways[region].len();
        let names = self.names.clone();
        self.gateways[region].clear();
        self.gateways[region] = (0..count)
            .map(|_| Arc::new(self.gateway(region, &names)))
            .collect();
    }

    /// Replaces every gateway with one that counts `regions` regions (a reload that adds a
    /// region); the new regions need servers and links: `add_region` first.
    pub fn reload_with(&mut self, regions: &[String]) {
        for region in 0..self.gateways.len() {
            let count = self.gateways[region].len();
            self.gateways[region] = (0..count)
                .map(|_| Arc::new(self.gateway(region, regions)))
                .collect();
        }
    }

    /// Adds a region of `gateways` gateways that counts `regions` (its name the next `rN`).
    pub fn add_region(&mut self, gateways: usize, regions: &[String]) {
        let index = self.names.len();
        self.links.push(FaultProxy::start(self.global.port()));
        self.stores.push(RedisServer::start());
        match self.mode {
            Mode::TradedSharded => self.second_shards.push(RedisServer::start()),
            Mode::TradedCluster => self.clusters.push(RedisCluster::start(3)),
            _ => {}
        }
        self.names.push(format!("r{index}"));
        let added = (0..gateways)
            .map(|_| Arc::new(self.gateway(index, regions)))
            .collect();
        self.gateways.push(added);
    }

    /// Kills the global store and starts an empty one on its port.
    pub fn restart_global_empty(&mut self) {
        let port = self.global.port();
        self.global.kill();
        self.global = RedisServer::start_on(port).expect("the global store restarts");
    }

    /// Takes a snapshot of the global store now (Redis's own RDB, by `SAVE`), for
    /// [`Regions::restart_global_from`].
    pub fn snapshot_global(&self) -> GlobalSnapshot {
        let file = crate::unique_temp_path("global-snapshot")
            .file_name()
            .and_then(|name| name.to_str())
            .map(|name| format!("{name}.rdb"))
            .expect("a file name");
        let _: () = self.global.command(&["SAVE"]);
        let dir: Vec<String> = self.global.command(&["CONFIG", "GET", "dir"]);
        let dir = std::path::Path::new(&dir[1]);
        // Moved aside (`dbfilename` cannot be set at run time): a later restart of a server on
        // this port must not load it.
        let path = dir.join(&file);
        std::fs::rename(dir.join("dump.rdb"), &path).expect("the snapshot moved aside");
        GlobalSnapshot { path, file }
    }

    /// Kills the global store and starts it again on its port from `snapshot`: what it held
    /// then and nothing since, as after a restart from an older RDB, an append-only file that
    /// lost its tail, or a failover to a replica that was behind.
    pub fn restart_global_from(&mut self, snapshot: &GlobalSnapshot) {
        let port = self.global.port();
        self.global.kill();
        let options = ["--dbfilename".to_owned(), snapshot.file.clone()];
        self.global = RedisServer::spawn(port, &options).expect("the global store restarts");
    }

    fn trades(&self, region: usize) -> u64 {
        self.gateways[region]
            .iter()
            .map(|gateway| {
                let status = gateway.status();
                [TradeResult::Ok, TradeResult::Failed, TradeResult::Stale]
                    .into_iter()
                    .map(|result| status.trades(result))
                    .sum::<u64>()
            })
            .sum()
    }

    /// The storage key [`Regions::run`] decides `limit` of `client` on.
    pub fn key(limit: &Limit, client: &str) -> Arc<str> {
        format!("fgregion:{{user:{client}}}:plan:{}", limit.name()).into()
    }

    /// Drives `rate(region, since_start)` requests a second into each region for `duration`
    /// against `limit` on one client's key, round-robin over the region's gateways (a test
    /// that cuts links or restarts things mid-run joins this with its own task).
    pub async fn run(
        &self,
        limit: &Arc<Limit>,
        client: &str,
        duration: Duration,
        rate: impl Fn(usize, Duration) -> f64 + Send + Sync + 'static,
    ) -> Report {
        let key = Self::key(limit, client);
        // As a gateway does before it serves: every one's table in force.
        for gateway in self.gateways.iter().flatten() {
            gateway.probe().await.expect("the region's table loads");
        }
        let started = Instant::now();
        let rate = Arc::new(rate);
        // The buckets of the run and no more: a last round that ends past `duration` (it may or
        // may not, by a few milliseconds) writes into no bucket, rather than into a bucket of
        // its own left empty when it does not.
        let buckets = duration.as_millis().div_ceil(BUCKET.as_millis()) as usize;
        let trades_before: Vec<u64> = (0..self.gateways.len()).map(|r| self.trades(r)).collect();
        let mut tasks = Vec::new();
        for region in 0..self.gateways.len() {
            let load = self.load_of(region, &key, limit);
            let rate = rate.clone();
            tasks.push(tokio::spawn(async move {
                load.drive(started, duration, buckets, rate).await
            }));
        }
        let mut regions = Vec::new();
        for task in tasks {
            regions.push(task.await.expect("a region's load"));
        }
        let elapsed = started.elapsed();
        for (region, report) in regions.iter_mut().enumerate() {
            report.trades = self.trades(region) - trades_before[region];
        }
        let rate = limit.limit() as f64 / limit.window().as_secs_f64();
        Report {
            regions,
            elapsed,
            allowance: limit.capacity() as f64 + rate * elapsed.as_secs_f64(),
        }
    }

    /// What `region`'s task in [`Regions::run`] decides with: its gateways, or in
    /// [`Mode::Fixed`] its own store and a fixed share of `limit`.
    fn load_of(&self, region: usize, key: &Arc<str>, limit: &Arc<Limit>) -> RegionLoad {
        let fixed = Arc::new(limit.with_share(limit.limit() / self.names.len() as u64));
        let direct: Option<RedisStore> = (self.mode == Mode::Fixed).then(|| {
            RedisStore::builder(self.stores[region].url())
                .timeout(Duration::from_secs(2))
                .build()
                .expect("a Redis store")
        });
        RegionLoad {
            region,
            gateways: self.gateways[region].clone(),
            direct,
            key: key.clone(),
            limit: limit.clone(),
            fixed,
            next_gateway: 0,
        }
    }
}

/// One region's part of [`Regions::run`], moved into its task.
struct RegionLoad {
    region: usize,
    gateways: Vec<Arc<RegionalStore>>,
    /// In [`Mode::Fixed`], the region's own store, decided on directly against `fixed`.
    direct: Option<RedisStore>,
    key: Arc<str>,
    limit: Arc<Limit>,
    /// The region's fixed share of `limit` ([`Mode::Fixed`]).
    fixed: Arc<Limit>,
    /// The gateway the next decision goes to (round-robin).
    next_gateway: usize,
}

impl RegionLoad {
    /// Sends `rate(region, since_start)` requests a second from `started` until `duration` has
    /// passed, ticking every 5 ms, and reports them in `buckets` buckets.
    async fn drive(
        mut self,
        started: Instant,
        duration: Duration,
        buckets: usize,
        rate: Arc<impl Fn(usize, Duration) -> f64>,
    ) -> RegionReport {
        let mut report = RegionReport {
            admitted_per_bucket: vec![0; buckets],
            share_per_bucket: vec![0; buckets],
            ..RegionReport::default()
        };
        let mut ticks = tokio::time::interval(Duration::from_millis(5));
        let mut owed = 0.0;
        let mut last = started;
        while started.elapsed() < duration {
            ticks.tick().await;
            let now = Instant::now();
            let since = now - started;
            owed += rate(self.region, since) * (now - last).as_secs_f64();
            last = now;
            while owed >= 1.0 {
                owed -= 1.0;
                let asked = Instant::now();
                let result = self.decide_one().await;
                report.latencies.push(asked.elapsed());
                report.count(since, result);
            }
            let bucket = (since.as_millis() / BUCKET.as_millis()) as usize;
            if let Some(share) = report.share_per_bucket.get_mut(bucket) {
                *share = match &self.direct {
                    Some(_) => self.fixed.limit(),
                    None => self.gateways[0].share_of(&self.key, &self.limit).units,
                };
            }
        }
        report.latencies.sort();
        report
    }

    /// One request's decision: whether it was admitted.
    async fn decide_one(&mut self) -> Result<bool, StoreError> {
        let decision = match &self.direct {
            Some(store) => {
                let checks = [Check::new(self.key.clone(), self.fixed.clone(), 1)];
                store.check_and_consume(&checks, None).await
            }
            None => {
                let checks = [Check::new(self.key.clone(), self.limit.clone(), 1)];
                let gateway = &self.gateways[self.next_gateway % self.gateways.len()];
                self.next_gateway += 1;
                gateway.check_and_consume(&checks, None).await
            }
        };
        decision.map(|decision| decision.is_allowed())
    }
}

impl RegionReport {
    /// Counts one request sent `since` the run's start, which `result` says was admitted,
    /// denied, or failed.
    fn count(&mut self, since: Duration, result: Result<bool, StoreError>) {
        self.sent += 1;
        let bucket = (since.as_millis() / BUCKET.as_millis()) as usize;
        match result {
            Ok(true) => {
                self.admitted += 1;
                let second = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |since| since.as_secs());
                *self.admitted_per_epoch_second.entry(second).or_default() += 1;
                if let Some(count) = self.admitted_per_bucket.get_mut(bucket) {
                    *count += 1;
                }
            }
            Ok(false) => {}
            Err(_) => self.errors += 1,
        }
    }
}
