//! A plain link to one Redis for the scripts that are not decisions: a region's table and its
//! trades with the global store. Each caller keeps its own script; the link only runs it, at
//! most once (a call that failed is never sent again). The readers of scripts' replies serve
//! the quota board too, which runs on a store's own connections (any deployment).

use std::time::Duration;

use deadpool_redis::redis::aio::MultiplexedConnection;
use deadpool_redis::redis::{self, Client, Script, Value};

use crate::store::StoreError;

/// One multiplexed connection to one Redis, opened on first use and dropped after any failure
/// (so that a call that timed out can not be applied later on the same stream).
pub(crate) struct Link {
    client: Client,
    timeout: Duration,
    connection: tokio::sync::Mutex<Option<MultiplexedConnection>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").finish_non_exhaustive()
    }
}

fn unavailable(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

impl Link {
    /// A link to `url` whose calls give up after `timeout`.
    pub(crate) fn new(url: &str, timeout: Duration) -> Result<Link, StoreError> {
        let client = Client::open(url).map_err(|error| {
            StoreError::Config(format!("{}: {error}", crate::store::redact_url(url)))
        })?;
        Ok(Link {
            client,
            timeout,
            connection: tokio::sync::Mutex::new(None),
        })
    }

    /// Runs `script` with `keys` and `args`, within the link's timeout (waiting for the
    /// connection included). Calls share the multiplexed connection at once: the lock is held
    /// only to take a handle to it, not for the call.
    pub(crate) async fn run(
        &self,
        script: &Script,
        keys: &[String],
        args: &[String],
    ) -> Result<Value, StoreError> {
        let call = async {
            let mut connection = {
                let mut slot = self.connection.lock().await;
                match slot.as_ref() {
                    Some(connection) => connection.clone(),
                    None => {
                        let connection = self
                            .client
                            .get_multiplexed_async_connection()
                            .await
                            .map_err(unavailable)?;
                        *slot = Some(connection.clone());
                        connection
                    }
                }
            };
            let mut invocation = script.prepare_invoke();
            for key in keys {
                invocation.key(key);
            }
            for arg in args {
                invocation.arg(arg);
            }
            invocation
                .invoke_async::<Value>(&mut connection)
                .await
                .map_err(unavailable)
        };
        let result = match tokio::time::timeout(self.timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        };
        if result.is_err() {
            // A call that timed out may still be applied later on this stream: no call goes
            // out on it again.
            *self.connection.lock().await = None;
        }
        result
    }
}

/// Readers of the scripts' replies.
pub(crate) mod reply {
    use super::{StoreError, Value, redis};

    fn malformed(what: &str) -> StoreError {
        StoreError::Protocol(format!("malformed reply: {what}"))
    }

    pub(crate) fn array(value: Value, what: &str) -> Result<Vec<Value>, StoreError> {
        match value {
            Value::Array(items) => Ok(items),
            _ => Err(malformed(what)),
        }
    }

    pub(crate) fn int(value: &Value, what: &str) -> Result<i64, StoreError> {
        redis::from_redis_value::<i64>(value.clone()).map_err(|_| malformed(what))
    }

    pub(crate) fn text(value: &Value, what: &str) -> Result<String, StoreError> {
        redis::from_redis_value::<String>(value.clone()).map_err(|_| malformed(what))
    }
}
