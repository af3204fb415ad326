//! Overrides in Redis ([`crate::store::override_backend::OverrideBackend`]).
//!
//! Each client's overrides are a hash under the client's own hash tag,
//! `<namespace>:{<scope>:<hash>}:overrides` (field: the target storage key, value: the
//! override's JSON), so that on a cluster they sit on the slot of the counters they change, and
//! expire with the last of them. An index, `<namespace>:{overrides}:index` (a sorted set of
//! targets by expiry), bounds how many are in force and lets a node read them all without a
//! scan; `<namespace>:{overrides}:version` holds a token that every change replaces with a
//! random one, so that a node polls one `GET` (and `TIME`, for the clock) while nothing changes. A counter would start
//! again at 1 on a Redis restarted without its data, and a node that had read change 1 before
//! would take the first change after the restart for one it had seen.
//!
//! Setting one takes three calls that no single script can make on a cluster (the index and
//! the client's hash are on different slots): the index first (it holds the bound), then the
//! client's hash, then the version. Nodes read the index and then the hashes, so a set that
//! fails half-way is never half in force: an index entry without its hash is skipped (a new
//! one is taken back out; one that could not be taken out holds its place in the bound until
//! it expires). A version that could not be bumped only delays the other nodes until their
//! next full read (10 s at most).

use std::collections::HashMap;

use deadpool_redis::redis::{self, Value};
use futures_util::future::join_all;

use super::{RedisStore, ShardedRedisStore};
use crate::key::storage::hash_tag;
use crate::store::override_backend::{Override, OverrideBackend};
use crate::store::{BoxFuture, StoreError};
use crate::time::Timestamp;

/// Prunes expired entries of the index, and adds `target` unless the bound is reached: 0
/// refused, 1 a new entry, 2 an entry in force replaced. KEYS: index. ARGV: now (ms), expires
/// at (ms), target, most in force.
const RESERVE: &str = r"
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local replaced = redis.call('ZSCORE', KEYS[1], ARGV[3])
if not replaced and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
if replaced then return 2 end
return 1
";

/// Stores an override in its client's hash, drops the hash's expired entries, and makes the
/// hash expire with its last entry. KEYS: the client's hash. ARGV: target, JSON, now (ms).
const STORE: &str = r"
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local now = tonumber(ARGV[3])
local latest = 0
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local ok, entry = pcall(cjson.decode, entries[i + 1])
  local at = ok and tonumber(entry.expires_at_ms) or 0
  if at <= now then
    redis.call('HDEL', KEYS[1], entries[i])
  elseif at > latest then
    latest = at
  end
end
if latest > 0 then redis.call('PEXPIREAT', KEYS[1], latest) end
return 1
";

/// Where one store's overrides go: a node per key.
enum Placement {
    /// A single Redis, a cluster (the connection routes by key) or a sentinel's master.
    One(RedisStore),
    /// Independent nodes, placed as the counters are.
    Sharded(ShardedRedisStore),
}

/// Overrides kept in Redis, beside the counters.
pub(crate) struct RedisOverrides {
    placement: Placement,
}

impl RedisOverrides {
    pub(crate) fn single(store: RedisStore) -> Self {
        RedisOverrides {
            placement: Placement::One(store),
        }
    }

    pub(crate) fn sharded(store: ShardedRedisStore) -> Self {
        RedisOverrides {
            placement: Placement::Sharded(store),
        }
    }

    fn node(&self, key: &str) -> &RedisStore {
        match &self.placement {
            Placement::One(store) => store,
            Placement::Sharded(store) => store.node(store.node_of(key)),
        }
    }

    async fn run(&self, key: &str, command: &redis::Cmd) -> Result<Value, StoreError> {
        self.node(key).command(command).await
    }
}

fn index_key(namespace: &str) -> String {
    format!("{namespace}:{{overrides}}:index")
}

fn version_key(namespace: &str) -> String {
    format!("{namespace}:{{overrides}}:version")
}

/// The hash of the overrides of the client that `target` belongs to.
fn client_key(namespace: &str, target: &str) -> String {
    format!("{namespace}:{{{}}}:overrides", hash_tag(target))
}

fn millis(at: Timestamp) -> u64 {
    at.as_micros() / 1000
}

fn eval(script: &str, key: &str) -> redis::Cmd {
    let mut command = redis::cmd("EVAL");
    command.arg(script).arg(1).arg(key);
    command
}

fn as_int(value: &Value) -> Result<i64, StoreError> {
    match value {
        Value::Int(number) => Ok(*number),
        Value::Nil => Ok(0),
        Value::BulkString(bytes) => std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| StoreError::Protocol(format!("expected a number, got {value:?}"))),
        other => Err(StoreError::Protocol(format!(
            "expected a number, got {other:?}"
        ))),
    }
}

fn as_strings(value: Value) -> Result<Vec<Option<String>>, StoreError> {
    match value {
        Value::Array(items) => Ok(items
            .into_iter()
            .map(|item| match item {
                Value::BulkString(bytes) => String::from_utf8(bytes).ok(),
                _ => None,
            })
            .collect()),
        other => Err(StoreError::Protocol(format!(
            "expected a list, got {other:?}"
        ))),
    }
}

impl RedisOverrides {
    /// Tells every node's deny cache to forget what it denied on `target`: the new limit may
    /// admit at once.
    async fn forget_denials(&self, target: &str) {
        self.node(target).forget_denials(&[target]).await;
    }

    /// Marks a change with a new version token, so that every node reads the list again; a
    /// failure only delays them until their next full read, and is logged.
    async fn bump_version_or_warn(&self, namespace: &str) {
        let key = version_key(namespace);
        // Positive, to read back as the integer it is written as; never 0, which a missing
        // key reads as. Two changes draw the same token once in 2^63.
        let token = fastrand::u64(1..=i64::MAX as u64);
        let mut set = redis::cmd("SET");
        set.arg(&key).arg(token);
        if let Err(error) = self.run(&key, &set).await {
            tracing::warn!(%error, "override changed, but its version was not: other gateways apply it at their next full read (within 10 s)");
        }
    }
}

impl OverrideBackend for RedisOverrides {
    fn put<'a>(
        &'a self,
        namespace: &'a str,
        entry: &'a Override,
        max_active: usize,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let index = index_key(namespace);
            let mut reserve = eval(RESERVE, &index);
            reserve
                .arg(millis(now))
                .arg(millis(entry.expires_at))
                .arg(&*entry.target)
                .arg(max_active);
            let reserved = as_int(&self.run(&index, &reserve).await?)?;
            if reserved == 0 {
                return Ok(false);
            }
            let client = client_key(namespace, &entry.target);
            let mut store = eval(STORE, &client);
            store
                .arg(&*entry.target)
                .arg(entry.to_json().to_string())
                .arg(millis(now));
            if let Err(error) = self.run(&client, &store).await {
                // Not stored (nodes skip an index entry without its hash): a new entry gives
                // its place in the bound back; one it was to replace stays, in force as it was.
                if reserved == 1 {
                    let mut unreserve = redis::cmd("ZREM");
                    unreserve.arg(&index).arg(&*entry.target);
                    let _ = self.run(&index, &unreserve).await;
                }
                return Err(error);
            }
            self.bump_version_or_warn(namespace).await;
            self.forget_denials(&entry.target).await;
            Ok(true)
        })
    }

    fn remove<'a>(
        &'a self,
        namespace: &'a str,
        target: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let client = client_key(namespace, target);
            let mut hdel = redis::cmd("HDEL");
            hdel.arg(&client).arg(target);
            let removed = as_int(&self.run(&client, &hdel).await?)? > 0;
            let index = index_key(namespace);
            let mut zrem = redis::cmd("ZREM");
            zrem.arg(&index).arg(target);
            let unindexed = as_int(&self.run(&index, &zrem).await?)? > 0;
            self.bump_version_or_warn(namespace).await;
            self.forget_denials(target).await;
            Ok(removed || unindexed)
        })
    }

    fn all<'a>(
        &'a self,
        namespace: &'a str,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Vec<Override>, StoreError>> {
        Box::pin(async move {
            let index = index_key(namespace);
            let mut range = redis::cmd("ZRANGEBYSCORE");
            range
                .arg(&index)
                .arg(format!("({}", millis(now)))
                .arg("+inf");
            let targets: Vec<String> = as_strings(self.run(&index, &range).await?)?
                .into_iter()
                .flatten()
                .collect();
            let mut by_client: HashMap<String, Vec<String>> = HashMap::new();
            for target in targets {
                by_client
                    .entry(client_key(namespace, &target))
                    .or_default()
                    .push(target);
            }
            let reads = by_client.iter().map(|(client, targets)| async move {
                let mut hmget = redis::cmd("HMGET");
                hmget.arg(client).arg(targets);
                as_strings(self.run(client, &hmget).await?)
            });
            let mut all = Vec::new();
            for values in join_all(reads).await {
                for value in values?.into_iter().flatten() {
                    let entry = serde_json::from_str(&value)
                        .ok()
                        .as_ref()
                        .and_then(Override::from_json);
                    match entry {
                        Some(entry) if entry.is_active(now) => all.push(entry),
                        Some(_) => {}
                        None => tracing::warn!(
                            "an override stored in Redis could not be read; it is skipped"
                        ),
                    }
                }
            }
            Ok(all)
        })
    }

    fn version<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let key = version_key(namespace);
            let mut get = redis::cmd("GET");
            get.arg(&key);
            let version = as_int(&self.run(&key, &get).await?)?;
            Ok(u64::try_from(version).unwrap_or(0))
        })
    }

    /// `TIME`: of the node that holds the version on a single Redis, a sentinel's master and
    /// sharded Redis; of any master on a cluster (a command without a key goes to any), whose
    /// clocks are taken to agree, as the clients' `PEXPIREAT` on their own masters assumes too.
    /// A plain command, not a script: the poll of every node stays apart from the decisions'
    /// scripts in `INFO commandstats`.
    fn time<'a>(
        &'a self,
        namespace: &'a str,
    ) -> BoxFuture<'a, Result<Option<Timestamp>, StoreError>> {
        Box::pin(async move {
            let key = version_key(namespace);
            let answer = self.run(&key, &redis::cmd("TIME")).await?;
            let unexpected =
                || StoreError::Protocol(format!("expected TIME's answer, got {answer:?}"));
            let Value::Array(parts) = &answer else {
                return Err(unexpected());
            };
            let [seconds, micros] = parts.as_slice() else {
                return Err(unexpected());
            };
            let (seconds, micros) = (as_int(seconds)?, as_int(micros)?);
            let micros = seconds
                .checked_mul(1_000_000)
                .and_then(|whole| whole.checked_add(micros))
                .and_then(|total| u64::try_from(total).ok())
                .ok_or_else(unexpected)?;
            Ok(Some(Timestamp::from_micros(micros)))
        })
    }
}
