//! Estimates a client cannot lowball, through the gateway (SPEC §9, issue 45): a route with
//! `estimate_header: x-max-tokens`, `estimate_max: 100` and its cost in the upstream's trailers
//! (an h2c upstream, as streaming LLM APIs are), `fixed_window 1000/h`. A client that leaves
//! before the trailer, an upstream that never sends one, and lowballed estimates in flight
//! together serve no client more than the limit plus one `estimate_max` in a window; on the
//! memory store, Redis exact and Redis batched. The same on the memory store and Redis exact
//! with every other algorithm a post-charge settles (`token_bucket`, `gcra`,
//! `sliding_window_counter`), over 1,000 hours so that nothing refills or slides during a test.

use crate::support;

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use floodgate_test_support::RedisServer;
use http::StatusCode;
use http_body_util::{BodyExt as _, Full};
use support::{TestClient, client, get, start_gateway};

const LIMIT: u64 = 1_000;
const ESTIMATE_MAX: u64 = 100;

/// A completion streamed over h2c: two data frames, then by path:
/// - `/stream?used=N`: `x-tokens-used: N` in its trailers;
/// - `/silent`: the end, without trailers;
/// - `/hang`: nothing more, ever (the client leaves before the trailers);
/// - `/spend?used=N`: `x-tokens-used: N` in the head, with one data frame;
/// - anything else: one data frame.
struct Completion {
    frames: std::collections::VecDeque<http_body::Frame<Bytes>>,
    hang: bool,
}

impl http_body::Body for Completion {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        match self.frames.pop_front() {
            Some(frame) => std::task::Poll::Ready(Some(Ok(frame))),
            // Dropped with the stream when the gateway lets go of it.
            None if self.hang => std::task::Poll::Pending,
            None => std::task::Poll::Ready(None),
        }
    }
}

fn used_in(uri: &http::Uri) -> String {
    uri.query()
        .and_then(|query| query.strip_prefix("used="))
        .unwrap_or("0")
        .to_owned()
}

async fn h2c_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let service = hyper::service::service_fn(
                |request: http::Request<hyper::body::Incoming>| async move {
                    let data =
                        |text: &'static [u8]| http_body::Frame::data(Bytes::from_static(text));
                    let mut frames = std::collections::VecDeque::from([data(b"data: one\n\n")]);
                    let path = request.uri().path();
                    let streamed = ["/stream", "/silent", "/hang"].contains(&path);
                    if streamed {
                        frames.push_back(data(b"data: two\n\n"));
                    }
                    if path == "/stream" {
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("x-tokens-used", used_in(request.uri()).parse().unwrap());
                        frames.push_back(http_body::Frame::trailers(trailers));
                    }
                    let mut response = http::Response::new(Completion {
                        frames,
                        hang: path == "/hang",
                    });
                    if path == "/spend" {
                        response
                            .headers_mut()
                            .insert("x-tokens-used", used_in(request.uri()).parse().unwrap());
                    }
                    Ok::<_, Infallible>(response)
                },
            );
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
            );
        }
    });
    addr
}

fn config(store: &str, limit: &str) -> String {
    let estimated = |path: &str| {
        format!(
            "  - {{ match: \"GET {path}\", cost_header: \"x-tokens-used\", estimate_header: \"x-max-tokens\", estimate_max: {ESTIMATE_MAX} }}\n"
        )
    };
    format!(
        "clients:\n  api_keys: {{ \"k-leaves\": free, \"k-silent\": free, \"k-ten\": free, \"k-hundred\": free, \"k-honest\": free }}\n\
         {store}upstream_protocol: http2\n\
         routes:\n{}{}{}  - {{ match: \"GET /spend\", cost_header: \"x-tokens-used\" }}\n\
         plans:\n  free:\n    limits: [ {{ name: tokens, {limit} }} ]\n  anonymous: {{}}\n",
        estimated("/stream"),
        estimated("/silent"),
        estimated("/hang"),
    )
}

fn remaining(response: &http::Response<Bytes>) -> u64 {
    response.headers()["x-ratelimit-remaining"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// What `key` has used of its 1,000: a request of cost 1 that reports nothing, minus itself.
async fn used(client: &TestClient, gateway: &support::Gateway, key: &str) -> u64 {
    let answer = get(client, &gateway.url("/v1/other"), &[("x-api-key", key)]).await;
    assert_eq!(answer.status(), StatusCode::OK);
    LIMIT - remaining(&answer) - 1
}

/// Sends a request with `x-max-tokens: estimate` and returns its answer's head and body.
async fn open(
    client: &TestClient,
    url: &str,
    key: &str,
    estimate: u64,
) -> http::Response<hyper::body::Incoming> {
    let request = http::Request::builder()
        .uri(url)
        .header("x-api-key", key)
        .header("x-max-tokens", estimate.to_string())
        .body(Full::new(Bytes::new()))
        .unwrap();
    client.request(request).await.expect("gateway answers")
}

async fn lowballed_in_flight(
    client: &TestClient,
    gateway: &support::Gateway,
    key: &str,
    in_flight: usize,
) {
    let spent = get(
        client,
        &gateway.url(&format!("/spend?used={}", LIMIT - 10)),
        &[("x-api-key", key)],
    )
    .await;
    assert_eq!(spent.status(), StatusCode::OK);
    let url = gateway.url("/stream?used=100");
    let mut opening = tokio::task::JoinSet::new();
    for _ in 0..in_flight {
        let (client, url, key) = (client.clone(), url.clone(), key.to_owned());
        opening.spawn(async move { open(&client, &url, &key, 1).await });
    }
    let mut served = LIMIT - 10;
    let mut bodies = Vec::new();
    for head in opening.join_all().await {
        if head.status() == StatusCode::OK {
            served += 100;
            bodies.push(head.into_body());
        }
    }
    for body in bodies {
        body.collect().await.unwrap();
    }
    assert!(
        served <= LIMIT + ESTIMATE_MAX,
        "{in_flight} lowballed requests in flight: served {served} in one window of {LIMIT}"
    );
}

/// The limit of 1,000 per hour most tests use.
const FIXED_WINDOW: &str = "algorithm: fixed_window, limit: 1000, window: 1h";

/// `algorithm`'s limit of 1,000, over 1,000 hours.
fn slow(algorithm: &str) -> String {
    format!("algorithm: {algorithm}, limit: {LIMIT}, window: 1000h")
}

async fn estimates_cannot_be_lowballed(store: &str, limit: &str) {
    let upstream = h2c_upstream().await;
    let (gateway, _directory) = start_gateway(&format!("http://{upstream}"), &config(store, limit));
    let client = client();

    // Item 1: the whole completion read, and gone before its trailer.
    let answer = open(&client, &gateway.url("/hang"), "k-leaves", 1).await;
    assert_eq!(answer.status(), StatusCode::OK);
    let mut body = answer.into_body();
    let mut read = Vec::new();
    while read.len() < b"data: one\n\ndata: two\n\n".len() {
        let frame = body.frame().await.unwrap().unwrap();
        read.extend_from_slice(&frame.into_data().unwrap());
    }
    drop(body);
    assert_eq!(
        used(&client, &gateway, "k-leaves").await,
        ESTIMATE_MAX,
        "a client that leaves before the trailer is charged estimate_max"
    );

    // An upstream that never sends the trailer, read to its end.
    let answer = open(&client, &gateway.url("/silent"), "k-silent", 1).await;
    assert_eq!(answer.status(), StatusCode::OK);
    answer.into_body().collect().await.unwrap();
    assert_eq!(
        used(&client, &gateway, "k-silent").await,
        ESTIMATE_MAX,
        "a request never settled is charged estimate_max"
    );

    // Item 2: 10 units left, lowballed streams in flight together.
    lowballed_in_flight(&client, &gateway, "k-ten", 10).await;
    lowballed_in_flight(&client, &gateway, "k-hundred", 100).await;

    // An honest client: estimated 80, used 30 (reported in the trailers), pays 30.
    let answer = open(&client, &gateway.url("/stream?used=30"), "k-honest", 80).await;
    assert_eq!(answer.status(), StatusCode::OK);
    answer.into_body().collect().await.unwrap();
    // Settled in the background once the stream ends: its refund is waited for, 10 s at most.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut charged = used(&client, &gateway, "k-honest").await;
    let mut probes = 1;
    while charged - (probes - 1) != 30 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        charged = used(&client, &gateway, "k-honest").await;
        probes += 1;
    }
    assert_eq!(
        charged - (probes - 1),
        30,
        "an honest client pays what it used"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn estimates_cannot_be_lowballed_on_memory() {
    estimates_cannot_be_lowballed("", FIXED_WINDOW).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn estimates_cannot_be_lowballed_on_redis() {
    let redis = RedisServer::start();
    estimates_cannot_be_lowballed(&support::redis_store(&redis.url()), FIXED_WINDOW).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn estimates_cannot_be_lowballed_on_redis_batched() {
    let redis = RedisServer::start();
    let store = format!(
        "store: {{ backend: redis, url: \"{}\", timeout: 2s, sync_interval: 100ms }}\n",
        redis.url()
    );
    estimates_cannot_be_lowballed(&store, FIXED_WINDOW).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn estimates_cannot_be_lowballed_on_memory_with_every_settled_algorithm() {
    for algorithm in ["token_bucket", "gcra", "sliding_window_counter"] {
        estimates_cannot_be_lowballed("", &slow(algorithm)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn estimates_cannot_be_lowballed_on_redis_with_every_settled_algorithm() {
    for algorithm in ["token_bucket", "gcra", "sliding_window_counter"] {
        // A Redis of its own: the keys are named alike whatever the algorithm.
        let redis = RedisServer::start();
        estimates_cannot_be_lowballed(&support::redis_store(&redis.url()), &slow(algorithm)).await;
    }
}
