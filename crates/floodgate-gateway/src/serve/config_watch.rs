//! Reload triggers: the configuration file's directory (editors' atomic renames and Kubernetes
//! ConfigMap symlink swaps replace the file, so the file itself cannot be watched), and SIGHUP.

use std::ffi::OsString;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode, ModifyKind};
use notify::{Event, EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, timeout};

use crate::gateway::{FileState, Gateway};

/// A change is over once its file has been quiet this long (editors write in several steps).
const SETTLE: Duration = Duration::from_millis(100);

/// How long a file written in place that is empty or invalid is given to be completed by its
/// writer before it is reported (and rejected).
const INCOMPLETE_GRACE: Duration = Duration::from_millis(500);

/// How a change was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    /// The file was written where it is: it may be read half-written.
    InPlace,
    /// The file (or the ConfigMap's `..data` link) was replaced, created or removed.
    Replaced,
}

/// Whether `event` changes the configuration file: a create, write, remove or rename of the file
/// itself, of the key file it names (`key_file`, in its directory) or of Kubernetes' `..data`
/// link. Reads (the reload's own `open` of the file), metadata and other files in the
/// directory are not changes.
fn change(event: &Event, file_name: &OsString, key_file: Option<&OsString>) -> Option<Change> {
    let concerns_the_file = event.paths.iter().any(|path| {
        path.file_name().is_some_and(|name| {
            name == file_name.as_os_str()
                || name == "..data"
                || Some(name) == key_file.map(OsString::as_os_str)
        })
    });
    if !concerns_the_file {
        return None;
    }
    match event.kind {
        EventKind::Modify(ModifyKind::Data(_))
        | EventKind::Access(AccessKind::Close(AccessMode::Write)) => Some(Change::InPlace),
        EventKind::Create(_)
        | EventKind::Remove(_)
        | EventKind::Modify(ModifyKind::Name(_) | ModifyKind::Any | ModifyKind::Other) => {
            Some(Change::Replaced)
        }
        _ => None,
    }
}

/// Watches the directory of `config_path`; returns the watcher, which must be kept alive.
pub(crate) fn watch_config(
    gateway: Arc<Gateway>,
    config_path: &Path,
) -> notify::Result<notify::RecommendedWatcher> {
    let directory = config_path
        .parent()
        .filter(|parent| !parent.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_owned();
    let file_name = config_path
        .file_name()
        .map(ToOwned::to_owned)
        .unwrap_or_default();
    let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
    let versions = gateway.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<Event>| {
        // The key file of the version in service: a reload may name another.
        let key_file = versions.key_file_beside_config();
        if let Some(change) = event
            .ok()
            .and_then(|event| change(&event, &file_name, key_file.as_ref()))
        {
            let _ = events.send(change);
        }
    })?;
    watcher.watch(&directory, RecursiveMode::NonRecursive)?;
    tokio::spawn(reload_on_changes(gateway, receiver));
    Ok(watcher)
}

/// Folds each burst of changes into one reload, once the file has been quiet for [`SETTLE`]. A
/// file written in place that is empty or does not parse may be a writer's work in progress:
/// it is given [`INCOMPLETE_GRACE`] to change again before it is reloaded (and rejected).
async fn reload_on_changes(gateway: Arc<Gateway>, mut changes: UnboundedReceiver<Change>) {
    while let Some(first) = changes.recv().await {
        let mut in_place = first == Change::InPlace;
        let mut incomplete_since: Option<Instant> = None;
        loop {
            // Quiet for SETTLE: the writer is done, or paused.
            match timeout(SETTLE, changes.recv()).await {
                Ok(Some(change)) => {
                    in_place |= change == Change::InPlace;
                    continue;
                }
                Ok(None) => return,
                Err(_elapsed) => {}
            }
            let state = {
                let gateway = gateway.clone();
                tokio::task::spawn_blocking(move || gateway.file_state())
                    .await
                    .unwrap_or(FileState::Ready)
            };
            let waited = incomplete_since.get_or_insert_with(Instant::now).elapsed();
            if state == FileState::Incomplete && in_place && waited < INCOMPLETE_GRACE {
                // Wait for the rest of the write (a change restarts the settling), up to the grace.
                match timeout(INCOMPLETE_GRACE - waited, changes.recv()).await {
                    Ok(Some(change)) => {
                        in_place |= change == Change::InPlace;
                        continue;
                    }
                    Ok(None) => return,
                    Err(_elapsed) => {}
                }
            }
            if state != FileState::Unchanged {
                let gateway = gateway.clone();
                let _ = tokio::task::spawn_blocking(move || gateway.reload(true)).await;
            }
            break;
        }
    }
}

/// Reloads on every SIGHUP.
pub(crate) fn reload_on_sighup(gateway: Arc<Gateway>) -> std::io::Result<()> {
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

/// Reopens the access log's file on every SIGUSR1 (logrotate's `postrotate`).
pub(crate) fn reopen_access_log_on_sigusr1(gateway: Arc<Gateway>) -> std::io::Result<()> {
    let mut signals =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())?;
    tokio::spawn(async move {
        while signals.recv().await.is_some() {
            gateway.reopen_access_log();
            tracing::info!("SIGUSR1: the access log is reopened before its next line");
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use notify::event::{CreateKind, DataChange, RenameMode};

    use super::*;

    fn event(kind: EventKind, path: &str) -> Event {
        Event::new(kind).add_path(path.into())
    }

    #[test]
    fn only_writes_renames_creates_and_removes_of_the_file_are_changes() {
        let name = OsString::from("floodgate.yaml");
        let file = "/etc/floodgate/floodgate.yaml";
        let read = EventKind::Access(AccessKind::Open(AccessMode::Any));
        assert_eq!(
            change(&event(read, file), &name, None),
            None,
            "the reload's own open"
        );
        let closed = EventKind::Access(AccessKind::Close(AccessMode::Read));
        assert_eq!(change(&event(closed, file), &name, None), None);
        let touched = EventKind::Modify(ModifyKind::Metadata(notify::event::MetadataKind::Any));
        assert_eq!(change(&event(touched, file), &name, None), None);
        let written = EventKind::Modify(ModifyKind::Data(DataChange::Any));
        assert_eq!(
            change(&event(written, file), &name, None),
            Some(Change::InPlace)
        );
        assert_eq!(
            change(&event(written, "/etc/floodgate/other.yaml"), &name, None),
            None
        );
        let renamed = EventKind::Modify(ModifyKind::Name(RenameMode::To));
        assert_eq!(
            change(&event(renamed, "/etc/floodgate/..data"), &name, None),
            Some(Change::Replaced),
            "a ConfigMap swap"
        );
        assert_eq!(
            change(
                &event(EventKind::Create(CreateKind::File), file),
                &name,
                None
            ),
            Some(Change::Replaced)
        );
        // The key file identity.jwt reads, beside the configuration: a change too.
        let keys = OsString::from("jwks.json");
        assert_eq!(
            change(
                &event(renamed, "/etc/floodgate/jwks.json"),
                &name,
                Some(&keys)
            ),
            Some(Change::Replaced)
        );
        assert_eq!(
            change(&event(renamed, "/etc/floodgate/jwks.json"), &name, None),
            None
        );
    }
}
