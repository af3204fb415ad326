//! A store that refuses the gateway (a wrong Redis password) is seen at once: at start, on
//! `/readyz`, and in the breaker's log line, which names its cause.
//!
//! Timing: log lines are waited for by polling the captured log every 10ms for up to 5s.

use crate::support;
use floodgate_test_support as redis_support;

use http::StatusCode;
use support::{Gateway, TempDir, Upstream, addresses, client, config_text, get};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_redis_password_is_seen_at_start_on_readyz_and_in_the_breaker_log() {
    let redis = redis_support::RedisServer::start_with(|_| {
        vec!["--requirepass".to_owned(), "right-password".to_owned()]
    });
    let upstream = Upstream::start().await;
    let directory = TempDir::new("wrongpass");
    let (listen, admin) = addresses();
    let path = directory.file("floodgate.yaml");
    let url = format!("redis://:wrong-password@127.0.0.1:{}", redis.port());
    let rest = format!(
        "store:\n  backend: redis\n  url: \"{url}\"\n  breaker: {{ failures: 2, open_for: 60s }}\non_store_error: open\nplans:\n  free: {{}}\n  anonymous:\n    limits: [ {{ name: m, algorithm: fixed_window, limit: 5, window: 60s }} ]\n"
    );
    std::fs::write(&path, config_text(listen, admin, &upstream.url(), &rest)).unwrap();
    let gateway = Gateway::start(&path, listen, admin);

    let at_start = gateway.wait_for_log(
        |line| line.contains("\"ERROR\"") && line.contains("store"),
        "at ERROR about the store",
    );
    assert!(
        at_start.to_lowercase().contains("authentication"),
        "{at_start}"
    );

    let client = client();
    let ready = get(&client, &gateway.admin_url("/readyz"), &[]).await;
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = String::from_utf8_lossy(ready.body()).to_lowercase();
    assert!(body.contains("authentication"), "{body}");

    // Under `open` requests pass unlimited; the breaker opens, and its log line says why.
    for _ in 0..3 {
        assert_eq!(
            get(&client, &gateway.url("/"), &[]).await.status(),
            StatusCode::OK
        );
    }
    let opened = gateway.wait_for_log(
        |line| line.contains("store circuit breaker opened"),
        "about the breaker opening",
    );
    assert!(opened.to_lowercase().contains("authentication"), "{opened}");
}

/// The store down, readiness by plan (SPEC §7 `/readyz`): a gateway is unready when the plan of
/// clients it cannot name beforehand (the default or the anonymous plan) fails closed, and stays
/// ready when only a plan of named keys does; the body lists every plan's state either way.
/// Before, `/readyz` read the top-level `on_store_error` alone: the first gateway below was 503
/// while every default and anonymous client was served, the second 200 while they all got 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_plans_that_take_unnamed_clients() {
    let mut redis = redis_support::RedisServer::start();
    let upstream = Upstream::start().await;
    let store = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  breaker: {{ failures: 1, open_for: 60s }}\n",
        redis.url()
    );
    let limits = "limits: [ { name: m, algorithm: fixed_window, limit: 100, window: 60s } ]";
    // A closed plan for one partner key; the default and anonymous plans serve without a store.
    let closed_partner = format!(
        "{store}on_store_error: closed\nclients:\n  api_keys: {{ \"partner\": strict }}\nplans:\n  free: {{ on_store_error: open, {limits} }}\n  anonymous: {{ on_store_error: local, {limits} }}\n  strict: {{ {limits} }}\n"
    );
    // The reverse: the default plan fails closed, a partner's plan serves.
    let closed_default = format!(
        "{store}on_store_error: open\nclients:\n  api_keys: {{ \"partner\": lenient }}\nplans:\n  free: {{ on_store_error: closed, {limits} }}\n  anonymous: {{ {limits} }}\n  lenient: {{ {limits} }}\n"
    );
    let directory = TempDir::new("readiness");
    let mut gateways = Vec::new();
    for (name, rest) in [("partner", &closed_partner), ("default", &closed_default)] {
        let (listen, admin) = addresses();
        let path = directory.file(&format!("{name}.yaml"));
        std::fs::write(&path, config_text(listen, admin, &upstream.url(), rest)).unwrap();
        gateways.push(Gateway::start(&path, listen, admin));
    }
    let client = client();
    for gateway in &gateways {
        let ready = get(&client, &gateway.admin_url("/readyz"), &[]).await;
        assert_eq!(ready.status(), StatusCode::OK, "the store is up");
    }

    redis.kill();
    let readiness = |gateway: &Gateway| {
        let client = client.clone();
        let url = gateway.admin_url("/readyz");
        let request = gateway.url("/");
        async move {
            // Requests trip the breaker (one failure opens it); poll until readiness sees it.
            let started = std::time::Instant::now();
            loop {
                let _ = get(&client, &request, &[]).await;
                let ready = get(&client, &url, &[]).await;
                let body: serde_json::Value = serde_json::from_slice(ready.body()).unwrap();
                if body["store_reachable"] == false {
                    return (ready.status(), body);
                }
                assert!(
                    started.elapsed() < std::time::Duration::from_secs(5),
                    "the breaker never opened: {body}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    };

    let (status, body) = readiness(&gateways[0]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "ready");
    assert_eq!(body["plans"]["strict"]["on_store_error"], "closed");
    assert_eq!(body["plans"]["strict"]["serving"], false);
    assert_eq!(body["plans"]["free"]["serving"], true);
    assert_eq!(body["plans"]["anonymous"]["on_store_error"], "local");
    assert_eq!(body["plans"]["anonymous"]["serving"], true);

    let (status, body) = readiness(&gateways[1]).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["status"], "store_unavailable");
    assert_eq!(body["plans"]["free"]["serving"], false);
    assert_eq!(body["plans"]["lenient"]["serving"], true);
}

/// The words of the warning a gateway logs at start when its quotas would not survive the
/// store's restart.
const QUOTAS_LOST: &str = "limits of a day or longer are kept in a store that loses them";

/// A gateway with a daily limit on the plan of anonymous clients, on `store`; returns once it
/// serves (the store is checked before it says so, so its log already holds any warning).
fn gateway_with_a_daily_quota(store: &str, upstream: &Upstream) -> (Gateway, TempDir) {
    let directory = TempDir::new("quota");
    let (listen, admin) = addresses();
    let path = directory.file("floodgate.yaml");
    let rest = format!(
        "{store}plans:\n  free: {{}}\n  anonymous:\n    limits:\n      - {{ name: minute, algorithm: fixed_window, limit: 50, window: 60s }}\n      - {{ name: daily, algorithm: fixed_window, limit: 1000, window: 1d }}\n"
    );
    std::fs::write(&path, config_text(listen, admin, &upstream.url(), &rest)).unwrap();
    (Gateway::start(&path, listen, admin), directory)
}

fn quota_warning(gateway: &Gateway) -> Option<String> {
    let log = gateway.log.lock().unwrap();
    log.iter().find(|line| line.contains(QUOTAS_LOST)).cloned()
}

/// Issue 34 "durable quotas": a daily limit on a Redis that forgets its counters when it
/// restarts (neither AOF nor snapshots) is warned of at start, naming the limit; on a Redis
/// that writes an append-only file it is not, nor on the memory store (its counters are the
/// process's by design: the quickstart's terminal stays quiet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daily_quota_on_a_store_that_forgets_is_warned_of_at_start() {
    let upstream = Upstream::start().await;
    let volatile = redis_support::RedisServer::start();
    let (gateway, _dir) =
        gateway_with_a_daily_quota(&support::redis_store(&volatile.url()), &upstream);
    let warning = quota_warning(&gateway).expect("a warning about the daily limit");
    assert!(warning.contains("\"WARN\""), "{warning}");
    assert!(
        warning.contains("plans.anonymous.limits `daily`"),
        "{warning}"
    );
    assert!(
        !warning.contains("`minute`"),
        "a minute is no quota: {warning}"
    );

    let (memory, _dir) = gateway_with_a_daily_quota("", &upstream);
    assert_eq!(
        quota_warning(&memory),
        None,
        "the memory store is never shared"
    );

    let durable = redis_support::RedisServer::start_with(|_| {
        vec!["--appendonly".to_owned(), "yes".to_owned()]
    });
    let (kept, _dir) = gateway_with_a_daily_quota(&support::redis_store(&durable.url()), &upstream);
    assert_eq!(
        quota_warning(&kept),
        None,
        "an append-only file keeps the counts"
    );
}
