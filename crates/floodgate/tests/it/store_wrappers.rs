//! Every store that wraps another forwards every `Store` method to it (issue 48): a method it
//! forgot would answer with the trait's default in the wrapped store's place (no breaker, no
//! overrides, nothing flushed at shutdown, "unsupported" for the admin API).
//!
//! The wrapped store here answers each method with a value no default gives (an error that
//! names the method, a backend name, an open breaker, `supports` false), so a wrapper's answer
//! proves whether it asked. A method added to `Store` belongs in [`Answering`] and in
//! [`assert_forwards_everything`].

use floodgate_test_support as support;

use std::sync::Arc;
use std::time::Duration;

use floodgate::overrides::{MemoryOverrides, OverrideBackend};
use floodgate::store::region::{RegionSettings, RegionalStore};
use floodgate::store::resilience::BreakerState;
use floodgate::store::{BatchedStore, BoxFuture, Check, Lease, RedisStore, SplitStore};
use floodgate::{Algorithm, Decision, Limit, Store, StoreError, time::Timestamp};
use support::RedisServer;

/// A store whose every answer names the method asked.
struct Answering {
    overrides: Arc<dyn OverrideBackend>,
}

impl Answering {
    fn new() -> Answering {
        Answering {
            overrides: Arc::new(MemoryOverrides::default()),
        }
    }
}

/// The error `Answering` gives for `method`.
fn answered(method: &str) -> String {
    format!("answered {method}")
}

fn refused<T>(method: &str) -> BoxFuture<'static, Result<T, StoreError>>
where
    T: Send + 'static,
{
    let error = StoreError::Protocol(answered(method));
    Box::pin(std::future::ready(Err(error)))
}

impl Store for Answering {
    fn check_and_consume<'a>(
        &'a self,
        _checks: &'a [Check],
        _now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        refused("check_and_consume")
    }

    fn check_and_consume_ready(
        &self,
        _checks: &[Check],
        _now: Option<Timestamp>,
    ) -> Option<Result<Decision, StoreError>> {
        Some(Err(StoreError::Protocol(answered(
            "check_and_consume_ready",
        ))))
    }

    fn release<'a>(&'a self, _leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        refused("release")
    }

    fn backend(&self) -> &'static str {
        "answering"
    }

    fn peek<'a>(
        &'a self,
        _checks: &'a [Check],
        _now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        refused("peek")
    }

    fn reset<'a>(&'a self, _keys: &'a [Arc<str>]) -> BoxFuture<'a, Result<u64, StoreError>> {
        refused("reset")
    }

    fn charge<'a>(
        &'a self,
        _checks: &'a [Check],
        _now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        refused("charge")
    }

    fn refund<'a>(
        &'a self,
        _checks: &'a [Check],
        _charged_at: Timestamp,
        _now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        refused("refund")
    }

    fn supports(&self, _algorithm: Algorithm) -> bool {
        false
    }

    fn breaker_state(&self) -> Option<BreakerState> {
        Some(BreakerState::Open)
    }

    fn override_backend(&self) -> Option<Arc<dyn OverrideBackend>> {
        Some(self.overrides.clone())
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        refused("probe")
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        refused("flush")
    }

    fn persistence(&self) -> BoxFuture<'_, Option<bool>> {
        Box::pin(std::future::ready(Some(false)))
    }
}

/// The answer of a call that should have been `Answering`'s error for `method`.
#[track_caller]
fn assert_answered<T: std::fmt::Debug>(result: Result<T, StoreError>, method: &str) {
    match result {
        Err(StoreError::Protocol(message)) if message == answered(method) => {}
        other => panic!("{method}: not forwarded, answered {other:?}"),
    }
}

/// Whether `check_and_consume_ready` is forwarded too: a wrapper whose decisions may have to
/// wait (a networked half, a region counting demand) answers `None` by design.
#[derive(Clone, Copy, PartialEq)]
enum ReadyDecisions {
    Forwarded,
    NeverReady,
}

async fn assert_forwards_everything(
    wrapper: &dyn Store,
    wrapped: &Answering,
    ready: ReadyDecisions,
) {
    let limit = Arc::new(Limit::fixed_window("wrapped", 10, Duration::from_secs(60)).unwrap());
    let checks = [Check::new("fgtest:{ip:wrapped}:p:wrapped", limit, 1)];
    let keys: [Arc<str>; 1] = [checks[0].key.clone()];
    let now = Some(Timestamp::now());
    let lease = Lease {
        key: checks[0].key.clone(),
        id: 7,
        cost: 1,
    };

    assert_answered(
        wrapper.check_and_consume(&checks, now).await,
        "check_and_consume",
    );
    match (ready, wrapper.check_and_consume_ready(&checks, now)) {
        (ReadyDecisions::Forwarded, Some(answer)) => {
            assert_answered(answer, "check_and_consume_ready")
        }
        (ReadyDecisions::NeverReady, None) => {}
        (_, answer) => panic!("check_and_consume_ready answered {answer:?}"),
    }
    assert_answered(wrapper.release(vec![lease]).await, "release");
    assert_eq!(wrapper.backend(), "answering");
    assert_answered(wrapper.peek(&checks, now).await, "peek");
    assert_answered(wrapper.reset(&keys).await, "reset");
    assert_answered(wrapper.charge(&checks, now).await, "charge");
    assert_answered(
        wrapper.refund(&checks, Timestamp::now(), now).await,
        "refund",
    );
    assert!(
        !wrapper.supports(Algorithm::Concurrency),
        "supports: not forwarded"
    );
    assert_eq!(wrapper.breaker_state(), Some(BreakerState::Open));
    let overrides = wrapper
        .override_backend()
        .expect("override_backend: not forwarded");
    assert!(
        Arc::ptr_eq(&overrides, &wrapped.overrides),
        "override_backend: another backend"
    );
    assert_answered(wrapper.probe().await, "probe");
    assert_eq!(wrapper.persistence().await, Some(false), "persistence");
    // Last: a region's store is retired by its flush.
    assert_answered(wrapper.flush().await, "flush");
}

#[tokio::test]
async fn an_arc_forwards_every_method() {
    let wrapped = Arc::new(Answering::new());
    assert_forwards_everything(&wrapped.clone(), &wrapped, ReadyDecisions::Forwarded).await;
}

#[tokio::test]
async fn a_split_store_forwards_every_method_of_its_exact_store() {
    let server = RedisServer::start();
    let hot = BatchedStore::builder(RedisStore::builder(server.url()).build().unwrap())
        .sync_interval(Duration::from_secs(3600))
        .build();
    let wrapped = Arc::new(Answering::new());
    // Nothing runs batched: every check is the exact store's.
    let split = SplitStore::new(hot, wrapped.clone(), |_: &Check| false);
    assert_forwards_everything(&split, &wrapped, ReadyDecisions::NeverReady).await;
}

#[tokio::test]
async fn a_regional_store_forwards_every_method_of_the_region_s_store() {
    let server = RedisServer::start();
    let regions = vec!["east".to_owned(), "west".to_owned()];
    let settings = RegionSettings::new(
        "east",
        regions,
        server.url(),
        server.url(),
        Duration::from_millis(50),
    );
    let wrapped = Arc::new(Answering::new());
    let regional = RegionalStore::new(wrapped.clone(), settings).expect("a region");
    assert_forwards_everything(&regional, &wrapped, ReadyDecisions::NeverReady).await;
}
