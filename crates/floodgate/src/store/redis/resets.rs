//! Hearing other nodes' resets: a subscription to [`RESETS_CHANNEL`] that makes the deny cache
//! forget what an operator reset anywhere (see [`super::deny_cache`]), and batched nodes drop
//! their leases of the reset keys.
//!
//! One task per store, started by its first decision (a store may be built before the runtime
//! that serves it), ended when the store is dropped. Until it is subscribed, and from the moment
//! its connection is lost until it is subscribed again, the cache denies nothing locally; each
//! new subscription starts from an empty cache, since a reset may have been published unheard.

use std::sync::Weak;
use std::time::Duration;

use deadpool_redis::redis::{self, Client};
use futures_util::StreamExt;
use tokio::sync::watch;

use super::Inner;
use super::deny_cache::RESETS_CHANNEL;

/// Where a store's subscription connects.
#[derive(Clone, Debug)]
pub(super) enum Source {
    /// Any of these servers (one server, or a cluster's seed nodes: a cluster delivers a
    /// message published on any node to subscribers on every node).
    Servers(Vec<String>),
    /// The master these sentinels name (asked again after every lost connection).
    Sentinel {
        master: String,
        sentinels: Vec<String>,
    },
}

/// How often the cache drops what is over while nothing else happens.
const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// Deadline of one connection attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Starts the subscription task of `store`, which ends when `stop`'s sender (the store) goes.
pub(super) fn spawn(store: Weak<Inner>, source: Source, stop: watch::Receiver<()>) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(listen(store, source, stop));
    }
}

async fn listen(store: Weak<Inner>, source: Source, mut stop: watch::Receiver<()>) {
    let mut failures: u32 = 0;
    loop {
        let subscribed = tokio::select! {
            subscribed = subscribe(&source, failures) => subscribed,
            _ = stop.changed() => return,
        };
        match subscribed {
            Ok(mut pubsub) => {
                failures = 0;
                {
                    let Some(inner) = store.upgrade() else {
                        return;
                    };
                    if let Some(cache) = &inner.deny_cache {
                        cache.set_listening(true);
                    }
                }
                let mut messages = pubsub.on_message();
                let mut sweeps = tokio::time::interval(SWEEP_EVERY);
                loop {
                    tokio::select! {
                        message = messages.next() => {
                            let Some(message) = message else {
                                break;
                            };
                            let Some(inner) = store.upgrade() else {
                                return;
                            };
                            let keys: String = message.get_payload().unwrap_or_default();
                            inner.heard_reset(&keys);
                        }
                        _ = sweeps.tick() => {
                            let Some(inner) = store.upgrade() else {
                                return;
                            };
                            if let Some(cache) = &inner.deny_cache {
                                cache.sweep();
                            }
                        }
                        _ = stop.changed() => return,
                    }
                }
                let Some(inner) = store.upgrade() else {
                    return;
                };
                if let Some(cache) = &inner.deny_cache {
                    cache.set_listening(false);
                }
                tracing::debug!("lost the resets subscription; local denials paused");
            }
            Err(error) => {
                tracing::debug!(%error, "could not subscribe to resets; local denials paused");
            }
        }
        failures = failures.saturating_add(1);
        let backoff = Duration::from_millis(50 << failures.min(5));
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
    }
}

/// A subscription to the resets channel, on the `attempt`-th server of `source` in turn.
async fn subscribe(source: &Source, attempt: u32) -> redis::RedisResult<redis::aio::PubSub> {
    let client = match source {
        Source::Servers(urls) => {
            let url = &urls[attempt as usize % urls.len().max(1)];
            Client::open(url.as_str())?
        }
        Source::Sentinel { master, sentinels } => {
            let mut sentinel = redis::sentinel::SentinelClient::build(
                sentinels.clone(),
                master.clone(),
                None,
                redis::sentinel::SentinelServerType::Master,
            )?;
            tokio::time::timeout(CONNECT_TIMEOUT, sentinel.async_get_client())
                .await
                .map_err(|_| timed_out())??
        }
    };
    let connect = async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(RESETS_CHANNEL).await?;
        Ok(pubsub)
    };
    tokio::time::timeout(CONNECT_TIMEOUT, connect)
        .await
        .map_err(|_| timed_out())?
}

fn timed_out() -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "connecting to subscribe to resets timed out",
    ))
}
