//! Surviving a failing store: a deadline on every call and a circuit breaker (SPEC §4).
//!
//! The breaker opens after `failures` consecutive failed calls, stays open for `open_for`
//! (every call fails at once with [`StoreError::BreakerOpen`], without touching the network),
//! then lets exactly one probe through: its success closes the breaker, its failure reopens it.
//! What happens to a request the store could not decide is the [`FailurePolicy`].

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

pub use super::error::BreakerState;
use super::error::StoreError;

/// What to do when the store cannot decide (`on_store_error`, SPEC §4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Let the request through, as most production APIs do (the default).
    #[default]
    Open,
    /// Refuse with 503 `{"error":"rate_limiter_unavailable"}` and `Retry-After: 1`.
    Closed,
    /// Decide with a per-node in-memory limiter whose limits are the configured ones ×
    /// `fallback_share` (see
    /// [`RateLimitLayerBuilder::fallback_share`](crate::RateLimitLayerBuilder::fallback_share)).
    Local,
}

impl std::str::FromStr for FailurePolicy {
    type Err = crate::error::BuildError;

    /// `open`, `closed` or `local`; anything else is a layer build error.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "open" => Ok(FailurePolicy::Open),
            "closed" => Ok(FailurePolicy::Closed),
            "local" => Ok(FailurePolicy::Local),
            other => Err(crate::error::BuildError::UnknownFailurePolicy(
                other.to_owned(),
            )),
        }
    }
}

impl FailurePolicy {
    /// The configuration name (`open`, `closed`, `local`).
    pub fn as_str(self) -> &'static str {
        match self {
            FailurePolicy::Open => "open",
            FailurePolicy::Closed => "closed",
            FailurePolicy::Local => "local",
        }
    }
}

/// Told about what the failure machinery does, so that none of it is silent. The default
/// methods log; the gateway adds metrics.
pub trait StoreObserver: Send + Sync + 'static {
    /// The breaker of `backend` moved from `from` to `to`; `cause` is the failure that opened
    /// it (`None` for the other transitions).
    fn breaker_changed(
        &self,
        backend: &'static str,
        from: BreakerState,
        to: BreakerState,
        cause: Option<&StoreError>,
    ) {
        match to {
            BreakerState::Open => {
                let cause = cause.map_or_else(String::new, ToString::to_string);
                tracing::warn!(
                    backend,
                    ?from,
                    %cause,
                    "store circuit breaker opened: not calling the store"
                )
            }
            BreakerState::HalfOpen => {
                tracing::info!(
                    backend,
                    "store circuit breaker half-open: probing the store"
                )
            }
            BreakerState::Closed => {
                tracing::info!(
                    backend,
                    ?from,
                    "store circuit breaker closed: store is back"
                )
            }
        }
    }

    /// The store failed and `policy` decided instead: `allowed` says whether the request went
    /// through (`closed` refuses; `open` admits; `local` asks the per-node limiter).
    fn fallback_decision(
        &self,
        backend: &'static str,
        policy: FailurePolicy,
        error: &StoreError,
        allowed: bool,
    ) {
        tracing::debug!(backend, policy = policy.as_str(), %error, allowed, "store failed; failure policy decided");
    }

    /// A store call failed (after the deadline, or at once if the breaker is open). The
    /// `floodgate_store_errors_total` metric is recorded whatever this does.
    fn store_failed(&self, backend: &'static str, error: &StoreError) {
        tracing::debug!(backend, %error, "store call failed");
    }
}

/// The default observer: logs, and records the metrics of [`crate::telemetry`].
#[derive(Clone, Copy, Debug, Default)]
pub struct LogObserver;

impl StoreObserver for LogObserver {}

/// Deadline and breaker settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuardConfig {
    /// Deadline of every store call (default 50ms).
    pub timeout: Duration,
    /// Consecutive failures that open the breaker (default 5).
    pub failures: u32,
    /// How long the breaker stays open before a probe (default 2s).
    pub open_for: Duration,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            timeout: Duration::from_millis(50),
            failures: 5,
            open_for: Duration::from_secs(2),
        }
    }
}

struct BreakerInner {
    state: BreakerState,
    consecutive_failures: u32,
    opened_at: Instant,
}

/// Wraps store calls with a deadline and a circuit breaker.
pub struct Guard {
    backend: &'static str,
    config: GuardConfig,
    breaker: Mutex<BreakerInner>,
    observer: Arc<dyn StoreObserver>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("backend", &self.backend)
            .field("config", &self.config)
            .field("state", &self.state())
            .finish()
    }
}

/// Whether a call may go to the store.
enum Admission {
    Call,
    Probe,
    Reject,
}

impl Guard {
    /// A guard for `backend` with `config`, reporting to `observer`.
    pub fn new(
        backend: &'static str,
        config: GuardConfig,
        observer: Arc<dyn StoreObserver>,
    ) -> Self {
        // The gauge exists from the start, so dashboards and alerts see "closed", not nothing.
        crate::telemetry::record_breaker_change(backend, None, Some(BreakerState::Closed));
        Guard {
            backend,
            config: GuardConfig {
                failures: config.failures.max(1),
                ..config
            },
            breaker: Mutex::new(BreakerInner {
                state: BreakerState::Closed,
                consecutive_failures: 0,
                opened_at: Instant::now(),
            }),
            observer,
        }
    }

    /// The settings.
    pub fn config(&self) -> &GuardConfig {
        &self.config
    }

    /// The breaker's current state.
    pub fn state(&self) -> BreakerState {
        self.breaker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .state
    }

    /// Whether a call made now would be rejected without going out: the breaker is open and
    /// its `open_for` has not passed, or half-open with its probe out. An open breaker whose
    /// time is up refuses nothing: the next call is its probe. (Its [`state`](Self::state)
    /// stays `Open` until that call is made, so a caller that asks the state before calling
    /// would never make it, and the breaker would never close.)
    pub fn refuses_calls(&self) -> bool {
        let breaker = self.breaker.lock().unwrap_or_else(PoisonError::into_inner);
        match breaker.state {
            BreakerState::Closed => false,
            BreakerState::Open => breaker.opened_at.elapsed() < self.config.open_for,
            BreakerState::HalfOpen => true,
        }
    }

    /// Runs `call` under the deadline, unless the breaker rejects it. The deadline runs from
    /// the start, or from when `call` last said that it went out only then (a decision
    /// queued by the Redis store's coalescer, once its batch is sent): a call that first
    /// waited for its turn gives the wait one deadline and the call another, so at most twice
    /// the deadline in all.
    pub async fn call<T, F>(&self, call: F) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        let probe = match self.admit() {
            Admission::Reject => {
                let error = StoreError::BreakerOpen;
                self.failed(&error);
                return Err(error);
            }
            Admission::Call => false,
            Admission::Probe => true,
        };
        // Recorded as a failure if the caller drops the call midway, so that an abandoned
        // probe cannot leave the breaker half-open forever.
        let mut pending = PendingCall {
            guard: self,
            probe,
            done: false,
        };
        let result = CALL_STARTED
            .scope(
                std::cell::Cell::new(None),
                within_deadline(self.config.timeout, call),
            )
            .await;
        pending.done = true;
        // An error that is not transient (the call's, not the store's) came from a store that
        // answered: it counts as a success, so it never opens the breaker.
        self.record(result.as_ref().err().filter(|error| error.is_transient()));
        if let Err(error) = &result {
            self.failed(error);
        }
        result
    }

    /// Counts a failed call, then tells the observer. The metric is recorded here, not in the
    /// observer's overridable default, so that a custom observer cannot drop it.
    fn failed(&self, error: &StoreError) {
        crate::telemetry::record_store_error(error);
        self.observer.store_failed(self.backend, error);
    }

    fn admit(&self) -> Admission {
        let mut breaker = self.breaker.lock().unwrap_or_else(PoisonError::into_inner);
        match breaker.state {
            BreakerState::Closed => Admission::Call,
            BreakerState::Open if breaker.opened_at.elapsed() >= self.config.open_for => {
                breaker.state = BreakerState::HalfOpen;
                drop(breaker);
                self.changed(BreakerState::Open, BreakerState::HalfOpen);
                self.observer.breaker_changed(
                    self.backend,
                    BreakerState::Open,
                    BreakerState::HalfOpen,
                    None,
                );
                Admission::Probe
            }
            BreakerState::Open | BreakerState::HalfOpen => Admission::Reject,
        }
    }

    /// Records a call's outcome: `failure` is the error of a failed one.
    fn record(&self, failure: Option<&StoreError>) {
        let mut breaker = self.breaker.lock().unwrap_or_else(PoisonError::into_inner);
        let from = breaker.state;
        if failure.is_none() {
            breaker.consecutive_failures = 0;
            breaker.state = BreakerState::Closed;
        } else {
            breaker.consecutive_failures = breaker.consecutive_failures.saturating_add(1);
            let trips = match from {
                BreakerState::HalfOpen => true,
                BreakerState::Closed => breaker.consecutive_failures >= self.config.failures,
                BreakerState::Open => false,
            };
            if trips {
                breaker.state = BreakerState::Open;
                breaker.opened_at = Instant::now();
            }
        }
        let to = breaker.state;
        drop(breaker);
        if from != to {
            self.changed(from, to);
            let cause = failure.filter(|_| to == BreakerState::Open);
            self.observer.breaker_changed(self.backend, from, to, cause);
        }
    }

    /// Keeps the breaker gauge right whatever the observer does.
    fn changed(&self, from: BreakerState, to: BreakerState) {
        crate::telemetry::record_breaker_change(self.backend, Some(from), Some(to));
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        crate::telemetry::record_breaker_change(self.backend, Some(self.state()), None);
    }
}

tokio::task_local! {
    /// When the guarded call being polled went out, if it said so since the guard last looked
    /// ([`call_goes_out_now`]).
    static CALL_STARTED: std::cell::Cell<Option<tokio::time::Instant>>;
}

/// Said from inside [`Guard::call`] by a call that waited for its turn before going out (a
/// decision queued to be coalesced): its deadline starts again now, so that the deadline
/// measures the store, not the queue. The wait itself stays bounded by the deadline that ran
/// until now. Outside a guarded call, nothing happens.
#[cfg(feature = "redis")]
pub(crate) fn call_goes_out_now() {
    let now = tokio::time::Instant::now();
    let _ = CALL_STARTED.try_with(|started| started.set(Some(now)));
}

/// `call`, or [`StoreError::Timeout`] once `deadline` has passed since it began or since it
/// last went out ([`call_goes_out_now`]). Polled inside the [`CALL_STARTED`] scope.
async fn within_deadline<T>(
    deadline: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let mut call = std::pin::pin!(call);
    let mut expiry = std::pin::pin!(tokio::time::sleep(deadline));
    std::future::poll_fn(|context| {
        if let std::task::Poll::Ready(result) = call.as_mut().poll(context) {
            return std::task::Poll::Ready(result);
        }
        if let Ok(Some(started)) = CALL_STARTED.try_with(std::cell::Cell::take) {
            expiry.as_mut().reset(started + deadline);
        }
        expiry
            .as_mut()
            .poll(context)
            .map(|()| Err(StoreError::Timeout(deadline)))
    })
    .await
}

struct PendingCall<'g> {
    guard: &'g Guard,
    probe: bool,
    done: bool,
}

impl Drop for PendingCall<'_> {
    fn drop(&mut self) {
        if !self.done && self.probe {
            let abandoned =
                StoreError::Unavailable("the probe call was abandoned by its caller".into());
            self.guard.record(Some(&abandoned));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(failures: u32, open_for: Duration) -> Guard {
        let config = GuardConfig {
            timeout: Duration::from_millis(20),
            failures,
            open_for,
        };
        Guard::new("test", config, Arc::new(LogObserver))
    }

    async fn fail(guard: &Guard) -> Result<(), StoreError> {
        guard
            .call(async {
                Err::<(), _>(StoreError::Unavailable(Box::new(std::io::Error::other(
                    "down",
                ))))
            })
            .await
    }

    async fn succeed(guard: &Guard) -> Result<(), StoreError> {
        guard.call(async { Ok(()) }).await
    }

    /// A caller that asks before calling (a batched store) must see an open breaker stop
    /// refusing once its probe is due: the state alone stays `Open` until a call is made.
    #[tokio::test]
    async fn an_open_breaker_refuses_calls_until_its_probe_is_due() {
        let open_for = Duration::from_millis(30);
        let guard = guard(1, open_for);
        assert!(!guard.refuses_calls());
        assert!(fail(&guard).await.is_err());
        assert!(guard.refuses_calls());
        let opened = std::time::Instant::now();
        while opened.elapsed() < open_for {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            guard.state(),
            BreakerState::Open,
            "no call made it half-open"
        );
        assert!(!guard.refuses_calls(), "the next call is the probe");
        assert!(succeed(&guard).await.is_ok());
        assert_eq!(guard.state(), BreakerState::Closed);
    }

    #[tokio::test]
    async fn opens_after_consecutive_failures_and_rejects_without_calling() {
        let guard = guard(3, Duration::from_secs(60));
        for _ in 0..2 {
            assert!(fail(&guard).await.is_err());
        }
        assert!(succeed(&guard).await.is_ok(), "a success resets the count");
        for _ in 0..3 {
            assert!(fail(&guard).await.is_err());
        }
        assert_eq!(guard.state(), BreakerState::Open);
        let called = std::sync::atomic::AtomicBool::new(false);
        let result = guard
            .call(async {
                called.store(true, std::sync::atomic::Ordering::SeqCst);
                Ok(())
            })
            .await;
        assert!(matches!(result, Err(StoreError::BreakerOpen)));
        assert!(!called.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[tokio::test]
    async fn errors_that_are_not_transient_never_open_the_breaker() {
        let guard = guard(2, Duration::from_secs(60));
        for _ in 0..10 {
            let result = guard
                .call(async { Err::<(), _>(StoreError::Protocol("WRONGTYPE".into())) })
                .await;
            assert!(result.is_err());
        }
        assert_eq!(guard.state(), BreakerState::Closed);
        assert!(fail(&guard).await.is_err());
        assert_eq!(
            guard.state(),
            BreakerState::Closed,
            "the count started afresh"
        );
    }

    #[tokio::test]
    async fn one_probe_after_open_for_closes_or_reopens() {
        let guard = guard(1, Duration::from_millis(30));
        assert!(fail(&guard).await.is_err());
        assert_eq!(guard.state(), BreakerState::Open);
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(fail(&guard).await.is_err(), "the probe fails");
        assert_eq!(guard.state(), BreakerState::Open, "and reopens");
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(succeed(&guard).await.is_ok());
        assert_eq!(guard.state(), BreakerState::Closed);
    }

    #[tokio::test]
    async fn the_deadline_fails_slow_calls() {
        let guard = guard(5, Duration::from_secs(1));
        let slow = guard
            .call(async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok(())
            })
            .await;
        assert!(matches!(slow, Err(StoreError::Timeout(_))));
    }

    #[tokio::test]
    async fn an_abandoned_probe_does_not_wedge_the_breaker() {
        let guard = guard(1, Duration::from_millis(10));
        assert!(fail(&guard).await.is_err());
        tokio::time::sleep(Duration::from_millis(20)).await;
        {
            let probe = guard.call(std::future::pending::<Result<(), StoreError>>());
            // Poll once so the probe is admitted, then drop it.
            let _ = tokio::time::timeout(Duration::from_millis(1), probe).await;
        }
        assert_eq!(guard.state(), BreakerState::Open);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(succeed(&guard).await.is_ok());
    }
}
