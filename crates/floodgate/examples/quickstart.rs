//! A small axum API behind floodgate, on the memory store (no Redis needed).
//!
//! ```text
//! cargo run -p floodgate --example quickstart
//! for i in $(seq 7); do curl -si http://127.0.0.1:3000/ | grep -iE '^(HTTP|x-ratelimit-remaining|retry-after)'; done
//! ```
//!
//! `FLOODGATE_LISTEN` changes the address (default `127.0.0.1:3000`).

use std::net::SocketAddr;
use std::time::Duration;

use axum::routing::get;
use axum::{Extension, Router};
use floodgate::{Decision, Limit, RateLimitLayer};

async fn hello() -> &'static str {
    "hello from behind floodgate\n"
}

/// Handlers can read the decision: here, what is left of the tightest limit.
async fn quota(Extension(decision): Extension<Decision>) -> String {
    match decision.binding_limit() {
        Some(limit) => format!(
            "{} of {} left on `{}`; full again in {:?}\n",
            limit.remaining, limit.limit, limit.name, limit.reset_after
        ),
        None => "not limited\n".to_owned(),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let layer = RateLimitLayer::builder()
        // 5 per second per client, and no more than 100 a minute.
        .limit(Limit::token_bucket(
            "per-second",
            5,
            Duration::from_secs(1),
        )?)
        .limit(Limit::fixed_window(
            "per-minute",
            100,
            Duration::from_secs(60),
        )?)
        .docs_url("https://example.com/docs/rate-limits")
        .build()?;
    let app = Router::new()
        .route("/", get(hello))
        .route("/quota", get(quota))
        .layer(layer);

    let listen = std::env::var("FLOODGATE_LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("floodgate quickstart listening on http://{listen}");
    println!("try: for i in $(seq 7); do curl -si http://{listen}/ | head -1; done");
    // Connect info gives the layer each client's address for IP identities.
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
