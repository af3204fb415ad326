//! Coalesced calls: decisions that wait while a node has calls in flight go out together, as
//! one `batch` call of the script, when one of those calls comes back.
//!
//! A node (or, on a cluster, a hash slot: a call must stay on one) has at most `in_flight`
//! calls out at once. A decision that finds a free place sends its own call at once, so an
//! idle node never waits to fill a batch; one that finds none queues, and the next call to come
//! back sends everything queued (up to [`MAX_BATCH`] decisions) as one call, from a task of its
//! own so that no request's lifetime holds the others'. The script decides a batch's decisions
//! one after the other in arrival order, each all-or-nothing, at one instant: exactly as if
//! they had come one by one. Under load this turns many calls into few: one `TIME`, one call's
//! overhead and one round trip for many decisions.
//!
//! A decision whose request goes away while it waits is left out of the batch; one that goes
//! away while its batch is out has its reply's concurrency leases released (its own future
//! releases them too: releasing twice is harmless), so a dropped request holds nothing.
//! Decisions with an explicit `now` (tests) are never coalesced: a batch has one instant.
//!
//! Deadlines: the store's deadline measures Redis, not the queue. A decision that queued has
//! its deadline started again when its batch goes out
//! ([`call_goes_out_now`](crate::store::resilience::call_goes_out_now)), so a Redis that is
//! slow but within the deadline never times out a decision that waited behind another call
//! (which would open the breaker on a healthy store). The wait for a place stays bounded by
//! the deadline that ran until then, so a decision never takes more than twice the deadline:
//! a queue that does not move within one deadline (the calls ahead all failing, or more than
//! [`MAX_BATCH`] decisions ahead of it on a store too slow for its load) fails the decision as
//! a timeout.
//!
//! Each decision of a batch has its own answer: one that fails in the script (corrupted stored
//! state, a spec the loaded library does not know) answers with its error, and the others are
//! decided as if it had not come (see `lua/check.lua`, mode 'batch').

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use tokio::sync::oneshot;

use super::RedisStore;
use super::groups::leases_of;
use super::script::{self, Mode, Reply};
use crate::decision::Check;
use crate::store::{Store, StoreError, resilience};

/// Most decisions sent in one call, so that one call never holds Redis for long.
pub(super) const MAX_BATCH: usize = 64;

/// The queues of one store, by routing slot (0 for every key where calls need not stay on one
/// slot).
#[derive(Default)]
pub(super) struct Coalescer {
    queues: Mutex<HashMap<u16, Queue>>,
}

#[derive(Default)]
struct Queue {
    in_flight: usize,
    waiting: Vec<Waiter>,
}

/// A decision waiting for a place in a call.
struct Waiter {
    checks: Vec<Check>,
    tokens: Vec<String>,
    /// Told when its batch goes out, so that its deadline starts again.
    sent: Option<oneshot::Sender<()>>,
    reply: oneshot::Sender<Result<Reply, StoreError>>,
}

/// Frees a place of `slot` when dropped: the next batch goes out on it, or it is given back.
struct Place<'s> {
    store: &'s RedisStore,
    slot: u16,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        finish(self.store, self.slot);
    }
}

impl Coalescer {
    /// Decisions waiting for a place in a call now.
    pub(super) fn waiting(&self) -> usize {
        self.queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|queue| queue.waiting.len())
            .sum()
    }
}

/// Decides one decision (`checks`, `tokens`: one slot's) through `store`'s coalescer.
pub(super) async fn check(
    store: &RedisStore,
    slot: u16,
    in_flight: usize,
    checks: &[&Check],
    tokens: &[String],
) -> Result<Reply, StoreError> {
    let coalescer = &store.inner.coalescer;
    let waiting = {
        let mut queues = coalescer
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let queue = queues.entry(slot).or_default();
        if queue.in_flight < in_flight {
            queue.in_flight += 1;
            None
        } else {
            let (sent, went_out) = oneshot::channel();
            let (reply, waiting) = oneshot::channel();
            queue.waiting.push(Waiter {
                checks: checks.iter().map(|check| (*check).clone()).collect(),
                tokens: tokens.to_vec(),
                sent: Some(sent),
                reply,
            });
            Some((went_out, waiting))
        }
    };
    match waiting {
        None => {
            let _place = Place { store, slot };
            let decision = script::Decision { checks, tokens };
            let mut replies = store.call(Mode::Check, &[decision], None).await?;
            replies
                .pop()
                .ok_or_else(|| StoreError::Protocol("a decision went unanswered".into()))
        }
        Some((went_out, waiting)) => {
            // Not sent when the waiter is dropped unbatched: the reply says why.
            if went_out.await.is_ok() {
                resilience::call_goes_out_now();
            }
            waiting.await.unwrap_or_else(|_| {
                Err(StoreError::Unavailable(
                    "the batch carrying this decision was abandoned".into(),
                ))
            })
        }
    }
}

/// A call of `slot` came back: sends what waits as the next batch, or frees the place.
fn finish(store: &RedisStore, slot: u16) {
    let batch = {
        let mut queues = store
            .inner
            .coalescer
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(queue) = queues.get_mut(&slot) else {
            return;
        };
        // Requests that went away while they waited are not decided at all.
        queue.waiting.retain(|waiter| !waiter.reply.is_closed());
        if queue.waiting.is_empty() {
            queue.in_flight = queue.in_flight.saturating_sub(1);
            return;
        }
        let take = queue.waiting.len().min(MAX_BATCH);
        queue.waiting.drain(..take).collect::<Vec<Waiter>>()
    };
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        // Outside a runtime (a store dropped late): nothing can carry the batch.
        return;
    };
    let store = store.clone();
    runtime.spawn(async move {
        let _place = Place {
            store: &store,
            slot,
        };
        send_batch(&store, batch).await;
    });
}

/// Sends `batch` as one call and answers each waiter: with its own decision, or its own
/// error, or the call's failure.
async fn send_batch(store: &RedisStore, mut batch: Vec<Waiter>) {
    for waiter in &mut batch {
        if let Some(sent) = waiter.sent.take() {
            let _ = sent.send(());
        }
    }
    let refs: Vec<Vec<&Check>> = batch
        .iter()
        .map(|waiter| waiter.checks.iter().collect())
        .collect();
    let decisions: Vec<script::Decision<'_>> = refs
        .iter()
        .zip(&batch)
        .map(|(checks, waiter)| script::Decision {
            checks,
            tokens: &waiter.tokens,
        })
        .collect();
    let deadline = store.inner.guard.config().timeout;
    let call = async {
        let spec_time = store
            .spec_time(script::has_calendar(&decisions), None)
            .await;
        let value = store
            .run_library(|dispatch| {
                script::command(dispatch, Mode::Check, &decisions, None, spec_time)
            })
            .await?;
        store.inner.server_clock.observe_reply(&value);
        script::decode_batch(value, &decisions)
    };
    let result = match tokio::time::timeout(deadline, call).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::Timeout(deadline)),
    };
    match result {
        Ok(replies) => {
            let mut orphaned = Vec::new();
            for (waiter, reply) in batch.into_iter().zip(replies) {
                let leases = match &reply {
                    Ok(reply) if reply.admitted => leases_of(waiter.checks.iter(), &reply.tokens),
                    _ => Vec::new(),
                };
                if waiter.reply.send(reply).is_err() {
                    orphaned.extend(leases);
                }
            }
            if !orphaned.is_empty()
                && let Err(error) = store.release(orphaned).await
            {
                tracing::warn!(%error, "could not release the leases of abandoned decisions; they expire with their window");
            }
        }
        Err(error) => {
            for waiter in batch {
                let _ = waiter.reply.send(Err(copy_of(&error)));
            }
        }
    }
}

/// The same failure for another decision of the batch (of the same class: the breaker and the
/// metrics tell them apart).
fn copy_of(error: &StoreError) -> StoreError {
    let message = || -> Box<dyn std::error::Error + Send + Sync> { error.to_string().into() };
    match error {
        StoreError::Timeout(deadline) => StoreError::Timeout(*deadline),
        StoreError::Unavailable(_) => StoreError::Unavailable(message()),
        StoreError::Rejected(_) => StoreError::Rejected(message()),
        StoreError::BreakerOpen => StoreError::BreakerOpen,
        StoreError::Protocol(text) => StoreError::Protocol(text.clone()),
        StoreError::Config(text) => StoreError::Config(text.clone()),
        StoreError::Unsupported(what) => StoreError::Unsupported(what),
    }
}
