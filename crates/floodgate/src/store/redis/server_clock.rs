//! The Redis server's clock as this node reckons it, for one use: the calendar boundaries a
//! call carries (SPEC §1) are computed around the server's time, not the node's.
//!
//! The script counts a calendar period by the server's clock, among four boundaries the node
//! computes (it has the time zones; the script has none). Computed around the node's own
//! clock, a node more than a period off would send boundaries that miss the server's time,
//! and the script could only extend them at a fixed length, which drifts across a month of
//! another length or a 23-hour day. Every reply carries the server's time; its offset from the
//! node's clock places the next call's boundaries around the server's time, so they are the
//! calendar's own whatever the node's clock says. Before the first reply, a call with a
//! calendar limit asks the server's `TIME` first (once).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use deadpool_redis::redis::Value;

use crate::time::{Clock, Timestamp};

/// No reply has shown the server's time yet.
const UNKNOWN: i64 = i64::MIN;

/// The node's clock and the server's offset from it.
pub(crate) struct ServerClock {
    local: Arc<dyn Clock>,
    /// Server minus node, in microseconds, as the last reply showed; [`UNKNOWN`] before one.
    offset_micros: AtomicI64,
}

impl ServerClock {
    pub(crate) fn new(local: Arc<dyn Clock>) -> ServerClock {
        ServerClock {
            local,
            offset_micros: AtomicI64::new(UNKNOWN),
        }
    }

    /// Whether a reply has shown the server's time.
    pub(crate) fn is_known(&self) -> bool {
        self.offset_micros.load(Ordering::Relaxed) != UNKNOWN
    }

    /// Takes in the server's time `server_now`, just received.
    pub(crate) fn observe(&self, server_now: Timestamp) {
        let offset = server_now.as_micros() as i64 - self.local.now().as_micros() as i64;
        self.offset_micros.store(offset, Ordering::Relaxed);
    }

    /// Takes in the server's time from a script's reply (its first value) or a `TIME` reply;
    /// a reply of another shape teaches nothing.
    pub(crate) fn observe_reply(&self, reply: &Value) {
        if let Some(server_now) = server_time(reply) {
            self.observe(server_now);
        }
    }

    /// The time a call's calendar boundaries are computed around: `now` when the caller gave
    /// one (the script then decides at it), else the server's time as last seen (the node's
    /// own before any reply).
    pub(crate) fn spec_time(&self, now: Option<Timestamp>) -> Timestamp {
        now.unwrap_or_else(|| {
            let local = self.local.now().as_micros() as i64;
            match self.offset_micros.load(Ordering::Relaxed) {
                UNKNOWN => Timestamp::from_micros(local.max(0) as u64),
                offset => Timestamp::from_micros(local.saturating_add(offset).max(0) as u64),
            }
        })
    }
}

/// The server's time in `reply`: a script's reply, whose first value is its time in
/// microseconds, or `TIME`'s `[seconds, microseconds]`.
fn server_time(reply: &Value) -> Option<Timestamp> {
    let Value::Array(values) = reply else {
        return None;
    };
    let number = |value: &Value| match value {
        Value::Int(number) => u64::try_from(*number).ok(),
        Value::BulkString(text) => std::str::from_utf8(text).ok()?.parse().ok(),
        _ => None,
    };
    match values.as_slice() {
        [seconds, micros] if matches!(seconds, Value::BulkString(_)) => Some(
            Timestamp::from_micros(number(seconds)?.checked_mul(1_000_000)? + number(micros)?),
        ),
        [first, ..] => number(first).map(Timestamp::from_micros),
        [] => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::FakeClock;

    #[test]
    fn boundaries_follow_the_servers_time_once_a_reply_shows_it() {
        let node = FakeClock::new(Timestamp::from_secs(1_000));
        let clock = ServerClock::new(Arc::new(node.clone()));
        assert!(!clock.is_known());
        assert_eq!(clock.spec_time(None), Timestamp::from_secs(1_000));
        // A script's reply: the server is 5,000 s ahead.
        clock.observe_reply(&Value::Array(vec![
            Value::Int(6_000_000_000),
            Value::Int(1),
        ]));
        assert!(clock.is_known());
        node.advance(std::time::Duration::from_secs(10));
        assert_eq!(clock.spec_time(None), Timestamp::from_secs(6_010));
        // The caller's own time wins.
        let given = Timestamp::from_secs(42);
        assert_eq!(clock.spec_time(Some(given)), given);
        // `TIME`: seconds and microseconds, as text; the server now 20 s behind.
        clock.observe_reply(&Value::Array(vec![
            Value::BulkString(b"990".to_vec()),
            Value::BulkString(b"500000".to_vec()),
        ]));
        assert_eq!(clock.spec_time(None), Timestamp::from_micros(990_500_000));
    }
}
