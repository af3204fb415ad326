//! The fleet simulation of `bench/fleet.sh`: `N` batched nodes in one process against one
//! Redis (a URL), every traffic shape, and what each admitted against its allowance.
//!
//! `fleet REDIS_URL [SECONDS] [N ...]` (default 10 s; 4, 20, 200 nodes)

use std::sync::Arc;
use std::time::Duration;

use floodgate::Limit;
use floodgate_test_support::fleet::{Fleet, Shape};

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .expect("usage: fleet REDIS_URL [SECONDS] [N ...]");
    let seconds: u64 = args.next().and_then(|text| text.parse().ok()).unwrap_or(10);
    let mut sizes: Vec<usize> = args.filter_map(|text| text.parse().ok()).collect();
    if sizes.is_empty() {
        sizes = vec![4, 20, 200];
    }
    let interval = Duration::from_millis(100);
    let limit = Arc::new(Limit::token_bucket("per-second", 100, Duration::from_secs(1)).unwrap());
    println!("token bucket 100/s, burst 100; sync_interval 100ms; {seconds} s per shape");
    println!(
        "{:>5}  {:<38} {:>9} {:>9} {:>10} {:>8} {:>12}",
        "nodes", "shape", "requests", "admitted", "allowance", "error", "calls/node/T"
    );
    for &nodes in &sizes {
        let fleet = Fleet::start(&url, nodes, interval);
        let shapes = [
            Shape::Uniform { rate: 300 },
            Shape::Skewed {
                rate: 300,
                share: 0.8,
            },
            Shape::Moving { rate: 300 },
            Shape::ColdBurst { per_node: 40 },
        ];
        for (index, shape) in shapes.into_iter().enumerate() {
            let client = format!("n{nodes}s{index}");
            let report = fleet
                .run(shape, &limit, &client, Duration::from_secs(seconds))
                .await;
            println!(
                "{:>5}  {:<38} {:>9} {:>9} {:>10.0} {:>+7.1}% {:>12.2}",
                nodes,
                shape.name(),
                report.requests,
                report.admitted,
                report.allowance,
                report.error() * 100.0,
                report.calls_per_node_interval(nodes, interval)
            );
        }
    }
}
