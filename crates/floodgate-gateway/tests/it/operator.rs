//! Through the `floodgate` binary: inspecting and resetting one client from the admin
//! API on every store, and costs the upstream reports after the response (SPEC §7, §9).

use crate::support;
use floodgate_test_support as redis_support;

use bytes::Bytes;
use http::{Method, StatusCode};
use serde_json::Value;
use support::{Gateway, TempDir, TestClient, Upstream, client, get, start_gateway};

const KNOWN_KEYS: &str = r#"
clients:
  api_keys: { "k-one": free, "k-two": free }
"#;

/// Five an hour for the `free` plan, on `store`.
fn hourly_five(store: &str) -> String {
    format!(
        "{KNOWN_KEYS}{store}plans:\n  free:\n    limits: [ {{ name: hourly, algorithm: fixed_window, limit: 5, window: 1h }} ]\n  anonymous: {{}}\n"
    )
}

async fn admin(
    client: &TestClient,
    gateway: &Gateway,
    method: Method,
    path_and_query: &str,
    token: Option<&str>,
) -> (StatusCode, Value) {
    support::admin_call(client, gateway, method, path_and_query, None, token).await
}

fn remaining(response: &http::Response<Bytes>) -> u64 {
    response.headers()["x-ratelimit-remaining"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

async fn as_client(client: &TestClient, gateway: &Gateway, key: &str) -> http::Response<Bytes> {
    get(client, &gateway.url("/v1/things"), &[("x-api-key", key)]).await
}

/// The inspection shows what the last answer showed, twice over, and the next request is
/// admitted as if nobody had looked. Redis stores get a 2 s deadline: on a loaded machine the
/// first connection can take longer than the default 50 ms, and a request that fails open
/// would not count.
async fn inspection_changes_nothing(store: &str) {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = start_gateway(&upstream.url(), &hourly_five(store));
    let client = client();
    as_client(&client, &gateway, "k-one").await;
    let last = remaining(&as_client(&client, &gateway, "k-one").await);
    assert_eq!(last, 3);
    for _ in 0..2 {
        let (status, body) = admin(
            &client,
            &gateway,
            Method::GET,
            "/admin/clients?api_key=k-one",
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["plan"], "free");
        assert_eq!(body["scope"], "key");
        assert_eq!(body["limits"][0]["name"], "hourly");
        assert_eq!(body["limits"][0]["limit"], 5);
        assert_eq!(body["limits"][0]["remaining"], last, "{body}");
        assert_eq!(body["limits"][0]["retry_after"], Value::Null);
    }
    assert_eq!(remaining(&as_client(&client, &gateway, "k-one").await), 2);
}

/// A quota (a fixed window of a day or longer) shows what its period has used and left, and
/// when the period ends; a shorter limit shows no quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_quota_shows_its_period_used_and_left() {
    let upstream = Upstream::start().await;
    let plans = format!(
        "{KNOWN_KEYS}plans:\n  free:\n    limits:\n      - {{ name: hourly, algorithm: fixed_window, limit: 50, window: 1h }}\n      - {{ name: daily, algorithm: fixed_window, limit: 100, window: 1d }}\n  anonymous: {{}}\n"
    );
    let (gateway, _directory) = start_gateway(&upstream.url(), &plans);
    let client = client();
    for _ in 0..3 {
        as_client(&client, &gateway, "k-one").await;
    }
    let (status, body) = admin(
        &client,
        &gateway,
        Method::GET,
        "/admin/clients?api_key=k-one",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["limits"][0]["name"], "hourly");
    assert!(body["limits"][0].get("quota").is_none(), "{body}");
    let quota = &body["limits"][1]["quota"];
    assert_eq!(quota["used"], 3, "{body}");
    assert_eq!(quota["left"], 97, "{body}");
    // A day's window ends at midnight UTC.
    let ends = quota["period_ends_at"].as_str().unwrap();
    assert!(ends.ends_with("T00:00:00.000Z"), "{ends}");
}

/// A daily quota on the calendar (midnight to midnight in UTC): the headers and the
/// `Retry-After` of a denial point at midnight, the period's real end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calendar_quota_resets_at_the_periods_end() {
    let upstream = Upstream::start().await;
    let plans = format!(
        "{KNOWN_KEYS}response: {{ retry_after_jitter: 0 }}\nplans:\n  free:\n    limits: [ {{ name: daily, algorithm: fixed_window, limit: 2, period: day, time_zone: UTC }} ]\n  anonymous: {{}}\n"
    );
    let (gateway, _directory) = start_gateway(&upstream.url(), &plans);
    let client = client();
    let now_secs = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    };
    let until_midnight = || 86_400 - now_secs() % 86_400;
    let header = |response: &http::Response<Bytes>, name: &str| -> u64 {
        response.headers()[name].to_str().unwrap().parse().unwrap()
    };
    let first = as_client(&client, &gateway, "k-one").await;
    // X-RateLimit-Reset is the reset's Unix time: the next midnight.
    let reset = header(&first, "x-ratelimit-reset");
    assert_eq!(reset % 86_400, 0, "reset {reset}");
    assert!(
        reset.abs_diff(now_secs() + until_midnight()) <= 5,
        "reset {reset}"
    );
    as_client(&client, &gateway, "k-one").await;
    let denied = as_client(&client, &gateway, "k-one").await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    // Retry-After is the wait: until midnight (a second may pass while the test reads it).
    let retry = header(&denied, "retry-after");
    assert!(retry.abs_diff(until_midnight()) <= 5, "Retry-After {retry}");
    assert!(
        denied.headers()["ratelimit-policy"]
            .to_str()
            .unwrap()
            .contains("w=86400"),
        "the period's nominal length in the policy"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspection_changes_nothing_on_memory() {
    inspection_changes_nothing("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspection_changes_nothing_on_redis() {
    let redis = redis_support::RedisServer::start();
    inspection_changes_nothing(&support::redis_store(&redis.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspection_changes_nothing_on_a_cluster() {
    let cluster = redis_support::RedisCluster::start(3);
    inspection_changes_nothing(&support::cluster_store(&cluster.urls())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspection_changes_nothing_in_batched_mode() {
    let redis = redis_support::RedisServer::start();
    inspection_changes_nothing(&format!(
        "store: {{ backend: redis, url: \"{}\", timeout: 2s, sync_interval: 50ms }}\n",
        redis.url()
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_client_shows_when_it_will_be_admitted() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = start_gateway(&upstream.url(), &hourly_five(""));
    let client = client();
    for _ in 0..6 {
        as_client(&client, &gateway, "k-one").await;
    }
    let (_, body) = admin(
        &client,
        &gateway,
        Method::GET,
        "/admin/clients?api_key=k-one",
        None,
    )
    .await;
    let limit = &body["limits"][0];
    assert_eq!(limit["remaining"], 0);
    assert_eq!(limit["allowed"], false);
    let retry = limit["retry_after"].as_f64().expect("a wait");
    assert!(retry > 0.0 && retry <= 3600.0, "{retry}");
    // The hash /admin/top shows names the same client.
    let identity = body["identity"].as_str().unwrap().to_owned();
    let (status, by_hash) = admin(
        &client,
        &gateway,
        Method::GET,
        &format!("/admin/clients?identity={identity}&plan=free"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{by_hash}");
    assert_eq!(by_hash["limits"][0]["remaining"], 0);
    for bad in [
        "/admin/clients",
        "/admin/clients?api_key=a&user=b",
        "/admin/clients?identity=xyz",
        "/admin/clients?ip=not-an-ip",
        "/admin/clients?api_key=k-one&plan=nope",
        "/admin/clients?api_key=k-one&bogus=1",
    ] {
        let (status, body) = admin(&client, &gateway, Method::GET, bad, None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
        assert!(body["error"].is_string(), "{bad}: {body}");
    }
}

/// A reset admits a client at 0 remaining at once, and touches no other client; with a token
/// set, neither inspection nor reset works without it.
async fn reset_unblocks_one_client(store: &str) {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = gateway_with_token(&upstream, store);
    let client = client();
    for key in ["k-one", "k-two"] {
        for _ in 0..5 {
            as_client(&client, &gateway, key).await;
        }
        assert_eq!(
            as_client(&client, &gateway, key).await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    assert_refused_without_the_token(&client, &gateway).await;
    assert_eq!(
        as_client(&client, &gateway, "k-one").await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "a refused reset reset nothing"
    );
    let (status, body) = admin(
        &client,
        &gateway,
        Method::DELETE,
        "/admin/clients?api_key=k-one",
        Some("op-secret"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["reset"][0]["name"], "hourly");
    assert_eq!(body["keys_with_state"], 1);
    let after = as_client(&client, &gateway, "k-one").await;
    assert_eq!(
        after.status(),
        StatusCode::OK,
        "admitted right after the reset"
    );
    assert_eq!(remaining(&after), 4);
    assert_eq!(
        as_client(&client, &gateway, "k-two").await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "another client is untouched"
    );
    let (status, _) = admin(
        &client,
        &gateway,
        Method::DELETE,
        "/admin/clients?api_key=k-one&limit=no-such-limit",
        Some("op-secret"),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_the_reset_logged_and_counted(&client, &gateway).await;
}

/// A gateway of five an hour on `store`, whose admin API wants the token `op-secret`.
fn gateway_with_token(upstream: &Upstream, store: &str) -> (Gateway, TempDir) {
    let directory = TempDir::new("gw");
    let (listen, admin_addr) = support::addresses();
    let path = directory.file("floodgate.yaml");
    std::fs::write(
        &path,
        support::config_text(listen, admin_addr, &upstream.url(), &hourly_five(store)),
    )
    .unwrap();
    let gateway = Gateway::start_with_env(
        &path,
        listen,
        admin_addr,
        &[("FLOODGATE_ADMIN_TOKEN", "op-secret")],
    );
    (gateway, directory)
}

/// Neither inspection nor reset works without the token or with a wrong one.
async fn assert_refused_without_the_token(client: &TestClient, gateway: &Gateway) {
    for method in [Method::GET, Method::DELETE] {
        let (status, _) = admin(
            client,
            gateway,
            method.clone(),
            "/admin/clients?api_key=k-one",
            None,
        )
        .await;
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "{method} without the token"
        );
        let (status, _) = admin(
            client,
            gateway,
            method.clone(),
            "/admin/clients?api_key=k-one",
            Some("wrong"),
        )
        .await;
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "{method} with a wrong token"
        );
    }
}

/// The one reset is logged with the hashed identity and the caller, never the raw key, and
/// counted in `/metrics`.
async fn assert_the_reset_logged_and_counted(client: &TestClient, gateway: &Gateway) {
    let line = gateway.wait_for_log(
        |line| line.contains("client counters reset through the admin API"),
        "of the reset",
    );
    let identity = floodgate::Identity::ApiKey("k-one".into())
        .hash()
        .to_string();
    assert!(
        line.contains(&identity),
        "logged with the hashed identity: {line}"
    );
    assert!(
        line.contains("\"caller\":\"127.0.0.1:"),
        "logged with the caller: {line}"
    );
    assert!(!line.contains("k-one"), "never the raw key: {line}");
    let metrics = get(client, &gateway.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(metrics.body()).into_owned();
    assert!(text.contains("floodgate_admin_resets_total 1"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_unblocks_one_client_on_memory() {
    reset_unblocks_one_client("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_unblocks_one_client_on_redis() {
    let redis = redis_support::RedisServer::start();
    reset_unblocks_one_client(&support::redis_store(&redis.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_frees_the_leases_of_requests_in_flight() {
    let upstream = Upstream::start().await;
    let rest = format!(
        "{KNOWN_KEYS}plans:\n  free:\n    endpoints:\n      \"GET /slow\": [ {{ name: streams, algorithm: concurrency, limit: 1, window: 30s }} ]\n  anonymous: {{}}\n"
    );
    let (gateway, _directory) = start_gateway(&upstream.url(), &rest);
    let client = client();
    let slow_url = gateway.url("/slow?ms=3000");
    let holder = {
        let client = client.clone();
        let url = slow_url.clone();
        tokio::spawn(async move { get(&client, &url, &[("x-api-key", "k-one")]).await })
    };
    upstream.slow_arrived.notified().await;
    assert_eq!(
        get(&client, &slow_url, &[("x-api-key", "k-one")])
            .await
            .status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the lease is held"
    );
    let (_, before) = admin(
        &client,
        &gateway,
        Method::GET,
        "/admin/clients?api_key=k-one&method=GET&path=/slow",
        None,
    )
    .await;
    assert_eq!(before["limits"][0]["name"], "streams");
    assert_eq!(before["limits"][0]["remaining"], 0);
    let (status, body) = admin(
        &client,
        &gateway,
        Method::DELETE,
        "/admin/clients?api_key=k-one&method=GET&path=/slow&limit=streams",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let second = {
        let client = client.clone();
        tokio::spawn(async move { get(&client, &slow_url, &[("x-api-key", "k-one")]).await })
    };
    upstream.slow_arrived.notified().await;
    assert_eq!(holder.await.unwrap().status(), StatusCode::OK);
    assert_eq!(second.await.unwrap().status(), StatusCode::OK);
}

/// SPEC §9: a 100-token budget, completions that report 40 tokens each.
const TOKEN_BUDGET: &str = r#"
routes:
  - { match: "GET /tokens", cost_header: "x-tokens-used" }
  - { match: "GET /no-report", cost_header: "x-tokens-used" }
response: { retry_after_jitter: 0 }
plans:
  free:
    limits: [ { name: tokens, algorithm: token_bucket, limit: 100, window: 100s } ]
  anonymous: {}
"#;

async fn costs_after_the_response(store: &str) {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = start_gateway(
        &upstream.url(),
        &format!("{KNOWN_KEYS}{store}{TOKEN_BUDGET}"),
    );
    let client = client();
    let completion = |used: &str| gateway.url(&format!("/tokens?used={used}"));
    for request in 0..3 {
        let response = get(&client, &completion("40"), &[("x-api-key", "k-one")]).await;
        assert_eq!(response.status(), StatusCode::OK, "request {request}");
        assert!(
            !response.headers().contains_key("x-tokens-used"),
            "the header is stripped from the client's response"
        );
    }
    let denied = get(&client, &completion("40"), &[("x-api-key", "k-one")]).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    // 20 tokens of debt and 1 for the request, at one token a second; a whole second may
    // pass during the test.
    let retry: u64 = denied.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((20..=21).contains(&retry), "Retry-After {retry}");

    // Malformed and missing values: counted, nothing more charged.
    let mut seen = Vec::new();
    for used in ["abc", "-5", "4.5"] {
        let response = get(&client, &completion(used), &[("x-api-key", "k-two")]).await;
        seen.push(remaining(&response));
    }
    assert_eq!(seen, [99, 98, 97]);
    let other = get(
        &client,
        &gateway.url("/v1/other"),
        &[("x-api-key", "k-two")],
    )
    .await;
    assert_eq!(remaining(&other), 96, "routes without cost_header charge 1");
    let missing = get(
        &client,
        &gateway.url("/no-report"),
        &[("x-api-key", "k-two")],
    )
    .await;
    assert_eq!(
        remaining(&missing),
        95,
        "an upstream that reports nothing is charged 1"
    );

    let metrics = get(&client, &gateway.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(metrics.body()).into_owned();
    assert!(
        text.contains("floodgate_post_charge_units_total 117"),
        "{text}"
    );
    assert!(
        text.contains("floodgate_post_charge_skipped_total{reason=\"malformed\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("floodgate_post_charge_skipped_total{reason=\"missing\"} 1"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn costs_known_after_the_response_on_memory() {
    costs_after_the_response("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn costs_known_after_the_response_on_redis() {
    let redis = redis_support::RedisServer::start();
    costs_after_the_response(&support::redis_store(&redis.url())).await;
}

/// SPEC §9: a completion reserves `estimate_max` (400) up front whatever its `x-max-tokens`
/// says, then is settled against the tokens it reports using: the difference back when it
/// used less, charged when more.
const ESTIMATED: &str = r#"
routes:
  - { match: "GET /tokens", cost_header: "x-tokens-used", estimate_header: "x-max-tokens", estimate_max: 400, cost: 50 }
plans:
  free:
    limits: [ { name: tokens, algorithm: fixed_window, limit: 1000, window: 60s } ]
  anonymous: {}
"#;

async fn estimates_are_settled(store: &str) {
    let upstream = Upstream::start().await;
    let (gateway, _directory) =
        start_gateway(&upstream.url(), &format!("{KNOWN_KEYS}{store}{ESTIMATED}"));
    let client = client();
    let completion = |used: &str| gateway.url(&format!("/tokens?used={used}"));
    let key = ("x-api-key", "k-one");
    // 300 estimated, 400 reserved up front, 200 used: 200 back.
    let under = get(&client, &completion("200"), &[key, ("x-max-tokens", "300")]).await;
    assert_eq!(remaining(&under), 600, "estimate_max, up front");
    let after = get(&client, &gateway.url("/v1/other"), &[key]).await;
    assert_eq!(remaining(&after), 1000 - 200 - 1, "settled at what it used");
    // 400 reserved again; 450 used: 50 more.
    let over = get(
        &client,
        &completion("450"),
        &[key, ("x-max-tokens", "9999")],
    )
    .await;
    assert_eq!(remaining(&over), 799 - 400);
    // Without an estimate too, 400 is reserved: the 349 left are not room for it.
    let plain = get(&client, &completion("50"), &[key]).await;
    assert_eq!(plain.status(), StatusCode::TOO_MANY_REQUESTS);
    let last = get(&client, &gateway.url("/v1/other"), &[key]).await;
    assert_eq!(remaining(&last), 1000 - 651 - 1);
    let metrics = get(&client, &gateway.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(metrics.body()).into_owned();
    assert!(
        text.contains("floodgate_refunded_units_total 200"),
        "{text}"
    );
    assert!(
        text.contains("floodgate_post_charge_units_total 50"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn estimates_are_settled_both_ways_on_memory() {
    estimates_are_settled("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn estimates_are_settled_both_ways_on_redis() {
    let redis = redis_support::RedisServer::start();
    estimates_are_settled(&support::redis_store(&redis.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_visible_cost_header_reaches_the_client() {
    let upstream = Upstream::start().await;
    let rest = TOKEN_BUDGET.replace(
        "cost_header: \"x-tokens-used\"",
        "cost_header: \"x-tokens-used\", cost_header_visible: true",
    );
    let (gateway, _directory) = start_gateway(&upstream.url(), &format!("{KNOWN_KEYS}{rest}"));
    let response = get(
        &client(),
        &gateway.url("/tokens?used=7"),
        &[("x-api-key", "k-one")],
    )
    .await;
    assert_eq!(response.headers()["x-tokens-used"], "7");
}

/// A reset is one client's: a global ceiling (every client's counter) is never reset, and
/// without a request named, every endpoint limit of the client is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_clears_every_limit_of_the_client_and_no_global_ceiling() {
    let upstream = Upstream::start().await;
    let rest = format!(
        "{KNOWN_KEYS}global:\n  \"GET /search\": [ {{ name: search-all, algorithm: fixed_window, limit: 3, window: 1h }} ]\nplans:\n  free:\n    limits: [ {{ name: hourly, algorithm: fixed_window, limit: 100, window: 1h }} ]\n    endpoints:\n      \"GET /export\": [ {{ name: exports, algorithm: fixed_window, limit: 1, window: 1h }} ]\n  anonymous: {{}}\n"
    );
    let (gateway, _directory) = start_gateway(&upstream.url(), &rest);
    let client = client();
    let url = |path: &str| gateway.url(path);
    for _ in 0..3 {
        get(&client, &url("/search"), &[("x-api-key", "k-one")]).await;
    }
    get(&client, &url("/export"), &[("x-api-key", "k-one")]).await;
    let export = get(&client, &url("/export"), &[("x-api-key", "k-one")]).await;
    assert_eq!(export.status(), StatusCode::TOO_MANY_REQUESTS);

    let (status, body) = admin(
        &client,
        &gateway,
        Method::DELETE,
        "/admin/clients?api_key=k-one",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let names: Vec<&str> = body["reset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|limit| limit["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["hourly", "exports"],
        "every limit of the client, no ceiling"
    );
    assert_eq!(
        get(&client, &url("/export"), &[("x-api-key", "k-one")])
            .await
            .status(),
        StatusCode::OK,
        "the endpoint limit was reset"
    );
    let (status, body) = admin(
        &client,
        &gateway,
        Method::DELETE,
        "/admin/clients?api_key=k-one&method=GET&path=/search",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(
        !body.to_string().contains("search-all"),
        "the ceiling is not reset: {body}"
    );
    assert_eq!(
        get(&client, &url("/search"), &[("x-api-key", "k-two")])
            .await
            .status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the global ceiling still holds for everyone"
    );
}

/// On Redis, a client over its limit is denied by each gateway from memory until its wait is
/// over, with the headers Redis's denial had, and no store call; `DELETE /admin/clients` on one
/// gateway lets it in on another within a round trip (a minute before its window ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_on_one_gateway_ends_local_denials_on_another() {
    let redis = redis_support::RedisServer::start();
    let upstream = Upstream::start().await;
    let store = support::redis_store(&redis.url());
    let (first, _first_dir) = start_gateway(&upstream.url(), &hourly_five(&store));
    let (second, _second_dir) = start_gateway(&upstream.url(), &hourly_five(&store));
    let client = client();
    for _ in 0..5 {
        assert_eq!(
            as_client(&client, &first, "k-one").await.status(),
            StatusCode::OK
        );
    }
    let by_redis = as_client(&client, &second, "k-one").await;
    assert_eq!(by_redis.status(), StatusCode::TOO_MANY_REQUESTS);
    // The second gateway's subscription to resets may still be on its way: local denials
    // start once it is up.
    let started = std::time::Instant::now();
    let local = loop {
        let calls = redis.script_calls();
        let response = as_client(&client, &second, "k-one").await;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        if redis.script_calls() == calls {
            break response;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(3),
            "never denied locally"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    for header in [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "ratelimit-policy",
    ] {
        assert_eq!(
            local.headers()[header],
            by_redis.headers()[header],
            "{header}"
        );
    }
    let metrics = get(&client, &second.admin_url("/metrics"), &[]).await;
    let metrics = String::from_utf8_lossy(metrics.body()).into_owned();
    assert!(
        metrics
            .lines()
            .any(|line| line.starts_with("floodgate_local_denials_total ") && !line.ends_with(" 0")),
        "{metrics}"
    );

    let (status, _) = admin(
        &client,
        &first,
        Method::DELETE,
        "/admin/clients?api_key=k-one",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let reset_at = std::time::Instant::now();
    while as_client(&client, &second, "k-one").await.status() != StatusCode::OK {
        assert!(
            reset_at.elapsed() < std::time::Duration::from_secs(1),
            "the reset did not reach the second gateway within 1 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// A streamed completion over h2c: two data frames, then the tokens it used (the query's
/// `used`) in its trailers, as streaming LLM APIs report them. Any other path: a plain answer.
struct Completion {
    frames: std::collections::VecDeque<http_body::Frame<Bytes>>,
}

impl http_body::Body for Completion {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.frames.pop_front().map(Ok))
    }
}

async fn h2c_streaming_upstream() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let service = hyper::service::service_fn(
                |request: http::Request<hyper::body::Incoming>| async move {
                    let mut frames = std::collections::VecDeque::new();
                    frames.push_back(http_body::Frame::data(Bytes::from_static(b"data: one\n\n")));
                    if request.uri().path() == "/stream" {
                        let used = request
                            .uri()
                            .query()
                            .and_then(|query| query.strip_prefix("used="))
                            .unwrap_or("0")
                            .to_owned();
                        frames.push_back(http_body::Frame::data(Bytes::from_static(
                            b"data: two\n\n",
                        )));
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("x-tokens-used", used.parse().unwrap());
                        frames.push_back(http_body::Frame::trailers(trailers));
                    }
                    Ok::<_, std::convert::Infallible>(http::Response::new(Completion { frames }))
                },
            );
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
            );
        }
    });
    addr
}

/// SPEC §9 through the gateway: an h2c upstream streams a completion and reports its tokens in
/// the trailers; the gateway settles the reservation from them when the stream ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_completion_is_settled_from_the_upstreams_trailers() {
    let upstream = h2c_streaming_upstream().await;
    let rest = format!(
        "{KNOWN_KEYS}upstream_protocol: http2\nroutes:\n  - {{ match: \"GET /stream\", cost_header: \"x-tokens-used\", estimate_header: \"x-max-tokens\", estimate_max: 400 }}\nplans:\n  free:\n    limits: [ {{ name: tokens, algorithm: fixed_window, limit: 1000, window: 60s }} ]\n  anonymous: {{}}\n"
    );
    let (gateway, _directory) = start_gateway(&format!("http://{upstream}"), &rest);
    let client = client();
    let key = ("x-api-key", "k-one");
    let streamed = get(
        &client,
        &gateway.url("/stream?used=120"),
        &[key, ("x-max-tokens", "300")],
    )
    .await;
    assert_eq!(streamed.status(), StatusCode::OK);
    assert_eq!(remaining(&streamed), 600, "estimate_max, up front");
    assert_eq!(&streamed.body()[..], b"data: one\n\ndata: two\n\n");
    let next = get(&client, &gateway.url("/v1/other"), &[key]).await;
    assert_eq!(
        remaining(&next),
        1000 - 120 - 1,
        "settled from the trailers"
    );
}
