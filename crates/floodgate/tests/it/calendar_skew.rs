//! Calendar periods under clock skew (SPEC §1, issue 45 item 6): a node whose clock is more
//! than a period away from the Redis server's still counts in the server's own calendar
//! period, whose end is the calendar's (a real month's length), not a fixed length extended
//! from boundaries around the node's time.

use std::sync::Arc;
use std::time::Duration;

use floodgate::calendar::{CalendarPeriod, Period};
use floodgate::store::{Check, RedisStore};
use floodgate::time::{FakeClock, Timestamp};
use floodgate::{Algorithm, Limit, Store};
use floodgate_test_support::RedisServer;

const DAY: u64 = 86_400;

/// The Redis server's time.
fn server_time(server: &RedisServer) -> Timestamp {
    let [seconds, micros]: [u64; 2] = server
        .command::<Vec<u64>>(&["TIME"])
        .try_into()
        .expect("TIME: seconds, microseconds");
    Timestamp::from_micros(seconds * 1_000_000 + micros)
}

fn monthly(period: &CalendarPeriod) -> Arc<Limit> {
    Arc::new(
        Limit::builder("monthly")
            .algorithm(Algorithm::FixedWindow)
            .limit(2)
            .calendar(period.clone())
            .build()
            .unwrap(),
    )
}

/// A node `skew` seconds behind (negative: ahead of) the server decides a monthly quota
/// anchored on the 31st in New York: the period it counts in ends where the calendar says,
/// seen from the server's time.
async fn a_skewed_node_counts_in_the_servers_period(skew_secs: i64) {
    let server = RedisServer::start();
    let period = CalendarPeriod::new(Period::Month, "America/New_York")
        .unwrap()
        .anchored("31")
        .unwrap();
    let before = server_time(&server);
    let node_time = (before.as_micros() as i64 - skew_secs * 1_000_000) as u64;
    let node = FakeClock::new(Timestamp::from_micros(node_time));
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(5))
        .clock(node)
        .build()
        .unwrap();
    let limit = monthly(&period);
    let checks = [Check::new("fgtest:{skewed}:monthly", limit.clone(), 1)];
    let decision = store.check_and_consume(&checks, None).await.unwrap();
    let after = server_time(&server);
    assert!(decision.is_allowed());
    // The server's period, by the calendar, at the server's time.
    let [_, _, end, _] = period.boundaries(before.as_micros());
    assert_eq!(
        period.boundaries(after.as_micros())[2],
        end,
        "a period ended while the test ran"
    );
    let reset_after = decision.limits()[0].reset_after;
    let earliest = Duration::from_micros(end - after.as_micros());
    let latest = Duration::from_micros(end - before.as_micros());
    assert!(
        earliest <= reset_after + Duration::from_secs(1) && reset_after <= latest,
        "node {skew_secs} s off: the period ends in {reset_after:?}, the calendar says \
         between {earliest:?} and {latest:?}"
    );
    // And it counts there: a second admitted, a third denied until the period's end.
    assert!(
        store
            .check_and_consume(&checks, None)
            .await
            .unwrap()
            .is_allowed()
    );
    let denied = store.check_and_consume(&checks, None).await.unwrap();
    assert!(!denied.is_allowed());
    let wait = denied.retry_after().expect("a denial waits");
    assert!(
        wait <= latest && earliest <= wait + Duration::from_secs(1),
        "waits {wait:?}, the calendar says between {earliest:?} and {latest:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_a_month_and_a_half_behind_counts_in_the_servers_period() {
    a_skewed_node_counts_in_the_servers_period(45 * DAY as i64).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_thirteen_months_ahead_counts_in_the_servers_period() {
    // Thirteen months of fixed length are never thirteen real months (395 to 397 days).
    a_skewed_node_counts_in_the_servers_period(-400 * DAY as i64).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_thirteen_months_behind_counts_in_the_servers_period() {
    a_skewed_node_counts_in_the_servers_period(400 * DAY as i64).await;
}
