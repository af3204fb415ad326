//! One configuration version, ready to serve ([`ConfigVersion`]): everything a request or an
//! operator reaches through it, its limit plan, one rate limit service per plan (a plan may
//! override the failure policy), the store and the upstream client. [`crate::gateway`] keeps
//! the version in service and builds the next.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use floodgate::store::HotIdentities;
use floodgate::{
    FailurePolicy, Outcome, RateLimit, RateLimitLayer, RequestInfo, rollout::Rollout,
    service::RateLimitBody,
};
use http::{Request, Response};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use tower::{Layer, ServiceExt};

use crate::access_log::RequestFacts;
use crate::client::{Resolution, ResolvedClient, resolve};
use crate::config::Config;
use crate::error::GatewayError;
use crate::outcome::GatewayOutcome;
use crate::plan::GatewayPlan;
use crate::proxy::shedding::Shedding;
use crate::proxy::{ClientSettings, Proxy, ProxyBody, UpstreamClients};
use crate::status::Observers;
use crate::stores::BuiltStore;

/// The body of every gateway response.
pub(crate) type GatewayBody = Either<RateLimitBody<ProxyBody>, Full<Bytes>>;

/// One configuration version, ready to serve.
pub(crate) struct ConfigVersion {
    /// Increments with every applied configuration.
    pub version: u64,
    /// When it was applied.
    pub loaded_at: SystemTime,
    /// The configuration.
    pub config: Arc<Config>,
    /// The store this version decides with (the admin API, readiness, the RLS service and the
    /// shutdown flush use it too), and its hot identity tracker.
    pub(crate) store: BuiltStore,
    /// The upstream client and the settings it was built from.
    pub(crate) client: (ClientSettings, UpstreamClients),
    /// The upstreams' adaptive limiters (`adaptive_concurrency`), kept by the next version
    /// when its settings are the same.
    pub(crate) shedding: Option<Arc<Shedding>>,
    services: HashMap<String, RateLimit<Proxy>>,
    fallback_service: RateLimit<Proxy>,
}

#[cfg(test)]
thread_local! {
    /// A test seam: the next [`Runtime::build`] on this thread fails, as a build can only after
    /// its inputs were validated (no configuration file reaches it).
    pub(crate) static FAIL_NEXT_BUILD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl ConfigVersion {
    pub(crate) fn build(
        version: u64,
        config: Arc<Config>,
        store: BuiltStore,
        client: (ClientSettings, UpstreamClients),
        shedding: Option<Arc<Shedding>>,
        observers: &Observers,
    ) -> Result<ConfigVersion, GatewayError> {
        #[cfg(test)]
        if FAIL_NEXT_BUILD.with(|fail| fail.replace(false)) {
            return Err(GatewayError::Layer(floodgate::BuildError::NoLimits));
        }
        let proxy = Proxy::new(client.1.clone(), config.clone(), shedding.clone());
        let make =
            |policy: FailurePolicy, rollout: &Rollout| -> Result<RateLimit<Proxy>, GatewayError> {
                let routes = config.clone();
                let mut layer = RateLimitLayer::builder()
                    .plan(GatewayPlan::new(config.clone()))
                    .shared_store(store.store.clone())
                    .identify(|request: &RequestInfo<'_>| {
                        request
                            .extensions
                            .get::<ResolvedClient>()
                            .map_or(floodgate::Identity::Unknown, |client| {
                                client.identity.clone()
                            })
                    })
                    .cost(move |request: &RequestInfo<'_>| {
                        ResolvedClient::route_of(
                            &routes.routes,
                            request.extensions,
                            request.method,
                            request.uri.path(),
                        )
                        .map_or(1, |route| route.up_front_cost())
                    })
                    .on_store_error(policy)
                    // Each layer its own controls, as the file describes them (a shared handle would
                    // also share the shadow log's per-second budget).
                    .rollout(Rollout::new(rollout.mode(), rollout.enforce_percent()))
                    .top_clients(observers.top.clone())
                    .limited_rate_baseline(observers.baseline.clone())
                    .fallback_share(config.store.fallback_share)
                    // A `concurrency` limit frees a slot when a request in flight ends, about
                    // the upstream's latency: a refused client comes back in a second or two,
                    // not when a lease's window (the net for leaked leases) would run out.
                    .concurrency_retry_hint(std::time::Duration::from_secs(1))
                    .responses(config.response.clone());
                if let Some(overrides) = &store.overrides {
                    // One copy for every layer, kept across reloads with the store.
                    layer = layer.overrides(overrides.clone());
                }
                Ok(layer.build()?.layer(proxy.clone()))
            };
        let mut services = HashMap::new();
        for (name, plan) in &config.plans {
            let policy = plan.on_store_error.unwrap_or(config.on_store_error);
            let rollout = plan.rollout.as_ref().unwrap_or(&config.rollout);
            services.insert(name.clone(), make(policy, rollout)?);
        }
        let fallback_service = make(config.on_store_error, &config.rollout)?;
        if let Some(overrides) = &store.overrides {
            // Built: the bounds of this version apply to the next changes.
            let bounds = config.overrides;
            overrides.set_bounds(bounds.max_active, bounds.max_expires_in);
        }
        Ok(ConfigVersion {
            version,
            loaded_at: SystemTime::now(),
            fallback_service,
            services,
            config,
            store,
            client,
            shedding,
        })
    }

    /// The per-client overrides of this version's store (`/admin/clients/overrides`).
    pub(crate) fn overrides(&self) -> Option<&Arc<floodgate::overrides::Overrides>> {
        self.store.overrides.as_ref()
    }

    /// The region's trading (`store.region`).
    pub(crate) fn region(&self) -> Option<&floodgate::store::region::RegionalStore> {
        self.store.region.as_ref()
    }

    /// Which identities this version's store decides from leases (`store.hot_identities`).
    pub(crate) fn hot_identities(&self) -> Option<&Arc<HotIdentities>> {
        self.store.hot_identities.as_ref()
    }

    /// Serves one request under this version. `facts`, when the access log wants the
    /// request's line, is filled in with what the gateway learns on the way; it is filled in
    /// as the request goes, so that a request whose client goes away has it too.
    pub(crate) async fn handle(
        &self,
        request: Request<Incoming>,
        facts: Option<&mut RequestFacts>,
    ) -> Response<GatewayBody> {
        match facts {
            Some(facts) => self.answer(request, facts, true).await,
            None => {
                self.answer(request, &mut RequestFacts::default(), false)
                    .await
            }
        }
    }

    /// Whether `plan`'s rollout (its own, or the top-level one) is `off`: its requests meet
    /// no limit.
    fn kill_switch_is_on(&self, plan: &str) -> bool {
        let rollout = self
            .config
            .plans
            .get(plan)
            .and_then(|plan| plan.rollout.as_ref())
            .unwrap_or(&self.config.rollout);
        rollout.mode() == floodgate::rollout::Mode::Off
    }

    /// The answer to `request`. The facts that cost an allocation (the path, the identity)
    /// are kept only for a request that is `logged`.
    async fn answer(
        &self,
        mut request: Request<Incoming>,
        facts: &mut RequestFacts,
        logged: bool,
    ) -> Response<GatewayBody> {
        if let Err(rejection) = crate::head::check(&request) {
            metrics::counter!(crate::telemetry::REJECTED_REQUESTS_TOTAL, "reason" => rejection.reason())
                .increment(1);
            facts.early = Some(GatewayOutcome::Rejected);
            facts.path = Some(request.uri().path().to_owned());
            return json_error(rejection.status(), rejection.reason());
        }
        // Limits match, and the upstream receives, the normalised path (SPEC §5 "Paths").
        match crate::path::normalize_uri(request.uri()) {
            Ok(Some(normal)) => *request.uri_mut() = normal,
            Ok(None) => {}
            Err(error) => {
                let reason = match error {
                    crate::path::PathError::AboveRoot => "path_above_root",
                    crate::path::PathError::BadEscape => "path_bad_escape",
                };
                metrics::counter!(crate::telemetry::REJECTED_REQUESTS_TOTAL, "reason" => reason)
                    .increment(1);
                facts.early = Some(GatewayOutcome::Rejected);
                facts.path = Some(request.uri().path().to_owned());
                return json_error(http::StatusCode::BAD_REQUEST, "bad_request");
            }
        }
        if logged {
            facts.path = Some(request.uri().path().to_owned());
        }
        let resolution = resolve(&self.config, &RequestInfo::new(&request));
        let client = match client_or_refusal(resolution, facts) {
            Ok(client) => client,
            Err(refusal) => return *refusal,
        };
        if logged {
            facts.identity = Some(client.identity.clone());
            facts.plan = Some(client.plan.clone());
        }
        if logged && self.kill_switch_is_on(&client.plan) {
            // The layer says so on the answer; this is for a client that leaves before it.
            facts.early = Some(GatewayOutcome::Limiter(Outcome::Bypassed));
        }
        if client.bypass {
            facts.early = Some(GatewayOutcome::Limiter(Outcome::Bypassed));
            floodgate::telemetry::record_allowlisted();
        }
        let service = self
            .services
            .get(&*client.plan)
            .unwrap_or(&self.fallback_service)
            .clone();
        let credentials = &self.config.identity.credentials;
        if client.anonymized {
            credentials.strip(request.headers_mut());
        } else if client.token_verified {
            credentials.strip_beside_token(request.headers_mut());
        }
        request.extensions_mut().insert(client);
        let grpc = is_grpc(request.headers());
        let response = match service.oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
        if grpc && response.status() == http::StatusCode::TOO_MANY_REQUESTS {
            return grpc_resource_exhausted(response);
        }
        response.map(Either::Left)
    }
}

/// The client `resolution` names, or the answer that refuses the request (its outcome in
/// `facts`, its reason counted; boxed: a refusal is rare, the client's path is not).
fn client_or_refusal(
    resolution: Resolution,
    facts: &mut RequestFacts,
) -> Result<ResolvedClient, Box<Response<GatewayBody>>> {
    match resolution {
        Resolution::InvalidRequest(ambiguity) => {
            facts.early = Some(GatewayOutcome::Rejected);
            metrics::counter!(crate::telemetry::REJECTED_REQUESTS_TOTAL, "reason" => ambiguity.reason())
                .increment(1);
            let mut answer = json_error(http::StatusCode::BAD_REQUEST, "invalid_request");
            // RFC 6750 §3.1: more than one way of including a credential.
            answer.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                http::HeaderValue::from_static("Bearer error=\"invalid_request\""),
            );
            Err(Box::new(answer))
        }
        Resolution::Denied => {
            facts.early = Some(GatewayOutcome::Limiter(Outcome::Denylisted));
            floodgate::telemetry::record_denylisted();
            Err(Box::new(
                floodgate::response::forbidden_response()
                    .map(|body| Either::Right(Full::new(body))),
            ))
        }
        Resolution::UnknownKey => {
            facts.early = Some(GatewayOutcome::UnknownKey);
            metrics::counter!(crate::telemetry::REJECTED_REQUESTS_TOTAL, "reason" => "unknown_api_key")
                .increment(1);
            Err(Box::new(json_error(
                http::StatusCode::UNAUTHORIZED,
                "unknown_api_key",
            )))
        }
        Resolution::InvalidToken => {
            facts.early = Some(GatewayOutcome::InvalidToken);
            metrics::counter!(crate::telemetry::REJECTED_REQUESTS_TOTAL, "reason" => "invalid_token")
                .increment(1);
            let mut answer = json_error(http::StatusCode::UNAUTHORIZED, "invalid_token");
            // RFC 6750 §3: what a bearer client is told about a token it must replace.
            answer.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                http::HeaderValue::from_static("Bearer error=\"invalid_token\""),
            );
            Err(Box::new(answer))
        }
        Resolution::Client(client) => Ok(client),
    }
}

/// Whether a request is gRPC (`content-type: application/grpc`, `application/grpc+proto`, ...).
fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"))
}

/// A 429 as a gRPC client understands it: a trailers-only answer with `grpc-status: 8`
/// (RESOURCE_EXHAUSTED), keeping the rate limit headers and `Retry-After`.
fn grpc_resource_exhausted<B>(limited: Response<B>) -> Response<GatewayBody> {
    let (mut parts, _body) = limited.into_parts();
    parts.status = http::StatusCode::OK;
    parts.headers.remove(http::header::CONTENT_LENGTH);
    parts.headers.remove(http::header::CACHE_CONTROL);
    parts.headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    parts
        .headers
        .insert("grpc-status", http::HeaderValue::from_static("8"));
    parts.headers.insert(
        "grpc-message",
        http::HeaderValue::from_static("rate%20limit%20exceeded"),
    );
    Response::from_parts(parts, Either::Right(Full::new(Bytes::new())))
}

/// The gateway's own answer `{"error": error}` with `status`: 400 for a path above the root,
/// 401 for an API key the configuration does not know (`clients.unknown_keys: reject`).
fn json_error(status: http::StatusCode, error: &'static str) -> Response<GatewayBody> {
    crate::proxy::json_error(status, error).map(Either::Right)
}
