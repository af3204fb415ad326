//! The newcomer app of `crates/floodgate/examples/newcomer.rs`, written against the API as it was
//! before issue 12 (commit bc25ef0), to compare their length. It compiles against bc25ef0 only
//! (with `metrics-exporter-prometheus` as a dev-dependency), not against this tree.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use floodgate::key::{DefaultIdentifier, IdentifyClient, storage_key};
use floodgate::store::RedisStore;
use floodgate::{Check, FailurePolicy, Identity, Limit, LimitPlan, RateLimitLayer, RequestInfo};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

/// Tiers, per-route and per-IP limits in one plan: a hand-written LimitPlan.
struct Tiers {
    identifier: Arc<DefaultIdentifier>,
    per_ip: Vec<Arc<Limit>>,
    anonymous: Vec<Arc<Limit>>,
    free: Vec<Arc<Limit>>,
    pro: Vec<Arc<Limit>>,
    pro_keys: Vec<String>,
    login: Vec<Arc<Limit>>,
}

impl LimitPlan for Tiers {
    fn checks(&self, request: &RequestInfo<'_>, identity: &Identity, cost: u64) -> Vec<Check> {
        let mut checks = Vec::new();
        let ip = self.identifier.client_ip_of(request);
        let mut add = |scope: &str, hash, rule: &str, limits: &[Arc<Limit>]| {
            for limit in limits {
                let key = storage_key("fg", scope, &hash, rule, limit.name());
                checks.push(Check::new(key, limit.clone(), cost).with_rule(Arc::from(rule)));
            }
        };
        if let Some(ip) = ip {
            add("ip", Identity::Ip(ip).hash(), "per_ip", &self.per_ip);
            if request.method == http::Method::POST && request.uri.path() == "/login" {
                add("ip", Identity::Ip(ip).hash(), "login", &self.login);
            }
        }
        let limits = match identity {
            Identity::ApiKey(key) if self.pro_keys.contains(key) => &self.pro,
            Identity::ApiKey(_) | Identity::User(_) => &self.free,
            _ => &self.anonymous,
        };
        add(identity.scope(), identity.hash(), "plan", limits);
        checks
    }
}

fn identifier() -> Result<DefaultIdentifier, Box<dyn std::error::Error>> {
    Ok(DefaultIdentifier::new().trusted_proxies(["10.0.0.0/8"])?)
}

/// DefaultIdentifier is not Clone and Arc<T> is no identifier: share it through a closure.
fn shared(identifier: &Arc<DefaultIdentifier>) -> impl IdentifyClient {
    let identifier = identifier.clone();
    move |request: &RequestInfo<'_>| identifier.identify(request)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let metrics = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("floodgate_check_duration_seconds".into()),
            &[0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1],
        )?
        .install_recorder()?;
    let second = Duration::from_secs(1);
    let identifier = Arc::new(identifier()?);
    let plan = Tiers {
        identifier: identifier.clone(),
        per_ip: vec![Arc::new(Limit::token_bucket("ip", 100, second)?)],
        anonymous: vec![Arc::new(Limit::token_bucket("anonymous", 5, second)?)],
        free: vec![Arc::new(Limit::token_bucket("free", 20, second)?)],
        pro: vec![Arc::new(Limit::gcra("pro", 500, second)?)],
        pro_keys: vec!["pk_live_partner".to_owned()],
        login: vec![Arc::new(Limit::fixed_window(
            "login",
            5,
            Duration::from_secs(60),
        )?)],
    };
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let limits = RateLimitLayer::builder()
        .identify(shared(&identifier))
        .plan(plan)
        .store(RedisStore::builder(redis_url).build()?)
        .on_store_error(FailurePolicy::Local)
        .fallback_share(1.0 / 3.0)
        .build()?;
    let streams = RateLimitLayer::builder()
        .identify(shared(&identifier))
        .limit(Limit::concurrency("streams", 2, Duration::from_secs(300))?)
        .build()?;

    let app = Router::new()
        .route(
            "/events",
            get(|| async { "a long stream" }).route_layer(streams),
        )
        .route("/login", post(|| async { "welcome" }))
        .route("/v1/things", get(|| async { "things" }))
        .layer(limits)
        .route(
            "/metrics",
            get(move || std::future::ready(metrics.render())),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .await?;
    Ok(())
}
