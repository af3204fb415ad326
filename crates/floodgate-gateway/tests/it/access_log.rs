//! The access log (`access_log`, SPEC §5) through the `floodgate` binary: one line per
//! request with every field (JSON parsed here), never a raw API key, `only: limited`,
//! sampling, the text format, reopening on SIGUSR1 after the file was moved, and a log that
//! cannot keep up costing lines (counted), never request latency.

use crate::support;

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{Gateway, TempDir, Upstream, client, get};

const API_KEY: &str = "sk-live-very-secret-key";

/// A gateway whose `free` plan admits `hourly` requests an hour, logging as `access_log`
/// (YAML, indented under `access_log:`) says.
fn gateway(upstream: &Upstream, access_log: &str, hourly: u64) -> (Gateway, TempDir) {
    let rest = format!(
        "access_log:\n{access_log}\nclients:\n  api_keys: {{ \"{API_KEY}\": free }}\nplans:\n  free:\n    limits: [ {{ name: hourly, algorithm: fixed_window, limit: {hourly}, window: 1h }} ]\n  anonymous: {{}}\n"
    );
    support::start_gateway(&upstream.url(), &rest)
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Waits (up to 5 s) until `path` holds `count` lines; they are written off the request path.
fn wait_for_lines(path: &Path, count: usize) -> Vec<String> {
    let started = Instant::now();
    loop {
        let lines = lines(path);
        if lines.len() >= count {
            return lines;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{} of {count} lines in {}:\n{}",
            lines.len(),
            path.display(),
            lines.join("\n")
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn parsed(line: &str) -> Value {
    serde_json::from_str(line).unwrap_or_else(|error| panic!("not JSON ({error}): {line}"))
}

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_lines_carry_every_field_and_no_raw_key() {
    let upstream = Upstream::start().await;
    let directory = TempDir::new("log");
    let path = directory.file("access.log");
    let (gateway, _dir) = gateway(
        &upstream,
        &format!("  path: \"{}\"\n  format: json", path.display()),
        2,
    );
    let client = client();
    let traceparent = format!("00-{TRACE_ID}-00f067aa0ba902b7-01");
    let headers = [
        ("x-api-key", API_KEY),
        ("traceparent", traceparent.as_str()),
    ];
    let url = gateway.url("/v1/./things?secret=query");
    let first = get(&client, &url, &headers).await;
    assert_eq!(first.status(), 200);
    let echoed: Value = serde_json::from_slice(first.body()).unwrap();
    assert_eq!(
        echoed["headers"]["traceparent"],
        traceparent.as_str(),
        "passed through unchanged"
    );
    assert_eq!(get(&client, &url, &headers).await.status(), 200);
    assert_eq!(get(&client, &url, &headers).await.status(), 429);
    // Anonymous, and without a trace.
    assert_eq!(get(&client, &gateway.url("/open"), &[]).await.status(), 200);

    // A gRPC call over the limit: answered 200 with `grpc-status: 8`, limited all the same.
    let grpc = get(
        &client,
        &url,
        &[("x-api-key", API_KEY), ("content-type", "application/grpc")],
    )
    .await;
    assert_eq!(grpc.headers()["grpc-status"], "8");

    let lines = wait_for_lines(&path, 5);
    assert_eq!(
        lines.len(),
        5,
        "one line per request:\n{}",
        lines.join("\n")
    );
    let text = lines.join("\n");
    assert!(!text.contains(API_KEY), "a raw API key in the log:\n{text}");
    assert!(
        !text.contains("secret=query"),
        "the query (it may hold secrets) in the log"
    );
    let hash = floodgate::Identity::ApiKey(API_KEY.to_owned())
        .hash()
        .to_string();
    let [allowed, _, limited, anonymous, grpc] = [0, 1, 2, 3, 4].map(|index| parsed(&lines[index]));

    let time = allowed["time"].as_str().unwrap();
    assert_eq!(time.len(), 24, "RFC 3339 with milliseconds: {time}");
    assert!(time.ends_with('Z') && time.as_bytes()[10] == b'T', "{time}");
    assert_eq!(allowed["method"], "GET");
    assert_eq!(allowed["path"], "/v1/things", "normalised");
    assert_eq!(allowed["status"], 200);
    assert!(allowed["duration_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(allowed["upstream_status"], 200);
    assert!(allowed["upstream_ms"].as_f64().unwrap() > 0.0);
    assert!(allowed["upstream_ms"].as_f64() <= allowed["duration_ms"].as_f64());
    assert_eq!(allowed["identity"], hash.as_str());
    assert_eq!(allowed["scope"], "key");
    assert_eq!(allowed["plan"], "free");
    assert_eq!(allowed["decision"], "allowed");
    assert_eq!(allowed["limit"], "hourly");
    assert_eq!(allowed["remaining"], 1);
    assert_eq!(allowed["retry_after"], Value::Null);
    assert_eq!(allowed["trace_id"], TRACE_ID);

    assert_eq!(limited["status"], 429);
    assert_eq!(limited["decision"], "limited");
    assert_eq!(limited["limit"], "hourly");
    assert_eq!(limited["remaining"], 0);
    assert!(limited["retry_after"].as_u64().unwrap() > 0, "{limited}");
    assert_eq!(
        limited["upstream_status"],
        Value::Null,
        "never sent upstream"
    );
    assert_eq!(limited["upstream_ms"], Value::Null);

    assert_eq!(anonymous["scope"], "ip");
    assert_eq!(anonymous["plan"], "anonymous");
    assert_eq!(
        anonymous["decision"], "unlimited",
        "the anonymous plan has no limits"
    );
    assert_eq!(anonymous["trace_id"], Value::Null);

    // Regression: a limited gRPC call (status 200) was logged as `shadow_limited`.
    assert_eq!(grpc["status"], 200);
    assert_eq!(grpc["decision"], "limited", "{grpc}");
}

/// The decisions logged for two requests of a client allowed one, under `rollout.mode`; both
/// must be answered 200.
async fn decisions_under_rollout(mode: &str) -> Vec<Value> {
    let upstream = Upstream::start().await;
    let directory = TempDir::new("log");
    let path = directory.file("access.log");
    let (gateway, _dir) = gateway(
        &upstream,
        &format!("  path: \"{}\"\nrollout:\n  mode: {mode}", path.display()),
        1,
    );
    let client = client();
    for _ in 0..2 {
        let answer = get(
            &client,
            &gateway.url("/v1/things"),
            &[("x-api-key", API_KEY)],
        )
        .await;
        assert_eq!(answer.status(), 200, "{mode} denies nothing");
    }
    wait_for_lines(&path, 2)
        .iter()
        .map(|line| parsed(line)["decision"].clone())
        .collect()
}

/// Regression: with the kill switch (`rollout: off`) requests were logged as `unlimited`
/// while the decision metrics count them as bypassed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_switch_requests_are_logged_as_bypassed() {
    assert_eq!(
        decisions_under_rollout("off").await,
        ["bypassed", "bypassed"]
    );
}

/// In shadow mode the client gets no denial; the log tells it apart from an admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_denials_are_logged_as_shadow_limited() {
    assert_eq!(
        decisions_under_rollout("shadow").await,
        ["allowed", "shadow_limited"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_limited_keeps_refusals_and_sampling_keeps_a_share() {
    let upstream = Upstream::start().await;
    let directory = TempDir::new("log");
    let limited_path = directory.file("limited.log");
    let (limited_gateway, _dir) = gateway(
        &upstream,
        &format!("  path: \"{}\"\n  only: limited", limited_path.display()),
        2,
    );
    let client = client();
    let url = limited_gateway.url("/v1/things");
    let statuses = [200, 200, 429, 429, 429];
    for status in statuses {
        assert_eq!(
            get(&client, &url, &[("x-api-key", API_KEY)]).await.status(),
            status
        );
    }
    // In order, by one writer: once the third refusal is there, every earlier line is too.
    let refused = wait_for_lines(&limited_path, 3);
    assert_eq!(refused.len(), 3, "{}", refused.join("\n"));
    assert!(
        refused
            .iter()
            .all(|line| parsed(line)["decision"] == "limited"),
        "{}",
        refused.join("\n")
    );

    let sampled_path = directory.file("sampled.log");
    let (sampled_gateway, _dir) = gateway(
        &upstream,
        &format!(
            "  path: \"{}\"\n  format: text\n  sample: 0.5",
            sampled_path.display()
        ),
        100_000,
    );
    let requests = 400;
    for _ in 0..requests {
        let answer = get(
            &client,
            &sampled_gateway.url("/v1/things"),
            &[("x-api-key", API_KEY)],
        )
        .await;
        assert_eq!(answer.status(), 200);
    }
    // Sampled lines have no marker to wait for: wait until the count holds still for 300 ms
    // (the writer flushes as soon as its queue runs empty, within microseconds).
    let mut count = lines(&sampled_path).len();
    let mut still_since = Instant::now();
    let started = Instant::now();
    while still_since.elapsed() < Duration::from_millis(300) {
        std::thread::sleep(Duration::from_millis(20));
        let now = lines(&sampled_path).len();
        if now != count {
            (count, still_since) = (now, Instant::now());
        }
        assert!(started.elapsed() < Duration::from_secs(10));
    }
    // Binomial(400, 0.5): mean 200, standard deviation 10; these bounds are 8 deviations out.
    assert!(
        (120..=280).contains(&count),
        "{count} of {requests} sampled at 0.5"
    );
    let line = &lines(&sampled_path)[0];
    assert!(
        line.contains("decision=allowed") && line.contains("path=/v1/things"),
        "{line}"
    );
    assert!(
        line.contains("status=200") && line.contains("plan=free"),
        "{line}"
    );
}

/// A line is written once its answer's body is sent: `duration_ms` covers a client that takes
/// its time to read the body, and `bytes` counts what was sent, in full or cut short by a
/// client that leaves mid-body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lines_time_the_whole_body_and_count_its_bytes() {
    use http_body_util::{BodyExt, Full};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let upstream = Upstream::start().await;
    let directory = TempDir::new("log");
    let path = directory.file("access.log");
    let (gateway, _dir) = gateway(&upstream, &format!("  path: \"{}\"", path.display()), 10);
    // Far more than the loopback socket buffers hold, so that the body waits for the reader.
    const TOTAL: u64 = 32 * 1024 * 1024;
    let url = gateway.url(&format!("/download?bytes={TOTAL}"));
    let request = http::Request::get(&url)
        .header("x-api-key", API_KEY)
        .body(Full::new(bytes::Bytes::new()))
        .unwrap();
    let response = client().request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    // The gateway cannot send the last of the body before the reader starts, 300 ms after
    // the head: the socket buffers hold far less than the body.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len() as u64, TOTAL);

    let lines = wait_for_lines(&path, 1);
    let line = parsed(&lines[0]);
    assert_eq!(line["bytes"], TOTAL, "{line}");
    let duration = line["duration_ms"].as_f64().unwrap();
    assert!(
        duration >= 300.0,
        "{duration} ms logged for a body read 300 ms after its head"
    );
    assert!(line["upstream_ms"].as_f64().unwrap() < duration, "{line}");

    // Cut short: the client reads the head and a little, then leaves.
    let mut connection = tokio::net::TcpStream::connect(gateway.listen)
        .await
        .unwrap();
    let request = format!(
        "GET /download?bytes={TOTAL} HTTP/1.1\r\nhost: floodgate\r\nx-api-key: {API_KEY}\r\n\r\n"
    );
    connection.write_all(request.as_bytes()).await.unwrap();
    let mut start = vec![0u8; 64 * 1024];
    connection.read_exact(&mut start).await.unwrap();
    drop(connection);
    let lines = wait_for_lines(&path, 2);
    let line = parsed(&lines[1]);
    assert_eq!(line["status"], 200, "the status it was sent: {line}");
    let bytes = line["bytes"].as_u64().unwrap();
    assert!(bytes > 0 && bytes < TOTAL, "{line}");
}

/// The line of a client that sends `GET /slow` (answered after 20 s) and goes away once the
/// upstream has it, through a gateway whose configuration ends with `config_tail` after the
/// access log's path; and how long after it left the line was there.
async fn line_of_a_client_that_goes_away(config_tail: &str) -> (String, Duration) {
    use tokio::io::AsyncWriteExt;

    let upstream = Upstream::start().await;
    let directory = TempDir::new("log");
    let path = directory.file("access.log");
    let config = format!("  path: \"{}\"\n{config_tail}", path.display());
    let (gateway, _dir) = gateway(&upstream, &config, 10);
    let mut connection = tokio::net::TcpStream::connect(gateway.listen)
        .await
        .unwrap();
    let request = format!(
        "GET /slow?ms=20000 HTTP/1.1\r\nhost: floodgate\r\nx-api-key: {API_KEY}\r\n\
         traceparent: 00-{TRACE_ID}-00f067aa0ba902b7-01\r\n\r\n"
    );
    connection.write_all(request.as_bytes()).await.unwrap();
    upstream.slow_arrived.notified().await;
    let left = Instant::now();
    drop(connection);

    let lines = wait_for_lines(&path, 1);
    let waited = left.elapsed();
    assert_eq!(lines.len(), 1, "{lines:?}");
    (lines[0].clone(), waited)
}

/// A client that goes away before its answer still gets a line, when it leaves (not when the
/// upstream answers): status 499 as nginx writes it, with who it was and its trace id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_gets_a_499_line() {
    let (text, waited) = line_of_a_client_that_goes_away("").await;
    let line = parsed(&text);
    assert_eq!(line["status"], 499, "{line}");
    assert_eq!(line["decision"], "client_closed");
    assert_eq!(line["method"], "GET");
    assert_eq!(line["path"], "/slow");
    assert_eq!(line["plan"], "free");
    assert_eq!(line["scope"], "key");
    assert_eq!(line["trace_id"], TRACE_ID);
    assert!(line["upstream_status"].is_null() && line["limit"].is_null());
    assert!(!text.contains(API_KEY));
    // Written when the client left: the upstream would have answered after 20 s.
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert!(line["duration_ms"].as_f64().unwrap() < 5_000.0, "{line}");
}

/// Regression (after review of the typed outcome): under the kill switch a client that goes
/// away is logged as bypassed, as its answered requests are; the layer's outcome rides on an
/// answer it never got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_under_the_kill_switch_is_logged_as_bypassed() {
    let (text, _) = line_of_a_client_that_goes_away("rollout:\n  mode: off").await;
    let line = parsed(&text);
    assert_eq!(line["status"], 499, "{line}");
    assert_eq!(line["decision"], "bypassed", "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr1_reopens_a_moved_file() {
    let upstream = Upstream::start().await;
    let directory = TempDir::new("log");
    let path = directory.file("access.log");
    let (gateway, _dir) = gateway(&upstream, &format!("  path: \"{}\"", path.display()), 100);
    let client = client();
    get(&client, &gateway.url("/before"), &[]).await;
    wait_for_lines(&path, 1);
    let rotated = directory.file("access.log.1");
    std::fs::rename(&path, &rotated).unwrap();
    gateway.signal("USR1");
    gateway.wait_for_log(
        |line| line.contains("the access log is reopened before its next line"),
        "SIGUSR1 heard",
    );
    get(&client, &gateway.url("/after"), &[]).await;
    let fresh = wait_for_lines(&path, 1);
    assert_eq!(parsed(&fresh[0])["path"], "/after");
    let old = lines(&rotated);
    assert_eq!(old.len(), 1, "{}", old.join("\n"));
    assert_eq!(parsed(&old[0])["path"], "/before");
}

/// A gateway whose access log is a FIFO (with a queue of 64 lines) that is opened and never
/// read: its writer blocks once the pipe and its buffer are full. Returns the gateway, its
/// directory and the FIFO's reader end, to be held for as long as the test needs the pipe.
fn logging_to_a_stalled_fifo(upstream: &Upstream) -> (Gateway, TempDir, (TempDir, std::fs::File)) {
    let directory = TempDir::new("log");
    let fifo = directory.file("stalled.fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    // The reader end, held open and never read (opening blocks until the gateway opens its end).
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::File::open(fifo).unwrap())
    };
    let (gateway, dir) = gateway(
        upstream,
        &format!("  path: \"{}\"\n  buffer: 64", fifo.display()),
        1_000_000,
    );
    let reader = reader.join().unwrap();
    (gateway, dir, (directory, reader))
}

/// The log is a FIFO that is opened and never read: the writer blocks once the pipe and its
/// buffer are full. Requests must not notice: every one is answered within 2 s (it would hang
/// for good if a request waited for the log), and the lines that could not be queued are
/// counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_cannot_keep_up_costs_lines_not_latency() {
    let upstream = Upstream::start().await;
    let (gateway, _dir, _stalled) = logging_to_a_stalled_fifo(&upstream);
    let requests = 3000;
    let started = Instant::now();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let client = client();
            let url = gateway.url("/v1/things");
            tokio::spawn(async move {
                let mut slowest = Duration::ZERO;
                for _ in 0..requests / 8 {
                    let sent = Instant::now();
                    let answer = tokio::time::timeout(
                        Duration::from_secs(2),
                        get(&client, &url, &[("x-api-key", API_KEY)]),
                    )
                    .await
                    .expect("answered within 2 s while the log is stalled");
                    assert_eq!(answer.status(), 200);
                    slowest = slowest.max(sent.elapsed());
                }
                slowest
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for task in tasks {
        slowest = slowest.max(task.await.unwrap());
    }
    let elapsed = started.elapsed();
    let metrics = get(&client(), &gateway.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(metrics.body()).into_owned();
    let dropped: u64 = text
        .lines()
        .find_map(|line| line.strip_prefix("floodgate_access_log_dropped_total "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no dropped-lines counter:\n{text}"));
    // At most the queue (64), the writer's 64 KiB buffer and the pipe's 64 KiB (lines of
    // about 400 bytes: some 330) were taken; the rest was dropped.
    assert!(dropped >= 2000, "{dropped} of {requests} lines dropped");
    eprintln!("{requests} requests in {elapsed:?}, slowest {slowest:?}, {dropped} lines dropped");
}

/// A log whose output takes nothing (a FIFO opened and never read) does not keep the process
/// from exiting on SIGTERM: shutdown waits for the writer a bounded time (3 s), logs what was
/// left unwritten and exits 0. Before, it joined the writer, blocked on the FIFO, for ever.
///
/// The writer is stalled before the signal: more lines than the FIFO (64 KiB), the writer's
/// buffer (64 KiB) and the queue (64) hold, some dropped and counted. The bound on the exit,
/// 20 s, is the 3 s wait plus ample room for the drain and a loaded machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_log_does_not_keep_sigterm_from_ending_the_process() {
    let upstream = Upstream::start().await;
    let (mut gateway, _dir, _stalled) = logging_to_a_stalled_fifo(&upstream);
    let client = client();
    let url = gateway.url("/v1/things");
    let mut dropped = 0;
    for _ in 0..20 {
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let client = client.clone();
                let url = url.clone();
                tokio::spawn(async move {
                    for _ in 0..50 {
                        let answer = get(&client, &url, &[("x-api-key", API_KEY)]).await;
                        assert_eq!(answer.status(), 200);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let metrics = get(&client, &gateway.admin_url("/metrics"), &[]).await;
        dropped = String::from_utf8_lossy(metrics.body())
            .lines()
            .find_map(|line| line.strip_prefix("floodgate_access_log_dropped_total "))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(0);
        if dropped > 0 {
            break;
        }
    }
    assert!(dropped > 0, "the writer never stalled");

    gateway.signal("TERM");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = gateway.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the process did not exit within 20 s of SIGTERM:\n{}",
            gateway.log.lock().unwrap().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
    gateway.wait_for_log(
        |line| {
            line.contains("access log: the output did not take the queue")
                && line.contains("unwritten")
        },
        "saying what the stalled log left unwritten",
    );
}
