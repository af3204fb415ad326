//! The status page in a real browser. Headless Chromium (Debian's `chromium`, which
//! `scripts/test.sh` installs) loads the page from a running gateway under traffic; the test
//! reads the rendered DOM. `--virtual-time-budget` lets the page's own fetches and timers run
//! before the DOM is dumped (virtual time waits for pending network requests).

use crate::support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use http::StatusCode;
use support::{Gateway, TempDir, Upstream, addresses, client, config_text, get};

const TOKEN: &str = "page-secret";

fn chromium() -> &'static str {
    let found = Command::new("chromium")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success());
    assert!(
        found,
        "the status page test needs Debian's `chromium` (scripts/test.sh installs it)"
    );
    "chromium"
}

/// Runs headless Chromium on `url` with `args`; returns its standard output.
fn run_chromium(profile: &Path, url: &str, args: &[&str]) -> String {
    let output = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()
        .expect("chromium runs");
    assert!(
        output.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The text inside the element with `id` (up to its first child tag).
fn text_of<'d>(dom: &'d str, id: &str) -> &'d str {
    let marker = format!("id=\"{id}\"");
    let start = dom
        .find(&marker)
        .unwrap_or_else(|| panic!("no #{id} in the DOM:\n{dom}"));
    let after_tag = start + dom[start..].find('>').expect("the tag ends") + 1;
    let end = after_tag + dom[after_tag..].find('<').unwrap_or(0);
    dom[after_tag..end].trim()
}

/// The opening tag of the element with `id`.
fn tag_of<'d>(dom: &'d str, id: &str) -> &'d str {
    let marker = format!("id=\"{id}\"");
    let start = dom.find(&marker).expect("the element exists");
    let open = dom[..start].rfind('<').expect("the tag opens");
    let close = start + dom[start..].find('>').expect("the tag ends");
    &dom[open..=close]
}

/// A gateway on `rest` in front of `upstream`, its admin API guarded by [`TOKEN`].
fn start_with_token(upstream: &Upstream, rest: &str) -> (Gateway, TempDir) {
    let directory = TempDir::new("page");
    let (listen, admin) = addresses();
    let path = directory.file("floodgate.yaml");
    std::fs::write(&path, config_text(listen, admin, &upstream.url(), rest)).unwrap();
    let gateway =
        Gateway::start_with_env(&path, listen, admin, &[("FLOODGATE_ADMIN_TOKEN", TOKEN)]);
    (gateway, directory)
}

/// `GET /admin/status` with the token.
async fn admin_status(client: &support::TestClient, gateway: &Gateway) -> serde_json::Value {
    let status = get(
        client,
        &gateway.admin_url("/admin/status"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
    )
    .await;
    serde_json::from_slice(status.body()).unwrap()
}

/// Requests until `/admin/status` reports a non-zero decision rate (the gateway samples once
/// a second, so this takes two samples).
async fn wait_for_a_decision_rate(gateway: &Gateway) {
    let client = client();
    let started = Instant::now();
    loop {
        for key in ["page-a", "page-b", "page-c"] {
            get(&client, &gateway.url("/v1/things"), &[("x-api-key", key)]).await;
        }
        let body = admin_status(&client, gateway).await;
        if body["decisions"]["per_second"]["allowed"].as_f64() > Some(0.0) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no decision rate after 10 s: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_the_gateway_under_traffic_and_asks_for_the_token() {
    let upstream = Upstream::start().await;
    let rest = "plans:\n  free:\n    limits:\n      - { name: per-second, algorithm: token_bucket, limit: 2, window: 1s }\n      - { name: daily, algorithm: fixed_window, limit: 1000000, period: day }\n  anonymous: {}\n";
    let (gateway, directory) = start_with_token(&upstream, rest);

    // The page itself is open (it holds no data); its data calls are not.
    let client = client();
    let page = get(&client, &gateway.admin_url("/"), &[]).await;
    assert_eq!(page.status(), StatusCode::OK);
    assert!(
        page.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    let html = String::from_utf8_lossy(page.body());
    let policy = page.headers()["content-security-policy"].to_str().unwrap();
    assert!(policy.contains("default-src 'none'") && policy.contains("frame-ancestors 'none'"));
    for external in [
        "src=\"http",
        "href=\"http",
        "url(http",
        "@import",
        "src=\"//",
    ] {
        assert!(!html.contains(external), "no external assets: {external}");
    }
    assert_eq!(
        get(&client, &gateway.admin_url("/admin/status"), &[])
            .await
            .status(),
        StatusCode::UNAUTHORIZED
    );

    // Traffic: allowed and limited decisions, kept going while the browser looks.
    wait_for_a_decision_rate(&gateway).await;
    let traffic = {
        let url = gateway.url("/v1/things");
        tokio::spawn(async move {
            let client = support::client();
            loop {
                get(&client, &url, &[("x-api-key", "page-a")]).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    // An override in force: the page lists it.
    let set = client
        .request(
            http::Request::put(gateway.admin_url("/admin/clients/overrides?api_key=page-a"))
                .header("authorization", format!("Bearer {TOKEN}"))
                .body(http_body_util::Full::new(bytes::Bytes::from_static(
                    br#"{"name": "per-second", "limit": 50, "expires_in": "1h"}"#,
                )))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(set.status(), StatusCode::OK);

    let profile = TempDir::new("chromium");
    let url = gateway.admin_url("/");
    let without_token = tokio::task::spawn_blocking({
        let profile = profile.file("without");
        let url = url.clone();
        move || run_chromium(&profile, &url, &["--dump-dom"])
    })
    .await
    .unwrap();
    assert!(
        without_token.contains("data-state=\"auth\""),
        "the token prompt, not data:\n{without_token}"
    );
    assert!(!tag_of(&without_token, "token-prompt").contains("hidden"));
    assert!(tag_of(&without_token, "data").contains("hidden"));
    assert_eq!(text_of(&without_token, "version"), "");

    // The fragment names a client whose quotas the page shows.
    let with_token = format!("{url}#token={TOKEN}&api_key=page-a");
    let dom = tokio::task::spawn_blocking({
        let profile = profile.file("with");
        let url = with_token.clone();
        move || run_chromium(&profile, &url, &["--dump-dom"])
    })
    .await
    .unwrap();
    assert!(
        dom.contains("data-state=\"ok\""),
        "rendered with data:\n{dom}"
    );
    assert!(tag_of(&dom, "token-prompt").contains("hidden"));
    assert_eq!(text_of(&dom, "version"), "1");
    assert_eq!(text_of(&dom, "backend"), "memory");
    assert_eq!(text_of(&dom, "mode"), "enforce");
    assert!(
        tag_of(&dom, "adaptive-card").contains("hidden"),
        "no adaptive_concurrency: no adaptive section"
    );
    let rate: f64 = text_of(&dom, "rate-total").parse().expect("a rate");
    assert!(rate > 0.0, "a non-zero decision rate: {rate}");
    assert!(
        dom.contains("<rect"),
        "the chart draws the last minute's decisions"
    );
    assert_eq!(text_of(&dom, "overrides-count"), "(1)");
    let overrides = &dom[dom.find("id=\"overrides\"").unwrap()..];
    let overrides = &overrides[..overrides.find("</tbody>").unwrap()];
    assert!(
        overrides.contains("<td>per-second</td>") && overrides.contains(">50<"),
        "the override in force is listed: {overrides}"
    );

    let quotas = &dom[dom.find("id=\"quotas\"").unwrap()..];
    let quotas = &quotas[..quotas.find("</tbody>").unwrap()];
    assert!(
        quotas.contains("<td>daily</td>") && quotas.contains(">1000000<"),
        "the client's daily quota: {quotas}"
    );
    assert!(
        !quotas.contains("per-second"),
        "a limit shorter than a day is no quota: {quotas}"
    );
    let used: u64 = quotas
        .split("<td class=\"num\">")
        .nth(1)
        .and_then(|cell| cell.split('<').next())
        .and_then(|cell| cell.parse().ok())
        .expect("a used count");
    assert!(used > 0, "page-a's requests count: {quotas}");

    let screenshot = directory.file("status.png");
    tokio::task::spawn_blocking({
        let profile = profile.file("shot");
        let argument = format!("--screenshot={}", screenshot.display());
        move || {
            run_chromium(
                &profile,
                &with_token,
                &["--hide-scrollbars", "--window-size=1100,800", &argument],
            )
        }
    })
    .await
    .unwrap();
    let png = std::fs::read(&screenshot).expect("a screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
    if let Ok(target) = std::env::var("FLOODGATE_STATUS_SCREENSHOT") {
        // `FLOODGATE_STATUS_SCREENSHOT=docs/status-page.png` refreshes the README's picture.
        std::fs::copy(&screenshot, target).unwrap();
    }
    traffic.abort();
}

/// With `adaptive_concurrency` (issue 49), the page draws each upstream's limit, in flight and
/// sampled latency over the last minute; without it, the section stays hidden (the test
/// above's gateway has none: its DOM has the card hidden).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_draws_the_adaptive_limit_over_time() {
    let upstream = Upstream::start().await;
    let rest = "adaptive_concurrency:\n  initial_limit: 25\n  min_samples: 1\n  window: 100ms\n";
    let (gateway, _directory) = start_with_token(&upstream, rest);
    // Traffic until the status board holds two seconds of the upstream's limiter.
    let client = client();
    let started = Instant::now();
    loop {
        get(&client, &gateway.url("/"), &[]).await;
        let body = admin_status(&client, &gateway).await;
        let points = body["adaptive"][0]["series"].as_array().map_or(0, Vec::len);
        if points >= 2 {
            assert_eq!(body["adaptive"][0]["upstream"], upstream.url().as_str());
            assert!(body["adaptive"][0]["series"][0]["limit"].as_u64() >= Some(1));
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no adaptive samples after 10 s: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let profile = TempDir::new("chromium-adaptive");
    let url = format!("{}#token={TOKEN}", gateway.admin_url("/"));
    let dom = tokio::task::spawn_blocking(move || {
        run_chromium(&profile.file("with"), &url, &["--dump-dom"])
    })
    .await
    .unwrap();
    assert!(dom.contains("data-state=\"ok\""), "rendered:\n{dom}");
    assert!(!tag_of(&dom, "adaptive-card").contains("hidden"), "{dom}");
    assert!(
        dom.contains(&format!("{}: limit ", upstream.url())),
        "the upstream's line:\n{dom}"
    );
    for series in ["limit", "in_flight"] {
        assert!(
            dom.contains(&format!("data-series=\"{series}\"")),
            "no {series} line:\n{dom}"
        );
    }
}
