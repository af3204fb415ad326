//! The layer end to end through `oneshot`: every response it returns carries its
//! `RequestOutcome`, on every path (admitted, limited, shadowed, listed, switched off, no
//! limit, a failing store under each policy), with the limit that bound the decision.

use crate::common;

use std::time::Duration;

use common::*;
use floodgate::lists::ClientList;
use floodgate::rollout::{Mode, Rollout};
use floodgate::store::Check;
use floodgate::{FailurePolicy, MemoryStore, Outcome, RateLimitLayer, RequestOutcome};
use http::{Response, StatusCode};
use tower::{Layer, service_fn};

fn outcome_of(response: &Response<bytes::Bytes>) -> &RequestOutcome {
    response
        .extensions()
        .get::<RequestOutcome>()
        .expect("every response of the layer carries its outcome")
}

#[tokio::test]
async fn every_path_through_the_layer_says_what_became_of_the_request() {
    let store = MemoryStore::new();
    let rollout = Rollout::new(Mode::Enforce, 100.0);
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .store(store.clone())
        .rollout(rollout.clone())
        .allowlist(ClientList::new().ip("192.0.2.0/24".parse().unwrap()))
        .denylist(ClientList::new().ip("203.0.113.66/32".parse().unwrap()))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));

    let admitted = send(&service, from_peer("198.51.100.1:1")).await;
    assert_eq!(admitted.status(), StatusCode::OK);
    let outcome = outcome_of(&admitted);
    assert_eq!(outcome.outcome, Outcome::Allowed);
    let binding = outcome.binding.as_ref().expect("a binding limit");
    assert_eq!((&*binding.name, binding.remaining), ("per-second", 0));
    assert_eq!(outcome.retry_after(), None);

    let limited = send(&service, from_peer("198.51.100.1:1")).await;
    assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
    let outcome = outcome_of(&limited);
    assert_eq!(outcome.outcome, Outcome::Limited);
    assert!(outcome.outcome.is_refused());
    let wait = outcome
        .retry_after()
        .expect("a denial says how long to wait");
    assert!(
        wait > Duration::ZERO && wait <= Duration::from_secs(1),
        "{wait:?}"
    );

    let allowlisted = send(&service, from_peer("192.0.2.7:1")).await;
    assert_eq!(outcome_of(&allowlisted).outcome, Outcome::Bypassed);
    assert_eq!(outcome_of(&allowlisted).binding, None);
    let denylisted = send(&service, from_peer("203.0.113.66:1")).await;
    assert_eq!(denylisted.status(), StatusCode::FORBIDDEN);
    assert_eq!(outcome_of(&denylisted).outcome, Outcome::Denylisted);

    rollout.set_mode(Mode::Shadow);
    let shadowed = send(&service, from_peer("198.51.100.1:1")).await;
    assert_eq!(shadowed.status(), StatusCode::OK);
    let outcome = outcome_of(&shadowed);
    assert_eq!(outcome.outcome, Outcome::ShadowLimited);
    assert!(!outcome.outcome.is_refused(), "the client was let through");
    assert!(
        outcome.retry_after().is_some(),
        "what the denial would have said"
    );

    rollout.set_mode(Mode::Off);
    let off = send(&service, from_peer("198.51.100.1:1")).await;
    assert_eq!(outcome_of(&off).outcome, Outcome::Bypassed);
}

/// A plan with no limit for any request.
struct NoLimits;

impl floodgate::plan::LimitPlan for NoLimits {
    fn checks(
        &self,
        _request: &floodgate::RequestInfo<'_>,
        _identity: &floodgate::Identity,
        _cost: u64,
    ) -> Vec<Check> {
        Vec::new()
    }
}

#[tokio::test]
async fn a_request_no_limit_applies_to_is_unlimited() {
    let layer = RateLimitLayer::builder().plan(NoLimits).build().unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let response = send(&service, from_peer("198.51.100.1:1")).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        outcome_of(&response),
        &RequestOutcome::undecided(Outcome::Unlimited)
    );
}

#[tokio::test]
async fn a_failing_store_is_named_by_what_the_policy_did() {
    let outcome = |policy: FailurePolicy| async move {
        let layer = RateLimitLayer::builder()
            .limit(per_second(1))
            .store(DownStore)
            .on_store_error(policy)
            .build()
            .unwrap();
        let service = layer.layer(service_fn(ok_handler));
        let response = send(&service, from_peer("198.51.100.1:1")).await;
        (response.status(), outcome_of(&response).outcome)
    };
    assert_eq!(
        outcome(FailurePolicy::Open).await,
        (StatusCode::OK, Outcome::FallbackAllowed)
    );
    assert_eq!(
        outcome(FailurePolicy::Closed).await,
        (StatusCode::SERVICE_UNAVAILABLE, Outcome::Unavailable)
    );
}

/// A shadowed request whose store fails and whose `local` fallback refuses it: let through
/// (shadow mode shows no denial), named by what decided it, the failure policy's
/// `fallback_limited` rather than the store's `shadow_limited` (SPEC §4; the RLS names a shadow
/// descriptor the same way).
#[tokio::test]
async fn a_shadowed_request_the_fallback_refuses_is_let_through_as_fallback_limited() {
    // A day's window: the second request is refused however slowly it follows the first.
    let one_a_day = floodgate::Limit::token_bucket("per-day", 1, Duration::from_secs(86_400));
    let layer = RateLimitLayer::builder()
        .limit(one_a_day.unwrap())
        .store(DownStore)
        .on_store_error(FailurePolicy::Local)
        .rollout(Rollout::new(Mode::Shadow, 100.0))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let first = send(&service, from_peer("198.51.100.1:1")).await;
    assert_eq!(
        (first.status(), outcome_of(&first).outcome),
        (StatusCode::OK, Outcome::FallbackAllowed)
    );
    let second = send(&service, from_peer("198.51.100.1:1")).await;
    assert_eq!(
        (second.status(), outcome_of(&second).outcome),
        (StatusCode::OK, Outcome::FallbackLimited),
        "the node's limiter holds one a day; shadow mode lets the refusal through"
    );
}

/// Nested layers (a global limit around a tighter one on a route): the outcome on the
/// response is the binding layer's, and a 429 still carries its whole decision.
#[tokio::test]
async fn nested_layers_keep_the_binding_outcome() {
    let tight = floodgate::Limit::token_bucket("route", 1, Duration::from_secs(1)).unwrap();
    let inner = RateLimitLayer::builder()
        .limit(tight)
        .store(MemoryStore::new())
        .build()
        .unwrap();
    let outer = RateLimitLayer::builder()
        .limit(per_second(100))
        .store(MemoryStore::new())
        .build()
        .unwrap();
    let service = outer.layer(inner.layer(service_fn(ok_handler)));

    let admitted = send(&service, from_peer("198.51.100.1:1")).await;
    assert_eq!(admitted.status(), StatusCode::OK);
    let outcome = outcome_of(&admitted);
    assert_eq!(outcome.outcome, Outcome::Allowed);
    let binding = outcome.binding.as_ref().unwrap();
    assert_eq!(
        (&*binding.name, binding.remaining),
        ("route", 0),
        "the inner limit has less room than the outer one's 99 of 100"
    );

    let limited = send(&service, from_peer("198.51.100.1:1")).await;
    assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        outcome_of(&limited).outcome,
        Outcome::Limited,
        "the outer layer admitted it, but the inner one answered"
    );
    let decision = limited
        .extensions()
        .get::<floodgate::Decision>()
        .expect("a denial carries its decision for a logging layer outside");
    assert!(!decision.is_allowed());
}

/// Adaptive concurrency inside the rate limits (issue 49): a request it sheds is told as
/// `shed`, a refusal, carrying the rate limit's binding limit (the shedding decided against
/// none); the request it let through keeps the rate limit's own outcome.
#[tokio::test]
async fn a_request_shed_inside_the_layer_is_told_as_shed_with_the_binding_limit() {
    use floodgate::adaptive::{AdaptiveConcurrencyLayer, GradientSettings};
    let adaptive = AdaptiveConcurrencyLayer::builder()
        .gradient(GradientSettings {
            initial_limit: 1,
            min_limit: 1,
            ..GradientSettings::default()
        })
        .build()
        .unwrap();
    // The first request is held at the service until released: it fills the limit of one.
    let (release, held) = tokio::sync::oneshot::channel::<()>();
    let held = std::sync::Arc::new(std::sync::Mutex::new(Some(held)));
    let (arrived_tx, mut arrived) = tokio::sync::mpsc::unbounded_channel();
    let inner = service_fn(move |request: http::Request<()>| {
        let held = held.lock().unwrap().take();
        let arrived = arrived_tx.clone();
        async move {
            if let Some(held) = held {
                arrived.send(()).unwrap();
                let _ = held.await;
            }
            ok_handler(request).await
        }
    });
    let rate_limits = RateLimitLayer::builder()
        .limit(per_second(100))
        .store(MemoryStore::new())
        .build()
        .unwrap();
    let service = rate_limits.layer(adaptive.layer(inner));

    let first = tokio::spawn({
        let service = service.clone();
        async move { send(&service, from_peer("198.51.100.1:1")).await }
    });
    arrived.recv().await.unwrap();
    let shed = send(&service, from_peer("198.51.100.2:1")).await;
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    let outcome = outcome_of(&shed);
    assert_eq!(outcome.outcome, Outcome::Shed);
    assert!(outcome.outcome.is_refused());
    let binding = outcome
        .binding
        .as_ref()
        .expect("the rate limit's binding limit");
    assert_eq!((&*binding.name, binding.remaining), ("per-second", 99));

    release.send(()).unwrap();
    let first = first.await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(outcome_of(&first).outcome, Outcome::Allowed);
}
