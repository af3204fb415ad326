//! A bare reverse proxy on the gateway's own HTTP stack, the third column of
//! `bench/gateway_vs_nginx.sh` (issue 47): hyper-util's server (HTTP/1.1 and h2c, as the
//! gateway's listener) in front of hyper-util's pooled client (`TCP_NODELAY`, 256 idle
//! connections per host, as the gateway's upstream client), on Tokio's multi-thread runtime. No
//! limiter, no header rewriting, no logging, no metrics: what separates floodgate from it is
//! floodgate's own work; what separates it from nginx is the stack's.
//!
//!   bare_proxy LISTEN_PORT UPSTREAM_PORT

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
use tokio::net::TcpListener;

type Answer = Response<Either<Incoming, Empty<Bytes>>>;

fn port(argument: Option<String>, what: &str) -> u16 {
    argument
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| panic!("{what} must be a port: bare_proxy LISTEN_PORT UPSTREAM_PORT"))
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

#[tokio::main]
async fn main() {
    let mut arguments = std::env::args().skip(1);
    let listen = port(arguments.next(), "LISTEN_PORT");
    let upstream = port(arguments.next(), "UPSTREAM_PORT");
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .build(connector);
    let listener = TcpListener::bind(("127.0.0.1", listen))
        .await
        .expect("the listening port is free");
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
