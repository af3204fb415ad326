//! Fixed windows decided without the general machinery (issue 35): a decision of fixed windows
//! by the server's clock reads each hash's window alone (`HGET f`) and, where every limit is in
//! its current window, increments each count (`HINCRBY`), taking every increment back where a
//! limit would deny; anything else (a window that begins, a cost above a limit, a key of another
//! shape) goes to the full decision. These tests hold that path to what the full one decides,
//! against a real redis-server.
//!
//! Timing: the tests decide by the server's clock on windows of an hour, placed clear of a
//! window's end first (`clear_of_window_end`), so that no window ends while a test counts;
//! those about windows' starts use windows of 50 ms and one second, placed by the server's
//! clock.

use floodgate_test_support as support;

use std::sync::Arc;
use std::time::Duration;

use floodgate::store::{Check, RedisStore};
use floodgate::{Algorithm, Decision, Limit, Store};
use support::{RedisServer, clear_of_window_end};

const HOUR: Duration = Duration::from_secs(3600);

/// A fixed window of `limit` per hour.
fn fixed_window(name: &str, limit: u64) -> Arc<Limit> {
    fixed_window_of(name, limit, HOUR)
}

/// A fixed window of `limit` per `window`.
fn fixed_window_of(name: &str, limit: u64, window: Duration) -> Arc<Limit> {
    Arc::new(
        Limit::builder(name)
            .algorithm(Algorithm::FixedWindow)
            .limit(limit)
            .window(window)
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

/// The decision on one limit of `limit` on `key`, at `cost`, by the server's clock.
async fn decide_one(store: &RedisStore, key: &str, limit: &Arc<Limit>, cost: u64) -> Decision {
    store
        .check_and_consume(&[Check::new(key, limit.clone(), cost)], None)
        .await
        .unwrap()
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

/// What an admission costs: after the first decision of a window, an admitted decision of one
/// limit runs `TIME`, one `HGET` (of the window alone) and one `HINCRBY`, and one of three
/// limits three of each; no `HMGET` and no `HSET` (the full decision reads and writes with
/// them) and nothing else.
#[tokio::test]
async fn an_admitted_decision_of_fixed_windows_reads_and_counts_each_limit_once() {
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
        &[
            "hincrby", "hget", "hmget", "hset", "hdel", "pexpire", "time",
        ],
    );
    let expected: Vec<(String, u64)> = [
        ("hincrby", 20 + 60),
        ("hget", 20 + 60),
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

/// What a window's first decision costs where its key holds nothing: `TIME`, and per limit
/// the `HGET` that finds no window, an `HLEN` that finds the key empty, one `HSET` and its
/// `PEXPIRE`; no `HMGET` and no `DEL` (the full decision's read, and its clearing of another
/// algorithm's state). The hash and its expiry are what the full decision writes, and a key
/// that holds something else still goes the full way (`keys_of_other_shapes_go_the_full_way`).
#[tokio::test]
async fn a_window_that_begins_on_an_empty_key_is_written_at_once() {
    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let store = store(&server);
    let keys = ["fgtest:{b}:r:x", "fgtest:{b}:r:y", "fgtest:{b}:r:z"];
    let three: Vec<Check> = keys
        .iter()
        .zip(["x", "y", "z"])
        .map(|(key, name)| Check::new(*key, fixed_window(name, 1000), 2))
        .collect();
    // The library loaded, and nothing of these keys.
    assert!(
        admitted(
            &store,
            &[Check::new("fgtest:{b}:r:w", fixed_window("w", 9), 1)]
        )
        .await
    );
    let _: () = server.command(&["CONFIG", "RESETSTAT"]);
    let decision = store.check_and_consume(&three, None).await.unwrap();
    assert!(decision.is_allowed());
    assert!(decision.limits().iter().all(|limit| limit.remaining == 998));
    let counted = calls(
        &server,
        &[
            "time", "hget", "hlen", "hset", "pexpire", "hmget", "del", "hincrby",
        ],
    );
    let expected: Vec<(String, u64)> = [
        ("time", 1),
        ("hget", 3),
        ("hlen", 3),
        ("hset", 3),
        ("pexpire", 3),
        ("hmget", 0),
        ("del", 0),
        ("hincrby", 0),
    ]
    .iter()
    .map(|(name, calls)| ((*name).to_owned(), *calls))
    .collect();
    assert_eq!(counted, expected);
    let window_start = server_now(&server) / 3_600_000_000 * 3_600_000_000;
    for key in keys {
        let fields: Vec<Option<String>> = server.command(&["HMGET", key, "w", "f", "c"]);
        let start = Some(window_start.to_string());
        assert_eq!(
            fields,
            vec![start.clone(), start, Some("2".to_owned())],
            "{key}"
        );
        let ttl: i64 = server.command(&["PTTL", key]);
        let until_end = (window_start + 3_600_000_000 - server_now(&server)) as i64 / 1000;
        assert!(
            (until_end - 1000..=until_end + 1000).contains(&ttl),
            "{key}: {ttl}"
        );
    }
    // The next decision counts on them: the count path.
    let decision = store.check_and_consume(&three, None).await.unwrap();
    assert!(decision.limits().iter().all(|limit| limit.remaining == 996));
    assert_eq!(server.command_calls("hincrby"), 3);
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
            reset <= window_end - before && reset + 5_000_000 > window_end - before,
            "reset {reset} µs against {} µs to the window's end",
            window_end - before
        );
    }
    let peeked = store.peek(&checks, None).await.unwrap();
    assert_eq!(peeked.limits()[0].remaining, 0);
    // Denied for the rest of the hour, by the server's clock around the call.
    let before = server_now(&server);
    let denied = store.check_and_consume(&checks, None).await.unwrap();
    let after = server_now(&server);
    assert!(!denied.is_allowed());
    let wait = denied.retry_after().unwrap().as_micros() as u64;
    let window_end = (before / 3_600_000_000 + 1) * 3_600_000_000;
    assert!(
        wait <= window_end - before && wait >= window_end - after,
        "{wait} µs against {} to {} µs to the window's end",
        window_end - after,
        window_end - before
    );
    assert_eq!(count_of(&server, "fgtest:{b}:r:w"), Some(5));
}

/// All or nothing across limits: where a later limit would deny, the earlier limits' increments
/// are taken back and the full decision denies, so the counts are as before.
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
    // Counted and taken back three times: the same digits as before.
    assert_eq!(
        server.command::<String>(&["HGET", "fgtest:{c}:r:wide", "c"]),
        "2"
    );
    assert_eq!(count_of(&server, "fgtest:{c}:r:narrow"), Some(2));
    // A cost the limit can never hold, on a key never used: denied, and no count is left
    // behind.
    let huge = [Check::new("fgtest:{c}:r:huge", fixed_window("huge", 3), 4)];
    let denied = store.check_and_consume(&huge, None).await.unwrap();
    assert!(denied.is_never_admissible());
    assert_eq!(server.command::<u64>(&["EXISTS", "fgtest:{c}:r:huge"]), 0);
    let alone = [Check::new("fgtest:{c}:r:wide", wide, 1)];
    let decision = store.check_and_consume(&alone, None).await.unwrap();
    assert_eq!(decision.limits()[0].remaining, 97);
}

/// Keys that are no fixed window's current state: another algorithm's string (a GCRA's), a
/// hash without the window (a token bucket's), and a count that is no number. The first two
/// are fresh keys (SPEC §3), the last fails as corrupted data and is left as it was.
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

/// Many callers on one key through two stores, coalesced: exactly the limit admitted, every
/// admission after the window's first counted by an increment, and every denial's increment
/// taken back.
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
    // Each denial is counted, found over the limit and taken back, then decided in full.
    let denied = 64 * 20 - 300;
    assert_eq!(
        server.command_calls("hincrby"),
        299 + 2 * denied,
        "every admission but the window's first, and each denial twice"
    );
}

/// Window boundaries by the server's clock: one caller deciding back to back on windows of
/// 50 ms, never near its limit, for a second (about 20 windows' starts, each met by a decision
/// within its first milliseconds). Each decision's remaining says which window it was
/// counted in: the first of a window (by the server's time it was decided at) starts from the
/// limit, the others go down by one. A hash still there in a window's first millisecond (its
/// expiry is to the millisecond) must not be counted as the new window's.
#[tokio::test]
async fn every_window_starts_fresh_at_its_start_by_the_servers_clock() {
    let server = RedisServer::start();
    let store = store(&server);
    let window = Duration::from_millis(50);
    let limit = fixed_window_of("edge", 1_000_000, window);
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

/// A limit whose window length changes under the same key (an override, a reload) starts
/// fresh: the hash of a one-second window is not the current window of a minute's, although it
/// is there, and neither is a sliding window counter's hash (SPEC §3).
#[tokio::test]
async fn a_hash_of_another_window_length_or_algorithm_is_not_counted_on() {
    clear_of_window_end(Duration::from_secs(60), Duration::from_secs(5));
    let server = RedisServer::start();
    // Not in a minute's first second, where a second's window starts with the minute's.
    let into_minute = server_now(&server) % 60_000_000;
    if into_minute < 2_000_000 {
        std::thread::sleep(Duration::from_micros(2_000_000 - into_minute));
    }
    let store = store(&server);
    let per_second = fixed_window_of("changed", 10, Duration::from_secs(1));
    let per_minute = fixed_window_of("changed", 100, Duration::from_secs(60));
    let key = "fgtest:{h}:r:changed";
    for _ in 0..8 {
        assert!(admitted(&store, &[Check::new(key, per_second.clone(), 1)]).await);
    }
    let minute = [Check::new(key, per_minute.clone(), 1)];
    let decision = store.check_and_consume(&minute, None).await.unwrap();
    assert_eq!(decision.limits()[0].remaining, 99, "a fresh minute");
    let decision = store.check_and_consume(&minute, None).await.unwrap();
    assert_eq!(decision.limits()[0].remaining, 98);

    let sliding = Arc::new(
        Limit::builder("slides")
            .algorithm(Algorithm::SlidingWindowCounter)
            .limit(100)
            .window(Duration::from_secs(60))
            .build()
            .unwrap(),
    );
    let key = "fgtest:{h}:r:slides";
    for _ in 0..5 {
        assert!(admitted(&store, &[Check::new(key, sliding.clone(), 1)]).await);
    }
    let fixed = [Check::new(key, per_minute, 1)];
    let decision = store.check_and_consume(&fixed, None).await.unwrap();
    assert_eq!(decision.limits()[0].remaining, 99, "a fresh fixed window");
}

/// A count stored in a form `HINCRBY` refuses though it reads as a number ("05", written by
/// hand): the decision goes the full way, with the first limit's increment taken back, so a
/// decision of two limits whose second holds it counts each limit once, as the general
/// decision does.
#[tokio::test]
async fn a_count_in_another_form_is_decided_in_full_and_counted_once() {
    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let store = store(&server);
    let limit = fixed_window("form", 10);
    let (first, second) = ("fgtest:{i}:r:first", "fgtest:{i}:r:second");
    assert!(admitted(&store, &[Check::new(first, limit.clone(), 1)]).await);
    assert!(admitted(&store, &[Check::new(second, limit.clone(), 1)]).await);
    let _: () = server.command(&["HSET", second, "c", "05"]);
    let both = [
        Check::new(first, limit.clone(), 1),
        Check::new(second, limit, 1),
    ];
    let decision = store.check_and_consume(&both, None).await.unwrap();
    assert!(decision.is_allowed());
    assert_eq!(decision.limits()[1].remaining, 4);
    assert_eq!(count_of(&server, first), Some(2));
    assert_eq!(count_of(&server, second), Some(6));
}

/// A calendar period is a fixed window too: a day's quota in a zone where it is about noon (far
/// from the day's ends) is counted by an increment after its first decision, and reports the
/// same remaining as the general decision.
#[tokio::test]
async fn a_calendar_quota_is_counted_by_an_increment() {
    use floodgate::calendar::{CalendarPeriod, Period};
    let server = RedisServer::start();
    let store = store(&server);
    let (zone, _) = support::zone_near_noon();
    let day = CalendarPeriod::new(Period::Day, &zone).expect("a fixed-offset zone");
    let limit = Arc::new(
        Limit::builder("daily")
            .algorithm(Algorithm::FixedWindow)
            .limit(5)
            .calendar(day)
            .build()
            .unwrap(),
    );
    let checks = [Check::new("fgtest:{j}:r:daily", limit, 1)];
    assert!(admitted(&store, &checks).await);
    let _: () = server.command(&["CONFIG", "RESETSTAT"]);
    for expected in (0..4).rev() {
        let decision = store.check_and_consume(&checks, None).await.unwrap();
        assert_eq!(decision.limits()[0].remaining, expected);
    }
    assert_eq!(server.command_calls("hincrby"), 4);
    assert_eq!(server.command_calls("hset"), 0);
    assert!(!admitted(&store, &checks).await);
    assert_eq!(count_of(&server, "fgtest:{j}:r:daily"), Some(5));
}

/// A decision that is not all fixed windows (one limit is a GCRA) is the general decision's,
/// and reads no key before it: every limit is counted once, by `HSET`.
#[tokio::test]
async fn a_decision_with_another_algorithm_is_decided_in_full() {
    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let store = store(&server);
    let gcra = Arc::new(Limit::gcra("smooth", 100, HOUR).unwrap());
    let mixed = [
        Check::new("fgtest:{k}:r:window", fixed_window("window", 10), 1),
        Check::new("fgtest:{k}:r:smooth", gcra, 1),
    ];
    assert!(admitted(&store, &mixed).await);
    let _: () = server.command(&["CONFIG", "RESETSTAT"]);
    let decision = store.check_and_consume(&mixed, None).await.unwrap();
    assert!(decision.is_allowed());
    assert_eq!(decision.limits()[0].remaining, 8);
    assert_eq!(server.command_calls("hincrby"), 0);
    assert_eq!(
        server.command_calls("hmget"),
        1,
        "the window's hash, read once"
    );
    assert_eq!(count_of(&server, "fgtest:{k}:r:window"), Some(2));
}

/// A count beyond the limit (a post-charge left debt) is the general decision's: a request of
/// cost 0 is admitted with nothing remaining and one of cost 1 is denied, as on a fresh store.
#[tokio::test]
async fn a_count_beyond_the_limit_is_decided_in_full() {
    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let store = store(&server);
    let limit = fixed_window("debt", 5);
    let key = "fgtest:{l}:r:debt";
    assert!(admitted(&store, &[Check::new(key, limit.clone(), 1)]).await);
    store
        .charge(&[Check::new(key, limit.clone(), 6)], None)
        .await
        .unwrap();
    assert_eq!(count_of(&server, key), Some(7));
    let free = decide_one(&store, key, &limit, 0).await;
    assert!(free.is_allowed());
    assert_eq!(free.limits()[0].remaining, 0);
    assert!(!admitted(&store, &[Check::new(key, limit, 1)]).await);
    assert_eq!(count_of(&server, key), Some(7));
}

/// A rolling upgrade: hashes written by a version before the `f` field, which every node of both
/// versions counts on alike. A hash of the current window with `w` and `c` only is decided in
/// full once, counting on from its count, and gets `f`: the next decision is an increment. A
/// hash whose `f` is an earlier window's while `w` is the current one (an earlier version began
/// this window) is decided in full too, from its count.
#[tokio::test]
async fn hashes_of_an_earlier_version_are_counted_on_and_given_the_window() {
    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let store = store(&server);
    let limit = fixed_window("upgrade", 100);
    let window_start = server_now(&server) / 3_600_000_000 * 3_600_000_000;
    let (before_f, stale_f) = ("fgtest:{m}:r:before", "fgtest:{m}:r:stale");
    let start = window_start.to_string();
    let earlier = (window_start - 3_600_000_000).to_string();
    let _: () = server.command(&["HSET", before_f, "w", &start, "c", "7"]);
    let _: () = server.command(&["HSET", stale_f, "w", &start, "f", &earlier, "c", "9"]);

    let _: () = server.command(&["CONFIG", "RESETSTAT"]);
    let decision = decide_one(&store, before_f, &limit, 1).await;
    assert_eq!(decision.limits()[0].remaining, 92);
    assert_eq!(
        server.command::<String>(&["HGET", before_f, "f"]),
        start,
        "given the window"
    );
    let decision = decide_one(&store, stale_f, &limit, 1).await;
    assert_eq!(decision.limits()[0].remaining, 90);
    assert_eq!(server.command::<String>(&["HGET", stale_f, "f"]), start);
    assert_eq!(server.command_calls("hincrby"), 0, "both decided in full");

    for (key, remaining) in [(before_f, 91), (stale_f, 89)] {
        let decision = decide_one(&store, key, &limit, 1).await;
        assert_eq!(decision.limits()[0].remaining, remaining);
    }
    assert_eq!(
        server.command_calls("hincrby"),
        2,
        "then counted by an increment"
    );
}

/// A cost above the limit, on a key in its current window, is denied for good and leaves the
/// count as it was: one of 11 on a limit of 10, one beyond what a Lua number holds exactly
/// (2^53 + 3, which would be taken back as 2^53 + 4), and 2^62 (whose opposite, as Redis
/// formats a Lua number, is no integer to `HINCRBY`). One of 12 on a count of -5 (written by
/// hand), which an increment would bring to 7, within the limit, is not admitted either.
#[tokio::test]
async fn a_cost_above_the_limit_is_denied_for_good_and_counts_nothing() {
    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let store = store(&server);
    let limit = fixed_window("costly", 10);
    let key = "fgtest:{n}:r:costly";
    assert!(admitted(&store, &[Check::new(key, limit.clone(), 1)]).await);
    for cost in [11, (1 << 53) + 3, 1 << 62] {
        let decision = decide_one(&store, key, &limit, cost).await;
        assert!(decision.is_never_admissible(), "cost {cost}");
        assert_eq!(
            server.command::<String>(&["HGET", key, "c"]),
            "1",
            "cost {cost}"
        );
    }
    let decision = decide_one(&store, key, &limit, 1).await;
    assert_eq!(decision.limits()[0].remaining, 8);

    // The full decision reports a negative count as corrupted data (its state cannot be
    // exported): what matters here is that nothing admits it, and nothing is counted.
    let _: () = server.command(&["HSET", key, "c", "-5"]);
    let result = store
        .check_and_consume(&[Check::new(key, limit, 12)], None)
        .await;
    assert!(!result.is_ok_and(|decision| decision.is_allowed()));
    assert_eq!(server.command::<String>(&["HGET", key, "c"]), "-5");
}

/// The lean path against the memory store's fixed windows, on random decisions by the server's
/// clock within one window of an hour: one to three limits over four keys (a key may come twice
/// in a decision), costs of 0 to a few and above every limit, and post-charges that leave debt.
/// Each decision must agree with the memory store's, limit by limit, on whether it admits, what
/// remains, and whether it waits or can never be admitted (the waits themselves depend on the
/// instant, which is Redis's here and fixed there). The store folds a repeated key into one
/// check before the script; the script's own refusal of repeated keys is not what this holds.
#[test]
fn fixed_windows_at_once_decide_as_the_memory_store_does() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    clear_of_window_end(HOUR, Duration::from_secs(60));
    let server = RedisServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let redis = store(&server);
    let at = Some(floodgate::time::Timestamp::from_micros(server_now(&server)));
    let step = (
        prop::collection::vec(0usize..4, 1..4),
        prop_oneof![4 => Just(1u64), 2 => 0u64..5, 1 => 15u64..30],
        prop::bool::weighted(0.1),
    );
    let cases = (
        prop::collection::vec(1u64..20, 4),
        prop::collection::vec(step, 1..40),
    );
    let case_number = std::sync::atomic::AtomicU64::new(0);
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&cases, |(sizes, steps)| {
            let case = case_number.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let memory = floodgate::MemoryStore::builder().build();
            let limits: Vec<Arc<Limit>> = sizes
                .iter()
                .enumerate()
                .map(|(index, &size)| fixed_window(&format!("l{index}"), size))
                .collect();
            for (index, (keys, cost, charge)) in steps.iter().enumerate() {
                let checks: Vec<Check> = keys
                    .iter()
                    .map(|&key| {
                        let name = format!("fgprop:{{{case}}}:r:l{key}");
                        Check::new(name, limits[key].clone(), *cost)
                    })
                    .collect();
                let context = format!("step {index}: keys {keys:?}, cost {cost}");
                if *charge {
                    runtime.block_on(memory.charge(&checks, at)).unwrap();
                    runtime.block_on(redis.charge(&checks, None)).unwrap();
                    continue;
                }
                let expected = memory.check_and_consume_now(&checks, at);
                let got = runtime
                    .block_on(redis.check_and_consume(&checks, None))
                    .unwrap();
                prop_assert_eq!(got.is_allowed(), expected.is_allowed(), "{}", context);
                prop_assert_eq!(
                    got.is_never_admissible(),
                    expected.is_never_admissible(),
                    "{}",
                    context
                );
                for (got, expected) in got.limits().iter().zip(expected.limits()) {
                    prop_assert_eq!(got.allowed, expected.allowed, "{}", context);
                    prop_assert_eq!(got.remaining, expected.remaining, "{}", context);
                    prop_assert_eq!(
                        got.retry_after.is_some(),
                        expected.retry_after.is_some(),
                        "{}",
                        context
                    );
                }
            }
            Ok(())
        })
        .unwrap();
}
