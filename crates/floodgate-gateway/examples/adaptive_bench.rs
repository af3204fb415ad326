//! The load of `bench/adaptive.sh` (issue 49): an upstream of a fixed number of workers, each
//! request holding one for a fixed service time (latency grows with its queue), and an
//! open-loop load through a gateway at twice the upstream's capacity, 20 % critical, 30 %
//! default and 50 % sheddable (`x-priority`), from many clients; from 10 s to 20 s half the
//! workers are taken away. Before the load, a quiet second at a tenth of the capacity gives the
//! unloaded latency. Prints one JSON object: per phase, goodput and, per class, the share
//! served and the p99 of what was served; and how often a sheddable request was served in a
//! second in which a critical one was refused.
//!
//!   adaptive_bench UPSTREAM_PORT GATEWAY_URL [SECONDS]
//!
//! The upstream is served at once on UPSTREAM_PORT; the load starts when GATEWAY_URL answers.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::Semaphore;

type Error = Box<dyn std::error::Error + Send + Sync>;

const WORKERS: usize = 16;
const SERVICE: Duration = Duration::from_millis(20);
const CLASSES: [&str; 3] = ["critical", "default", "sheddable"];

/// Requests per second the upstream serves at full strength.
fn capacity() -> f64 {
    WORKERS as f64 / SERVICE.as_secs_f64()
}

/// One request's fate.
struct Sent {
    at: Duration,
    class: usize,
    served: bool,
    latency: Duration,
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: adaptive_bench UPSTREAM_PORT GATEWAY_URL [SECONDS]";
    let port: u16 = args.next().ok_or(usage)?.parse()?;
    let gateway = args.next().ok_or(usage)?;
    let seconds: u64 = args.next().map_or(Ok(30), |text| text.parse())?;
    let workers = Arc::new(Semaphore::new(WORKERS));
    serve_upstream(port, workers.clone()).await?;
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4_096)
        .build(HttpConnector::new());
    wait_until_up(&client, &gateway).await?;

    let quiet = drive(
        &client,
        &gateway,
        capacity() / 10.0,
        Duration::from_secs(1),
        Some(0),
    )
    .await;
    let unloaded_p99 = p99(quiet.iter().filter(|s| s.served).map(|s| s.latency));
    let third = Duration::from_secs(seconds) / 3;
    let outage = tokio::spawn(async move {
        tokio::time::sleep(third).await;
        let taken = workers.acquire_many(WORKERS as u32 / 2).await;
        tokio::time::sleep(third).await;
        drop(taken);
    });
    let sent = drive(&client, &gateway, 2.0 * capacity(), third * 3, None).await;
    outage.await?;
    println!("{}", report(&sent, third, unloaded_p99));
    Ok(())
}

/// The upstream: `WORKERS` workers (the semaphore), `SERVICE` per request.
async fn serve_upstream(port: u16, workers: Arc<Semaphore>) -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let workers = workers.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |_: Request<_>| {
                    let workers = workers.clone();
                    async move {
                        let _worker = workers.acquire().await;
                        tokio::time::sleep(SERVICE).await;
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(())
}

async fn wait_until_up(
    client: &Client<HttpConnector, Empty<Bytes>>,
    gateway: &str,
) -> Result<(), Error> {
    for _ in 0..300 {
        let request = Request::get(gateway).body(Empty::new())?;
        if client.request(request).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("{gateway} did not answer").into())
}

/// Sends `rate` requests per second for `length`, each of the class `only` or of the 2/3/5
/// mix; waits for every answer (at most 10 s each: later is a failure).
async fn drive(
    client: &Client<HttpConnector, Empty<Bytes>>,
    gateway: &str,
    rate: f64,
    length: Duration,
    only: Option<usize>,
) -> Vec<Sent> {
    let sent = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / rate);
    let mut tasks = Vec::new();
    let mut index: u32 = 0;
    while start.elapsed() < length {
        tokio::time::sleep_until((start + interval * index).into()).await;
        let class = only.unwrap_or(match index % 10 {
            0 | 1 => 0,
            2..=4 => 1,
            _ => 2,
        });
        let request = Request::get(gateway)
            .header("x-priority", CLASSES[class])
            .header("x-api-key", format!("client-{}", index % 200))
            .body(Empty::new())
            .expect("a valid request");
        let (client, sent) = (client.clone(), sent.clone());
        let at = start.elapsed();
        tasks.push(tokio::spawn(async move {
            let begun = Instant::now();
            let answer = tokio::time::timeout(Duration::from_secs(10), async {
                let response = client.request(request).await.ok()?;
                let status = response.status();
                response.into_body().collect().await.ok()?;
                Some(status)
            })
            .await;
            let served = matches!(answer, Ok(Some(status)) if status.is_success());
            let latency = begun.elapsed();
            sent.lock().unwrap().push(Sent {
                at,
                class,
                served,
                latency,
            });
        }));
        index += 1;
    }
    for task in tasks {
        let _ = task.await;
    }
    Arc::try_unwrap(sent)
        .map(|sent| sent.into_inner().unwrap_or_default())
        .unwrap_or_default()
}

fn p99(latencies: impl Iterator<Item = Duration>) -> Option<Duration> {
    let mut latencies: Vec<Duration> = latencies.collect();
    latencies.sort();
    let index = (latencies.len() * 99 / 100).min(latencies.len().checked_sub(1)?);
    Some(latencies[index])
}

fn millis(duration: Option<Duration>) -> serde_json::Value {
    duration.map_or(serde_json::Value::Null, |d| {
        serde_json::json!((d.as_secs_f64() * 10_000.0).round() / 10.0)
    })
}

/// The JSON report: three phases of `third` each.
fn report(sent: &[Sent], third: Duration, unloaded_p99: Option<Duration>) -> serde_json::Value {
    let phases: Vec<serde_json::Value> = (0..3)
        .map(|phase| {
            let (from, to) = (third * phase, third * (phase + 1));
            let within: Vec<&Sent> = sent.iter().filter(|s| s.at >= from && s.at < to).collect();
            let served = within.iter().filter(|s| s.served).count();
            let capacity = if phase == 1 {
                capacity() / 2.0
            } else {
                capacity()
            };
            let classes: serde_json::Map<String, serde_json::Value> = (0..3)
                .map(|class| {
                    let of_class: Vec<&&Sent> =
                        within.iter().filter(|s| s.class == class).collect();
                    let ok = of_class.iter().filter(|s| s.served).count();
                    let share = ok as f64 / of_class.len().max(1) as f64;
                    let latency = p99(of_class.iter().filter(|s| s.served).map(|s| s.latency));
                    (
                        CLASSES[class].to_owned(),
                        serde_json::json!({
                            "served_share": (share * 10_000.0).round() / 10_000.0,
                            "p99_ms": millis(latency),
                        }),
                    )
                })
                .collect();
            serde_json::json!({
                "capacity_per_s": capacity,
                "goodput_per_s": (served as f64 / third.as_secs_f64()).round(),
                "classes": classes,
            })
        })
        .collect();
    serde_json::json!({
        "unloaded_p99_ms": millis(unloaded_p99),
        "phases": phases,
        "sheddable_served_in_seconds_critical_was_refused": inversions(sent),
    })
}

/// Sheddable requests served in a second in which a critical request was refused.
fn inversions(sent: &[Sent]) -> usize {
    let seconds = sent.iter().map(|s| s.at.as_secs()).max().unwrap_or(0) + 1;
    (0..seconds)
        .filter(|&second| {
            sent.iter()
                .any(|s| s.at.as_secs() == second && s.class == 0 && !s.served)
        })
        .map(|second| {
            sent.iter()
                .filter(|s| s.at.as_secs() == second && s.class == 2 && s.served)
                .count()
        })
        .sum()
}
