//! `server.workers: per_core`: one current-thread runtime per worker thread, each
//! with its own `SO_REUSEPORT` listener and upstream pool. Black-box, like the other tests: the
//! real binary, a real upstream, real sockets.

use crate::support;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use support::{
    Gateway, TempDir, Upstream, addresses, client, config_text, connect, get, start_gateway,
};

const PLANS: &str = r#"
plans:
  anonymous:
    limits: [ { name: hourly, algorithm: fixed_window, limit: 40, window: 1h } ]
  free:
    limits: [ { name: hourly, algorithm: fixed_window, limit: 40, window: 1h } ]
"#;

fn per_core(workers: usize, rest: &str) -> String {
    format!("server:\n  workers: per_core\n  worker_threads: {workers}\n{rest}")
}

/// A GET on `connection`: its status and body.
async fn send(
    connection: &mut SendRequest<Full<Bytes>>,
    addr: SocketAddr,
    path: &str,
) -> (StatusCode, Bytes) {
    connection.ready().await.expect("the connection stays open");
    let request = Request::get(path)
        .header("host", addr.to_string())
        .body(Full::default())
        .unwrap();
    let response = connection
        .send_request(request)
        .await
        .expect("gateway answers");
    let status = response.status();
    (
        status,
        response.into_body().collect().await.unwrap().to_bytes(),
    )
}

/// The gateway's threads named as `per_core` workers (`floodgate-worker-N`, cut to 15 bytes),
/// once they are started.
fn worker_threads(gateway: &Gateway) -> usize {
    gateway.wait_for_log(
        |line| line.contains("per_core workers serving"),
        "of the workers",
    );
    std::fs::read_dir(format!("/proc/{}/task", gateway.child.id()))
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("floodgate-worke"))
        .count()
}

/// The multi-thread model, which per_core replaced as the default, still serves.
fn multi_thread(rest: &str) -> String {
    format!("server:\n  workers: multi_thread\n{rest}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_keep_alive_connections_are_answered_and_a_limit_holds_exactly_across_workers() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = start_gateway(&upstream.url(), &per_core(4, PLANS));
    assert_eq!(worker_threads(&gateway), 4);
    a_limit_holds_exactly_over_sixteen_connections(&gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_multi_thread_model_holds_a_limit_exactly_too() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = start_gateway(&upstream.url(), &multi_thread(PLANS));
    a_limit_holds_exactly_over_sixteen_connections(&gateway).await;
}

async fn a_limit_holds_exactly_over_sixteen_connections(gateway: &Gateway) {
    let addr = gateway.listen;
    // 16 connections (the kernel spreads them over the 4 listeners by their ports), 10
    // requests each, all at once: 4 × the limit of 40 for the one client (127.0.0.1).
    let connections: Vec<_> = (0..16)
        .map(|_| {
            tokio::spawn(async move {
                let mut connection = connect(addr).await;
                let mut statuses = Vec::new();
                for _ in 0..10 {
                    statuses.push(send(&mut connection, addr, "/v1/things").await.0);
                }
                statuses
            })
        })
        .collect();
    let mut admitted = 0;
    let mut limited = 0;
    for connection in connections {
        for status in connection.await.unwrap() {
            match status {
                StatusCode::OK => admitted += 1,
                StatusCode::TOO_MANY_REQUESTS => limited += 1,
                other => panic!("unexpected {other}"),
            }
        }
    }
    assert_eq!(admitted, 40, "one limit across every worker");
    assert_eq!(limited, 120);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_reused_within_each_worker() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = start_gateway(&upstream.url(), &per_core(2, ""));
    let addr = gateway.listen;

    // One client connection is served by one worker: its requests reuse one upstream
    // connection from that worker's pool.
    let mut connection = connect(addr).await;
    for _ in 0..50 {
        assert_eq!(send(&mut connection, addr, "/").await.0, StatusCode::OK);
    }
    assert_eq!(upstream.connections.load(Ordering::Relaxed), 1);

    // 8 connections at once, 25 requests each: at most one upstream connection per request in
    // flight on each worker's pool, whichever worker each client connection landed on.
    let connections: Vec<_> = (0..8)
        .map(|_| {
            tokio::spawn(async move {
                let mut connection = connect(addr).await;
                for _ in 0..25 {
                    assert_eq!(send(&mut connection, addr, "/").await.0, StatusCode::OK);
                }
            })
        })
        .collect();
    for connection in connections {
        connection.await.unwrap();
    }
    let opened = upstream.connections.load(Ordering::Relaxed);
    assert!(
        opened <= 1 + 2 * 8,
        "{opened} upstream connections for 250 requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connections_bounds_every_worker_together() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) =
        start_gateway(&upstream.url(), &per_core(2, "  max_connections: 2\n"));
    let addr = gateway.listen;
    let mut first = connect(addr).await;
    let mut second = connect(addr).await;
    assert_eq!(send(&mut first, addr, "/").await.0, StatusCode::OK);
    assert_eq!(send(&mut second, addr, "/").await.0, StatusCode::OK);

    // A third connection waits, whichever worker it reached, until one of the two closes.
    let third = tokio::spawn(async move {
        let mut third = connect(addr).await;
        send(&mut third, addr, "/").await.0
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !third.is_finished(),
        "a third connection was served at once"
    );
    drop(first);
    let answered = tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("served once a slot is free")
        .unwrap();
    assert_eq!(answered, StatusCode::OK);
    assert_eq!(send(&mut second, addr, "/").await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_every_worker_accepting_and_finishes_in_flight_requests() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = start_gateway(&upstream.url(), &per_core(2, ""));
    sigterm_drains(gateway, &upstream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_multi_thread_model_too() {
    let upstream = Upstream::start().await;
    let (gateway, _directory) = start_gateway(&upstream.url(), &multi_thread(""));
    sigterm_drains(gateway, &upstream).await;
}

async fn sigterm_drains(mut gateway: Gateway, upstream: &Upstream) {
    let url = gateway.url("/slow?ms=1500");
    let in_flight = tokio::spawn(async move { get(&client(), &url, &[]).await });
    upstream.slow_arrived.notified().await;
    let signalled = Instant::now();
    gateway.signal("TERM");

    // Every listener closes: new connections are refused (several in a row, from different
    // ports, so that each listener had its turn) while the slow request is still in flight.
    let mut refused_in_a_row = 0;
    while refused_in_a_row < 20 {
        assert!(
            signalled.elapsed() < Duration::from_secs(1),
            "the listeners still accept after SIGTERM"
        );
        match tokio::net::TcpStream::connect(gateway.listen).await {
            Err(_) => refused_in_a_row += 1,
            Ok(_) => {
                refused_in_a_row = 0;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    assert!(!in_flight.is_finished());

    let response = in_flight.await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.body(), "slow done");
    let status = tokio::task::spawn_blocking(move || gateway.child.wait().unwrap())
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

#[test]
fn invalid_worker_settings_name_their_field() {
    let directory = TempDir::new("per-core-check");
    let (listen, admin) = addresses();
    let path = directory.file("floodgate.yaml");
    std::fs::write(
        &path,
        config_text(
            listen,
            admin,
            "http://127.0.0.1:9",
            "server:\n  workers: forked\n  worker_threads: 0\n",
        ),
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let errors = String::from_utf8_lossy(&output.stderr);
    assert!(errors.contains("server.workers"), "{errors}");
    assert!(
        errors.contains("`forked` is not one of multi_thread, per_core"),
        "{errors}"
    );
    assert!(errors.contains("server.worker_threads"), "{errors}");

    std::fs::write(
        &path,
        config_text(
            listen,
            admin,
            "http://127.0.0.1:9",
            "server:\n  workers: per_core\n",
        ),
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
}

#[test]
fn a_taken_port_cannot_be_shared_by_per_core_listeners() {
    // Taken without SO_REUSEPORT: the workers' listeners cannot join it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = taken.local_addr().unwrap();
    let (_, admin) = addresses();
    let directory = TempDir::new("per-core-bind");
    let path = directory.file("floodgate.yaml");
    std::fs::write(
        &path,
        config_text(listen, admin, "http://127.0.0.1:9", &per_core(2, "")),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["serve", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("the gateway served on a taken port");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success());
    assert!(
        stderr.contains(&format!("cannot listen on {listen}")),
        "{stderr}"
    );
}
