//! Several regions sharing one limit through a global store, against real redis-server
//! processes: a Redis per region, a global one behind a fault-injecting proxy per region (a
//! round trip of 100 ms, or a partition), gateways per region in this process
//! (`floodgate_test_support::regions`).
//!
//! Fast variants of `bench/regions.sh`'s shapes: a token bucket of 300/s (burst 300), three
//! regions, rounds every 200 ms, runs of a few seconds. Bounds: what every region admitted
//! together never exceeds the limit's allowance (its burst plus its refill over the run) by
//! more than the issue allows (none for the concentrated shape, 2 % for the others); a
//! concentrated client reaches at least 75 % of the limit once shares have moved (the bench's
//! goal is 90 % over 5 s; a short run on a loaded 2-core machine gets a looser bound).

use floodgate_test_support as support;

use std::sync::Arc;
use std::time::Duration;

use floodgate::{Algorithm, Limit};
use support::faults::Fault;
use support::regions::{Mode, Regions};

const INTERVAL: Duration = Duration::from_millis(200);
const ROUND_TRIP: Duration = Duration::from_millis(100);

fn bucket() -> Arc<Limit> {
    Arc::new(
        Limit::builder("api")
            .algorithm(Algorithm::TokenBucket)
            .limit(300)
            .window(Duration::from_secs(1))
            .burst(300)
            .build()
            .unwrap(),
    )
}

fn oceans(regions: &Regions) {
    for link in &regions.links {
        link.set(Fault::DelayReplies(ROUND_TRIP));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concentrated_client_gets_most_of_the_limit_and_never_more() {
    let regions = Regions::start(Mode::Traded, 3, 1, INTERVAL);
    oceans(&regions);
    let limit = bucket();
    let run = Duration::from_secs(4);
    let report = regions
        .run(&limit, "concentrated", run, |region, _| {
            if region == 0 { 600.0 } else { 0.0 }
        })
        .await;
    let admitted = report.admitted();
    assert!(
        admitted as f64 <= report.allowance,
        "admitted {admitted} > allowance {:.0}",
        report.allowance
    );
    let steady = report.regions[0].admitted_between(Duration::from_secs(2), run);
    assert!(
        steady as f64 >= 0.75 * 300.0 * 2.0,
        "the last 2 s admitted {steady}, shares {:?}",
        report.regions[0].share_per_bucket
    );
    assert_eq!(report.errors(), 0);
}

/// The most a run may admit beyond the limit's allowance, as a fraction of it.
const OVER: f64 = 0.02;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_spread_over_every_region_gets_the_limit_and_no_more() {
    let regions = Regions::start(Mode::Traded, 3, 2, INTERVAL);
    oceans(&regions);
    let report = regions
        .run(&bucket(), "spread", Duration::from_secs(3), |_, _| 200.0)
        .await;
    let admitted = report.admitted() as f64;
    assert!(
        admitted <= report.allowance * (1.0 + OVER),
        "admitted {admitted} > allowance {:.0} + 2 %",
        report.allowance
    );
    assert!(
        admitted >= report.allowance * 0.8,
        "admitted {admitted} of an allowance of {:.0}",
        report.allowance
    );
    assert_eq!(report.errors(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_moving_between_regions_is_followed_and_bounded() {
    let regions = Regions::start(Mode::Traded, 3, 1, INTERVAL);
    oceans(&regions);
    let run = Duration::from_secs(5);
    let report = regions
        .run(&bucket(), "moving", run, move |region, since| {
            let moved = since >= run / 2;
            if (region == 0 && !moved) || (region == 1 && moved) {
                600.0
            } else {
                0.0
            }
        })
        .await;
    let admitted = report.admitted() as f64;
    assert!(
        admitted <= report.allowance * (1.0 + OVER),
        "admitted {admitted} > allowance {:.0} + 2 %",
        report.allowance
    );
    // The region it moved to holds most of the limit by the end.
    let last = report.regions[1].admitted_between(run - Duration::from_secs(1), run);
    assert!(
        last as f64 >= 0.75 * 300.0,
        "the last second admitted {last} in the new region, shares {:?}",
        report.regions[1].share_per_bucket
    );
    assert_eq!(report.errors(), 0);
}
