//! Reload triggers: the configuration file's directory (editors' atomic renames and Kubernetes
//! ConfigMap symlink swaps replace the file, so the file itself cannot be watched), and SIGHUP.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

use crate::runtime::Gateway;

/// Events closer together than this are one change (editors write in several steps).
const SETTLE: Duration = Duration::from_millis(100);

/// Watches the directory of `config_path`; returns the watcher, which must be kept alive.
pub fn watch_config(
    gateway: Arc<Gateway>,
    config_path: &Path,
) -> notify::Result<notify::RecommendedWatcher> {
    let directory = config_path
        .parent()
        .filter(|parent| !parent.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_owned();
    let (events, mut receiver) = tokio::sync::mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok() {
            let _ = events.send(());
        }
    })?;
    watcher.watch(&directory, RecursiveMode::NonRecursive)?;
    tokio::spawn(async move {
        while receiver.recv().await.is_some() {
            // Let the writer finish, and fold the burst of events into one reload.
            tokio::time::sleep(SETTLE).await;
            while receiver.try_recv().is_ok() {}
            let gateway = gateway.clone();
            let _ = tokio::task::spawn_blocking(move || gateway.reload(true)).await;
        }
    });
    Ok(watcher)
}

/// Reloads on every SIGHUP.
pub fn reload_on_sighup(gateway: Arc<Gateway>) -> std::io::Result<()> {
    let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading the configuration");
            let gateway = gateway.clone();
            let _ = tokio::task::spawn_blocking(move || gateway.reload(false)).await;
        }
    });
    Ok(())
}
