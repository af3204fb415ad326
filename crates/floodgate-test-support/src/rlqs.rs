//! An RLQS client that behaves as Envoy's `rate_limit_quota` HTTP filter does, to drive a Rate
//! Limit Quota Service server (`envoy.service.rate_limit_quota.v3`) in tests as a fleet of
//! Envoys would.
//!
//! Each [`Envoy`] keeps one bidirectional stream (`StreamRateLimitQuotas`) to one server of its
//! list for one domain. It decides every request locally from what its bucket enforces now,
//! counts it, and reports the counts to the server: at once for a bucket it has not seen
//! before (which subscribes it), and for every cached bucket each report interval. It applies
//! the server's assignments (blanket rules and token buckets) until their time to live runs
//! out, then its expired-assignment behaviour, then its no-assignment behaviour; an abandon
//! action forgets a bucket. When its stream ends it keeps its assignments, reconnects to the
//! next server of its list and reports every cached bucket there.
//!
//! What the server sends that Envoy drops, misreads or would crash on is recorded as a
//! violation ([`Envoy::violations`]), so that a test can assert a server never does it.
//!
//! Modelled on Envoy's `source/extensions/filters/http/rate_limit_quota` (`filter.cc`,
//! `global_client_impl.cc`), where this emulation follows it:
//! - time to live: whole seconds (`seconds` only, nanos ignored; unset is 0 s, expired at
//!   once);
//! - `time_elapsed` of a report: whole seconds since the bucket's last report, truncated, so
//!   the report that subscribes a bucket says 0 s;
//! - a token bucket refills continuously at `tokens_per_fill / fill_interval` tokens a second
//!   (the interval truncated to whole seconds) up to `max_tokens`, starts full, and a request
//!   takes one whole token; an identical token bucket re-sent keeps its tokens, a different
//!   one starts over, full;
//! - `RequestsPerTimeUnit`, an assignment without a strategy, and an action for a bucket not
//!   in the cache are dropped (the bucket keeps what it had);
//! - a bucket action with neither an assignment nor an abandon is installed as an empty
//!   assignment with no time to live: it expires at once.
//!
//! Where it does not: it connects at [`Envoy::start`] (Envoy, at the first request), and on a
//! failed stream it reconnects after [`EnvoySettings::reconnect_backoff`] and reports every
//! cached bucket at once (Envoy, at its next report tick). [`Expired::ReuseLast`] keeps the
//! last assignment for the expired-assignment timeout as Envoy's API documents; Envoy's code
//! ignores `reuse_last_assignment` and goes straight to the no-assignment behaviour. A token
//! bucket as no-assignment behaviour is enforced per bucket (Envoy crashes on it past the
//! first request).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket as WireTokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    BucketAction as WireAction, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as WireDuration;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tonic::codegen::tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Channel, Endpoint};

/// A bucket id: the `BucketId.bucket` map, ordered.
pub type Bucket = BTreeMap<String, String>;

/// The bucket with these `(key, value)` pairs.
pub fn bucket(pairs: &[(&str, &str)]) -> Bucket {
    pairs
        .iter()
        .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
        .collect()
}

/// A strategy the client applies on its own: Envoy's `no_assignment_behavior` and
/// `expired_assignment_behavior.fallback_rate_limit`.
#[derive(Clone, Debug)]
pub enum Fallback {
    /// Every request allowed.
    AllowAll,
    /// Every request denied.
    DenyAll,
    /// A token bucket per bucket, full when it starts.
    TokenBucket {
        /// The most tokens it holds, and the tokens it starts with.
        max_tokens: u32,
        /// Tokens added per `fill_interval`.
        tokens_per_fill: u32,
        /// The fill interval (Envoy truncates it to whole seconds).
        fill_interval: Duration,
    },
}

/// What a bucket follows once its assignment's time to live has run out, for
/// [`EnvoySettings::expired_timeout`]; after that it follows its no-assignment behaviour.
#[derive(Clone, Debug)]
pub enum Expired {
    /// No expired-assignment behaviour: straight to the no-assignment behaviour.
    NoAssignment,
    /// `fallback_rate_limit`: this strategy.
    Fallback(Fallback),
    /// `reuse_last_assignment`: the expired assignment's strategy (and its tokens).
    ReuseLast,
}

/// How an [`Envoy`] is configured.
#[derive(Clone, Debug)]
pub struct EnvoySettings {
    /// The domain every usage report carries.
    pub domain: String,
    /// The RLQS servers (plain HTTP/2), tried in turn, round robin.
    pub servers: Vec<SocketAddr>,
    /// How often every cached bucket is reported (Envoy: 5 s).
    pub report_interval: Duration,
    /// What a bucket without an assignment enforces.
    pub no_assignment: Fallback,
    /// What a bucket whose assignment expired enforces, for `expired_timeout`.
    pub expired: Expired,
    /// Envoy's `expired_assignment_behavior_timeout`: how long `expired` applies (whole
    /// seconds in Envoy, where unset means 0 s, which skips it). Default 15 s.
    pub expired_timeout: Duration,
    /// The pause before the next connection attempt after a stream ends or fails.
    pub reconnect_backoff: Duration,
}

impl EnvoySettings {
    /// Settings for `domain` on `servers`: reports every 5 s, no-assignment allows all, no
    /// expired-assignment behaviour (15 s if one is set), 100 ms between connection attempts.
    pub fn new(domain: &str, servers: Vec<SocketAddr>) -> Self {
        EnvoySettings {
            domain: domain.to_owned(),
            servers,
            report_interval: Duration::from_secs(5),
            no_assignment: Fallback::AllowAll,
            expired: Expired::NoAssignment,
            expired_timeout: Duration::from_secs(15),
            reconnect_backoff: Duration::from_millis(100),
        }
    }
}

/// What a bucket enforces now, as the tests see it.
#[derive(Clone, Debug, PartialEq)]
pub enum Enforced {
    /// No assignment (or none cached): the no-assignment behaviour.
    NoAssignment,
    /// An assignment of the blanket rule `ALLOW_ALL`.
    AllowAll,
    /// An assignment of the blanket rule `DENY_ALL`.
    DenyAll,
    /// An assignment of a token bucket.
    TokenBucket {
        /// `max_tokens` as sent.
        max_tokens: u32,
        /// `tokens_per_fill` as sent (0 if unset).
        tokens_per_fill: u32,
        /// `fill_interval` truncated to whole seconds, as Envoy reads it.
        fill_interval_secs: u64,
    },
    /// The assignment expired: the expired-assignment behaviour.
    Fallback,
}

/// How one request was decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Denied (by an assignment or by the Envoy's own behaviour).
    Denied,
    /// Allowed by the server's assignment in force.
    ByAssignment,
    /// Allowed by the Envoy's own behaviour: no assignment (yet, or any more) or an expired
    /// one. No server decided it.
    OnItsOwn,
}

/// A token bucket's parameters as sent (compared whole to tell a re-send from a change).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TokenSpec {
    max_tokens: u32,
    tokens_per_fill: u32,
    fill_seconds: i64,
    fill_nanos: i32,
}

impl TokenSpec {
    /// The fill interval as Envoy reads it: truncated to whole seconds (none below 0).
    fn interval_secs(&self) -> u64 {
        let nanos = i128::from(self.fill_seconds) * 1_000_000_000 + i128::from(self.fill_nanos);
        u64::try_from(nanos / 1_000_000_000).unwrap_or(0)
    }
}

/// A strategy being enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    AllowAll,
    DenyAll,
    TokenBucket(TokenSpec),
}

impl Fallback {
    fn rule(&self) -> Rule {
        match self {
            Fallback::AllowAll => Rule::AllowAll,
            Fallback::DenyAll => Rule::DenyAll,
            Fallback::TokenBucket {
                max_tokens,
                tokens_per_fill,
                fill_interval,
            } => Rule::TokenBucket(TokenSpec {
                max_tokens: *max_tokens,
                tokens_per_fill: *tokens_per_fill,
                fill_seconds: i64::try_from(fill_interval.as_secs()).unwrap_or(i64::MAX),
                fill_nanos: i32::try_from(fill_interval.subsec_nanos()).unwrap_or(0),
            }),
        }
    }
}

/// A token bucket's state, in exact units: one token is `interval_secs * 1e9` units and
/// every nanosecond adds `tokens_per_fill` units, so a whole fill interval adds exactly
/// `tokens_per_fill` tokens.
#[derive(Clone, Debug)]
struct Limiter {
    spec: TokenSpec,
    units: u128,
    at: Instant,
}

impl Limiter {
    fn full(spec: TokenSpec, now: Instant) -> Limiter {
        let mut limiter = Limiter {
            spec,
            units: 0,
            at: now,
        };
        limiter.units = limiter.capacity();
        limiter
    }

    fn per_token(&self) -> u128 {
        u128::from(self.spec.interval_secs()) * 1_000_000_000
    }

    fn capacity(&self) -> u128 {
        u128::from(self.spec.max_tokens).saturating_mul(self.per_token())
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_nanos();
        let added = elapsed.saturating_mul(u128::from(self.spec.tokens_per_fill));
        self.units = self.units.saturating_add(added).min(self.capacity());
        self.at = self.at.max(now);
    }

    /// Whole tokens available at `now`.
    fn tokens(&mut self, now: Instant) -> u128 {
        if self.per_token() == 0 {
            // A fill interval under a second: Envoy divides by zero, an endless fill rate.
            return u128::from(self.spec.max_tokens);
        }
        self.refill(now);
        self.units / self.per_token()
    }

    /// Takes one token if there is one.
    fn try_take(&mut self, now: Instant) -> bool {
        if self.tokens(now) == 0 {
            return false;
        }
        self.units = self.units.saturating_sub(self.per_token());
        true
    }
}

/// A strategy in force, with its token bucket if it is one.
#[derive(Clone, Debug)]
struct Active {
    rule: Rule,
    limiter: Option<Limiter>,
}

impl Active {
    /// Whether `rule` after `previous` keeps its tokens: both the same token bucket (Envoy's
    /// `shouldReplaceTokenBucket`). A token bucket that does not starts full.
    fn keeps_tokens(previous: Option<&Active>, rule: Rule) -> bool {
        matches!(
            (previous, rule),
            (Some(Active { rule: Rule::TokenBucket(old), limiter: Some(_) }), Rule::TokenBucket(new))
                if *old == new
        )
    }

    /// `rule`, keeping `previous`'s tokens if [`Active::keeps_tokens`], else a full bucket.
    fn new(rule: Rule, previous: Option<Active>, now: Instant) -> Active {
        let kept = Active::keeps_tokens(previous.as_ref(), rule);
        let limiter = match rule {
            Rule::TokenBucket(spec) => Some(match previous {
                Some(Active {
                    limiter: Some(limiter),
                    ..
                }) if kept => limiter,
                _ => Limiter::full(spec, now),
            }),
            _ => None,
        };
        Active { rule, limiter }
    }

    fn allows(&mut self, now: Instant) -> bool {
        match self.rule {
            Rule::AllowAll => true,
            Rule::DenyAll => false,
            Rule::TokenBucket(_) => self.limiter.as_mut().is_none_or(|l| l.try_take(now)),
        }
    }
}

/// Where a bucket is in its assignment's life.
#[derive(Clone, Debug)]
enum Phase {
    /// No assignment: the no-assignment behaviour.
    Unassigned,
    /// The server's assignment, until it expires.
    Assigned(Active, Instant),
    /// The expired-assignment behaviour, until it ends.
    Expired(Active, Instant),
}

/// What the client does on its own, from [`EnvoySettings`].
#[derive(Clone, Debug)]
struct Policy {
    no_assignment: Rule,
    expired: Expired,
    expired_timeout: Duration,
}

impl Policy {
    fn of(settings: &EnvoySettings) -> Policy {
        Policy {
            no_assignment: settings.no_assignment.rule(),
            expired: settings.expired.clone(),
            expired_timeout: settings.expired_timeout,
        }
    }
}

/// `at + span`, or far ahead if that overflows.
fn later(at: Instant, span: Duration) -> Instant {
    at.checked_add(span)
        .or_else(|| at.checked_add(Duration::from_secs(u64::from(u32::MAX))))
        .unwrap_or(at)
}

/// One cached bucket: its usage since its last report and what it enforces.
#[derive(Clone, Debug)]
struct BucketState {
    allowed: u64,
    denied: u64,
    /// Requests allowed by the Envoy's own behaviour (no assignment, or an expired one), over
    /// the bucket's life: what no server decided.
    allowed_on_its_own: u64,
    /// Each token bucket assignment that started full (a new one, or a different one than
    /// in force): when, and its `max_tokens`.
    fresh_fills: Vec<(Instant, u32)>,
    last_report: Instant,
    phase: Phase,
    /// The no-assignment behaviour, with its own tokens.
    default: Active,
}

impl BucketState {
    fn new(policy: &Policy, now: Instant) -> BucketState {
        BucketState {
            allowed: 0,
            denied: 0,
            allowed_on_its_own: 0,
            fresh_fills: Vec::new(),
            last_report: now,
            phase: Phase::Unassigned,
            default: Active::new(policy.no_assignment, None, now),
        }
    }

    /// Moves through the expirations due by `now`, each at the instant it was due.
    fn settle(&mut self, policy: &Policy, now: Instant) {
        loop {
            match self.phase {
                Phase::Assigned(_, expires) if now >= expires => self.expire(policy, expires),
                Phase::Expired(_, until) if now >= until => self.phase = Phase::Unassigned,
                _ => return,
            }
        }
    }

    fn expire(&mut self, policy: &Policy, at: Instant) {
        let Phase::Assigned(last, _) = std::mem::replace(&mut self.phase, Phase::Unassigned) else {
            return;
        };
        let until = later(at, policy.expired_timeout);
        self.phase = match &policy.expired {
            Expired::NoAssignment => Phase::Unassigned,
            Expired::ReuseLast => Phase::Expired(last, until),
            Expired::Fallback(fallback) => {
                Phase::Expired(Active::new(fallback.rule(), Some(last), at), until)
            }
        };
    }

    /// Installs `rule` for `ttl` from `now` (after [`settle`](Self::settle)).
    fn assign(&mut self, rule: Rule, ttl: Duration, now: Instant) {
        let previous = match std::mem::replace(&mut self.phase, Phase::Unassigned) {
            Phase::Unassigned => None,
            Phase::Assigned(active, _) | Phase::Expired(active, _) => Some(active),
        };
        let kept = Active::keeps_tokens(previous.as_ref(), rule);
        if let (Rule::TokenBucket(spec), false) = (rule, kept) {
            self.fresh_fills.push((now, spec.max_tokens));
        }
        self.phase = Phase::Assigned(Active::new(rule, previous, now), later(now, ttl));
    }

    /// Decides and counts one request (after [`settle`](Self::settle)).
    fn request(&mut self, now: Instant) -> Admission {
        let (allowed, on_its_own) = match &mut self.phase {
            Phase::Unassigned => (self.default.allows(now), true),
            Phase::Expired(active, _) => (active.allows(now), true),
            Phase::Assigned(active, _) => (active.allows(now), false),
        };
        if allowed {
            self.allowed += 1;
            self.allowed_on_its_own += u64::from(on_its_own);
        } else {
            self.denied += 1;
        }
        match (allowed, on_its_own) {
            (false, _) => Admission::Denied,
            (true, false) => Admission::ByAssignment,
            (true, true) => Admission::OnItsOwn,
        }
    }

    /// The usage since the last report, which it resets.
    fn usage(&mut self, bucket: &Bucket, now: Instant) -> BucketQuotaUsage {
        let elapsed = now.saturating_duration_since(self.last_report).as_secs();
        self.last_report = now;
        BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: bucket.clone().into_iter().collect(),
            }),
            time_elapsed: Some(WireDuration {
                seconds: i64::try_from(elapsed).unwrap_or(i64::MAX),
                nanos: 0,
            }),
            num_requests_allowed: std::mem::take(&mut self.allowed),
            num_requests_denied: std::mem::take(&mut self.denied),
        }
    }

    fn enforced(&self) -> Enforced {
        match &self.phase {
            Phase::Unassigned => Enforced::NoAssignment,
            Phase::Expired(..) => Enforced::Fallback,
            Phase::Assigned(active, _) => match active.rule {
                Rule::AllowAll => Enforced::AllowAll,
                Rule::DenyAll => Enforced::DenyAll,
                Rule::TokenBucket(spec) => Enforced::TokenBucket {
                    max_tokens: spec.max_tokens,
                    tokens_per_fill: spec.tokens_per_fill,
                    fill_interval_secs: spec.interval_secs(),
                },
            },
        }
    }

    /// When what it enforces changes next without a message.
    fn next_change(&self) -> Option<Instant> {
        match self.phase {
            Phase::Unassigned => None,
            Phase::Assigned(_, at) | Phase::Expired(_, at) => Some(at),
        }
    }
}

/// `{key=value,...}`.
fn show(bucket: &Bucket) -> String {
    let mut out = String::from("{");
    for (index, (key, value)) in bucket.iter().enumerate() {
        let comma = if index == 0 { "" } else { "," };
        let _ = write!(out, "{comma}{key}={value}");
    }
    out.push('}');
    out
}

/// The bucket cache of one Envoy and everything it received: the protocol state machine,
/// without the network.
#[derive(Debug)]
struct Buckets {
    policy: Policy,
    map: BTreeMap<Bucket, BucketState>,
    violations: Vec<String>,
    ttls: Vec<u64>,
    actions: Vec<(Bucket, String)>,
    /// When the cache was made: the action log's times count from it.
    born: Instant,
}

impl Buckets {
    fn new(policy: Policy) -> Buckets {
        Buckets {
            policy,
            map: BTreeMap::new(),
            violations: Vec::new(),
            ttls: Vec::new(),
            actions: Vec::new(),
            born: Instant::now(),
        }
    }

    /// Decides and counts one request; for a bucket not cached, creates it and returns its
    /// first report (the subscription). The unit tests' view of [`Buckets::admit`].
    #[cfg(test)]
    fn request(&mut self, bucket: &Bucket, now: Instant) -> (bool, Option<BucketQuotaUsage>) {
        let (admission, subscription) = self.admit(bucket, now);
        (admission != Admission::Denied, subscription)
    }

    /// Decides and counts one request, and how; for a bucket not cached, creates it and
    /// returns its first report (the subscription).
    fn admit(&mut self, bucket: &Bucket, now: Instant) -> (Admission, Option<BucketQuotaUsage>) {
        if let Some(state) = self.map.get_mut(bucket) {
            state.settle(&self.policy, now);
            return (state.request(now), None);
        }
        let mut state = BucketState::new(&self.policy, now);
        let admission = state.request(now);
        let usage = state.usage(bucket, now);
        self.map.insert(bucket.clone(), state);
        (admission, Some(usage))
    }

    /// The usage of every cached bucket since its last report, which it resets.
    fn report_all(&mut self, now: Instant) -> Vec<BucketQuotaUsage> {
        self.map
            .iter_mut()
            .map(|(bucket, state)| state.usage(bucket, now))
            .collect()
    }

    fn state(&mut self, bucket: &Bucket, now: Instant) -> Option<&mut BucketState> {
        let state = self.map.get_mut(bucket)?;
        state.settle(&self.policy, now);
        Some(state)
    }

    fn enforced(&mut self, bucket: &Bucket, now: Instant) -> Enforced {
        self.state(bucket, now)
            .map_or(Enforced::NoAssignment, |state| state.enforced())
    }

    fn ttl_left(&mut self, bucket: &Bucket, now: Instant) -> Option<Duration> {
        match self.state(bucket, now)?.phase {
            Phase::Assigned(_, expires) => Some(expires.saturating_duration_since(now)),
            _ => None,
        }
    }

    fn next_change(&mut self, bucket: &Bucket, now: Instant) -> Option<Instant> {
        self.state(bucket, now)?.next_change()
    }

    fn violation(&mut self, bucket: &Bucket, what: &str) {
        self.violations.push(format!("{}: {what}", show(bucket)));
    }

    fn log(&mut self, bucket: Bucket, summary: String) {
        let at = self.born.elapsed().as_secs_f64();
        self.actions.push((bucket, format!("{at:.2}s {summary}")));
    }

    /// Applies a response from the server, action by action, as Envoy does.
    fn apply(&mut self, response: &RateLimitQuotaResponse, now: Instant) {
        for action in &response.bucket_action {
            self.apply_action(action, now);
        }
    }

    fn apply_action(&mut self, action: &BucketAction, now: Instant) {
        let bucket: Bucket = action
            .bucket_id
            .as_ref()
            .map(|id| id.bucket.clone().into_iter().collect())
            .unwrap_or_default();
        if bucket.is_empty() {
            self.violation(
                &bucket,
                "bucket action without a bucket id (Envoy drops it)",
            );
            return self.log(bucket, "dropped: no bucket id".to_owned());
        }
        if !self.map.contains_key(&bucket) {
            self.violation(
                &bucket,
                "action for a bucket not reported or already abandoned (Envoy drops it)",
            );
            return self.log(bucket, "dropped: bucket not cached".to_owned());
        }
        match &action.bucket_action {
            Some(WireAction::QuotaAssignmentAction(assignment)) => {
                self.apply_assignment(bucket, assignment, now);
            }
            Some(WireAction::AbandonAction(_)) => {
                self.map.remove(&bucket);
                self.log(bucket, "abandon".to_owned());
            }
            None => self.apply_empty(bucket, now),
        }
    }

    /// Neither assignment nor abandon: Envoy caches the action as is, fails open on it and
    /// expires it at once (its time to live reads 0 s).
    fn apply_empty(&mut self, bucket: Bucket, now: Instant) {
        self.violation(
            &bucket,
            "bucket action with neither an assignment nor an abandon",
        );
        if let Some(state) = self.map.get_mut(&bucket) {
            state.settle(&self.policy, now);
            state.assign(Rule::AllowAll, Duration::ZERO, now);
        }
        self.log(bucket, "empty".to_owned());
    }

    fn apply_assignment(&mut self, bucket: Bucket, action: &QuotaAssignmentAction, now: Instant) {
        let ttl = self.read_ttl(&bucket, action.assignment_time_to_live.as_ref());
        self.ttls.push(ttl);
        let Some(rule) = self.read_strategy(&bucket, action.rate_limit_strategy.as_ref()) else {
            return self.log(bucket, format!("dropped: assignment ttl={ttl}s"));
        };
        if let Some(state) = self.map.get_mut(&bucket) {
            state.settle(&self.policy, now);
            state.assign(rule, Duration::from_secs(ttl), now);
        }
        self.log(bucket, format!("assign {rule:?} ttl={ttl}s"));
    }

    /// The time to live in whole seconds, as Envoy reads it (`seconds` only).
    fn read_ttl(&mut self, bucket: &Bucket, ttl: Option<&WireDuration>) -> u64 {
        let Some(ttl) = ttl else {
            self.violation(
                bucket,
                "assignment without assignment_time_to_live (read as 0 s)",
            );
            return 0;
        };
        if ttl.nanos != 0 {
            let what = format!("assignment_time_to_live with nanos {} (ignored)", ttl.nanos);
            self.violation(bucket, &what);
        }
        u64::try_from(ttl.seconds).unwrap_or_else(|_| {
            let what = format!("negative assignment_time_to_live {} s", ttl.seconds);
            self.violation(bucket, &what);
            0
        })
    }

    /// The strategy Envoy would enforce, or `None` for one it drops.
    fn read_strategy(
        &mut self,
        bucket: &Bucket,
        strategy: Option<&RateLimitStrategy>,
    ) -> Option<Rule> {
        let Some(strategy) = strategy.and_then(|s| s.strategy.as_ref()) else {
            self.violation(
                bucket,
                "assignment without a rate_limit_strategy (Envoy drops it)",
            );
            return None;
        };
        match strategy {
            Strategy::BlanketRule(rule) => Some(match BlanketRule::try_from(*rule) {
                Ok(BlanketRule::AllowAll) => Rule::AllowAll,
                Ok(BlanketRule::DenyAll) => Rule::DenyAll,
                Err(_) => {
                    let what = format!("unknown blanket rule {rule} (Envoy fails open)");
                    self.violation(bucket, &what);
                    Rule::AllowAll
                }
            }),
            Strategy::RequestsPerTimeUnit(_) => {
                self.violation(
                    bucket,
                    "RequestsPerTimeUnit strategy (unsupported: Envoy drops it)",
                );
                None
            }
            Strategy::TokenBucket(token_bucket) => {
                Some(self.read_token_bucket(bucket, token_bucket))
            }
        }
    }

    fn read_token_bucket(&mut self, bucket: &Bucket, sent: &WireTokenBucket) -> Rule {
        let tokens_per_fill = sent.tokens_per_fill.map_or(0, |value| value.value);
        let fill = sent.fill_interval.unwrap_or_default();
        let spec = TokenSpec {
            max_tokens: sent.max_tokens,
            tokens_per_fill,
            fill_seconds: fill.seconds,
            fill_nanos: fill.nanos,
        };
        let mut problems = Vec::new();
        if sent.max_tokens == 0 {
            problems.push("max_tokens 0 (denies all)".to_owned());
        }
        if tokens_per_fill == 0 {
            problems.push("tokens_per_fill unset or 0 (never refills)".to_owned());
        }
        if sent.fill_interval.is_none() {
            problems.push("fill_interval unset".to_owned());
        } else if fill.seconds < 1 {
            problems.push(format!(
                "fill_interval {}s under 1 s (Envoy divides by 0)",
                fill.seconds
            ));
        }
        if fill.nanos != 0 {
            problems.push(format!(
                "fill_interval with nanos {} (truncated)",
                fill.nanos
            ));
        }
        for problem in problems {
            self.violation(bucket, &format!("token bucket {problem}"));
        }
        Rule::TokenBucket(spec)
    }
}

/// An [`Envoy`]'s state, shared with its tasks.
struct Inner {
    buckets: Buckets,
    domain: String,
    /// The open stream's outbound messages, if a stream is open.
    outbound: Option<mpsc::UnboundedSender<RateLimitQuotaUsageReports>>,
    streams_opened: usize,
    disconnects: Vec<String>,
}

impl Inner {
    /// Sends a report on the open stream; without one it is lost, as in Envoy.
    fn send(&mut self, usages: Vec<BucketQuotaUsage>) {
        let Some(outbound) = &self.outbound else {
            return;
        };
        let message = RateLimitQuotaUsageReports {
            domain: self.domain.clone(),
            bucket_quota_usages: usages,
        };
        if outbound.send(message).is_err() {
            self.outbound = None;
        }
    }
}

struct Shared {
    inner: Mutex<Inner>,
    settings: EnvoySettings,
    /// Bumped whenever what a bucket enforces may have changed by a message or a stream.
    changes: watch::Sender<u64>,
    /// Signalled when a bucket is created: Envoy starts its report timer on the first one.
    bucket_created: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn changed(&self) {
        self.changes
            .send_modify(|generation| *generation = generation.wrapping_add(1));
    }
}

/// An emulated Envoy with the `rate_limit_quota` filter: one stream to one RLQS server at a
/// time, for one domain. Dropping it stops it.
pub struct Envoy {
    shared: Arc<Shared>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Envoy {
    /// Connects (spawns the stream task; returns once the first stream is open or after
    /// trying every server once). There is no connect timeout (it would fire early under
    /// paused time): a server that accepts but never answers the stream's headers keeps it
    /// waiting.
    pub async fn start(settings: EnvoySettings) -> Envoy {
        let inner = Inner {
            buckets: Buckets::new(Policy::of(&settings)),
            domain: settings.domain.clone(),
            outbound: None,
            streams_opened: 0,
            disconnects: Vec::new(),
        };
        let shared = Arc::new(Shared {
            inner: Mutex::new(inner),
            settings,
            changes: watch::Sender::new(0),
            bucket_created: Notify::new(),
        });
        let (ready, connected) = oneshot::channel();
        let tasks = vec![
            tokio::spawn(drive(Arc::clone(&shared), ready)),
            tokio::spawn(report(Arc::clone(&shared))),
        ];
        // An error means the stream task ended without trying (no servers).
        let _ = connected.await;
        Envoy {
            shared,
            tasks: Mutex::new(tasks),
        }
    }

    /// One request for `bucket`: decided locally from the bucket's current enforcement,
    /// counted as allowed or denied. Never awaits the server. A bucket not cached is created
    /// and reported at once (on the open stream; with none, the report is lost, as in Envoy).
    pub fn request(&self, bucket: &Bucket) -> bool {
        self.request_admission(bucket) != Admission::Denied
    }

    /// [`request`](Self::request), telling whether the server's assignment or the Envoy's
    /// own behaviour decided it.
    pub fn request_admission(&self, bucket: &Bucket) -> Admission {
        let (admission, created) = {
            let mut inner = self.shared.lock();
            let (admission, subscription) = inner.buckets.admit(bucket, Instant::now());
            let created = subscription.is_some();
            if let Some(usage) = subscription {
                inner.send(vec![usage]);
            }
            (admission, created)
        };
        if created {
            self.shared.bucket_created.notify_one();
            self.shared.changed();
        }
        admission
    }

    /// What `bucket` enforces now ([`Enforced::NoAssignment`] if it is not cached).
    pub fn enforced(&self, bucket: &Bucket) -> Enforced {
        self.shared.lock().buckets.enforced(bucket, Instant::now())
    }

    /// Remaining TTL of the bucket's assignment, if any (none once it expired).
    pub fn ttl_left(&self, bucket: &Bucket) -> Option<Duration> {
        self.shared.lock().buckets.ttl_left(bucket, Instant::now())
    }

    /// Waits until `check(enforced)` holds or `timeout` passes; returns whether it held.
    /// Woken whenever a message arrives or a stream opens or ends, and when the bucket's
    /// assignment or expired-assignment behaviour runs out.
    pub async fn wait_for(
        &self,
        bucket: &Bucket,
        timeout: Duration,
        check: impl Fn(&Enforced) -> bool,
    ) -> bool {
        let deadline = later(Instant::now(), timeout);
        let mut changes = self.shared.changes.subscribe();
        loop {
            changes.borrow_and_update();
            let now = Instant::now();
            let (enforced, next_change) = {
                let mut inner = self.shared.lock();
                let enforced = inner.buckets.enforced(bucket, now);
                (enforced, inner.buckets.next_change(bucket, now))
            };
            if check(&enforced) {
                return true;
            }
            if now >= deadline {
                return false;
            }
            let wake = next_change.map_or(deadline, |at| at.min(deadline));
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        tokio::time::sleep_until(wake).await;
                    }
                }
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// Bucket actions received so far (every `BucketAction` of every response, applied or
    /// dropped).
    pub fn actions_received(&self) -> usize {
        self.shared.lock().buckets.actions.len()
    }

    /// Every bucket action received, in order: its bucket (empty if it had none) and a
    /// summary after the seconds since the Envoy started (`1.25s assign AllowAll ttl=5s`,
    /// `abandon`, `dropped: ...`, `empty`).
    pub fn action_log(&self) -> Vec<(Bucket, String)> {
        self.shared.lock().buckets.actions.clone()
    }

    /// Each assignment TTL received (whole seconds as Envoy reads them; 0 when unset),
    /// including those of assignments Envoy drops for their strategy.
    pub fn ttls_received(&self) -> Vec<u64> {
        self.shared.lock().buckets.ttls.clone()
    }

    /// The protocol violations seen so far: what the server sent that Envoy drops, misreads
    /// or cannot enforce.
    pub fn violations(&self) -> Vec<String> {
        self.shared.lock().buckets.violations.clone()
    }

    /// The requests of `bucket` that this Envoy allowed on its own (without an assignment,
    /// or by its expired-assignment behaviour), over the bucket's life; 0 if not cached.
    pub fn allowed_on_its_own(&self, bucket: &Bucket) -> u64 {
        let shared = self.shared.lock();
        shared
            .buckets
            .map
            .get(bucket)
            .map_or(0, |state| state.allowed_on_its_own)
    }

    /// The tokens `bucket`'s token bucket assignments started with in `[from, to)`: each new
    /// or changed token bucket starts full (Envoy's `shouldReplaceTokenBucket`), so each is up
    /// to its `max_tokens` allowed at once beyond what the rates in force refill.
    pub fn fresh_tokens(&self, bucket: &Bucket, from: Instant, to: Instant) -> u64 {
        let shared = self.shared.lock();
        shared.buckets.map.get(bucket).map_or(0, |state| {
            state
                .fresh_fills
                .iter()
                .filter(|(at, _)| *at >= from && *at < to)
                .map(|(_, tokens)| u64::from(*tokens))
                .sum()
        })
    }

    /// The cached buckets, in order.
    pub fn buckets(&self) -> Vec<Bucket> {
        self.shared.lock().buckets.map.keys().cloned().collect()
    }

    /// Number of streams opened so far (reconnects).
    pub fn streams_opened(&self) -> usize {
        self.shared.lock().streams_opened
    }

    /// Why each connection attempt failed or each stream ended, in order.
    pub fn disconnects(&self) -> Vec<String> {
        self.shared.lock().disconnects.clone()
    }

    /// Stops the stream task and drops the connection (as an Envoy that leaves).
    pub fn stop(&self) {
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(PoisonError::into_inner));
        for task in tasks {
            task.abort();
        }
        self.shared.lock().outbound = None;
        self.shared.changed();
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The stream task: opens a stream to each server in turn and follows it until it ends.
async fn drive(shared: Arc<Shared>, ready: oneshot::Sender<()>) {
    let servers = shared.settings.servers.clone();
    let mut ready = Some(ready);
    for (attempt, server) in servers.iter().cycle().enumerate() {
        match open(&shared, *server).await {
            Ok((client, inbound)) => {
                signal(&mut ready);
                let ended = follow(&shared, inbound).await;
                drop(client);
                shared.lock().disconnects.push(format!("{server}: {ended}"));
            }
            Err(error) => shared.lock().disconnects.push(format!("{server}: {error}")),
        }
        shared.lock().outbound = None;
        shared.changed();
        if attempt + 1 >= servers.len() {
            signal(&mut ready);
        }
        tokio::time::sleep(shared.settings.reconnect_backoff).await;
    }
}

/// Lets [`Envoy::start`] return, the first time.
fn signal(ready: &mut Option<oneshot::Sender<()>>) {
    if let Some(ready) = ready.take() {
        let _ = ready.send(());
    }
}

type Inbound = tonic::Streaming<RateLimitQuotaResponse>;

/// Connects to `server` and opens a stream on which every cached bucket is reported first.
async fn open(
    shared: &Shared,
    server: SocketAddr,
) -> Result<(RateLimitQuotaServiceClient<Channel>, Inbound), String> {
    let endpoint = Endpoint::from_shared(format!("http://{server}"))
        .map_err(|error| format!("bad address: {error}"))?;
    let channel = endpoint
        .connect()
        .await
        .map_err(|error| format!("connect failed: {error}"))?;
    let mut client = RateLimitQuotaServiceClient::new(channel);
    let (outbound, messages) = mpsc::unbounded_channel();
    {
        let mut inner = shared.lock();
        inner.outbound = Some(outbound);
        let usages = inner.buckets.report_all(Instant::now());
        if !usages.is_empty() {
            inner.send(usages);
        }
    }
    let response = client
        .stream_rate_limit_quotas(UnboundedReceiverStream::new(messages))
        .await
        .map_err(|status| format!("stream refused: {status}"))?;
    shared.lock().streams_opened += 1;
    shared.changed();
    Ok((client, response.into_inner()))
}

/// Applies every response on `inbound` until the stream ends; returns how it ended.
async fn follow(shared: &Shared, mut inbound: Inbound) -> String {
    loop {
        match inbound.message().await {
            Ok(Some(response)) => {
                shared.lock().buckets.apply(&response, Instant::now());
                shared.changed();
            }
            Ok(None) => return "stream ended by the server".to_owned(),
            Err(status) => return format!("stream failed: {status}"),
        }
    }
}

/// The report task: from the first bucket on, every report interval, reports every cached
/// bucket (lost if no stream is open, as in Envoy).
async fn report(shared: Arc<Shared>) {
    shared.bucket_created.notified().await;
    let period = shared
        .settings
        .report_interval
        .max(Duration::from_millis(1));
    let mut ticker = tokio::time::interval_at(later(Instant::now(), period), period);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let mut inner = shared.lock();
        let usages = inner.buckets.report_all(Instant::now());
        inner.send(usages);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::RequestsPerTimeUnit;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::AbandonAction;
    use envoy_types::pb::google::protobuf::UInt32Value;

    fn secs(seconds: i64) -> Option<WireDuration> {
        Some(WireDuration { seconds, nanos: 0 })
    }

    fn token_bucket(max_tokens: u32, tokens_per_fill: u32, fill_secs: i64) -> RateLimitStrategy {
        RateLimitStrategy {
            strategy: Some(Strategy::TokenBucket(WireTokenBucket {
                max_tokens,
                tokens_per_fill: Some(UInt32Value {
                    value: tokens_per_fill,
                }),
                fill_interval: secs(fill_secs),
            })),
        }
    }

    fn blanket(rule: BlanketRule) -> RateLimitStrategy {
        RateLimitStrategy {
            strategy: Some(Strategy::BlanketRule(rule as i32)),
        }
    }

    fn action(bucket: &Bucket, action: Option<WireAction>) -> RateLimitQuotaResponse {
        RateLimitQuotaResponse {
            bucket_action: vec![BucketAction {
                bucket_id: Some(BucketId {
                    bucket: bucket.clone().into_iter().collect(),
                }),
                bucket_action: action,
            }],
        }
    }

    fn assign(
        bucket: &Bucket,
        ttl: Option<WireDuration>,
        strategy: RateLimitStrategy,
    ) -> RateLimitQuotaResponse {
        let assignment = QuotaAssignmentAction {
            assignment_time_to_live: ttl,
            rate_limit_strategy: Some(strategy),
        };
        action(bucket, Some(WireAction::QuotaAssignmentAction(assignment)))
    }

    fn policy(no_assignment: Fallback, expired: Expired, timeout_secs: u64) -> Policy {
        Policy {
            no_assignment: no_assignment.rule(),
            expired,
            expired_timeout: Duration::from_secs(timeout_secs),
        }
    }

    fn allow_all() -> Buckets {
        Buckets::new(policy(Fallback::AllowAll, Expired::NoAssignment, 15))
    }

    /// An [`allow_all`] cache whose bucket `k: v` has been requested (so reported) once, at
    /// the instant returned.
    fn reported() -> (Buckets, Bucket, Instant) {
        let mut buckets = allow_all();
        let start = Instant::now();
        let key = bucket(&[("k", "v")]);
        buckets.request(&key, start);
        (buckets, key, start)
    }

    fn at(start: Instant, millis: u64) -> Instant {
        start + Duration::from_millis(millis)
    }

    fn allowed_in_a_row(buckets: &mut Buckets, bucket: &Bucket, now: Instant) -> usize {
        (0..1000)
            .take_while(|_| buckets.request(bucket, now).0)
            .count()
    }

    #[test]
    fn a_new_bucket_is_reported_at_once_with_its_first_request() {
        let mut buckets = allow_all();
        let start = Instant::now();
        let key = bucket(&[("tenant", "a")]);
        let (allowed, usage) = buckets.request(&key, start);
        assert!(allowed);
        let usage = usage.expect("the subscription report");
        assert_eq!(usage.num_requests_allowed, 1);
        assert_eq!(usage.num_requests_denied, 0);
        assert_eq!(usage.time_elapsed, secs(0));
        assert_eq!(usage.bucket_id.map(|id| id.bucket.len()), Some(1));
        assert!(buckets.request(&key, start).1.is_none());
        assert_eq!(buckets.enforced(&key, start), Enforced::NoAssignment);
    }

    #[test]
    fn periodic_reports_count_since_the_last_and_truncate_seconds() {
        let mut buckets = Buckets::new(policy(Fallback::DenyAll, Expired::NoAssignment, 0));
        let start = Instant::now();
        let key = bucket(&[("k", "v")]);
        assert!(!buckets.request(&key, start).0);
        buckets.request(&key, at(start, 100));
        buckets.request(&key, at(start, 200));
        let usages = buckets.report_all(at(start, 5_999));
        assert_eq!(usages.len(), 1);
        assert_eq!(usages[0].num_requests_denied, 2);
        assert_eq!(usages[0].time_elapsed, secs(5));
        let usages = buckets.report_all(at(start, 11_000));
        assert_eq!(usages[0].num_requests_denied, 0);
        assert_eq!(usages[0].time_elapsed, secs(5));
    }

    #[test]
    fn a_token_bucket_starts_full_and_refills_at_its_rate() {
        let (mut buckets, key, start) = reported();
        buckets.apply(&assign(&key, secs(3600), token_bucket(5, 2, 10)), start);
        assert_eq!(
            buckets.enforced(&key, start),
            Enforced::TokenBucket {
                max_tokens: 5,
                tokens_per_fill: 2,
                fill_interval_secs: 10
            }
        );
        assert_eq!(allowed_in_a_row(&mut buckets, &key, start), 5);
        // 2 tokens per 10 s: one after 5 s, none more until 10 s.
        assert_eq!(allowed_in_a_row(&mut buckets, &key, at(start, 4_999)), 0);
        assert_eq!(allowed_in_a_row(&mut buckets, &key, at(start, 5_000)), 1);
        assert_eq!(allowed_in_a_row(&mut buckets, &key, at(start, 9_999)), 0);
        assert_eq!(allowed_in_a_row(&mut buckets, &key, at(start, 10_000)), 1);
        // A whole fill interval adds exactly tokens_per_fill; never beyond max_tokens.
        assert_eq!(allowed_in_a_row(&mut buckets, &key, at(start, 20_000)), 2);
        assert_eq!(
            allowed_in_a_row(&mut buckets, &key, at(start, 1_000_000)),
            5
        );
        assert!(buckets.violations.is_empty(), "{:?}", buckets.violations);
    }

    #[test]
    fn an_identical_token_bucket_keeps_its_tokens_and_a_different_one_starts_full() {
        let (mut buckets, key, start) = reported();
        buckets.apply(&assign(&key, secs(2), token_bucket(3, 1, 60)), start);
        assert_eq!(allowed_in_a_row(&mut buckets, &key, start), 3);
        let resend = at(start, 1_000);
        buckets.apply(&assign(&key, secs(2), token_bucket(3, 1, 60)), resend);
        assert_eq!(buckets.ttl_left(&key, resend), Some(Duration::from_secs(2)));
        assert_eq!(allowed_in_a_row(&mut buckets, &key, resend), 0);
        let change = at(start, 2_000);
        buckets.apply(&assign(&key, secs(2), token_bucket(4, 1, 60)), change);
        assert_eq!(allowed_in_a_row(&mut buckets, &key, change), 4);
        // A blanket rule in between: the same token bucket again starts over, full.
        buckets.apply(
            &assign(&key, secs(2), blanket(BlanketRule::DenyAll)),
            change,
        );
        buckets.apply(&assign(&key, secs(2), token_bucket(4, 1, 60)), change);
        assert_eq!(allowed_in_a_row(&mut buckets, &key, change), 4);
    }

    #[test]
    fn a_ttl_is_read_in_whole_seconds() {
        let (mut buckets, key, start) = reported();
        let ttl = Some(WireDuration {
            seconds: 3,
            nanos: 900_000_000,
        });
        buckets.apply(&assign(&key, ttl, blanket(BlanketRule::DenyAll)), start);
        assert_eq!(buckets.ttls, vec![3]);
        assert_eq!(buckets.ttl_left(&key, start), Some(Duration::from_secs(3)));
        assert_eq!(buckets.enforced(&key, at(start, 2_999)), Enforced::DenyAll);
        assert_eq!(
            buckets.enforced(&key, at(start, 3_000)),
            Enforced::NoAssignment
        );
        assert_eq!(buckets.ttl_left(&key, at(start, 3_000)), None);
        assert_eq!(buckets.violations.len(), 1);
        assert!(
            buckets.violations[0].contains("nanos"),
            "{:?}",
            buckets.violations
        );
    }

    #[test]
    fn a_missing_or_zero_ttl_expires_at_once() {
        let (mut buckets, key, start) = reported();
        buckets.apply(&assign(&key, secs(0), blanket(BlanketRule::DenyAll)), start);
        assert_eq!(buckets.enforced(&key, start), Enforced::NoAssignment);
        assert!(buckets.violations.is_empty());
        buckets.apply(&assign(&key, None, blanket(BlanketRule::DenyAll)), start);
        assert_eq!(buckets.enforced(&key, start), Enforced::NoAssignment);
        assert_eq!(buckets.ttls, vec![0, 0]);
        assert_eq!(buckets.violations.len(), 1);
        assert!(buckets.violations[0].contains("assignment_time_to_live"));
    }

    #[test]
    fn an_expired_assignment_falls_back_then_to_no_assignment() {
        let fallback = Expired::Fallback(Fallback::DenyAll);
        let mut buckets = Buckets::new(policy(Fallback::AllowAll, fallback, 10));
        let start = Instant::now();
        let key = bucket(&[("k", "v")]);
        buckets.request(&key, start);
        buckets.apply(
            &assign(&key, secs(5), blanket(BlanketRule::AllowAll)),
            start,
        );
        assert_eq!(buckets.enforced(&key, at(start, 4_999)), Enforced::AllowAll);
        assert_eq!(buckets.next_change(&key, start), Some(at(start, 5_000)));
        assert_eq!(buckets.enforced(&key, at(start, 5_000)), Enforced::Fallback);
        assert!(!buckets.request(&key, at(start, 5_000)).0);
        assert_eq!(
            buckets.next_change(&key, at(start, 5_000)),
            Some(at(start, 15_000))
        );
        assert_eq!(
            buckets.enforced(&key, at(start, 14_999)),
            Enforced::Fallback
        );
        assert_eq!(
            buckets.enforced(&key, at(start, 15_000)),
            Enforced::NoAssignment
        );
        assert!(buckets.request(&key, at(start, 15_000)).0);
        assert_eq!(buckets.next_change(&key, at(start, 15_000)), None);
    }

    #[test]
    fn expiry_is_counted_from_when_it_was_due_not_when_it_is_seen() {
        let fallback = Expired::Fallback(Fallback::DenyAll);
        let mut buckets = Buckets::new(policy(Fallback::AllowAll, fallback, 10));
        let start = Instant::now();
        let key = bucket(&[("k", "v")]);
        buckets.request(&key, start);
        buckets.apply(&assign(&key, secs(5), blanket(BlanketRule::DenyAll)), start);
        // First looked at long after both the TTL and the fallback ran out.
        assert_eq!(
            buckets.enforced(&key, at(start, 60_000)),
            Enforced::NoAssignment
        );
    }

    #[test]
    fn reuse_last_keeps_the_last_token_bucket_with_its_tokens() {
        let mut buckets = Buckets::new(policy(Fallback::DenyAll, Expired::ReuseLast, 10));
        let start = Instant::now();
        let key = bucket(&[("k", "v")]);
        buckets.request(&key, start);
        buckets.apply(&assign(&key, secs(1), token_bucket(2, 1, 3600)), start);
        assert!(buckets.request(&key, start).0);
        let expired = at(start, 1_000);
        assert_eq!(buckets.enforced(&key, expired), Enforced::Fallback);
        assert_eq!(allowed_in_a_row(&mut buckets, &key, expired), 1);
        assert!(
            !buckets.request(&key, at(start, 11_000)).0,
            "no-assignment denies all"
        );
    }

    #[test]
    fn a_fallback_token_bucket_keeps_the_tokens_of_the_same_assigned_one() {
        let same = Fallback::TokenBucket {
            max_tokens: 2,
            tokens_per_fill: 1,
            fill_interval: Duration::from_secs(3600),
        };
        let mut buckets = Buckets::new(policy(Fallback::AllowAll, Expired::Fallback(same), 60));
        let start = Instant::now();
        let key = bucket(&[("k", "v")]);
        buckets.request(&key, start);
        buckets.apply(&assign(&key, secs(1), token_bucket(2, 1, 3600)), start);
        assert_eq!(allowed_in_a_row(&mut buckets, &key, start), 2);
        assert_eq!(allowed_in_a_row(&mut buckets, &key, at(start, 1_000)), 0);
        // A different token bucket as fallback starts full.
        let other = Fallback::TokenBucket {
            max_tokens: 3,
            tokens_per_fill: 1,
            fill_interval: Duration::from_secs(3600),
        };
        let mut buckets = Buckets::new(policy(Fallback::AllowAll, Expired::Fallback(other), 60));
        buckets.request(&key, start);
        buckets.apply(&assign(&key, secs(1), token_bucket(2, 1, 3600)), start);
        assert_eq!(allowed_in_a_row(&mut buckets, &key, start), 2);
        assert_eq!(allowed_in_a_row(&mut buckets, &key, at(start, 1_000)), 3);
    }

    #[test]
    fn abandon_forgets_the_bucket_and_a_later_request_subscribes_again() {
        let (mut buckets, key, start) = reported();
        buckets.apply(
            &assign(&key, secs(60), blanket(BlanketRule::DenyAll)),
            start,
        );
        buckets.apply(
            &action(&key, Some(WireAction::AbandonAction(AbandonAction {}))),
            start,
        );
        assert!(buckets.map.is_empty());
        assert_eq!(buckets.enforced(&key, start), Enforced::NoAssignment);
        let (allowed, usage) = buckets.request(&key, start);
        assert!(allowed);
        assert!(usage.is_some());
        assert!(buckets.violations.is_empty());
        assert_eq!(buckets.actions.len(), 2);
    }

    #[test]
    fn actions_for_buckets_not_cached_are_dropped_and_recorded() {
        let mut buckets = allow_all();
        let start = Instant::now();
        let key = bucket(&[("k", "v")]);
        buckets.apply(
            &assign(&key, secs(60), blanket(BlanketRule::DenyAll)),
            start,
        );
        assert!(buckets.map.is_empty());
        assert_eq!(buckets.violations.len(), 1);
        assert!(buckets.violations[0].contains("not reported"));
        buckets.apply(&action(&Bucket::new(), None), start);
        assert!(buckets.violations[1].contains("without a bucket id"));
        assert_eq!(buckets.actions.len(), 2);
    }

    #[test]
    fn requests_per_time_unit_is_dropped_and_recorded() {
        let (mut buckets, key, start) = reported();
        buckets.apply(
            &assign(&key, secs(60), blanket(BlanketRule::DenyAll)),
            start,
        );
        let per_unit = RateLimitStrategy {
            strategy: Some(Strategy::RequestsPerTimeUnit(RequestsPerTimeUnit {
                requests_per_time_unit: 10,
                time_unit: 1,
            })),
        };
        buckets.apply(&assign(&key, secs(60), per_unit), start);
        assert_eq!(
            buckets.enforced(&key, start),
            Enforced::DenyAll,
            "the action is dropped"
        );
        assert_eq!(buckets.violations.len(), 1);
        assert!(buckets.violations[0].contains("RequestsPerTimeUnit"));
        let unset = RateLimitStrategy { strategy: None };
        buckets.apply(&assign(&key, secs(60), unset), start);
        assert!(buckets.violations[1].contains("without a rate_limit_strategy"));
        assert_eq!(buckets.ttls, vec![60, 60, 60]);
    }

    #[test]
    fn an_action_with_neither_assignment_nor_abandon_expires_at_once() {
        let fallback = Expired::Fallback(Fallback::DenyAll);
        let mut buckets = Buckets::new(policy(Fallback::AllowAll, fallback, 10));
        let start = Instant::now();
        let key = bucket(&[("k", "v")]);
        buckets.request(&key, start);
        buckets.apply(&action(&key, None), start);
        assert_eq!(buckets.enforced(&key, start), Enforced::Fallback);
        assert_eq!(buckets.violations.len(), 1);
        assert!(buckets.violations[0].contains("neither"));
    }

    #[test]
    fn token_bucket_pitfalls_are_recorded() {
        let (mut buckets, key, start) = reported();
        let bad = |max_tokens, tokens_per_fill, fill_interval| RateLimitStrategy {
            strategy: Some(Strategy::TokenBucket(WireTokenBucket {
                max_tokens,
                tokens_per_fill,
                fill_interval,
            })),
        };
        let one = Some(UInt32Value { value: 1 });
        let half = Some(WireDuration {
            seconds: 0,
            nanos: 500_000_000,
        });
        let cases = [
            (bad(0, one, secs(1)), "max_tokens 0"),
            (bad(1, None, secs(1)), "tokens_per_fill unset or 0"),
            (
                bad(1, Some(UInt32Value { value: 0 }), secs(1)),
                "tokens_per_fill unset or 0",
            ),
            (bad(1, one, None), "fill_interval unset"),
            (bad(1, one, secs(0)), "under 1 s"),
        ];
        for (strategy, problem) in cases {
            buckets.violations.clear();
            buckets.apply(&assign(&key, secs(60), strategy), start);
            assert_eq!(
                buckets.violations.len(),
                1,
                "{problem}: {:?}",
                buckets.violations
            );
            assert!(
                buckets.violations[0].contains(problem),
                "{:?}",
                buckets.violations
            );
        }
        buckets.violations.clear();
        buckets.apply(&assign(&key, secs(60), bad(1, one, half)), start);
        assert_eq!(buckets.violations.len(), 2, "{:?}", buckets.violations);
        assert!(buckets.violations[1].contains("nanos"));
    }

    #[test]
    fn degenerate_token_buckets_behave_as_in_envoy() {
        let (mut buckets, key, start) = reported();
        buckets.apply(&assign(&key, secs(60), token_bucket(0, 1, 1)), start);
        assert!(!buckets.request(&key, start).0, "max_tokens 0 denies");
        buckets.apply(&assign(&key, secs(60), token_bucket(1, 1, 0)), start);
        assert_eq!(
            allowed_in_a_row(&mut buckets, &key, start),
            1000,
            "an endless fill rate"
        );
        buckets.apply(&assign(&key, secs(60), token_bucket(1, 0, 1)), start);
        assert!(buckets.request(&key, start).0);
        assert!(!buckets.request(&key, at(start, 59_000)).0, "never refills");
    }

    #[test]
    fn a_token_bucket_as_no_assignment_behaviour_is_per_bucket() {
        let limited = Fallback::TokenBucket {
            max_tokens: 2,
            tokens_per_fill: 1,
            fill_interval: Duration::from_secs(60),
        };
        let mut buckets = Buckets::new(policy(limited, Expired::NoAssignment, 0));
        let start = Instant::now();
        let a = bucket(&[("k", "a")]);
        let b = bucket(&[("k", "b")]);
        assert_eq!(allowed_in_a_row(&mut buckets, &a, start), 2);
        assert_eq!(allowed_in_a_row(&mut buckets, &b, start), 2);
    }

    #[test]
    fn shows_buckets_in_key_order() {
        assert_eq!(show(&bucket(&[("b", "2"), ("a", "1")])), "{a=1,b=2}");
        assert_eq!(show(&Bucket::new()), "{}");
    }

    /// Against a real (test) RLQS server over gRPC.
    mod served {
        use super::*;
        use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
            RateLimitQuotaService, RateLimitQuotaServiceServer,
        };
        use tonic::transport::server::TcpIncoming;
        use tonic::{Request, Response, Status};

        type Seen = mpsc::UnboundedSender<(usize, RateLimitQuotaUsageReports)>;

        /// Assigns `rule` for 60 s to every bucket of every report; ends its streams with
        /// UNAVAILABLE when `end` is notified.
        struct TestServer {
            id: usize,
            rule: BlanketRule,
            seen: Seen,
            end: Arc<Notify>,
        }

        type Replies = UnboundedReceiverStream<Result<RateLimitQuotaResponse, Status>>;

        #[tonic::async_trait]
        impl RateLimitQuotaService for TestServer {
            type StreamRateLimitQuotasStream = Replies;

            async fn stream_rate_limit_quotas(
                &self,
                request: Request<tonic::Streaming<RateLimitQuotaUsageReports>>,
            ) -> Result<Response<Replies>, Status> {
                let mut inbound = request.into_inner();
                let (replies, stream) = mpsc::unbounded_channel();
                let (id, rule, seen, end) =
                    (self.id, self.rule, self.seen.clone(), self.end.clone());
                tokio::spawn(async move {
                    loop {
                        tokio::select! {
                            () = end.notified() => {
                                let _ = replies.send(Err(Status::unavailable("going away")));
                                return;
                            }
                            message = inbound.message() => {
                                let Ok(Some(report)) = message else { return };
                                for usage in &report.bucket_quota_usages {
                                    let id = usage.bucket_id.clone().unwrap_or_default();
                                    let bucket: Bucket = id.bucket.into_iter().collect();
                                    let _ = replies.send(Ok(assign(&bucket, secs(60), blanket(rule))));
                                }
                                let _ = seen.send((id, report));
                            }
                        }
                    }
                });
                Ok(Response::new(UnboundedReceiverStream::new(stream)))
            }
        }

        async fn serve(id: usize, rule: BlanketRule, seen: &Seen) -> (SocketAddr, Arc<Notify>) {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let address = listener.local_addr().expect("address");
            let end = Arc::new(Notify::new());
            let server = TestServer {
                id,
                rule,
                seen: seen.clone(),
                end: end.clone(),
            };
            let router = tonic::transport::Server::builder()
                .add_service(RateLimitQuotaServiceServer::new(server));
            tokio::spawn(router.serve_with_incoming(TcpIncoming::from(listener)));
            (address, end)
        }

        async fn next_report(
            seen: &mut mpsc::UnboundedReceiver<(usize, RateLimitQuotaUsageReports)>,
        ) -> (usize, RateLimitQuotaUsageReports) {
            tokio::time::timeout(Duration::from_secs(10), seen.recv())
                .await
                .expect("a report within 10 s")
                .expect("the servers run")
        }

        #[tokio::test]
        async fn subscribes_follows_assignments_reports_and_fails_over() {
            let (seen_tx, mut seen) = mpsc::unbounded_channel();
            let (first, end_first) = serve(0, BlanketRule::DenyAll, &seen_tx).await;
            let (second, _end_second) = serve(1, BlanketRule::AllowAll, &seen_tx).await;
            let mut settings = EnvoySettings::new("d", vec![first, second]);
            settings.report_interval = Duration::from_millis(200);
            let envoy = Envoy::start(settings).await;
            assert_eq!(envoy.streams_opened(), 1, "{:?}", envoy.disconnects());
            let key = bucket(&[("tenant", "a")]);
            assert!(envoy.request(&key), "no assignment yet: allowed");

            let (server, report) = next_report(&mut seen).await;
            assert_eq!((server, report.domain.as_str()), (0, "d"));
            let usage = &report.bucket_quota_usages[0];
            assert_eq!(usage.num_requests_allowed, 1);
            assert_eq!(usage.time_elapsed, secs(0));
            let timeout = Duration::from_secs(10);
            assert!(
                envoy
                    .wait_for(&key, timeout, |e| *e == Enforced::DenyAll)
                    .await
            );
            assert!(!envoy.request(&key));
            assert_eq!(
                envoy.ttl_left(&key).map(|ttl| ttl.as_secs() >= 59),
                Some(true)
            );

            // The periodic report counts the denial.
            loop {
                let (_, report) = next_report(&mut seen).await;
                if report
                    .bucket_quota_usages
                    .iter()
                    .any(|u| u.num_requests_denied == 1)
                {
                    break;
                }
            }
            // The first server ends the stream: the next one gets the cached bucket at once.
            end_first.notify_one();
            loop {
                let (server, report) = next_report(&mut seen).await;
                if server == 1 {
                    assert_eq!(report.bucket_quota_usages.len(), 1);
                    break;
                }
            }
            assert!(
                envoy
                    .wait_for(&key, timeout, |e| *e == Enforced::AllowAll)
                    .await
            );
            assert_eq!(envoy.streams_opened(), 2);
            assert_eq!(envoy.buckets(), vec![key.clone()]);
            assert!(envoy.violations().is_empty(), "{:?}", envoy.violations());
            assert!(envoy.ttls_received().iter().all(|ttl| *ttl == 60));
            assert!(envoy.actions_received() >= 2);
            envoy.stop();
            assert!(envoy.request(&key), "the assignment outlives the stream");
        }
    }
}
