//! Accepting connections: HTTP/1.1 and HTTP/2 with upgrades, the peer address as a request
//! extension, the limits of `server.*` on every connection, and graceful shutdown (stop
//! accepting, let in-flight requests finish).
//!
//! A client must not be able to hold the gateway's resources for free: heads have a
//! size cap and a deadline (hyper's for HTTP/1.1 heads; ours for the first request of any
//! connection, which also covers the HTTP/2 preface that hyper-util reads without one);
//! connections on which nothing moves are closed; and the number of connections stays below
//! the open-file limit, so that one client holding idle sockets cannot stop `accept` for
//! everyone (nor make it spin: accept errors back off, and their log line is rate-limited).

pub(crate) mod config_watch;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::serve::{ListenerExt, TapIo};
use floodgate::PeerAddr;
use hyper::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot, watch};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use crate::config::ServerLimits;
use crate::gateway::{Gateway, handle};
use crate::proxy::OverTls;

/// An axum listener (the admin API's, the rate limit service's HTTP one) setting `TCP_NODELAY`
/// on every connection it accepts, as the proxy's and the gRPC listeners do: an answer written in more than one piece
/// (a head, then a body) must not wait for the client's delayed ACK of the first (Nagle's
/// algorithm), about 40 ms on Linux, on every scrape, status page refresh and `/json` answer.
pub(crate) fn nodelay_listener(
    listener: tokio::net::TcpListener,
) -> TapIo<tokio::net::TcpListener, fn(&mut tokio::net::TcpStream)> {
    fn set_nodelay(stream: &mut tokio::net::TcpStream) {
        if let Err(error) = stream.set_nodelay(true) {
            // The connection is still served, only perhaps slower: not worth more than debug.
            tracing::debug!(%error, "could not set TCP_NODELAY on a connection");
        }
    }
    listener.tap_io(set_nodelay as fn(&mut tokio::net::TcpStream))
}

/// How long in-flight requests may take to finish after a shutdown signal.
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest pause of the accept loop after an error (descriptor exhaustion, mostly).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// At most one warning per this interval for the same condition, with a count of the rest.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Serves the gateway on `listener` (over TLS with `tls`) until `shutdown` resolves, then
/// drains (`server.workers: multi_thread`: every connection on the calling runtime).
pub(crate) async fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()>,
) {
    let limits = gateway.current().config.server.clone();
    let permits = connection_permits(&limits, 1);
    let graceful = GracefulShutdown::new();
    accept_loop(
        &listener,
        &gateway,
        &limits,
        tls.as_ref(),
        &permits,
        PermitOrder::BeforeAccept,
        &graceful,
        shutdown,
    )
    .await;
    drop(listener);
    tracing::info!("shutting down: no new connections; finishing in-flight requests");
    drain(graceful).await;
    flush_store(&gateway).await;
}

/// Serves the gateway with one worker per listener (`server.workers: per_core`): each worker
/// is an OS thread running a current-thread runtime that accepts on its own `SO_REUSEPORT`
/// listener (the kernel spreads new connections over them) and serves its connections to the
/// end, upstream calls included, so that a request never crosses threads. The workers share
/// the `server.max_connections` budget; a worker takes its slot after accepting, so that at
/// the limit a freed slot goes to a connection that is waiting, whichever worker has it (each
/// worker holds at most one such connection; the rest wait in the backlogs). When `shutdown`
/// resolves, every worker stops accepting and drains its connections; the store is flushed
/// once all have finished.
///
/// The listeners must be non-blocking (as [`tokio::net::TcpListener::into_std`] leaves them).
/// Fails, stopping the workers already started, when a worker's thread or runtime cannot be
/// made.
pub(crate) async fn serve_per_core(
    listeners: Vec<std::net::TcpListener>,
    gateway: Arc<Gateway>,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let limits = gateway.current().config.server.clone();
    let permits = connection_permits(&limits, listeners.len());
    // `true` (or a dropped sender): stop accepting and drain.
    let (stop, _) = watch::channel(false);
    // `true` (or a dropped sender): the store is flushed; the worker's runtime may end. Until
    // then it keeps driving what its requests started (a store connection opened there, say).
    let (exit, _) = watch::channel(false);
    let mut drained = Vec::with_capacity(listeners.len());
    // Each worker says when it holds its listener: "serving" is logged once all of them do
    // (a thread named at spawn is not yet running, nor named, when `spawn` returns).
    let mut serving = Vec::with_capacity(listeners.len());
    for (index, listener) in listeners.into_iter().enumerate() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (done, done_receiver) = oneshot::channel::<()>();
        let (started, started_receiver) = oneshot::channel::<()>();
        let (gateway, limits, tls, permits) = (
            gateway.clone(),
            limits.clone(),
            tls.clone(),
            permits.clone(),
        );
        let (mut stop, mut exit) = (stop.subscribe(), exit.subscribe());
        std::thread::Builder::new()
            .name(format!("floodgate-worker-{index}"))
            .spawn(move || {
                crate::proxy::use_thread_local_upstream_pool();
                runtime.block_on(async move {
                    let listener = match TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(error) => {
                            tracing::error!(%error, worker = index, "worker cannot use its listener");
                            return;
                        }
                    };
                    let _ = started.send(());
                    let graceful = GracefulShutdown::new();
                    let stopped = async move {
                        let _ = stop.wait_for(|stop| *stop).await;
                    };
                    accept_loop(
                        &listener,
                        &gateway,
                        &limits,
                        tls.as_ref(),
                        &permits,
                        PermitOrder::AfterAccept,
                        &graceful,
                        stopped,
                    )
                    .await;
                    drop(listener);
                    drain(graceful).await;
                    let _ = done.send(());
                    let _ = exit.wait_for(|exit| *exit).await;
                });
                // Tasks still open (upgraded connections, idle pools) end with the process.
                runtime.shutdown_background();
            })?;
        drained.push(done_receiver);
        serving.push(started_receiver);
    }
    let mut workers = 0;
    for started in serving {
        // An error: the worker could not use its listener (it logged why).
        workers += usize::from(started.await.is_ok());
    }
    tracing::info!(workers, "per_core workers serving");
    shutdown.await;
    tracing::info!("shutting down: no new connections; finishing in-flight requests");
    stop.send_replace(true);
    for done in drained {
        // An error: the worker ended without draining (it could not use its listener).
        let _ = done.await;
    }
    flush_store(&gateway).await;
    exit.send_replace(true);
    Ok(())
}

/// The `server.max_connections` budget of every listener together.
fn connection_permits(limits: &ServerLimits, listeners: usize) -> Arc<Semaphore> {
    let max_connections = limits.max_connections();
    tracing::info!(
        max_connections,
        header_read_timeout = ?limits.header_read_timeout,
        idle_timeout = ?limits.idle_timeout,
        max_head_bytes = limits.max_head_bytes,
        workers = limits.workers.as_str(),
        listeners,
        "connection limits"
    );
    Arc::new(Semaphore::new(max_connections))
}

/// Waits up to [`DRAIN_TIMEOUT`] for the connections `graceful` watches to finish.
async fn drain(graceful: GracefulShutdown) {
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("some connections did not finish within {DRAIN_TIMEOUT:?}");
    }
}

/// On shutdown: the batched store gives its leases back and delivers its debts, and the
/// access log writes its last lines, before the process exits.
pub(crate) async fn flush_store(gateway: &Gateway) {
    if let Err(error) = gateway.store().flush().await {
        tracing::warn!(%error, "could not flush batched counts on shutdown");
    }
    // Its writer writes what is queued (one batch at most) and stops.
    gateway.close_access_log();
}

/// When an accept loop takes its slot under `server.max_connections`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PermitOrder {
    /// Before accepting: at the limit, new clients wait in the listen backlog. Right for one
    /// listener; with several, an idle listener's loop would sit on a slot a busy one needs.
    BeforeAccept,
    /// After accepting (`per_core`): a slot goes to a connection that is there. At the limit
    /// each worker holds at most one accepted connection while it waits, the rest wait in the
    /// backlogs.
    AfterAccept,
}

/// An accept loop's slots under `server.max_connections`, and the log of waiting for one.
struct Slots<'p> {
    permits: &'p Arc<Semaphore>,
    max_connections: usize,
    at_capacity: RateLimitedLog,
}

impl Slots<'_> {
    /// A slot, waiting (and saying so) at the limit; `None` when `shutdown` resolves first.
    async fn take(
        &mut self,
        shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> Option<OwnedSemaphorePermit> {
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return Some(permit);
        }
        metrics::counter!(crate::telemetry::CONNECTIONS_AT_LIMIT_TOTAL).increment(1);
        let max_connections = self.max_connections;
        self.at_capacity.warn(|suppressed| {
            tracing::warn!(
                max_connections,
                suppressed,
                "connection limit reached: new connections wait until one closes (server.max_connections)"
            )
        });
        tokio::select! {
            permit = self.permits.clone().acquire_owned() => permit.ok(),
            () = shutdown => None,
        }
    }
}

/// Accepts connections on `listener` and serves each on its own task (watched by `graceful`,
/// holding one of `permits`, taken in `order`) until `shutdown` resolves.
#[allow(clippy::too_many_arguments)]
async fn accept_loop(
    listener: &TcpListener,
    gateway: &Arc<Gateway>,
    limits: &ServerLimits,
    tls: Option<&TlsAcceptor>,
    permits: &Arc<Semaphore>,
    order: PermitOrder,
    graceful: &GracefulShutdown,
    shutdown: impl Future<Output = ()>,
) {
    let mut slots = Slots {
        permits,
        max_connections: limits.max_connections(),
        at_capacity: RateLimitedLog::default(),
    };
    let builder = connection_builder(limits);
    let mut accept_errors = RateLimitedLog::default();
    let mut backoff = Duration::ZERO;
    tokio::pin!(shutdown);
    loop {
        // A free slot first: at the limit, new clients wait in the listen backlog instead of
        // taking descriptors the gateway needs.
        let early = match order {
            PermitOrder::BeforeAccept => match slots.take(shutdown.as_mut()).await {
                Some(permit) => Some(permit),
                None => break,
            },
            PermitOrder::AfterAccept => None,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // EMFILE/ENFILE and the like persist until a descriptor is freed: retrying
                    // at once would spin a core and flood the log.
                    backoff = (backoff * 2).clamp(Duration::from_millis(5), MAX_ACCEPT_BACKOFF);
                    metrics::counter!(crate::telemetry::ACCEPT_ERRORS_TOTAL).increment(1);
                    accept_errors.warn(|suppressed| {
                        tracing::warn!(%error, suppressed, retry_in = ?backoff, "accept failed")
                    });
                    drop(early);
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => continue,
                        () = &mut shutdown => break,
                    }
                }
            },
            () = &mut shutdown => break,
        };
        backoff = Duration::ZERO;
        let permit = match early {
            Some(permit) => permit,
            None => match slots.take(shutdown.as_mut()).await {
                Some(permit) => permit,
                None => break,
            },
        };
        serve_connection(
            &builder, graceful, gateway, limits, tls, stream, peer, permit,
        );
    }
}

/// HTTP/1.1 and HTTP/2 with the head size cap and hyper's head deadline.
fn connection_builder(limits: &ServerLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Each head, including the next one on a keep-alive connection, within the deadline.
        .header_read_timeout(limits.header_read_timeout)
        // The read buffer holds at most this much of an unfinished head: then 431.
        .max_buf_size(limits.max_head_bytes);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_head_bytes).unwrap_or(u32::MAX));
    builder
}

#[allow(clippy::too_many_arguments)]
fn serve_connection(
    builder: &auto::Builder<TokioExecutor>,
    graceful: &GracefulShutdown,
    gateway: &Arc<Gateway>,
    limits: &ServerLimits,
    tls: Option<&TlsAcceptor>,
    stream: TcpStream,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let activity = Arc::new(Activity::new());
    let gateway = gateway.clone();
    let seen = activity.clone();
    let over_tls = tls.is_some();
    let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
        seen.request_arrived();
        request.extensions_mut().insert(PeerAddr(peer));
        if over_tls {
            request.extensions_mut().insert(OverTls);
        }
        handle(gateway.clone(), request)
    });
    let (builder, watcher, limits, tls) = (
        builder.clone(),
        graceful.watcher(),
        limits.clone(),
        tls.cloned(),
    );
    tokio::spawn(async move {
        // Held for the connection's life: its slot under server.max_connections.
        let _permit = permit;
        let Some(tls) = tls else {
            let io = ActivityIo::new(stream, activity.clone());
            let connection = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
            watch_deadlines(watcher.watch(connection), &activity, &limits).await;
            return;
        };
        // The handshake counts against the head deadline, like the preface would.
        let handshake = tokio::time::timeout(
            limits.header_read_timeout,
            tls.accept(ActivityIo::new(stream, activity.clone())),
        );
        let stream = match handshake.await {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => {
                metrics::counter!(crate::telemetry::TLS_HANDSHAKE_FAILURES_TOTAL).increment(1);
                tracing::debug!(%error, %peer, "TLS handshake failed");
                return;
            }
            Err(_) => {
                metrics::counter!(crate::telemetry::CONNECTIONS_CLOSED_TOTAL, "reason" => "header_timeout").increment(1);
                return;
            }
        };
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
        watch_deadlines(watcher.watch(connection), &activity, &limits).await;
    });
}

/// Drives `connection` to its end, or drops it when its first request is late or nothing has
/// moved on it for `idle_timeout`.
async fn watch_deadlines<E: std::fmt::Display>(
    connection: impl Future<Output = Result<(), E>>,
    activity: &Activity,
    limits: &ServerLimits,
) {
    tokio::pin!(connection);
    let mut deadline = activity.started + limits.header_read_timeout;
    loop {
        tokio::select! {
            result = &mut connection => {
                if let Err(error) = result {
                    tracing::debug!(%error, "connection ended with an error");
                }
                return;
            }
            () = tokio::time::sleep_until(deadline) => {
                if !activity.has_seen_request() {
                    metrics::counter!(crate::telemetry::CONNECTIONS_CLOSED_TOTAL, "reason" => "header_timeout").increment(1);
                    return;
                }
                let next = activity.last() + limits.idle_timeout;
                if next <= Instant::now() {
                    metrics::counter!(crate::telemetry::CONNECTIONS_CLOSED_TOTAL, "reason" => "idle_timeout").increment(1);
                    return;
                }
                deadline = next;
            }
        }
    }
}

/// When bytes last moved on a connection, and whether a request has arrived on it.
struct Activity {
    started: Instant,
    /// Milliseconds after `started`.
    last_millis: AtomicU64,
    seen_request: AtomicBool,
}

impl Activity {
    fn new() -> Self {
        Activity {
            started: Instant::now(),
            last_millis: AtomicU64::new(0),
            seen_request: AtomicBool::new(false),
        }
    }

    fn touch(&self) {
        let millis = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_millis.store(millis, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.started + Duration::from_millis(self.last_millis.load(Ordering::Relaxed))
    }

    fn request_arrived(&self) {
        self.seen_request.store(true, Ordering::Relaxed);
    }

    fn has_seen_request(&self) -> bool {
        self.seen_request.load(Ordering::Relaxed)
    }
}

/// A client socket that records when bytes last moved on it, either way.
struct ActivityIo<T> {
    inner: T,
    activity: Arc<Activity>,
}

impl<T> ActivityIo<T> {
    fn new(inner: T, activity: Arc<Activity>) -> Self {
        ActivityIo { inner, activity }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ActivityIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        result
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ActivityIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(result, Poll::Ready(Ok(written)) if written > 0) {
            self.activity.touch();
        }
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, data);
        if matches!(result, Poll::Ready(Ok(written)) if written > 0) {
            self.activity.touch();
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A warning logged at most once per [`LOG_INTERVAL`], saying how many were held back.
#[derive(Default)]
struct RateLimitedLog {
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    fn warn(&mut self, log: impl FnOnce(u64)) {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < LOG_INTERVAL)
        {
            self.suppressed += 1;
            return;
        }
        log(self.suppressed);
        self.last = Some(now);
        self.suppressed = 0;
    }
}
