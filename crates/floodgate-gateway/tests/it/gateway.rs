//! Black-box tests of the `floodgate` binary: real gateway processes, a real upstream, real
//! sockets (and real redis-server processes for the shared-store test).

use crate::support;
use floodgate_test_support as redis_support;

use std::process::Command;
use std::time::{Duration, Instant};

use http::StatusCode;
use http_body_util::BodyExt;
use support::{
    Gateway, TempDir, Upstream, addresses, client, config_text, free_port, get, start_gateway,
    write_atomically,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PLANS: &str = r#"
plans:
  anonymous:
    limits: [ { name: per-minute, algorithm: fixed_window, limit: 2, window: 60s } ]
  free:
    limits: [ { name: per-minute, algorithm: fixed_window, limit: 3, window: 60s } ]
  enterprise:
    limits: [ { name: per-minute, algorithm: fixed_window, limit: 5, window: 60s } ]
clients:
  api_keys:
    "ent-key": enterprise
"#;

/// Starts a gateway on a fresh config; returns it with its directory.
fn gateway(upstream: &Upstream, rest: &str) -> (Gateway, TempDir) {
    start_gateway(&upstream.url(), rest)
}

async fn admitted(
    client: &support::TestClient,
    url: &str,
    headers: &[(&str, &str)],
    attempts: usize,
) -> usize {
    let mut admitted = 0;
    for _ in 0..attempts {
        let response = get(client, url, headers).await;
        match response.status() {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}: {:?}", response.body()),
        }
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_headers_and_429s_for_each_identity_and_plan() {
    let upstream = Upstream::start().await;
    let rest = format!(
        "identity:\n  trusted_proxies: [\"127.0.0.1/32\"]\n  user_header: x-user-id\n  plan_header: x-plan\n{PLANS}"
    );
    let (gateway, _directory) = gateway(&upstream, &rest);
    let client = client();
    let url = gateway.url("/v1/things");

    // Anonymous, by IP (a trusted proxy, us, names the client in X-Forwarded-For).
    let first = get(&client, &url, &[("x-forwarded-for", "198.51.100.1")]).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.headers()["x-ratelimit-limit"], "2");
    assert_eq!(first.headers()["x-ratelimit-remaining"], "1");
    assert_eq!(
        first.headers()["ratelimit-policy"],
        "\"per-minute\";q=2;w=60"
    );
    assert_eq!(
        admitted(&client, &url, &[("x-forwarded-for", "198.51.100.1")], 3).await,
        1
    );
    let denied = get(&client, &url, &[("x-forwarded-for", "198.51.100.1")]).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = denied.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let body: serde_json::Value = serde_json::from_slice(denied.body()).unwrap();
    assert_eq!(body["error"], "rate_limit_exceeded");
    assert_eq!(body["policy"], "per-minute");
    assert_eq!(
        admitted(&client, &url, &[("x-forwarded-for", "198.51.100.2")], 4).await,
        2,
        "another IP"
    );

    // API keys: listed (enterprise), by header or bearer token; unlisted (free).
    assert_eq!(
        admitted(&client, &url, &[("x-api-key", "ent-key")], 3).await,
        3
    );
    assert_eq!(
        admitted(&client, &url, &[("authorization", "Bearer ent-key")], 4).await,
        2,
        "same key"
    );
    assert_eq!(
        admitted(&client, &url, &[("x-api-key", "unlisted")], 5).await,
        3
    );

    // User ids from the trusted proxy: default plan, or the plan it names.
    assert_eq!(
        admitted(&client, &url, &[("x-user-id", "alice")], 5).await,
        3
    );
    assert_eq!(
        admitted(
            &client,
            &url,
            &[("x-user-id", "bob"), ("x-plan", "enterprise")],
            7
        )
        .await,
        5
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_forwarded_for_from_an_untrusted_peer_is_ignored() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = gateway(&upstream, PLANS);
    let client = client();
    let url = gateway.url("/");
    let mut statuses = Vec::new();
    for forged in 0..4 {
        let ip = format!("203.0.113.{forged}");
        statuses.push(
            get(&client, &url, &[("x-forwarded-for", &ip)])
                .await
                .status()
                .as_u16(),
        );
    }
    assert_eq!(
        statuses,
        [200, 200, 429, 429],
        "one client: the socket peer"
    );
    // A user header from an untrusted peer does not make a user either.
    assert_eq!(
        get(&client, &url, &[("x-user-id", "mallory")])
            .await
            .status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_forwards_faithfully() {
    let upstream = Upstream::start().await;
    let closed = format!("http://127.0.0.1:{}", free_port());
    let rest = format!(
        "upstream_timeout: 300ms\nroutes:\n  - {{ match: \"/unreachable\", upstream: \"{closed}\" }}\n"
    );
    let (gateway, _directory) = gateway(&upstream, &rest);
    let client = client();

    let echo = get(
        &client,
        &gateway.url("/echo?x=1"),
        &[
            ("host", "api.example.test"),
            ("x-forwarded-for", "192.0.2.9"),
            ("connection", "x-hop-secret"),
            ("x-hop-secret", "1"),
            ("te", "trailers"),
            ("x-end-to-end", "kept"),
        ],
    )
    .await;
    assert_eq!(echo.status(), StatusCode::OK);
    let seen: serde_json::Value = serde_json::from_slice(echo.body()).unwrap();
    let headers = &seen["headers"];
    assert_eq!(headers["host"], "api.example.test", "Host is preserved");
    assert_eq!(
        headers["x-forwarded-for"], "192.0.2.9, 127.0.0.1",
        "the peer is appended"
    );
    assert_eq!(headers["x-forwarded-proto"], "http");
    assert_eq!(headers["x-forwarded-host"], "api.example.test");
    assert_eq!(headers["x-end-to-end"], "kept");
    assert!(
        headers.get("x-hop-secret").is_none(),
        "named by Connection: hop-by-hop"
    );
    assert!(headers.get("te").is_none());
    assert!(
        !echo.headers().contains_key("keep-alive"),
        "hop-by-hop on the way back too"
    );
    assert!(!echo.headers().contains_key("x-upstream-private"));

    let unreachable = get(&client, &gateway.url("/unreachable"), &[]).await;
    assert_eq!(unreachable.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(
        unreachable.body(),
        r#"{"error":"bad_gateway"}"#,
        "no internal detail"
    );
    let slow = get(&client, &gateway.url("/slow?ms=3000"), &[]).await;
    assert_eq!(slow.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(slow.body(), r#"{"error":"upstream_timeout"}"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_upgrades_pass_through() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = gateway(&upstream, "");
    let mut stream = tokio::net::TcpStream::connect(gateway.listen)
        .await
        .unwrap();
    stream
        .write_all(b"GET /ws HTTP/1.1\r\nHost: ws.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        stream.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("upgrade: websocket"),
        "{head}"
    );
    stream
        .write_all(b"ping over the upgraded connection")
        .await
        .unwrap();
    let mut echoed = vec![0u8; 33];
    stream.read_exact(&mut echoed).await.unwrap();
    assert_eq!(echoed, b"ping over the upgraded connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_applies_within_a_second_and_drops_nothing() {
    let upstream = Upstream::start().await;
    let directory = TempDir::new("reload");
    let (listen, admin) = addresses();
    let path = directory.file("floodgate.yaml");
    let version = |limit: u64| {
        config_text(
            listen,
            admin,
            &upstream.url(),
            &format!(
                "plans:\n  free: {{}}\n  anonymous:\n    limits: [ {{ name: per-second, algorithm: token_bucket, limit: {limit}, window: 1s }} ]\n"
            ),
        )
    };
    std::fs::write(&path, version(100_000)).unwrap();
    let gateway = Gateway::start(&path, listen, admin);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (url, stop) = (gateway.url("/load"), stop.clone());
        clients.push(tokio::spawn(async move {
            let client = client();
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let request = http::Request::get(&url).body(Default::default()).unwrap();
                let response = client.request(request).await.expect("no connection error");
                let status = response.status();
                response.into_body().collect().await.expect("complete body");
                assert!(!status.is_server_error(), "{status} during reloads");
                sent += 1;
            }
            sent
        }));
    }
    let client = client();
    let mut slowest = Duration::ZERO;
    for change in 1..=50u64 {
        let limit = 100_000 + change;
        let written = Instant::now();
        write_atomically(&path, &version(limit));
        loop {
            let response = get(&client, &gateway.url("/probe"), &[]).await;
            if response
                .headers()
                .get("x-ratelimit-limit")
                .is_some_and(|value| value == limit.to_string().as_str())
            {
                break;
            }
            assert!(
                written.elapsed() < Duration::from_secs(1),
                "change {change} not in force after 1s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        slowest = slowest.max(written.elapsed());
    }
    // A bad file: rejected, the previous rules stay, and the admin endpoint says why.
    write_atomically(&path, &version(100_050).replace("window: 1s", "window: 0s"));
    let (status, error) = support::admin_reload(&client, &gateway).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error["error"]
            .as_str()
            .is_some_and(|error| error.contains("plans.anonymous.limits[0].window")),
        "{error}"
    );
    let still = get(&client, &gateway.url("/probe"), &[]).await;
    assert_eq!(still.headers()["x-ratelimit-limit"], "100050");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut sent = 0;
    for handle in clients {
        sent += handle.await.expect("client finished cleanly");
    }
    assert!(sent > 100, "{sent} requests during the reloads");
    eprintln!(
        "50 reloads under load: slowest took {slowest:?} to be in force; {sent} requests, no 5xx"
    );

    let metrics = get(&client, &gateway.admin_url("/metrics"), &[]).await;
    let metrics = String::from_utf8_lossy(metrics.body()).into_owned();
    assert!(
        metrics.contains("floodgate_config_reloads_total{result=\"failure\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("floodgate_config_version 51"), "{metrics}");

    let check = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(check.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert!(
        stderr.contains("plans.anonymous.limits[0].window: must be greater than 0"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_survive_a_reload_and_sighup_reloads() {
    let upstream = Upstream::start().await;
    let directory = TempDir::new("survive");
    let (listen, admin) = addresses();
    let path = directory.file("floodgate.yaml");
    let text = config_text(listen, admin, &upstream.url(), PLANS);
    std::fs::write(&path, &text).unwrap();
    let gateway = Gateway::start(&path, listen, admin);
    let client = client();
    assert_eq!(admitted(&client, &gateway.url("/"), &[], 1).await, 1);
    // Another change elsewhere, applied by SIGHUP rather than by the watcher.
    std::fs::write(
        &path,
        format!("{text}response:\n  docs_url: \"https://example.test/limits\"\n"),
    )
    .unwrap();
    gateway.signal("HUP");
    let started = Instant::now();
    loop {
        let config = get(&client, &gateway.admin_url("/admin/config"), &[]).await;
        let config: serde_json::Value = serde_json::from_slice(config.body()).unwrap();
        if config["config"]["response"]["docs_url"] == "https://example.test/limits" {
            assert!(
                config["config"]["clients"]["api_keys"]
                    .as_object()
                    .unwrap()
                    .keys()
                    .all(|key| key.starts_with("sha256:")),
                "keys redacted"
            );
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "SIGHUP reload not applied"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Same rule, same limit name: the one request already counted still counts.
    assert_eq!(admitted(&client, &gateway.url("/"), &[], 3).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_sharing_redis_enforce_one_limit_exactly() {
    let redis = redis_support::RedisServer::start();
    let upstream = Upstream::start().await;
    let rest = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 2s\nplans:\n  free:\n    limits: [ {{ name: hourly, algorithm: fixed_window, limit: 20, window: 1h }} ]\n  anonymous:\n    limits: [ {{ name: hourly, algorithm: gcra, limit: 7, window: 1h }} ]\n",
        redis.url()
    );
    let gateways: Vec<(Gateway, TempDir)> = (0..3).map(|_| gateway(&upstream, &rest)).collect();
    let client = client();
    let mut by_key = 0;
    let mut by_ip = 0;
    for round in 0..30 {
        let (gateway, _) = &gateways[round % 3];
        by_key += admitted(
            &client,
            &gateway.url("/"),
            &[("x-api-key", "shared-client")],
            1,
        )
        .await;
        by_ip += admitted(&client, &gateway.url("/"), &[], 1).await;
    }
    assert_eq!(by_key, 20, "one API key's limit across three gateways");
    assert_eq!(by_ip, 7, "one IP's limit across three gateways");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_requests_then_exits_zero() {
    let upstream = Upstream::start().await;
    let (mut gateway, _directory) = gateway(&upstream, "");
    let url = gateway.url("/slow?ms=800");
    let in_flight = tokio::spawn(async move { get(&client(), &url, &[]).await });
    upstream.slow_arrived.notified().await;
    gateway.signal("TERM");
    let response = in_flight.await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.body(), "slow done");
    let status = tokio::task::spawn_blocking(move || {
        let status = gateway.child.wait().unwrap();
        (status, gateway)
    })
    .await
    .unwrap()
    .0;
    assert_eq!(status.code(), Some(0));
}

/// SIGTERM the moment the gateway logs "floodgate serving" still ends it cleanly (exit 0): its
/// handler is in place before that line, not only once the workers are running (a signal in
/// between took the default action and killed the process mid-request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_as_soon_as_serving_is_logged_exits_zero() {
    let upstream = Upstream::start().await;
    let (mut gateway, _directory) = gateway(&upstream, "");
    gateway.signal("TERM");
    let status = tokio::task::spawn_blocking(move || gateway.child.wait().unwrap())
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_ip_endpoint_global_limits_and_route_costs_apply_in_order() {
    let upstream = Upstream::start().await;
    let rest = r#"
identity:
  trusted_proxies: ["127.0.0.1/32"]
routes:
  - { match: "POST /v1/completions", cost: 4 }
plans:
  anonymous: {}
  free:
    limits: [ { name: units, algorithm: fixed_window, limit: 10, window: 60s } ]
    endpoints:
      "POST /export": [ { name: export, algorithm: fixed_window, limit: 1, window: 60s } ]
per_ip:
  - { name: ip, algorithm: fixed_window, limit: 12, window: 60s }
global:
  "GET /search/{*rest}": [ { name: search, algorithm: fixed_window, limit: 3, window: 60s } ]
"#;
    let (gateway, _directory) = gateway(&upstream, rest);
    let client = client();
    let post = |path: &str, key: &str, ip: &str| {
        http::Request::post(gateway.url(path))
            .header("x-api-key", key)
            .header("x-forwarded-for", ip)
            .body(Default::default())
            .unwrap()
    };
    // A cost-4 route: 10 units allow two calls (the cost counts against every limit: 8 of the
    // address's 12 too).
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(
            client
                .request(post("/v1/completions", "key-a", "198.51.100.1"))
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
    assert_eq!(statuses, [200, 200, 429]);
    // The endpoint limit: one export per client.
    let first = client
        .request(post("/export", "key-b", "198.51.100.2"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let second = client
        .request(post("/export", "key-b", "198.51.100.2"))
        .await
        .unwrap();
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        second.headers()["x-ratelimit-limit"],
        "1",
        "the endpoint limit binds"
    );
    // Global: three searches in all, whoever sends them.
    let mut searches = 0;
    for (index, key) in ["k1", "k2", "k3", "k4", "k5"].iter().enumerate() {
        let ip = format!("198.51.100.{}", 10 + index);
        let response = get(
            &client,
            &gateway.url("/search/books"),
            &[("x-api-key", key), ("x-forwarded-for", &ip)],
        )
        .await;
        searches += usize::from(response.status() == StatusCode::OK);
    }
    assert_eq!(searches, 3);
    // Per IP, across API keys: twelve requests from one address, whatever the key.
    let mut from_one_ip = 0;
    for index in 0..14 {
        let key = format!("rotating-{index}");
        let response = get(
            &client,
            &gateway.url("/other"),
            &[("x-api-key", &key), ("x-forwarded-for", "198.51.100.99")],
        )
        .await;
        from_one_ip += usize::from(response.status() == StatusCode::OK);
    }
    assert_eq!(from_one_ip, 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_style_symlink_swap_is_seen() {
    let upstream = Upstream::start().await;
    let directory = TempDir::new("symlink");
    let (listen, admin) = addresses();
    let text = |limit: u64| {
        config_text(
            listen,
            admin,
            &upstream.url(),
            &format!(
                "plans:\n  free: {{}}\n  anonymous:\n    limits: [ {{ name: m, algorithm: fixed_window, limit: {limit}, window: 60s }} ]\n"
            ),
        )
    };
    // Kubernetes mounts ConfigMaps as file -> ..data/file, and swaps ..data atomically.
    std::fs::create_dir(directory.file("v1")).unwrap();
    std::fs::write(directory.file("v1/floodgate.yaml"), text(7)).unwrap();
    std::os::unix::fs::symlink("v1", directory.file("..data")).unwrap();
    std::os::unix::fs::symlink("..data/floodgate.yaml", directory.file("floodgate.yaml")).unwrap();
    let gateway = Gateway::start(&directory.file("floodgate.yaml"), listen, admin);
    let client = client();
    assert_eq!(
        get(&client, &gateway.url("/"), &[]).await.headers()["x-ratelimit-limit"],
        "7"
    );

    std::fs::create_dir(directory.file("v2")).unwrap();
    std::fs::write(directory.file("v2/floodgate.yaml"), text(9)).unwrap();
    std::os::unix::fs::symlink("v2", directory.file("..data_tmp")).unwrap();
    std::fs::rename(directory.file("..data_tmp"), directory.file("..data")).unwrap();
    let swapped = Instant::now();
    loop {
        let response = get(&client, &gateway.url("/"), &[]).await;
        if response.headers()["x-ratelimit-limit"] == "9" {
            break;
        }
        assert!(
            swapped.elapsed() < Duration::from_secs(1),
            "symlink swap not seen within 1s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_readiness() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = gateway(&upstream, "");
    let client = client();
    assert_eq!(
        get(&client, &gateway.admin_url("/healthz"), &[])
            .await
            .status(),
        StatusCode::OK
    );
    let ready = get(&client, &gateway.admin_url("/readyz"), &[]).await;
    assert_eq!(ready.status(), StatusCode::OK);
    let metrics = get(&client, &gateway.admin_url("/metrics"), &[]).await;
    assert!(String::from_utf8_lossy(metrics.body()).contains("floodgate_config_version 1"));
}

#[test]
fn the_shipped_configurations_pass_check() {
    let directory = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config");
    let mut checked = 0;
    for entry in std::fs::read_dir(&directory).unwrap() {
        let path = entry.unwrap().path();
        if path
            .extension()
            .is_some_and(|extension| extension == "yaml")
        {
            let output = Command::new(env!("CARGO_BIN_EXE_floodgate"))
                .args(["check", "--config"])
                .arg(&path)
                .output()
                .unwrap();
            assert!(
                output.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&output.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 3, "quickstart, example and redis configurations");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_on_redis_sharded_share_each_identity_exactly() {
    let servers: Vec<redis_support::RedisServer> = (0..3)
        .map(|_| redis_support::RedisServer::start())
        .collect();
    let upstream = Upstream::start().await;
    let nodes: Vec<String> = servers
        .iter()
        .map(|server| format!("\"{}\"", server.url()))
        .collect();
    let rest = format!(
        "store:\n  backend: redis_sharded\n  nodes: [{}]\n  timeout: 2s\nplans:\n  free:\n    limits: [ {{ name: hourly, algorithm: fixed_window, limit: 5, window: 1h }} ]\n  anonymous: {{}}\n",
        nodes.join(", ")
    );
    let gateways: Vec<(Gateway, TempDir)> = (0..2).map(|_| gateway(&upstream, &rest)).collect();
    let client = client();
    // Pick API keys the placement puts on at least two different nodes (ports, hence node
    // names, change from run to run).
    let node_names: Vec<String> = servers
        .iter()
        .map(redis_support::RedisServer::url)
        .collect();
    let node_of = |key: &str| {
        let tagged = format!(
            "fg:{{key:{}}}:x:y",
            floodgate::Identity::ApiKey(key.to_owned()).hash()
        );
        floodgate::store::redis::rendezvous(&tagged, &node_names)
    };
    let mut keys: Vec<String> = (0..3).map(|index| format!("client-{index}")).collect();
    let first_node = node_of(&keys[0]);
    let other = (3..)
        .map(|index| format!("client-{index}"))
        .find(|key| node_of(key) != first_node)
        .unwrap();
    keys.push(other);
    for key in &keys {
        let key = key.as_str();
        let mut admitted_for_key = 0;
        for round in 0..12 {
            let (gateway, _) = &gateways[round % 2];
            admitted_for_key +=
                admitted(&client, &gateway.url("/"), &[("x-api-key", key)], 1).await;
        }
        assert_eq!(
            admitted_for_key, 5,
            "{key}: one limit across gateways and shards"
        );
    }
    let used: usize = servers
        .iter()
        .map(|server| usize::from(!server.command::<Vec<String>>(&["KEYS", "*"]).is_empty()))
        .sum();
    assert!(
        used >= 2,
        "four identities spread over several nodes ({used} used)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_on_a_redis_cluster_share_each_identity_exactly() {
    let cluster = redis_support::RedisCluster::start(3);
    let upstream = Upstream::start().await;
    let nodes: Vec<String> = cluster
        .urls()
        .iter()
        .map(|url| format!("\"{url}\""))
        .collect();
    // Through deadpool-redis's cluster pool (`connection: pool`); the library tests cover the
    // default shared cluster connection.
    let rest = format!(
        "store:\n  backend: redis_cluster\n  nodes: [{}]\n  connection: pool\n  pool_size: 4\n  timeout: 2s\nplans:\n  free:\n    limits: [ {{ name: hourly, algorithm: fixed_window, limit: 5, window: 1h }} ]\n  anonymous: {{}}\n",
        nodes.join(", ")
    );
    let gateways: Vec<(Gateway, TempDir)> = (0..2).map(|_| gateway(&upstream, &rest)).collect();
    let client = client();
    for index in 0..6 {
        let key = format!("cluster-client-{index}");
        let mut admitted_for_key = 0;
        for round in 0..8 {
            let (gateway, _) = &gateways[round % 2];
            admitted_for_key +=
                admitted(&client, &gateway.url("/"), &[("x-api-key", &key)], 1).await;
        }
        assert_eq!(admitted_for_key, 5, "{key}: one limit across gateways");
    }
    let used: usize = cluster
        .masters
        .iter()
        .map(|master| usize::from(master.command::<u64>(&["DBSIZE"]) > 0))
        .sum();
    assert!(
        used >= 2,
        "six identities over several masters ({used} used)"
    );
}

/// `store.sentinel`: the gateway finds the master through the sentinels and, after the master
/// is killed, follows the promoted replica; meanwhile `on_store_error: closed` answers 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_follows_a_sentinel_failover() {
    let mut group = redis_support::SentinelGroup::start();
    let upstream = Upstream::start().await;
    let sentinels: Vec<String> = group
        .sentinel_urls()
        .iter()
        .map(|url| format!("\"{url}\""))
        .collect();
    let rest = format!(
        "store:\n  backend: redis\n  sentinel: {{ master: {}, nodes: [{}] }}\n  timeout: 200ms\n  breaker: {{ failures: 3, open_for: 300ms }}\non_store_error: closed\nplans:\n  free:\n    limits: [ {{ name: hourly, algorithm: fixed_window, limit: 2, window: 1h }} ]\n  anonymous: {{}}\n",
        redis_support::SENTINEL_MASTER,
        sentinels.join(", ")
    );
    let (gateway, _directory) = gateway(&upstream, &rest);
    let client = client();
    let url = gateway.url("/");
    assert_eq!(
        admitted(&client, &url, &[("x-api-key", "before")], 3).await,
        2
    );

    group.master.kill();
    let killed_at = Instant::now();
    let mut answered_by_policy = 0;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let key = format!("during-{attempt}");
        let response = get(&client, &url, &[("x-api-key", &key)]).await;
        match response.status() {
            StatusCode::OK => break,
            StatusCode::SERVICE_UNAVAILABLE => answered_by_policy += 1,
            other => panic!("unexpected {other} during failover"),
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(10),
            "the gateway did not reach the new master within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "sentinel failover: the gateway decided again {:?} after the kill ({answered_by_policy} \
         answers by the policy meanwhile)",
        killed_at.elapsed()
    );
    assert!(
        answered_by_policy > 0,
        "the failure policy answered meanwhile"
    );
    assert_eq!(group.current_master_port(), Some(group.replica.port()));
    assert_eq!(
        admitted(&client, &url, &[("x-api-key", "after")], 3).await,
        2
    );
}
