//! A `per_core` worker's own HTTP/1.1 upstream connections: reused while they
//! last, never reused once the upstream closed them or broke a response, and answered with
//! 502 / 504 when the upstream fails. The upstreams here are raw sockets, so that each test
//! decides exactly when a connection closes.

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use support::{connect, start_gateway};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One worker, so that every client connection shares one pool.
const ONE_WORKER: &str =
    "server:\n  workers: per_core\n  worker_threads: 1\nupstream_timeout: 1s\n";

/// What a raw upstream does with each request on a connection (0-based index on it).
#[derive(Clone, Copy)]
enum Behaviour {
    /// Answer every request, keep the connection, close it after `idle` without a request.
    KeepAliveFor(Duration),
    /// Answer `Connection: close` and close.
    CloseEach,
    /// On the connection's first request, promise 100 bytes, send 10 and close; answer
    /// normally on later connections.
    BreakFirstResponse,
}

struct RawUpstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawUpstream {
    async fn start(behaviour: Behaviour) -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let accepted = connections.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let index = accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve_raw(stream, behaviour, index));
            }
        });
        RawUpstream {
            addr,
            connections,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

/// Reads one request head (the gateway sends no body on these GETs); `false` at end of stream
/// or after `idle` without one.
async fn read_head(stream: &mut TcpStream, idle: Duration) -> bool {
    let mut head = Vec::new();
    let mut byte = [0u8; 1024];
    while !head.windows(4).any(|window| window == b"\r\n\r\n") {
        match tokio::time::timeout(idle, stream.read(&mut byte)).await {
            Ok(Ok(read)) if read > 0 => head.extend_from_slice(&byte[..read]),
            _ => return false,
        }
    }
    true
}

async fn serve_raw(mut stream: TcpStream, behaviour: Behaviour, connection: usize) {
    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    match behaviour {
        Behaviour::KeepAliveFor(idle) => {
            while read_head(&mut stream, idle).await {
                if stream.write_all(OK).await.is_err() {
                    return;
                }
            }
        }
        Behaviour::CloseEach => {
            if read_head(&mut stream, Duration::from_secs(5)).await {
                let _ = stream
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
                    )
                    .await;
            }
        }
        Behaviour::BreakFirstResponse => {
            if connection == 0 {
                if read_head(&mut stream, Duration::from_secs(5)).await {
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
                        .await;
                }
                return;
            }
            while read_head(&mut stream, Duration::from_secs(5)).await {
                if stream.write_all(OK).await.is_err() {
                    return;
                }
            }
        }
    }
    // Dropped: closed.
}

/// A GET on `connection`: the status and the whole body, or the body's error.
async fn get(
    connection: &mut SendRequest<Full<Bytes>>,
    addr: SocketAddr,
) -> (StatusCode, Result<Bytes, hyper::Error>) {
    connection.ready().await.expect("the connection stays open");
    let request = Request::get("/")
        .header("host", addr.to_string())
        .body(Full::default())
        .unwrap();
    let response = connection.send_request(request).await.expect("answered");
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map(|body| body.to_bytes());
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_reused_until_the_upstream_closes_them_when_idle() {
    let upstream = RawUpstream::start(Behaviour::KeepAliveFor(Duration::from_millis(100))).await;
    let (gateway, _directory) = start_gateway(&upstream.url(), ONE_WORKER);
    let addr = gateway.listen;
    let mut connection = connect(addr).await;

    // Back to back: one upstream connection.
    for _ in 0..20 {
        let (status, body) = get(&mut connection, addr).await;
        assert_eq!((status, body.unwrap()), (StatusCode::OK, Bytes::from("ok")));
    }
    assert_eq!(upstream.connections(), 1);

    // Pauses longer than the upstream's keep-alive: each time the idle connection was closed
    // by the upstream, and the next request goes out on a new one instead of failing.
    for round in 0..3 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (status, body) = get(&mut connection, addr).await;
        assert_eq!(status, StatusCode::OK, "after pause {round}");
        assert_eq!(body.unwrap(), "ok");
    }
    assert_eq!(upstream.connections(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_closes_after_each_response_is_never_reused() {
    let upstream = RawUpstream::start(Behaviour::CloseEach).await;
    let (gateway, _directory) = start_gateway(&upstream.url(), ONE_WORKER);
    let addr = gateway.listen;
    let mut connection = connect(addr).await;
    for request in 0..20 {
        let (status, body) = get(&mut connection, addr).await;
        assert_eq!(status, StatusCode::OK, "request {request}");
        assert_eq!(body.unwrap(), "ok");
    }
    assert_eq!(upstream.connections(), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_broken_midway_fails_its_client_and_its_connection_is_not_reused() {
    let upstream = RawUpstream::start(Behaviour::BreakFirstResponse).await;
    let (gateway, _directory) = start_gateway(&upstream.url(), ONE_WORKER);
    let addr = gateway.listen;

    // The head went out before the upstream broke off: the client sees the body fail (the
    // gateway closes its connection), never a complete-looking truncated body.
    let mut first = connect(addr).await;
    let (status, body) = get(&mut first, addr).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.is_err(), "a truncated body passed for whole: {body:?}");

    // The broken connection is gone: the next requests get a new one and whole answers.
    let mut second = connect(addr).await;
    for _ in 0..5 {
        let (status, body) = get(&mut second, addr).await;
        assert_eq!((status, body.unwrap()), (StatusCode::OK, Bytes::from("ok")));
    }
    assert_eq!(upstream.connections(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_or_silent_upstream_is_502_or_504_and_the_next_request_recovers() {
    // Refused: nothing listens on the port.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let refused_url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let (gateway, _directory) = start_gateway(&refused_url, ONE_WORKER);
    let mut connection = connect(gateway.listen).await;
    let (status, body) = get(&mut connection, gateway.listen).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(body.unwrap(), r#"{"error":"bad_gateway"}"#);

    // Silent: accepts, reads, never answers. 504 after upstream_timeout (1 s); the abandoned
    // connection is not reused, so a second request waits its own full timeout again, on a
    // connection of its own.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            held.push(stream);
        }
    });
    let (gateway, _directory) = start_gateway(&silent_url, ONE_WORKER);
    let mut connection = connect(gateway.listen).await;
    for _ in 0..2 {
        let (status, body) = get(&mut connection, gateway.listen).await;
        assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(body.unwrap(), r#"{"error":"upstream_timeout"}"#);
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    holder.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_request_without_host_reaches_the_upstream_with_its_authority() {
    let upstream = support::Upstream::start().await;
    let (gateway, _directory) = start_gateway(&upstream.url(), ONE_WORKER);
    let mut stream = TcpStream::connect(gateway.listen).await.unwrap();
    stream
        .write_all(b"GET /echo HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    let body = &answer[answer.find("\r\n\r\n").unwrap() + 4..];
    let echo: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(echo["headers"]["host"], upstream.addr.to_string(), "{echo}");
}
