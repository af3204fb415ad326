//! `store.region` through the real binary: two regions, each a gateway process with its own
//! redis-server, trading their shares of one limit through a global redis-server. A client
//! concentrated in one region gets more than that region's fixed half once shares have moved,
//! never more than the limit; `/admin/clients` shows the share in force, `/admin/status` the
//! region and the global store's health, `/metrics` the trades; `floodgate check` reports the
//! section; a reload that adds a region rebuilds the store with it; a gateway shutting down
//! gives its region's trader lock up.

use crate::support;
use floodgate_test_support as redis_support;

use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use redis_support::RedisServer;
use support::{TempDir, Upstream, admin_call, admin_reload, client, get, start_gateway};

const RATE: u64 = 20; // per second, burst 20

/// The `store:` and plans of a gateway of `region`, trading through the global store at
/// `global` (a Redis URL).
fn rest(region: &str, local: &RedisServer, global: &str, regions: &str) -> String {
    format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 2s\n  region: {{ name: {region}, regions: [{regions}], global: \"{}\", sync_interval: 200ms }}\n\
         clients:\n  api_keys:\n    \"hot-client\": free\n\
         plans:\n  free:\n    limits: [ {{ name: per-second, algorithm: token_bucket, limit: {RATE}, window: 1s }} ]\n  anonymous: {{}}\n",
        local.url(),
        global,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_regions_share_one_limit_through_the_gateway() {
    let global = RedisServer::start();
    let (eu_store, us_store) = (RedisServer::start(), RedisServer::start());
    let upstream = Upstream::start().await;
    let (eu, eu_dir): (_, TempDir) = start_gateway(
        &upstream.url(),
        &rest("eu", &eu_store, &global.url(), "eu, us"),
    );
    let (_us, _us_dir) = start_gateway(
        &upstream.url(),
        &rest("us", &us_store, &global.url(), "eu, us"),
    );

    let checked = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["check", "--config"])
        .arg(eu_dir.file("floodgate.yaml"))
        .output()
        .unwrap();
    let summary = String::from_utf8_lossy(&checked.stdout);
    assert!(
        summary.contains(
            "region eu of eu/us (fixed share 1/2, traded every 200ms through redis://127.0.0.1:"
        ),
        "{summary}"
    );

    // Twice the limit, all in eu, for 3 s.
    let client = client();
    let url = eu.url("/");
    let period = Duration::from_secs(1) / (2 * RATE as u32);
    let mut ticks = tokio::time::interval(period);
    let started = Instant::now();
    let (mut admitted, mut last_second) = (0u64, 0u64);
    while started.elapsed() < Duration::from_secs(3) {
        ticks.tick().await;
        let status = get(&client, &url, &[("x-api-key", "hot-client")])
            .await
            .status();
        match status {
            StatusCode::OK => {
                admitted += 1;
                if started.elapsed() >= Duration::from_secs(2) {
                    last_second += 1;
                }
            }
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
    }
    let allowance = RATE as f64 * (1.0 + started.elapsed().as_secs_f64());
    assert!(
        admitted as f64 <= allowance,
        "admitted {admitted} > {allowance:.0}"
    );
    assert!(
        last_second > RATE / 2 + 2,
        "the last second admitted {last_second}: no more than eu's fixed half"
    );

    let (status, inspected) = admin_call(
        &client,
        &eu,
        Method::GET,
        "/admin/clients?api_key=hot-client",
        None,
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let share = &inspected["limits"][0]["region_share"];
    assert_eq!(share["region"], "eu");
    assert_eq!(share["of"], RATE);
    assert_eq!(share["fixed"], RATE / 2);
    assert_eq!(share["trades"], true);
    assert!(share["units"].as_u64().unwrap() > RATE / 2, "{inspected}");
    assert!(
        share["raised_for_seconds"].as_f64().is_some(),
        "{inspected}"
    );
    assert_eq!(
        inspected["limits"][0]["limit"], share["units"],
        "decided under the share"
    );

    let (_, status) = admin_call(&client, &eu, Method::GET, "/admin/status", None, None).await;
    let region = &status["store"]["region"];
    assert_eq!(region["name"], "eu");
    assert_eq!(region["global"], "healthy", "{status}");
    assert_eq!(region["trader"], true);
    assert!(region["trades_ok"].as_u64().unwrap() >= 5, "{status}");

    let metrics = get(&client, &eu.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(metrics.body());
    assert!(
        text.contains("floodgate_region_trades_total{result=\"ok\"}"),
        "{text}"
    );
    assert!(text.contains("floodgate_region_trader 1"), "{text}");

    // A reload that adds a region rebuilds the store with three.
    std::fs::write(
        eu_dir.file("floodgate.yaml"),
        support::config_text(
            eu.listen,
            eu.admin,
            &upstream.url(),
            &rest("eu", &eu_store, &global.url(), "eu, us, ap"),
        ),
    )
    .unwrap();
    let (status, _) = admin_reload(&client, &eu).await;
    assert_eq!(status, StatusCode::OK);
    let (_, status) = admin_call(&client, &eu, Method::GET, "/admin/status", None, None).await;
    assert_eq!(
        status["store"]["region"]["regions"],
        serde_json::json!(["eu", "us", "ap"])
    );

    // On SIGTERM the gateway gives its region's trader lock up, so that another gateway of
    // the region trades at its next sync.
    // The reload's new store takes the lock its predecessor gave up at its first sync:
    // polled every 20 ms, for up to 5 s.
    let lock = "floodgate:region:{eu}:trader";
    let polled = Instant::now();
    while eu_store.command::<Option<String>>(&["GET", lock]).is_none() {
        assert!(
            polled.elapsed() < Duration::from_secs(5),
            "eu's gateway holds its region's lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut eu = eu;
    eu.signal("TERM");
    let status = tokio::task::spawn_blocking(move || eu.child.wait().unwrap())
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let held: Option<String> = eu_store.command(&["GET", lock]);
    assert_eq!(held, None, "given up on shutdown");
}

/// A global store that may evict any key (`maxmemory-policy allkeys-lru`) is named at start:
/// its evicted records and generation would be detected only by settling for a lifetime
/// (SPEC §5). One with the default policy (`noeviction`) is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_store_that_may_evict_any_key_is_warned_of_at_start() {
    let evicting =
        RedisServer::start_with(|_| vec!["--maxmemory-policy".into(), "allkeys-lru".into()]);
    let keeping = RedisServer::start();
    let (eu_store, us_store) = (RedisServer::start(), RedisServer::start());
    let upstream = Upstream::start().await;
    let (eu, _eu_dir) = start_gateway(
        &upstream.url(),
        &rest("eu", &eu_store, &evicting.url(), "eu, us"),
    );
    let line = eu.wait_for_log(
        |line| line.contains("may evict floodgate's keys"),
        "warning of the evicting global store",
    );
    assert!(line.contains("allkeys-lru"), "{line}");
    let (us, _us_dir) = start_gateway(
        &upstream.url(),
        &rest("us", &us_store, &keeping.url(), "eu, us"),
    );
    // The policy is read beside the serving gateway: its line says the look is done.
    let line = us.wait_for_log(
        |line| line.contains("global store keeps floodgate's keys"),
        "the policy read",
    );
    assert!(line.contains("noeviction"), "{line}");
    assert!(
        !us.log
            .lock()
            .unwrap()
            .iter()
            .any(|line| line.contains("may evict")),
        "no warning for noeviction"
    );
}

/// A gateway starts serving without waiting on the global store (SPEC §5: the request path
/// never waits on it): with the global store black-holed, the gateway says it serves within
/// half a second of its first log line (the configuration's warnings, written as it starts)
/// and answers. The start-up look at the global store's eviction policy, which held the
/// listener for up to the region's `timeout` (1 s here: 1.011 s measured), runs beside the
/// serving gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_global_store_does_not_hold_the_start() {
    let global = RedisServer::start();
    let proxy = redis_support::faults::FaultProxy::start(global.port());
    proxy.set(redis_support::faults::Fault::BlackHole);
    let eu_store = RedisServer::start();
    let upstream = Upstream::start().await;
    let (eu, _dir) = start_gateway(
        &upstream.url(),
        &rest("eu", &eu_store, &proxy.url(), "eu, us"),
    );
    let response = get(&client(), &eu.url("/"), &[]).await;
    assert_eq!(response.status(), StatusCode::OK);

    let log = eu.log.lock().unwrap().clone();
    let first = logged_at(&log[0]);
    let serving = log
        .iter()
        .find(|line| line.contains("floodgate serving"))
        .map(|line| logged_at(line))
        .unwrap();
    // Generous: the start takes tens of milliseconds here; the wait it must not have is the
    // region's `timeout` (its default, 1 s, in `rest`).
    let start = (serving - first).rem_euclid(86_400.0);
    assert!(
        start < 0.5,
        "serving {start:.3} s after the first line: the start waited on the global store\n{log:#?}"
    );
}

/// The time of day a JSON log line was written, in seconds.
fn logged_at(line: &str) -> f64 {
    let parsed: serde_json::Value = serde_json::from_str(line).unwrap();
    let timestamp = parsed["timestamp"].as_str().unwrap();
    let time = timestamp.split('T').nth(1).unwrap().trim_end_matches('Z');
    time.split(':')
        .map(|part| part.parse::<f64>().unwrap())
        .fold(0.0, |seconds, part| seconds * 60.0 + part)
}
