//! Many Envoys on floodgate's Rate Limit Quota Service (`bench/rlqs.sh`): `ENVOYS` emulated
//! Envoys (`floodgate_test_support::rlqs`, reporting every 5 s as Envoy does) spread over the
//! given servers, `BUCKETS` per-user buckets (`name: user, user: u<n>`), each requested by
//! `PER_BUCKET` Envoys: one of them at five times the others' rate, together twice the
//! bucket's limit. Prints one JSON line: the worst 10 s window of any bucket against
//! `limit × 10 × 1.02 + burst`, and how many (Envoy, bucket) pairs got at least 90 % of
//! min(their demand, their max-min fair share) over the last half of the run, and what every
//! bucket admitted per second after the first 10 s against its limit.
//!
//! With `MODE` `rls`, the same demand goes through the rate limit service instead: every
//! request is a `ShouldRateLimit` call (domain `bench`, descriptor `user: u<n>`) to the
//! server the Envoy would have reported to, deciding the same limit there: the RLS deployment
//! of the same rules, for the comparison of what each admits.
//!
//!   rlqs_bench SERVERS(comma-separated) SECONDS ENVOYS BUCKETS PER_BUCKET LIMIT BURST [MODE]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use floodgate_test_support::rlqs::{Bucket, Envoy, EnvoySettings, bucket};
use tokio::time::Instant;
use tonic::transport::Channel;

/// How often each Envoy offers its requests.
const STEP: Duration = Duration::from_millis(50);

struct Args {
    servers: Vec<SocketAddr>,
    seconds: u64,
    envoys: usize,
    buckets: usize,
    per_bucket: usize,
    limit: f64,
    burst: f64,
    /// Through the rate limit service (one call per request) instead of the quota service.
    rls: bool,
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let number = |index: usize| -> f64 {
        argv.get(index)
            .and_then(|text| text.parse().ok())
            .unwrap_or_else(|| panic!("argument {index} must be a number: see the file's doc"))
    };
    Args {
        servers: argv[1]
            .split(',')
            .map(|address| address.parse().expect("an address"))
            .collect(),
        seconds: number(2) as u64,
        envoys: number(3) as usize,
        buckets: number(4) as usize,
        per_bucket: number(5) as usize,
        limit: number(6),
        burst: number(7),
        rls: match argv.get(8).map(String::as_str) {
            None | Some("rlqs") => false,
            Some("rls") => true,
            Some(other) => panic!("MODE is rlqs or rls, not {other}"),
        },
    }
}

/// One (Envoy, bucket) pair's offered rate.
struct Demand {
    envoy: usize,
    bucket: usize,
    per_second: f64,
}

/// Each bucket's Envoys (consecutive, wrapping) and their rates: the first at 5× the others,
/// together twice the limit.
fn demands(args: &Args) -> Vec<Demand> {
    let shares = 5.0 + (args.per_bucket - 1) as f64;
    let unit = 2.0 * args.limit / shares;
    let mut demands = Vec::new();
    for bucket in 0..args.buckets {
        for k in 0..args.per_bucket {
            demands.push(Demand {
                envoy: (bucket * 7 + k) % args.envoys,
                bucket,
                per_second: if k == 0 { 5.0 * unit } else { unit },
            });
        }
    }
    demands
}

/// The max-min fair share of each demand of one bucket, of what the holders share (the limit
/// less the newcomer's twenty-fifth).
fn fair_shares(wants: &[f64], shared: f64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by(|a, b| wants[*a].total_cmp(&wants[*b]));
    let mut left = shared;
    let mut shares = vec![0.0; wants.len()];
    for (position, index) in order.iter().enumerate() {
        let even = left / (wants.len() - position) as f64;
        shares[*index] = wants[*index].min(even);
        left -= shares[*index];
    }
    shares
}

/// Who decides one Envoy's requests: its quota service assignments, or the rate limit service.
#[derive(Clone)]
enum Decider {
    Quota(Arc<Envoy>),
    Service(RateLimitServiceClient<Channel>),
}

impl Decider {
    /// Whether a request of `user`'s bucket is admitted.
    async fn admits(&mut self, bucket: &Bucket, user: &str) -> bool {
        match self {
            Decider::Quota(envoy) => envoy.request(bucket),
            Decider::Service(client) => {
                let request = RateLimitRequest {
                    domain: "bench".to_owned(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: vec![Entry {
                            key: "user".to_owned(),
                            value: user.to_owned(),
                        }],
                        ..RateLimitDescriptor::default()
                    }],
                    hits_addend: 0,
                };
                client
                    .should_rate_limit(request)
                    .await
                    .is_ok_and(|answer| answer.into_inner().overall_code == Code::Ok as i32)
            }
        }
    }
}

/// Offers one Envoy's demands for the run; returns, per demand index, when each admitted
/// request was (ms from start).
async fn offer(
    mut decider: Decider,
    mine: Vec<(usize, Bucket, String, f64)>,
    start: Instant,
    run: Duration,
) -> Vec<(usize, Vec<u32>)> {
    let mut owed = vec![0.0; mine.len()];
    let mut admitted: Vec<Vec<u32>> = vec![Vec::new(); mine.len()];
    let mut ticks = tokio::time::interval_at(start, STEP);
    loop {
        let now = ticks.tick().await;
        let at = now.duration_since(start);
        if at >= run {
            break;
        }
        for (slot, (_, bucket, user, per_second)) in mine.iter().enumerate() {
            owed[slot] += per_second * STEP.as_secs_f64();
            while owed[slot] >= 1.0 {
                owed[slot] -= 1.0;
                if decider.admits(bucket, user).await {
                    admitted[slot].push(at.as_millis() as u32);
                }
            }
        }
    }
    mine.iter()
        .map(|(index, _, _, _)| *index)
        .zip(admitted)
        .collect()
}

#[tokio::main]
async fn main() {
    let args = args();
    let demands = demands(&args);
    let mut envoys = Vec::new();
    let mut deciders = Vec::new();
    for index in 0..args.envoys {
        let server = args.servers[index % args.servers.len()];
        if args.rls {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{server}"))
                .expect("an address")
                .connect()
                .await
                .expect("the rate limit service answers");
            deciders.push(Decider::Service(RateLimitServiceClient::new(channel)));
        } else {
            let envoy = Arc::new(Envoy::start(EnvoySettings::new("bench", vec![server])).await);
            deciders.push(Decider::Quota(envoy.clone()));
            envoys.push(envoy);
        }
    }
    let start = Instant::now() + Duration::from_millis(200);
    let run = Duration::from_secs(args.seconds);
    let mut tasks = Vec::new();
    for (index, decider) in deciders.iter().enumerate() {
        let mine = demands
            .iter()
            .enumerate()
            .filter(|(_, demand)| demand.envoy == index)
            .map(|(at, demand)| {
                let name = format!("u{}", demand.bucket);
                (
                    at,
                    bucket(&[("name", "user"), ("user", &name)]),
                    name,
                    demand.per_second,
                )
            })
            .collect();
        tasks.push(tokio::spawn(offer(decider.clone(), mine, start, run)));
    }
    let mut admitted: HashMap<usize, Vec<u32>> = HashMap::new();
    for task in tasks {
        admitted.extend(task.await.expect("an Envoy's traffic"));
    }
    report(&args, &demands, &admitted, &envoys);
}

fn report(
    args: &Args,
    demands: &[Demand],
    admitted: &HashMap<usize, Vec<u32>>,
    envoys: &[Arc<Envoy>],
) {
    let run_ms = args.seconds as u32 * 1000;
    // The worst 10 s window of any bucket, after the first two report intervals (10 s).
    let bound = args.limit * 10.0 * 1.02 + args.burst;
    let mut worst = 0usize;
    let mut over = 0usize;
    for bucket in 0..args.buckets {
        let mut times: Vec<u32> = demands
            .iter()
            .enumerate()
            .filter(|(_, demand)| demand.bucket == bucket)
            .flat_map(|(index, _)| admitted[&index].iter().copied())
            .filter(|at| *at >= 10_000)
            .collect();
        times.sort_unstable();
        let mut bucket_worst = 0;
        let mut first = 0;
        for last in 0..times.len() {
            while times[last] - times[first] >= 10_000 {
                first += 1;
            }
            bucket_worst = bucket_worst.max(last - first + 1);
        }
        worst = worst.max(bucket_worst);
        over += usize::from(bucket_worst as f64 > bound);
    }
    // Fairness over the second half.
    let half_ms = run_ms / 2;
    let seconds = f64::from(run_ms - half_ms) / 1000.0;
    let shared = args.limit * 24.0 / 25.0;
    let mut fair_pairs = 0;
    let mut pairs = 0;
    let mut least = f64::MAX;
    for bucket in 0..args.buckets {
        let mine: Vec<usize> = (0..demands.len())
            .filter(|index| demands[*index].bucket == bucket)
            .collect();
        let wants: Vec<f64> = mine
            .iter()
            .map(|index| demands[*index].per_second)
            .collect();
        let fair = fair_shares(&wants, shared);
        for (slot, index) in mine.iter().enumerate() {
            let got = admitted[index].iter().filter(|at| **at >= half_ms).count() as f64 / seconds;
            let ratio = got / fair[slot];
            least = least.min(ratio);
            pairs += 1;
            fair_pairs += usize::from(ratio >= 0.9);
        }
    }
    let violations: usize = envoys.iter().map(|envoy| envoy.violations().len()).sum();
    // What a bucket admitted per second once the first two report intervals are over.
    let steady: usize = admitted
        .values()
        .map(|times| times.iter().filter(|at| **at >= 10_000).count())
        .sum();
    let per_bucket_second =
        steady as f64 / args.buckets as f64 / (f64::from(run_ms) / 1000.0 - 10.0);
    println!(
        "{{\"mode\": \"{}\", \"envoys\": {}, \"buckets\": {}, \"seconds\": {}, \"worst_10s_window\": {worst}, \"bound\": {bound:.0}, \"buckets_over_bound\": {over}, \"pairs_at_90pct_of_fair\": {fair_pairs}, \"pairs\": {pairs}, \"least_ratio_to_fair\": {least:.3}, \"admitted_per_bucket_second_after_10s\": {per_bucket_second:.3}, \"of_limit\": {:.3}, \"wire_violations\": {violations}}}",
        if args.rls { "rls" } else { "rlqs" },
        args.envoys,
        args.buckets,
        args.seconds,
        per_bucket_second / args.limit,
    );
}
