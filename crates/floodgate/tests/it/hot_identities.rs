//! Hot identities in exact mode, against a real redis-server: a client whose decision rate on a
//! node crosses the threshold is decided from leases (about one call per node and interval),
//! every other client stays exact (one call per decision), and a client that cools down goes
//! back to exact decisions.

use floodgate_test_support as support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate::key::storage::hash_tag;
use floodgate::store::{BatchedStore, HotIdentities, RedisStore, SplitStore};
use floodgate::{Limit, Store, store::Check};
use support::RedisServer;

const INTERVAL: Duration = Duration::from_millis(50);
/// Decisions per second on a node above which an identity is hot.
const ABOVE: u64 = 100;

/// One gateway's store in exact mode with hot identities: exact calls are neither coalesced
/// nor answered from the deny cache, so that Redis's call count is one per exact decision.
fn gateway(server: &RedisServer) -> (SplitStore<RedisStore>, Arc<HotIdentities>) {
    let redis = || {
        RedisStore::builder(server.url())
            .timeout(Duration::from_secs(5))
            .coalesce(0)
            .deny_cache(false)
            .build()
            .unwrap()
    };
    let hot = Arc::new(HotIdentities::new(ABOVE, INTERVAL));
    let leases = BatchedStore::builder(redis())
        .sync_interval(INTERVAL)
        .build();
    let store = SplitStore::new(leases, Arc::new(redis()), |_: &Check| false)
        .with_hot_identities(hot.clone());
    (store, hot)
}

fn checks(limit: &Arc<Limit>, client: &str) -> Vec<Check> {
    vec![Check::new(
        format!("fgtest:{{key:{client}}}:plan:{}", limit.name()),
        limit.clone(),
        1,
    )]
}

/// Whether one decision of `checks` admits.
async fn admit(store: &SplitStore<RedisStore>, checks: &[Check]) -> bool {
    store
        .check_and_consume(checks, None)
        .await
        .unwrap()
        .is_allowed()
}

/// Decides `checks` at `rate` per second (paced on the real clock) for `duration`; returns
/// how many were admitted.
async fn drive(
    store: &SplitStore<RedisStore>,
    checks: &[Check],
    rate: u64,
    duration: Duration,
) -> u64 {
    let started = Instant::now();
    let (mut done, mut admitted) = (0u64, 0u64);
    while started.elapsed() < duration {
        let due = (started.elapsed().as_secs_f64() * rate as f64) as u64;
        while done < due {
            admitted += u64::from(admit(store, checks).await);
            done += 1;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    admitted
}

/// The target case: one client at 20× the threshold among 10,000 ordinary ones on 3
/// gateways. Once it is hot, its decisions cost about one Redis call per gateway and interval;
/// each ordinary client's decision is one call; no ordinary client is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_client_costs_a_call_per_gateway_and_interval_and_ordinary_ones_stay_exact() {
    let server = RedisServer::start();
    let gateways: Vec<_> = (0..3).map(|_| gateway(&server)).collect();
    let limit = Arc::new(Limit::gcra("per-second", 20_000, Duration::from_secs(1)).unwrap());
    let heavy = checks(&limit, "heavy");
    let heavy_rate = 20 * ABOVE;

    // Each gateway's connection is made, and the library loaded, before the warm-up: on a
    // machine the rest of the suite loads, a first call once took most of the three
    // intervals below, and the client was not hot yet.
    for (store, _) in &gateways {
        assert!(admit(store, &checks(&limit, "connection")).await);
    }
    // Warm-up: the heavy client becomes hot on every gateway.
    for (store, _) in &gateways {
        drive(store, &heavy, heavy_rate, 3 * INTERVAL).await;
    }
    for (_, hot) in &gateways {
        assert_eq!(hot.hot(), vec![hash_tag(&heavy[0].key).to_owned()]);
    }

    // Measured: 10,000 ordinary clients, one decision each, spread over the gateways, while
    // the heavy one keeps its rate on each.
    let _: () = server.command(&["CONFIG", "RESETSTAT"]);
    let started = Instant::now();
    let ordinary = 10_000;
    let mut tasks = Vec::new();
    for (index, (store, _)) in gateways.into_iter().enumerate() {
        let limit = limit.clone();
        let heavy = heavy.clone();
        tasks.push(tokio::spawn(async move {
            let mut heavy_done = 0u64;
            let mut heavy_admitted = 0u64;
            let clients = (index..ordinary).step_by(3);
            for client in clients {
                let ordinary = checks(&limit, &format!("ordinary-{client}"));
                assert!(
                    store
                        .check_and_consume(&ordinary, None)
                        .await
                        .unwrap()
                        .is_allowed()
                );
                let due = (started.elapsed().as_secs_f64() * heavy_rate as f64) as u64;
                while heavy_done < due {
                    heavy_admitted += u64::from(
                        store
                            .check_and_consume(&heavy, None)
                            .await
                            .unwrap()
                            .is_allowed(),
                    );
                    heavy_done += 1;
                }
            }
            (store, heavy_done, heavy_admitted)
        }));
    }
    let mut heavy_decisions = 0;
    let mut stores = Vec::new();
    for task in tasks {
        let (store, done, admitted) = task.await.unwrap();
        heavy_decisions += done;
        // Under its own limit: a lease short for a moment denies a few until the next trade.
        assert!(admitted * 10 >= done * 8, "{admitted} of {done} admitted");
        stores.push(store);
    }
    let elapsed = started.elapsed();
    let calls = server.script_calls();
    let intervals = (elapsed.as_secs_f64() / INTERVAL.as_secs_f64()).ceil() as u64;
    let heavy_calls = calls.saturating_sub(ordinary as u64);
    println!(
        "{ordinary} ordinary decisions, {heavy_decisions} hot ones over {elapsed:?}: \
         {calls} calls, {heavy_calls} for the hot client ({intervals} intervals x 3 gateways)"
    );
    assert!(
        heavy_decisions >= 3 * intervals * (ABOVE * INTERVAL.as_millis() as u64 / 1000),
        "the heavy client ran above the threshold: {heavy_decisions} in {elapsed:?}"
    );
    // One call per gateway per interval for the hot client (its trade), plus a top-up in an
    // interval where its lease ran short: at most two per gateway and interval, and far fewer
    // than its decisions.
    assert!(
        calls >= ordinary as u64,
        "every ordinary decision is a call: {calls}"
    );
    assert!(
        heavy_calls <= 2 * 3 * (intervals + 1),
        "{heavy_calls} calls for the hot client over {intervals} intervals on 3 gateways"
    );
    assert!(
        heavy_calls * 10 < heavy_decisions,
        "{heavy_calls} calls for {heavy_decisions}"
    );
    let heavy_tag = hash_tag(&heavy[0].key).to_owned();
    for store in &stores {
        let tracker = store.hot_identities().unwrap();
        // The heavy client ends hot and is the only one: an ordinary client (one decision)
        // never is. On a machine loaded enough to starve the heavy loop for an interval it
        // cools down and warms up again (a suite run under two busy loops counted 8
        // promotions), so promotions are counted against demotions, not against 1.
        assert_eq!(
            tracker.hot(),
            vec![heavy_tag.clone()],
            "no ordinary client is hot"
        );
        let (promotions, demotions) = tracker.changes();
        assert_eq!(
            promotions,
            demotions + 1,
            "every other promotion was undone"
        );
        assert_eq!(store.hot().stats().keys, 1, "only the hot client is leased");
    }
}

/// Promotion under a rising rate, demotion when it falls: decisions go from one call each to
/// leases and back, and the lease a cooled-down client held flows back to the shared state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_is_promoted_when_its_rate_rises_and_demoted_when_it_falls() {
    let server = RedisServer::start();
    let (store, hot) = gateway(&server);
    // Redis's count is compared with what was admitted, so the test must not cross the
    // window's end (it runs for about 2 s).
    let window = Duration::from_secs(3600);
    support::clear_of_window_end(window, Duration::from_secs(30));
    let limit = Arc::new(Limit::fixed_window("per-hour", 100_000, window).unwrap());
    let client = checks(&limit, "tide");
    let tag = hash_tag(&client[0].key).to_owned();

    // Below the threshold: exact, one call per decision (counted after the first, which
    // also loads the function library).
    assert!(admit(&store, &client).await);
    let _: () = server.command(&["CONFIG", "RESETSTAT"]);
    let mut admitted = 1 + drive(&store, &client, ABOVE / 4, 4 * INTERVAL).await;
    assert!(!hot.is_hot(&tag));
    let calm_calls = server.script_calls();
    let count: Vec<u64> = server.command(&["HMGET", &client[0].key, "c"]);
    assert_eq!(calm_calls, count[0] - 1, "one call per decision while calm");

    // 20x the threshold: promoted, then decided from leases.
    admitted += drive(&store, &client, 20 * ABOVE, 6 * INTERVAL).await;
    assert!(hot.is_hot(&tag));
    assert_eq!(hot.changes(), (1, 0));
    assert!(store.hot().leased(&client[0].key) > 0);

    // Back to a trickle: demoted within a few intervals, and the lease given back.
    admitted += drive(&store, &client, ABOVE / 10, 8 * INTERVAL).await;
    assert!(!hot.is_hot(&tag), "demoted after cooling down");
    assert_eq!(hot.changes(), (1, 1));
    support::wait_until(Duration::from_secs(5), "the lease flows back", || {
        store.hot().leased(&client[0].key) == 0
    });
    // Exact again: every decision is a call, and Redis's count is what was admitted.
    let before = server.script_calls();
    for _ in 0..5 {
        assert!(admit(&store, &client).await);
    }
    assert_eq!(server.script_calls() - before, 5);
    let count: Vec<u64> = server.command(&["HMGET", &client[0].key, "c"]);
    assert_eq!(count[0], admitted + 5, "nothing leased is left counted");
}
