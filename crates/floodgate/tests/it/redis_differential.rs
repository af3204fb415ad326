//! Differential test: each Lua script and its Rust algorithm give identical outcomes on random
//! schedules with explicit `now`, run against a real redis-server.

use floodgate_test_support as support;

use std::sync::Arc;
use std::time::Duration;

use floodgate::algorithm::{self, State};
use floodgate::{Algorithm, Limit, Store, store::Check, time::Timestamp};
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
        // From 100ms: a key's TTL, set from the test's clock, runs out in Redis's real time; a
        // window of a few ms (an emission interval under 1ms) let a busy machine expire a key
        // between two steps at the same test instant (seen once: leaky_bucket, 9ms).
        100u64..3_000,
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

/// A runtime for the store calls, and a store on a fresh redis-server.
fn runtime_and_store() -> (tokio::runtime::Runtime, ServedStore) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    (runtime, ServedStore::start())
}

/// `cases` random cases, none persisted.
fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

#[test]
fn lua_scripts_match_the_rust_algorithms() {
    let (runtime, served) = runtime_and_store();
    single_limit_cases_agree(&runtime, &served, 200);
    assert!(
        served.servers[0].command_calls("fcall") > 0,
        "decided by FCALL"
    );
}

/// The same on a server with `FUNCTION` disabled: the store falls back to `EVALSHA` of the same
/// code, and decides identically.
#[test]
fn lua_scripts_match_the_rust_algorithms_without_functions() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let served = ServedStore::without_functions();
    single_limit_cases_agree(&runtime, &served, 100);
    let server = &served.servers[0];
    assert_eq!(
        server.command_calls("fcall"),
        1,
        "one FCALL found no function"
    );
    assert!(
        server.command_calls("evalsha") > 100,
        "then every call by EVALSHA"
    );
}

fn single_limit_cases_agree(runtime: &tokio::runtime::Runtime, served: &ServedStore, count: u32) {
    let case_number = std::sync::atomic::AtomicU64::new(0);
    let mut runner = runner(count);
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

/// One limit of a multi-limit case: its algorithm (and the one it is changed to, if at all),
/// size, window and hash tag (limits with the same tag share a slot and one script call).
#[derive(Clone, Debug)]
struct LimitCase {
    algorithm: Algorithm,
    changed_to: Algorithm,
    limit: u64,
    window_ms: u64,
    extra_burst: u64,
    tag: u8,
}

#[derive(Clone, Debug)]
struct MultiCase {
    limits: Vec<LimitCase>,
    /// (clock step in µs, backwards when negative; cost; whether the changes happen now)
    steps: Vec<(i64, u64, bool)>,
}

fn multi_cases() -> impl Strategy<Value = MultiCase> {
    let limit = (
        0usize..7,
        0usize..7,
        1u64..25,
        // At least 10s: the scripts' keys expire in Redis's real time, while the test's clock
        // is its own, and goes back. A key must not expire between two steps (a few ms apart)
        // unless the memory store would see fresh state too: with windows of 10s or more every
        // TTL but a fixed window's last moments lasts at least 400ms (one emission interval of
        // 25 per 10s). Shorter windows are the single-limit test's.
        prop_oneof![3 => 10_000u64..60_000, 1 => 60_000u64..86_400_000],
        0u64..10,
        0u8..3,
    )
        .prop_map(
            |(algorithm, changed_to, limit, window_ms, extra_burst, tag)| LimitCase {
                algorithm: Algorithm::ALL[algorithm],
                changed_to: Algorithm::ALL[changed_to],
                limit,
                window_ms,
                extra_burst,
                tag,
            },
        );
    let step = (
        prop_oneof![
            3 => 0i64..200_000,
            2 => 0i64..5_000_000,
            1 => -3_000_000i64..0,
            1 => Just(3_600_000_000i64),
        ],
        prop_oneof![3 => Just(1u64), 1 => 1u64..8],
        prop::bool::weighted(0.05),
    );
    (
        prop::collection::vec(limit, 1..5),
        prop::collection::vec(step, 1..40),
    )
        .prop_map(|(limits, steps)| MultiCase { limits, steps })
}

fn build(case: &LimitCase, index: usize, algorithm: Algorithm) -> Arc<Limit> {
    let mut builder = Limit::builder(format!("l{index}"))
        .algorithm(algorithm)
        .limit(case.limit)
        .window(Duration::from_millis(case.window_ms));
    if algorithm.uses_burst() {
        builder = builder.burst(case.limit + case.extra_burst);
    }
    Arc::new(builder.build().unwrap())
}

/// The Lua scripts against the Rust algorithms (the memory store) on calls of several limits:
/// all-or-nothing in one script call, and one call per slot with refunds ('refund' mode) when a
/// later slot denies; costs above 1; windows up to a day; a clock that steps back; and limits
/// whose algorithm changes under the same name, so that each script meets the state another
/// left behind.
#[test]
fn lua_scripts_match_the_rust_algorithms_on_multi_limit_calls() {
    let (runtime, served) = runtime_and_store();
    let per_slot = floodgate::store::RedisStore::builder(served.servers[0].url())
        .timeout(Duration::from_secs(5))
        .cluster_compatible(true)
        .build()
        .unwrap();
    let case_number = std::sync::atomic::AtomicU64::new(0);
    let mut runner = runner(150);
    runner
        .run(&multi_cases(), |case| {
            let case_number = case_number.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // Never sweeps idle keys (the first call's sweep finds none): Redis forgets a key
            // only when its TTL runs out in real time, which the windows keep out of a case's
            // reach, while a sweep by the case's own clock would forget a key that a later
            // step back in time still sees.
            let memory = floodgate::MemoryStore::builder()
                .sweep_interval(Duration::from_secs(100 * 365 * 86_400))
                .build();
            // A refund leaves a bucket's state advanced to the instant of the refund, which
            // only a clock that then steps back can tell from untouched state: the per-slot
            // path is compared on cases whose clock only moves forward.
            let forward_only = case.steps.iter().all(|&(step, _, _)| step >= 0);
            let mut limits: Vec<Arc<Limit>> = case
                .limits
                .iter()
                .enumerate()
                .map(|(index, limit)| build(limit, index, limit.algorithm))
                .collect();
            let checks = |store: &str, limits: &[Arc<Limit>], cost: u64| -> Vec<Check> {
                limits
                    .iter()
                    .zip(&case.limits)
                    .map(|(limit, spec)| {
                        let key = format!(
                            "multi:{{{store}:{case_number}:{}}}:r:{}",
                            spec.tag,
                            limit.name()
                        );
                        Check::new(key, limit.clone(), cost)
                    })
                    .collect()
            };
            let mut now = START;
            for (index, &(step, cost, change)) in case.steps.iter().enumerate() {
                now = now.saturating_add_signed(step);
                if change {
                    limits = case
                        .limits
                        .iter()
                        .enumerate()
                        .map(|(index, limit)| build(limit, index, limit.changed_to))
                        .collect();
                }
                let at = Some(Timestamp::from_micros(now));
                let expected = memory.check_and_consume_now(&checks("m", &limits, cost), at);
                let (one_call, by_slot) = (checks("s", &limits, cost), checks("p", &limits, cost));
                let decided: [(&str, &dyn Store, &[Check]); 2] = [
                    ("one call", &served, &one_call),
                    ("per slot", &per_slot, &by_slot),
                ];
                for (how, store, checks) in decided {
                    if how == "per slot" && !forward_only {
                        continue;
                    }
                    let got = runtime
                        .block_on(store.check_and_consume(checks, at))
                        .expect("redis decides");
                    let context = format!(
                        "{how}, step {index} at {}µs cost {cost}",
                        now as i64 - START as i64
                    );
                    prop_assert_eq!(got.is_allowed(), expected.is_allowed(), "{}", context);
                    prop_assert_eq!(got.delay(), expected.delay(), "delay: {}", context);
                    for (got, expected) in got.limits().iter().zip(expected.limits()) {
                        let what =
                            format!("{} ({}): {context}", got.name, got.definition().algorithm());
                        prop_assert_eq!(got.allowed, expected.allowed, "allowed: {}", what);
                        prop_assert_eq!(got.remaining, expected.remaining, "remaining: {}", what);
                        prop_assert_eq!(got.reset_after, expected.reset_after, "reset: {}", what);
                        prop_assert_eq!(got.retry_after, expected.retry_after, "retry: {}", what);
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

/// A clock step of a give-back case.
#[derive(Clone, Copy, Debug)]
enum Gap {
    /// The same instant.
    None,
    /// Up to 5 s.
    Short(u64),
    /// Exactly one window: the same offset in a later window.
    Window,
    /// Up to two emission intervals, so that a debt is partly paid by refill (buckets and
    /// GCRA only; the window counters take a short step instead, keeping clear of window ends,
    /// where a key's TTL in Redis's real time would end before the test's clock got there).
    Emissions(u64),
}

/// One step of a give-back case: charge units unconditionally (batched mode's charge beyond
/// the level: a debt), or give units back (a lease's unused part, a refund).
#[derive(Clone, Copy, Debug)]
enum Trade {
    Charge(u64),
    GiveBack(u64),
}

#[derive(Clone, Debug)]
struct GiveBackCase {
    algorithm: Algorithm,
    limit: u64,
    window_hours: u64,
    extra_burst: u64,
    steps: Vec<(Gap, Trade)>,
}

fn give_back_cases() -> impl Strategy<Value = GiveBackCase> {
    let algorithm = prop_oneof![
        Just(Algorithm::TokenBucket),
        Just(Algorithm::Gcra),
        Just(Algorithm::FixedWindow),
        Just(Algorithm::SlidingWindowCounter),
    ];
    let gap = prop_oneof![
        1 => Just(Gap::None),
        2 => (0u64..5_000_000).prop_map(Gap::Short),
        1 => Just(Gap::Window),
        2 => (0u64..2_000).prop_map(Gap::Emissions),
    ];
    let trade = prop_oneof![
        (1u64..60).prop_map(Trade::Charge),
        (1u64..30).prop_map(Trade::GiveBack),
    ];
    (
        algorithm,
        1u64..25,
        // Windows that divide a day, so that START (midnight) begins one of each.
        prop::sample::select(vec![1u64, 2, 3, 4, 6, 8, 12, 24]),
        0u64..10,
        prop::collection::vec((gap, trade), 1..40),
    )
        .prop_map(
            |(algorithm, limit, window_hours, extra_burst, steps)| GiveBackCase {
                algorithm,
                limit,
                window_hours,
                extra_burst,
                steps,
            },
        )
}

/// Batched mode's trades against the Rust algorithms: charges beyond what a limit holds (a
/// token bucket or GCRA then owes refill time) and give-backs, through the scripts' `charge`
/// and `refund` in lease calls, and through `algorithm::consume` and `algorithm::unconsume` on
/// a node's copy. The state Redis reports after each trade must be the node's: a give-back into
/// a bucket in debt pays the debt before it refills the bucket, on both.
#[test]
fn lua_give_backs_match_the_rust_algorithms_on_limits_in_debt() {
    use floodgate::store::batched::{LeaseRequest, SyncTarget};

    let (runtime, served) = runtime_and_store();
    let case_number = std::sync::atomic::AtomicU64::new(0);
    let mut runner = runner(150);
    runner
        .run(&give_back_cases(), |case| {
            let case_number = case_number.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let window = Duration::from_secs(case.window_hours * 3600);
            let mut builder = Limit::builder("give-back")
                .algorithm(case.algorithm)
                .limit(case.limit)
                .window(window);
            if case.algorithm.uses_burst() {
                builder = builder.burst(case.limit + case.extra_burst);
            }
            let limit = Arc::new(builder.build().unwrap());
            let key = format!("give-back:{{case:{case_number}}}:r:{}", case.algorithm);
            let counts_in_windows = matches!(
                case.algorithm,
                Algorithm::FixedWindow | Algorithm::SlidingWindowCounter
            );
            let mut node: Option<State> = None;
            let mut now = START;
            for (index, &(gap, trade)) in case.steps.iter().enumerate() {
                now += match gap {
                    Gap::None => 0,
                    Gap::Short(micros) => micros,
                    Gap::Window => window.as_micros() as u64,
                    Gap::Emissions(_) if counts_in_windows => 0,
                    Gap::Emissions(thousandths) => limit.emission_micros() * thousandths / 1_000,
                };
                let (charge, give_back) = match trade {
                    Trade::Charge(units) => (units, 0),
                    Trade::GiveBack(units) => (0, units),
                };
                if charge > 0 {
                    algorithm::consume(&limit, &mut node, now, charge, 0);
                }
                if let Some(state) = &mut node
                    && give_back > 0
                {
                    algorithm::unconsume(&limit, state, now, give_back);
                }
                let request = LeaseRequest {
                    check: Check::new(key.clone(), limit.clone(), 1),
                    give_back,
                    leased_in: None,
                    want: 0,
                    charge,
                };
                let leased = runtime.block_on(
                    served
                        .store
                        .lease(&[request], Some(Timestamp::from_micros(now))),
                );
                let shared = &leased.grants[0].as_ref().expect("redis trades").state;
                prop_assert_eq!(
                    shared,
                    &node,
                    "{} step {} ({:?}) at +{}µs",
                    case.algorithm,
                    index,
                    trade,
                    now - START
                );
            }
            Ok(())
        })
        .unwrap();
}
