//! A small gRPC load client for floodgate's rate limit service (`bench/rls.sh`): `callers`
//! tasks call `ShouldRateLimit` back to back over `connections` HTTP/2 connections for
//! `seconds`, each with one descriptor `client: c<n>` of domain `bench`; prints calls/s.
//!
//! `cargo run --release -p floodgate-gateway --example rls_load -- ADDRESS [callers] [connections] [seconds]`

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

fn argument(index: usize, default: u64) -> u64 {
    std::env::args()
        .nth(index)
        .and_then(|text| text.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let address = std::env::args()
        .nth(1)
        .ok_or("usage: rls_load ADDRESS [callers] [connections] [seconds]")?;
    let callers = argument(2, 64);
    let connections = argument(3, 4).max(1);
    let seconds = argument(4, 10);
    let mut channels = Vec::new();
    for _ in 0..connections {
        channels.push(
            tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
                .connect()
                .await?,
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let admitted = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for caller in 0..callers {
        let mut client =
            RateLimitServiceClient::new(channels[usize::try_from(caller % connections)?].clone());
        let (stop, calls, admitted, errors) = (
            stop.clone(),
            calls.clone(),
            admitted.clone(),
            errors.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let request = RateLimitRequest {
                domain: "bench".to_owned(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "client".to_owned(),
                        value: format!("c{caller}"),
                    }],
                    ..RateLimitDescriptor::default()
                }],
                hits_addend: 0,
            };
            while !stop.load(Ordering::Relaxed) {
                match client.should_rate_limit(request.clone()).await {
                    Ok(answer) => {
                        calls.fetch_add(1, Ordering::Relaxed);
                        if answer.into_inner().overall_code == Code::Ok as i32 {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    for task in tasks {
        task.await?;
    }
    let calls = calls.load(Ordering::Relaxed);
    println!(
        "{:.0} calls/s ({calls} calls, {} OK, {} errors, {callers} callers on {connections} connections, {elapsed:.1}s)",
        calls as f64 / elapsed,
        admitted.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
    );
    Ok(())
}
