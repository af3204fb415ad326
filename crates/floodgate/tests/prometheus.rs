//! The `prometheus` feature: one call installs a recorder whose output Prometheus reads as
//! intended (issue 12.9). Compiled when the feature is on (the workspace's gateway turns it on).
#![cfg(feature = "prometheus")]

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use floodgate::{Limit, PeerAddr, RateLimitLayer};
use http::{Request, Response};
use http_body_util::Full;
use tower::{Layer, ServiceExt, service_fn};

#[tokio::test]
async fn install_prometheus_describes_and_buckets_the_library_metrics() {
    let handle = floodgate::telemetry::install_prometheus().unwrap();
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
