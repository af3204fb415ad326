//! The hello-world server of the layer-overhead benchmark (`bench/layer_overhead.sh`):
//! `overhead plain PORT` serves without the layer, `overhead limited PORT` with it.
//!
//! The limit is far above what the load reaches, so every request takes the full admitted
//! path (identity, key, store decision, headers) and none is denied.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use floodgate::{Limit, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_default();
    let port: u16 = args
        .next()
        .and_then(|port| port.parse().ok())
        .unwrap_or(3000);
    let app = Router::new().route("/", get(|| async { "hello" }));
    let app = match mode.as_str() {
        "plain" => app,
        "limited" => app.layer(
            RateLimitLayer::builder()
                .limit(Limit::token_bucket(
                    "per-second",
                    1_000_000_000,
                    Duration::from_secs(1),
                )?)
                .build()?,
        ),
        other => return Err(format!("usage: overhead plain|limited PORT (got `{other}`)").into()),
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
