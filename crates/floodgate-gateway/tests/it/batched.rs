//! Batched mode through the real binary: four gateway processes share one Redis with
//! `store.sync_interval: 100ms`; one client sends three times its limit, spread over all four,
//! for 10 s. What they admit in all must stay within 5% above the limit's allowance (and the
//! documented bound), and the Redis work must follow the interval, not the traffic.

use crate::support;
use floodgate_test_support as redis_support;

use std::time::{Duration, Instant};

use http::StatusCode;
use redis_support::RedisServer;
use support::{Gateway, TempDir, Upstream, client, get, start_gateway};

const NODES: usize = 4;
const RATE: u64 = 50; // per second, burst 50
const SEND_FOR: Duration = Duration::from_secs(10);
const INTERVAL: Duration = Duration::from_millis(100);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_batched_gateways_hold_one_limit_within_five_percent() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let rest = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 1s\n  sync_interval: {}ms\n\
         clients:\n  api_keys:\n    \"hot-client\": free\n\
         plans:\n  free:\n    limits: [ {{ name: per-second, algorithm: token_bucket, limit: {RATE}, window: 1s }} ]\n  anonymous: {{}}\n",
        redis.url(),
        INTERVAL.as_millis()
    );
    let gateways: Vec<(Gateway, TempDir)> = (0..NODES)
        .map(|_| start_gateway(&upstream.url(), &rest))
        .collect();
    let urls: Vec<String> = gateways
        .iter()
        .map(|(gateway, _)| gateway.url("/"))
        .collect();
    let client = client();
    let _: () = redis.command(&["CONFIG", "RESETSTAT"]);

    // Three times the rate, paced evenly, round-robin over the gateways.
    let period = Duration::from_secs(1) / (3 * RATE as u32);
    let mut ticks = tokio::time::interval(period);
    let mut requests = Vec::new();
    let started = Instant::now();
    let mut sent = 0usize;
    while started.elapsed() < SEND_FOR {
        ticks.tick().await;
        let (client, url) = (client.clone(), urls[sent % NODES].clone());
        requests.push(tokio::spawn(async move {
            get(&client, &url, &[("x-api-key", "hot-client")])
                .await
                .status()
        }));
        sent += 1;
    }
    let sending_for = started.elapsed();
    let mut admitted = 0u64;
    for request in requests {
        match request.await.unwrap() {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
    }
    let calls = redis.script_calls();

    // The bucket starts full (burst = rate) and refills at the rate while requests arrive.
    let allowance = RATE as f64 * (1.0 + sending_for.as_secs_f64());
    let over = admitted as f64 / allowance - 1.0;
    // The documented worst case, (N − 1) × (r × 2T + c).
    let bound = (NODES as f64 - 1.0) * (RATE as f64 * 2.0 * INTERVAL.as_secs_f64() + RATE as f64);
    eprintln!(
        "batched accuracy: {admitted} admitted of {sent} sent over {sending_for:?}; allowance \
         {allowance:.0} ({:+.2}%); {calls} Redis script calls ({:.1}/s)",
        over * 100.0,
        calls as f64 / sending_for.as_secs_f64()
    );
    assert!(
        sent as f64 >= 2.9 * RATE as f64 * sending_for.as_secs_f64(),
        "the client really sent 3× its limit: {sent}"
    );
    assert!(
        over <= 0.05,
        "{admitted} admitted, more than 5% above {allowance:.0}"
    );
    assert!(
        admitted as f64 <= allowance + bound,
        "beyond the documented bound"
    );
    assert!(
        admitted as f64 >= 0.9 * allowance,
        "{admitted} admitted: batched mode must not starve the client ({allowance:.0} allowed)"
    );
    // One call per gateway per interval for this identity, plus each gateway's first-sight
    // fetch, plus the tail of rounds still running while the last responses came back.
    let intervals = (sending_for.as_secs_f64() / INTERVAL.as_secs_f64()).ceil() as u64 + 5;
    let most = NODES as u64 * (intervals + 1);
    assert!(
        calls <= most,
        "{calls} script calls; at most one per node per interval ({most})"
    );
}

/// In exact mode, `global` ceilings still run batched by default: a ceiling every client
/// writes costs Redis one call per gateway per interval, not one per request, while the
/// per-client limits stay exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_ceilings_run_batched_while_client_limits_stay_exact() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    // Without the deny cache, an exact ceiling would cost a call per request, refused or
    // not (with it, the refusals after the first on each gateway would cost none, and exact
    // mode would look batched).
    let rest = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 1s\n  deny_cache: false\n\
         identity:\n  trusted_proxies: [\"127.0.0.1/32\"]\n\
         plans:\n  free: {{}}\n  anonymous:\n    endpoints:\n      \"GET /other\": [ {{ name: hourly, algorithm: fixed_window, limit: 3, window: 1h }} ]\n\
         global:\n  \"GET /search\": [ {{ name: ceiling, algorithm: fixed_window, limit: 40, window: 1h }} ]\n",
        redis.url()
    );
    let gateways: Vec<(Gateway, TempDir)> = (0..2)
        .map(|_| start_gateway(&upstream.url(), &rest))
        .collect();
    let client = client();
    let _: () = redis.command(&["CONFIG", "RESETSTAT"]);
    // 120 clients, one request each every 25 ms, alternating gateways.
    let mut ticks = tokio::time::interval(Duration::from_millis(25));
    let started = Instant::now();
    let mut admitted = 0;
    for client_number in 0..120 {
        ticks.tick().await;
        let (gateway, _) = &gateways[client_number % 2];
        let ip = format!("10.9.{}.{}", client_number / 200, client_number % 200 + 1);
        let response = get(
            &client,
            &gateway.url("/search"),
            &[("x-forwarded-for", &ip)],
        )
        .await;
        match response.status() {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
    }
    let calls = redis.script_calls();
    let elapsed = started.elapsed();
    eprintln!(
        "hot key: {admitted} of 120 admitted under a ceiling of 40; {calls} script calls in \
         {elapsed:?}"
    );
    // Syncs every 100 ms while requests arrive every 25 ms (40/s): what one gateway admits can
    // stay unseen by the other for up to two intervals, (N − 1) × 40/s × 0.2 s = 8 requests.
    assert!(
        (40..=48).contains(&admitted),
        "{admitted} admitted under a ceiling of 40"
    );
    // About one sync call per gateway per 100 ms interval (and a fetch each), where exact mode
    // would have made one call per request.
    let intervals = (elapsed.as_millis() / 100) as u64 + 3;
    assert!(
        calls <= 2 * (intervals + 1) && calls < 100,
        "{calls} script calls for 120 requests over {elapsed:?}"
    );

    // The per-client limit is exact: one client through both gateways gets its 3.
    let mut own = 0;
    for attempt in 0..6 {
        let (gateway, _) = &gateways[attempt % 2];
        let response = get(
            &client,
            &gateway.url("/other"),
            &[("x-forwarded-for", "10.8.0.1")],
        )
        .await;
        own += u32::from(response.status() == StatusCode::OK);
    }
    assert_eq!(own, 3);
}

/// On SIGTERM a batched gateway gives back what its leases hold unused before it exits: the
/// count is then what it admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_gateway_flushes_its_batched_counts() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    // An interval far longer than the test (the longest allowed): only the shutdown flush can
    // give the lease back.
    let rest = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  sync_interval: 1m\n\
         plans:\n  free:\n    limits: [ {{ name: hourly, algorithm: fixed_window, limit: 10, window: 1h }} ]\n  anonymous: {{}}\n",
        redis.url()
    );
    let (mut gateway, _directory) = start_gateway(&upstream.url(), &rest);
    let client = client();
    // Each top-up asks for what the key asked so far this interval: leases of 1, 2 and 4, of
    // which the fourth request spends one.
    for _ in 0..4 {
        let response = get(&client, &gateway.url("/"), &[("x-api-key", "leaving")]).await;
        assert_eq!(response.status(), StatusCode::OK);
    }
    let key = format!(
        "fg:{{key:{}}}:plan.free:hourly",
        floodgate::Identity::ApiKey("leaving".to_owned()).hash()
    );
    // A lease is counted as used when granted: the count holds this gateway's unused lease.
    let before: Vec<u64> = redis.command(&["HMGET", &key, "c"]);
    assert!(before[0] > 4, "{before:?}");
    gateway.signal("TERM");
    let status = tokio::task::spawn_blocking(move || gateway.child.wait().unwrap())
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let count: Vec<String> = redis.command(&["HMGET", &key, "c"]);
    assert_eq!(count, vec!["4".to_owned()]);
}

/// `GET` on the admin API, as JSON.
async fn admin_json(
    client: &support::TestClient,
    gateway: &Gateway,
    path: &str,
) -> serde_json::Value {
    let response = get(client, &gateway.admin_url(path), &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    serde_json::from_slice(response.body()).unwrap()
}

/// Sends requests of `key` from 4 tasks for `duration`, as fast as the gateway answers.
async fn busy(gateway: &Gateway, key: &str, duration: Duration) {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (client, url, key) = (client(), gateway.url("/"), key.to_owned());
        tasks.push(tokio::spawn(async move {
            while started.elapsed() < duration {
                let response = get(&client, &url, &[("x-api-key", &key)]).await;
                assert_eq!(response.status(), StatusCode::OK);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

/// Exact mode with `store.hot_identities`: a busy client is decided from leases once its rate
/// crosses the threshold, which the admin API shows (`/admin/clients` `local`, `/admin/top`'s
/// `local_identities`) and the metrics count; a reload that changes the threshold takes
/// effect (a new store: a raised threshold puts the client back to exact decisions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_identities_follow_the_threshold_a_reload_sets() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let rest = |above: &str| {
        format!(
            "store:\n  backend: redis\n  url: \"{}\"\n  hot_identities: {{ above: {above}, interval: 50ms }}\n\
             clients:\n  api_keys:\n    \"busy\": free\n\
             plans:\n  free:\n    limits: [ {{ name: per-second, algorithm: gcra, limit: 100000, window: 1s }} ]\n  anonymous: {{}}\n",
            redis.url()
        )
    };
    let (gateway, directory) = start_gateway(&upstream.url(), &rest("1000000/s"));
    let path = directory.file("floodgate.yaml");
    let client = client();
    busy(&gateway, "busy", Duration::from_millis(300)).await;
    let inspected = admin_json(&client, &gateway, "/admin/clients?api_key=busy").await;
    assert_eq!(inspected["local"], false, "{inspected}");
    assert_eq!(inspected["limits"][0]["view"], "shared");

    // A threshold the client's rate is far above (the debug gateway answers thousands a
    // second on 4 connections).
    let text = std::fs::read_to_string(&path).unwrap();
    support::write_atomically(&path, &text.replace("1000000/s", "20/s"));
    let (status, body) = support::admin_reload(&client, &gateway).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    busy(&gateway, "busy", Duration::from_millis(300)).await;
    let inspected = admin_json(&client, &gateway, "/admin/clients?api_key=busy").await;
    assert_eq!(inspected["local"], true, "{inspected}");
    assert_eq!(inspected["limits"][0]["view"], "node");
    let identity = inspected["identity"].as_str().unwrap().to_owned();
    let top = admin_json(&client, &gateway, "/admin/top").await;
    assert_eq!(
        top["local_identities"],
        serde_json::json!([format!("key:{identity}")]),
        "{top}"
    );
    let metrics = get(&client, &gateway.admin_url("/metrics"), &[]).await;
    let metrics = String::from_utf8_lossy(metrics.body()).into_owned();
    assert!(metrics.contains("floodgate_hot_identities 1"), "{metrics}");
    assert!(
        metrics.contains("# HELP floodgate_hot_identities "),
        "{metrics}"
    );
    assert!(
        metrics.contains("floodgate_hot_identity_changes_total{change=\"promoted\"} 1"),
        "{metrics}"
    );

    // Raised again: a new store, in which the client starts exact.
    let text = std::fs::read_to_string(&path).unwrap();
    support::write_atomically(&path, &text.replace("20/s", "1000000/s"));
    let (status, body) = support::admin_reload(&client, &gateway).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    busy(&gateway, "busy", Duration::from_millis(200)).await;
    let inspected = admin_json(&client, &gateway, "/admin/clients?api_key=busy").await;
    assert_eq!(inspected["local"], false, "{inspected}");
}
