//! Misuse that used to show only at run time is a build error with the field named: limit
//! settings next to a plan, a limit the store cannot decide, a limit without its quantity, and
//! bad Redis settings.

use crate::common;

use floodgate_test_support as support;

use std::time::Duration;

use common::per_second;
use floodgate::store::{BatchedStore, RedisStore};
use floodgate::{BuildError, Limit, RateLimitLayer, plan::LimitPlan, plan::StaticPlan};
use support::RedisServer;

#[test]
fn limits_rule_or_prefix_next_to_a_plan_are_an_error_not_ignored() {
    // Regression: with `.plan()` set, `.limit()` was silently ignored (a 1/s limit
    // admitted three requests in a row).
    let plan = || {
        StaticPlan::new(
            String::from("fg"),
            String::from("custom"),
            vec![std::sync::Arc::new(per_second(5))],
        )
    };
    for (builder, ignored) in [
        (
            RateLimitLayer::builder().plan(plan()).limit(per_second(1)),
            "limit",
        ),
        (RateLimitLayer::builder().plan(plan()).rule("login"), "rule"),
        (
            RateLimitLayer::builder().plan(plan()).key_prefix("app"),
            "key_prefix",
        ),
    ] {
        let error = builder.build().expect_err(ignored);
        assert_eq!(error, BuildError::IgnoredWithPlan(ignored));
        assert!(error.to_string().starts_with("plan:"), "{error}");
    }
    assert!(RateLimitLayer::builder().plan(plan()).build().is_ok());
    let _: &dyn LimitPlan = &plan();
}

#[tokio::test]
async fn a_batched_store_refuses_limits_it_cannot_decide_at_build_time() {
    // Regression: a concurrency limit on a BatchedStore built fine, then every
    // request was a StoreError::Protocol and failed open.
    let server = RedisServer::start();
    let batched = BatchedStore::builder(RedisStore::builder(server.url()).build().unwrap()).build();
    let error = RateLimitLayer::builder()
        .limit(per_second(10))
        .limit(Limit::concurrency("streams", 2, Duration::from_secs(30)).unwrap())
        .store(batched.clone())
        .build()
        .expect_err("concurrency on a batched store");
    assert!(
        error
            .to_string()
            .starts_with("limits[1].algorithm: the batched store cannot decide `concurrency`"),
        "{error}"
    );
    assert!(
        RateLimitLayer::builder()
            .limit(per_second(10))
            .store(batched)
            .build()
            .is_ok()
    );
}

#[test]
fn a_limit_without_its_quantity_says_it_is_required() {
    // Regression: a builder that never called `.limit()` said "must be greater than 0".
    let error = Limit::builder("x")
        .window(Duration::from_secs(1))
        .build()
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "limit: is required (LimitBuilder::limit)"
    );
    // And a limit error converts into a build error.
    let build: BuildError = error.into();
    assert!(build.to_string().starts_with("limit:"));
}

#[test]
fn bad_redis_settings_are_build_errors_that_name_the_url_without_its_password() {
    // Regression: a bad Redis URL was StoreError::Unavailable, transient, with no URL in the
    // message; zero timeouts and breaker(0, ZERO) were accepted.
    let error = RedisStore::builder("redis://:hunter2@127.0.0.1:6379/not-a-db")
        .build()
        .unwrap_err();
    assert!(!error.is_transient(), "{error}");
    let message = error.to_string();
    assert!(
        message.contains("redis://:***@127.0.0.1:6379/not-a-db"),
        "{message}"
    );
    assert!(!message.contains("hunter2"), "{message}");
    let unparsable = RedisStore::builder("http://elsewhere").build().unwrap_err();
    assert!(
        unparsable
            .to_string()
            .contains("`http://elsewhere` is not a Redis URL")
    );
    for (builder, field) in [
        (
            RedisStore::builder("redis://127.0.0.1:6379").timeout(Duration::ZERO),
            "timeout",
        ),
        (
            RedisStore::builder("redis://127.0.0.1:6379").breaker(0, Duration::from_secs(1)),
            "breaker",
        ),
        (
            RedisStore::builder("redis://127.0.0.1:6379").breaker(5, Duration::ZERO),
            "breaker",
        ),
    ] {
        let error = builder.build().unwrap_err();
        assert!(!error.is_transient());
        assert!(error.to_string().contains(field), "{error}");
    }
    assert!(
        RedisStore::cluster(Vec::new()).build().is_err(),
        "no node at all"
    );
}
