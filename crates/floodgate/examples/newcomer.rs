//! A typical app, as a newcomer writes it from the crate docs alone: anonymous clients by
//! IP and API-key tiers, five login attempts a minute per IP, a per-IP ceiling, Redis with a
//! local fallback, a concurrency limit on a streaming route, trusted proxies, Prometheus.
//!
//! `cargo run -p floodgate --example newcomer --features prometheus` (needs a Redis at
//! `REDIS_URL`, default `redis://127.0.0.1:6379`; without one the local fallback decides).

use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use floodgate::key::DefaultIdentifier;
use floodgate::plan::{RouteKey, TieredPlan};
use floodgate::store::RedisStore;
use floodgate::{FailurePolicy, Limit, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let metrics = floodgate::telemetry::install_prometheus()?;
    let second = Duration::from_secs(1);
    let identifier = DefaultIdentifier::new().trusted_proxies(["10.0.0.0/8"])?;
    let plan = TieredPlan::builder()
        .per_ip([Limit::token_bucket("ip", 100, second)?])
        .anonymous([Limit::token_bucket("anonymous", 5, second)?])
        .keyed([Limit::token_bucket("free", 20, second)?])
        .tier("pro", [Limit::gcra("pro", 500, second)?])
        .api_key("pk_live_partner", "pro")
        .route(
            "POST /login",
            RouteKey::Ip,
            [Limit::fixed_window("login", 5, Duration::from_secs(60))?],
        )
        .identifier(identifier.clone())
        .build()?;
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let limits = RateLimitLayer::builder()
        .identify(identifier.clone())
        .plan(plan)
        .store(RedisStore::builder(redis_url).build()?)
        .on_store_error(FailurePolicy::Local)
        .fallback_share(1.0 / 3.0)
        .build()?;
    let streams = RateLimitLayer::builder()
        .identify(identifier)
        .limit(Limit::concurrency("streams", 2, Duration::from_secs(300))?)
        .concurrency_retry_hint(Duration::from_secs(2))
        .build()?;

    let app = Router::new()
        .route(
            "/events",
            get(|| async { "a long stream" }).route_layer(streams),
        )
        .route("/login", post(|| async { "welcome" }))
        .route("/v1/things", get(|| async { "things" }))
        .layer(limits)
        .route(
            "/metrics",
            get(move || std::future::ready(metrics.render())),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .await?;
    Ok(())
}
