//! A bare reverse proxy on the gateway's own HTTP stack, the third column of
//! `bench/gateway_vs_nginx.sh` (issue 47): hyper-util's server (HTTP/1.1 and h2c, as the
//! gateway's listener) in front of hyper-util's pooled client (`TCP_NODELAY`, 256 idle
//! connections per host, as the gateway's upstream client), on Tokio's multi-thread runtime. No
//! limiter, no header rewriting, no logging, no metrics: what separates floodgate from it is
//! floodgate's own work; what separates it from nginx is the stack's. Its two modes are the
//! gateway's `server.workers`: Tokio's multi-thread runtime, or one current-thread runtime
//! per core, each on its own `SO_REUSEPORT` listener with its own upstream pool.
//!
//!   bare_proxy LISTEN_PORT UPSTREAM_PORT [multi_thread|per_core]

use std::convert::Infallible;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{Either, Empty};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpSocket};

type Answer = Response<Either<Incoming, Empty<Bytes>>>;

fn port(argument: Option<String>, what: &str) -> u16 {
    argument
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| panic!("{what} must be a port: see the file's doc"))
}

/// Sends `request` to the upstream on `client`'s pool; a failure is a bodiless 502.
async fn forward(
    client: Client<HttpConnector, Incoming>,
    upstream: u16,
    mut request: Request<Incoming>,
) -> Result<Answer, Infallible> {
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |path| path.as_str());
    let target = format!("http://127.0.0.1:{upstream}{path}");
    *request.uri_mut() = target.parse().expect("a path the server accepted");
    Ok(match client.request(request).await {
        Ok(response) => response.map(Either::Left),
        Err(_) => {
            let mut failed = Response::new(Either::Right(Empty::new()));
            *failed.status_mut() = StatusCode::BAD_GATEWAY;
            failed
        }
    })
}

/// Binds `port` on loopback with `SO_REUSEPORT`, so that each per-core worker has a listener
/// of its own on it (the kernel spreads connections over them), as the gateway's workers do.
fn listener(port: u16) -> TcpListener {
    let socket = TcpSocket::new_v4().expect("a socket");
    socket.set_reuseport(true).expect("SO_REUSEPORT");
    socket
        .bind(([127, 0, 0, 1], port).into())
        .expect("the listening port is free");
    socket.listen(1024).expect("a listening socket")
}

/// Accepts on `listener` and forwards every request to the upstream through a pool of its
/// own (one per worker in `per_core` mode, as the gateway's thread-local pools).
async fn serve(listener: TcpListener, upstream: u16) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .build(connector);
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let client = client.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| forward(client.clone(), upstream, request));
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder.http1().timer(TokioTimer::new());
            // A connection that ends early is the client's business.
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn main() {
    let mut arguments = std::env::args().skip(1);
    let listen = port(arguments.next(), "LISTEN_PORT");
    let upstream = port(arguments.next(), "UPSTREAM_PORT");
    match arguments.next().as_deref() {
        None | Some("multi_thread") => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(async { serve(listener(listen), upstream).await }),
        Some("per_core") => {
            let workers = std::thread::available_parallelism().map_or(1, usize::from);
            let threads: Vec<_> = (0..workers)
                .map(|_| {
                    std::thread::spawn(move || {
                        tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .expect("a runtime")
                            .block_on(async { serve(listener(listen), upstream).await });
                    })
                })
                .collect();
            for thread in threads {
                let _ = thread.join();
            }
        }
        Some(other) => panic!("the mode is multi_thread or per_core, not {other}"),
    }
}
