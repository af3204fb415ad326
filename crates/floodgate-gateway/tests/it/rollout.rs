//! Safe rollout and observability through the real binary: shadow mode, the kill switch, the
//! lists, the metrics endpoint and the top clients.

use crate::support;
use floodgate_test_support as redis_support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::StatusCode;
use redis_support::RedisServer;
use support::{Gateway, TempDir, Upstream, addresses, client, get, write_atomically};

fn text(listen: SocketAddr, admin: SocketAddr, upstream: &Upstream, rest: &str) -> String {
    format!(
        "listen: \"{listen}\"\nadmin:\n  listen: \"{admin}\"\nupstream: \"{}\"\nidentity:\n  trusted_proxies: [\"127.0.0.1/32\"]\n  user_header: x-user-id\n{rest}",
        upstream.url()
    )
}

const PLANS: &str = "plans:\n  free:\n    limits: [ { name: per-minute, algorithm: fixed_window, limit: 3, window: 60s } ]\n  anonymous:\n    limits: [ { name: per-minute, algorithm: fixed_window, limit: 3, window: 60s } ]\n";

/// `metric{labels} value` lines of a Prometheus text body, checked for well-formedness.
fn parse_prometheus(body: &str) -> Vec<(String, f64)> {
    body.lines()
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let (series, value) = line
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("not a sample: {line}"));
            let value: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("not a number: {line}"));
            let name_end = series.find('{').unwrap_or(series.len());
            let name = &series[..name_end];
            assert!(
                !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':'),
                "bad metric name: {line}"
            );
            if name_end < series.len() {
                assert!(series.ends_with('}'), "bad labels: {line}");
            }
            (series.to_owned(), value)
        })
        .collect()
}

fn sample(samples: &[(String, f64)], series: &str) -> f64 {
    samples
        .iter()
        .find(|(name, _)| name == series)
        .map_or(0.0, |(_, value)| *value)
}

async fn metrics(client: &support::TestClient, gateway: &Gateway) -> Vec<(String, f64)> {
    let response = get(client, &gateway.admin_url("/metrics"), &[]).await;
    parse_prometheus(&String::from_utf8_lossy(response.body()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_lets_everything_through_and_counts_would_be_denials_exactly() {
    let upstream = Upstream::start().await;
    let directory = TempDir::new("shadow");
    let (listen, admin) = addresses();
    let path = directory.file("floodgate.yaml");
    std::fs::write(
        &path,
        text(
            listen,
            admin,
            &upstream,
            &format!("rollout: {{ mode: shadow }}\n{PLANS}"),
        ),
    )
    .unwrap();
    let gateway = Gateway::start(&path, listen, admin);
    let client = client();
    for _ in 0..10 {
        let response = get(
            &client,
            &gateway.url("/"),
            &[("x-forwarded-for", "198.51.100.5")],
        )
        .await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(
            !response.headers().contains_key("x-ratelimit-remaining"),
            "shadow is invisible"
        );
    }
    let samples = metrics(&client, &gateway).await;
    let series = |decision: &str| {
        format!(
            "floodgate_decisions_total{{rule=\"plan.anonymous\",limit=\"per-minute\",decision=\"{decision}\"}}"
        )
    };
    assert_eq!(sample(&samples, &series("allowed")), 3.0);
    assert_eq!(sample(&samples, &series("shadow_limited")), 7.0);
    assert_eq!(sample(&samples, &series("limited")), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kill_switch_stops_429s_and_store_calls_within_a_second() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let directory = TempDir::new("kill");
    let (listen, admin) = addresses();
    let path = directory.file("floodgate.yaml");
    let store = format!(
        "store: {{ backend: redis, url: \"{}\", timeout: 1s }}\n",
        redis.url()
    );
    let config = |mode: &str| {
        text(
            listen,
            admin,
            &upstream,
            &format!("{store}rollout: {{ mode: {mode} }}\n{PLANS}"),
        )
    };
    std::fs::write(&path, config("enforce")).unwrap();
    let gateway = Gateway::start(&path, listen, admin);
    let client = client();
    for _ in 0..4 {
        get(
            &client,
            &gateway.url("/"),
            &[("x-forwarded-for", "198.51.100.6")],
        )
        .await;
    }
    assert_eq!(
        get(
            &client,
            &gateway.url("/"),
            &[("x-forwarded-for", "198.51.100.6")]
        )
        .await
        .status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    write_atomically(&path, &config("off"));
    let written = Instant::now();
    loop {
        let before = redis.script_calls();
        let response = get(
            &client,
            &gateway.url("/"),
            &[("x-forwarded-for", "198.51.100.6")],
        )
        .await;
        if response.status() == StatusCode::OK && redis.script_calls() == before {
            break;
        }
        assert!(
            written.elapsed() < Duration::from_secs(1),
            "still limiting 1s after `mode: off`"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = written.elapsed();
    let calls = redis.script_calls();
    for _ in 0..20 {
        assert_eq!(
            get(
                &client,
                &gateway.url("/"),
                &[("x-forwarded-for", "198.51.100.6")]
            )
            .await
            .status(),
            StatusCode::OK
        );
    }
    assert_eq!(redis.script_calls(), calls, "no store call while off");
    eprintln!("kill switch: limiting and store calls stopped {took:?} after the write");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowlisted_clients_make_no_store_call_and_denylisted_get_403() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let directory = TempDir::new("lists");
    let (listen, admin) = addresses();
    let path = directory.file("floodgate.yaml");
    let rest = format!(
        "store: {{ backend: redis, url: \"{}\", timeout: 1s }}\nallowlist: {{ api_keys: [\"partner\"], ips: [\"192.0.2.0/24\"] }}\ndenylist: {{ ips: [\"203.0.113.66\"], users: [\"mallory\"] }}\n{PLANS}",
        redis.url()
    );
    std::fs::write(&path, text(listen, admin, &upstream, &rest)).unwrap();
    let gateway = Gateway::start(&path, listen, admin);
    let client = client();
    let before = redis.script_calls();
    for _ in 0..10 {
        assert_eq!(
            get(&client, &gateway.url("/"), &[("x-api-key", "partner")])
                .await
                .status(),
            StatusCode::OK
        );
        assert_eq!(
            get(
                &client,
                &gateway.url("/"),
                &[("x-forwarded-for", "192.0.2.7")]
            )
            .await
            .status(),
            StatusCode::OK
        );
    }
    assert_eq!(
        redis.script_calls(),
        before,
        "allowlisted traffic never reaches the store"
    );
    // One spelling for the event, as the library's allowlist counts it (the gateway's said
    // rule="bypass").
    let samples = metrics(&client, &gateway).await;
    assert_eq!(
        sample(
            &samples,
            "floodgate_decisions_total{rule=\"allowlist\",limit=\"allowlist\",decision=\"bypassed\"}"
        ),
        20.0
    );
    let denied = get(
        &client,
        &gateway.url("/"),
        &[("x-forwarded-for", "203.0.113.66")],
    )
    .await;
    assert_eq!(denied.status(), StatusCode::FORBIDDEN);
    assert_eq!(denied.body(), r#"{"error":"forbidden"}"#);
    assert_eq!(
        get(&client, &gateway.url("/"), &[("x-user-id", "mallory")])
            .await
            .status(),
        StatusCode::FORBIDDEN
    );
    // Others are limited as usual, through the store.
    assert_eq!(
        get(
            &client,
            &gateway.url("/"),
            &[("x-forwarded-for", "198.51.100.8")]
        )
        .await
        .status(),
        StatusCode::OK
    );
    assert!(redis.script_calls() > before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_match_the_traffic_and_identities_add_no_series() {
    let upstream = Upstream::start().await;
    let directory = TempDir::new("metrics");
    let (listen, admin) = addresses();
    let path = directory.file("floodgate.yaml");
    let rest = "plans:\n  free:\n    limits: [ { name: per-minute, algorithm: fixed_window, limit: 2, window: 60s } ]\n  anonymous: {}\n";
    std::fs::write(&path, text(listen, admin, &upstream, rest)).unwrap();
    let gateway = Gateway::start(&path, listen, admin);
    let client = client();
    for _ in 0..5 {
        get(&client, &gateway.url("/"), &[("x-api-key", "counted")]).await;
    }
    let samples = metrics(&client, &gateway).await;
    let series = |decision: &str| {
        format!(
            "floodgate_decisions_total{{rule=\"plan.free\",limit=\"per-minute\",decision=\"{decision}\"}}"
        )
    };
    assert_eq!(sample(&samples, &series("allowed")), 2.0);
    assert_eq!(sample(&samples, &series("limited")), 3.0);
    assert_eq!(
        sample(
            &samples,
            "floodgate_upstream_requests_total{status=\"200\"}"
        ),
        2.0
    );
    assert!(
        samples
            .iter()
            .any(|(name, _)| name.starts_with("floodgate_check_duration_seconds_bucket")),
        "a histogram"
    );
    let series_before: std::collections::HashSet<String> =
        samples.iter().map(|(name, _)| name.clone()).collect();

    // 10,000 distinct identities: counts grow, series do not.
    let mut statuses = 0;
    for index in 0..10_000 {
        let key = format!("identity-{index}");
        if get(&client, &gateway.url("/"), &[("x-api-key", &key)])
            .await
            .status()
            == StatusCode::OK
        {
            statuses += 1;
        }
    }
    assert_eq!(statuses, 10_000);
    let samples = metrics(&client, &gateway).await;
    assert_eq!(sample(&samples, &series("allowed")), 10_002.0);
    let new_series: Vec<&String> = samples
        .iter()
        .map(|(name, _)| name)
        .filter(|name| name.contains("identity"))
        .collect();
    assert!(new_series.is_empty(), "{new_series:?}");
    let added: Vec<&String> = samples
        .iter()
        .map(|(name, _)| name)
        .filter(|name| !series_before.contains(*name))
        .collect();
    // Series that come with time are not the identities': the 429-rate baseline's two after
    // its first 10 s (`floodgate_limited_ratio`, `_anomaly`), and under load (the 10,000
    // requests then take longer) a third was seen. 10,000 identities adding a series each
    // would add 10,000; the bound leaves the timing out and keeps that in.
    assert!(
        added.len() <= 10,
        "{} series before, {} after: {added:?}",
        series_before.len(),
        samples.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_clients_are_reported_in_order() {
    let upstream = Upstream::start().await;
    let directory = TempDir::new("top");
    let (listen, admin) = addresses();
    let path = directory.file("floodgate.yaml");
    let rest = "plans:\n  free:\n    limits: [ { name: per-minute, algorithm: fixed_window, limit: 1, window: 60s } ]\n  anonymous: {}\n";
    std::fs::write(&path, text(listen, admin, &upstream, rest)).unwrap();
    let gateway = Gateway::start(&path, listen, admin);
    let client = client();
    // A skewed mix: heavy 31 requests (30 denials), medium 21, light 11, and a tail.
    for (key, requests) in [("light", 11), ("heavy", 31), ("medium", 21)] {
        for _ in 0..requests {
            get(&client, &gateway.url("/"), &[("x-api-key", key)]).await;
        }
    }
    for index in 0..50 {
        let key = format!("tail-{index}");
        get(&client, &gateway.url("/"), &[("x-api-key", &key)]).await;
    }
    let top = get(&client, &gateway.admin_url("/admin/top?n=3"), &[]).await;
    let top: serde_json::Value = serde_json::from_slice(top.body()).unwrap();
    let hash = |key: &str| {
        floodgate::Identity::ApiKey(key.to_owned())
            .hash()
            .to_string()
    };
    let by_denials: Vec<(&str, u64)> = top["by_denials"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| {
            (
                entry["identity"].as_str().unwrap(),
                entry["denials"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        by_denials,
        [
            (hash("heavy").as_str(), 30),
            (hash("medium").as_str(), 20),
            (hash("light").as_str(), 10)
        ]
    );
    assert!(!top.to_string().contains("heavy"), "identities are hashes");
    assert_eq!(top["by_closeness"].as_array().unwrap().len(), 3);
}
