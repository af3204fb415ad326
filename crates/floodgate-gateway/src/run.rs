//! `floodgate serve`: starts the gateway from its configuration file (the proxy's
//! listeners, the admin API, the rate limit service, the watches and periodic tasks) and runs it
//! until `SIGTERM` or `SIGINT` (SPEC §6).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use crate::admin::{self, AdminState};
use crate::config::{self, Workers};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::rlqs::QuotaService;
use crate::rls::{self, RulesHandle};
use crate::serve::{self, config_watch};
use crate::tls::ReloadingCertificate;

/// How often the listener's certificate files are checked for a change.
const CERTIFICATE_POLL_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// SIGTERM and SIGINT, listened for from the moment this is made: made before "floodgate
/// serving" is logged, so that a signal arriving before the serving loop awaits it is kept and
/// ends the gateway gracefully, rather than taking its default action (ending the process
/// mid-request; per_core workers take a moment to start).
struct ShutdownSignals {
    terminate: Option<tokio::signal::unix::Signal>,
    interrupt: Option<tokio::signal::unix::Signal>,
}

impl ShutdownSignals {
    fn install() -> ShutdownSignals {
        use tokio::signal::unix::{SignalKind, signal};
        let listen = |kind: SignalKind, name: &str| match signal(kind) {
            Ok(signal) => Some(signal),
            Err(error) => {
                tracing::error!(%error, "cannot listen for {name}");
                None
            }
        };
        ShutdownSignals {
            terminate: listen(SignalKind::terminate(), "SIGTERM"),
            interrupt: listen(SignalKind::interrupt(), "SIGINT"),
        }
    }

    /// Resolves at the first SIGTERM or SIGINT (never, for one that could not be listened for).
    async fn received(mut self) {
        async fn next(signal: &mut Option<tokio::signal::unix::Signal>) {
            match signal {
                Some(signal) => {
                    signal.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            () = next(&mut self.terminate) => tracing::info!("SIGTERM received"),
            () = next(&mut self.interrupt) => tracing::info!("SIGINT received"),
        }
    }
}

/// Installs the Prometheus recorder, with its upkeep every 5 s.
fn install_metrics() -> Result<metrics_exporter_prometheus::PrometheusHandle, GatewayError> {
    // Buckets make the latencies Prometheus histograms (the exporter's default is a summary).
    let latency_buckets = [
        0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
        2.5, 5.0, 10.0,
    ];
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(&latency_buckets)
        .map_err(|error| GatewayError::Metrics(error.to_string()))?
        .install_recorder()
        .map_err(|error| GatewayError::Metrics(error.to_string()))?;
    crate::telemetry::describe_all();
    // The recorder keeps histogram samples until upkeep folds them in: without it, memory and
    // the cost of every record grow with the traffic.
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            ticks.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(metrics)
}

/// The TLS acceptor of `listen_tls`, its certificate reloaded when its files change.
fn listen_tls(
    files: Option<&config::ListenTls>,
) -> Result<Option<tokio_rustls::TlsAcceptor>, GatewayError> {
    Ok(match files {
        Some(files) => {
            let listen_tls = |source| GatewayError::Tls {
                context: "listen_tls",
                source: Box::new(source),
            };
            let certificate = ReloadingCertificate::load(files.cert.clone(), files.key.clone())
                .map_err(listen_tls)?;
            let server_config = certificate.server_config().map_err(listen_tls)?;
            certificate.watch(CERTIFICATE_POLL_INTERVAL);
            Some(tokio_rustls::TlsAcceptor::from(Arc::new(server_config)))
        }
        None => None,
    })
}

/// The rate limit service in service: its rules' watcher, its task, and the quota service
/// when configured.
struct RlsRunning {
    _watcher: notify::RecommendedWatcher,
    serving: tokio::task::JoinHandle<()>,
    /// Asks the gRPC server to stop gracefully.
    stop: tokio::sync::oneshot::Sender<()>,
    quota: Option<Arc<QuotaService>>,
}

impl RlsRunning {
    /// Stops the service: the quota streams first (each Envoy told its assignments end), then
    /// the gRPC server, gracefully (what the streams said is written before their connections
    /// close), each within its bound.
    async fn stop(self) {
        if let Some(quota) = &self.quota {
            quota.shut_down(QUOTA_SHUTDOWN).await;
        }
        let _ = self.stop.send(());
        let mut serving = self.serving;
        if tokio::time::timeout(RLS_DRAIN, &mut serving).await.is_err() {
            serving.abort();
        }
    }
}

/// How long a graceful stop waits for the quota service's Envoys to be told their
/// assignments end.
const QUOTA_SHUTDOWN: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a graceful stop waits for the rate limit service's calls under way, and the
/// quota streams' last answers, to be written.
const RLS_DRAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// Loads the rate limit service's rules, watches their directory and serves it (and the quota
/// service, when configured).
async fn start_rls(
    path: &std::path::Path,
    settings: &config::RlsSettings,
    gateway: &Arc<Gateway>,
) -> Result<RlsRunning, GatewayError> {
    let directory = settings.directory(path);
    let rules = RulesHandle::load(&directory, settings.merge_domains).map_err(|errors| {
        GatewayError::RlsRules {
            directory: directory.clone(),
            errors,
        }
    })?;
    let watcher = rules.watch().map_err(|error| GatewayError::Watch {
        path: directory.clone(),
        reason: error.to_string(),
    })?;
    let listener = bind(settings.listen).await?;
    let http_listener = match settings.http_listen {
        Some(address) => Some(bind(address).await?),
        None => None,
    };
    let quota = match &settings.quota {
        Some(_) => {
            let store = &gateway.current().config.store;
            let board = crate::stores::quota_board(store).map_err(GatewayError::Store)?;
            Some(Arc::new(QuotaService::new(gateway.clone(), board)))
        }
        None => None,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(rls::serve(
        listener,
        http_listener,
        gateway.clone(),
        rules,
        settings.clone(),
        quota.clone(),
        async move {
            // A sender dropped (the service going without a graceful stop) stops it too.
            let _ = stopped.await;
        },
    ));
    tracing::info!(listen = %settings.listen, http_listen = ?settings.http_listen, directory = %directory.display(), quota = quota.is_some(), "rls: serving Envoy's rate limit service");
    Ok(RlsRunning {
        _watcher: watcher,
        serving,
        stop,
        quota,
    })
}

/// The gateway's periodic tasks: the 429-rate baseline, the status page's samples and the
/// demotion of hot identities that went quiet.
fn spawn_periodic_tasks(gateway: &Arc<Gateway>) {
    // The 429-rate baseline: one interval every 10 s.
    let baseline = gateway.observers.baseline.clone();
    let board = gateway.observers.status.clone();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(std::time::Duration::from_secs(10));
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let interval = baseline.tick();
            board.record_anomaly(interval.anomaly);
            if interval.anomaly {
                tracing::warn!(
                    limited_ratio = interval.ratio,
                    decisions = interval.decisions,
                    "429 rate is more than 2σ from its trailing baseline"
                );
            }
        }
    });
    // The status page's decision rates and adaptive limits: one sample a second. Hot identities that went quiet
    // are demoted on the same tick (recording demotes them only where traffic still flows).
    let board = gateway.observers.status.clone();
    let sweeping = gateway.clone();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            ticks.tick().await;
            board.sample();
            let shedding = sweeping.current().shedding.clone();
            board.sample_adaptive(
                shedding
                    .map(|shedding| shedding.snapshots())
                    .unwrap_or_default(),
            );
            if let Some(hot) = sweeping.current().hot_identities() {
                for identity in hot.sweep() {
                    tracing::info!(identity, "hot identity went quiet: decided exactly again");
                }
            }
        }
    });
}

/// Runs the gateway configured by the file at `path` until it is told to stop.
pub async fn serve(path: PathBuf) -> Result<(), GatewayError> {
    let metrics = install_metrics()?;
    let gateway = Gateway::start(&path)?;
    let config = gateway.current().config.clone();
    let token = admin::token_from_env();
    for warning in config.warnings(token.is_some()) {
        tracing::warn!("{warning}");
    }
    if !config.admin_listen.ip().is_loopback() && token.is_none() {
        return Err(GatewayError::AdminUnprotected(config.admin_listen));
    }
    let tls = listen_tls(config.listen_tls.as_ref())?;
    let rls = match &config.rls {
        Some(settings) => Some(start_rls(&path, settings, &gateway).await?),
        None => None,
    };
    let listener = match config.server.workers {
        // RLS only: nothing to proxy, and `listen` stays free.
        _ if !config.serves_proxy => Listener::None,
        Workers::MultiThread => Listener::Shared(bind(config.listen).await?),
        Workers::PerCore => {
            Listener::PerCore(bind_reuseport(config.listen, config.server.worker_threads()).await?)
        }
    };
    let admin_listener = bind(config.admin_listen).await?;
    let _watcher = config_watch::watch_config(gateway.clone(), &path).map_err(|error| {
        GatewayError::Watch {
            path: path.clone(),
            reason: error.to_string(),
        }
    })?;
    config_watch::reload_on_sighup(gateway.clone()).map_err(GatewayError::Signal)?;
    config_watch::reopen_access_log_on_sigusr1(gateway.clone()).map_err(GatewayError::Signal)?;
    // A change written between the first read and the watch would otherwise go unseen.
    let catch_up = gateway.clone();
    let _ = tokio::task::spawn_blocking(move || catch_up.reload(true)).await;
    gateway.check_store_at_start().await;
    let shutdown = ShutdownSignals::install();
    if config.serves_proxy {
        tracing::info!(listen = %config.listen, admin = %config.admin_listen, tls = tls.is_some(), "floodgate serving");
    } else {
        tracing::info!(admin = %config.admin_listen, "floodgate serving the rate limit service only (no upstream: the proxy's listen is not bound)");
    }

    spawn_periodic_tasks(&gateway);
    let admin_router = admin::router(AdminState {
        gateway: gateway.clone(),
        metrics,
        token: token.map(Arc::from),
        quota: rls.as_ref().and_then(|rls| rls.quota.clone()),
    });
    let admin = tokio::spawn(async move {
        // The peer address names the caller in the log of a reset.
        let service = admin_router.into_make_service_with_connect_info::<std::net::SocketAddr>();
        if let Err(error) = axum::serve(serve::nodelay_listener(admin_listener), service).await {
            tracing::error!(%error, "admin server failed");
        }
    });
    let served = match listener {
        Listener::Shared(listener) => {
            serve::serve(listener, gateway, tls, shutdown.received()).await;
            Ok(())
        }
        Listener::PerCore(listeners) => {
            serve::serve_per_core(listeners, gateway, tls, shutdown.received())
                .await
                .map_err(GatewayError::Workers)
        }
        Listener::None => {
            shutdown.received().await;
            serve::flush_store(&gateway).await;
            Ok(())
        }
    };
    admin.abort();
    if let Some(rls) = rls {
        rls.stop().await;
    }
    served?;
    tracing::info!("stopped");
    Ok(())
}

/// The proxy's listening sockets, as `server.workers` asks (none in an RLS-only deployment).
enum Listener {
    /// One listener for the multi-threaded runtime.
    Shared(tokio::net::TcpListener),
    /// One `SO_REUSEPORT` listener per worker, detached from the main runtime.
    PerCore(Vec<std::net::TcpListener>),
    /// RLS only: no proxy.
    None,
}

/// `count` listeners on `addr`, all with `SO_REUSEPORT` so that the kernel spreads new
/// connections over them. Each is detached from the calling runtime, for a worker's runtime
/// to adopt. A port already taken (without `SO_REUSEPORT`) fails like [`bind`].
async fn bind_reuseport(
    addr: SocketAddr,
    count: usize,
) -> Result<Vec<std::net::TcpListener>, GatewayError> {
    let mut listeners = Vec::with_capacity(count);
    // Port 0: the others join the port the first one got.
    let mut address = addr;
    for _ in 0..count {
        let listener = (|| {
            let socket = if address.is_ipv4() {
                tokio::net::TcpSocket::new_v4()?
            } else {
                tokio::net::TcpSocket::new_v6()?
            };
            // As tokio's TcpListener::bind does.
            socket.set_reuseaddr(true)?;
            socket.set_reuseport(true)?;
            socket.bind(address)?;
            let listener = socket.listen(LISTEN_BACKLOG)?;
            address = listener.local_addr()?;
            listener.into_std()
        })()
        .map_err(|source| GatewayError::Bind {
            address: addr,
            source,
        })?;
        listeners.push(listener);
    }
    Ok(listeners)
}

/// The accept backlog of each `per_core` listener (what `TcpListener::bind` uses).
const LISTEN_BACKLOG: u32 = 1024;

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, GatewayError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| GatewayError::Bind {
            address: addr,
            source,
        })
}
