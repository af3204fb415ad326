//! The running gateway: the configuration version in service, and the swap to the next (SPEC §5
//! hot reload); the access log; the entry point of every proxied request.
//!
//! A reload builds all of a new version first and then puts it in service in one `arc-swap`
//! store, so that a version that cannot be built changes nothing. The store and the client pass
//! from version to version as long as their settings do not change, so counters survive a
//! reload; requests in flight keep the version they started with, since they hold an `Arc` to
//! it.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::{ArcSwap, ArcSwapOption};
use floodgate::Store;
use http::{Request, Response};
use hyper::body::Incoming;

use crate::access_log::{AccessLog, LoggedBody, PendingLine, RequestLine};
use crate::config::{self, Config};
use crate::error::GatewayError;
use crate::proxy::shedding::carried_over;
use crate::proxy::{ClientSettings, upstream_client};
use crate::status::Observers;
use crate::stores::{build_store, builds_the_same_store};
use crate::version::{ConfigVersion, GatewayBody};

/// The running gateway: the current version and how to replace it.
pub(crate) struct Gateway {
    /// Top clients and the 429 baseline.
    pub observers: Observers,
    current: ArcSwap<ConfigVersion>,
    /// The access log (`access_log`), replaced when a reload changes its settings.
    access_log: ArcSwapOption<AccessLog>,
    config_path: PathBuf,
    /// What the last reload read, applied or rejected: the watcher acts (and logs, and
    /// counts) only when the file, or the key file it names, says something else. Held
    /// through a reload, so that reloads from the watcher, SIGHUP and the admin API take
    /// turns.
    last_seen: Mutex<Inputs>,
}

/// What a configuration version is read from: the file's text, and the key file
/// `identity.jwt` names (its bytes; `None` without one, or when it cannot be read).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Inputs {
    text: String,
    keys: Option<Vec<u8>>,
}

impl Inputs {
    /// `text`, with the bytes of `key_file`.
    fn read(text: String, key_file: Option<&Path>) -> Inputs {
        Inputs {
            text,
            keys: key_file.and_then(|path| std::fs::read(path).ok()),
        }
    }
}

/// What the configuration file holds now, compared with what the last reload read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FileState {
    /// The same text (or the file cannot be read): nothing to do.
    Unchanged,
    /// New text that cannot be put in service: empty, or not a valid configuration (perhaps a
    /// writer still at work).
    Incomplete,
    /// New text that parses.
    Ready,
}

/// Whether `text` holds nothing but blank lines and comments. Never a valid replacement: it is
/// what a truncating writer leaves for a moment, and would drop every plan and the upstream.
fn is_empty(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .all(|line| line.is_empty() || line.starts_with('#'))
}

impl Gateway {
    /// Loads `config_path` and builds the first version.
    pub(crate) fn start(config_path: &Path) -> Result<Arc<Gateway>, GatewayError> {
        let text = read_config(config_path)?;
        let config = Arc::new(config::parse_in(&text, config::directory_of(config_path))?);
        let store = build_store(&config.store)?;
        let client_settings = ClientSettings::of(&config);
        let client = upstream_client(&client_settings)?;
        let observers = Observers::default();
        let access_log = open_access_log(&config)?;
        let inputs = Inputs::read(text, config.identity.key_file.as_deref());
        let shedding = carried_over(None, config.adaptive.as_ref());
        let client = (client_settings, client);
        let first = ConfigVersion::build(1, config, store, client, shedding, &observers)?;
        metrics::gauge!(crate::telemetry::CONFIG_VERSION).set(1.0);
        Ok(Arc::new(Gateway {
            observers,
            current: ArcSwap::from_pointee(first),
            access_log: ArcSwapOption::new(access_log),
            config_path: config_path.to_owned(),
            last_seen: Mutex::new(inputs),
        }))
    }

    /// Writes the access log's last lines and closes it (on shutdown).
    pub(crate) fn close_access_log(&self) {
        if let Some(log) = self.access_log.swap(None) {
            log.close();
        }
    }

    /// Reopens the access log's file before its next line (`SIGUSR1`, after logrotate).
    pub(crate) fn reopen_access_log(&self) {
        if let Some(log) = &*self.access_log.load() {
            log.reopen();
        }
    }

    /// The version in service.
    pub(crate) fn current(&self) -> Arc<ConfigVersion> {
        self.current.load_full()
    }

    /// Asks the store in service whether it answers, once at start, and says so loudly if not:
    /// a store that refuses the gateway (a wrong password) or cannot be reached is logged at
    /// ERROR with the reason. The gateway still starts; requests follow `on_store_error`.
    ///
    /// The regions' global store is looked at beside the serving gateway, not before it: no
    /// request waits on the global store (SPEC §5), not even the first one.
    pub(crate) async fn check_store_at_start(&self) {
        if let Some(region) = self.current().region().cloned() {
            tokio::spawn(warn_of_an_evicting_global_store(region));
        }
        let store = self.store();
        match store.probe().await {
            Ok(()) => {
                tracing::debug!(backend = store.backend(), "the store answers");
                self.warn_of_quotas_lost_on_restart(&*store).await;
            }
            Err(error) => tracing::error!(
                backend = store.backend(),
                %error,
                policy = self.current().config.on_store_error.as_str(),
                "store check at start failed: requests follow on_store_error until it answers"
            ),
        }
    }

    /// Warns when limits of a day or longer are kept in a shared store that forgets them
    /// when it restarts (a Redis without persistence): each restart would give every client
    /// its daily or monthly quota again. Silent when the store cannot tell, and for the
    /// memory store, whose counters are this process's by design (the quickstart's).
    async fn warn_of_quotas_lost_on_restart(&self, store: &dyn Store) {
        let config = &self.current().config;
        if !config.store.backend.is_shared() {
            return;
        }
        let quotas = config.quota_limits();
        if quotas.is_empty() || store.persistence().await != Some(false) {
            return;
        }
        tracing::warn!(
            backend = store.backend(),
            limits = %quotas.join(", "),
            "limits of a day or longer are kept in a store that loses them when it restarts \
             (for Redis: appendonly yes, or save snapshots; see README \"Running Redis for \
             quotas\"): every client would get these again after a restart"
        );
    }

    /// The name of the key file the version in service reads (`identity.jwt`), when it is in
    /// the configuration file's directory: the watcher reloads when it changes.
    pub(crate) fn key_file_beside_config(&self) -> Option<std::ffi::OsString> {
        let key_file = self.current().config.identity.key_file.clone()?;
        (key_file.parent() == self.config_path.parent())
            .then(|| key_file.file_name().map(ToOwned::to_owned))
            .flatten()
    }

    /// The store of the version in service.
    pub(crate) fn store(&self) -> Arc<dyn Store> {
        self.current().store.store.clone()
    }

    /// Re-reads the configuration file and swaps it in if valid. With `only_if_changed` (the
    /// watcher), a file whose text the last reload already read is left alone, silently:
    /// only a reload that read new text (or was asked for) is logged and counted.
    pub(crate) fn reload(&self, only_if_changed: bool) -> Result<u64, GatewayError> {
        let result = match self.try_reload(only_if_changed) {
            Ok(None) => return Ok(self.current().version),
            Ok(Some(version)) => Ok(version),
            Err(error) => Err(error),
        };
        let label = if result.is_ok() { "success" } else { "failure" };
        match &result {
            Ok(version) => {
                tracing::info!(version, path = %self.config_path.display(), "configuration applied")
            }
            Err(error) => {
                tracing::error!(path = %self.config_path.display(), error = %error, "configuration rejected; previous rules stay active");
                self.observers.status.record_reload_error(error.to_string());
            }
        }
        metrics::counter!(crate::telemetry::CONFIG_RELOADS_TOTAL, "result" => label).increment(1);
        result
    }

    /// What the file holds now, for the watcher to decide whether to reload or to wait for a
    /// writer to finish. Reads and parses, changes nothing.
    pub(crate) fn file_state(&self) -> FileState {
        let Ok(text) = std::fs::read_to_string(&self.config_path) else {
            return FileState::Unchanged;
        };
        let inputs = self.inputs(text);
        if *self
            .last_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            == inputs
        {
            FileState::Unchanged
        } else if is_empty(&inputs.text)
            || config::parse_in(&inputs.text, config::directory_of(&self.config_path)).is_err()
        {
            FileState::Incomplete
        } else {
            FileState::Ready
        }
    }

    /// `text` with the key file of the version in service: what the watcher compares.
    fn inputs(&self, text: String) -> Inputs {
        Inputs::read(text, self.current().config.identity.key_file.as_deref())
    }

    /// The new version, or `None` if `only_if_changed` and the file and its key file are
    /// what the last reload read.
    fn try_reload(&self, only_if_changed: bool) -> Result<Option<u64>, GatewayError> {
        let inputs = self.inputs(read_config(&self.config_path)?);
        let mut last_seen = self
            .last_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if only_if_changed && *last_seen == inputs {
            return Ok(None);
        }
        // Held to the end: reloads from the watcher, SIGHUP and the admin API take turns.
        last_seen.clone_from(&inputs);
        let text = inputs.text;
        if is_empty(&text) {
            return Err(GatewayError::Empty {
                path: self.config_path.clone(),
            });
        }
        let config = Arc::new(config::parse_in(
            &text,
            config::directory_of(&self.config_path),
        )?);
        let current = self.current();
        if config.listen != current.config.listen
            || config.admin_listen != current.config.admin_listen
        {
            tracing::warn!("listen and admin.listen changes take effect on restart only");
        }
        // Everything the version needs is built before anything is put in service: a step that
        // fails leaves the version in service, its store and its client as they were.
        let replaced_store = !builds_the_same_store(&current.config.store, &config.store);
        let store = if replaced_store {
            // New store settings: a new store (counters start afresh only then).
            build_store(&config.store)?
        } else {
            current.store.clone()
        };
        let settings = ClientSettings::of(&config);
        let client = if current.client.0 == settings {
            current.client.1.clone()
        } else {
            // New TLS settings or protocol: a new pool (connections in use finish on the old).
            upstream_client(&settings)?
        };
        let version = current.version + 1;
        let access_log = if config.access_log == current.config.access_log {
            self.access_log.load_full()
        } else {
            open_access_log(&config)?
        };
        // The key file this version reads is the one the watcher compares from now on.
        *last_seen = Inputs::read(text, config.identity.key_file.as_deref());
        let shedding = carried_over(current.shedding.as_ref(), config.adaptive.as_ref());
        let client = (settings, client);
        let next = ConfigVersion::build(version, config, store, client, shedding, &self.observers)?;
        self.current.store(Arc::new(next));
        // The replaced log's writer drains its queue and stops once no request holds it.
        self.access_log.store(access_log);
        if replaced_store {
            flush_in_background(current.store.store.clone());
        }
        metrics::gauge!(crate::telemetry::CONFIG_VERSION).set(version as f64);
        Ok(Some(version))
    }
}

/// The access log `config` asks for, opened.
fn open_access_log(config: &Config) -> Result<Option<Arc<AccessLog>>, GatewayError> {
    let Some(settings) = &config.access_log else {
        return Ok(None);
    };
    AccessLog::open(settings)
        .map(|log| Some(Arc::new(log)))
        .map_err(|source| GatewayError::AccessLog {
            path: match &settings.target {
                crate::config::AccessLogTarget::File(path) => path.clone(),
                crate::config::AccessLogTarget::Stdout => PathBuf::from("stdout"),
            },
            source,
        })
}

/// The configuration file's text.
fn read_config(path: &Path) -> Result<String, GatewayError> {
    std::fs::read_to_string(path).map_err(|source| GatewayError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Sends a replaced store's batched counts where they belong. Requests still finishing under the
/// old version after the flush may add a few, delivered by the old store's sync task only while
/// such requests keep it alive: at most the last moments before a reload.
fn flush_in_background(store: Arc<dyn Store>) {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(async move {
            if let Err(error) = store.flush().await {
                tracing::warn!(%error, "could not flush the replaced store's batched counts");
            }
        });
    }
}

/// Serves a request under the version in service when it arrives, and gives it its line in
/// the access log, if there is one.
pub(crate) async fn handle(
    gateway: Arc<Gateway>,
    request: Request<Incoming>,
) -> Result<Response<LoggedBody<GatewayBody>>, Infallible> {
    let current = gateway.current();
    let Some(log) = gateway.access_log.load_full() else {
        return Ok(current
            .handle(request, None)
            .await
            .map(LoggedBody::unlogged));
    };
    // Dropped unanswered with this future when the client goes away: then it writes a 499.
    let mut line = PendingLine::new(log, RequestLine::of(request.method(), request.headers()));
    let response = current.handle(request, Some(line.facts())).await;
    Ok(line.answered(response))
}

/// Warns when the regions' global store may evict any key (`maxmemory-policy allkeys-*`): an
/// evicted record or generation is detected only by settling for a lifetime, during which
/// shares stop following demand (SPEC §5: `noeviction` or `volatile-*`). A policy that cannot
/// be read (`CONFIG` refused, as managed Redis services do, or no answer) is said at INFO.
async fn warn_of_an_evicting_global_store(region: floodgate::store::region::RegionalStore) {
    let global = floodgate::store::redact_url(&region.settings().global_url);
    match region.global_eviction_policy().await {
        Some(policy) if policy.starts_with("allkeys") => tracing::warn!(
            %global,
            policy = %policy,
            "the regions' global store may evict floodgate's keys (maxmemory-policy \
             allkeys-*): set noeviction or a volatile-* policy (SPEC §5)"
        ),
        Some(policy) => {
            tracing::info!(%global, policy = %policy, "the regions' global store keeps floodgate's keys")
        }
        None => tracing::info!(
            %global,
            "the regions' global store's maxmemory-policy could not be read: it should be \
             noeviction or volatile-* (SPEC §5)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_file(rest: &str) -> String {
        format!(
            "listen: \"127.0.0.1:0\"\nadmin:\n  listen: \"127.0.0.1:0\"\nupstream: \"http://127.0.0.1:9\"\n\
             plans:\n  free: {{}}\n  anonymous:\n    limits: [ {{ name: m, algorithm: fixed_window, limit: 5, window: 60s }} ]\n{rest}"
        )
    }

    /// A reload whose last step fails leaves the store, the upstream client and the version in
    /// service as they were. Before, the new store (and client) were put in service first: a
    /// version that then failed to build left requests on the old store while the admin API,
    /// `/readyz`, the RLS service and the shutdown flush used the rejected one's.
    #[tokio::test]
    async fn a_reload_that_fails_to_build_changes_nothing() {
        let directory = std::env::temp_dir().join(format!(
            "floodgate-current-test-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&directory).unwrap();
        let path = directory.join("floodgate.yaml");
        std::fs::write(&path, config_file("")).unwrap();
        let gateway = Gateway::start(&path).unwrap();
        let before = gateway.current();

        // New store settings and a new upstream protocol: a new store and a new client.
        std::fs::write(
            &path,
            config_file(
                "store:\n  backend: redis\n  url: \"redis://127.0.0.1:1\"\nupstream_protocol: http2\n",
            ),
        )
        .unwrap();
        crate::version::FAIL_NEXT_BUILD.with(|fail| fail.set(true));
        assert!(gateway.reload(false).is_err());

        let after = gateway.current();
        assert!(
            Arc::ptr_eq(&before, &after),
            "the version in service is kept"
        );
        assert_eq!(after.version, 1);
        assert!(Arc::ptr_eq(&gateway.store(), &before.store.store));
        assert_eq!(gateway.store().backend(), "memory");
        assert!(after.client.1.is(&before.client.1));

        // The same file, built this time: both are replaced together.
        assert_eq!(gateway.reload(false).unwrap(), 2);
        assert_eq!(gateway.store().backend(), "redis");
        assert_eq!(
            gateway.current().client.0.protocol,
            config::UpstreamProtocol::Http2
        );
        std::fs::remove_dir_all(&directory).unwrap();
    }
}
