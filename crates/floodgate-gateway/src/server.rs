//! Accepting connections: HTTP/1.1 and HTTP/2 with upgrades, the peer address as a request
//! extension, and graceful shutdown (stop accepting, let in-flight requests finish).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use floodgate::PeerAddr;
use hyper::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::runtime::{Gateway, handle};

/// How long in-flight requests may take to finish after a shutdown signal.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves the gateway on `listener` until `shutdown` resolves, then drains.
pub async fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
    let builder = auto::Builder::new(TokioExecutor::new());
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let gateway = gateway.clone();
                let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
                    request.extensions_mut().insert(PeerAddr(peer));
                    handle(gateway.clone(), request)
                });
                let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                let connection = graceful.watch(connection.into_owned());
                tokio::spawn(async move {
                    if let Err(error) = connection.await {
                        tracing::debug!(%error, "connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!("shutting down: no new connections; finishing in-flight requests");
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("some connections did not finish within {DRAIN_TIMEOUT:?}");
    }
    // Batched mode: the last interval's counts go to the shared store before the process ends.
    if let Err(error) = gateway.store().flush().await {
        tracing::warn!(%error, "could not flush batched counts on shutdown");
    }
}
