//! The reverse proxy: forwards a request to its upstream and streams both bodies.
//!
//! Hop-by-hop headers are removed both ways (RFC 9110 §7.6.1), `X-Forwarded-For` is appended,
//! `X-Forwarded-Proto` / `X-Forwarded-Host` are set, `Host` is kept, WebSocket upgrades are
//! spliced through, and an unreachable or slow upstream yields 502 / 504 with no internal
//! detail in the body.

pub(crate) mod client_body;
pub(crate) mod pool;
pub(crate) mod shedding;

/// A request extension marking requests that arrived over the TLS listener
/// (`X-Forwarded-Proto: https`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct OverTls;

use std::cell::{Cell, RefCell};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use floodgate::PeerAddr;
use floodgate::adaptive::{AdaptivePermit, Admission, ShedDecision};
use floodgate::post_charge::{CostHeader, CostInTrailers, ReportedCost, ResponseCost};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tower_service::Service;

use crate::client::ResolvedClient;
use crate::config::{Config, RouteTarget, Upstream, UpstreamProtocol};
use crate::error::GatewayError;
use crate::tls::{TlsError, UpstreamTls, upstream_client_config};
use client_body::{BodyWatch, ClientBody, ClientFault};
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use pool::UpstreamBody;
use rustls::pki_types::ServerName;
use shedding::Shedding;

/// The body of a proxied response: the upstream's, streamed, or the gateway's own error body.
pub(crate) type ProxyBody = Either<UpstreamBody, Full<Bytes>>;

/// An upstream HTTP client: pooled connections (http and https). Its pool is shared by its
/// clones, and across configuration versions as long as the TLS settings and protocol stay the
/// same (see [`UpstreamClients`]).
pub(crate) type UpstreamClient = Client<HttpsConnector<HttpConnector>, ClientBody>;

/// What an upstream client is built from: a reload that changes none of it keeps the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClientSettings {
    /// `upstream_tls`.
    pub tls: UpstreamTls,
    /// `upstream_protocol`.
    pub protocol: UpstreamProtocol,
}

impl ClientSettings {
    /// The settings of `config`.
    pub(crate) fn of(config: &Config) -> Self {
        ClientSettings {
            tls: config.upstream_tls.clone(),
            protocol: config.upstream_protocol,
        }
    }
}

/// The upstream clients of one [`ClientSettings`]: a pool shared by every thread of the
/// multi-threaded runtime, and one pool per `per_core` worker thread (made on the thread's
/// first request), so that a worker's upstream connections are driven by the worker that uses
/// them. A worker sends plain-`http` HTTP/1.1 requests over connections of its own instead
/// ([`pool`]); its hyper-util pool serves `https` and h2c upstreams. Cheap to clone;
/// clones share the pools.
#[derive(Clone)]
pub(crate) struct UpstreamClients {
    inner: Arc<ClientsInner>,
}

struct ClientsInner {
    /// Which settings these are, process-wide: a worker's cached pool is for one generation.
    generation: u64,
    connector: HttpsConnector<HttpConnector>,
    protocol: UpstreamProtocol,
    shared: UpstreamClient,
}

/// The generation of the next [`UpstreamClients`].
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// Set on `per_core` worker threads: requests there use the thread's own pool.
    static PER_WORKER_POOL: Cell<bool> = const { Cell::new(false) };
    /// A worker thread's own pool, and the generation it was made for.
    static WORKER_CLIENT: RefCell<Option<(u64, UpstreamClient)>> = const { RefCell::new(None) };
}

/// Makes the calling thread (a `per_core` worker) use an upstream pool of its own, made on its
/// first request and replaced when a reload brings new client settings.
pub(crate) fn use_thread_local_upstream_pool() {
    PER_WORKER_POOL.set(true);
}

impl UpstreamClients {
    /// Whether `self` and `other` are one client (clones of one build).
    #[cfg(test)]
    pub(crate) fn is(&self, other: &UpstreamClients) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether a request to `upstream` on the calling thread goes over the worker's own
    /// HTTP/1.1 connections ([`pool`]): on a `per_core` worker, to a plain-`http`
    /// upstream, unless `upstream_protocol: http2` asks for h2c.
    fn worker_pool_serves(&self, upstream: &Upstream) -> bool {
        PER_WORKER_POOL.get()
            && upstream.scheme == http::uri::Scheme::HTTP
            && self.inner.protocol != UpstreamProtocol::Http2
    }

    /// Sends `request` to `upstream`: over the worker's own connections where
    /// [`Self::worker_pool_serves`], else through the hyper-util client of the calling
    /// thread. `origin` is the request's path and query.
    async fn send(
        &self,
        upstream: &Upstream,
        origin: PathAndQuery,
        mut request: Request<ClientBody>,
    ) -> Result<Response<UpstreamBody>, Box<dyn std::error::Error + Send + Sync>> {
        if self.worker_pool_serves(upstream) {
            *request.uri_mut() = Uri::from(origin);
            if !request.headers().contains_key(header::HOST) {
                // An HTTP/1.0 request without one: the upstream's, as hyper-util's client
                // writes it (the port only when it is not 80).
                let host = match upstream.authority.port_u16() {
                    Some(port) if port != 80 => upstream.authority.as_str(),
                    _ => upstream.authority.host(),
                };
                if let Ok(host) = HeaderValue::from_str(host) {
                    request.headers_mut().insert(header::HOST, host);
                }
            }
            return Ok(pool::send(&upstream.authority, request).await?);
        }
        *request.uri_mut() = target_uri(upstream, origin)?;
        let response = self.client().request(request).await?;
        Ok(response.map(UpstreamBody::from))
    }

    /// The client for a request on the calling thread: the thread's own on a `per_core`
    /// worker, the shared one elsewhere.
    pub(crate) fn client(&self) -> UpstreamClient {
        if !PER_WORKER_POOL.get() {
            return self.inner.shared.clone();
        }
        let generation = self.inner.generation;
        WORKER_CLIENT.with_borrow_mut(|cached| match cached {
            Some((cached_generation, client)) if *cached_generation == generation => client.clone(),
            // A request still finishing under an older version: not worth evicting the pool
            // the current version uses.
            Some((cached_generation, _)) if *cached_generation > generation => {
                self.inner.shared.clone()
            }
            _ => {
                let client = pooled_client(self.inner.connector.clone(), self.inner.protocol);
                *cached = Some((generation, client.clone()));
                client
            }
        })
    }
}

/// Pooled clients for http and https upstreams.
pub(crate) fn upstream_client(settings: &ClientSettings) -> Result<UpstreamClients, GatewayError> {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    // The TLS layer above decides the scheme.
    http.enforce_http(false);
    let tls = upstream_client_config(&settings.tls).map_err(|source| GatewayError::Tls {
        context: "upstream_tls",
        source: Box::new(source),
    })?;
    let builder = HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    let builder = match &settings.tls.server_name {
        Some(name) => {
            let name = ServerName::try_from(name.clone()).map_err(|_| GatewayError::Tls {
                context: "upstream_tls.server_name",
                source: Box::new(TlsError::ServerName(name.clone())),
            })?;
            builder.with_server_name_resolver(FixedServerNameResolver::new(name))
        }
        None => builder,
    };
    let connector = match settings.protocol {
        UpstreamProtocol::Auto => builder.enable_all_versions().wrap_connector(http),
        UpstreamProtocol::Http1 => builder.enable_http1().wrap_connector(http),
        UpstreamProtocol::Http2 => builder.enable_http2().wrap_connector(http),
    };
    Ok(UpstreamClients {
        inner: Arc::new(ClientsInner {
            generation: NEXT_GENERATION.fetch_add(1, Ordering::Relaxed),
            shared: pooled_client(connector.clone(), settings.protocol),
            connector,
            protocol: settings.protocol,
        }),
    })
}

/// A client with a pool of its own over `connector` (clones share the TLS configuration).
fn pooled_client(
    connector: HttpsConnector<HttpConnector>,
    protocol: UpstreamProtocol,
) -> UpstreamClient {
    let mut client = Client::builder(TokioExecutor::new());
    client
        .pool_max_idle_per_host(256)
        .timer(hyper_util::rt::TokioTimer::new())
        .pool_timer(hyper_util::rt::TokioTimer::new());
    if protocol == UpstreamProtocol::Http2 {
        // h2 by ALPN on https, prior knowledge (h2c) on http.
        client.http2_only(true);
    }
    client.build(connector)
}

/// Forwards requests under one configuration version.
#[derive(Clone)]
pub(crate) struct Proxy {
    clients: UpstreamClients,
    config: Arc<Config>,
    shedding: Option<Arc<Shedding>>,
}

impl Proxy {
    /// A proxy for `config`, shedding by `shedding` when `adaptive_concurrency` is set.
    pub(crate) fn new(
        clients: UpstreamClients,
        config: Arc<Config>,
        shedding: Option<Arc<Shedding>>,
    ) -> Self {
        Proxy {
            clients,
            config,
            shedding,
        }
    }
}

/// The upstream `request` goes to: its route's, else the default.
/// Whether `request` came from one of `identity.trusted_proxies`.
fn trusted_peer<B>(config: &Config, request: &Request<B>) -> bool {
    request
        .extensions()
        .get::<PeerAddr>()
        .is_some_and(|PeerAddr(peer)| config.identity.identifier.client_ip().is_trusted(peer.ip()))
}

/// The request's route, if one matches.
fn route_of<'c, B>(config: &'c Config, request: &Request<B>) -> Option<&'c RouteTarget> {
    ResolvedClient::route_of(
        &config.routes,
        request.extensions(),
        request.method(),
        request.uri().path(),
    )
}

/// Where a request of `route` goes: the route's upstream, else the default one.
fn upstream_of_route<'c>(config: &'c Config, route: Option<&'c RouteTarget>) -> &'c Upstream {
    route
        .and_then(|route| route.upstream.as_ref())
        .unwrap_or(&config.upstream)
}

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Removes hop-by-hop headers, including those the `Connection` header names.
fn remove_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::try_from(name.trim()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        &header::CONNECTION,
        &KEEP_ALIVE,
        &PROXY_CONNECTION,
        &header::PROXY_AUTHENTICATE,
        &header::PROXY_AUTHORIZATION,
        &header::TE,
        &header::TRAILER,
        &header::TRANSFER_ENCODING,
        &header::UPGRADE,
    ] {
        headers.remove(name);
    }
}

/// The WebSocket upgrade a request asks for (`Connection: upgrade` + `Upgrade: websocket`).
///
/// Only WebSocket is spliced through: after any upgrade the connection is a tunnel the limiter
/// no longer sees, so `h2c` (or any other protocol an upstream might accept) would carry
/// unlimited requests for the one that was counted. Other `Upgrade` headers are dropped with
/// the hop-by-hop headers, and the request is forwarded as an ordinary one.
fn upgrade_protocol(headers: &HeaderMap) -> Option<HeaderValue> {
    let asks = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"));
    let protocol = headers.get(header::UPGRADE)?;
    let websocket = protocol
        .to_str()
        .is_ok_and(|value| value.trim().eq_ignore_ascii_case("websocket"));
    (asks && websocket).then(|| protocol.clone())
}

/// The gateway's own JSON error answer, `{"error": error}`.
pub(crate) fn json_error(status: StatusCode, error: &'static str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({ "error": error }).to_string();
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Appends `peer` to `X-Forwarded-For`, joining several header lines into one. Bytes, not
/// text: a line that is not UTF-8 must not make the gateway drop the chain it was given.
fn append_forwarded_for(headers: &mut HeaderMap, peer: std::net::IpAddr) {
    let mut chain = Vec::new();
    for line in headers.get_all(&X_FORWARDED_FOR) {
        chain.extend_from_slice(line.as_bytes());
        chain.extend_from_slice(b", ");
    }
    chain.extend_from_slice(peer.to_string().as_bytes());
    if let Ok(value) = HeaderValue::from_bytes(&chain) {
        headers.insert(X_FORWARDED_FOR.clone(), value);
    }
}

/// Handles of the upstream metrics, looked up once: the `metrics!` macros hash the name and
/// labels into the registry on every call (and the status label was a new `String` per
/// request), which showed in a profile of the gateway under load.
struct UpstreamMetrics {
    duration: metrics::Histogram,
    /// `floodgate_upstream_requests_total{status}` by status code, each registered on first use
    /// so that /metrics lists only the statuses seen.
    by_status: [std::sync::OnceLock<metrics::Counter>; 500],
}

impl UpstreamMetrics {
    fn status(&self, status: StatusCode) -> &metrics::Counter {
        let index = usize::from(status.as_u16()).saturating_sub(100).min(499);
        self.by_status[index].get_or_init(|| {
            metrics::counter!(crate::telemetry::UPSTREAM_REQUESTS_TOTAL, "status" => status.as_str().to_owned())
        })
    }
}

/// The upstream metrics of the process. First used by a request, after `serve` installed the
/// recorder (a handle taken before that would count into nothing).
fn upstream_metrics() -> &'static UpstreamMetrics {
    static METRICS: std::sync::OnceLock<UpstreamMetrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| UpstreamMetrics {
        duration: metrics::histogram!(crate::telemetry::UPSTREAM_DURATION_SECONDS),
        by_status: [const { std::sync::OnceLock::new() }; 500],
    })
}

/// An error and its sources, `: `-separated.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The client's fault behind a failed upstream call, if it was the client's: a body it broke
/// or stopped sending (also when the upstream timed out while waiting for that body).
fn client_fault(watch: &BodyWatch, timed_out: bool) -> Option<ClientFault> {
    watch
        .fault()
        .or_else(|| (timed_out && watch.waiting_on_client()).then_some(ClientFault::Timeout))
}

/// 408 or 400, counted under `floodgate_client_errors_total` and logged at debug: a client's
/// fault is not the upstream's, and must not trip upstream alerts.
fn client_fault_response(fault: ClientFault) -> Response<ProxyBody> {
    let (status, error, kind) = match fault {
        ClientFault::Timeout => (
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "body_timeout",
        ),
        ClientFault::Malformed => (StatusCode::BAD_REQUEST, "bad_request", "malformed_body"),
    };
    tracing::debug!(kind, "request body failed on the client's side");
    metrics::counter!(crate::telemetry::CLIENT_ERRORS_TOTAL, "kind" => kind).increment(1);
    let mut response = error_response(status, error);
    // The rest of the body is unread: the connection cannot carry another request.
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

fn error_response(status: StatusCode, error: &'static str) -> Response<ProxyBody> {
    json_error(status, error).map(Either::Right)
}

/// The absolute URI hyper-util's client routes by.
fn target_uri(upstream: &Upstream, origin: PathAndQuery) -> Result<Uri, http::Error> {
    Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(origin)
        .build()
}

async fn forward(
    clients: UpstreamClients,
    config: Arc<Config>,
    mut request: Request<Incoming>,
) -> Response<ProxyBody> {
    let route = route_of(&config, &request);
    let upstream = upstream_of_route(&config, route);
    // Kept to be written as the upstream request's target (hyper-util's client wants it
    // absolute, an HTTP/1.1 connection origin-form).
    let origin = request
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let peer = request
        .extensions()
        .get::<PeerAddr>()
        .map(|PeerAddr(addr)| addr.ip());
    let upgrade = upgrade_protocol(request.headers());
    let client_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut request));

    let (mut parts, body) = request.into_parts();
    // HTTP/2 names the host in `:authority` (the URI), HTTP/1.1 in `Host`: the upstream gets a
    // `Host` either way (head::check refused requests where the two disagree).
    let original_host = parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|authority| HeaderValue::from_str(authority.as_str()).ok())
    });
    if let Some(host) = &original_host {
        parts.headers.insert(header::HOST, host.clone());
    }
    remove_hop_by_hop(&mut parts.headers);
    if let Some(protocol) = &upgrade {
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, protocol.clone());
    }
    if let Some(peer) = peer {
        append_forwarded_for(&mut parts.headers, peer);
    }
    let scheme = if parts.extensions.get::<OverTls>().is_some() {
        "https"
    } else {
        "http"
    };
    parts
        .headers
        .insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static(scheme));
    if let Some(host) = original_host {
        parts.headers.insert(X_FORWARDED_HOST.clone(), host);
    }
    // HTTP/2 from the client is forwarded as HTTP/1.1 to the upstream.
    parts.version = http::Version::HTTP_11;
    let (body, watch) = ClientBody::new(body, config.server.body_read_timeout);
    let outgoing = Request::from_parts(parts, body);

    let started = Instant::now();
    let result = tokio::time::timeout(
        config.upstream_timeout,
        clients.send(upstream, origin, outgoing),
    )
    .await;
    let elapsed = started.elapsed();
    upstream_metrics().duration.record(elapsed.as_secs_f64());
    let mut response = answered(result, &watch, upstream, &config, client_upgrade, route);
    if config.access_log.is_some() {
        let upstream_status = response
            .extensions()
            .get::<UpstreamAnswered>()
            .map(|answered| answered.0);
        response
            .extensions_mut()
            .insert(crate::access_log::UpstreamFacts {
                status: upstream_status,
                elapsed,
            });
    }
    response
}

/// The status the upstream itself answered (the gateway's own 502 and 504 carry none).
#[derive(Clone, Copy, Debug)]
struct UpstreamAnswered(StatusCode);

/// The client's response from the upstream's answer (or its failure).
fn answered(
    result: Result<
        Result<Response<UpstreamBody>, Box<dyn std::error::Error + Send + Sync>>,
        tokio::time::error::Elapsed,
    >,
    watch: &crate::proxy::client_body::BodyWatch,
    upstream: &Upstream,
    config: &Config,
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
    route: Option<&RouteTarget>,
) -> Response<ProxyBody> {
    if result.as_ref().map_or(true, Result::is_err)
        && let Some(fault) = client_fault(watch, result.is_err())
    {
        return client_fault_response(fault);
    }
    let mut response = match result {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            // hyper-util's error says only "client error (Connect)": the reason (a certificate
            // that does not verify, a refused connection) is in its sources.
            let reason = error_chain(&*error);
            tracing::warn!(upstream = %upstream.authority, error = %reason, "upstream request failed");
            upstream_metrics()
                .status(StatusCode::BAD_GATEWAY)
                .increment(1);
            return error_response(StatusCode::BAD_GATEWAY, "bad_gateway");
        }
        Err(_) => {
            tracing::warn!(upstream = %upstream.authority, timeout = ?config.upstream_timeout, "upstream timed out");
            upstream_metrics()
                .status(StatusCode::GATEWAY_TIMEOUT)
                .increment(1);
            return error_response(StatusCode::GATEWAY_TIMEOUT, "upstream_timeout");
        }
    };
    upstream_metrics().status(response.status()).increment(1);
    let status = response.status();
    response.extensions_mut().insert(UpstreamAnswered(status));

    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade else {
            // An upstream switching protocols on a request that asked for no WebSocket would
            // turn the connection into a tunnel the limiter never sees.
            tracing::warn!(upstream = %upstream.authority, "upstream switched protocols unasked");
            return error_response(StatusCode::BAD_GATEWAY, "bad_gateway");
        };
        let upstream_upgrade = hyper::upgrade::on(&mut response);
        tokio::spawn(async move {
            match tokio::try_join!(client_upgrade, upstream_upgrade) {
                Ok((client_io, upstream_io)) => {
                    let mut client_io = TokioIo::new(client_io);
                    let mut upstream_io = TokioIo::new(upstream_io);
                    let _ = tokio::io::copy_bidirectional(&mut client_io, &mut upstream_io).await;
                }
                Err(error) => tracing::debug!(%error, "upgrade failed"),
            }
        });
        let (parts, body) = response.into_parts();
        return Response::from_parts(parts, Either::Left(body));
    }
    remove_hop_by_hop(response.headers_mut());
    if let Some((name, visible)) = route.and_then(|route| route.cost_header.as_ref()) {
        // The rate limit layer settles what the upstream reports (SPEC §9): in the head, or
        // at the end of a stream, in its trailers.
        let reader = CostHeader::new(name.clone()).visible(*visible);
        let reported = reader.reported_cost(response.headers_mut());
        let streamed = http_body::Body::size_hint(response.body())
            .exact()
            .is_none();
        if reported == ReportedCost::Missing && streamed {
            response
                .extensions_mut()
                .insert(CostInTrailers::new(reader));
        } else {
            response.extensions_mut().insert(reported);
        }
    }
    response.map(Either::Left)
}

impl Service<Request<Incoming>> for Proxy {
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Incoming>) -> Self::Future {
        let (clients, config) = (self.clients.clone(), self.config.clone());
        let Some(shedding) = &self.shedding else {
            return Box::pin(forward_holding(clients, config, request, None));
        };
        // Looked up here only when something sheds (forwarding finds it again by the index
        // the client's resolution kept).
        let route = route_of(&config, &request);
        let upstream = upstream_of_route(&config, route);
        match shedding.admit(upstream, route, &request, trusted_peer(&config, &request)) {
            Admission::Admitted(permit) => {
                Box::pin(forward_holding(clients, config, request, Some(permit)))
            }
            Admission::Shed(shed) => Box::pin(std::future::ready(Ok(shed_answer(&shed, &request)))),
            Admission::Queued(queued) => Box::pin(async move {
                match queued.wait().await {
                    Ok(permit) => forward_holding(clients, config, request, Some(permit)).await,
                    Err(shed) => Ok(shed_answer(&shed, &request)),
                }
            }),
        }
    }
}

/// Forwards `request`, holding the shedding's `permit` (if any) until the upstream answers.
async fn forward_holding(
    clients: UpstreamClients,
    config: Arc<Config>,
    request: Request<Incoming>,
    permit: Option<AdaptivePermit>,
) -> Result<Response<ProxyBody>, Infallible> {
    let response = forward(clients, config, request).await;
    // The upstream's answer, or the gateway's 502 or 504 for it: either is its latency.
    if let Some(permit) = permit {
        permit.answered();
    }
    Ok(response)
}

/// The 503 (or gRPC `UNAVAILABLE`) of a request the shedding refused.
fn shed_answer<B>(shed: &ShedDecision, request: &Request<B>) -> Response<ProxyBody> {
    let grpc = floodgate::adaptive::is_grpc(request.headers());
    shed.response(grpc)
        .map(|body| Either::Right(Full::new(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generation of the calling thread's own pool, if it has one.
    fn cached_generation() -> Option<u64> {
        WORKER_CLIENT.with_borrow(|cached| cached.as_ref().map(|(generation, _)| *generation))
    }

    #[test]
    fn worker_threads_keep_a_pool_per_generation_of_client_settings() {
        let settings = ClientSettings {
            tls: UpstreamTls::default(),
            protocol: UpstreamProtocol::Http1,
        };
        let old = upstream_client(&settings).unwrap();
        let new = upstream_client(&settings).unwrap();
        assert!(new.inner.generation > old.inner.generation);
        std::thread::spawn(move || {
            // Not a worker: the shared pool, nothing cached.
            let _ = old.client();
            assert_eq!(cached_generation(), None);
            use_thread_local_upstream_pool();
            let _ = old.client();
            assert_eq!(cached_generation(), Some(old.inner.generation));
            // New settings (a reload): a new pool for the thread.
            let _ = new.client();
            assert_eq!(cached_generation(), Some(new.inner.generation));
            // A request still under the old version does not evict it.
            let _ = old.client();
            assert_eq!(cached_generation(), Some(new.inner.generation));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn hop_by_hop_headers_and_those_named_by_connection_are_removed() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-private"),
        );
        headers.insert("x-private", HeaderValue::from_static("1"));
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
        headers.insert("x-kept", HeaderValue::from_static("1"));
        remove_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key("x-kept"));
    }

    #[test]
    fn upgrade_requests_are_recognised() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert_eq!(
            upgrade_protocol(&headers),
            Some(HeaderValue::from_static("websocket"))
        );
        headers.remove(header::CONNECTION);
        assert_eq!(upgrade_protocol(&headers), None);
    }
}
