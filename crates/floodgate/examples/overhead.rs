//! The hello-world server of the layer-overhead benchmark (`bench/layer_overhead.sh`):
//! `overhead plain PORT` serves without a limiter, `overhead limited PORT` with floodgate's
//! layer (default headers: both sets, five), `overhead ietf PORT` with the layer sending the
//! IETF set alone (two headers, as many as its peer sends), `overhead governor PORT` with its
//! peer, tower_governor 0.8 (headers on, keyed by the peer IP, as floodgate's default identity
//! is).
//!
//! `overhead cpu [REQUESTS]` serves no socket: it calls three of the apps (`plain`, `limited`,
//! `governor`) in process, one request after another on one thread, in alternating rounds,
//! and prints the time per request of each and the limiters' cost over plain axum: the
//! layers' own CPU, without the network and the load generator that share the cores in the
//! wrk runs.
//!
//! `overhead calls MODE [REQUESTS]` calls one app (`plain`, `limited`, `ietf` or `governor`)
//! that many times in process and prints nothing else: for an instruction count under
//! `valgrind --tool=callgrind`, which, unlike the clock, does not move with the machine's load
//! (`bench/layer_instructions.sh` counts only the calls, in `time_per_request`).
//!
//! Every limit is far above what the load reaches, so every request takes the full admitted
//! path (identity, key, store decision, headers) and none is denied.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use floodgate::adaptive::{AdaptiveConcurrencyLayer, Class};
use floodgate::{HeaderStyle, Limit, RateLimitLayer};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

type Error = Box<dyn std::error::Error>;

const MODES: [&str; 3] = ["plain", "limited", "governor"];

/// The app of `mode`, its routes finished as `axum::serve` finishes them (`with_state`), so
/// that the in-process calls do not build each route and its layers anew per request.
fn app(mode: &str) -> Result<Router, Error> {
    let app = Router::new().route("/", get(|| async { "hello" }));
    let app = match mode {
        "plain" => app,
        "limited" => app.layer(floodgate_layer(HeaderStyle::Both)?),
        // The IETF set alone: two headers, as many as tower_governor sets.
        "ietf" => app.layer(floodgate_layer(HeaderStyle::Ietf)?),
        // Adaptive concurrency (three classes, a classifier reading a header), far from its
        // limit: what the layer costs when nothing is shed.
        "adaptive" => app.layer(adaptive_layer()?),
        "governor" => app.layer(GovernorLayer::new(
            GovernorConfigBuilder::default()
                .per_nanosecond(1)
                .burst_size(1_000_000_000)
                .use_headers()
                .finish()
                .ok_or("tower_governor refused the quota")?,
        )),
        other => {
            return Err(format!(
                "usage: overhead plain|limited|ietf|adaptive|governor PORT, overhead cpu [REQUESTS], or overhead calls plain|limited|ietf|adaptive|governor [REQUESTS] (got `{other}`)"
            )
            .into());
        }
    };
    Ok(app.with_state(()))
}

/// floodgate's layer on a memory store, with a limit far above the load, sending `headers`.
fn floodgate_layer(headers: HeaderStyle) -> Result<RateLimitLayer, Error> {
    Ok(RateLimitLayer::builder()
        .limit(Limit::token_bucket(
            "per-second",
            1_000_000_000,
            Duration::from_secs(1),
        )?)
        .headers(headers)
        .build()?)
}

/// The adaptive concurrency layer with three classes, its limit far above the load.
fn adaptive_layer() -> Result<AdaptiveConcurrencyLayer, Error> {
    Ok(AdaptiveConcurrencyLayer::builder()
        .classes([
            Class::new("critical").reserve(0.2),
            Class::new("default"),
            Class::new("sheddable"),
        ])
        .default_class("default")
        .classify(
            |request| match request.headers.get("x-priority")?.as_bytes() {
                b"critical" => Some("critical"),
                b"sheddable" => Some("sheddable"),
                _ => None,
            },
        )
        .build()?)
}

/// Nanoseconds per request of `app`, over `requests` requests from one peer, each answered and
/// its body read to the end.
async fn time_per_request(app: &Router, requests: u32) -> Result<f64, Error> {
    let peer: SocketAddr = ([127, 0, 0, 1], 40_000).into();
    let started = Instant::now();
    for _ in 0..requests {
        let mut request = http::Request::get("/").body(Body::empty())?;
        request.extensions_mut().insert(ConnectInfo(peer));
        let response = app.clone().oneshot(request).await?;
        assert_eq!(response.status(), http::StatusCode::OK);
        response.into_body().collect().await?;
    }
    Ok(started.elapsed().as_nanos() as f64 / f64::from(requests))
}

async fn cpu(requests: u32) -> Result<(), Error> {
    let apps = MODES.map(|mode| app(mode).expect("the three apps build"));
    for app in &apps {
        time_per_request(app, requests / 10).await?; // warm up
    }
    println!("in process, one thread, {requests} requests per run (ns per request)");
    println!("round   plain  limited  governor  limited-plain  governor-plain  ratio");
    let mut ratios = Vec::new();
    for round in 1..=7 {
        let mut ns = [0.0; 3];
        for offset in 0..3 {
            let index = (round + offset) % 3;
            ns[index] = time_per_request(&apps[index], requests).await?;
        }
        let (ours, theirs) = (ns[1] - ns[0], ns[2] - ns[0]);
        ratios.push(theirs / ours);
        println!(
            "{round:>5} {:>7.0} {:>8.0} {:>9.0} {ours:>14.0} {theirs:>15.0} {:>6.2}",
            ns[0],
            ns[1],
            ns[2],
            theirs / ours
        );
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "median cost ratio (tower_governor's / floodgate's): {:.2}",
        ratios[ratios.len() / 2]
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_default();
    if mode == "cpu" {
        let requests = args.next().and_then(|n| n.parse().ok()).unwrap_or(200_000);
        return cpu(requests).await;
    }
    if mode == "calls" {
        let app = app(&args.next().unwrap_or_default())?;
        let requests = args.next().and_then(|n| n.parse().ok()).unwrap_or(10_000);
        time_per_request(&app, requests).await?;
        return Ok(());
    }
    let port: u16 = args
        .next()
        .and_then(|port| port.parse().ok())
        .unwrap_or(3000);
    let app = app(&mode)?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
