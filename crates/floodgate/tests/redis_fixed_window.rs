//! Fixed windows at one command per limit (issue 35): a decision of fixed windows decided by
//! the server's clock increments each count (`HINCRBY`) and reads nothing where the stored
//! state allows it, and goes the full way (read, decide, write) where it does not: a window
//! that starts, a limit that would deny, a key of another type or of corrupted data. These
//! tests hold that path to what the full one decides, against a real redis-server.
//!
//! Timing: the tests decide by the server's clock on windows of an hour, placed clear of a
//! window's end first (`clear_of_window_end`), so that no window ends while a test counts; the
//! lagging caller's test places itself in a one-second window by the server's clock.

use floodgate_test_support as support;

use std::sync::Arc;
use std::time::Duration;

use floodgate::store::{Check, RedisStore};
use floodgate::time::Timestamp;
use floodgate::{Algorithm, Limit, Store};
use support::{RedisServer, clear_of_window_end};

const HOUR: Duration = Duration::from_secs(3600);

fn fixed_window(name: &str, limit: u64) -> Arc<Limit> {
    Arc::new(
        Limit::builder(name)
            .algorithm(Algorithm::FixedWindow)
            .limit(limit)
            .window(HOUR)
            .build()
            .unwrap(),
    )
}

/// A store that calls Redis for every decision (no deny cache) and one at a time (no
/// coalescing), so that command counts are per decision.
fn store(server: &RedisServer) -> RedisStore {
    RedisStore::builder(server.url())
        .timeout(Duration::from_secs(5))
        .deny_cache(false)
        .coalesce(0)
        .build()
        .unwrap()
}

/// Whether a decision of `checks` by the server's clock admits.
async fn admitted(store: &RedisStore, checks: &[Check]) -> bool {
    store
        .check_and_consume(checks, None)
        .await
        .unwrap()
        .is_allowed()
}

/// The server's clock, in microseconds since the epoch.
fn server_now(server: &RedisServer) -> u64 {
    let time: Vec<String> = server.command(&["TIME"]);
    time[0].parse::<u64>().unwrap() * 1_000_000 + time[1].parse::<u64>().unwrap()
}

fn count_of(server: &RedisServer, key: &str) -> Option<u64> {
    server.command::<Option<u64>>(&["HGET", key, "c"])
}

/// Calls of `commands` since the last `CONFIG RESETSTAT`, by name.
fn calls(server: &RedisServer, commands: &[&str]) -> Vec<(String, u64)> {
    commands
        .iter()
        .map(|command| ((*command).to_owned(), server.command_calls(command)))
        .collect()
}

/// The cost that makes the difference: after the first decision of a window, an admitted
/// decision of one limit runs `HINCRBY` alone (with `TIME`), and one of three limits three
/// `HINCRBY`s; no read of the hash and no other write. On the full path each limit was an
/// `HMGET` and an `HSET`.
#[tokio::test]
async fn an_admitted_decision_of_fixed_windows_costs_one_command_per_limit() {
    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let store = store(&server);
    let one = [Check::new("fgtest:{a}:r:one", fixed_window("one", 1000), 1)];
    let three: Vec<Check> = ["x", "y", "z"]
        .iter()
        .map(|name| {
            Check::new(
                format!("fgtest:{{a}}:r:{name}"),
                fixed_window(name, 1000),
                1,
            )
        })
        .collect();
    // The first decision of each key starts its window: the full path.
    assert!(admitted(&store, &one).await);
    assert!(admitted(&store, &three).await);

    let _: () = server.command(&["CONFIG", "RESETSTAT"]);
    for _ in 0..20 {
        assert!(admitted(&store, &one).await);
        assert!(admitted(&store, &three).await);
    }
    let counted = calls(
        &server,
        &["hincrby", "hmget", "hset", "hdel", "pexpire", "time"],
    );
    let expected: Vec<(String, u64)> = [
        ("hincrby", 20 + 60),
        ("hmget", 0),
        ("hset", 0),
        ("hdel", 0),
        ("pexpire", 0),
        ("time", 40),
    ]
    .iter()
    .map(|(name, calls)| ((*name).to_owned(), *calls))
    .collect();
    assert_eq!(counted, expected);
    assert_eq!(count_of(&server, "fgtest:{a}:r:one"), Some(21));
    assert_eq!(count_of(&server, "fgtest:{a}:r:z"), Some(21));
}

/// Remaining and reset as the full path reports them: the count down to zero, then a denial
/// whose wait is the window's rest, and a peek (the full path) that agrees with the last
/// admission.
#[tokio::test]
async fn fixed_windows_at_once_report_what_the_full_path_reports() {
    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let store = store(&server);
    let checks = [Check::new("fgtest:{b}:r:w", fixed_window("w", 5), 1)];
    for expected in (0..5).rev() {
        let before = server_now(&server);
        let decision = store.check_and_consume(&checks, None).await.unwrap();
        let status = &decision.limits()[0];
        assert!(status.allowed);
        assert_eq!(status.remaining, expected);
        let window_end = (before / 3_600_000_000 + 1) * 3_600_000_000;
        let reset = status.reset_after.as_micros() as u64;
        assert!(
            reset <= window_end - before && reset + 1_000_000 > window_end - before,
            "reset {reset} µs against {} µs to the window's end",
            window_end - before
        );
    }
    let peeked = store.peek(&checks, None).await.unwrap();
    assert_eq!(peeked.limits()[0].remaining, 0);
    let denied = store.check_and_consume(&checks, None).await.unwrap();
    assert!(!denied.is_allowed());
    // At least the minute clear_of_window_end left, at most the hour.
    let wait = denied.retry_after().unwrap();
    assert!(wait <= HOUR && wait >= Duration::from_secs(59), "{wait:?}");
    assert_eq!(count_of(&server, "fgtest:{b}:r:w"), Some(5));
}

/// All or nothing across limits: where a later limit denies, what the fast path added to the
/// earlier ones is taken back before the full path decides, so the counts are as before.
#[tokio::test]
async fn a_limit_that_denies_leaves_the_other_counts_as_they_were() {
    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let store = store(&server);
    let wide = fixed_window("wide", 100);
    let narrow = fixed_window("narrow", 2);
    let both = [
        Check::new("fgtest:{c}:r:wide", wide.clone(), 1),
        Check::new("fgtest:{c}:r:narrow", narrow, 1),
    ];
    for _ in 0..2 {
        assert!(admitted(&store, &both).await);
    }
    for _ in 0..3 {
        let denied = store.check_and_consume(&both, None).await.unwrap();
        assert!(!denied.is_allowed());
        assert_eq!(
            denied.limits()[0].remaining,
            98,
            "the wide limit is not charged"
        );
    }
    assert_eq!(count_of(&server, "fgtest:{c}:r:wide"), Some(2));
    assert_eq!(count_of(&server, "fgtest:{c}:r:narrow"), Some(2));
    // A cost the limit can never hold, on a key never used: denied, and no count is left
    // behind (the field the increment created is removed).
    let huge = [Check::new("fgtest:{c}:r:huge", fixed_window("huge", 3), 4)];
    let denied = store.check_and_consume(&huge, None).await.unwrap();
    assert!(denied.is_never_admissible());
    assert_eq!(server.command::<u64>(&["EXISTS", "fgtest:{c}:r:huge"]), 0);
    let alone = [Check::new("fgtest:{c}:r:wide", wide, 1)];
    let decision = store.check_and_consume(&alone, None).await.unwrap();
    assert_eq!(decision.limits()[0].remaining, 97);
}

/// Keys the fast path cannot count: another algorithm's string (a GCRA's), a hash without
/// the window (another algorithm's), and a count that is no number. The first two are fresh
/// keys (SPEC §3), the last fails as corrupted data, and none is changed by the attempt.
#[tokio::test]
async fn keys_of_other_shapes_go_the_full_way() {
    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let store = store(&server);
    let limit = fixed_window("f", 10);

    let _: () = server.command(&["SET", "fgtest:{d}:r:string", "123456"]);
    let on_string = [Check::new("fgtest:{d}:r:string", limit.clone(), 1)];
    let decision = store.check_and_consume(&on_string, None).await.unwrap();
    assert_eq!(decision.limits()[0].remaining, 9);

    let _: () = server.command(&["HSET", "fgtest:{d}:r:bucket", "l", "5", "u", "7"]);
    let on_bucket = [Check::new("fgtest:{d}:r:bucket", limit.clone(), 1)];
    let decision = store.check_and_consume(&on_bucket, None).await.unwrap();
    assert_eq!(decision.limits()[0].remaining, 9);
    assert_eq!(
        server.command::<Option<String>>(&["HGET", "fgtest:{d}:r:bucket", "l"]),
        None,
        "another algorithm's fields are cleared"
    );

    let window_start = server_now(&server) / 3_600_000_000 * 3_600_000_000;
    let _: () = server.command(&[
        "HSET",
        "fgtest:{d}:r:corrupted",
        "w",
        &window_start.to_string(),
        "c",
        "not a number",
    ]);
    let on_corrupted = [Check::new("fgtest:{d}:r:corrupted", limit, 1)];
    assert!(store.check_and_consume(&on_corrupted, None).await.is_err());
    assert_eq!(
        server.command::<String>(&["HGET", "fgtest:{d}:r:corrupted", "c"]),
        "not a number"
    );
}

/// Many callers on one key through two stores, coalesced: exactly the limit admitted, with the
/// fast path taking every admission after the window's first and the reverts of the denials
/// keeping the count at the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_admit_exactly_the_limit() {
    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let limit = fixed_window("hot", 300);
    let nodes: Vec<RedisStore> = (0..2)
        .map(|_| {
            RedisStore::builder(server.url())
                .timeout(Duration::from_secs(5))
                .deny_cache(false)
                .build()
                .unwrap()
        })
        .collect();
    let mut tasks = Vec::new();
    for node in &nodes {
        for _ in 0..32 {
            let (node, limit) = (node.clone(), limit.clone());
            tasks.push(tokio::spawn(async move {
                let checks = [Check::new("fgtest:{hot}:r:hot", limit, 1)];
                let mut admitted = 0u64;
                for _ in 0..20 {
                    admitted += u64::from(
                        node.check_and_consume(&checks, None)
                            .await
                            .unwrap()
                            .is_allowed(),
                    );
                }
                admitted
            }));
        }
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    assert_eq!(admitted, 300, "64 callers × 20 decisions on a limit of 300");
    assert_eq!(count_of(&server, "fgtest:{hot}:r:hot"), Some(300));
    assert!(server.command_calls("hincrby") > 0, "the fast path ran");
}

/// A write decided at a caller's time a little behind the server's (a later slot of a
/// decision on a cluster goes at the first slot's time) expires by the server's clock at the
/// window's end, not later: the fast path counts any hash that is there as the current
/// window's. Fails without the cap (the hash outlived its window by the caller's lag).
#[tokio::test]
async fn a_write_at_a_lagging_callers_time_expires_at_the_windows_end_by_the_servers_clock() {
    let server = RedisServer::start();
    let store = store(&server);
    let second = Duration::from_secs(1);
    let limit = Arc::new(
        Limit::builder("lag")
            .algorithm(Algorithm::FixedWindow)
            .limit(10)
            .window(second)
            .build()
            .unwrap(),
    );
    let checks = [Check::new("fgtest:{e}:r:lag", limit, 1)];
    // Behind by 300 ms, in the server's window: at least 400 ms into it (the clock is the only
    // signal of where a window is).
    let into_second = server_now(&server) % 1_000_000;
    if into_second < 400_000 {
        std::thread::sleep(Duration::from_micros(400_000 - into_second));
    }
    let lagging = server_now(&server) - 300_000;
    let window_end = (lagging / 1_000_000 + 1) * 1_000_000;
    assert!(
        store
            .check_and_consume(&checks, Some(Timestamp::from_micros(lagging)))
            .await
            .unwrap()
            .is_allowed()
    );
    let pttl: i64 = server.command(&["PTTL", "fgtest:{e}:r:lag"]);
    let now = server_now(&server);
    if pttl >= 0 {
        let expires_at = now / 1000 + pttl as u64;
        assert!(
            expires_at <= window_end / 1000 + 1,
            "the hash expires at {expires_at} ms, its window ends at {} ms",
            window_end / 1000
        );
    }
}

/// Window boundaries by the server's clock: one caller deciding back to back on windows of
/// 50 ms, never near its limit, for a second (about 20 windows' starts, each met by a decision
/// within its first milliseconds). Each decision's remaining says which window it was
/// counted in: the first of a window (by the server's time it was decided at) starts from the
/// limit, the others go down by one. A hash still there in a window's first millisecond (its
/// expiry is to the millisecond) counted by the fast path would continue the old window's count.
#[tokio::test]
async fn every_window_starts_fresh_at_its_start_by_the_servers_clock() {
    let server = RedisServer::start();
    let store = store(&server);
    let window = Duration::from_millis(50);
    let limit = Arc::new(
        Limit::builder("edge")
            .algorithm(Algorithm::FixedWindow)
            .limit(1_000_000)
            .window(window)
            .build()
            .unwrap(),
    );
    let checks = [Check::new("fgtest:{g}:r:edge", limit, 1)];
    let window_micros = window.as_micros() as u64;
    let mut previous: Option<(u64, u64)> = None;
    let (mut windows, mut decisions) = (0, 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    while std::time::Instant::now() < deadline {
        let decision = store.check_and_consume(&checks, None).await.unwrap();
        assert!(decision.is_allowed());
        let at = decision.decided_at().as_micros() / window_micros;
        let remaining = decision.limits()[0].remaining;
        match previous {
            Some((window, before)) if window == at => assert_eq!(
                remaining,
                before - 1,
                "decision {decisions} at {} µs continues its window",
                decision.decided_at().as_micros()
            ),
            _ => {
                assert_eq!(
                    remaining,
                    999_999,
                    "decision {decisions} at {} µs starts its window",
                    decision.decided_at().as_micros()
                );
                windows += 1;
            }
        }
        previous = Some((at, remaining));
        decisions += 1;
    }
    assert!(windows >= 10, "{decisions} decisions met {windows} windows");
}
