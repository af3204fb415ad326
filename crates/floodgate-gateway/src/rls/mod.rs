//! floodgate as Envoy's rate limit service (SPEC §10): `envoy.service.ratelimit.v3.
//! RateLimitService/ShouldRateLimit` over gRPC (h2c), deciding on the gateway's store under its
//! failure policy, with rules from a directory of envoyproxy/ratelimit-format domain files.
//!
//! - [`rules`]: the domain file format and the descriptor tree a request walks.
//! - [`reload`]: the directory in service and its hot reload.
//! - [`decide`]: a request's descriptors planned, decided and answered in floodgate's own
//!   terms, whatever protocol asked.
//! - [`service`]: `ShouldRateLimit` itself, Envoy's messages converted at the edge.
//! - [`json`] and [`http`]: envoyproxy/ratelimit's `POST /json` on `rls.http_listen`, the same
//!   decision in the peer's JSON form.
//! - [`limit_overrides`]: the limits of Envoy's `limit` overrides, least recently used evicted.
//! - [`batched_writes`]: answers that are ready together leave in one write.

pub(crate) mod batched_writes;
pub(crate) mod decide;
pub(crate) mod http;
pub(crate) mod json;
pub(crate) mod limit_overrides;
pub(crate) mod reload;
pub(crate) mod rules;
pub(crate) mod service;

pub(crate) use reload::RulesHandle;
pub(crate) use service::RlsService;

use std::sync::Arc;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;

use crate::config::RlsSettings;
use crate::gateway::Gateway;
use crate::rlqs::QuotaService;

/// Serves the rate limit service on `listener` (gRPC) and, when given, `http_listener`
/// (`POST /json`), both deciding through one [`RlsService`], until the task is dropped or
/// `stop` completes; and the quota service (`quota`, when configured) on the same gRPC
/// listener. The domain rules must have been loaded (and their watcher started) by the caller.
/// On `stop` the gRPC server takes no new connection and ends when the calls and streams under
/// way have ended, their last answers written: the quota streams' TTL-0 assignments reach
/// their Envoys before the connection closes.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    http_listener: Option<tokio::net::TcpListener>,
    gateway: Arc<Gateway>,
    rules: Arc<RulesHandle>,
    settings: RlsSettings,
    quota: Option<Arc<QuotaService>>,
    stop: impl std::future::Future<Output = ()>,
) {
    let service = Arc::new(RlsService::new(gateway, rules, settings.response_headers));
    // Dropped (and so stopped) with this task.
    let _http = http_listener
        .map(|listener| AbortOnDrop(tokio::spawn(http::serve(listener, service.clone()))));
    // TCP_NODELAY, as on the proxy's connections: without it, a caller that pings when data
    // arrives (grpc-go's BDP estimator) gets a PING ACK it acknowledges late (delayed ACK),
    // and Nagle's algorithm holds the answer written after it until then, about 40 ms.
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    // Answers that are ready together (decisions coalesced into one Redis call, denials from
    // the deny cache) leave in one write, held while other calls are under way.
    let calls = batched_writes::CallsInFlight::default();
    let counted =
        batched_writes::Counted::new(RateLimitServiceServer::from_arc(service), calls.clone());
    let incoming = tonic::codegen::tokio_stream::StreamExt::map(incoming, move |accepted| {
        accepted.map(|connection| batched_writes::BatchedWrites::new(connection, calls.clone()))
    });
    // gRPC health (`grpc.health.v1.Health`): the server as a whole and each service served.
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<RateLimitServiceServer<RlsService>>()
        .await;
    if quota.is_some() {
        health
            .set_serving::<RateLimitQuotaServiceServer<QuotaService>>()
            .await;
    }
    // HTTP/2 keepalive: a quota stream whose Envoy vanished (a crash, a partition) ends
    // within 40 s instead of at the TCP retransmission timeout, and its shares with it.
    let served = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
        .add_service(counted)
        .add_service(health_service)
        .add_optional_service(quota.map(RateLimitQuotaServiceServer::from_arc))
        .serve_with_incoming_shutdown(incoming, stop)
        .await;
    if let Err(error) = served {
        tracing::error!(%error, "rls: the rate limit service failed");
    }
}

/// A task aborted when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
