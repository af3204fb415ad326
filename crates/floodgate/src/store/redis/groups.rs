//! SPEC §1's order-and-refund protocol over groups of checks, each decided by one script call
//! on one node: the Redis store's hash-slot groups and the sharded store's node groups share it.

use std::sync::Arc;
use std::time::Instant;

use super::RedisStore;
use super::deny_cache;
use super::script::{LeaseToken, Mode};
use crate::algorithm::LimitOutcome;
use crate::decision::{Check, Decision, Folded, Lease};
use crate::limit::Algorithm;
use crate::store::batched::{Grant, LeaseRequest, Leased, Synced, Unanswered};
use crate::store::{BoxFuture, Store, StoreError};
use crate::time::Timestamp;

/// What a store asks of its groups: a decision, or a peek.
#[derive(Clone, Copy)]
pub(super) enum Asking {
    Decide,
    Peek,
}

/// A Redis store that decides by groups of checks, one script call per group on the node it
/// lives on: one Redis (a group per hash slot) or sharded Redis (a group per node).
pub(super) trait GroupedStore: Sync {
    /// `checks` grouped by where each must be decided, in order of first appearance.
    fn node_groups(&self, checks: &[Check]) -> Vec<Group<'_>>;

    /// [`Store::check_and_consume`] (`Asking::Decide`) or [`Store::peek`] over the groups.
    fn decide_grouped<'a>(
        &'a self,
        asking: Asking,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(decide_folded(
            asking,
            |checks| self.node_groups(checks),
            checks,
            now,
        ))
    }

    /// [`Store::charge`] over the groups.
    fn charge_grouped<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            adjust_groups(Mode::Charge, &self.node_groups(checks), checks, now).await
        })
    }

    /// [`Store::refund`] over the groups: the windows' limits as of `charged_at` (their
    /// script gives back only to the window they hold, if it is that time's), the others
    /// now, by the server's clock unless `now` says otherwise.
    fn refund_grouped<'a>(
        &'a self,
        checks: &'a [Check],
        charged_at: Timestamp,
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            // Whether the charge's window is still the current one, by `now` or this node's
            // clock (the script then checks that the key still holds it, by its time).
            let current = now.unwrap_or_else(Timestamp::now).as_micros();
            let (windows, others): (Vec<Check>, Vec<Check>) = checks
                .iter()
                .filter(|check| check.cost > 0 && check.limit.algorithm().is_batchable())
                .filter(|check| {
                    !check.limit.algorithm().counts_in_windows()
                        || check.limit.window_bounds(charged_at.as_micros()).0
                            == check.limit.window_bounds(current).0
                })
                .cloned()
                .partition(|check| check.limit.algorithm().counts_in_windows());
            for (checks, at) in [(windows, Some(charged_at)), (others, now)] {
                if !checks.is_empty() {
                    adjust_groups(Mode::Refund, &self.node_groups(&checks), &checks, at).await?;
                }
            }
            Ok(())
        })
    }
}

/// Decides (or peeks at) `checks` over the groups `groups_of` makes of them, folded first when
/// a key repeats ([`Folded`]: a counter named twice costs both).
async fn decide_folded<'s>(
    asking: Asking,
    groups_of: impl Fn(&[Check]) -> Vec<Group<'s>>,
    checks: &[Check],
    now: Option<Timestamp>,
) -> Result<Decision, StoreError> {
    let folded = Folded::of(checks);
    let asked = folded.as_ref().map_or(checks, |folded| &folded.checks);
    let groups = groups_of(asked);
    let decision = match asking {
        Asking::Decide => decide_groups(&groups, asked, now).await?,
        Asking::Peek => peek_groups(&groups, asked, now).await?,
    };
    Ok(match &folded {
        Some(folded) => folded.unfold(checks, decision),
        None => decision,
    })
}

/// Decides `checks` by one script call per group, in group order; a group's node is the store
/// that runs its call. When a group denies, what earlier groups took is refunded, and every
/// group not charged is reported as it stands (SPEC §1's order-and-refund rule).
///
/// With the server's clock, the nodes' deny caches are asked first (a decision they can deny
/// is denied without a call), then told what the calls decided (see [`deny_cache`]).
pub(super) async fn decide_groups(
    groups: &[Group<'_>],
    checks: &[Check],
    now: Option<Timestamp>,
) -> Result<Decision, StoreError> {
    if checks.is_empty() {
        return Ok(Decision::from_outcomes(
            now.unwrap_or_else(Timestamp::now),
            checks,
            &[],
            Vec::new(),
        ));
    }
    // A caller's own clock (tests, replays) is not the servers': the memories stay out of it.
    let memories = match now {
        Some(_) => None,
        None => match Memories::ask(groups, checks) {
            Asked::Denied(denied) => return Ok(denied),
            Asked::Call(memories) => Some(memories),
        },
    };
    let called = decide_by_calls(groups, checks, now).await?;
    if let Some(memories) = memories {
        memories.tell(&called);
    }
    Ok(called.decision)
}

/// The nodes' deny caches around one decision by calls: asked before it, told after it.
struct Memories<'a> {
    groups: &'a [Group<'a>],
    checks: &'a [Check],
    /// Set when the memories admitted a probe and counted it: forgotten unless decided.
    probing: Option<ForgetUnlessDecided<'a>>,
    /// Each group's cache resets when the calls were sent: a reset since makes their answer
    /// stale.
    resets_before: Vec<u64>,
}

/// What the memories answered before the calls.
enum Asked<'a> {
    /// Denied without a call.
    Denied(Decision),
    /// The calls decide; the memories learn from them.
    Call(Memories<'a>),
}

impl<'a> Memories<'a> {
    fn ask(groups: &'a [Group<'a>], checks: &'a [Check]) -> Asked<'a> {
        for group in groups {
            group.node.ensure_listening();
        }
        // A node whose breaker is open is down: the failure policy decides, not its memory.
        let cache_of = |index: usize| {
            groups
                .iter()
                .find(|group| group.members.contains(&index))
                .filter(|group| !group.node.is_refused(&checks[index].key))
                .and_then(|group| group.node.deny_cache())
        };
        let probing = match deny_cache::decide_locally(checks, cache_of) {
            deny_cache::Local::Denied(denied) => return Asked::Denied(denied),
            deny_cache::Local::Probing => Some(ForgetUnlessDecided { groups, checks }),
            deny_cache::Local::Unknown => None,
        };
        let resets_before = groups
            .iter()
            .map(|group| group.node.deny_cache().map_or(0, |cache| cache.resets()))
            .collect();
        Asked::Call(Memories {
            groups,
            checks,
            probing,
            resets_before,
        })
    }

    /// Tells the memories what the calls decided (a probe's admission is already counted).
    fn tell(self, called: &Called) {
        let counted = self.probing.is_some_and(ForgetUnlessDecided::decided);
        if !(counted && called.decision.is_allowed()) {
            remember(
                self.groups,
                self.checks,
                called,
                Instant::now(),
                &self.resets_before,
            );
        }
    }
}

/// The keys of a decision whose admission the memories counted before its call: forgotten
/// unless the call is decided (it failed, or its request went away, and Redis may not have
/// counted it).
struct ForgetUnlessDecided<'a> {
    groups: &'a [Group<'a>],
    checks: &'a [Check],
}

impl ForgetUnlessDecided<'_> {
    /// The call was decided: nothing to forget.
    fn decided(self) -> bool {
        std::mem::forget(self);
        true
    }
}

impl Drop for ForgetUnlessDecided<'_> {
    fn drop(&mut self) {
        for group in self.groups {
            if let Some(cache) = group.node.deny_cache() {
                cache.forget(group.members.iter().map(|&index| &*self.checks[index].key));
            }
        }
    }
}

/// A decision made by calls, with each limit's state as the calls reported it (a denial's).
struct Called {
    decision: Decision,
    states: Vec<Option<[u64; 3]>>,
}

/// What the nodes' deny caches keep of a decision: a denial's states until its wait is over;
/// an admission makes them forget its keys (their state changed). `arrived`: when the reply
/// came, the instant its states are anchored to.
fn remember(
    groups: &[Group<'_>],
    checks: &[Check],
    called: &Called,
    arrived: Instant,
    resets_before: &[u64],
) {
    let decision = &called.decision;
    let wait = decision.retry_after().filter(|_| !decision.is_allowed());
    let cacheable = checks
        .iter()
        .all(|check| deny_cache::applies_to(check.limit.algorithm()));
    for (position, group) in groups.iter().enumerate() {
        let Some(cache) = group.node.deny_cache() else {
            continue;
        };
        let keys = group.members.iter().map(|&index| &*checks[index].key);
        match wait {
            // A reset since the call was sent: what it read may be gone.
            Some(wait) if cacheable && cache.resets() == resets_before[position] => {
                let read_at = decision.decided_at().as_micros();
                let until =
                    read_at.saturating_add(u64::try_from(wait.as_micros()).unwrap_or(u64::MAX));
                let entries = group.members.iter().map(|&index| {
                    let check = &checks[index];
                    (
                        check.key.clone(),
                        check.limit.algorithm(),
                        deny_cache::state_of(check, called.states[index]),
                    )
                });
                cache.remember(entries, read_at, arrived, until);
            }
            _ => cache.forget(keys),
        }
    }
}

/// The ids a group's script call gives its checks: concurrency limits take a lease under a
/// fresh random id (recorded in `taken`, released unless the decision ends); a log entry is
/// made unique by one (its position in the log is not: a refund can remove an older entry).
fn fresh_ids(node: &RedisStore, checks: &[&Check], taken: &mut TakenLeases) -> Vec<String> {
    checks
        .iter()
        .map(|check| match check.limit.algorithm() {
            Algorithm::Concurrency => {
                let id = fastrand::u64(1..);
                taken.add(node, check, id);
                id.to_string()
            }
            Algorithm::SlidingWindowLog => fastrand::u64(1..).to_string(),
            _ => String::new(),
        })
        .collect()
}

/// [`decide_groups`] by calls only.
async fn decide_by_calls(
    groups: &[Group<'_>],
    checks: &[Check],
    now: Option<Timestamp>,
) -> Result<Called, StoreError> {
    let mut outcomes: Vec<Option<LimitOutcome>> = vec![None; checks.len()];
    let mut states: Vec<Option<[u64; 3]>> = vec![None; checks.len()];
    let mut tokens: Vec<String> = vec![String::new(); checks.len()];
    // Every lease a script may take, released unless this decision ends: on an error (a
    // deadline that fired after the script ran) or a drop (the request went away) mid-way.
    let mut taken = TakenLeases::default();
    // Later calls use the first call's server time, so every group decides at one instant.
    let mut decided_at = now;
    let mut denied_group = None;
    for (
        position,
        Group {
            node,
            members: group,
        },
    ) in groups.iter().enumerate()
    {
        let group_checks: Vec<&Check> = group.iter().map(|&index| &checks[index]).collect();
        let lease_ids = fresh_ids(node, &group_checks, &mut taken);
        let reply = node
            .guarded_call(Mode::Check, &group_checks, &lease_ids, decided_at)
            .await?;
        decided_at.get_or_insert(reply.now);
        for ((&index, outcome), token) in group.iter().zip(reply.outcomes).zip(reply.tokens) {
            outcomes[index] = Some(outcome);
            tokens[index] = token;
        }
        for (&index, state) in group.iter().zip(reply.states) {
            states[index] = state;
        }
        if !reply.admitted {
            denied_group = Some(position);
            break;
        }
    }
    if let Some(denied) = denied_group {
        // Give back what earlier groups took, then report them (and the groups never
        // reached) as they stand.
        for Group {
            node,
            members: group,
        } in groups[..denied].iter().chain(&groups[denied + 1..])
        {
            let group_checks: Vec<&Check> = group.iter().map(|&index| &checks[index]).collect();
            let was_charged = outcomes[group[0]].is_some();
            let group_tokens: Vec<String> =
                group.iter().map(|&index| tokens[index].clone()).collect();
            let (mode, tokens) = if was_charged {
                (Mode::Refund, group_tokens)
            } else {
                // Never reached: evaluated at the request's cost, so that one that would deny
                // too reports its (perhaps longer) wait, as on a single call.
                (Mode::Peek, vec![String::new(); group.len()])
            };
            let reply = node
                .guarded_call(mode, &group_checks, &tokens, decided_at)
                .await?;
            for (&index, outcome) in group.iter().zip(reply.outcomes) {
                // A refunded limit had admitted the request.
                let allowed = was_charged || outcome.allowed;
                outcomes[index] = Some(LimitOutcome { allowed, ..outcome });
            }
            for (&index, state) in group.iter().zip(reply.states) {
                states[index] = state;
            }
        }
    }
    let outcomes: Vec<LimitOutcome> = outcomes
        .into_iter()
        .map(|outcome| {
            outcome.ok_or_else(|| StoreError::Protocol("a limit went unanswered".into()))
        })
        .collect::<Result<_, _>>()?;
    let admitted = denied_group.is_none();
    // Decided: an admission's leases go to the caller; a denial's were refunded.
    taken.hand_over();
    let leases = if admitted {
        leases_of(checks.iter(), &tokens)
    } else {
        Vec::new()
    };
    let decided_at = decided_at.unwrap_or_else(Timestamp::now);
    Ok(Called {
        decision: Decision::from_outcomes(decided_at, checks, &outcomes, leases),
        states,
    })
}

/// The concurrency leases an admission of `checks` took: the script answers each lease's
/// member ([`LeaseToken`]) as the check's token.
pub(super) fn leases_of<'c>(
    checks: impl Iterator<Item = &'c Check>,
    tokens: &[String],
) -> Vec<Lease> {
    checks
        .zip(tokens)
        .filter(|(check, _)| check.limit.algorithm() == Algorithm::Concurrency)
        .filter_map(|(check, token)| {
            Some(Lease {
                key: check.key.clone(),
                id: LeaseToken::parse(token)?.id,
                cost: check.cost,
            })
        })
        .collect()
}

/// Reads `checks` by one peek call per group, changing nothing.
pub(super) async fn peek_groups(
    groups: &[Group<'_>],
    checks: &[Check],
    now: Option<Timestamp>,
) -> Result<Decision, StoreError> {
    let mut outcomes: Vec<Option<LimitOutcome>> = vec![None; checks.len()];
    let mut decided_at = now;
    for Group { node, members } in groups {
        let group_checks: Vec<&Check> = members.iter().map(|&index| &checks[index]).collect();
        let tokens = vec![String::new(); members.len()];
        let reply = node
            .guarded_call(Mode::Peek, &group_checks, &tokens, decided_at)
            .await?;
        decided_at.get_or_insert(reply.now);
        for (&index, outcome) in members.iter().zip(reply.outcomes) {
            outcomes[index] = Some(outcome);
        }
    }
    let outcomes: Vec<LimitOutcome> = outcomes
        .into_iter()
        .map(|outcome| {
            outcome.ok_or_else(|| StoreError::Protocol("a limit went unanswered".into()))
        })
        .collect::<Result<_, _>>()?;
    Ok(Decision::from_outcomes(
        decided_at.unwrap_or_else(Timestamp::now),
        checks,
        &outcomes,
        Vec::new(),
    ))
}

/// Post-charges (`Mode::Charge`) or refunds (`Mode::Refund`) `checks` by one call per group,
/// concurrently.
async fn adjust_groups(
    mode: Mode,
    groups: &[Group<'_>],
    checks: &[Check],
    now: Option<Timestamp>,
) -> Result<(), StoreError> {
    let calls = groups.iter().map(|Group { node, members }| async move {
        let group_checks: Vec<&Check> = members.iter().map(|&index| &checks[index]).collect();
        // A log entry is made unique by a random id, as on admission.
        let tokens: Vec<String> = group_checks
            .iter()
            .map(|check| match check.limit.algorithm() {
                Algorithm::SlidingWindowLog => fastrand::u64(1..).to_string(),
                _ => String::new(),
            })
            .collect();
        node.guarded_call(mode, &group_checks, &tokens, now).await?;
        if mode == Mode::Refund
            && let Some(cache) = node.deny_cache()
        {
            // Units given back may admit what this node remembers as denied.
            cache.forget_reset(group_checks.iter().map(|check| &*check.key));
        }
        Ok::<(), StoreError>(())
    });
    futures_util::future::try_join_all(calls).await.map(drop)
}

/// The leases a decision's scripts may have taken, by node. Dropped before
/// [`TakenLeases::hand_over`], it releases them in the background: releasing a lease that was
/// never taken does nothing.
#[derive(Default)]
struct TakenLeases {
    leases: Vec<(RedisStore, Lease)>,
}

impl TakenLeases {
    fn add(&mut self, node: &RedisStore, check: &Check, id: u64) {
        let lease = Lease {
            key: check.key.clone(),
            id,
            cost: check.cost,
        };
        self.leases.push((node.clone(), lease));
    }

    fn hand_over(&mut self) {
        self.leases.clear();
    }
}

impl Drop for TakenLeases {
    fn drop(&mut self) {
        if self.leases.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut by_node: Vec<(RedisStore, Vec<Lease>)> = Vec::new();
        for (node, lease) in self.leases.drain(..) {
            match by_node
                .iter_mut()
                .find(|(known, _)| Arc::ptr_eq(&known.inner, &node.inner))
            {
                Some((_, leases)) => leases.push(lease),
                None => by_node.push((node, vec![lease])),
            }
        }
        for (node, leases) in by_node {
            runtime.spawn(async move {
                if let Err(error) = node.release(leases).await {
                    tracing::warn!(%error, "could not release the leases of an abandoned decision; they expire with their window");
                }
            });
        }
    }
}

/// Syncs `checks` by one call per group, concurrently (pipelined on a multiplexed
/// connection), and puts the states back in the order of `checks`.
pub(super) async fn sync_groups(
    groups: &[Group<'_>],
    checks: &[Check],
    now: Option<Timestamp>,
) -> Result<Synced, StoreError> {
    let calls = groups.iter().map(|group| async move {
        let members: Vec<&Check> = group.members.iter().map(|&index| &checks[index]).collect();
        group.node.guarded_sync(&members, now).await
    });
    let replies = futures_util::future::try_join_all(calls).await?;
    let mut states = vec![None; checks.len()];
    let mut latest = now.unwrap_or(Timestamp::EPOCH);
    for (group, reply) in groups.iter().zip(replies) {
        latest = latest.max(reply.now);
        for (&index, state) in group.members.iter().zip(reply.states) {
            states[index] = state;
        }
    }
    Ok(Synced {
        now: latest,
        states,
    })
}

/// Trades the leases of `requests` by one call per group (of the requests' checks),
/// concurrently, and puts the grants back in the order of `requests`. Each group's call
/// stands alone: a node (or slot) that fails leaves the others' grants answered, and only its
/// own requests unanswered.
pub(super) async fn lease_groups(
    groups: &[Group<'_>],
    requests: &[LeaseRequest],
    now: Option<Timestamp>,
) -> Leased {
    let calls = groups.iter().map(|group| async move {
        let members: Vec<&LeaseRequest> = group
            .members
            .iter()
            .map(|&index| &requests[index])
            .collect();
        group.node.guarded_lease(&members, now).await
    });
    let replies = futures_util::future::join_all(calls).await;
    let mut grants: Vec<Result<Grant, Unanswered>> = (0..requests.len())
        .map(|_| Err(Unanswered::NotSent))
        .collect();
    let mut failure = None;
    for (group, reply) in groups.iter().zip(replies) {
        match reply {
            Ok(answered) => {
                for (&index, grant) in group.members.iter().zip(answered) {
                    grants[index] = Ok(grant);
                }
            }
            Err(error) => {
                let unanswered = Unanswered::after(&error);
                for &index in &group.members {
                    grants[index] = Err(unanswered);
                }
                failure.get_or_insert(error);
            }
        }
    }
    Leased { grants, failure }
}

/// Checks decided together by one script call on `node`.
pub(super) struct Group<'s> {
    pub(super) node: &'s RedisStore,
    pub(super) members: Vec<usize>,
}
