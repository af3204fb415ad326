//! A store that refuses the gateway (a wrong Redis password) is seen at once: at start, on
//! `/readyz`, and in the breaker's log line, which names its cause (issue 11 item 9).
//!
//! Timing: log lines are waited for by polling the captured log every 10ms for up to 5s.

use floodgate_test_support as redis_support;
mod support;

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
