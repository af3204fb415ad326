//! `ShouldRateLimit`'s decision in floodgate's own terms, whatever protocol asked: a request's
//! descriptors matched against its domain's rules ([`matched`]), planned into checks
//! ([`plan`]), every counted one decided in one `check_and_consume` call, all or nothing, those
//! in shadow mode or with `count_every_hit` each on its own, first ([`Decider`]), and each
//! answered and counted under the library's [`Outcome`] ([`answers`]). Envoy's messages are
//! converted to and from these at the edge, in [`super::service`].

use std::sync::{Arc, Mutex};
use std::time::Instant;

use floodgate::decision::{DecisionSource, LimitStatus};
use floodgate::fallback::{DecidedBy, decide_or_fall_back, settle_or_fall_back};
use floodgate::key::{IdentityHash, storage_key};
use floodgate::telemetry;
use floodgate::{Decision, FailurePolicy, OnStoreError, Outcome, Store, store::Check};
use sha2::{Digest, Sha256};

use super::rules::{Action, DescriptorLimit, Match, Node};
use crate::gateway::Gateway;

/// A request to decide: its domain, its hits, its descriptors.
pub(crate) struct Request<'a> {
    /// The domain whose rules apply.
    pub(crate) domain: &'a str,
    /// The hits of every descriptor without its own (`0` means 1).
    pub(crate) hits_addend: u32,
    /// The descriptors, answered in this order.
    pub(crate) descriptors: Vec<Descriptor<'a>>,
}

/// One descriptor of a [`Request`].
pub(crate) struct Descriptor<'a> {
    /// Its entries, `(key, value)`, in order.
    pub(crate) entries: Vec<(&'a str, &'a str)>,
    /// Its own hits, in place of the request's.
    pub(crate) hits_addend: Option<u64>,
    /// Whether it asks to give hits back (refused: nothing is refunded here).
    pub(crate) negative_hits: bool,
    /// The limit the caller set for it, deciding in place of the rules (Envoy's `limit`
    /// override).
    pub(crate) limit: Option<Arc<DescriptorLimit>>,
}

/// Why a request is not decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A descriptor asks to give hits back.
    NegativeHits,
    /// The store failed under `on_store_error: closed`.
    Unavailable,
}

/// The scope of RLS identities in storage keys: `<prefix>:{rls:<hash>}:<domain>:<name>`.
const SCOPE: &str = "rls";

/// The identity of one request descriptor: the first 16 bytes of SHA-256 over the domain and
/// every entry, each length-prefixed so that no two entry lists hash alike by concatenation.
/// Descriptor values (client IPs, user ids) never appear raw in keys, logs or labels. An
/// entry matched by a `share_threshold` wildcard hashes as its pattern (marked, so that it is
/// never the hash of a literal value), so every value it matches shares one counter.
fn descriptor_hash(
    domain: &str,
    entries: &[(&str, &str)],
    shared_values: &[Option<&str>],
) -> IdentityHash {
    let mut hasher = Sha256::new();
    let mut field = |marker: u8, text: &str| {
        hasher.update([marker]);
        hasher.update((text.len() as u64).to_be_bytes());
        hasher.update(text.as_bytes());
    };
    field(0, domain);
    for (index, (key, value)) in entries.iter().enumerate() {
        field(0, key);
        match shared_values.get(index).copied().flatten() {
            Some(pattern) => field(1, pattern),
            None => field(0, value),
        }
    }
    let digest = hasher.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    IdentityHash(bytes)
}

/// A domain's text as it may appear in a storage key (no `:`, `{` or `}`).
fn key_safe(domain: &str) -> String {
    floodgate::key::key_part(domain, floodgate::key::KeyChars::Text)
}

/// How one descriptor of the request is decided.
enum Slot<'r> {
    /// No configured descriptor matches: `OK`, no limit.
    NoLimit,
    /// Matched an `unlimited` one, or a counted one of `requests_per_unit: 0`.
    Fixed(&'r DescriptorLimit),
    /// Counted: index into the enforced checks, or into those decided apart (shadow mode,
    /// `count_every_hit`).
    Counted {
        limit: &'r DescriptorLimit,
        index: usize,
    },
}

/// The decision of the enforced checks, or why there is none.
enum Enforced {
    Decided(Decision),
    /// The store failed and `open` admits.
    FailedOpen,
}

/// A request's descriptors as they matched: the caller's limit where one came, else the tree.
pub(crate) fn matched<'r>(tree: &'r Node, request: &'r Request<'_>) -> Vec<Option<Match<'r>>> {
    request
        .descriptors
        .iter()
        .map(|descriptor| {
            if let Some(limit) = &descriptor.limit {
                return Some(Match {
                    limit,
                    shared_values: Vec::new(),
                });
            }
            tree.find(descriptor.entries.iter().copied())
        })
        .collect()
}

/// What a request's matched descriptors ask of the store.
pub(crate) struct Planned<'r> {
    slots: Vec<Slot<'r>>,
    /// Decided together, all or nothing.
    enforced: Vec<Check>,
    /// Decided one by one: shadow mode (never enforced) and `count_every_hit`.
    apart: Vec<Apart<'r>>,
    /// A `requests_per_unit: 0` descriptor (not shadowed) refuses the request.
    deny_all: bool,
}

/// The decisions of a plan.
pub(crate) struct Decided {
    enforced: Option<Enforced>,
    apart: Vec<Enforced>,
    admitted: bool,
}

impl Decided {
    /// Whether the request is admitted: no descriptor refused it.
    pub(crate) fn admitted(&self) -> bool {
        self.admitted
    }

    /// The store's (or the node limiter's) decision of the all-or-nothing descriptors, when
    /// there was one: what the rate limit headers describe.
    pub(crate) fn enforced(&self) -> Option<&Decision> {
        match &self.enforced {
            Some(Enforced::Decided(decision)) => Some(decision),
            _ => None,
        }
    }
}

/// A descriptor decided on its own ([`DescriptorLimit::decided_apart`]).
struct Apart<'r> {
    limit: &'r DescriptorLimit,
    check: Check,
    /// A `count_every_hit` descriptor's own `hits_addend: 0`: what one hit would get, nothing
    /// counted.
    check_only: bool,
}

/// Plans the checks of `matched` (the request's descriptors as they matched), keys under
/// `prefix`.
pub(crate) fn plan<'r>(
    request: &Request<'_>,
    matched: &[Option<Match<'r>>],
    prefix: &str,
) -> Result<Planned<'r>, Refusal> {
    let rule: Arc<str> = Arc::from(request.domain);
    let key_rule = key_safe(request.domain);
    let request_hits = u64::from(request.hits_addend.max(1));
    let mut planned = Planned {
        slots: Vec::with_capacity(request.descriptors.len()),
        enforced: Vec::new(),
        apart: Vec::new(),
        deny_all: false,
    };
    // `replaces`: a matched limit sets aside the limits it names.
    let replaced: Vec<&str> = matched
        .iter()
        .flatten()
        .flat_map(|found| found.limit.replaces.iter().map(|name| &**name))
        .collect();
    for (descriptor, found) in request.descriptors.iter().zip(matched) {
        if descriptor.negative_hits {
            return Err(Refusal::NegativeHits);
        }
        let Some(found) = found.as_ref().filter(|found| {
            found
                .limit
                .name
                .as_deref()
                .is_none_or(|name| !replaced.contains(&name))
        }) else {
            planned.slots.push(Slot::NoLimit);
            continue;
        };
        let limit = found.limit;
        let counted = match &limit.action {
            Action::Unlimited => None,
            Action::DenyAll => {
                planned.deny_all |= !limit.shadow_mode;
                None
            }
            Action::Limited(counted) => Some(counted),
        };
        let Some(counted) = counted else {
            planned.slots.push(Slot::Fixed(limit));
            continue;
        };
        // hits_addend 0 means 1 at both levels, except a `count_every_hit` descriptor's own 0:
        // a check that counts nothing, as envoyproxy/ratelimit reads it
        // (`utils.GetHitsAddends`). That only holds where refused hits are counted, as there:
        // elsewhere floodgate counts none, so such a check could never be refused (a client
        // that checks with 0 and reports its usage later would never be stopped).
        let check_only = limit.count_every_hit && descriptor.hits_addend == Some(0);
        let hits = descriptor
            .hits_addend
            .map_or(request_hits, |hits| hits.max(1));
        let key = storage_key(
            prefix,
            SCOPE,
            &descriptor_hash(request.domain, &descriptor.entries, &found.shared_values),
            &key_rule,
            counted.name(),
        );
        let check = Check::new(key, counted.clone(), hits).with_rule(rule.clone());
        let index = if limit.decided_apart() {
            planned.apart.push(Apart {
                limit,
                check,
                check_only,
            });
            planned.apart.len() - 1
        } else {
            planned.enforced.push(check);
            planned.enforced.len() - 1
        };
        planned.slots.push(Slot::Counted { limit, index });
    }

    Ok(planned)
}

/// Decides plans on the gateway's store, under its failure policy.
pub(crate) struct Decider {
    gateway: Arc<Gateway>,
    /// The failure policy last used, with its node limiter under `local`.
    on_store_error: Mutex<Option<Arc<OnStoreError>>>,
}

impl Decider {
    /// A decider on `gateway`'s store and failure policy.
    pub(crate) fn new(gateway: Arc<Gateway>) -> Self {
        Decider {
            gateway,
            on_store_error: Mutex::new(None),
        }
    }

    /// Decides `checks` on the store, under the failure policy; with `peek`, says what the
    /// store would decide and counts nothing.
    async fn decide(&self, checks: &[Check], peek: bool) -> Result<Enforced, Refusal> {
        // Descriptors may name any algorithm: in batched mode, those that cannot run batched
        // are decided exactly (timed under the batched store's label, as the proxy's are).
        let current = self.gateway.current();
        let store = &current.store;
        let config = &current.config;
        let policy = || self.on_store_error_for(config.on_store_error, config.store.fallback_share);
        // A failed call is not counted here: the store's guard (the library's
        // `store::resilience`) counted it in `floodgate_store_errors_total`, as for the layer.
        let decided = if peek {
            // Under `local`, the node's limiter decides a failed peek as it decides any check
            // (it counts one hit there): it has no other way to answer.
            let started = Instant::now();
            let peeked = store.for_any_algorithm.peek(checks, None).await;
            settle_or_fall_back(peeked, started, store.store.backend(), checks, policy)
        } else {
            decide_or_fall_back(
                &*store.for_any_algorithm,
                store.store.backend(),
                checks,
                policy,
            )
            .await
        };
        match decided {
            DecidedBy::Store(decision) => Ok(Enforced::Decided(decision)),
            DecidedBy::Fallback { decision: None, .. } => Err(Refusal::Unavailable),
            DecidedBy::Fallback {
                decision: Some(decision),
                error,
            } if decision.source() == DecisionSource::FailOpen => {
                tracing::debug!(%error, "rls: store failed; on_store_error open admits");
                Ok(Enforced::FailedOpen)
            }
            DecidedBy::Fallback {
                decision: Some(decision),
                ..
            } => Ok(Enforced::Decided(decision)),
        }
    }

    /// The failure policy in force, with its node limiter for `share` under `local`: kept
    /// while the policy and the share stay (its counters with it), built afresh when a reload
    /// changes either, as a layer's is.
    fn on_store_error_for(&self, policy: FailurePolicy, share: f64) -> Arc<OnStoreError> {
        let mut current = self
            .on_store_error
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match &*current {
            Some(kept)
                if kept.policy() == policy
                    && kept.fallback_share().is_none_or(|kept| kept == share) =>
            {
                kept.clone()
            }
            _ => {
                let built = Arc::new(OnStoreError::new(policy, share));
                *current = Some(built.clone());
                built
            }
        }
    }

    /// Decides a plan: each descriptor decided apart (shadow mode, `count_every_hit`) on its
    /// own, then the enforced checks in one call, all or nothing.
    pub(crate) async fn decide_planned(&self, planned: &Planned<'_>) -> Result<Decided, Refusal> {
        // Shadow descriptors count on their own (as envoyproxy/ratelimit counts every
        // descriptor), so that one over its limit never blocks the request nor the others;
        // so do `count_every_hit` ones, whose hits count whatever the others decide.
        let mut apart = Vec::with_capacity(planned.apart.len());
        for descriptor in &planned.apart {
            apart.push(self.decide_apart(descriptor).await?);
        }
        let refused_apart = planned
            .apart
            .iter()
            .zip(&apart)
            .any(|(descriptor, decided)| {
                !descriptor.limit.shadow_mode
                    && matches!(decided, Enforced::Decided(decision) if !decision.is_allowed())
            });
        // All or nothing: a request that a `requests_per_unit: 0` descriptor or a
        // `count_every_hit` one refuses consumes from none of the others, so the store is not
        // asked.
        let enforced = if planned.enforced.is_empty() || planned.deny_all || refused_apart {
            None
        } else {
            Some(self.decide(&planned.enforced, false).await?)
        };
        let admitted = !planned.deny_all
            && !refused_apart
            && match &enforced {
                Some(Enforced::Decided(decision)) => decision.is_allowed(),
                _ => true,
            };
        Ok(Decided {
            enforced,
            apart,
            admitted,
        })
    }

    /// Decides a descriptor on its own. A `count_every_hit` one's check (its own
    /// `hits_addend: 0`) is a peek; its hits are counted even where they do not fit, as
    /// envoyproxy/ratelimit counts every hit, and that call is answered over the limit with
    /// the state they left.
    async fn decide_apart(&self, descriptor: &Apart<'_>) -> Result<Enforced, Refusal> {
        let checks = std::slice::from_ref(&descriptor.check);
        let decided = self.decide(checks, descriptor.check_only).await?;
        if let Enforced::Decided(decision) = &decided
            && descriptor.limit.count_every_hit
            && !descriptor.check_only
            && !decision.is_allowed()
            && decision.source() == DecisionSource::Store
        {
            // Usage reported after the fact happened: it is counted past the limit, so that
            // the next checks are refused until the window (or the bucket) has room again.
            let store = &self.gateway.current().store.for_any_algorithm;
            match store.charge(checks, None).await {
                // The answer says what is left now, and when there is room again.
                Ok(()) => match store.peek(checks, None).await {
                    Ok(after) => return Ok(Enforced::Decided(after)),
                    Err(error) => {
                        tracing::debug!(%error, "rls: the state after counting hits past the limit could not be read");
                    }
                },
                Err(error) => {
                    tracing::warn!(%error, "rls: hits past the limit could not be counted");
                }
            }
        }
        Ok(decided)
    }
}

/// What became of one descriptor of a request.
pub(crate) enum Answer<'a> {
    /// No configured descriptor matches: no limit.
    NoLimit,
    /// An `unlimited` descriptor, or (`over`) one of `requests_per_unit: 0`: answered by the
    /// rules alone.
    Fixed {
        limit: &'a DescriptorLimit,
        over: bool,
    },
    /// A counted descriptor, with its limit's state after the decision: `None` when the
    /// store was not asked (another descriptor refused the request) or failed and `open`
    /// admitted.
    Counted {
        limit: &'a DescriptorLimit,
        state: Option<&'a LimitStatus>,
    },
}

impl Answer<'_> {
    /// Whether the descriptor is answered over its limit (one in shadow mode never is).
    pub(crate) fn is_over(&self) -> bool {
        match self {
            Answer::NoLimit => false,
            Answer::Fixed { limit, over } => *over && !limit.shadow_mode,
            Answer::Counted { limit, state } => {
                state.is_some_and(|state| !state.allowed && !limit.shadow_mode)
            }
        }
    }
}

/// One answer per descriptor, in the request's order, each decision counted under `rule`
/// (the domain).
pub(crate) fn answers<'a>(
    planned: &'a Planned<'a>,
    decided: &'a Decided,
    rule: &str,
) -> Vec<Answer<'a>> {
    planned
        .slots
        .iter()
        .map(|slot| match *slot {
            Slot::NoLimit => Answer::NoLimit,
            Slot::Fixed(limit) => {
                let over = matches!(limit.action, Action::DenyAll);
                // Decided by the rules, not the store, but named as the store's decision
                // would be.
                record_outcome(
                    rule,
                    limit,
                    Outcome::of_store_decision(!over, limit.shadow_mode),
                );
                Answer::Fixed { limit, over }
            }
            Slot::Counted { limit, index } => counted_answer(planned, decided, rule, limit, index),
        })
        .collect()
}

/// The answer of a counted descriptor (`index` into the enforced checks, or into those
/// decided apart), from what the store decided, its decision counted under `rule` and near
/// the limit as envoyproxy/ratelimit counts it.
fn counted_answer<'a>(
    planned: &'a Planned<'a>,
    decided: &'a Decided,
    rule: &str,
    limit: &'a DescriptorLimit,
    index: usize,
) -> Answer<'a> {
    let apart = limit.decided_apart();
    let outcome = if apart {
        decided.apart.get(index)
    } else {
        decided.enforced.as_ref()
    };
    let decision = match outcome {
        Some(Enforced::Decided(decision)) => Some(decision),
        _ => None,
    };
    let position = if apart { 0 } else { index };
    let state = decision.and_then(|decision| {
        decision
            .limits()
            .get(position)
            .map(|state| (decision, state))
    });
    let outcome = counted_outcome(
        state.map(|(decision, _)| decision),
        limit,
        apart,
        decided.admitted,
    );
    record_outcome(rule, limit, outcome);
    // envoyproxy/ratelimit's `near_limit` (its default ratio, 0.8), by the rule the
    // proxy's limits follow: admitted with under 20% of the limit left. A check
    // adds no hit, so none near the limit (as the peer counts it).
    let check_only = apart
        && planned
            .apart
            .get(index)
            .is_some_and(|apart| apart.check_only);
    if let Some((_, state)) = state
        && !check_only
        && matches!(outcome, Outcome::Allowed | Outcome::FallbackAllowed)
        && state.remaining.saturating_mul(5) < state.capacity
    {
        telemetry::record_near_limit(rule, &limit.key_path);
    }
    Answer::Counted {
        limit,
        state: state.map(|(_, state)| state),
    }
}

/// What became of a counted descriptor, named as the layer names a request
/// ([`Outcome::of_decision`]): `decision`, the one that holds its limit's state, shadowed in
/// shadow mode. A shadow descriptor the store refuses is `shadow_limited`; one the failure
/// policy's node limiter refuses is `fallback_limited`, as the layer counts a shadowed request
/// that fallback refuses (SPEC §4: every fallback decision is counted as one).
fn counted_outcome(
    decision: Option<&Decision>,
    limit: &DescriptorLimit,
    apart: bool,
    admitted: bool,
) -> Outcome {
    match decision {
        // One decided apart holds this descriptor alone; the enforced one is decided only
        // when nothing else refused the request, so its admission is the request's.
        Some(decision) => Outcome::of_decision(decision, limit.shadow_mode),
        // Not asked: a `requests_per_unit: 0` or a `count_every_hit` descriptor refused the
        // request (those decided apart are always asked).
        None if !apart && !admitted => Outcome::Limited,
        // The store failed and `open` admitted.
        None => Outcome::of_fallback(true),
    }
}

/// Counts a descriptor's `outcome` in `floodgate_decisions_total`, under `rule` (the domain)
/// and the descriptor's key path.
fn record_outcome(rule: &str, limit: &DescriptorLimit, outcome: Outcome) {
    if let Some(label) = outcome.decision_label() {
        telemetry::record_decision(rule, &limit.key_path, label);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use floodgate::algorithm::LimitOutcome;
    use floodgate::time::Timestamp;
    use floodgate::{Algorithm, Limit};

    use crate::rls::rules::Unit;

    fn counted_limit(key_path: &str, shadow_mode: bool) -> DescriptorLimit {
        let limit = Limit::new(key_path, Algorithm::FixedWindow, 1, Duration::from_secs(60));
        DescriptorLimit {
            key_path: Arc::from(key_path),
            name: None,
            requests_per_unit: 1,
            unit: Unit::Minute,
            action: Action::Limited(Arc::new(limit.unwrap())),
            shadow_mode,
            count_every_hit: false,
            replaces: Vec::new(),
        }
    }

    fn check_of(limit: &DescriptorLimit) -> Check {
        let Action::Limited(counted) = &limit.action else {
            unreachable!("a counted limit");
        };
        Check::new("key", counted.clone(), 1).with_rule(Arc::from("api"))
    }

    /// What `source` decided of `limit`'s one check: admitted or not.
    fn decided_by(source: DecisionSource, limit: &DescriptorLimit, allowed: bool) -> Enforced {
        if source == DecisionSource::FailOpen {
            // `decide` answers a failure `open` admits without a decision.
            assert!(allowed, "open admits");
            return Enforced::FailedOpen;
        }
        let outcome = LimitOutcome {
            allowed,
            remaining: u64::from(allowed),
            reset_after_micros: 60_000_000,
            retry_after_micros: (!allowed).then_some(60_000_000),
            delay_micros: 0,
        };
        let at = Timestamp::from_micros(0);
        let decision = Decision::from_outcomes(at, &[check_of(limit)], &[outcome], Vec::new());
        Enforced::Decided(decision.with_source(source))
    }

    /// The one counted descriptor `limit` (apart in shadow mode, else enforced) answered with
    /// `decided`: whether it is answered over its limit, and the `decision` labels
    /// `floodgate_decisions_total` counted.
    fn answer(limit: &DescriptorLimit, decided: Enforced) -> (bool, Vec<String>) {
        let check = check_of(limit);
        let apart = limit.decided_apart();
        let admitted = apart || !matches!(&decided, Enforced::Decided(d) if !d.is_allowed());
        let planned = Planned {
            slots: vec![Slot::Counted { limit, index: 0 }],
            enforced: if apart {
                Vec::new()
            } else {
                vec![check.clone()]
            },
            apart: if apart {
                vec![Apart {
                    limit,
                    check,
                    check_only: false,
                }]
            } else {
                Vec::new()
            },
            deny_all: false,
        };
        let decided = if apart {
            Decided {
                enforced: None,
                apart: vec![decided],
                admitted,
            }
        } else {
            Decided {
                enforced: Some(decided),
                apart: Vec::new(),
                admitted,
            }
        };
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let over = metrics::with_local_recorder(&recorder, || {
            let answers = answers(&planned, &decided, "api");
            answers[0].is_over()
        });
        let labels = handle
            .render()
            .lines()
            .filter(|line| line.starts_with(telemetry::DECISIONS_TOTAL))
            .filter_map(|line| {
                let (_, rest) = line.split_once("decision=\"")?;
                Some(rest.split('"').next()?.to_owned())
            })
            .collect();
        (over, labels)
    }

    /// The case the RLS and the layer once named apart: the store failed, `local`'s node
    /// limiter refused a shadow descriptor. The client is not refused (shadow mode), and the
    /// decision is the fallback's, counted as the layer counts it (SPEC §4).
    #[test]
    fn a_shadow_descriptor_the_fallback_refuses_is_counted_as_the_layer_counts_it() {
        let limit = counted_limit("tenant", true);
        let refused = decided_by(DecisionSource::LocalFallback, &limit, false);
        let (over, labels) = answer(&limit, refused);
        assert!(!over, "shadow mode never refuses");
        assert_eq!(labels, ["fallback_limited"]);
    }

    /// Every way a counted descriptor is decided (by the store, the node's fallback limiter, or
    /// `open`; admitted or not; shown or shadowed) is counted under the label the layer counts
    /// the same decision under.
    #[test]
    fn every_decision_of_a_descriptor_is_labelled_as_the_layers() {
        use DecisionSource::{FailOpen, LocalFallback, Store};
        let expected = [
            (Store, true, false, "allowed"),
            (Store, true, true, "allowed"),
            (Store, false, false, "limited"),
            (Store, false, true, "shadow_limited"),
            (LocalFallback, true, false, "fallback_allowed"),
            (LocalFallback, true, true, "fallback_allowed"),
            (LocalFallback, false, false, "fallback_limited"),
            (LocalFallback, false, true, "fallback_limited"),
            (FailOpen, true, false, "fallback_allowed"),
            (FailOpen, true, true, "fallback_allowed"),
        ];
        for (source, allowed, shadowed, label) in expected {
            let case = format!("{source:?}, allowed {allowed}, shadowed {shadowed}");
            let limit = counted_limit("tenant", shadowed);
            let decided = decided_by(source, &limit, allowed);
            // The layer's name for it: the outcome it puts on the response and counts.
            let layers = match &decided {
                Enforced::Decided(decision) => Outcome::of_decision(decision, shadowed),
                Enforced::FailedOpen => {
                    let at = Timestamp::from_micros(0);
                    Outcome::of_decision(&Decision::unlimited(at, source), shadowed)
                }
            };
            let layers = layers.decision_label().expect("a counted outcome");
            assert_eq!(layers.as_str(), label, "{case}");
            let (over, labels) = answer(&limit, decided);
            assert_eq!(labels, [label], "{case}");
            assert_eq!(over, !allowed && !shadowed, "{case}");
        }
    }
}
