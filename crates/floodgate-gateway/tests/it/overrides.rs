//! Per-client overrides through the admin API (`/admin/clients/overrides`, SPEC §7): set on
//! one gateway, in force on a second gateway on the same store within a second, on one Redis,
//! a 3-master cluster and sharded Redis; they expire by themselves, `DELETE` ends them at once,
//! the inspection and the status report show them, the token guards them, and their number is
//! bounded.

use crate::support;
use floodgate_test_support as redis_support;

use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use serde_json::{Value, json};
use support::{Gateway, TempDir, TestClient, Upstream, client, get};

const TOKEN: &str = "op-secret";

/// Three an hour for the `free` plan, on `store`; at most `max_active` overrides.
fn config(store: &str, max_active: usize) -> (usize, String) {
    let rest = format!(
        "clients:\n  api_keys: {{ \"k-one\": free, \"k-two\": free, \"k-three\": free }}\n\
         {store}plans:\n  free:\n    limits: [ {{ name: hourly, algorithm: fixed_window, limit: 3, window: 1h }} ]\n  anonymous: {{}}\n"
    );
    (max_active, rest)
}

/// A gateway with the admin token set.
fn gateway(upstream: &Upstream, (max_active, rest): &(usize, String)) -> (Gateway, TempDir) {
    let directory = TempDir::new("gw");
    let (listen, admin) = support::addresses();
    let path = directory.file("floodgate.yaml");
    let text = format!(
        "listen: \"{listen}\"\nadmin:\n  listen: \"{admin}\"\n  overrides: {{ max_active: {max_active}, max_expires_in: 1d }}\nupstream: \"{}\"\n{rest}",
        upstream.url()
    );
    std::fs::write(&path, text).unwrap();
    let gateway =
        Gateway::start_with_env(&path, listen, admin, &[("FLOODGATE_ADMIN_TOKEN", TOKEN)]);
    (gateway, directory)
}

async fn admin(
    client: &TestClient,
    gateway: &Gateway,
    method: Method,
    path_and_query: &str,
    body: Option<Value>,
    token: Option<&str>,
) -> (StatusCode, Value) {
    support::admin_call(client, gateway, method, path_and_query, body, token).await
}

/// The status and `X-RateLimit-Limit` of one request of `key`.
async fn send(client: &TestClient, gateway: &Gateway, key: &str) -> (StatusCode, u64) {
    let response = get(client, &gateway.url("/v1/things"), &[("x-api-key", key)]).await;
    let limit = response
        .headers()
        .get("x-ratelimit-limit")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0);
    (response.status(), limit)
}

/// Polls with requests of `key` until one answers `status` under `limit`; how long it took.
/// Denied requests consume nothing (a fixed window counts admissions).
async fn until(
    client: &TestClient,
    gateway: &Gateway,
    key: &str,
    expected: (StatusCode, u64),
    within: Duration,
) -> Duration {
    let started = Instant::now();
    loop {
        let answer = send(client, gateway, key).await;
        if answer == expected {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "still {answer:?} after {within:?}, waiting for {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const LIMITED: StatusCode = StatusCode::TOO_MANY_REQUESTS;

async fn across_gateways(store: &str) {
    let upstream = Upstream::start().await;
    let (a, _a_dir) = gateway(&upstream, &config(store, 100));
    let (b, _b_dir) = gateway(&upstream, &config(store, 100));
    let client = client();
    for _ in 0..3 {
        assert_eq!(send(&client, &b, "k-one").await, (StatusCode::OK, 3));
    }
    assert_eq!(send(&client, &b, "k-one").await, (LIMITED, 3));

    let path = "/admin/clients/overrides?api_key=k-one";
    set_a_two_second_override(&client, &a, path).await;
    until_in_the_status_report(&client, &b).await;
    let in_force_after = until(
        &client,
        &b,
        "k-one",
        (StatusCode::OK, 5),
        Duration::from_secs(3),
    )
    .await;
    assert!(
        in_force_after < Duration::from_secs(1),
        "in force on the second gateway after {in_force_after:?}"
    );
    assert_shown_by_the_second_gateway(&client, &b, path).await;
    // Another client of the plan keeps the plan's limit.
    assert_eq!(send(&client, &b, "k-two").await, (StatusCode::OK, 3));

    // It expires by itself (2 s after it was set), on both gateways.
    until(&client, &b, "k-one", (LIMITED, 3), Duration::from_secs(4)).await;
    until(&client, &a, "k-one", (LIMITED, 3), Duration::from_secs(2)).await;
    let (_, listed) = admin(&client, &a, Method::GET, path, None, Some(TOKEN)).await;
    assert_eq!(listed["overrides"], json!([]), "{listed}");

    delete_ends_it_everywhere(&client, &a, &b, path).await;
}

/// Sets an override of `hourly` to 5 for 2 s on `gateway`, which answers with what it stored.
async fn set_a_two_second_override(client: &TestClient, gateway: &Gateway, path: &str) {
    let body = json!({"name": "hourly", "limit": 5, "expires_in": "2s"});
    let (status, stored) = admin(client, gateway, Method::PUT, path, Some(body), Some(TOKEN)).await;
    assert_eq!(status, StatusCode::OK, "{stored}");
    assert_eq!(stored["limit"], 5);
    assert_eq!(stored["name"], "hourly");
    assert_eq!(stored["plan"], "free");
    assert_eq!(stored["window_seconds"], 3600.0, "the limit's own window");
    assert_eq!(stored["expires_in"], 2);
}

/// Regression: a gateway refreshed its copy only when requests came. Without any request to
/// it, the second gateway's status report (its copy) shows the override within 1 s.
async fn until_in_the_status_report(client: &TestClient, gateway: &Gateway) {
    let set_at = Instant::now();
    loop {
        let (_, report) = admin(
            client,
            gateway,
            Method::GET,
            "/admin/status",
            None,
            Some(TOKEN),
        )
        .await;
        if report["overrides_in_force"] == 1 {
            break;
        }
        assert!(
            set_at.elapsed() < Duration::from_secs(1),
            "not in the second gateway's copy after {:?}: {report}",
            set_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The second gateway's inspection shows the override, with the counter carried over (4 of 5
/// used), and so do its list and its status report.
async fn assert_shown_by_the_second_gateway(client: &TestClient, gateway: &Gateway, path: &str) {
    let (status, inspected) = admin(
        client,
        gateway,
        Method::GET,
        "/admin/clients?api_key=k-one",
        None,
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{inspected}");
    assert_eq!(inspected["limits"][0]["limit"], 5, "{inspected}");
    assert_eq!(inspected["limits"][0]["remaining"], 1, "{inspected}");
    assert_eq!(
        inspected["limits"][0]["override"]["limit"], 5,
        "{inspected}"
    );
    let (_, listed) = admin(client, gateway, Method::GET, path, None, Some(TOKEN)).await;
    assert_eq!(
        listed["overrides"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );
    let (_, report) = admin(
        client,
        gateway,
        Method::GET,
        "/admin/status",
        None,
        Some(TOKEN),
    )
    .await;
    assert_eq!(report["overrides"][0]["name"], "hourly", "{report}");
}

/// `DELETE` ends an override at once on the gateway asked (`a`), within a second on the other
/// (`b`); a second `DELETE` finds nothing left.
async fn delete_ends_it_everywhere(client: &TestClient, a: &Gateway, b: &Gateway, path: &str) {
    let body = json!({"name": "hourly", "limit": 100, "expires_in": "1h"});
    let (status, _) = admin(client, a, Method::PUT, path, Some(body), Some(TOKEN)).await;
    assert_eq!(status, StatusCode::OK);
    until(
        client,
        b,
        "k-one",
        (StatusCode::OK, 100),
        Duration::from_secs(2),
    )
    .await;
    let (status, removed) = admin(
        client,
        a,
        Method::DELETE,
        "/admin/clients/overrides?api_key=k-one&name=hourly",
        None,
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{removed}");
    assert_eq!(removed["removed"], json!(["hourly"]));
    assert_eq!(
        send(client, a, "k-one").await,
        (LIMITED, 3),
        "at once where removed"
    );
    let removed_after = until(client, b, "k-one", (LIMITED, 3), Duration::from_secs(3)).await;
    assert!(
        removed_after < Duration::from_secs(1),
        "removed on the second gateway after {removed_after:?}"
    );
    let (status, _) = admin(client, a, Method::DELETE, path, None, Some(TOKEN)).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "nothing left to remove");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_cross_gateways_on_redis() {
    let redis = redis_support::RedisServer::start();
    across_gateways(&support::redis_store(&redis.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_cross_gateways_on_a_cluster() {
    let cluster = redis_support::RedisCluster::start(3);
    across_gateways(&support::cluster_store(&cluster.urls())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_cross_gateways_on_sharded_redis() {
    let nodes: Vec<_> = (0..3)
        .map(|_| redis_support::RedisServer::start())
        .collect();
    let urls: Vec<String> = nodes.iter().map(redis_support::RedisServer::url).collect();
    across_gateways(&support::sharded_store(&urls)).await;
}

/// The token is required for every override operation; the bound answers 409 and is counted;
/// bad bodies are refused with the field they are about; names outside the plan are 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_are_guarded_bounded_and_checked() {
    let upstream = Upstream::start().await;
    let (gateway, _dir) = gateway(&upstream, &config("", 2));
    let client = client();
    let path = |key: &str| format!("/admin/clients/overrides?api_key={key}");
    let body = || json!({"name": "hourly", "limit": 10, "expires_in": "1h"});
    for (method, body) in [
        (Method::PUT, Some(body())),
        (Method::GET, None),
        (Method::DELETE, None),
    ] {
        let (status, _) = admin(
            &client,
            &gateway,
            method.clone(),
            &path("k-one"),
            body.clone(),
            None,
        )
        .await;
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "{method} without the token"
        );
        let (status, _) = admin(
            &client,
            &gateway,
            method.clone(),
            &path("k-one"),
            body,
            Some("wrong"),
        )
        .await;
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "{method} with a wrong token"
        );
    }
    assert_eq!(
        send(&client, &gateway, "k-one").await,
        (StatusCode::OK, 3),
        "nothing was set"
    );

    for key in ["k-one", "k-two"] {
        let (status, stored) = admin(
            &client,
            &gateway,
            Method::PUT,
            &path(key),
            Some(body()),
            Some(TOKEN),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{stored}");
    }
    let (status, refused) = admin(
        &client,
        &gateway,
        Method::PUT,
        &path("k-three"),
        Some(body()),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{refused}");
    assert_eq!(refused["error"], "too_many_overrides");
    // Replacing one in force is not one more.
    let (status, _) = admin(
        &client,
        &gateway,
        Method::PUT,
        &path("k-one"),
        Some(body()),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    // Every override, without a client, a page at a time.
    let (status, page) = admin(
        &client,
        &gateway,
        Method::GET,
        "/admin/clients/overrides?per_page=1",
        None,
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert_eq!(page["total"], 2);
    assert_eq!(page["overrides"].as_array().map(Vec::len), Some(1));
    let next = page["next"].as_str().expect("a second page").to_owned();
    let (_, second) = admin(
        &client,
        &gateway,
        Method::GET,
        &format!(
            "/admin/clients/overrides?per_page=1&after={}",
            urlencode(&next)
        ),
        None,
        Some(TOKEN),
    )
    .await;
    assert_eq!(
        second["overrides"].as_array().map(Vec::len),
        Some(1),
        "{second}"
    );
    assert_ne!(
        second["overrides"][0]["identity"],
        page["overrides"][0]["identity"]
    );
    assert_eq!(second["next"], Value::Null);

    let cases = [
        (
            json!({"name": "hourly", "limit": 10}),
            "expires_in: is required",
        ),
        (
            json!({"name": "hourly", "limit": 10, "expires_in": "2d"}),
            "expires_in: must be between 1s and 86400s",
        ),
        (
            json!({"name": "hourly", "limit": 0, "expires_in": "1h"}),
            "limit: must be greater than 0",
        ),
        (
            json!({"name": "hourly", "limit": 10, "burst": 5, "expires_in": "1h"}),
            "burst: not used by fixed_window; remove it",
        ),
        (
            json!({"name": "hourly", "limit": "ten", "expires_in": "1h"}),
            "limit: must be a whole number",
        ),
    ];
    for (body, detail) in cases {
        let (status, answer) = admin(
            &client,
            &gateway,
            Method::PUT,
            &path("k-one"),
            Some(body.clone()),
            Some(TOKEN),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert_eq!(answer["detail"], detail, "{body}");
    }
    let (status, answer) = admin(
        &client,
        &gateway,
        Method::PUT,
        &path("k-one"),
        Some(json!({"name": "daily", "limit": 10, "expires_in": "1h"})),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");

    let metrics = get(&client, &gateway.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(metrics.body()).into_owned();
    assert!(
        text.contains("floodgate_overrides_total{action=\"set\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("floodgate_overrides_total{action=\"refused\"} 1"),
        "{text}"
    );
    assert!(text.contains("floodgate_overrides_active 2"), "{text}");
    gateway.wait_for_log(
        |line| line.contains("limit override set through the admin API") && line.contains("caller"),
        "the change logged at WARN with the caller",
    );
}

/// `%`-encodes what a query value cannot hold as it is.
fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                (byte as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

/// This gateway's count of overrides in its copy (`/admin/status`).
async fn in_force(client: &TestClient, gateway: &Gateway) -> Value {
    let (_, report) = admin(
        client,
        gateway,
        Method::GET,
        "/admin/status",
        None,
        Some(TOKEN),
    )
    .await;
    report["overrides_in_force"].clone()
}

/// Redis down: every override operation answers 503 `store_unavailable` and changes nothing,
/// requests are served by the failure policy, and the gateway keeps the copy it had. Redis
/// back, and empty (it kept nothing): the copy follows it, and a new override can be set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_while_redis_is_down_and_after() {
    let mut redis = redis_support::RedisServer::start();
    let upstream = Upstream::start().await;
    let store = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n",
        redis.url()
    );
    let (gateway, _dir) = gateway(&upstream, &config(&store, 10));
    let client = client();
    let body = json!({"name": "hourly", "limit": 5, "expires_in": "1h"});
    let set = "/admin/clients/overrides?api_key=k-one";
    let (status, stored) = admin(
        &client,
        &gateway,
        Method::PUT,
        set,
        Some(body.clone()),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{stored}");
    assert_eq!(send(&client, &gateway, "k-one").await, (StatusCode::OK, 5));

    redis.kill();
    for (method, path_and_query, body) in [
        (
            Method::PUT,
            "/admin/clients/overrides?api_key=k-two",
            Some(body.clone()),
        ),
        (Method::GET, "/admin/clients/overrides?api_key=k-one", None),
        (Method::GET, "/admin/clients/overrides", None),
        (
            Method::DELETE,
            "/admin/clients/overrides?api_key=k-one&name=hourly",
            None,
        ),
    ] {
        let (status, answer) = admin(
            &client,
            &gateway,
            method.clone(),
            path_and_query,
            body,
            Some(TOKEN),
        )
        .await;
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{method} {path_and_query}: {answer}"
        );
        assert_eq!(answer["error"], "store_unavailable", "{answer}");
    }
    // `on_store_error: open`: served, without made-up limit headers.
    assert_eq!(send(&client, &gateway, "k-one").await, (StatusCode::OK, 0));
    assert_eq!(in_force(&client, &gateway).await, 1, "the copy is kept");

    redis.restart();
    // The store is reached again after the breaker's `open_for` (2 s) and a reconnection:
    // a generous bound of 10 s for both.
    let back = Instant::now();
    while in_force(&client, &gateway).await != 0 {
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "the copy still holds what Redis lost"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, stored) = admin(
        &client,
        &gateway,
        Method::PUT,
        "/admin/clients/overrides?api_key=k-two",
        Some(body),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{stored}");
    assert_eq!(send(&client, &gateway, "k-two").await, (StatusCode::OK, 5));
    assert_eq!(send(&client, &gateway, "k-one").await, (StatusCode::OK, 3));
}

/// An override set on a token bucket with a burst of its own no longer fits once a reload
/// makes that limit a fixed window (which has no burst): decisions and `/admin/clients` use
/// the configured limit, and the override stays listed until it expires or is removed. A
/// reload back to the bucket applies it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_that_a_reload_makes_unfit_stops_applying() {
    let upstream = Upstream::start().await;
    let plan = |algorithm: &str| {
        format!(
            "clients:\n  api_keys: {{ \"k-one\": free }}\nplans:\n  free:\n    limits: [ {{ name: hourly, algorithm: {algorithm}, limit: 3, window: 1h }} ]\n  anonymous: {{}}\n"
        )
    };
    let (gateway, directory) = gateway(&upstream, &(10, plan("token_bucket")));
    let client = client();
    let body = json!({"name": "hourly", "limit": 5, "burst": 8, "expires_in": "1h"});
    let set = "/admin/clients/overrides?api_key=k-one";
    let (status, stored) =
        admin(&client, &gateway, Method::PUT, set, Some(body), Some(TOKEN)).await;
    assert_eq!(status, StatusCode::OK, "{stored}");
    let applied = |inspected: &Value| inspected["limits"][0]["override"]["burst"].clone();
    let inspect = || {
        admin(
            &client,
            &gateway,
            Method::GET,
            "/admin/clients?api_key=k-one",
            None,
            Some(TOKEN),
        )
    };
    assert_eq!(applied(&inspect().await.1), 8);

    let path = directory.file("floodgate.yaml");
    let reload_to = async |algorithm: &str| {
        let text = std::fs::read_to_string(&path).unwrap();
        let (head, _) = text.split_once("clients:").unwrap();
        support::write_atomically(&path, &format!("{head}{}", plan(algorithm)));
        let reload = "/admin/reload";
        let (status, answer) =
            admin(&client, &gateway, Method::POST, reload, None, Some(TOKEN)).await;
        assert_eq!(status, StatusCode::OK, "{answer}");
    };
    reload_to("fixed_window").await;
    let (_, inspected) = inspect().await;
    assert_eq!(inspected["limits"][0]["limit"], 3, "{inspected}");
    assert!(applied(&inspected).is_null(), "{inspected}");
    assert_eq!(send(&client, &gateway, "k-one").await, (StatusCode::OK, 3));
    let (_, listed) = admin(&client, &gateway, Method::GET, set, None, Some(TOKEN)).await;
    assert_eq!(
        listed["overrides"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );

    reload_to("token_bucket").await;
    assert_eq!(applied(&inspect().await.1), 8);
}
