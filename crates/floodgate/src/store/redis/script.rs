//! The Lua library of `lua/`, as a Redis Function library and as scripts for servers without
//! functions, and the encoding of its calls and replies.
//!
//! A Redis Function library is loaded once per node (`FUNCTION LOAD`) and called by `FCALL`: a
//! call runs only its decision. A script called by `EVALSHA` runs the whole file on every call
//! (every algorithm's definitions before the decision), so it is the fallback for servers where
//! functions are missing or disabled. Both run the same code. Names carry a hash of the code,
//! so that gateways of different versions sharing one Redis (a rolling upgrade) each call
//! their own.

use std::sync::LazyLock;
use std::time::Duration;

use deadpool_redis::redis::{self, Script, Value};

use crate::Limit;
use crate::algorithm::LimitOutcome;
use crate::store::batched::{self, Synced};
use crate::store::{Check, StoreError};
use crate::time::Timestamp;

/// Helpers, one file per algorithm, then the entry points (local functions, registered or
/// returned by what follows them).
fn library_body() -> String {
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
        include_str!("../../../lua/release.lua"),
    ]
    .join("\n")
}

/// The library in both forms.
pub(crate) struct Library {
    /// The `FUNCTION LOAD` source: a header naming the library, the body, the registrations.
    pub(crate) source: String,
    /// The name `FCALL` decides with.
    pub(crate) check_function: String,
    /// The name `FCALL` releases leases with.
    pub(crate) release_function: String,
    /// The body and a `return` of the check entry point, for `EVALSHA`, and its hash.
    pub(crate) check_script: (String, String),
    /// The release entry point alone, for `EVALSHA`, and its hash.
    pub(crate) release_script: (String, String),
}

/// A script's source with its SHA-1, the name `EVALSHA` calls it by.
fn hashed(source: String) -> (String, String) {
    let hash = Script::new(&source).get_hash().to_owned();
    (source, hash)
}

/// The library, assembled and hashed once.
pub(crate) static LIBRARY: LazyLock<Library> = LazyLock::new(|| {
    let body = library_body();
    // 16 hex digits of the body's SHA-1: the version in every name.
    let version = Script::new(&body).get_hash()[..16].to_owned();
    let check_function = format!("floodgate_check_{version}");
    let release_function = format!("floodgate_release_{version}");
    let source = format!(
        "#!lua name=floodgate_{version}\n{body}\n\
         redis.register_function('{check_function}', floodgate_check)\n\
         redis.register_function('{release_function}', floodgate_release)\n"
    );
    Library {
        source,
        check_function,
        release_function,
        check_script: hashed(check_source()),
        release_script: hashed(format!(
            "{}\nreturn floodgate_release(KEYS, ARGV)\n",
            include_str!("../../../lua/release.lua")
        )),
    }
});

/// The check script's source as `EVALSHA` runs it (tooling and benchmarks).
pub(crate) fn check_source() -> String {
    format!("{}\nreturn floodgate_check(KEYS, ARGV)\n", library_body())
}

/// How calls reach the library on a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dispatch {
    /// `FCALL` of the loaded function library.
    Function,
    /// `EVALSHA` of the scripts (servers without functions, or with `FUNCTION` disabled).
    Script,
}

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

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Check => "check",
            Mode::Refund => "refund",
            Mode::Peek => "peek",
            Mode::Sync => "sync",
            Mode::Charge => "charge",
        }
    }

    /// Whether a reply of this mode carries the states of its limits: a denial's (or a
    /// peek's) as decided on, a refund's or a charge's as left.
    fn replies_with_states(self, admitted: bool) -> bool {
        match self {
            Mode::Check | Mode::Peek => !admitted,
            Mode::Refund | Mode::Charge => true,
            Mode::Sync => false,
        }
    }
}

/// A concurrency lease as the library keeps it, a member `"<id>:<cost>"` of its limit's sorted
/// set: written when a lease is released, read back from a decision's reply. The one place
/// that knows the format (`lua/concurrency.lua` makes it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LeaseToken {
    pub(crate) id: u64,
    pub(crate) cost: u64,
}

impl LeaseToken {
    /// The token of `lease`.
    pub(crate) fn of(lease: &crate::store::Lease) -> Self {
        LeaseToken {
            id: lease.id,
            cost: lease.cost,
        }
    }

    /// The token a reply answered (`None` for anything else: no lease was taken).
    pub(crate) fn parse(member: &str) -> Option<Self> {
        let (id, cost) = member.split_once(':')?;
        Some(LeaseToken {
            id: id.parse().ok()?,
            cost: cost.parse().ok()?,
        })
    }
}

impl std::fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.id, self.cost)
    }
}

/// One decision of a call: its checks (all on one slot where calls must stay on one) and, per
/// check, the token the script takes or gives back (`""` if none).
#[derive(Clone, Copy)]
pub(crate) struct Decision<'a> {
    pub(crate) checks: &'a [&'a Check],
    pub(crate) tokens: &'a [String],
}

/// The reply to one decision of a call.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) now: Timestamp,
    pub(crate) admitted: bool,
    pub(crate) outcomes: Vec<LimitOutcome>,
    /// Per limit: the lease member or log entry the call created ('' if none).
    pub(crate) tokens: Vec<String>,
    /// A denial's or a peek's (per limit, the three exported state fields it was decided on),
    /// a refund's or a charge's (the state it left); `None` for a fresh key or an algorithm
    /// without export. Empty for an admission.
    pub(crate) states: Vec<Option<[u64; 3]>>,
}

/// Whether the library takes (and answers) a token for limits of `algorithm`: the id of a
/// lease or a log entry.
fn takes_token(algorithm: crate::Algorithm) -> bool {
    matches!(
        algorithm,
        crate::Algorithm::Concurrency | crate::Algorithm::SlidingWindowLog
    )
}

/// The command for `decisions` in `mode`, dispatched as `dispatch`: one decision, or in
/// `Mode::Check` several (a batch, decided in order).
pub(crate) fn command(
    dispatch: Dispatch,
    mode: Mode,
    decisions: &[Decision<'_>],
    now: Option<Timestamp>,
    spec_time: Timestamp,
) -> redis::Cmd {
    let library = &*LIBRARY;
    let mut command = invoking(dispatch, &library.check_function, &library.check_script.1);
    let keys: usize = decisions.iter().map(|decision| decision.checks.len()).sum();
    command.arg(keys);
    for decision in decisions {
        for check in decision.checks {
            command.arg(&*check.key);
        }
    }
    let batch = decisions.len() != 1;
    debug_assert!(!batch || mode == Mode::Check, "only checks are batched");
    // A calendar period's boundaries are given around `spec_time` (the server's time as this
    // node reckons it); the script picks its own period among them.
    command.arg(if batch { "batch" } else { mode.as_str() });
    match now {
        Some(now) => command.arg(now.as_micros()),
        None => command.arg(""),
    };
    if batch {
        command.arg(decisions.len());
    }
    for decision in decisions {
        if batch {
            // Its limits, and its arguments after these two: where the next decision starts,
            // even when the script cannot read this one.
            let arguments: usize = decision
                .checks
                .iter()
                .map(|check| 2 + usize::from(takes_token(check.limit.algorithm())))
                .sum();
            command.arg(decision.checks.len()).arg(arguments);
        }
        for (index, check) in decision.checks.iter().enumerate() {
            command
                .arg(script_spec(&check.limit, spec_time))
                .arg(check.cost);
            if takes_token(check.limit.algorithm()) {
                command.arg(decision.tokens.get(index).map_or("", String::as_str));
            }
        }
    }
    command
}

/// `limit` as the Redis library takes it (see `lua/common.lua`): the algorithm and the two
/// numbers it uses, `burst` and `emission` for the buckets and GCRA, `limit` and `window` for
/// the rest.
///
/// A calendar period's boundaries change with time: its spec is
/// `"calendar_window <limit> <b0>,<b1>,<b2>,<b3>"`, the four boundaries around `now`
/// ([`CalendarPeriod::boundaries`](crate::calendar::CalendarPeriod::boundaries)), among which
/// the script finds the store's own period.
///
/// Formatted per call: a few hundred nanoseconds against the call's tens of microseconds.
pub(crate) fn script_spec(limit: &Limit, now: Timestamp) -> String {
    use crate::Algorithm;
    if let Some(calendar) = limit.calendar() {
        let [b0, b1, b2, b3] = calendar.boundaries(now.as_micros());
        return format!("calendar_window {} {b0},{b1},{b2},{b3}", limit.limit());
    }
    let algorithm = limit.algorithm();
    let (a, b) = match algorithm {
        Algorithm::Gcra | Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            (limit.burst(), limit.emission_micros())
        }
        Algorithm::FixedWindow
        | Algorithm::SlidingWindowCounter
        | Algorithm::SlidingWindowLog
        | Algorithm::Concurrency => (limit.limit(), limit.window_micros()),
    };
    format!("{} {a} {b}", algorithm.as_str())
}

/// Whether one of `decisions` counts a calendar period (its call carries boundaries).
pub(crate) fn has_calendar(decisions: &[Decision<'_>]) -> bool {
    decisions.iter().any(|decision| {
        decision
            .checks
            .iter()
            .any(|check| check.limit.calendar().is_some())
    })
}

/// `FCALL function` or `EVALSHA script_hash`, the rest to follow.
fn invoking(dispatch: Dispatch, function: &str, script_hash: &str) -> redis::Cmd {
    let (name, target) = match dispatch {
        Dispatch::Function => ("FCALL", function),
        Dispatch::Script => ("EVALSHA", script_hash),
    };
    let mut command = redis::cmd(name);
    command.arg(target);
    command
}

/// The `lease` call of `requests` (batched mode's trade; see `lua/check.lua`): trade number
/// `trade` of its node, recorded at `record` ([`trade_record_key`]) so that Redis applies it
/// once however often it is sent.
pub(crate) fn lease_command(
    dispatch: Dispatch,
    requests: &[&crate::store::batched::LeaseRequest],
    trade: TradeId<'_>,
    now: Option<Timestamp>,
    spec_time: Timestamp,
) -> redis::Cmd {
    let library = &*LIBRARY;
    let mut command = invoking(dispatch, &library.check_function, &library.check_script.1);
    command.arg(requests.len() + 1);
    for request in requests {
        command.arg(&*request.check.key);
    }
    command.arg(trade.record).arg("lease");
    match now {
        Some(now) => command.arg(now.as_micros()),
        None => command.arg(""),
    };
    command.arg(trade.number);
    for request in requests {
        command
            .arg(script_spec(&request.check.limit, spec_time))
            .arg(request.give_back)
            .arg(request.want)
            .arg(request.charge)
            .arg(request.leased_in.unwrap_or(0));
    }
    command
}

/// One lease trade of a node: its number (increasing on the node) and the key of the node's
/// trade record on the trade's slot.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TradeId<'a> {
    pub(crate) number: u64,
    pub(crate) record: &'a str,
}

/// The key where `node` records its last trade through a call whose first key is `first_key`:
/// on the key's cluster slot, so that one call may hold both. A key with a hash tag (every
/// storage key) gives its prefix and tag; a key without one is the tag itself where it can be
/// (it holds no `}`), else the first `fg-slot-<n>` tag on its slot.
pub(crate) fn trade_record_key(first_key: &str, node: &str) -> String {
    let tag = crate::key::storage::hash_tag(first_key);
    if tag.len() < first_key.len()
        && let Some(open) = first_key.find('{')
    {
        let close = open + 1 + tag.len();
        return format!("{}:trade:{node}", &first_key[..=close]);
    }
    if !first_key.contains('}') {
        return format!("{{{first_key}}}:trade:{node}");
    }
    let slot = super::slot::hash_slot(first_key);
    let on_slot = (0u32..)
        .map(|n| format!("fg-slot-{n}"))
        .find(|tag| super::slot::hash_slot(tag) == slot)
        .expect("every slot has a tag");
    format!("{{{on_slot}}}:trade:{node}")
}

/// Decodes a lease reply, `{ now, granted_at, (granted, present, field, field, field)* }`:
/// each request's grant, stamped with the time it was granted. `None` when the trade was
/// superseded (a later trade of its node was recorded first: this run applied nothing, and an
/// earlier run may have).
pub(crate) fn decode_lease(
    value: Value,
    requests: &[&crate::store::batched::LeaseRequest],
) -> Result<Option<Vec<crate::store::batched::Grant>>, StoreError> {
    let mut fields = Fields::of(value)?;
    let now = Timestamp::from_micros(fields.non_negative()?);
    let granted_at = fields.non_negative()?;
    let grants = requests
        .iter()
        .map(|request| {
            let granted = fields.non_negative()?;
            let state = match fields.state()? {
                None => None,
                Some(values) => Some(
                    batched::state_from_fields(request.check.limit.algorithm(), values)
                        .ok_or_else(|| {
                            StoreError::Protocol("state of an unbatchable limit".into())
                        })?,
                ),
            };
            Ok(crate::store::batched::Grant {
                now,
                granted_at: Timestamp::from_micros(granted_at),
                granted,
                state,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    fields.finish()?;
    Ok((granted_at > 0).then_some(grants))
}

/// The command that releases `members` of `keys` (one each).
pub(crate) fn release_command(
    dispatch: Dispatch,
    keys: &[&str],
    members: &[LeaseToken],
) -> redis::Cmd {
    let library = &*LIBRARY;
    let mut command = invoking(
        dispatch,
        &library.release_function,
        &library.release_script.1,
    );
    command.arg(keys.len());
    for key in keys {
        command.arg(*key);
    }
    for member in members {
        command.arg(member.to_string());
    }
    command
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

/// Reads a reply's values in order.
struct Fields {
    items: std::vec::IntoIter<Value>,
}

impl Fields {
    fn of(value: Value) -> Result<Fields, StoreError> {
        match value {
            Value::Array(items) => Ok(Fields {
                items: items.into_iter(),
            }),
            other => Err(StoreError::Protocol(format!(
                "expected an array, got {other:?}"
            ))),
        }
    }

    fn next(&mut self) -> Result<Value, StoreError> {
        self.items
            .next()
            .ok_or_else(|| StoreError::Protocol("the reply ended early".to_owned()))
    }

    fn integer(&mut self) -> Result<i64, StoreError> {
        integer(&self.next()?)
    }

    fn non_negative(&mut self) -> Result<u64, StoreError> {
        non_negative(&self.next()?)
    }

    fn text(&mut self) -> Result<String, StoreError> {
        Ok(match self.next()? {
            Value::BulkString(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Value::SimpleString(text) => text,
            _ => String::new(),
        })
    }

    /// A limit's outcome (remaining, reset, retry: -1 allowed, -2 denied for good, else the
    /// wait; then its delay and token where its algorithm has them), and its token.
    fn outcome(
        &mut self,
        algorithm: crate::Algorithm,
    ) -> Result<(LimitOutcome, String), StoreError> {
        let remaining = self.non_negative()?;
        let reset_after_micros = self.non_negative()?;
        let retry = self.integer()?;
        let delay_micros = if algorithm == crate::Algorithm::LeakyBucket {
            self.non_negative()?
        } else {
            0
        };
        let token = if takes_token(algorithm) {
            self.text()?
        } else {
            String::new()
        };
        let outcome = LimitOutcome {
            allowed: retry == -1,
            remaining,
            reset_after_micros,
            retry_after_micros: u64::try_from(retry).ok(),
            delay_micros,
        };
        Ok((outcome, token))
    }

    /// A state: present (0/1) and three fields.
    fn state(&mut self) -> Result<Option<[u64; 3]>, StoreError> {
        let present = self.integer()? == 1;
        let fields = [
            self.non_negative()?,
            self.non_negative()?,
            self.non_negative()?,
        ];
        Ok(present.then_some(fields))
    }

    /// The rest of one decision's reply after its admitted flag: each limit's outcome, then
    /// the states if `mode` replies with them.
    fn decision(
        &mut self,
        mode: Mode,
        now: Timestamp,
        admitted: bool,
        decision: &Decision<'_>,
    ) -> Result<Reply, StoreError> {
        let limits = decision.checks.len();
        let mut outcomes = Vec::with_capacity(limits);
        let mut tokens = Vec::with_capacity(limits);
        for check in decision.checks {
            let (outcome, token) = self.outcome(check.limit.algorithm())?;
            outcomes.push(outcome);
            tokens.push(token);
        }
        let states = if mode.replies_with_states(admitted) {
            decision
                .checks
                .iter()
                .map(|check| {
                    if check.limit.algorithm().is_batchable() {
                        self.state()
                    } else {
                        Ok(None)
                    }
                })
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        Ok(Reply {
            now,
            admitted,
            outcomes,
            tokens,
            states,
        })
    }

    fn finish(mut self) -> Result<(), StoreError> {
        match self.items.next() {
            None => Ok(()),
            Some(_) => Err(StoreError::Protocol(
                "the reply has more values than its decisions".to_owned(),
            )),
        }
    }
}

/// Decodes the reply of a `mode` call of `decisions`.
pub(crate) fn decode(
    mode: Mode,
    value: Value,
    decisions: &[Decision<'_>],
) -> Result<Vec<Reply>, StoreError> {
    let mut fields = Fields::of(value)?;
    let now = Timestamp::from_micros(fields.non_negative()?);
    let mut replies = Vec::with_capacity(decisions.len());
    for decision in decisions {
        let admitted = fields.integer()? == 1;
        replies.push(fields.decision(mode, now, admitted, decision)?);
    }
    fields.finish()?;
    Ok(replies)
}

/// Decodes the reply of a `Mode::Check` call of `decisions` (a batch, or one decision) into
/// each decision's own answer: a batch's decision that failed in the script answers with its
/// error (a string where its admitted flag goes), and the others are decided.
pub(crate) fn decode_batch(
    value: Value,
    decisions: &[Decision<'_>],
) -> Result<Vec<Result<Reply, StoreError>>, StoreError> {
    let mut fields = Fields::of(value)?;
    let now = Timestamp::from_micros(fields.non_negative()?);
    let mut replies = Vec::with_capacity(decisions.len());
    for decision in decisions {
        let admitted = match fields.next()? {
            Value::Int(admitted) => admitted == 1,
            Value::BulkString(error) => {
                // The script's error, as a call that failed with it would give (SPEC §3: not
                // transient, it would fail again).
                let error = String::from_utf8_lossy(&error).into_owned();
                replies.push(Err(StoreError::Protocol(error)));
                continue;
            }
            other => {
                return Err(StoreError::Protocol(format!(
                    "expected a decision's admitted flag or error, got {other:?}"
                )));
            }
        };
        replies.push(fields.decision(Mode::Check, now, admitted, decision));
    }
    fields.finish()?;
    Ok(replies)
}

/// Decodes a sync reply, `{ now, (present, field, field, field)* }`, into the states of
/// `checks`.
pub(crate) fn decode_sync(value: Value, checks: &[&Check]) -> Result<Synced, StoreError> {
    let mut fields = Fields::of(value)?;
    let now = Timestamp::from_micros(fields.non_negative()?);
    let states = checks
        .iter()
        .map(|check| {
            let Some(fields) = fields.state()? else {
                return Ok(None);
            };
            batched::state_from_fields(check.limit.algorithm(), fields)
                .map(Some)
                .ok_or_else(|| StoreError::Protocol("state of an unbatchable limit".into()))
        })
        .collect::<Result<_, StoreError>>()?;
    fields.finish()?;
    Ok(Synced { now, states })
}

/// The deadline below which a lease release is abandoned (it then expires with its window).
pub(crate) const RELEASE_TIMEOUT: Duration = Duration::from_secs(1);
