//! `/metrics` as Prometheus reads it: every series described (`# HELP`), latencies as
//! histograms (issue 12.9).

mod support;

use support::{Upstream, client, get, start_gateway};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_described_and_latencies_are_histograms() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = start_gateway(
        &upstream.url(),
        "plans:\n  anonymous: { limits: [ { name: m, algorithm: fixed_window, limit: 5, window: 60s } ] }\n  free: { limits: [] }\n",
    );
    let client = client();
    assert_eq!(get(&client, &gateway.url("/"), &[]).await.status(), 200);
    let text = get(&client, &gateway.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(text.body()).into_owned();
    for help in [
        "# HELP floodgate_decisions_total",
        "# HELP floodgate_check_duration_seconds",
        "# HELP floodgate_upstream_requests_total",
        "# HELP floodgate_config_version",
    ] {
        assert!(text.contains(help), "{help} missing:\n{text}");
    }
    assert!(
        text.contains("# TYPE floodgate_check_duration_seconds histogram"),
        "{text}"
    );
}
