//! The Lua scripts, assembled from `lua/` and loaded once, and the encoding of their arguments
//! and replies.

use std::sync::LazyLock;
use std::time::Duration;

use deadpool_redis::redis::{Script, Value};

use crate::algorithm::LimitOutcome;
use crate::store::batched::{self, Synced};
use crate::store::{Check, StoreError};
use crate::time::Timestamp;

/// The check script's source: helpers, one file per algorithm, then the entry point.
pub(crate) fn check_source() -> String {
    [
        include_str!("../../../lua/common.lua"),
        include_str!("../../../lua/token_bucket.lua"),
        include_str!("../../../lua/gcra.lua"),
        include_str!("../../../lua/fixed_window.lua"),
        include_str!("../../../lua/sliding_window_log.lua"),
        include_str!("../../../lua/sliding_window_counter.lua"),
        include_str!("../../../lua/leaky_bucket.lua"),
        include_str!("../../../lua/concurrency.lua"),
        include_str!("../../../lua/check.lua"),
    ]
    .join("\n")
}

/// The check script, hashed once.
pub(crate) static CHECK: LazyLock<Script> = LazyLock::new(|| Script::new(&check_source()));

/// Releases concurrency leases.
pub(crate) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/release.lua")));

/// What a call asks of the script.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Check all-or-nothing and consume.
    Check,
    /// Give back what an earlier `Check` consumed.
    Refund,
    /// Evaluate at the request's cost without consuming (limits after one that denied).
    Peek,
    /// Batched mode: add each cost unconditionally and return the resulting states.
    Sync,
    /// A post-charge: add each cost unconditionally (never denies; may leave debt).
    Charge,
}

/// The reply of one script call.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) now: Timestamp,
    pub(crate) admitted: bool,
    pub(crate) outcomes: Vec<LimitOutcome>,
    /// Per limit: the lease member or log entry the call created ('' if none).
    pub(crate) tokens: Vec<String>,
}

/// Builds the invocation for `checks` (all on one slot).
pub(crate) fn invocation<'s>(
    mode: Mode,
    checks: &[&Check],
    tokens: &[String],
    now: Option<Timestamp>,
) -> deadpool_redis::redis::ScriptInvocation<'s> {
    let mut invocation = CHECK.prepare_invoke();
    invocation.arg(match mode {
        Mode::Check => "check",
        Mode::Refund => "refund",
        Mode::Peek => "peek",
        Mode::Sync => "sync",
        Mode::Charge => "charge",
    });
    invocation.arg(now.map_or_else(String::new, |now| now.as_micros().to_string()));
    for (index, check) in checks.iter().enumerate() {
        let limit = &check.limit;
        invocation
            .key(&*check.key)
            .arg(limit.algorithm().as_str())
            .arg(limit.limit())
            .arg(limit.window_micros())
            .arg(limit.burst())
            .arg(limit.emission_micros())
            .arg(check.cost)
            .arg(tokens.get(index).map_or("", String::as_str));
    }
    invocation
}

fn integer(value: &Value) -> Result<i64, StoreError> {
    match value {
        Value::Int(int) => Ok(*int),
        other => Err(StoreError::Protocol(format!(
            "expected an integer, got {other:?}"
        ))),
    }
}

fn non_negative(value: &Value) -> Result<u64, StoreError> {
    u64::try_from(integer(value)?).map_err(|_| StoreError::Protocol("negative value".to_owned()))
}

/// Decodes `{ now, admitted, (allowed, remaining, reset, retry, delay, token)* }`.
pub(crate) fn decode(value: Value, limits: usize) -> Result<Reply, StoreError> {
    const PER_LIMIT: usize = 6;
    let Value::Array(items) = value else {
        return Err(StoreError::Protocol(format!(
            "expected an array, got {value:?}"
        )));
    };
    if items.len() != 2 + PER_LIMIT * limits {
        return Err(StoreError::Protocol(format!(
            "expected {} values for {limits} limits, got {}",
            2 + PER_LIMIT * limits,
            items.len()
        )));
    }
    let now = Timestamp::from_micros(non_negative(&items[0])?);
    let admitted = integer(&items[1])? == 1;
    let mut outcomes = Vec::with_capacity(limits);
    let mut tokens = Vec::with_capacity(limits);
    for fields in items[2..].chunks_exact(PER_LIMIT) {
        let retry = integer(&fields[3])?;
        outcomes.push(LimitOutcome {
            allowed: integer(&fields[0])? == 1,
            remaining: non_negative(&fields[1])?,
            reset_after_micros: non_negative(&fields[2])?,
            retry_after_micros: u64::try_from(retry).ok(),
            delay_micros: non_negative(&fields[4])?,
        });
        tokens.push(match &fields[5] {
            Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            Value::SimpleString(text) => text.clone(),
            _ => String::new(),
        });
    }
    Ok(Reply {
        now,
        admitted,
        outcomes,
        tokens,
    })
}

/// Decodes a sync reply, `{ now, (present, field, field, field)* }`, into the states of
/// `checks`.
pub(crate) fn decode_sync(value: Value, checks: &[&Check]) -> Result<Synced, StoreError> {
    const PER_LIMIT: usize = 4;
    let Value::Array(items) = value else {
        return Err(StoreError::Protocol(format!(
            "expected an array, got {value:?}"
        )));
    };
    if items.len() != 1 + PER_LIMIT * checks.len() {
        return Err(StoreError::Protocol(format!(
            "expected {} values for {} limits, got {}",
            1 + PER_LIMIT * checks.len(),
            checks.len(),
            items.len()
        )));
    }
    let now = Timestamp::from_micros(non_negative(&items[0])?);
    let states = items[1..]
        .chunks_exact(PER_LIMIT)
        .zip(checks)
        .map(|(fields, check)| {
            if integer(&fields[0])? == 0 {
                return Ok(None);
            }
            let fields = [
                non_negative(&fields[1])?,
                non_negative(&fields[2])?,
                non_negative(&fields[3])?,
            ];
            batched::state_from_fields(check.limit.algorithm(), fields)
                .map(Some)
                .ok_or_else(|| StoreError::Protocol("state of an unbatchable limit".into()))
        })
        .collect::<Result<_, StoreError>>()?;
    Ok(Synced { now, states })
}

/// The deadline below which a lease release is abandoned (it then expires with its window).
pub(crate) const RELEASE_TIMEOUT: Duration = Duration::from_secs(1);
