//! What an Envoy is told, in the terms its filter reads: a blanket rule or a token bucket, for
//! a whole number of seconds.
//!
//! Envoy's filter reads a time to live as whole seconds (no presence check: an unset or
//! sub-second one expires at once), enforces only `blanket_rule` and `token_bucket` (an
//! assignment of `requests_per_time_unit` fails open), and refills a token bucket by
//! `tokens_per_fill` every `fill_interval` whole seconds. Every action built here keeps to that.

use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::TokenBucket;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{
    BlanketRule, Strategy as ProtoStrategy,
};
use envoy_types::pb::envoy::r#type::v3::RateLimitStrategy;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, UInt32Value};

use crate::config::QuotaLimit;

/// What a bucket's Envoy enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Strategy {
    /// Every request.
    AllowAll,
    /// No request.
    DenyAll,
    /// `tokens_per_fill` every `fill_interval_secs`, at most `max_tokens` at once.
    TokenBucket {
        max_tokens: u32,
        tokens_per_fill: u32,
        fill_interval_secs: u32,
    },
}

/// The longest fill interval a share is cut into: a share below one request per this many
/// seconds is refused outright.
const LONGEST_FILL_SECS: u64 = 3600;

/// The longest fill interval tried to bring a bucket's rate close to its share: Envoy refills
/// continuously at `tokens_per_fill / fill_interval`, so a longer interval only makes the rate
/// finer (9.6 per second is 48 every 5 s, not 9 every second).
const FINEST_FILL_SECS: u64 = 60;

/// `tokens_per_fill` and `fill_interval` (whole seconds) whose rate is the closest to `share`
/// (thousandths per second) without exceeding it, the shortest interval among equals: within
/// a sixtieth of a request per second (0.96 per second is 24 every 25 s, not 1 every 2 s).
/// `None` below one request per [`LONGEST_FILL_SECS`].
fn fill_of(share: u64) -> Option<(u64, u64)> {
    if share == 0 {
        return None;
    }
    if share * FINEST_FILL_SECS < 1000 {
        // Below one request per the finest interval: one token per as many seconds as it
        // takes.
        let interval = 1000u64.div_ceil(share);
        return (interval <= LONGEST_FILL_SECS).then_some((1, interval));
    }
    let mut best = (0, 1);
    for interval in 1..=FINEST_FILL_SECS {
        let tokens = share * interval / 1000;
        // tokens / interval > best.0 / best.1, in integers.
        if tokens * best.1 > best.0 * interval {
            best = (tokens, interval);
        }
        if best.0 * 1000 == share * best.1 {
            break;
        }
    }
    Some(best)
}

impl Strategy {
    /// The token bucket of `share` (thousandths of a request per second) of `limit`. Its rate
    /// never exceeds the share, and comes within a sixtieth of a request per second of it; its
    /// bucket holds the share's part of the limit's burst rounded to the nearest token (at
    /// least one), so that the buckets of shares within the limit hold about its burst
    /// together: no more than half a token each above it. Rounded down, a share's bucket of
    /// one token where its part was nearly two wasted the refill of requests at about its rate
    /// (admitting 62 % of the limit where the rate limit service admitted all of it).
    pub(crate) fn for_share(share: u64, limit: QuotaLimit) -> Strategy {
        let Some((tokens_per_fill, fill_interval_secs)) = fill_of(share) else {
            return Strategy::DenyAll;
        };
        let rate = u128::from(limit.rate_milli.max(1));
        let burst_part = ((u128::from(limit.burst) * u128::from(share) + rate / 2) / rate) as u64;
        let clamp = |value: u64| u32::try_from(value).unwrap_or(u32::MAX);
        Strategy::TokenBucket {
            max_tokens: clamp(burst_part.max(1)),
            tokens_per_fill: clamp(tokens_per_fill),
            fill_interval_secs: clamp(fill_interval_secs),
        }
    }

    /// Its name in metrics and the admin API.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Strategy::AllowAll => "allow_all",
            Strategy::DenyAll => "deny_all",
            Strategy::TokenBucket { .. } => "token_bucket",
        }
    }

    fn proto(&self) -> RateLimitStrategy {
        let strategy = match *self {
            Strategy::AllowAll => ProtoStrategy::BlanketRule(BlanketRule::AllowAll as i32),
            Strategy::DenyAll => ProtoStrategy::BlanketRule(BlanketRule::DenyAll as i32),
            Strategy::TokenBucket {
                max_tokens,
                tokens_per_fill,
                fill_interval_secs,
            } => ProtoStrategy::TokenBucket(TokenBucket {
                max_tokens,
                tokens_per_fill: Some(UInt32Value {
                    value: tokens_per_fill,
                }),
                fill_interval: Some(whole_seconds(Duration::from_secs(u64::from(
                    fill_interval_secs,
                )))),
            }),
        };
        RateLimitStrategy {
            strategy: Some(strategy),
        }
    }
}

/// `duration` in whole seconds, rounded down.
fn whole_seconds(duration: Duration) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(duration.as_secs()).unwrap_or(i64::MAX),
        nanos: 0,
    }
}

/// `strategy` for `bucket` for `ttl` (whole seconds; 0 expires it at once).
pub(crate) fn assign(bucket: &BucketId, strategy: Strategy, ttl: Duration) -> BucketAction {
    BucketAction {
        bucket_id: Some(bucket.clone()),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(whole_seconds(ttl)),
            rate_limit_strategy: Some(strategy.proto()),
        })),
    }
}

/// `bucket` abandoned: the Envoy erases it (a later request starts it again).
pub(crate) fn abandon(bucket: &BucketId) -> BucketAction {
    BucketAction {
        bucket_id: Some(bucket.clone()),
        bucket_action: Some(Action::AbandonAction(AbandonAction {})),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: QuotaLimit = QuotaLimit {
        rate_milli: 100_000,
        burst: 50,
    };

    fn bucket_of(strategy: Strategy) -> (u32, u32, u32) {
        match strategy {
            Strategy::TokenBucket {
                max_tokens,
                tokens_per_fill,
                fill_interval_secs,
            } => (max_tokens, tokens_per_fill, fill_interval_secs),
            other => panic!("not a token bucket: {other:?}"),
        }
    }

    #[test]
    fn a_share_becomes_a_bucket_whose_rate_never_exceeds_it() {
        for share in [
            1, 7, 16, 17, 400, 960, 999, 1000, 1001, 33_333, 50_000, 99_999, 100_000,
        ] {
            let (max_tokens, per_fill, interval) = bucket_of(Strategy::for_share(share, LIMIT));
            assert!(interval >= 1 && per_fill >= 1 && max_tokens >= 1);
            let (per_fill, interval) = (u64::from(per_fill), u64::from(interval));
            assert!(
                per_fill * 1000 <= share * interval,
                "{share}: {per_fill}/{interval}s"
            );
            if share * 60 >= 1000 {
                // Within a sixtieth of a request per second.
                assert!(
                    share * interval - per_fill * 1000 <= 1000 * interval / 60,
                    "{share}"
                );
            }
        }
        assert_eq!(bucket_of(Strategy::for_share(50_000, LIMIT)), (25, 50, 1));
        assert_eq!(
            bucket_of(Strategy::for_share(9_600, LIMIT)),
            (5, 48, 5),
            "4.8 tokens: 5"
        );
        assert_eq!(bucket_of(Strategy::for_share(400, LIMIT)), (1, 2, 5));
        assert_eq!(bucket_of(Strategy::for_share(960, LIMIT)), (1, 24, 25));
        assert_eq!(bucket_of(Strategy::for_share(10, LIMIT)), (1, 1, 100));
        assert_eq!(Strategy::for_share(0, LIMIT), Strategy::DenyAll);
        assert_eq!(Strategy::for_share(0, LIMIT).label(), "deny_all");
    }

    /// Regression (found by `MODE=rls bench/rlqs.sh`): five Envoys sharing 10/s with a burst of
    /// 10 each held 1.92/s in a bucket of one token (the burst's part, 1.92, rounded down).
    /// Requests at about the rate then find the single token spent and refill wasted while the
    /// bucket sat full: each Envoy admitted about 1.1/s of its 1.92 (62 % of the limit, where
    /// the rate limit service admitted 100 %). Rounded to the nearest token, the five hold two
    /// each: the whole burst.
    #[test]
    fn a_share_s_part_of_the_burst_is_rounded_to_the_nearest_token() {
        let limit = QuotaLimit {
            rate_milli: 10_000,
            burst: 10,
        };
        assert_eq!(bucket_of(Strategy::for_share(1_920, limit)).0, 2);
        assert_eq!(bucket_of(Strategy::for_share(1_400, limit)).0, 1);
        assert_eq!(
            bucket_of(Strategy::for_share(100, limit)).0,
            1,
            "at least one"
        );
        let five: u32 = (0..5)
            .map(|_| bucket_of(Strategy::for_share(1_920, limit)).0)
            .sum();
        assert_eq!(five, 10, "the whole burst, no more");
    }

    #[test]
    fn the_buckets_of_shares_within_the_limit_hold_no_more_than_its_burst_together() {
        let limit = QuotaLimit {
            rate_milli: 10_000,
            burst: 100,
        };
        let shares = [2_500, 2_500, 2_500, 2_500];
        let burst: u32 = shares
            .iter()
            .map(|share| bucket_of(Strategy::for_share(*share, limit)).0)
            .sum();
        assert_eq!(burst, 100);
    }

    #[test]
    fn every_action_keeps_to_what_envoy_reads() {
        let bucket = BucketId::default();
        for strategy in [
            Strategy::AllowAll,
            Strategy::DenyAll,
            Strategy::for_share(12_345, LIMIT),
        ] {
            let action = assign(&bucket, strategy, Duration::from_millis(15_700));
            let Some(Action::QuotaAssignmentAction(assignment)) = action.bucket_action else {
                panic!("an assignment");
            };
            let ttl = assignment
                .assignment_time_to_live
                .expect("a TTL is always set");
            assert_eq!((ttl.seconds, ttl.nanos), (15, 0), "whole seconds");
            match assignment.rate_limit_strategy.and_then(|s| s.strategy) {
                Some(ProtoStrategy::BlanketRule(_)) => {}
                Some(ProtoStrategy::TokenBucket(bucket)) => {
                    assert!(bucket.tokens_per_fill.is_some_and(|fill| fill.value >= 1));
                    let interval = bucket.fill_interval.expect("set");
                    assert!(interval.seconds >= 1 && interval.nanos == 0);
                    assert!(bucket.max_tokens >= 1);
                }
                other => panic!("never requests_per_time_unit or nothing: {other:?}"),
            }
        }
        assert!(matches!(
            abandon(&bucket).bucket_action,
            Some(Action::AbandonAction(_))
        ));
    }
}
