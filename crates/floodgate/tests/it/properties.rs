//! Property tests of the pure algorithms on random schedules.

use std::time::Duration;

use floodgate::Limit;
use floodgate::algorithm::{self, State};
use floodgate::{Algorithm, limit::LimitBuilder};
use proptest::prelude::*;

/// One request: time since the previous one (µs) and its cost.
#[derive(Clone, Debug)]
struct Step {
    gap_micros: u64,
    cost: u64,
}

fn schedule(max_gap_micros: u64, max_cost: u64) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (
            prop_oneof![Just(0u64), 0..max_gap_micros, 0..max_gap_micros / 50 + 1],
            1..=max_cost,
        )
            .prop_map(|(gap_micros, cost)| Step { gap_micros, cost }),
        1..200,
    )
}

fn build(builder: LimitBuilder) -> Limit {
    builder.build().expect("valid limit")
}

/// Runs `steps` against one key from `start`; returns (time, cost, allowed) per request.
fn run(limit: &Limit, steps: &[Step], start: u64) -> Vec<(u64, u64, bool)> {
    let mut state: Option<State> = None;
    let mut now = start;
    steps
        .iter()
        .enumerate()
        .map(|(index, step)| {
            now += step.gap_micros;
            let (outcome, next) =
                algorithm::check(limit, state.take(), now, step.cost, index as u64);
            state = next;
            (now, step.cost, outcome.allowed)
        })
        .collect()
}

const MAX_COST: u64 = 3;

const START: u64 = 1_700_000_000_000_000;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn token_bucket_and_gcra_admit_the_same_requests(
        limit in 1u64..50,
        window_ms in 1u64..5_000,
        extra_burst in 0u64..20,
        steps in schedule(400_000, 5),
    ) {
        let make = |algorithm| build(
            Limit::builder("p")
                .algorithm(algorithm)
                .limit(limit)
                .window(Duration::from_millis(window_ms))
                .burst(limit + extra_burst),
        );
        let bucket = run(&make(Algorithm::TokenBucket), &steps, START);
        let gcra = run(&make(Algorithm::Gcra), &steps, START);
        prop_assert_eq!(bucket, gcra);
    }

    #[test]
    fn sliding_window_log_never_exceeds_limit_in_any_trailing_window(
        limit in 1u64..30,
        window_ms in 1u64..2_000,
        steps in schedule(200_000, 4),
    ) {
        let limit = build(
            Limit::builder("p")
                .algorithm(Algorithm::SlidingWindowLog)
                .limit(limit)
                .window(Duration::from_millis(window_ms)),
        );
        let admitted: Vec<(u64, u64)> = run(&limit, &steps, START)
            .into_iter()
            .filter(|&(_, _, allowed)| allowed)
            .map(|(at, cost, _)| (at, cost))
            .collect();
        for &(end, _) in &admitted {
            let in_window: u64 = admitted
                .iter()
                .filter(|&&(at, _)| at <= end && at + limit.window_micros() > end)
                .map(|&(_, cost)| cost)
                .sum();
            prop_assert!(in_window <= limit.limit(), "{} in the window ending {}", in_window, end);
        }
    }

    #[test]
    fn no_algorithm_admits_more_than_its_capacity_allows(
        algorithm_index in 0usize..6,
        limit in 1u64..30,
        window_ms in 1u64..2_000,
        extra_burst in 0u64..10,
        steps in schedule(200_000, MAX_COST),
    ) {
        // Concurrency has its own test: its capacity is about leases, not time.
        let algorithm = Algorithm::ALL[algorithm_index];
        let mut builder = Limit::builder("p")
            .algorithm(algorithm)
            .limit(limit)
            .window(Duration::from_millis(window_ms));
        if algorithm.uses_burst() {
            builder = builder.burst(limit + extra_burst);
        }
        let limit = build(builder);
        let admitted: Vec<(u64, u64)> = run(&limit, &steps, START)
            .into_iter()
            .filter(|&(_, _, allowed)| allowed)
            .map(|(at, cost, _)| (at, cost))
            .collect();
        let emission = limit.emission_micros();
        let window = limit.window_micros();
        for (first, &(from, _)) in admitted.iter().enumerate() {
            let mut units = 0;
            for &(to, cost) in &admitted[first..] {
                units += cost;
                let span = to - from;
                let bound = match algorithm {
                    // A full bucket plus what refills during the span.
                    Algorithm::TokenBucket | Algorithm::Gcra => limit.burst() + span / emission,
                    // A request is admitted while its wait is at most `burst` intervals,
                    // whatever its own cost: the queue plus one request, plus the drain.
                    Algorithm::LeakyBucket => limit.burst() + MAX_COST + span / emission,
                    Algorithm::SlidingWindowLog => limit.limit() * (span / window + 1),
                    // Aligned windows: a span touches at most span/window + 2 of them.
                    Algorithm::FixedWindow | Algorithm::SlidingWindowCounter => {
                        limit.limit() * (span / window + 2)
                    }
                    Algorithm::Concurrency => unreachable!(),
                };
                prop_assert!(units <= bound, "{} units in {}µs, bound {}", units, span, bound);
                if matches!(algorithm, Algorithm::FixedWindow | Algorithm::SlidingWindowCounter)
                    && from / window == to / window
                {
                    prop_assert!(units <= limit.limit(), "{} units in one aligned window", units);
                }
            }
        }
    }

    #[test]
    fn concurrency_never_exceeds_limit_in_flight(
        limit in 1u64..10,
        operations in prop::collection::vec((any::<bool>(), 0u64..2_000_000), 1..200),
    ) {
        let limit = build(
            Limit::builder("p")
                .algorithm(Algorithm::Concurrency)
                .limit(limit)
                .window(Duration::from_secs(1)),
        );
        let mut state: Option<State> = None;
        let mut held: Vec<(u64, u64)> = Vec::new(); // (lease id, expires at)
        let mut now = START;
        for (index, (acquire, gap)) in operations.into_iter().enumerate() {
            now += gap / 10;
            held.retain(|&(_, expires_at)| expires_at > now);
            if acquire || held.is_empty() {
                let in_flight = held.len() as u64;
                let (outcome, next) = algorithm::check(&limit, state.take(), now, 1, index as u64);
                state = next;
                // Admitted exactly when a lease is free: never above the limit, never refused
                // below it.
                prop_assert_eq!(outcome.allowed, in_flight < limit.limit());
                if outcome.allowed {
                    held.push((index as u64, now + limit.window_micros()));
                }
                prop_assert!(held.len() as u64 <= limit.limit());
            } else {
                let (lease, _) = held.remove(0);
                if let Some(state) = state.as_mut() {
                    prop_assert!(algorithm::release(state, lease));
                }
            }
        }
    }

    #[test]
    fn retry_after_is_exact_on_random_schedules(
        algorithm_index in 0usize..7,
        limit in 1u64..20,
        window_ms in 1u64..3_000,
        steps in schedule(300_000, 3),
    ) {
        let algorithm = Algorithm::ALL[algorithm_index];
        let limit = build(
            Limit::builder("p")
                .algorithm(algorithm)
                .limit(limit)
                .window(Duration::from_millis(window_ms)),
        );
        let mut state: Option<State> = None;
        let mut now = START;
        for (index, step) in steps.iter().enumerate() {
            now += step.gap_micros;
            let outcome = algorithm::evaluate(&limit, state.as_ref(), now, step.cost);
            if let Some(wait) = outcome.retry_after_micros {
                prop_assert!(wait > 0);
                let early = algorithm::evaluate(&limit, state.as_ref(), now + wait - 1, step.cost);
                prop_assert!(!early.allowed, "{} admitted {}µs before retry_after", algorithm, 1);
                let on_time = algorithm::evaluate(&limit, state.as_ref(), now + wait, step.cost);
                prop_assert!(on_time.allowed, "{} denied at retry_after {}µs", algorithm, wait);
            } else if outcome.allowed {
                algorithm::consume(&limit, &mut state, now, step.cost, index as u64);
            } else {
                prop_assert!(step.cost > limit.capacity(), "no retry promise for cost {}", step.cost);
            }
        }
    }
}
