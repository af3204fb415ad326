//! `adaptive_concurrency` through the `floodgate` binary (SPEC §11), a fast variant of
//! `bench/adaptive.sh`'s arms: an upstream of four workers × 20 ms (200 requests per second)
//! offered about ten times what it can serve by 40 sheddable callers, beside 2 critical
//! callers (about 40 % of the capacity). Enforced, the
//! sheddable class is shed with 503s while critical requests keep being served; in shadow,
//! nothing is refused and the admin API counts what would have been.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use support::{Gateway, TempDir, admin_call, client, get};
use tokio::sync::Semaphore;

const WORKERS: usize = 4;
const SERVICE: Duration = Duration::from_millis(20);

/// An upstream of `WORKERS` workers each taking `SERVICE` per request; the rest queue.
async fn limited_upstream() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let workers = Arc::new(Semaphore::new(WORKERS));
    let task = tokio::spawn(async move {
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
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(
                            "served",
                        ))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, task)
}

/// A gateway shedding by class in front of `upstream`, logging refused requests to `log`. The
/// test's callers stand for a trusted proxy that sets `x-priority` (loopback is trusted).
fn gateway(upstream: &str, shadow: bool, log: &std::path::Path) -> (Gateway, TempDir) {
    let rest = format!(
        "adaptive_concurrency:\n  shadow: {shadow}\n  initial_limit: 40\n  min_limit: 2\n  \
         window: 200ms\n  min_samples: 10\n  class_header: x-priority\n  default_class: default\n  \
         classes:\n    - {{ name: critical, reserve: 0.3 }}\n    - {{ name: default }}\n    - {{ name: sheddable }}\n\
         per_ip: [ {{ name: generous, algorithm: token_bucket, limit: 1000000, window: 1s }} ]\n\
         identity:\n  trusted_proxies: [\"127.0.0.1/32\"]\n\
         access_log:\n  path: \"{}\"\n  format: json\n  only: limited\n",
        log.display()
    );
    support::start_gateway(upstream, &rest)
}

/// What `callers` callers of `class` got over `run`: (served, shed) counts.
async fn drive(
    gateway: &Gateway,
    class: &'static str,
    callers: usize,
    run: Duration,
) -> (u64, u64) {
    let served = Arc::new(AtomicU64::new(0));
    let shed = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + run;
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let (served, shed) = (served.clone(), shed.clone());
            let url = gateway.url("/");
            tokio::spawn(async move {
                let client = client();
                while Instant::now() < until {
                    let response = get(&client, &url, &[("x-priority", class)]).await;
                    match response.status().as_u16() {
                        200 => served.fetch_add(1, Ordering::Relaxed),
                        503 => {
                            assert_shed_answer(&response);
                            // A client told to come back later would; here it tries at once,
                            // to keep the pressure on.
                            shed.fetch_add(1, Ordering::Relaxed)
                        }
                        other => panic!("unexpected {other}: {:?}", response.body()),
                    };
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    (served.load(Ordering::Relaxed), shed.load(Ordering::Relaxed))
}

fn assert_shed_answer(response: &Response<Bytes>) {
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let retry_after: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_after >= 1);
    let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
    assert_eq!(
        body["type"],
        "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
    );
}

/// Runs both classes together for `run`: (critical served, shed), (sheddable served, shed).
async fn overload(gateway: &Gateway, run: Duration) -> ((u64, u64), (u64, u64)) {
    tokio::join!(
        drive(gateway, "critical", 2, run),
        drive(gateway, "sheddable", 40, run)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_upstream_sheds_the_lowest_class_and_serves_the_critical_one() {
    let (upstream, _task) = limited_upstream().await;
    let logs = TempDir::new("shed-log");
    let log = logs.file("access.log");
    let (gateway, _directory) = gateway(&upstream, false, &log);
    let ((critical, critical_shed), (sheddable, sheddable_shed)) =
        overload(&gateway, Duration::from_secs(4)).await;
    // The upstream serves at most 200 a second: about 800 in 4 s, whoever sends them.
    assert!(critical + sheddable <= 900, "{critical} + {sheddable}");
    assert!(sheddable_shed > 0, "nothing shed");
    // Critical callers keep 30 % of the limit to themselves: almost all of theirs go through
    // (generous: the limit moves while the run goes on).
    let critical_share = critical as f64 / (critical + critical_shed) as f64;
    assert!(
        critical_share >= 0.9,
        "{critical} served, {critical_shed} shed"
    );
    let sheddable_share = sheddable as f64 / (sheddable + sheddable_shed) as f64;
    assert!(
        sheddable_share < critical_share,
        "{sheddable_share} ≥ {critical_share}"
    );

    let answer = adaptive_status(&gateway).await;
    let only = &answer["upstreams"][0];
    assert_eq!(only["upstream"], upstream.as_str());
    // 40 at the start: the controller brought it toward the upstream's 4 workers.
    assert!(only["limit"].as_u64().unwrap() < 40, "{answer}");
    assert!(only["min_rtt_ms"].as_f64().unwrap() >= 20.0, "{answer}");
    assert_eq!(only["classes"][2]["name"], "sheddable");
    assert_eq!(only["classes"][2]["refused"], sheddable_shed);
    assert_eq!(only["classes"][0]["refused"], critical_shed);
    // The same, as gauges for dashboards: the round trip learned (the upstream's 20 ms at
    // least), the last window's sampled latency and peak in flight.
    let metrics = get(&client(), &gateway.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(metrics.body()).into_owned();
    let gauge = |name: &str| -> f64 {
        text.lines()
            .find(|line| line.starts_with(&format!("{name}{{")))
            .and_then(|line| line.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {name}:\n{text}"))
    };
    let min_rtt = gauge("floodgate_adaptive_min_rtt_seconds");
    assert!(min_rtt >= 0.02, "{min_rtt}");
    assert!(gauge("floodgate_adaptive_latency_seconds") >= min_rtt);
    assert!(gauge("floodgate_adaptive_peak_in_flight") >= 1.0);
    // The access log (`only: limited`) names the shedding as the refusal, once per request.
    let first = wait_for_first_line(&log).await;
    let line: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(line["decision"], "shed", "{line}");
    assert_eq!(line["status"], 503, "{line}");
}

/// `GET /admin/adaptive`, answered 200.
async fn adaptive_status(gateway: &Gateway) -> serde_json::Value {
    let (status, answer) = admin_call(
        &client(),
        gateway,
        http::Method::GET,
        "/admin/adaptive",
        None,
        None,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    answer
}

/// The log's first line, once its writer has written it (off the request path; 5 s at most).
async fn wait_for_first_line(path: &std::path::Path) -> String {
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if let Some(line) = text.lines().next() {
            return line.to_owned();
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no line in the access log"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_shadow_nothing_is_refused_and_what_would_be_is_counted() {
    let (upstream, _task) = limited_upstream().await;
    let logs = TempDir::new("shadow-log");
    let (gateway, _directory) = gateway(&upstream, true, &logs.file("access.log"));
    let ((_, critical_shed), (_, sheddable_shed)) =
        overload(&gateway, Duration::from_secs(2)).await;
    assert_eq!((critical_shed, sheddable_shed), (0, 0));
    let answer = adaptive_status(&gateway).await;
    let would_have = answer["upstreams"][0]["classes"][2]["refused"]
        .as_u64()
        .unwrap();
    assert!(would_have > 0, "{answer}");
}

/// A `concurrency` ceiling refused a request: a slot frees when a request in flight ends, about
/// the upstream's latency, not when a lease's window (its safety net against leaked leases)
/// runs out. Before: `Retry-After: 30` to `36` here, the window plus its jitter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_concurrency_ceiling_refuses_is_told_to_come_back_within_two_seconds() {
    let upstream = support::Upstream::start().await;
    let rest = "global:\n  \"GET /slow\": [ { name: in-flight, algorithm: concurrency, limit: 1, window: 30s } ]\n";
    let (gateway, _directory) = support::start_gateway(&upstream.url(), rest);
    let client = client();
    let slow_url = gateway.url("/slow?ms=2000");
    let holder = {
        let (client, url) = (client.clone(), slow_url.clone());
        tokio::spawn(async move { get(&client, &url, &[]).await })
    };
    upstream.slow_arrived.notified().await;
    let refused = get(&client, &slow_url, &[]).await;
    assert_eq!(refused.status(), 429);
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=2).contains(&retry_after), "Retry-After: {retry_after}");
    assert_eq!(holder.await.unwrap().status(), 200);
}

/// A route's `class` places its requests (SPEC §11, amended): through the binary, requests to
/// `/checkout` are counted in `critical`, the others in the default class, and a client's own
/// `x-priority` (no trusted proxy here) changes neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_s_class_places_its_requests() {
    let upstream = support::Upstream::start().await;
    let rest = "routes:\n  - { match: \"/checkout\", class: critical }\n\
                adaptive_concurrency:\n  class_header: x-priority\n  default_class: default\n  \
                classes:\n    - { name: critical, reserve: 0.2 }\n    - { name: default }\n    - { name: sheddable }\n";
    let (gateway, _directory) = support::start_gateway(&upstream.url(), rest);
    let client = client();
    for path in ["/checkout", "/checkout", "/checkout", "/", "/other"] {
        let response = get(&client, &gateway.url(path), &[("x-priority", "sheddable")]).await;
        assert_eq!(response.status(), 200, "{path}");
    }
    let answer = adaptive_status(&gateway).await;
    let admitted: Vec<_> = answer["upstreams"][0]["classes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|class| (class["name"].clone(), class["admitted"].clone()))
        .collect();
    assert_eq!(
        admitted,
        [
            ("critical".into(), 3.into()),
            ("default".into(), 2.into()),
            ("sheddable".into(), 0.into()),
        ],
        "{answer}"
    );
}

/// A class with a `wait` (SPEC §11, amended): a critical request that finds the limit full waits
/// for a place instead of being refused at once, and is refused only when its wait runs out.
/// The limit is fixed at 2 (`min_limit` = `max_limit`), both places held by slow default
/// requests: one ends at 1.5 s, the other at 6 s; critical requests wait up to 1 s. The first
/// critical request, sent at once, finds nothing freed within its second: 503. The second, sent
/// then, gets the place freed at 1.5 s: 200. Bounds of half a second each way, for a loaded
/// machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_critical_request_waits_for_a_place_and_is_refused_when_its_wait_runs_out() {
    let upstream = support::Upstream::start().await;
    // One client (the test's address) holds both places: `client_share: 1` lets it.
    let rest = "adaptive_concurrency:\n  initial_limit: 2\n  min_limit: 2\n  max_limit: 2\n  \
                client_share: 1\n  class_header: x-priority\n  default_class: default\n  \
                classes:\n    - { name: critical, wait: 1s }\n    - { name: default }\n\
                identity:\n  trusted_proxies: [\"127.0.0.1/32\"]\n";
    let (gateway, _directory) = support::start_gateway(&upstream.url(), rest);
    let client = client();
    let started = Instant::now();
    let holders: Vec<_> = [1_500, 6_000]
        .into_iter()
        .map(|ms| {
            let (client, url) = (client.clone(), gateway.url(&format!("/slow?ms={ms}")));
            tokio::spawn(async move { get(&client, &url, &[]).await.status() })
        })
        .collect();
    // Both holders in flight (a `Notify` would keep one wake-up of two arriving together).
    while adaptive_status(&gateway).await["upstreams"][0]["in_flight"] != 2 {
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "holders not in flight"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let critical = [("x-priority", "critical")];

    let refused = get(&client, &gateway.url("/"), &critical).await;
    let refused_at = started.elapsed();
    assert_eq!(refused.status(), 503);
    assert_shed_answer(&refused);
    assert!(
        refused_at >= Duration::from_secs(1) && refused_at < Duration::from_millis(1_500),
        "refused at {refused_at:?}: after its whole wait, before the first place freed"
    );

    let served = get(&client, &gateway.url("/"), &critical).await;
    assert_eq!(served.status(), 200, "the place freed at 1.5 s went to it");
    assert!(started.elapsed() < Duration::from_secs(6));
    let answer = adaptive_status(&gateway).await;
    let critical = &answer["upstreams"][0]["classes"][0];
    assert_eq!(
        (
            &critical["admitted"],
            &critical["waited"],
            &critical["refused"]
        ),
        (&1.into(), &1.into(), &1.into()),
        "{answer}"
    );
    assert_eq!(critical["waiting"], 0, "{answer}");
    let metrics = get(&client, &gateway.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(metrics.body()).into_owned();
    let waited = text
        .lines()
        .find(|line| line.starts_with("floodgate_adaptive_waited_total{"))
        .unwrap_or_else(|| panic!("no waited counter:\n{text}"));
    assert!(
        waited.contains("class=\"critical\"") && waited.ends_with(" 1"),
        "{waited}"
    );
    for holder in holders {
        assert_eq!(holder.await.unwrap(), 200);
    }
}
