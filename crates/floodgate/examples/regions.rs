//! The regions simulation of `bench/regions.sh`: three regions in one process, each with its
//! own redis-server and gateways, a global redis-server behind a fault-injecting proxy per
//! region (50 ms each way: a 100 ms round trip), the issue's traffic shapes against a token bucket of 300/s
//! (burst 300), traded shares beside fixed ones (`store.share`) on the same setup and load (fresh servers for each run).
//!
//! `regions [SECONDS] [GATEWAYS PER REGION]` (default 10 s, 2 gateways)

use std::sync::Arc;
use std::time::Duration;

use floodgate::{Algorithm, Limit};
use floodgate_test_support::faults::Fault;
use floodgate_test_support::regions::{Mode, Regions, Report};

/// Each way between a region and the global store: a round trip of 100 ms.
const ONE_WAY: Duration = Duration::from_millis(50);
const INTERVAL: Duration = Duration::from_secs(1);
const RATE: f64 = 300.0;

#[derive(Clone, Copy, Debug)]
enum Shape {
    Concentrated,
    Spread,
    Moving,
    Partition,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Concentrated => "concentrated",
            Shape::Spread => "spread",
            Shape::Moving => "moving",
            Shape::Partition => "partition",
        }
    }
}

fn print(shape: Shape, mode: Mode, report: &Report, run: Duration, interval: Duration) {
    let steady_from = run.saturating_sub(Duration::from_secs(5));
    let steady = report.admitted_between(steady_from, run) as f64
        / (RATE * (run - steady_from).as_secs_f64());
    // One trade per interval at most: the first at the run's start.
    let intervals = (report.elapsed.as_secs_f64() / interval.as_secs_f64()).floor() + 1.0;
    // A region without requests has no latency: "–".
    let quantile = |q: f64| -> Vec<String> {
        report
            .regions
            .iter()
            .map(|region| {
                if region.latencies.is_empty() {
                    "–".to_owned()
                } else {
                    format!("{:.2}", region.latency(q).as_secs_f64() * 1000.0)
                }
            })
            .collect()
    };
    let (p50, p99) = (quantile(0.5), quantile(0.99));
    let calls: Vec<String> = report
        .regions
        .iter()
        .map(|region| format!("{:.2}", region.trades as f64 / intervals))
        .collect();
    println!(
        "| {} | {} | {} | {:.0} | {:.3} | {:.0} % | {} | {} | {} | {} |",
        shape.name(),
        match mode {
            Mode::Traded => "traded",
            Mode::TradedBatched(_) => "traded, batched in each region",
            Mode::TradedSharded => "traded, sharded in each region",
            Mode::TradedCluster => "traded, a cluster in each region",
            Mode::Fixed => "fixed",
        },
        report.admitted(),
        report.allowance,
        report.admitted() as f64 / report.allowance,
        steady * 100.0,
        p50.join(" / "),
        p99.join(" / "),
        calls.join(" / "),
        report.errors(),
    );
    if mode != Mode::Fixed {
        for (index, region) in report.regions.iter().enumerate() {
            let per_second: Vec<String> = region
                .share_per_bucket
                .iter()
                .step_by(10)
                .map(u64::to_string)
                .collect();
            let admitted: Vec<String> = region
                .admitted_per_bucket
                .chunks(10)
                .map(|second| second.iter().sum::<u64>().to_string())
                .collect();
            println!(
                "    r{index} share each second: {}; admitted each second: {}",
                per_second.join(" "),
                admitted.join(" ")
            );
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut args = std::env::args().skip(1);
    let seconds: u64 = args.next().and_then(|text| text.parse().ok()).unwrap_or(10);
    let gateways: usize = args.next().and_then(|text| text.parse().ok()).unwrap_or(2);
    let run = Duration::from_secs(seconds);
    let limit = Arc::new(
        Limit::builder("api")
            .algorithm(Algorithm::TokenBucket)
            .limit(300)
            .window(Duration::from_secs(1))
            .burst(300)
            .build()
            .expect("a limit"),
    );
    println!(
        "token bucket 300/s, burst 300; 3 regions of {gateways} gateways; sync_interval {INTERVAL:?}; \
         one-way delay to the global store {ONE_WAY:?} (a round trip of twice it); {seconds} s per shape (partition: +5 s, the first region cut off from 5 s to 10 s)"
    );
    println!(
        "| shape | shares | admitted | allowance | admitted / allowance | last 5 s, % of the limit | p50 ms per region | p99 ms per region | cross-region calls per region and interval | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for shape in [
        Shape::Concentrated,
        Shape::Spread,
        Shape::Moving,
        Shape::Partition,
    ] {
        for mode in [Mode::Fixed, Mode::Traded] {
            let regions = Arc::new(Regions::start(mode, 3, gateways, INTERVAL));
            for link in &regions.links {
                link.set(Fault::Latency(ONE_WAY));
            }
            let run = match shape {
                Shape::Partition => run + Duration::from_secs(5),
                _ => run,
            };
            let cut = {
                let regions = regions.clone();
                async move {
                    if let Shape::Partition = shape {
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        regions.links[0].set(Fault::BlackHole);
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        regions.links[0].set(Fault::Latency(ONE_WAY));
                    }
                }
            };
            let client = format!("{}-{}", shape.name(), fastrand::u32(..));
            let load = regions.run(&limit, &client, run, move |region, since| match shape {
                Shape::Concentrated | Shape::Partition => {
                    if region == 0 {
                        600.0
                    } else {
                        0.0
                    }
                }
                Shape::Spread => 200.0,
                Shape::Moving => {
                    let moved = since >= run / 2;
                    if (region == 0 && !moved) || (region == 1 && moved) {
                        600.0
                    } else {
                        0.0
                    }
                }
            });
            let (report, ()) = tokio::join!(load, cut);
            print(shape, mode, &report, run, INTERVAL);
        }
    }
}
