//! `/metrics` as Prometheus reads it: every series described (`# HELP`), latencies as
//! histograms. The gateway's unit test `every_metric_name_in_the_source_is_described` holds
//! every name the code can record to a description; this test renders the series a run with
//! allowed, limited, rejected and reloaded traffic produces and checks each of them.

use crate::support;

use std::collections::HashSet;

use support::{Upstream, admin_reload, client, get, start_gateway};

/// The metric a sample line belongs to: its name without labels, and without the suffix of a
/// histogram's parts.
fn family(sample: &str, histograms: &HashSet<String>) -> String {
    let name = sample
        .split(|c: char| c == '{' || c.is_whitespace())
        .next()
        .unwrap_or_default();
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && histograms.contains(base)
        {
            return base.to_owned();
        }
    }
    name.to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_series_is_described_and_latencies_are_histograms() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = start_gateway(
        &upstream.url(),
        "plans:\n  anonymous: { limits: [ { name: m, algorithm: fixed_window, limit: 2, window: 60s } ] }\n  free: { limits: [] }\n",
    );
    let client = client();
    // Allowed, then limited; a path above the root (rejected before any limit); a reload.
    for _ in 0..4 {
        get(&client, &gateway.url("/"), &[]).await;
    }
    assert_eq!(get(&client, &gateway.url("/../x"), &[]).await.status(), 400);
    admin_reload(&client, &gateway).await;

    let text = get(&client, &gateway.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(text.body()).into_owned();
    let described: HashSet<String> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# HELP "))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    let histograms: HashSet<String> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter(|rest| rest.ends_with(" histogram"))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    let families: HashSet<String> = text
        .lines()
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| family(line, &histograms))
        .collect();
    for name in &families {
        assert!(described.contains(name), "{name} has no # HELP:\n{text}");
    }
    for expected in [
        "floodgate_decisions_total",
        "floodgate_check_duration_seconds",
        "floodgate_upstream_requests_total",
        "floodgate_upstream_duration_seconds",
        "floodgate_rejected_requests_total",
        "floodgate_config_reloads_total",
        "floodgate_config_version",
    ] {
        assert!(
            families.contains(expected),
            "{expected} not rendered:\n{text}"
        );
    }
    assert!(
        histograms.contains("floodgate_check_duration_seconds"),
        "{text}"
    );
    assert!(
        histograms.contains("floodgate_upstream_duration_seconds"),
        "{text}"
    );
}
