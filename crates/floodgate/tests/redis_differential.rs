//! Differential test: each Lua script and its Rust algorithm give identical outcomes on random
//! schedules with explicit `now`, run against a real redis-server.

mod support;

use std::sync::Arc;
use std::time::Duration;

use floodgate::algorithm::{self, State};
use floodgate::{Algorithm, Check, Limit, Store, Timestamp};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use support::ServedStore;

const START: u64 = 1_700_006_400_000_000;

#[derive(Clone, Debug)]
struct Case {
    algorithm: Algorithm,
    limit: u64,
    window_ms: u64,
    extra_burst: u64,
    steps: Vec<(u64, u64)>, // (gap µs, cost)
}

fn cases() -> impl Strategy<Value = Case> {
    (
        0usize..7,
        1u64..25,
        1u64..3_000,
        0u64..10,
        prop::collection::vec(
            (
                prop_oneof![Just(0u64), 0u64..200_000, 0u64..5_000_000],
                prop_oneof![4 => Just(1u64), 1 => 1u64..8],
            ),
            1..80,
        ),
    )
        .prop_map(|(algorithm, limit, window_ms, extra_burst, steps)| Case {
            algorithm: Algorithm::ALL[algorithm],
            limit,
            window_ms,
            extra_burst,
            steps,
        })
}

#[test]
fn lua_scripts_match_the_rust_algorithms() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let served = ServedStore::start();
    let case_number = std::sync::atomic::AtomicU64::new(0);
    let mut runner = TestRunner::new(Config {
        cases: 200,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&cases(), |case| {
            let case_number = case_number.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut builder = Limit::builder("diff")
                .algorithm(case.algorithm)
                .limit(case.limit)
                .window(Duration::from_millis(case.window_ms));
            if case.algorithm.uses_burst() {
                builder = builder.burst(case.limit + case.extra_burst);
            }
            let limit = Arc::new(builder.build().unwrap());
            let key = format!("diff:{{case:{case_number}}}:r:{}", case.algorithm);
            let mut state: Option<State> = None;
            let mut now = START;
            for (index, &(gap, cost)) in case.steps.iter().enumerate() {
                now += gap;
                let (expected, next) =
                    algorithm::check(&limit, state.take(), now, cost, index as u64 + 1);
                state = next;
                let checks = [Check::new(key.clone(), limit.clone(), cost)];
                let decision = runtime
                    .block_on(served.check_and_consume(&checks, Some(Timestamp::from_micros(now))))
                    .expect("redis decides");
                let got = &decision.limits()[0];
                let context = format!(
                    "{} step {index} at +{}µs cost {cost}",
                    case.algorithm,
                    now - START
                );
                prop_assert_eq!(got.allowed, expected.allowed, "allowed: {}", context);
                prop_assert_eq!(got.remaining, expected.remaining, "remaining: {}", context);
                prop_assert_eq!(
                    got.reset_after,
                    Duration::from_micros(expected.reset_after_micros),
                    "reset_after: {}",
                    context
                );
                prop_assert_eq!(
                    got.retry_after,
                    expected.retry_after_micros.map(Duration::from_micros),
                    "retry_after: {}",
                    context
                );
                prop_assert_eq!(
                    decision.delay(),
                    Duration::from_micros(expected.delay_micros),
                    "delay: {}",
                    context
                );
            }
            Ok(())
        })
        .unwrap();
}
