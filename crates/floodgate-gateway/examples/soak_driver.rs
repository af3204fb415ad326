//! The traffic and the sampling of `bench/soak.sh`: an upstream (`/` answers at once, `/slow`
//! after 100 ms), mixed clients against each gateway, and every 10 s one sample per gateway of
//! its process (RSS, open descriptors, threads) and of its answers (requests, 429s, 5xx,
//! connection errors, p99 latency of the fast route). At the end it prints whether each resource stayed within a
//! plateau, and exits 1 if one did not.
//!
//! The clients, per gateway (each with an API key the plans know, or a fresh one):
//! - 20 steady clients at 10 requests/s each, under their plan's 20/s;
//! - 2 abusers at 200 requests/s each, mostly denied;
//! - rotating identities: 50 requests/s, each with a key never seen before;
//! - 8 callers of `/slow` (100 ms each) at up to 10 requests/s each, 4 of them sharing one key,
//!   so that its concurrency limit (where the gateway has one) takes and frees leases all the
//!   time.
//!
//! `soak_driver UPSTREAM_ADDRESS MINUTES NAME=URL@PID [NAME=URL@PID ...]`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::Request;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// What one gateway answered in the current sample interval.
#[derive(Default)]
struct Answers {
    requests: AtomicU64,
    limited: AtomicU64,
    server_errors: AtomicU64,
    failed: AtomicU64,
    /// Latencies of the interval, in microseconds.
    latencies: Mutex<Vec<u32>>,
}

struct Target {
    name: String,
    url: String,
    pid: u32,
    answers: Answers,
}

/// One sample of one gateway.
#[derive(Clone, Copy, Debug)]
struct Sample {
    seconds: u64,
    rss_kib: u64,
    descriptors: u64,
    threads: u64,
    requests: u64,
    limited: u64,
    server_errors: u64,
    failed: u64,
    p99_ms: f64,
}

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

async fn upstream(listener: tokio::net::TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let service = hyper::service::service_fn(|request: Request<Incoming>| async move {
                if request.uri().path() == "/slow" {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                    Bytes::from_static(b"ok"),
                )))
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn send(client: &HttpClient, target: &Target, path: &str, key: &str) {
    let request = Request::get(format!("{}{path}", target.url))
        .header("x-api-key", key)
        .body(Empty::new())
        .expect("a valid request");
    let started = Instant::now();
    let answers = &target.answers;
    match tokio::time::timeout(Duration::from_secs(10), client.request(request)).await {
        Ok(Ok(response)) => {
            let status = response.status();
            let _ = response.into_body().collect().await;
            answers.requests.fetch_add(1, Ordering::Relaxed);
            if status == 429 {
                answers.limited.fetch_add(1, Ordering::Relaxed);
            } else if status.is_server_error() {
                answers.server_errors.fetch_add(1, Ordering::Relaxed);
            }
            // The slow route's latency is the upstream's 100 ms: only the others say how fast
            // the gateway is.
            if path != "/slow" {
                let micros = u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX);
                answers
                    .latencies
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(micros);
            }
        }
        _ => {
            answers.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Sends `per_second` requests a second from `key(n)` until `until`.
async fn paced(
    client: HttpClient,
    target: Arc<Target>,
    path: &'static str,
    per_second: u64,
    until: Instant,
    key: impl Fn(u64) -> String,
) {
    let mut ticks = tokio::time::interval(Duration::from_micros(1_000_000 / per_second.max(1)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut sent = 0;
    while Instant::now() < until {
        ticks.tick().await;
        send(&client, &target, path, &key(sent)).await;
        sent += 1;
    }
}

fn read_proc(pid: u32) -> (u64, u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|value| value.parse().ok())
            .unwrap_or(0)
    };
    let descriptors =
        std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |entries| entries.count() as u64);
    (field("VmRSS:"), descriptors, field("Threads:"))
}

fn take_sample(target: &Target, seconds: u64) -> Sample {
    let (rss_kib, descriptors, threads) = read_proc(target.pid);
    let answers = &target.answers;
    let mut latencies = std::mem::take(
        &mut *answers
            .latencies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    latencies.sort_unstable();
    let p99_ms = latencies
        .get(latencies.len().saturating_sub(1) * 99 / 100)
        .map_or(0.0, |&micros| f64::from(micros) / 1000.0);
    Sample {
        seconds,
        rss_kib,
        descriptors,
        threads,
        requests: answers.requests.swap(0, Ordering::Relaxed),
        limited: answers.limited.swap(0, Ordering::Relaxed),
        server_errors: answers.server_errors.swap(0, Ordering::Relaxed),
        failed: answers.failed.swap(0, Ordering::Relaxed),
        p99_ms,
    }
}

fn max_of(samples: &[Sample], value: impl Fn(&Sample) -> f64) -> f64 {
    samples.iter().map(value).fold(0.0, f64::max)
}

fn median_of(samples: &[Sample], value: impl Fn(&Sample) -> f64) -> f64 {
    let mut values: Vec<f64> = samples.iter().map(value).collect();
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Whether each resource of `samples` stayed within a plateau: after a warm-up (the first
/// tenth, at least 3 samples), the last quarter's peak against the first quarter's, with slack
/// for what moves by itself (a few MiB of allocator pages, a connection or a blocking-pool
/// thread more at the moment of a sample).
fn verdict(name: &str, samples: &[Sample]) -> bool {
    let warm = (samples.len() / 10).max(3);
    if samples.len() < warm + 4 {
        println!("{name}: too few samples ({}) for a verdict", samples.len());
        return false;
    }
    let steady = &samples[warm..];
    let quarter = (steady.len() / 4).max(1);
    let (first, last) = (&steady[..quarter], &steady[steady.len() - quarter..]);
    let mut flat = true;
    let mut check = |what: &str, before: f64, after: f64, allowed: f64| {
        let holds = after <= allowed;
        flat &= holds;
        println!(
            "{name}: {what}: first quarter {before:.1}, last quarter {after:.1} (plateau if <= {allowed:.1}): {}",
            if holds { "flat" } else { "GREW" }
        );
    };
    let rss = |sample: &Sample| sample.rss_kib as f64 / 1024.0;
    check(
        "peak RSS MiB",
        max_of(first, rss),
        max_of(last, rss),
        max_of(first, rss) * 1.10 + 4.0,
    );
    let fds = |sample: &Sample| sample.descriptors as f64;
    check(
        "peak descriptors",
        max_of(first, fds),
        max_of(last, fds),
        max_of(first, fds) + 8.0,
    );
    let threads = |sample: &Sample| sample.threads as f64;
    check(
        "peak threads",
        max_of(first, threads),
        max_of(last, threads),
        max_of(first, threads) + 4.0,
    );
    let p99 = |sample: &Sample| sample.p99_ms;
    check(
        "median p99 ms",
        median_of(first, p99),
        median_of(last, p99),
        median_of(first, p99) * 2.0 + 5.0,
    );
    let server_errors: u64 = samples.iter().map(|sample| sample.server_errors).sum();
    let failed: u64 = samples.iter().map(|sample| sample.failed).sum();
    let requests: u64 = samples.iter().map(|sample| sample.requests).sum();
    println!(
        "{name}: {requests} answers, {server_errors} 5xx, {failed} failed connections or timeouts"
    );
    flat &= server_errors == 0;
    flat
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Arguments {
        upstream_address,
        minutes,
        targets,
    } = arguments()?;
    tokio::spawn(upstream(
        tokio::net::TcpListener::bind(&upstream_address).await?,
    ));
    // The gateways start with this upstream down: give them a moment to see it up.
    tokio::time::sleep(Duration::from_millis(200)).await;

    let until = Instant::now() + Duration::from_secs(minutes * 60);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http();
    let rotation = Arc::new(AtomicU64::new(0));
    for target in &targets {
        spawn_clients(&client, target, until, &rotation);
    }

    let samples = sample_until(&targets, until).await;
    println!();
    let mut all_flat = true;
    for (target, kept) in targets.iter().zip(&samples) {
        all_flat &= verdict(&target.name, kept);
    }
    println!(
        "verdict: {}",
        if all_flat {
            "every resource flat"
        } else {
            "something grew (see above)"
        }
    );
    std::process::exit(if all_flat { 0 } else { 1 });
}

/// The command line: `UPSTREAM_ADDRESS MINUTES NAME=URL@PID [NAME=URL@PID ...]`.
struct Arguments {
    upstream_address: String,
    minutes: u64,
    targets: Vec<Arc<Target>>,
}

fn arguments() -> Result<Arguments, Box<dyn std::error::Error>> {
    let mut arguments = std::env::args().skip(1);
    let usage = "usage: soak_driver UPSTREAM_ADDRESS MINUTES NAME=URL@PID [NAME=URL@PID ...]";
    let upstream_address = arguments.next().ok_or(usage)?;
    let minutes: u64 = arguments.next().ok_or(usage)?.parse()?;
    let mut targets = Vec::new();
    for argument in arguments {
        let (name, rest) = argument.split_once('=').ok_or(usage)?;
        let (url, pid) = rest.split_once('@').ok_or(usage)?;
        targets.push(Arc::new(Target {
            name: name.to_owned(),
            url: url.to_owned(),
            pid: pid.parse()?,
            answers: Answers::default(),
        }));
    }
    if targets.is_empty() {
        return Err(usage.into());
    }
    Ok(Arguments {
        upstream_address,
        minutes,
        targets,
    })
}

/// The clients of one gateway (see the module's docs), each its own task until `until`.
fn spawn_clients(
    client: &HttpClient,
    target: &Arc<Target>,
    until: Instant,
    rotation: &Arc<AtomicU64>,
) {
    for steady in 0..20 {
        tokio::spawn(paced(
            client.clone(),
            target.clone(),
            "/",
            10,
            until,
            move |_| format!("steady-{steady}"),
        ));
    }
    for abuser in 0..2 {
        tokio::spawn(paced(
            client.clone(),
            target.clone(),
            "/",
            200,
            until,
            move |_| format!("abuser-{abuser}"),
        ));
    }
    let rotation = rotation.clone();
    tokio::spawn(paced(
        client.clone(),
        target.clone(),
        "/",
        50,
        until,
        move |_| format!("rotating-{}", rotation.fetch_add(1, Ordering::Relaxed)),
    ));
    for caller in 0..8 {
        // Up to 10 a second each: back to back while each takes 100 ms, paced when denied.
        tokio::spawn(paced(
            client.clone(),
            target.clone(),
            "/slow",
            10,
            until,
            move |_| {
                if caller < 4 {
                    "slow-shared".to_owned()
                } else {
                    format!("slow-{caller}")
                }
            },
        ));
    }
}

/// Every [`SAMPLE_EVERY`] until `until`, one sample of each target, printed as it is taken;
/// each target's samples.
async fn sample_until(targets: &[Arc<Target>], until: Instant) -> Vec<Vec<Sample>> {
    let started = Instant::now();
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); targets.len()];
    println!("seconds gateway rss_mib fds threads requests limited 5xx failed p99_ms");
    let mut ticks =
        tokio::time::interval_at(tokio::time::Instant::now() + SAMPLE_EVERY, SAMPLE_EVERY);
    while Instant::now() < until {
        ticks.tick().await;
        let seconds = started.elapsed().as_secs();
        for (target, kept) in targets.iter().zip(&mut samples) {
            let sample = take_sample(target, seconds);
            println!(
                "{:>7} {:<8} {:>7.1} {:>4} {:>7} {:>8} {:>7} {:>3} {:>6} {:>6.2}",
                sample.seconds,
                target.name,
                sample.rss_kib as f64 / 1024.0,
                sample.descriptors,
                sample.threads,
                sample.requests,
                sample.limited,
                sample.server_errors,
                sample.failed,
                sample.p99_ms
            );
            kept.push(sample);
        }
    }
    samples
}
