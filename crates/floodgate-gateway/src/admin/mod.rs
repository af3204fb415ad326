//! The admin API (SPEC §7): health, readiness, metrics, reload, active configuration, top
//! clients, a client's inspection and reset, and the status page.

mod answers;
pub(crate) mod inspect;

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use axum::Json;
use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use floodgate::store::resilience::BreakerState;
use floodgate::{FailurePolicy, StoreError};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::admin::answers::{
    ActiveConfig, ClientOverrides, Failure, InspectedClient, LimitName, LimitView, OverridePage,
    OverrideView, OverridesRemoved, PlanReadiness, Readiness, RegionShareView, RegionState,
    Reloaded, Reset, StoreRejected, StoreState, TopClient, TopClients,
};
use crate::admin::inspect::{ClientQuery, SelectError, Selected};
use crate::gateway::Gateway;
use crate::rlqs::QuotaService;

/// `FLOODGATE_ADMIN_TOKEN`, when set and not empty: the bearer token the admin API asks for.
pub(crate) fn token_from_env() -> Option<String> {
    std::env::var("FLOODGATE_ADMIN_TOKEN")
        .ok()
        .filter(|token| !token.is_empty())
}

/// What the admin handlers share.
#[derive(Clone)]
pub(crate) struct AdminState {
    /// The gateway.
    pub gateway: Arc<Gateway>,
    /// The Prometheus recorder's handle.
    pub metrics: PrometheusHandle,
    /// `FLOODGATE_ADMIN_TOKEN`, if set.
    pub token: Option<Arc<str>>,
    /// The Rate Limit Quota Service, when served.
    pub quota: Option<Arc<QuotaService>>,
}

/// The admin router. Every `/admin/*` route (reads included: they show client data and
/// configuration) needs the token when one is set; `/healthz`, `/readyz` and `/metrics` stay
/// open for probes and scrapers, and `/` (the status page, which holds no data) for browsers.
pub(crate) fn router(state: AdminState) -> Router {
    let guarded = Router::new()
        .route("/admin/reload", post(reload))
        .route("/admin/config", get(active_config))
        .route("/admin/top", get(top))
        .route("/admin/status", get(status))
        .route("/admin/adaptive", get(adaptive))
        .route("/admin/rlqs", get(quota))
        .route("/admin/clients", get(inspect_client).delete(reset_client))
        .route(
            "/admin/clients/overrides",
            get(list_overrides)
                .put(set_override)
                .delete(remove_overrides),
        )
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .route("/", get(status_page))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(guarded)
        .with_state(state)
}

/// 401 unless the request carries `Authorization: Bearer <token>` (when a token is set).
async fn require_token(
    State(state): State<AdminState>,
    request: axum::extract::Request,
    next: middleware::Next,
) -> Response {
    if authorized(&state, request.headers()) {
        next.run(request).await
    } else {
        (
            StatusCode::UNAUTHORIZED,
            [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
            Json(Failure::new("unauthorized")),
        )
            .into_response()
    }
}

fn authorized(state: &AdminState, headers: &HeaderMap) -> bool {
    let Some(token) = &state.token else {
        return true;
    };
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .is_some_and(|given| constant_time_eq(given.as_bytes(), token.as_bytes()))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `/readyz`: ready unless the store refuses this gateway (a configuration error, under any
/// policy) or the store is down and the default or anonymous plan fails closed
/// ([`crate::config::Config::unready_without_store`]). The body lists every plan's policy and
/// whether its clients are served while the store is down.
async fn readyz(State(state): State<AdminState>) -> Response {
    let current = state.gateway.current();
    // A store that refuses this gateway (a wrong password) is a configuration error, not an
    // outage: not ready under any failure policy, so that a bad rollout stops here.
    if let Err(error @ StoreError::Rejected(_)) = state.gateway.store().probe().await {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(StoreRejected {
                status: "store_rejected",
                error: error.to_string(),
            }),
        )
            .into_response();
    }
    let store_ok = match state.gateway.store().breaker_state() {
        None | Some(BreakerState::Closed) => true,
        Some(BreakerState::Open | BreakerState::HalfOpen) => false,
    };
    let config = &current.config;
    let plans = config
        .plans
        .keys()
        .map(|name| {
            let policy = config.store_error_policy(name);
            let serving = store_ok || policy != FailurePolicy::Closed;
            let readiness = PlanReadiness {
                on_store_error: policy.as_str(),
                serving,
            };
            (name.as_str(), readiness)
        })
        .collect();
    let ready = store_ok || !config.unready_without_store();
    let (status, label) = if ready {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")
    };
    (
        status,
        Json(Readiness {
            status: label,
            version: current.version,
            store_reachable: store_ok,
            plans,
        }),
    )
        .into_response()
}

async fn metrics(State(state): State<AdminState>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn reload(State(state): State<AdminState>) -> Response {
    let gateway = state.gateway.clone();
    match tokio::task::spawn_blocking(move || gateway.reload(false)).await {
        Ok(Ok(version)) => Json(Reloaded {
            status: "applied",
            version,
        })
        .into_response(),
        Ok(Err(error)) => (
            StatusCode::BAD_REQUEST,
            Json(Failure::new(error.to_string())),
        )
            .into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(Failure::new("reload failed")),
        )
            .into_response(),
    }
}

async fn active_config(State(state): State<AdminState>) -> Response {
    let current = state.gateway.current();
    let loaded_at = current
        .loaded_at
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    Json(ActiveConfig {
        version: current.version,
        loaded_at,
        config: &current.config.redacted,
    })
    .into_response()
}

#[derive(serde::Deserialize)]
struct TopQuery {
    n: Option<usize>,
}

/// Each upstream's adaptive limiter.
/// The quota service's streams and the shares their Envoys hold on this server.
async fn quota(State(state): State<AdminState>) -> Response {
    match &state.quota {
        Some(quota) => Json(quota.snapshot().await).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": "rls.quota is not configured"})),
        )
            .into_response(),
    }
}

async fn adaptive(State(state): State<AdminState>) -> Json<answers::AdaptiveUpstreams> {
    let current = state.gateway.current();
    let upstreams = current
        .shedding
        .as_ref()
        .map(|shedding| shedding.snapshots())
        .unwrap_or_default()
        .into_iter()
        .map(|(upstream, snapshot)| answers::AdaptiveUpstream::of(upstream, &snapshot))
        .collect();
    Json(answers::AdaptiveUpstreams {
        configured: current.shedding.is_some(),
        upstreams,
    })
}

async fn top(State(state): State<AdminState>, Query(query): Query<TopQuery>) -> Response {
    let n = query.n.unwrap_or(10).clamp(1, 1000);
    let now = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    let (by_denials, by_closeness) = state.gateway.observers.top.top(n, now);
    // Hot identities are `<scope>:<hash>` tags; the top lists name the hash.
    let local_identities: Vec<String> = state
        .gateway
        .current()
        .hot_identities()
        .map(|hot| hot.hot())
        .unwrap_or_default();
    let is_local = |hash: &str| {
        local_identities
            .iter()
            .any(|tag| floodgate::key::ClientTag::parse(tag).is_some_and(|tag| tag.hash == hash))
    };
    let render = |entries: Vec<floodgate::top::TopEntry>| -> Vec<TopClient> {
        entries
            .into_iter()
            .map(|entry| {
                let identity = entry.identity.to_string();
                TopClient {
                    local: is_local(&identity),
                    identity,
                    denials: entry.denials,
                    closeness: (entry.closeness * 1000.0).round() / 1000.0,
                }
            })
            .collect()
    };
    Json(TopClients {
        window_seconds: floodgate::top::TopClients::WINDOW.as_secs(),
        local_identities: &local_identities,
        by_denials: render(by_denials),
        by_closeness: render(by_closeness),
    })
    .into_response()
}

/// The status page: static, open (it holds no data; it asks for the token and sends it with
/// its data calls).
async fn status_page() -> Response {
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (axum::http::header::CACHE_CONTROL, "no-cache"),
            // Its own inline script and style, data calls to this origin, nothing else; never
            // framed (the page may hold a token).
            (
                axum::http::header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; \
                 frame-ancestors 'none'",
            ),
        ],
        include_str!("status.html"),
    )
        .into_response()
}

/// What the status page polls: the version in service, the store, the decision rates.
async fn status(State(state): State<AdminState>) -> Response {
    let current = state.gateway.current();
    let store = state.gateway.store();
    let loaded_at = current
        .loaded_at
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    let breaker = store.breaker_state().map(|state| match state {
        BreakerState::Closed => "closed",
        BreakerState::Open => "open",
        BreakerState::HalfOpen => "half_open",
    });
    // This node's copy, as decisions see it: the first 100.
    let (now, overrides) = current
        .overrides()
        .map(|overrides| (overrides.now(), overrides.in_force()))
        .unwrap_or_default();
    Json(answers::Status {
        observed: state.gateway.observers.status.report(),
        version: current.version,
        loaded_at,
        mode: current.config.rollout.mode().as_str(),
        store: StoreState {
            backend: store.backend(),
            breaker,
            region: current.region().map(RegionState::of),
        },
        overrides_in_force: overrides.len(),
        overrides: overrides
            .iter()
            .take(100)
            .map(|entry| OverrideView::new(entry, now))
            .collect(),
    })
    .into_response()
}

/// A client named by the query (only the limit it names, if it names one), or the status and
/// message that say why not.
fn selected(
    current: &crate::version::ConfigVersion,
    query: Result<Query<ClientQuery>, QueryRejection>,
) -> Result<Selected, (StatusCode, String)> {
    let Query(query) =
        query.map_err(|rejection| (StatusCode::BAD_REQUEST, rejection.body_text()))?;
    let mut selected = query.select(&current.config).map_err(|error| match error {
        SelectError::BadQuery(message) => (StatusCode::BAD_REQUEST, message),
        SelectError::UnknownKey => (
            StatusCode::NOT_FOUND,
            "unknown_api_key: refused under clients.unknown_keys: reject".to_owned(),
        ),
    })?;
    if let Some(name) = &query.limit {
        selected.checks.retain(|check| check.limit.name() == name);
    }
    Ok(selected)
}

fn refusal((status, message): (StatusCode, String)) -> Response {
    (status, Json(Failure::new(message))).into_response()
}

fn store_failure(error: &StoreError) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(Failure::with_detail("store_unavailable", error.to_string())),
    )
        .into_response()
}

/// `GET /admin/clients`: a client's limits as they stand, read without consuming.
async fn inspect_client(
    State(state): State<AdminState>,
    query: Result<Query<ClientQuery>, QueryRejection>,
) -> Response {
    let current = state.gateway.current();
    let selected = match selected(&current, query) {
        Ok(selected) => selected,
        Err(refused) => return refusal(refused),
    };
    let store = state.gateway.store();
    let mut selected = selected;
    if let Some(overrides) = current.overrides() {
        // As the request path decides them.
        overrides.apply(&mut selected.checks);
    }
    let decision = match store.peek(&selected.checks, None).await {
        Ok(decision) => decision,
        Err(error) => return store_failure(&error),
    };
    let settings = &current.config.store;
    // Decided from this node's leases (`store.hot_identities`): its limits that can be.
    let local = current.hot_identities().is_some_and(|hot| {
        selected
            .checks
            .iter()
            .any(|check| hot.is_hot(floodgate::key::storage::hash_tag(&check.key)))
    });
    let limits: Vec<LimitView> = decision
        .limits()
        .iter()
        .zip(&selected.checks)
        .map(|(status, check)| {
            let leased = floodgate::store::batched::supports(check.limit.algorithm());
            let batched = settings.sync_interval.is_some()
                || (settings.global_sync_interval.is_some()
                    && crate::plan::is_global_ceiling(check))
                || (local && leased && !crate::plan::is_global_ceiling(check));
            let mut limit = LimitView::new(status, check, batched, decision.decided_at());
            limit.in_force = current.overrides().and_then(|overrides| {
                let entry = overrides.applied_to(check)?;
                Some(OverrideView::new(&entry, overrides.now()))
            });
            limit.region_share = current
                .region()
                .map(|region| RegionShareView::of(region, check));
            limit
        })
        .collect();
    Json(InspectedClient::new(
        &selected,
        local,
        store.backend(),
        limits,
    ))
    .into_response()
}

/// `DELETE /admin/clients`: forgets a client's counters (and leases), all of its limits or
/// the one named by `limit`. Global ceilings are every client's, and are never reset here.
async fn reset_client(
    State(state): State<AdminState>,
    parts: axum::http::request::Parts,
    query: Result<Query<ClientQuery>, QueryRejection>,
) -> Response {
    let current = state.gateway.current();
    let mut selected = match selected(&current, query) {
        Ok(selected) => selected,
        Err(refused) => return refusal(refused),
    };
    selected
        .checks
        .retain(|check| !crate::plan::is_global_ceiling(check));
    if selected.checks.is_empty() {
        return refusal((
            StatusCode::NOT_FOUND,
            "no limit of this client matches".to_owned(),
        ));
    }
    let keys: Vec<Arc<str>> = selected
        .checks
        .iter()
        .map(|check| check.key.clone())
        .collect();
    let store = state.gateway.store();
    let held = match store.reset(&keys).await {
        Ok(held) => held,
        Err(error) => return store_failure(&error),
    };
    let names: Vec<String> = selected
        .checks
        .iter()
        .map(|check| format!("{}/{}", check.rule, check.limit.name()))
        .collect();
    log_change(
        &selected,
        &names,
        &parts,
        "client counters reset through the admin API",
    );
    metrics::counter!(crate::telemetry::ADMIN_RESETS_TOTAL).increment(1);
    let reset = selected
        .checks
        .iter()
        .map(|check| LimitName {
            rule: check.rule.to_string(),
            name: check.limit.name().to_owned(),
        })
        .collect();
    Json(Reset {
        identity: selected.hash.to_string(),
        plan: selected.plan.to_string(),
        reset,
        keys_with_state: held,
    })
    .into_response()
}

/// A change an operator made to a client, at WARN with who asked.
fn log_change(
    selected: &Selected,
    limits: &[String],
    parts: &axum::http::request::Parts,
    what: &'static str,
) {
    tracing::warn!(
        identity = %selected.hash,
        plan = %selected.plan,
        limits = ?limits,
        caller = caller(parts),
        "{what}"
    );
}

/// Who called the admin API, for the log of a change.
fn caller(parts: &axum::http::request::Parts) -> String {
    parts
        .extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map_or_else(|| "unknown".to_owned(), |info| info.0.to_string())
}

/// An override error as the admin API answers it.
fn override_failure(error: floodgate::overrides::OverrideError) -> Response {
    use floodgate::overrides::OverrideError;
    match error {
        OverrideError::Full(max) => {
            floodgate::overrides::record_change("refused");
            (
                StatusCode::CONFLICT,
                Json(Failure::with_detail(
                    "too_many_overrides",
                    format!(
                        "{max} overrides are in force (admin.overrides.max_active); remove one \
                         or wait for one to expire"
                    ),
                )),
            )
                .into_response()
        }
        OverrideError::Store(error) => store_failure(&error),
        OverrideError::Unsupported => refusal((
            StatusCode::NOT_FOUND,
            "overrides_unsupported: this store keeps no overrides".to_owned(),
        )),
        other => (
            StatusCode::BAD_REQUEST,
            Json(Failure::with_detail("invalid_override", other.to_string())),
        )
            .into_response(),
    }
}

/// `PUT /admin/clients/overrides?api_key=…`: replaces one limit of the client's plan until
/// the override expires (SPEC §7). The body: `{"name", "limit", "window", "burst",
/// "expires_in"}`; answers the override as stored.
async fn set_override(
    State(state): State<AdminState>,
    parts: axum::http::request::Parts,
    query: Result<Query<ClientQuery>, QueryRejection>,
    body: axum::body::Bytes,
) -> Response {
    let current = state.gateway.current();
    let Some(overrides) = current.overrides() else {
        return override_failure(floodgate::overrides::OverrideError::Unsupported);
    };
    let selected = match selected(&current, query) {
        Ok(selected) => selected,
        Err(refused) => return refusal(refused),
    };
    let spec = match serde_json::from_slice::<serde_json::Value>(&body)
        .map_err(|_| floodgate::overrides::OverrideError::Invalid {
            field: "body".to_owned(),
            problem: "is not JSON".to_owned(),
        })
        .and_then(|body| floodgate::overrides::OverrideSpec::from_json(&body))
    {
        Ok(spec) => spec,
        Err(error) => return override_failure(error),
    };
    let Some(target) = selected.plan_limit(&current.config, &spec.name) else {
        return refusal((
            StatusCode::NOT_FOUND,
            format!(
                "unknown_limit: plan `{}` has no limit `{}` for this client",
                selected.plan, spec.name
            ),
        ));
    };
    let entry = match overrides.set(target, &spec).await {
        Ok(entry) => entry,
        Err(error) => return override_failure(error),
    };
    tracing::warn!(
        identity = %selected.hash,
        plan = %selected.plan,
        limit = %entry.name,
        new_limit = entry.limit,
        window = ?entry.window,
        burst = ?entry.burst,
        expires_in = spec.expires_in.as_secs(),
        caller = caller(&parts),
        "limit override set through the admin API"
    );
    floodgate::overrides::record_change("set");
    let mut answer = OverrideView::new(&entry, overrides.now());
    answer.plan = Some(selected.plan.to_string());
    Json(answer).into_response()
}

/// `GET /admin/clients/overrides`: a client's overrides in force, or (without a client) every
/// override of the store, a page at a time (`per_page`, `after` the previous page's `next`).
async fn list_overrides(
    State(state): State<AdminState>,
    query: Result<Query<ClientQuery>, QueryRejection>,
) -> Response {
    let current = state.gateway.current();
    let Some(overrides) = current.overrides() else {
        return override_failure(floodgate::overrides::OverrideError::Unsupported);
    };
    let now = overrides.now();
    let names_a_client = query
        .as_ref()
        .is_ok_and(|Query(query)| query.names_a_client());
    if !names_a_client {
        let Ok(Query(query)) = query else {
            return refusal((StatusCode::BAD_REQUEST, "invalid query".to_owned()));
        };
        let per_page = query.per_page.unwrap_or(100).clamp(1, 1000);
        let all = match overrides.list().await {
            Ok(all) => all,
            Err(error) => return override_failure(error),
        };
        let page: Vec<&floodgate::overrides::Override> = all
            .iter()
            .filter(|entry| {
                query
                    .after
                    .as_deref()
                    .is_none_or(|after| &*entry.target > after)
            })
            .take(per_page)
            .collect();
        let next = (page.len() == per_page)
            .then(|| page.last().map(|entry| entry.target.to_string()))
            .flatten()
            .filter(|last| all.last().is_some_and(|end| &*end.target != last));
        return Json(OverridePage {
            total: all.len(),
            overrides: page
                .iter()
                .map(|entry| OverrideView::new(entry, now))
                .collect(),
            next,
        })
        .into_response();
    }
    let selected = match selected(&current, query) {
        Ok(selected) => selected,
        Err(refused) => return refusal(refused),
    };
    let entries = match overrides.of_client(&selected.tag()).await {
        Ok(entries) => entries,
        Err(error) => return override_failure(error),
    };
    Json(ClientOverrides {
        identity: selected.hash.to_string(),
        scope: selected.scope.clone(),
        plan: selected.plan.to_string(),
        overrides: entries
            .iter()
            .map(|entry| OverrideView::new(entry, now))
            .collect(),
    })
    .into_response()
}

/// `DELETE /admin/clients/overrides?api_key=…&name=…`: ends the client's override of `name`
/// (without `name`, all of the client's) at once.
async fn remove_overrides(
    State(state): State<AdminState>,
    parts: axum::http::request::Parts,
    query: Result<Query<ClientQuery>, QueryRejection>,
) -> Response {
    let current = state.gateway.current();
    let Some(overrides) = current.overrides() else {
        return override_failure(floodgate::overrides::OverrideError::Unsupported);
    };
    let name = query
        .as_ref()
        .ok()
        .and_then(|Query(query)| query.name.clone());
    let selected = match selected(&current, query) {
        Ok(selected) => selected,
        Err(refused) => return refusal(refused),
    };
    let entries = match overrides.of_client(&selected.tag()).await {
        Ok(entries) => entries,
        Err(error) => return override_failure(error),
    };
    let mut removed = Vec::new();
    let mut failed = None;
    for entry in entries
        .iter()
        .filter(|entry| name.as_deref().is_none_or(|name| *entry.name == *name))
    {
        match overrides.remove(&entry.target).await {
            Ok(true) => removed.push(entry.name.to_string()),
            Ok(false) => {}
            Err(error) => {
                failed = Some(error);
                break;
            }
        }
    }
    if !removed.is_empty() {
        // Logged and counted even when a later one failed: these are gone.
        log_change(
            &selected,
            &removed,
            &parts,
            "limit override removed through the admin API",
        );
        for _ in &removed {
            floodgate::overrides::record_change("removed");
        }
    }
    if let Some(error) = failed {
        return override_failure(error);
    }
    if removed.is_empty() {
        return refusal((
            StatusCode::NOT_FOUND,
            "no_override: this client has no override in force".to_owned(),
        ));
    }
    Json(OverridesRemoved {
        identity: selected.hash.to_string(),
        plan: selected.plan.to_string(),
        removed,
    })
    .into_response()
}

#[cfg(test)]
mod tests {
    use axum::serve::Listener;

    /// Connections the admin API accepts have `TCP_NODELAY` (the Rust standard library and
    /// tokio leave it off).
    #[tokio::test]
    async fn the_admin_listener_sets_nodelay_on_what_it_accepts() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let mut listener = crate::serve::nodelay_listener(listener);
        let _client = tokio::net::TcpStream::connect(address).await.unwrap();
        let (accepted, _) = listener.accept().await;
        assert!(accepted.nodelay().unwrap());
    }
}
