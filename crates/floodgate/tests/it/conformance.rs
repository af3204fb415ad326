//! The store conformance suite: every test body is written once here, against the `Store`
//! trait, and stamped out for each store by `conformance_suite!` (see `conformance_memory.rs`).
//!
//! Time is passed explicitly (`now`), so the suite runs on a fake clock against any store.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use floodgate::{Algorithm, Decision, Limit, Store, store::Check, time::Timestamp};

/// A timestamp aligned to a day, so every window of the suite starts there.
pub const T0: u64 = 1_700_006_400 * 1_000_000;

pub fn at(offset: Duration) -> Timestamp {
    Timestamp::from_micros(T0 + offset.as_micros() as u64)
}

pub fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

pub fn secs(secs: u64) -> Duration {
    Duration::from_secs(secs)
}

pub fn limit(algorithm: Algorithm, limit: u64, window: Duration) -> Arc<Limit> {
    Arc::new(Limit::new("test", algorithm, limit, window).unwrap())
}

pub fn limit_with_burst(
    algorithm: Algorithm,
    limit: u64,
    window: Duration,
    burst: u64,
) -> Arc<Limit> {
    Arc::new(
        Limit::builder("test")
            .algorithm(algorithm)
            .limit(limit)
            .window(window)
            .burst(burst)
            .build()
            .unwrap(),
    )
}

pub fn named(name: &str, algorithm: Algorithm, limit: u64, window: Duration) -> Arc<Limit> {
    Arc::new(Limit::new(name, algorithm, limit, window).unwrap())
}

/// A key shaped like the real layout, on one hash slot per identity.
pub fn key(identity: &str, limit: &str) -> String {
    format!("fgtest:{{ip:{identity}}}:default:{limit}")
}

pub async fn hit_all(store: &dyn Store, checks: &[Check], now: Timestamp) -> Decision {
    store
        .check_and_consume(checks, Some(now))
        .await
        .expect("store decides")
}

pub async fn hit(store: &dyn Store, limit: &Arc<Limit>, cost: u64, now: Timestamp) -> Decision {
    let checks = [Check::new(key("client", limit.name()), limit.clone(), cost)];
    hit_all(store, &checks, now).await
}

/// Sends unit requests at `now` until one is denied; returns how many were admitted.
pub async fn admit_until_denied(store: &dyn Store, limit: &Arc<Limit>, now: Timestamp) -> u64 {
    let mut admitted = 0;
    while hit(store, limit, 1, now).await.is_allowed() {
        admitted += 1;
        assert!(admitted <= 1_000_000, "never denied");
    }
    admitted
}

fn binding(decision: &Decision) -> &floodgate::decision::LimitStatus {
    decision.binding_limit().expect("a binding limit")
}

// ---------------------------------------------------------------------------------------------

async fn bucket_burst_then_refill(store: &dyn Store, algorithm: Algorithm) {
    let limit = limit(algorithm, 10, secs(1)); // one token every 100ms
    for expected_remaining in (0..10).rev() {
        let decision = hit(store, &limit, 1, at(ms(0))).await;
        assert!(decision.is_allowed());
        assert_eq!(binding(&decision).remaining, expected_remaining);
        assert_eq!(
            binding(&decision).reset_after,
            ms(100) * (10 - expected_remaining as u32),
            "time until the bucket is full again"
        );
    }
    let denied = hit(store, &limit, 1, at(ms(0))).await;
    assert!(!denied.is_allowed());
    assert_eq!(denied.retry_after(), Some(ms(100)));
    assert_eq!(binding(&denied).remaining, 0);
    assert_eq!(binding(&denied).reset_after, secs(1));

    let early = hit(store, &limit, 1, at(ms(100) - Duration::from_micros(1))).await;
    assert!(!early.is_allowed());
    assert_eq!(early.retry_after(), Some(Duration::from_micros(1)));
    assert!(hit(store, &limit, 1, at(ms(100))).await.is_allowed());

    // Half a window refills half the capacity, no more.
    assert_eq!(admit_until_denied(store, &limit, at(ms(600))).await, 5);
    // A long pause refills to capacity, never beyond.
    assert_eq!(admit_until_denied(store, &limit, at(secs(60))).await, 10);
}

pub async fn token_bucket_burst_then_refill(store: impl Store) {
    bucket_burst_then_refill(&store, Algorithm::TokenBucket).await;
}

pub async fn gcra_burst_then_refill(store: impl Store) {
    bucket_burst_then_refill(&store, Algorithm::Gcra).await;
}

async fn bucket_burst_above_rate(store: &dyn Store, algorithm: Algorithm) {
    let limit = limit_with_burst(algorithm, 10, secs(1), 20);
    assert_eq!(admit_until_denied(store, &limit, at(ms(0))).await, 20);
    // Then the sustained rate: one per 100ms.
    assert_eq!(admit_until_denied(store, &limit, at(ms(300))).await, 3);
    let decision = hit(store, &limit, 1, at(ms(300))).await;
    assert_eq!(decision.retry_after(), Some(ms(100)));
}

pub async fn token_bucket_burst_above_rate(store: impl Store) {
    bucket_burst_above_rate(&store, Algorithm::TokenBucket).await;
}

pub async fn gcra_burst_above_rate(store: impl Store) {
    bucket_burst_above_rate(&store, Algorithm::Gcra).await;
}

pub async fn fixed_window_counts_per_aligned_window(store: impl Store) {
    let limit = limit(Algorithm::FixedWindow, 5, secs(60));
    for expected_remaining in (0..5).rev() {
        let decision = hit(&store, &limit, 1, at(secs(30))).await;
        assert!(decision.is_allowed());
        assert_eq!(binding(&decision).remaining, expected_remaining);
        assert_eq!(
            binding(&decision).reset_after,
            secs(30),
            "until the window ends"
        );
    }
    let denied = hit(&store, &limit, 1, at(secs(45))).await;
    assert!(!denied.is_allowed());
    assert_eq!(denied.retry_after(), Some(secs(15)));
    assert!(
        !hit(&store, &limit, 1, at(secs(60) - Duration::from_micros(1)))
            .await
            .is_allowed()
    );
    assert_eq!(admit_until_denied(&store, &limit, at(secs(60))).await, 5);
}

/// The known flaw of fixed windows, shown: `limit` at the end of one window and `limit` at the
/// start of the next pass within 200ms, twice the limit in far less than a window.
pub async fn fixed_window_boundary_burst(store: impl Store) {
    let limit = limit(Algorithm::FixedWindow, 5, secs(60));
    assert_eq!(
        admit_until_denied(&store, &limit, at(secs(60) - ms(100))).await,
        5
    );
    assert_eq!(
        admit_until_denied(&store, &limit, at(secs(60) + ms(100))).await,
        5
    );
}

pub async fn sliding_window_log_trailing_window(store: impl Store) {
    let limit = limit(Algorithm::SlidingWindowLog, 3, secs(10));
    for offset in [0, 2, 4] {
        assert!(hit(&store, &limit, 1, at(secs(offset))).await.is_allowed());
    }
    let denied = hit(&store, &limit, 1, at(secs(5))).await;
    assert!(!denied.is_allowed());
    assert_eq!(
        denied.retry_after(),
        Some(secs(5)),
        "the t0 entry leaves at t0+10s"
    );
    assert_eq!(
        binding(&denied).reset_after,
        secs(9),
        "the t0+4s entry leaves at t0+14s"
    );
    // No boundary burst: just before the oldest entry leaves, still denied.
    assert!(
        !hit(&store, &limit, 1, at(secs(10) - Duration::from_micros(1)))
            .await
            .is_allowed()
    );
    let admitted = hit(&store, &limit, 1, at(secs(10))).await;
    assert!(admitted.is_allowed());
    assert_eq!(binding(&admitted).remaining, 0);
    // Denied requests were not logged: only the t0+2s entry must leave for one more.
    let denied = hit(&store, &limit, 1, at(secs(11))).await;
    assert_eq!(denied.retry_after(), Some(secs(1)));
}

pub async fn sliding_window_counter_weights_previous_window(store: impl Store) {
    let limit = limit(Algorithm::SlidingWindowCounter, 10, secs(10));
    assert_eq!(admit_until_denied(&store, &limit, at(secs(1))).await, 10);
    // New window starts at t0+10s: the previous window still weighs 100%.
    assert!(!hit(&store, &limit, 1, at(secs(10))).await.is_allowed());
    // Halfway through: previous weighs 50% → estimate 5 → five more.
    let first = hit(&store, &limit, 1, at(secs(15))).await;
    assert!(first.is_allowed());
    assert_eq!(binding(&first).remaining, 4);
    assert_eq!(admit_until_denied(&store, &limit, at(secs(15))).await, 4);
    let denied = hit(&store, &limit, 1, at(secs(15))).await;
    // estimate = 10 × (10 - 5 - d)/10 + 5 must drop to 9: d = 1s.
    assert_eq!(denied.retry_after(), Some(secs(1)));
    assert!(
        !hit(&store, &limit, 1, at(secs(16) - Duration::from_micros(1)))
            .await
            .is_allowed()
    );
    assert!(hit(&store, &limit, 1, at(secs(16))).await.is_allowed());
}

pub async fn leaky_bucket_delays_then_rejects(store: impl Store) {
    // 10 per second (one every 100ms); a request may wait at most burst × 100ms = 200ms.
    let limit = limit_with_burst(Algorithm::LeakyBucket, 10, secs(1), 2);
    for expected_delay in [ms(0), ms(100), ms(200)] {
        let decision = hit(&store, &limit, 1, at(ms(0))).await;
        assert!(decision.is_allowed());
        assert_eq!(decision.delay(), expected_delay);
    }
    let denied = hit(&store, &limit, 1, at(ms(0))).await;
    assert!(!denied.is_allowed());
    assert_eq!(denied.delay(), Duration::ZERO);
    assert_eq!(denied.retry_after(), Some(ms(100)));
    assert_eq!(
        binding(&denied).reset_after,
        ms(300),
        "the queue drains in 300ms"
    );
    let later = hit(&store, &limit, 1, at(ms(100))).await;
    assert!(later.is_allowed());
    assert_eq!(later.delay(), ms(200));
    // Once drained, no delay.
    let drained = hit(&store, &limit, 1, at(secs(5))).await;
    assert_eq!(drained.delay(), Duration::ZERO);
}

pub async fn concurrency_leases_release_and_expire(store: impl Store) {
    let limit = limit(Algorithm::Concurrency, 2, secs(30));
    let first = hit(&store, &limit, 1, at(ms(0))).await;
    let second = hit(&store, &limit, 1, at(ms(10))).await;
    assert!(first.is_allowed() && second.is_allowed());
    assert_eq!(first.leases().len(), 1);
    let denied = hit(&store, &limit, 1, at(ms(20))).await;
    assert!(!denied.is_allowed());
    assert!(
        denied.leases().is_empty(),
        "a denied request holds no lease"
    );
    assert_eq!(
        denied.retry_after(),
        Some(secs(30) - ms(20)),
        "until the first lease expires"
    );

    store
        .release(first.leases().to_vec())
        .await
        .expect("released");
    let third = hit(&store, &limit, 1, at(ms(30))).await;
    assert!(third.is_allowed(), "a released lease frees its slot");
    assert!(!hit(&store, &limit, 1, at(ms(40))).await.is_allowed());
    // Leases never released (a crashed node) expire with the window.
    assert!(
        hit(&store, &limit, 1, at(secs(30) + ms(30)))
            .await
            .is_allowed()
    );
}

pub async fn several_limits_are_all_or_nothing(store: impl Store) {
    let per_second = named("per-second", Algorithm::TokenBucket, 2, secs(1));
    let daily = named("daily", Algorithm::FixedWindow, 3, secs(86_400));
    let checks = [
        Check::new(key("client", "per-second"), per_second.clone(), 1),
        Check::new(key("client", "daily"), daily.clone(), 1),
    ];
    assert!(hit_all(&store, &checks, at(ms(0))).await.is_allowed());
    assert!(hit_all(&store, &checks, at(ms(0))).await.is_allowed());
    // per-second denies: daily must not be charged.
    let denied = hit_all(&store, &checks, at(ms(0))).await;
    assert!(!denied.is_allowed());
    assert_eq!(denied.binding_limit().unwrap().name.as_ref(), "per-second");
    assert_eq!(denied.limits()[1].remaining, 1);
    let third = hit_all(&store, &checks, at(secs(1))).await;
    assert!(third.is_allowed(), "daily still had one left");
    assert_eq!(third.limits()[1].remaining, 0);
    // Now daily denies: per-second (refilled to 2, one taken) must not be charged.
    let denied = hit_all(&store, &checks, at(secs(1))).await;
    assert!(!denied.is_allowed());
    assert_eq!(denied.binding_limit().unwrap().name.as_ref(), "daily");
    assert_eq!(
        denied.limits()[0].remaining,
        1,
        "per-second reports its state without charge"
    );
    let per_second_only = [Check::new(key("client", "per-second"), per_second, 1)];
    let after = hit_all(&store, &per_second_only, at(secs(1) + ms(500))).await;
    assert!(after.is_allowed());
    // 1 token + 0.5s × 2/s = 2, minus one: 1 left. Had daily's denial charged it, 0.
    assert_eq!(after.limits()[0].remaining, 1);
    // The binding limit's retry is the longest: daily resets at the end of the day.
    assert_eq!(denied.retry_after(), Some(secs(86_399)));
}

pub async fn binding_limit_has_least_room(store: impl Store) {
    let per_second = named("per-second", Algorithm::TokenBucket, 10, secs(1));
    let daily = named("daily", Algorithm::FixedWindow, 100, secs(86_400));
    let checks = [
        Check::new(key("client", "daily"), daily, 1),
        Check::new(key("client", "per-second"), per_second, 1),
    ];
    let decision = hit_all(&store, &checks, at(ms(0))).await;
    let binding = binding(&decision);
    assert_eq!(
        binding.name.as_ref(),
        "per-second",
        "9/10 left beats 99/100"
    );
    assert_eq!(binding.remaining, 9);
    assert_eq!(decision.limits().len(), 2);
}

pub async fn costs_are_charged_and_oversized_costs_never_pass(store: impl Store) {
    let limit = limit(Algorithm::TokenBucket, 10, secs(1));
    let first = hit(&store, &limit, 4, at(ms(0))).await;
    assert_eq!(binding(&first).remaining, 6);
    assert_eq!(
        binding(&hit(&store, &limit, 4, at(ms(0))).await).remaining,
        2
    );
    let denied = hit(&store, &limit, 4, at(ms(0))).await;
    assert!(!denied.is_allowed());
    assert_eq!(
        denied.retry_after(),
        Some(ms(200)),
        "two more tokens needed"
    );
    let oversized = hit(&store, &limit, 11, at(secs(10))).await;
    assert!(!oversized.is_allowed());
    assert!(oversized.is_never_admissible());
    assert_eq!(
        oversized.retry_after(),
        None,
        "no promise for a request that cannot pass"
    );
    // ... and it consumed nothing.
    assert_eq!(admit_until_denied(&store, &limit, at(secs(10))).await, 10);
}

/// For every algorithm: the retry_after of a denial is exact. A microsecond early the request
/// is still denied; at `now + retry_after`, sent alone, it is admitted.
pub async fn retry_after_is_exact_for_every_algorithm(store: impl Store) {
    for algorithm in Algorithm::ALL {
        let limit = Arc::new(Limit::new(algorithm.as_str(), algorithm, 3, secs(1)).unwrap());
        let checks = [Check::new(
            key("retry", algorithm.as_str()),
            limit.clone(),
            1,
        )];
        let now = at(ms(300));
        let mut denied = None;
        for _ in 0..100 {
            let decision = hit_all(&store, &checks, now).await;
            if !decision.is_allowed() {
                denied = Some(decision);
                break;
            }
        }
        let denied = denied.unwrap_or_else(|| panic!("{algorithm} never denied"));
        let wait = denied.retry_after().expect("a retry promise");
        assert!(wait > Duration::ZERO, "{algorithm}");
        let early = hit_all(
            &store,
            &checks,
            now.saturating_add(wait - Duration::from_micros(1)),
        )
        .await;
        assert!(
            !early.is_allowed(),
            "{algorithm}: admitted before retry_after {wait:?}"
        );
        let on_time = hit_all(&store, &checks, now.saturating_add(wait)).await;
        assert!(
            on_time.is_allowed(),
            "{algorithm}: denied at retry_after {wait:?}"
        );
    }
}

pub async fn keys_are_independent(store: impl Store) {
    let limit = limit(Algorithm::FixedWindow, 2, secs(1));
    let alice = [Check::new(key("alice", "test"), limit.clone(), 1)];
    let bob = [Check::new(key("bob", "test"), limit.clone(), 1)];
    for _ in 0..2 {
        assert!(hit_all(&store, &alice, at(ms(0))).await.is_allowed());
    }
    assert!(!hit_all(&store, &alice, at(ms(0))).await.is_allowed());
    assert!(hit_all(&store, &bob, at(ms(0))).await.is_allowed());
}

/// The algorithms a batched store runs.
const BATCHABLE: [Algorithm; 4] = [
    Algorithm::TokenBucket,
    Algorithm::Gcra,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindowCounter,
];

/// What a decision says about its limits, for comparing two decisions (lease ids aside).
fn summary(decision: &Decision) -> Vec<(bool, u64, Duration, Option<Duration>)> {
    decision
        .limits()
        .iter()
        .map(|status| {
            (
                status.allowed,
                status.remaining,
                status.reset_after,
                status.retry_after,
            )
        })
        .collect()
}

/// SPEC §3: a limit whose algorithm changes under the same rule and name starts from fresh
/// state. For every ordered pair of `algorithms`, the key is left exhausted (or full of leases,
/// or of log entries) by the first algorithm; the second must then decide exactly as on a key
/// never used, request after request, and so must the first again when changed back.
async fn algorithm_changes_start_fresh(store: &dyn Store, algorithms: &[Algorithm]) {
    let now = at(secs(10));
    for &from in algorithms {
        for &to in algorithms.iter().filter(|&&to| to != from) {
            let name = format!("{from}-to-{to}");
            let before = named(&name, from, 3, secs(1));
            let after = named(&name, to, 3, secs(1));
            let changed = key("changed", &name);
            for _ in 0..4 {
                let checks = [Check::new(changed.clone(), before.clone(), 1)];
                hit_all(store, &checks, now).await;
            }
            let fresh = key("fresh", &name);
            for request in 0..5 {
                let on_changed =
                    hit_all(store, &[Check::new(changed.clone(), after.clone(), 1)], now).await;
                let on_fresh =
                    hit_all(store, &[Check::new(fresh.clone(), after.clone(), 1)], now).await;
                assert_eq!(
                    summary(&on_changed),
                    summary(&on_fresh),
                    "{from} -> {to}, request {request}"
                );
            }
            let back = key("back", &name);
            let on_changed = hit_all(
                store,
                &[Check::new(changed.clone(), before.clone(), 2)],
                now,
            )
            .await;
            let on_fresh = hit_all(store, &[Check::new(back, before.clone(), 2)], now).await;
            assert_eq!(
                summary(&on_changed),
                summary(&on_fresh),
                "{from} -> {to} -> {from}"
            );
        }
    }
}

/// Two suite tests of `$body`: one for every algorithm, one for those a batched store runs.
macro_rules! every_algorithm_and_the_batchable {
    ($body:ident => $all:ident, $batchable:ident) => {
        #[doc = concat!("`", stringify!($body), "` for every algorithm.")]
        pub async fn $all(store: impl Store) {
            $body(&store, &Algorithm::ALL).await;
        }

        #[doc = concat!("`", stringify!($body), "` for the algorithms a batched store runs.")]
        pub async fn $batchable(store: impl Store) {
            $body(&store, &BATCHABLE).await;
        }
    };
}

every_algorithm_and_the_batchable!(algorithm_changes_start_fresh =>
    an_algorithm_change_starts_from_fresh_state,
    a_batchable_algorithm_change_starts_from_fresh_state);

/// The keys of one limit named `name` for `side`, on three hash slots in SPEC §1's order: a
/// global ceiling, the client's IP, the client.
fn keys_on_three_slots(side: &str, name: &str) -> [String; 3] {
    [
        format!("fgtest:{{global:{side}}}:default:{name}"),
        format!("fgtest:{{ip:{side}}}:default:{name}"),
        format!("fgtest:{{client:{side}}}:default:{name}"),
    ]
}

/// SPEC §1's order-and-refund rule across hash slots (on a cluster, across nodes): when a later
/// limit denies, what the earlier ones took is given back and the ones never reached are left
/// alone. For every algorithm of the other two limits (so every refund path of the script runs),
/// with the per-IP or the per-client limit denying: afterwards each of them decides exactly as
/// a twin that saw only the admitted request.
async fn refunds_across_slots(store: &dyn Store, algorithms: &[Algorithm]) {
    let now = at(secs(5));
    for &algorithm in algorithms {
        for denier in [1, 2] {
            let name = format!("{algorithm}-{denier}");
            let shared = named(&name, algorithm, 5, secs(60));
            let strict = named(&name, Algorithm::FixedWindow, 1, secs(60));
            let checks = |side: &str| -> Vec<Check> {
                keys_on_three_slots(side, &name)
                    .into_iter()
                    .enumerate()
                    .map(|(index, key)| {
                        let limit = if index == denier { &strict } else { &shared };
                        Check::new(key, limit.clone(), 1)
                    })
                    .collect()
            };
            let (refunded, twin) = (checks("refunded"), checks("twin"));
            assert!(hit_all(store, &refunded, now).await.is_allowed(), "{name}");
            assert!(hit_all(store, &twin, now).await.is_allowed(), "{name}");
            let denied = hit_all(store, &refunded, now).await;
            assert!(!denied.is_allowed(), "{name}");
            assert!(!summary(&denied)[denier].0, "{name}: limit {denier} denies");
            for index in (0..3).filter(|&index| index != denier) {
                let alone = hit_all(store, &refunded[index..=index], now).await;
                let twin_alone = hit_all(store, &twin[index..=index], now).await;
                assert_eq!(
                    summary(&alone),
                    summary(&twin_alone),
                    "{name}: limit {index} after the denial"
                );
            }
        }
    }
}

every_algorithm_and_the_batchable!(refunds_across_slots =>
    limits_on_different_slots_are_refunded_when_a_later_one_denies,
    batchable_limits_on_different_slots_are_refunded);

/// SPEC §2 across slots: when an earlier limit denies, the later ones (never charged) are still
/// evaluated at the request's cost, so that the promised wait is the longest: a retry at the
/// global ceiling's short wait would be denied by the client's hourly limit.
pub async fn the_longest_wait_across_slots_is_promised(store: impl Store) {
    let global = named("burst", Algorithm::TokenBucket, 1, secs(1));
    let hourly = named("hourly", Algorithm::FixedWindow, 1, secs(3600));
    let [global_key, _, client_key] = keys_on_three_slots("longest", "wait");
    let checks = [
        Check::new(global_key, global, 1),
        Check::new(client_key, hourly, 1),
    ];
    assert!(hit_all(&store, &checks, at(ms(0))).await.is_allowed());
    let denied = hit_all(&store, &checks, at(ms(500))).await;
    assert!(!denied.is_allowed());
    assert_eq!(
        summary(&denied),
        vec![
            (false, 0, ms(500), Some(ms(500))),
            (false, 0, secs(3600) - ms(500), Some(secs(3600) - ms(500))),
        ]
    );
    assert_eq!(denied.retry_after(), Some(secs(3600) - ms(500)));
}

/// Concurrency leases of one request on three slots are all released by one release call.
pub async fn leases_on_different_slots_are_all_released(store: impl Store) {
    let limit = limit(Algorithm::Concurrency, 1, secs(30));
    let checks: Vec<Check> = keys_on_three_slots("lease", "test")
        .into_iter()
        .map(|key| Check::new(key, limit.clone(), 1))
        .collect();
    let first = hit_all(&store, &checks, at(ms(0))).await;
    assert!(first.is_allowed());
    assert_eq!(first.leases().len(), 3);
    assert!(!hit_all(&store, &checks, at(ms(10))).await.is_allowed());
    store
        .release(first.leases().to_vec())
        .await
        .expect("released");
    assert!(
        hit_all(&store, &checks, at(ms(20))).await.is_allowed(),
        "every lease released"
    );
}

async fn peek_now(store: &dyn Store, checks: &[Check], now: Timestamp) -> Decision {
    store.peek(checks, Some(now)).await.expect("store peeks")
}

/// A peek reads a limit as it stands and changes nothing. After three admissions,
/// it shows what the last one's answer showed (twice the same); the key then decides exactly
/// as a twin that was never peeked at, admitted or, once exhausted, denied with the very
/// answer the peek gave.
async fn peeks_change_nothing(store: &dyn Store, algorithms: &[Algorithm]) {
    let now = at(secs(7));
    for &algorithm in algorithms {
        let name = format!("peek-{algorithm}");
        let limit = named(&name, algorithm, 5, secs(60));
        let peeked = [Check::new(key("peeked", &name), limit.clone(), 1)];
        let twin = [Check::new(key("twin", &name), limit.clone(), 1)];
        let fresh = peek_now(store, &peeked, now).await;
        assert!(fresh.is_allowed(), "{algorithm}: a fresh key admits");
        let mut last = None;
        for _ in 0..3 {
            last = Some(hit_all(store, &peeked, now).await);
            hit_all(store, &twin, now).await;
        }
        let last = last.expect("three admissions");
        let first_look = peek_now(store, &peeked, now).await;
        let second_look = peek_now(store, &peeked, now).await;
        assert_eq!(summary(&first_look), summary(&second_look), "{algorithm}");
        assert!(
            first_look.leases().is_empty(),
            "{algorithm}: a peek takes no lease"
        );
        assert_eq!(
            first_look.limits()[0].remaining,
            last.limits()[0].remaining,
            "{algorithm}: the remaining the last answer showed"
        );
        loop {
            let on_peeked = hit_all(store, &peeked, now).await;
            let on_twin = hit_all(store, &twin, now).await;
            assert_eq!(summary(&on_peeked), summary(&on_twin), "{algorithm}");
            if !on_peeked.is_allowed() {
                let look = peek_now(store, &peeked, now).await;
                assert_eq!(summary(&look), summary(&on_peeked), "{algorithm}: denied");
                assert!(!look.is_allowed());
                break;
            }
        }
    }
}

every_algorithm_and_the_batchable!(peeks_change_nothing =>
    a_peek_changes_nothing,
    a_batchable_peek_changes_nothing);

/// A reset key starts again as a fresh one; other keys keep their state; keys that
/// hold nothing count for nothing.
async fn resets_forget_a_key(store: &dyn Store, algorithms: &[Algorithm]) {
    let now = at(secs(9));
    for &algorithm in algorithms {
        let name = format!("reset-{algorithm}");
        let limit = named(&name, algorithm, 2, secs(60));
        let [reset, kept, fresh] =
            ["reset", "kept", "fresh"].map(|side| [Check::new(key(side, &name), limit.clone(), 1)]);
        for checks in [&reset, &kept] {
            while hit_all(store, checks, now).await.is_allowed() {}
        }
        let removed = store
            .reset(&[reset[0].key.clone(), key("never-used", &name).into()])
            .await
            .expect("store resets");
        assert_eq!(removed, 1, "{algorithm}: one key held state");
        let after = hit_all(store, &reset, now).await;
        assert!(
            after.is_allowed(),
            "{algorithm}: admitted right after the reset"
        );
        assert_eq!(
            summary(&after),
            summary(&hit_all(store, &fresh, now).await),
            "{algorithm}: as a fresh key"
        );
        assert!(
            !hit_all(store, &kept, now).await.is_allowed(),
            "{algorithm}: other keys untouched"
        );
    }
}

every_algorithm_and_the_batchable!(resets_forget_a_key =>
    a_reset_key_starts_fresh,
    a_reset_batchable_key_starts_fresh);

/// A reset frees a concurrency key's leases; the release its old holder sends later
/// frees nothing of the new holder's.
pub async fn a_reset_frees_leases(store: impl Store) {
    let limit = limit(Algorithm::Concurrency, 1, secs(30));
    let checks = [Check::new(key("leases", "test"), limit, 1)];
    let old = hit_all(&store, &checks, at(ms(0))).await;
    assert!(old.is_allowed());
    assert!(!hit_all(&store, &checks, at(ms(1))).await.is_allowed());
    store.reset(&[checks[0].key.clone()]).await.expect("reset");
    let new = hit_all(&store, &checks, at(ms(2))).await;
    assert!(new.is_allowed(), "the lease was freed");
    store.release(old.leases().to_vec()).await.expect("release");
    assert!(
        !hit_all(&store, &checks, at(ms(3))).await.is_allowed(),
        "the new holder's lease is still held"
    );
}

/// SPEC §9: post-charges never deny, may leave debt, and the wait a later denial
/// promises covers the debt exactly: denied just before it, admitted at it. A concurrency
/// limit is never post-charged.
async fn post_charges_leave_debt(store: &dyn Store, algorithms: &[Algorithm]) {
    let now = at(secs(11));
    for &algorithm in algorithms {
        let name = format!("charge-{algorithm}");
        let limit = named(&name, algorithm, 100, secs(100));
        let checks = [Check::new(key("charged", &name), limit.clone(), 1)];
        let mut admitted = 0;
        while hit_all(store, &checks, now).await.is_allowed() {
            admitted += 1;
            let post = [Check::new(checks[0].key.clone(), limit.clone(), 39)];
            store.charge(&post, Some(now)).await.expect("store charges");
            assert!(admitted <= 100, "{algorithm}: never denied");
        }
        if algorithm == Algorithm::Concurrency {
            assert_eq!(admitted, 100, "concurrency: leases only");
            continue;
        }
        let denied = hit_all(store, &checks, now).await;
        let wait = denied.retry_after().expect("a wait is promised");
        assert!(wait > Duration::ZERO, "{algorithm}");
        let just_before = Timestamp::from_micros(now.as_micros() + wait.as_micros() as u64 - 1_000);
        assert!(
            !hit_all(store, &checks, just_before).await.is_allowed(),
            "{algorithm}: admitted {admitted}, wait {wait:?}: denied before it ends"
        );
        let at_wait = Timestamp::from_micros(now.as_micros() + wait.as_micros() as u64);
        assert!(
            hit_all(store, &checks, at_wait).await.is_allowed(),
            "{algorithm}: admitted {admitted}, wait {wait:?}: admitted once it ends"
        );
    }
}

every_algorithm_and_the_batchable!(post_charges_leave_debt =>
    post_charges_leave_a_debt_that_the_promised_wait_covers,
    batchable_post_charges_leave_a_debt_that_the_promised_wait_covers);

/// SPEC §9's settlement: a response that cost less than its estimate gets the difference
/// back, never more than was charged, never above the limit's capacity, and a window's units
/// only to the window they were counted in. Algorithms that cannot give back (the log, the
/// leaky bucket, concurrency) are left as they stand.
async fn refunds_settle_estimates(store: &dyn Store, algorithms: &[Algorithm]) {
    // 100 s windows: the first one here is [1000 s, 1100 s) after T0's own alignment.
    let charged_at = at(secs(1_050));
    for &algorithm in algorithms {
        let name = format!("refund-{algorithm}");
        let limit = named(&name, algorithm, 10, secs(100));
        let key = key("refunded", &name);
        let check = |cost| [Check::new(key.clone(), limit.clone(), cost)];
        assert!(hit_all(store, &check(8), charged_at).await.is_allowed());
        let before = peek_now(store, &check(1), charged_at).await;
        // The response reports 3 of the estimated 8.
        store
            .refund(&check(5), charged_at, Some(charged_at))
            .await
            .expect("store refunds");
        let after = peek_now(store, &check(1), charged_at).await;
        if !algorithm.is_batchable() {
            assert_eq!(summary(&after), summary(&before), "{algorithm}: left alone");
            continue;
        }
        assert_eq!(after.limits()[0].remaining, 7, "{algorithm}: 3 of 10 used");
        // However much is refunded, the limit holds its capacity and no more.
        store
            .refund(&check(50), charged_at, Some(charged_at))
            .await
            .expect("store refunds");
        for request in 0..10 {
            assert!(
                hit_all(store, &check(1), charged_at).await.is_allowed(),
                "{algorithm}: request {request} of the 10 the limit holds"
            );
        }
        assert!(
            !hit_all(store, &check(1), charged_at).await.is_allowed(),
            "{algorithm}: an 11th is refused"
        );
    }
}

every_algorithm_and_the_batchable!(refunds_settle_estimates =>
    refunds_settle_estimates_and_never_exceed_the_limit,
    batchable_refunds_settle_estimates_and_never_exceed_the_limit);

/// A window's units counted in a window that has ended are not given back to the next one:
/// its counter holds other requests' units.
pub async fn a_refund_never_reaches_into_the_next_window(store: impl Store) {
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindowCounter] {
        let name = format!("late-refund-{algorithm}");
        let limit = named(&name, algorithm, 10, secs(100));
        let key = key("late", &name);
        let check = |cost| [Check::new(key.clone(), limit.clone(), cost)];
        let charged_at = at(secs(1_090));
        let next_window = at(secs(1_100) + ms(500));
        assert!(hit_all(&store, &check(8), charged_at).await.is_allowed());
        assert!(hit_all(&store, &check(2), next_window).await.is_allowed());
        let before = peek_now(&store, &check(1), next_window).await;
        store
            .refund(&check(8), charged_at, Some(next_window))
            .await
            .expect("store refunds");
        let after = peek_now(&store, &check(1), next_window).await;
        assert_eq!(
            after.limits()[0].remaining,
            before.limits()[0].remaining,
            "{algorithm}: the next window's count is its own"
        );
    }
    // The next window has begun but no request has moved the key into it yet: the units are
    // still the past window's (a sliding counter's next window weighs them), none given back.
    let limit = named(
        "quiet-window",
        Algorithm::SlidingWindowCounter,
        10,
        secs(100),
    );
    let quiet = [Check::new(key("quiet", "quiet-window"), limit.clone(), 8)];
    assert!(hit_all(&store, &quiet, at(secs(1_090))).await.is_allowed());
    let next_window = at(secs(1_100) + ms(500));
    let one = [Check::new(quiet[0].key.clone(), limit, 1)];
    let before = peek_now(&store, &one, next_window).await;
    store
        .refund(&quiet, at(secs(1_090)), Some(next_window))
        .await
        .expect("store refunds");
    let after = peek_now(&store, &one, next_window).await;
    assert_eq!(
        after.limits()[0].remaining,
        before.limits()[0].remaining,
        "the previous window's 8 still weigh on the next"
    );
}

/// A fixed window on the calendar (a month from the 31st, in New York): April's period runs
/// from March 31 to April 30 at midnight there, so the wait a denial promises ends at that
/// midnight, and the first microsecond of the next period admits again; the period after
/// runs to May 31.
pub async fn calendar_periods_end_at_the_periods_real_end(store: impl Store) {
    use floodgate::calendar::{CalendarPeriod, Period};
    let month = CalendarPeriod::new(Period::Month, "America/New_York")
        .and_then(|month| month.anchored("31"))
        .expect("a calendar period");
    let limit = Arc::new(
        Limit::builder("monthly")
            .algorithm(Algorithm::FixedWindow)
            .limit(3)
            .calendar(month)
            .build()
            .expect("a calendar limit"),
    );
    let checks = [Check::new(key("calendar", "monthly"), limit, 1)];
    // 2026-04-29T12:00:00-04:00 and the period's end, 2026-04-30T00:00:00-04:00.
    let noon = Timestamp::from_secs(1_777_478_400);
    let period_end = Timestamp::from_secs(1_777_521_600);
    for request in 0..3 {
        assert!(
            hit_all(&store, &checks, noon).await.is_allowed(),
            "request {request}"
        );
    }
    let denied = hit_all(&store, &checks, noon).await;
    assert!(!denied.is_allowed());
    assert_eq!(
        denied.retry_after(),
        Some(secs(12 * 3600)),
        "until midnight in New York"
    );
    assert_eq!(denied.limits()[0].reset_after, secs(12 * 3600));
    let just_before = Timestamp::from_micros(period_end.as_micros() - 1);
    assert!(!hit_all(&store, &checks, just_before).await.is_allowed());
    let next = hit_all(&store, &checks, period_end).await;
    assert!(next.is_allowed(), "a new period at midnight");
    assert_eq!(next.limits()[0].remaining, 2);
    // April 30 to May 31: 31 days.
    assert_eq!(next.limits()[0].reset_after, secs(31 * 86_400));
}

/// Daily periods across New York's daylight-saving changes (issue 45): the day the clocks go
/// back lasts 25 hours, the day they go forward 23, so a request half an hour after midnight
/// waits 24.5 and 22.5 hours for the next one, and the next day is 24 hours long again.
pub async fn calendar_days_of_a_daylight_saving_change_last_25_or_23_hours(store: impl Store) {
    use floodgate::calendar::{CalendarPeriod, Period};
    let day = CalendarPeriod::new(Period::Day, "America/New_York").expect("a calendar period");
    let limit = Arc::new(
        Limit::builder("daily")
            .algorithm(Algorithm::FixedWindow)
            .limit(1)
            .calendar(day)
            .build()
            .expect("a calendar limit"),
    );
    // (00:30 local on the day of the change, the next midnight, how long till then, in UTC
    // seconds): 2026-11-01T00:30-04:00, 2026-11-02T00:00-05:00; 2026-03-08T00:30-05:00,
    // 2026-03-09T00:00-04:00.
    let changes = [
        ("back", 1_793_507_400, 1_793_595_600, 24 * 3600 + 1800),
        ("forward", 1_772_947_800, 1_773_028_800, 22 * 3600 + 1800),
    ];
    for (change, half_past_midnight, next_midnight, wait) in changes {
        let checks = [Check::new(key(change, "daily"), limit.clone(), 1)];
        let at = Timestamp::from_secs(half_past_midnight);
        let admitted = hit_all(&store, &checks, at).await;
        assert!(admitted.is_allowed(), "{change}");
        assert_eq!(admitted.limits()[0].reset_after, secs(wait), "{change}");
        let denied = hit_all(&store, &checks, at).await;
        assert!(!denied.is_allowed(), "{change}");
        assert_eq!(denied.retry_after(), Some(secs(wait)), "{change}");
        let just_before = Timestamp::from_micros(next_midnight * 1_000_000 - 1);
        assert!(
            !hit_all(&store, &checks, just_before).await.is_allowed(),
            "{change}"
        );
        let next = hit_all(&store, &checks, Timestamp::from_secs(next_midnight)).await;
        assert!(next.is_allowed(), "{change}: a new day at midnight");
        assert_eq!(next.limits()[0].reset_after, secs(24 * 3600), "{change}");
    }
}

/// The token bucket case of SPEC §9 in figures: 100 tokens, requests that turn out to
/// cost 40: three admitted (the third leaves 20 tokens of debt), the fourth told to wait for 21
/// tokens at one a second.
pub async fn a_token_budget_admits_three_forty_token_requests(store: impl Store) {
    let limit = named("tokens", Algorithm::TokenBucket, 100, secs(100));
    let checks = [Check::new(key("llm", "tokens"), limit.clone(), 1)];
    let post = [Check::new(key("llm", "tokens"), limit, 39)];
    let now = at(secs(1));
    for request in 0..3 {
        assert!(
            hit_all(&store, &checks, now).await.is_allowed(),
            "request {request}"
        );
        store.charge(&post, Some(now)).await.expect("charged");
    }
    let denied = hit_all(&store, &checks, now).await;
    assert!(!denied.is_allowed());
    assert_eq!(denied.retry_after(), Some(secs(21)));
    assert_eq!(denied.limits()[0].remaining, 0);
}

/// Stamps out every test above for one store. `$make_store` is an async expression that
/// yields a fresh, empty store.
#[macro_export]
macro_rules! conformance_suite {
    (@each $make_store:expr; $($test:ident,)*) => {
        $(
            #[tokio::test]
            async fn $test() {
                let store = $make_store.await;
                conformance::$test(store).await;
            }
        )*
    };
    ($make_store:expr) => {
        $crate::batchable_conformance_suite!($make_store);
        $crate::conformance_suite!(@each $make_store;
            sliding_window_log_trailing_window,
            leaky_bucket_delays_then_rejects,
            concurrency_leases_release_and_expire,
            retry_after_is_exact_for_every_algorithm,
            an_algorithm_change_starts_from_fresh_state,
            limits_on_different_slots_are_refunded_when_a_later_one_denies,
            leases_on_different_slots_are_all_released,
            a_peek_changes_nothing,
            a_reset_key_starts_fresh,
            a_reset_frees_leases,
            post_charges_leave_a_debt_that_the_promised_wait_covers,
            refunds_settle_estimates_and_never_exceed_the_limit,
        );
    };
}

/// The tests whose limits can all run batched (token bucket, GCRA, fixed and sliding window
/// counters): the part of the suite a batched store must pass too.
#[macro_export]
macro_rules! batchable_conformance_suite {
    ($make_store:expr) => {
        $crate::conformance_suite!(@each $make_store;
            token_bucket_burst_then_refill,
            gcra_burst_then_refill,
            token_bucket_burst_above_rate,
            gcra_burst_above_rate,
            fixed_window_counts_per_aligned_window,
            fixed_window_boundary_burst,
            sliding_window_counter_weights_previous_window,
            several_limits_are_all_or_nothing,
            binding_limit_has_least_room,
            costs_are_charged_and_oversized_costs_never_pass,
            keys_are_independent,
            a_batchable_algorithm_change_starts_from_fresh_state,
            batchable_limits_on_different_slots_are_refunded,
            the_longest_wait_across_slots_is_promised,
            a_batchable_peek_changes_nothing,
            a_reset_batchable_key_starts_fresh,
            batchable_post_charges_leave_a_debt_that_the_promised_wait_covers,
            a_token_budget_admits_three_forty_token_requests,
            batchable_refunds_settle_estimates_and_never_exceed_the_limit,
            a_refund_never_reaches_into_the_next_window,
            calendar_periods_end_at_the_periods_real_end,
            calendar_days_of_a_daylight_saving_change_last_25_or_23_hours,
        );
    };
}
