//! The gateway as a hostile client sees it (issue 10, SPEC §3, §5 "Paths", §7): identities a
//! client cannot choose, paths that cannot dodge a limit, an admin API that leaks nothing, and
//! connection limits. Black-box, through the `floodgate` binary and real sockets.

mod support;

use http::StatusCode;
use support::{Gateway, TempDir, Upstream, client, get, start_gateway};

/// Two requests a minute per client IP, behind a trusted proxy (the test itself, on loopback).
const PER_IP_TWO: &str = r#"
identity:
  trusted_proxies: ["127.0.0.1/32"]
per_ip:
  - { name: ip, algorithm: fixed_window, limit: 2, window: 60s }
"#;

async fn statuses(
    gateway: &Gateway,
    path: &str,
    requests: impl IntoIterator<Item = Vec<(String, String)>>,
) -> Vec<u16> {
    let client = client();
    let mut statuses = Vec::new();
    for headers in requests {
        let pairs: Vec<(&str, &str)> = headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect();
        statuses.push(
            get(&client, &gateway.url(path), &pairs)
                .await
                .status()
                .as_u16(),
        );
    }
    statuses
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

fn start(upstream: &Upstream, rest: &str) -> (Gateway, TempDir) {
    start_gateway(&upstream.url(), rest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_written_forwarded_header_chooses_nothing() {
    // Regression (issue 10.1): with `Forwarded: for=<rotating>` added, six requests were
    // admitted at 2/min, and an allowlisted address in `Forwarded` bypassed every limit.
    let upstream = Upstream::start().await;
    let rest = format!("{PER_IP_TWO}allowlist: {{ ips: [\"192.0.2.1\"] }}\n");
    let (gateway, _directory) = start(&upstream, &rest);
    let rotating = (0..6).map(|n| {
        pairs(&[
            ("x-forwarded-for", "198.51.100.7"),
            ("forwarded", &format!("for=203.0.113.{n}")),
        ])
    });
    assert_eq!(
        statuses(&gateway, "/", rotating).await,
        [200, 200, 429, 429, 429, 429]
    );
    let allowlisted = (0..3).map(|_| {
        pairs(&[
            ("x-forwarded-for", "198.51.100.8"),
            ("forwarded", "for=192.0.2.1"),
        ])
    });
    assert_eq!(statuses(&gateway, "/", allowlisted).await, [200, 200, 429]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_forwarded_family_is_read_when_configured() {
    let upstream = Upstream::start().await;
    let rest = PER_IP_TWO.replace(
        "trusted_proxies:",
        "forwarded: forwarded\n  trusted_proxies:",
    );
    let (gateway, _directory) = start(&upstream, &rest);
    // Rotating X-Forwarded-For is ignored; the Forwarded client is counted.
    let requests = (0..3).map(|n| {
        pairs(&[
            ("x-forwarded-for", &format!("203.0.113.{n}")),
            ("forwarded", "for=\"[2001:db8::9]:443\""),
        ])
    });
    assert_eq!(statuses(&gateway, "/", requests).await, [200, 200, 429]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_match_exact_ipv6_addresses() {
    // Regression (issue 10.2): lists saw the /64-grouped address, so a denylisted
    // 2001:db8::5 got 200, and an allowlisted single address covered its whole /64.
    let upstream = Upstream::start().await;
    let rest = format!(
        "{PER_IP_TWO}denylist: {{ ips: [\"2001:db8::5\"] }}\nallowlist: {{ ips: [\"2001:db8:1::7\"] }}\n"
    );
    let (gateway, _directory) = start(&upstream, &rest);
    // Three requests from one forwarded client address, and their statuses.
    let three_from = |ip: &'static str| {
        let gateway = &gateway;
        async move {
            let requests = (0..3).map(|_| pairs(&[("x-forwarded-for", ip)]));
            statuses(gateway, "/", requests).await
        }
    };
    assert_eq!(three_from("2001:db8::5").await, [403, 403, 403]);
    assert_eq!(
        three_from("2001:db8::6").await,
        [200, 200, 429],
        "the neighbour is limited, not denied"
    );
    assert_eq!(
        three_from("2001:db8:1::7").await,
        [200, 200, 200],
        "the allowlisted address bypasses"
    );
    assert_eq!(
        three_from("2001:db8:1::8").await,
        [200, 200, 429],
        "its /64 neighbour does not"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_and_plan_headers_are_off_unless_configured() {
    // Regression (issue 10.5): x-user-id and x-plan were honoured from any trusted proxy by
    // default, so a client behind it chose a fresh user (and a bigger plan) per request.
    let upstream = Upstream::start().await;
    let rest = r#"
identity:
  trusted_proxies: ["127.0.0.1/32"]
plans:
  anonymous: { limits: [ { name: m, algorithm: fixed_window, limit: 2, window: 60s } ] }
  free: { limits: [ { name: m, algorithm: fixed_window, limit: 2, window: 60s } ] }
  big: { limits: [ { name: m, algorithm: fixed_window, limit: 100, window: 60s } ] }
"#;
    let (gateway, _directory) = start(&upstream, rest);
    let requests = (0..4).map(|n| {
        pairs(&[
            ("x-forwarded-for", "198.51.100.7"),
            ("x-user-id", &format!("user-{n}")),
            ("x-plan", "big"),
        ])
    });
    assert_eq!(
        statuses(&gateway, "/", requests).await,
        [200, 200, 429, 429]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_keys_can_be_limited_as_their_ip_or_rejected() {
    // Issue 10.6: an invented key per request got a fresh budget each time.
    let upstream = Upstream::start().await;
    let plans = r#"
identity:
  trusted_proxies: ["127.0.0.1/32"]
plans:
  anonymous: { limits: [ { name: m, algorithm: fixed_window, limit: 2, window: 60s } ] }
  free: { limits: [ { name: m, algorithm: fixed_window, limit: 5, window: 60s } ] }
clients:
  api_keys: { "known-key": free }
"#;
    let invented = |ip: &'static str| {
        (0..4).map(move |n| {
            pairs(&[
                ("x-forwarded-for", ip),
                ("x-api-key", &format!("invented-{n}")),
            ])
        })
    };
    let (anonymous, _a) = start(&upstream, &format!("{plans}  unknown_keys: anonymous\n"));
    assert_eq!(
        statuses(&anonymous, "/", invented("198.51.100.1")).await,
        [200, 200, 429, 429]
    );
    let known = (0..3).map(|_| {
        pairs(&[
            ("x-forwarded-for", "198.51.100.1"),
            ("x-api-key", "known-key"),
        ])
    });
    assert_eq!(statuses(&anonymous, "/", known).await, [200, 200, 200]);

    let (reject, _r) = start(&upstream, &format!("{plans}  unknown_keys: reject\n"));
    let client = client();
    let refused = get(&client, &reject.url("/"), &[("x-api-key", "invented")]).await;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(refused.body(), r#"{"error":"unknown_api_key"}"#);
    assert_eq!(
        get(&client, &reject.url("/"), &[("x-api-key", "known-key")])
            .await
            .status(),
        StatusCode::OK
    );
}

#[test]
fn check_warns_about_unverified_keys_and_an_exposed_admin_api() {
    // Issue 10.6 and 10.16: `check` said nothing about either.
    let directory = TempDir::new("check-warn");
    let path = directory.file("floodgate.yaml");
    std::fs::write(
        &path,
        "admin: { listen: \"0.0.0.0:9090\" }\nplans:\n  anonymous: { limits: [ { name: m, algorithm: fixed_window, limit: 2, window: 60s } ] }\n  free: { limits: [ { name: m, algorithm: fixed_window, limit: 2, window: 60s } ] }\n",
    )
    .unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["check", "--config"])
        .arg(&path)
        .env_remove("FLOODGATE_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert!(output.status.success());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("warning: clients.unknown_keys"), "{stdout}");
    assert!(stdout.contains("warning: admin.listen"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_and_global_limits_cannot_be_dodged_by_spelling_the_path() {
    // Regression (issue 10.3): `//export`, `/%65xport`, `/./export` and `/a/../export` skipped
    // an `/export` limit while the upstream (which normalises) served `/export`.
    let upstream = Upstream::start().await;
    let rest = r#"
plans:
  anonymous:
    limits: [ { name: m, algorithm: fixed_window, limit: 100, window: 60s } ]
    endpoints:
      "GET /export": [ { name: export, algorithm: fixed_window, limit: 1, window: 60s } ]
  free: { limits: [] }
global:
  "/search": [ { name: search, algorithm: fixed_window, limit: 2, window: 60s } ]
"#;
    let (gateway, _directory) = start(&upstream, rest);
    let client = client();
    let first = get(&client, &gateway.url("/export"), &[]).await;
    assert_eq!(first.status(), StatusCode::OK);
    for spelling in [
        "//export",
        "/%65xport",
        "/./export",
        "/a/../export",
        "/%2E/export",
    ] {
        let response = get(&client, &gateway.url(spelling), &[]).await;
        assert_eq!(
            response.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{spelling} is /export"
        );
    }
    let head = client
        .request(
            http::Request::head(gateway.url("/export"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        head.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "HEAD meets the GET limit (issue 10.16)"
    );
    // The upstream receives the normalised path, query kept.
    let echoed = get(&client, &gateway.url("/x/..//search?q=%41"), &[]).await;
    assert_eq!(echoed.status(), StatusCode::OK);
    let seen: serde_json::Value = serde_json::from_slice(echoed.body()).unwrap();
    assert_eq!(seen["path"], "/search");
    assert_eq!(seen["query"], "q=%41");
    assert_eq!(
        get(&client, &gateway.url("/%73earch"), &[]).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        get(&client, &gateway.url("/search/"), &[]).await.status(),
        StatusCode::OK,
        "a different path (trailing slash) is not merged"
    );
    assert_eq!(
        get(&client, &gateway.url("//search"), &[]).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the global ceiling counted every spelling"
    );
    let above = get(&client, &gateway.url("/../etc/passwd"), &[]).await;
    assert_eq!(above.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_endpoint_needs_the_token_and_config_shows_no_secret() {
    // Regression (issue 10.4): /admin/config and /admin/top answered without the token, and
    // /admin/config printed Redis passwords (store.url, nodes, sentinel URLs).
    let upstream = Upstream::start().await;
    let directory = TempDir::new("admin-token");
    let (listen, admin) = support::addresses();
    let path = directory.file("floodgate.yaml");
    // The memory store ignores these URLs, so no Redis needs to run; sentinel URLs are
    // redacted by the same function (config::tests::passwords_in_urls_are_redacted).
    let rest = "store:\n  url: \"redis://:hunter2-secret@127.0.0.1:1\"\n  nodes: [\"redis://user:s3cret-node@127.0.0.1:2\"]\n";
    std::fs::write(
        &path,
        support::config_text(listen, admin, &upstream.url(), rest),
    )
    .unwrap();
    let gateway = Gateway::start_with_env(
        &path,
        listen,
        admin,
        &[("FLOODGATE_ADMIN_TOKEN", "the-admin-token")],
    );
    let client = client();
    let post = |headers: &'static [(&'static str, &'static str)]| {
        let client = client.clone();
        let url = gateway.admin_url("/admin/reload");
        async move {
            let mut request = http::Request::post(url);
            for (name, value) in headers {
                request = request.header(*name, *value);
            }
            client
                .request(
                    request
                        .body(http_body_util::Full::new(bytes::Bytes::new()))
                        .unwrap(),
                )
                .await
                .unwrap()
                .status()
        }
    };
    for path in ["/admin/config", "/admin/top", "/admin/top?n=3"] {
        let url = gateway.admin_url(path);
        let missing = get(&client, &url, &[]).await;
        assert_eq!(missing.status(), StatusCode::UNAUTHORIZED, "{path}");
        assert_eq!(missing.body(), r#"{"error":"unauthorized"}"#);
        let wrong = get(&client, &url, &[("authorization", "Bearer not-it")]).await;
        assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED, "{path}");
        let right = get(
            &client,
            &url,
            &[("authorization", "Bearer the-admin-token")],
        )
        .await;
        assert_eq!(right.status(), StatusCode::OK, "{path}");
    }
    assert_eq!(post(&[]).await, StatusCode::UNAUTHORIZED);
    assert_eq!(
        post(&[("authorization", "Bearer wrong")]).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        post(&[("authorization", "Bearer the-admin-token")]).await,
        StatusCode::OK
    );
    for open in ["/healthz", "/metrics"] {
        assert_eq!(
            get(&client, &gateway.admin_url(open), &[]).await.status(),
            StatusCode::OK,
            "{open} stays open for probes and scrapers"
        );
    }
    let config = get(
        &client,
        &gateway.admin_url("/admin/config"),
        &[("authorization", "Bearer the-admin-token")],
    )
    .await;
    let text = String::from_utf8_lossy(config.body()).into_owned();
    for secret in ["hunter2-secret", "s3cret-node"] {
        assert!(!text.contains(secret), "{secret} leaked: {text}");
    }
    let shown: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(shown["config"]["store"]["url"], "redis://:***@127.0.0.1:1");
    assert_eq!(
        shown["config"]["store"]["nodes"][0],
        "redis://user:***@127.0.0.1:2"
    );
}
