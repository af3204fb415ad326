//! Load generator for the Redis store benchmark (`bench/redis_store.sh`).
//!
//! ```text
//! redis_bench script | library | function
//! redis_bench URL throughput multiplexed|pool:N CALLERS SECONDS
//! redis_bench URL latency    multiplexed|pool:N CALLERS SECONDS RATE
//! redis_bench URL spread     multiplexed|pool:N CALLERS SECONDS
//! ```
//!
//! URL is `redis://host:port`, or `cluster:redis://a,redis://b,...` for a Redis Cluster.
//!
//! `throughput`: CALLERS tasks decide back to back on one token-bucket key; prints decisions/s.
//! `spread`: the same, each caller with its own identity (so a cluster spreads them over its
//! masters).
//! `latency`: the same callers issue RATE decisions/s in all, evenly paced; prints p50/p99/max.

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate::store::Check;
use floodgate::store::{ConnectionMode, RedisStore};
use floodgate::{Limit, Store};

fn usage() -> ! {
    eprintln!(
        "usage: redis_bench URL throughput|latency multiplexed|pool:N CALLERS SECONDS [RATE]"
    );
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("script") {
        // The exact bytes of the script the store runs without functions, for SCRIPT LOAD.
        print!("{}", floodgate::store::redis::check_script_source());
        return;
    }
    if args.first().map(String::as_str) == Some("library") {
        // The function library the store loads, for FUNCTION LOAD.
        print!("{}", floodgate::store::redis::function_library().0);
        return;
    }
    if args.first().map(String::as_str) == Some("function") {
        // The name of its check function, for FCALL.
        print!("{}", floodgate::store::redis::function_library().1);
        return;
    }
    if args.len() < 5 {
        usage();
    }
    let mode = match args[2].as_str() {
        "multiplexed" => ConnectionMode::Multiplexed,
        pool => match pool
            .strip_prefix("pool:")
            .and_then(|size| size.parse().ok())
        {
            Some(size) => ConnectionMode::Pool(size),
            None => usage(),
        },
    };
    let callers: usize = args[3].parse().unwrap_or_else(|_| usage());
    let seconds: u64 = args[4].parse().unwrap_or_else(|_| usage());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let builder = match args[0].strip_prefix("cluster:") {
            Some(nodes) => RedisStore::cluster(nodes.split(',').map(str::to_owned).collect()),
            None => RedisStore::builder(args[0].clone()),
        };
        let store = builder
            .connection_mode(mode)
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        // Never denies: the admitted path, which writes, is measured.
        let limit =
            Arc::new(Limit::token_bucket("bench", 1_000_000_000, Duration::from_secs(1)).unwrap());
        let checks: Arc<[Check]> =
            Arc::new([Check::new("fg:{ip:bench}:r:bench", limit.clone(), 1)]);
        store
            .check_and_consume(&checks, None)
            .await
            .expect("redis is up");
        let duration = Duration::from_secs(seconds);
        match args[1].as_str() {
            "throughput" => throughput(store, |_| checks.clone(), callers, duration).await,
            "spread" => {
                let per_caller = |caller: usize| -> Arc<[Check]> {
                    let key = format!("fg:{{ip:bench-{caller}}}:r:bench");
                    Arc::new([Check::new(key, limit.clone(), 1)])
                };
                throughput(store, per_caller, callers, duration).await
            }
            "latency" => {
                let rate: f64 = args
                    .get(5)
                    .and_then(|rate| rate.parse().ok())
                    .unwrap_or_else(|| usage());
                latency(store, checks, callers, duration, rate).await
            }
            _ => usage(),
        }
    });
}

async fn throughput(
    store: RedisStore,
    checks_of: impl Fn(usize) -> Arc<[Check]>,
    callers: usize,
    duration: Duration,
) {
    let started = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let (store, checks) = (store.clone(), checks_of(caller));
            tokio::spawn(async move {
                let mut decisions = 0u64;
                while started.elapsed() < duration {
                    store
                        .check_and_consume(&checks, None)
                        .await
                        .expect("decision");
                    decisions += 1;
                }
                decisions
            })
        })
        .collect();
    let mut decisions = 0;
    for task in tasks {
        decisions += task.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "{:.0} decisions/s ({decisions} in {elapsed:.1}s, {callers} callers)",
        decisions as f64 / elapsed
    );
}

async fn latency(
    store: RedisStore,
    checks: Arc<[Check]>,
    callers: usize,
    duration: Duration,
    rate: f64,
) {
    let per_caller = Duration::from_secs_f64(callers as f64 / rate);
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let (store, checks) = (store.clone(), checks.clone());
            tokio::spawn(async move {
                // Stagger the callers across one period so the load is even.
                tokio::time::sleep(per_caller.mul_f64(caller as f64 / callers as f64)).await;
                let mut ticks = tokio::time::interval(per_caller);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                let started = Instant::now();
                let mut latencies = Vec::new();
                while started.elapsed() < duration {
                    ticks.tick().await;
                    let call = Instant::now();
                    store
                        .check_and_consume(&checks, None)
                        .await
                        .expect("decision");
                    latencies.push(call.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    latencies.sort_unstable();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    println!(
        "{} decisions at {rate:.0}/s target: p50 {:?} p99 {:?} max {:?}",
        latencies.len(),
        at(0.50),
        at(0.99),
        latencies[latencies.len() - 1]
    );
}
