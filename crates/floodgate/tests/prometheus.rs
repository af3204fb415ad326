//! The `prometheus` feature: one call installs a recorder whose output Prometheus reads as
//! intended. Compiled when the feature is on (the workspace's gateway turns it on).
#![cfg(feature = "prometheus")]

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use floodgate::{Limit, PeerAddr, RateLimitLayer};
use http::{Request, Response};
use http_body_util::Full;
use tower::{Layer, ServiceExt, service_fn};

/// The process's one recorder, shared by the tests of this file.
fn handle() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE.get_or_init(|| floodgate::telemetry::install_prometheus().unwrap())
}

#[tokio::test]
async fn install_prometheus_describes_and_buckets_the_library_metrics() {
    let handle = handle();
    let service = RateLimitLayer::builder()
        .limit(Limit::token_bucket("per-second", 10, Duration::from_secs(1)).unwrap())
        .build()
        .unwrap()
        .layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        }));
    let request = Request::builder()
        .extension(PeerAddr("198.51.100.1:1".parse().unwrap()))
        .body(())
        .unwrap();
    service.oneshot(request).await.unwrap();
    let text = handle.render();
    assert!(text.contains("# HELP floodgate_decisions_total"), "{text}");
    assert!(
        text.contains("# TYPE floodgate_check_duration_seconds histogram"),
        "{text}"
    );
    assert!(
        text.contains("floodgate_check_duration_seconds_bucket{"),
        "{text}"
    );
}

/// An observer that only counts: it overrides `store_failed` and records no metric itself.
#[derive(Default)]
struct Counting(std::sync::atomic::AtomicU64);

impl floodgate::store::resilience::StoreObserver for Counting {
    fn store_failed(&self, _backend: &'static str, _error: &floodgate::StoreError) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[tokio::test]
async fn a_custom_observer_does_not_drop_the_store_error_metric() {
    // Regression: the metric was recorded in StoreObserver::store_failed's default body, so an
    // observer that overrode it silently dropped floodgate_store_errors_total.
    use floodgate::Store;
    let handle = handle();
    let observer = std::sync::Arc::new(Counting::default());
    let closed_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let store = floodgate::store::RedisStore::builder(format!("redis://127.0.0.1:{closed_port}"))
        .timeout(Duration::from_millis(200))
        .observer(observer.clone())
        .build()
        .unwrap();
    let limit = std::sync::Arc::new(Limit::token_bucket("s", 1, Duration::from_secs(1)).unwrap());
    let check = floodgate::store::Check::new("fg:{ip:x}:r:s", limit, 1);
    assert!(store.check_and_consume(&[check], None).await.is_err());
    assert!(observer.0.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    let text = handle.render();
    assert!(
        text.contains("floodgate_store_errors_total{kind="),
        "{text}"
    );
}

/// A limit keeps the metric keys of the rule it first decided under; the same limit under
/// another rule is still counted under that rule, and each count goes to its own series.
#[tokio::test]
async fn one_limit_under_two_rules_counts_each_rules_decisions_apart() {
    use floodgate::plan::StaticPlan;
    use std::sync::Arc;

    let handle = handle();
    let shared = Arc::new(Limit::token_bucket("shared", 100, Duration::from_secs(1)).unwrap());
    let layer = |rule: &str| {
        RateLimitLayer::builder()
            .plan(StaticPlan::new(
                "fgtest",
                rule.to_owned(),
                vec![shared.clone()],
            ))
            .build()
            .unwrap()
            .layer(service_fn(|_: Request<()>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }))
    };
    let (first, second) = (layer("first-rule"), layer("second-rule"));
    let request = || {
        Request::builder()
            .extension(PeerAddr("198.51.100.7:1".parse().unwrap()))
            .body(())
            .unwrap()
    };
    for service in [&first, &first, &second, &first] {
        service.clone().oneshot(request()).await.unwrap();
    }
    let text = handle.render();
    let series = |rule: &str| {
        format!(
            "floodgate_decisions_total{{rule=\"{rule}\",limit=\"shared\",decision=\"allowed\"}}"
        )
    };
    assert!(
        text.contains(&format!("{} 3\n", series("first-rule"))),
        "{text}"
    );
    assert!(
        text.contains(&format!("{} 1\n", series("second-rule"))),
        "{text}"
    );
}
