//! The domain directory in service, and its hot reload: a change to any file (or a Kubernetes
//! ConfigMap's `..data` swap) re-reads the whole directory; a directory with a bad file keeps
//! the rules in service, and says so in the log and in `floodgate_rls_reloads_total{result}`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use notify::{Event, EventKind, RecursiveMode, Watcher};
use tokio::time::timeout;

use super::rules::{Rules, load_dir};
use crate::config::ConfigErrors;

use crate::telemetry::RLS_RELOADS_TOTAL;

/// A burst of changes is over once the directory has been quiet this long.
const SETTLE: Duration = Duration::from_millis(100);

/// The rules in service and where they come from.
pub(crate) struct RulesHandle {
    directory: PathBuf,
    /// `rls.merge_domains` (read at start, as the directory is).
    merge_domains: bool,
    current: ArcSwap<Rules>,
    /// The directory's files and texts as the last reload read them, applied or rejected: an
    /// unchanged directory is neither reloaded nor logged.
    last_seen: Mutex<Vec<(String, String)>>,
}

/// The `*.yaml` / `*.yml` files of `directory` with their text, in name order.
fn snapshot(directory: &Path) -> Vec<(String, String)> {
    let Ok(entries) = std::fs::read_dir(directory) else {
        return Vec::new();
    };
    let mut files: Vec<(String, String)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter(|name| {
            !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"))
        })
        .map(|name| {
            let text = std::fs::read_to_string(directory.join(&name)).unwrap_or_default();
            (name, text)
        })
        .collect();
    files.sort();
    files
}

impl RulesHandle {
    /// Reads `directory`; an error in any file is an error here (`serve` refuses to start).
    /// `merge_domains`: as `rls.merge_domains`.
    pub(crate) fn load(
        directory: &Path,
        merge_domains: bool,
    ) -> Result<Arc<RulesHandle>, ConfigErrors> {
        let seen = snapshot(directory);
        let rules = load_dir(directory, merge_domains).map_err(ConfigErrors)?;
        Ok(Arc::new(RulesHandle {
            directory: directory.to_owned(),
            merge_domains,
            current: ArcSwap::from_pointee(rules),
            last_seen: Mutex::new(seen),
        }))
    }

    /// The rules in service.
    pub(crate) fn current(&self) -> Arc<Rules> {
        self.current.load_full()
    }

    /// Re-reads the directory if it changed (or always, with `force`), and swaps the new rules
    /// in if every file is valid. `Ok(false)`: nothing changed.
    pub(crate) fn reload(&self, force: bool) -> Result<bool, ConfigErrors> {
        let mut last_seen = self
            .last_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let seen = snapshot(&self.directory);
        if !force && *last_seen == seen {
            return Ok(false);
        }
        *last_seen = seen;
        let result = load_dir(&self.directory, self.merge_domains).map_err(ConfigErrors);
        let directory = self.directory.display().to_string();
        match &result {
            Ok(rules) => {
                tracing::info!(
                    directory,
                    domains = rules.domain_count(),
                    "rls: domain rules applied"
                );
                metrics::counter!(RLS_RELOADS_TOTAL, "result" => "success").increment(1);
            }
            Err(errors) => {
                tracing::error!(directory, error = %errors, "rls: domain rules rejected; previous rules stay active");
                metrics::counter!(RLS_RELOADS_TOTAL, "result" => "failure").increment(1);
            }
        }
        let rules = result?;
        self.current.store(Arc::new(rules));
        Ok(true)
    }

    /// Reloads after every burst of changes in the directory and on every SIGHUP; returns the
    /// watcher, which must be kept alive.
    pub(crate) fn watch(self: &Arc<Self>) -> notify::Result<notify::RecommendedWatcher> {
        let (events, mut changes) = tokio::sync::mpsc::unbounded_channel::<()>();
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<Event>| {
            // Reads are not changes (the reload's own reads would loop).
            if event.is_ok_and(|event| !matches!(event.kind, EventKind::Access(_))) {
                let _ = events.send(());
            }
        })?;
        watcher.watch(&self.directory, RecursiveMode::NonRecursive)?;
        let handle = self.clone();
        tokio::spawn(async move {
            while changes.recv().await.is_some() {
                // Quiet for SETTLE: the writer is done.
                loop {
                    match timeout(SETTLE, changes.recv()).await {
                        Ok(Some(())) => continue,
                        Ok(None) => return,
                        Err(_elapsed) => break,
                    }
                }
                let handle = handle.clone();
                let _ = tokio::task::spawn_blocking(move || handle.reload(false)).await;
            }
        });
        if let Ok(mut hangups) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        {
            let handle = self.clone();
            tokio::spawn(async move {
                while hangups.recv().await.is_some() {
                    let handle = handle.clone();
                    let _ = tokio::task::spawn_blocking(move || handle.reload(true)).await;
                }
            });
        }
        Ok(watcher)
    }
}
