//! `ShouldRateLimit` at Envoy's edge: the request's messages converted into a
//! [`decide::Request`], decided there in floodgate's own terms, and its answers converted into
//! the `RateLimitResponse`'s statuses and headers.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderValue as ProtoHeader;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit as ProtoLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use floodgate::HeaderStyle;
use floodgate::headers::RateLimitHeaders;

use super::decide::{self, Answer, Decided, Decider, Refusal};
use super::limit_overrides::LimitOverrides;
use super::reload::RulesHandle;
use super::rules::DescriptorLimit;
use crate::config::Config;
use crate::gateway::Gateway;

/// The rate limit service: the gateway's store and failure policy, the directory's rules.
pub(crate) struct RlsService {
    gateway: Arc<Gateway>,
    rules: Arc<RulesHandle>,
    response_headers: bool,
    /// Decides on the gateway's store, under its failure policy.
    decider: Decider,
    /// The limits of Envoy's `limit` overrides, the most recently used kept.
    overrides: LimitOverrides,
}

impl RlsService {
    /// A service deciding on `gateway`'s store under the rules of `rules`.
    pub(crate) fn new(
        gateway: Arc<Gateway>,
        rules: Arc<RulesHandle>,
        response_headers: bool,
    ) -> Self {
        RlsService {
            decider: Decider::new(gateway.clone()),
            gateway,
            rules,
            response_headers,
            overrides: LimitOverrides::default(),
        }
    }

    /// The limit of a descriptor's `limit` override, if it carries a usable one.
    fn override_limit(&self, descriptor: &RateLimitDescriptor) -> Option<Arc<DescriptorLimit>> {
        let requested = descriptor.limit.as_ref()?;
        self.overrides
            .limit_for(requested.requests_per_unit, requested.unit)
    }

    /// `request` in floodgate's terms. Envoy's `limit` override decides a descriptor in place
    /// of the file (as envoyproxy/ratelimit does, whether or not the file configures it).
    fn to_decide<'a>(&self, request: &'a RateLimitRequest) -> decide::Request<'a> {
        decide::Request {
            domain: &request.domain,
            hits_addend: request.hits_addend,
            descriptors: request
                .descriptors
                .iter()
                .map(|descriptor| decide::Descriptor {
                    entries: descriptor
                        .entries
                        .iter()
                        .map(|entry| (entry.key.as_str(), entry.value.as_str()))
                        .collect(),
                    hits_addend: descriptor.hits_addend.as_ref().map(|hits| hits.value),
                    negative_hits: descriptor.is_negative_hits,
                    limit: self.override_limit(descriptor),
                })
                .collect(),
        }
    }

    /// The answer to one `ShouldRateLimit` request: its descriptors matched against the
    /// domain's rules, planned into checks, decided, and answered with statuses and headers.
    /// gRPC and `POST /json` both answer through this.
    ///
    /// # Errors
    ///
    /// `INVALID_ARGUMENT` for a request without a domain or descriptors, or with
    /// `is_negative_hits`; `UNAVAILABLE` when the store fails under `on_store_error: closed`.
    pub(crate) async fn should_rate_limit(
        &self,
        request: &RateLimitRequest,
    ) -> Result<RateLimitResponse, tonic::Status> {
        // Refused as envoyproxy/ratelimit refuses them (its `/json` answers 400).
        if request.domain.is_empty() {
            return Err(tonic::Status::invalid_argument(
                "rate limit domain must not be empty",
            ));
        }
        if request.descriptors.is_empty() {
            return Err(tonic::Status::invalid_argument(
                "rate limit descriptor list must not be empty",
            ));
        }
        let rules = self.rules.current();
        let Some(tree) = rules.domain(&request.domain) else {
            // An unknown domain limits nothing (as envoyproxy/ratelimit answers).
            return Ok(RateLimitResponse {
                overall_code: Code::Ok as i32,
                statuses: request.descriptors.iter().map(|_| ok_status()).collect(),
                ..RateLimitResponse::default()
            });
        };
        let current = self.gateway.current();
        let config = &current.config;
        let asked = self.to_decide(request);
        let matched = decide::matched(tree, &asked);
        let planned = decide::plan(&asked, &matched, &config.store.prefix)?;
        let decided = self.decider.decide_planned(&planned).await?;
        let answers = decide::answers(&planned, &decided, &request.domain);
        Ok(RateLimitResponse {
            overall_code: if decided.admitted() {
                Code::Ok as i32
            } else {
                Code::OverLimit as i32
            },
            statuses: answers.iter().map(status).collect(),
            response_headers_to_add: self.headers(&decided, config),
            ..RateLimitResponse::default()
        })
    }

    /// The rate limit headers of the binding limit, when the answer carries them.
    fn headers(&self, decided: &Decided, config: &Config) -> Vec<ProtoHeader> {
        let mut response_headers_to_add = Vec::new();
        if self.response_headers
            && let Some(decision) = decided.enforced()
        {
            let style = config.response.headers;
            if style != HeaderStyle::None {
                let mut headers = http::HeaderMap::new();
                RateLimitHeaders::new(decision, style).apply(&mut headers);
                if let Some(wait) = decision.retry_after() {
                    let seconds = floodgate::headers::retry_after_secs(
                        wait,
                        config.response.retry_after_jitter,
                        fastrand::f64(),
                    );
                    headers.insert(http::header::RETRY_AFTER, http::HeaderValue::from(seconds));
                }
                for (name, value) in &headers {
                    response_headers_to_add.push(ProtoHeader {
                        key: name.as_str().to_owned(),
                        value: String::from_utf8_lossy(value.as_bytes()).into_owned(),
                        ..ProtoHeader::default()
                    });
                }
            }
        }
        response_headers_to_add
    }
}

/// A refusal as gRPC answers it (`POST /json` reads the code).
impl From<Refusal> for tonic::Status {
    fn from(refusal: Refusal) -> tonic::Status {
        match refusal {
            Refusal::NegativeHits => tonic::Status::invalid_argument(
                "is_negative_hits is not supported: floodgate never refunds through ShouldRateLimit",
            ),
            Refusal::Unavailable => {
                tonic::Status::unavailable("rate limit store unavailable (on_store_error: closed)")
            }
        }
    }
}

/// A `duration_until_reset` in whole seconds, rounded up (never early), as envoyproxy/ratelimit
/// answers it: clients that read the seconds alone, or parse the JSON form's `"49s"` as a
/// whole number, read what they read from the peer.
fn proto_duration(duration: Duration) -> ProtoDuration {
    let seconds = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    ProtoDuration {
        seconds: i64::try_from(seconds).unwrap_or(i64::MAX),
        nanos: 0,
    }
}

/// The time until the current window of `window`, aligned to the epoch, ends: what
/// envoyproxy/ratelimit answers for a limit that counts nothing (`requests_per_unit: 0`).
fn window_end(window: Duration) -> ProtoDuration {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let window = window.as_micros().max(1);
    let left = window - now.as_micros() % window;
    proto_duration(Duration::from_micros(
        u64::try_from(left).unwrap_or(u64::MAX),
    ))
}

fn proto_limit(limit: &DescriptorLimit) -> ProtoLimit {
    ProtoLimit {
        name: limit.name.as_deref().unwrap_or_default().to_owned(),
        requests_per_unit: limit.requests_per_unit,
        unit: limit.unit.proto(),
    }
}

fn ok_status() -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok as i32,
        ..DescriptorStatus::default()
    }
}

/// The `DescriptorStatus` of a descriptor's answer.
fn status(answer: &Answer<'_>) -> DescriptorStatus {
    let code = if answer.is_over() {
        Code::OverLimit as i32
    } else {
        Code::Ok as i32
    };
    match *answer {
        Answer::NoLimit => ok_status(),
        Answer::Fixed { limit, over } => DescriptorStatus {
            code,
            current_limit: over.then(|| proto_limit(limit)),
            limit_remaining: if over { 0 } else { u32::MAX },
            duration_until_reset: over.then(|| window_end(limit.unit.window())),
            ..DescriptorStatus::default()
        },
        Answer::Counted { limit, state: None } => DescriptorStatus {
            code,
            current_limit: Some(proto_limit(limit)),
            ..DescriptorStatus::default()
        },
        Answer::Counted {
            limit,
            state: Some(state),
        } => DescriptorStatus {
            code,
            current_limit: Some(proto_limit(limit)),
            limit_remaining: u32::try_from(state.remaining).unwrap_or(u32::MAX),
            duration_until_reset: Some(proto_duration(state.reset_after)),
            ..DescriptorStatus::default()
        },
    }
}

#[tonic::async_trait]
impl RateLimitService for RlsService {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        RlsService::should_rate_limit(self, request.get_ref())
            .await
            .map(tonic::Response::new)
    }
}
