//! TieredPlan: tiers, per-route limits and per-IP ceilings in one all-or-nothing decision, and
//! closures whose argument types are inferred, as a newcomer writes them.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use floodgate::key::DefaultIdentifier;
use floodgate::plan::{PlanError, RouteKey, TieredPlan};
use floodgate::{Identity, Limit, MemoryStore, PeerAddr, RateLimitLayer};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt, service_fn};

const MINUTE: Duration = Duration::from_secs(60);

fn per_minute(name: &str, limit: u64) -> Limit {
    Limit::fixed_window(name, limit, MINUTE).unwrap()
}

async fn hello(_: Request<()>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"hello"))))
}

async fn send<S, B>(
    service: &S,
    method: Method,
    path: &str,
    peer: &str,
    key: Option<&str>,
) -> (u16, String)
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .extension(PeerAddr(peer.parse::<SocketAddr>().unwrap()));
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    let response = service
        .clone()
        .oneshot(request.body(()).unwrap())
        .await
        .unwrap();
    let status = response.status().as_u16();
    let limit = response
        .headers()
        .get("x-ratelimit-limit")
        .map(|value| value.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let _ = response.into_body().collect().await;
    (status, limit)
}

fn app() -> impl Service<
    Request<()>,
    Response = Response<floodgate::service::RateLimitBody<Full<Bytes>>>,
    Error = Infallible,
> + Clone {
    let identifier = DefaultIdentifier::new();
    let plan = TieredPlan::builder()
        .per_ip([per_minute("ip", 6)])
        .anonymous([per_minute("anonymous", 2)])
        .keyed([per_minute("free", 3)])
        .tier("pro", [per_minute("pro", 100)])
        .api_key("pro-key", "pro")
        .route("POST /login", RouteKey::Ip, [per_minute("login", 1)])
        .identifier(identifier.clone())
        .build()
        .unwrap();
    RateLimitLayer::builder()
        .identify(identifier)
        .plan(plan)
        .store(MemoryStore::new())
        .build()
        .unwrap()
        .layer(service_fn(hello))
}

#[tokio::test]
async fn tiers_routes_and_per_ip_ceilings_decide_together() {
    let service = app();
    let get = Method::GET;
    // Anonymous: 2 a minute, by IP.
    let anonymous: Vec<u16> =
        futures(&service, 3, |_| (get.clone(), "/", "198.51.100.1:1", None)).await;
    assert_eq!(anonymous, [200, 200, 429]);
    // A keyed client without a tier: 3; the pro key: its tier's 100 (until the per-IP 6).
    let (status, limit) = send(
        &service,
        get.clone(),
        "/",
        "198.51.100.2:1",
        Some("some-key"),
    )
    .await;
    assert_eq!((status, limit.as_str()), (200, "3"));
    let (status, limit) = send(
        &service,
        get.clone(),
        "/",
        "198.51.100.3:1",
        Some("pro-key"),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        limit, "6",
        "the per-IP ceiling (5 of 6 left) binds before pro's 99 of 100"
    );
    // Inventing a key per request gets past the keyed tier, not past the per-IP ceiling.
    let mut invented = Vec::new();
    for n in 0..8 {
        let key = format!("invented-{n}");
        invented.push(
            send(&service, get.clone(), "/", "198.51.100.4:1", Some(&key))
                .await
                .0,
        );
    }
    assert_eq!(invented, [200, 200, 200, 200, 200, 200, 429, 429]);
}

#[tokio::test]
async fn a_route_limit_keyed_by_ip_holds_across_keys_and_denials_consume_nothing() {
    let service = app();
    let post = Method::POST;
    assert_eq!(
        send(
            &service,
            post.clone(),
            "/login",
            "198.51.100.9:1",
            Some("a")
        )
        .await
        .0,
        200
    );
    assert_eq!(
        send(
            &service,
            post.clone(),
            "/login",
            "198.51.100.9:1",
            Some("b")
        )
        .await
        .0,
        429,
        "another key, same IP: the login limit is per IP"
    );
    assert_eq!(
        send(&service, Method::GET, "/login", "198.51.100.9:1", Some("b"))
            .await
            .0,
        200,
        "GET /login is not the POST route"
    );
    // Key "b" was denied once on POST /login: all-or-nothing, so that request took nothing from
    // its tier (3 a minute): GET /login and two GET / pass, the fourth does not.
    let mut rest = Vec::new();
    for _ in 0..3 {
        rest.push(
            send(&service, Method::GET, "/", "198.51.100.9:1", Some("b"))
                .await
                .0,
        );
    }
    assert_eq!(rest, [200, 200, 429]);
}

async fn futures<S, B>(
    service: &S,
    count: usize,
    request: impl Fn(usize) -> (Method, &'static str, &'static str, Option<&'static str>),
) -> Vec<u16>
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let mut statuses = Vec::new();
    for index in 0..count {
        let (method, path, peer, key) = request(index);
        statuses.push(send(service, method, path, peer, key).await.0);
    }
    statuses
}

#[test]
fn a_plan_that_cannot_work_is_a_build_error() {
    let unknown = TieredPlan::builder()
        .keyed([per_minute("free", 1)])
        .api_key("k", "gold")
        .build()
        .unwrap_err();
    assert_eq!(unknown, PlanError::UnknownTier("gold".into()));
    let duplicate = TieredPlan::builder()
        .keyed([per_minute("a", 1), per_minute("a", 2)])
        .build()
        .unwrap_err();
    assert_eq!(duplicate.to_string(), "keyed: limit `a` appears twice");
    let route = TieredPlan::builder()
        .route("login", RouteKey::Client, [per_minute("login", 1)])
        .build()
        .unwrap_err();
    assert!(route.to_string().starts_with("routes[0]:"), "{route}");
    assert_eq!(TieredPlan::builder().build().unwrap_err(), PlanError::Empty);
}

#[tokio::test]
async fn closures_infer_their_argument_types() {
    // Regression: `.identify(|req| …)` needed `|req: &RequestInfo<'_>|`.
    let service = RateLimitLayer::builder()
        .limit(per_minute("tenant", 2))
        .identify_with(|request| match request.headers.get("x-tenant") {
            Some(tenant) => Identity::Custom {
                scope: "tenant".into(),
                value: tenant.to_str().unwrap_or("").to_owned(),
            },
            None => Identity::Unknown,
        })
        .cost_with(|request| if request.method == Method::POST { 2 } else { 1 })
        .build()
        .unwrap()
        .layer(service_fn(hello));
    let call = |method: Method| {
        let service = service.clone();
        async move {
            let request = Request::builder()
                .method(method)
                .header("x-tenant", "acme")
                .body(())
                .unwrap();
            service.oneshot(request).await.unwrap().status()
        }
    };
    assert_eq!(call(Method::POST).await, StatusCode::OK);
    assert_eq!(
        call(Method::GET).await,
        StatusCode::TOO_MANY_REQUESTS,
        "POST cost 2 of 2"
    );
}

/// Routes read and match as the gateway's endpoints do (`floodgate::route`): `{param}`
/// segments, a method-specific route over an any-method one, `HEAD` meeting `GET`'s limits.
#[tokio::test]
async fn routes_are_patterns_with_the_gateways_meaning() {
    let plan = TieredPlan::builder()
        .keyed([per_minute("keyed", 100)])
        .route(
            "GET /v1/orders/{id}",
            RouteKey::Client,
            [per_minute("read", 2)],
        )
        .route("/v1/orders/{id}", RouteKey::Client, [per_minute("any", 5)])
        .build()
        .unwrap();
    let service = RateLimitLayer::builder()
        .plan(plan)
        .store(MemoryStore::new())
        .build()
        .unwrap()
        .layer(service_fn(hello));
    let peer = "198.51.100.7:1";
    let key = Some("k");
    // The binding limit is the route's, the tighter one: its limit names which route matched.
    let first = send(&service, Method::GET, "/v1/orders/1", peer, key).await;
    assert_eq!(first, (200, "2".to_owned()), "GET meets the GET route");
    let head = send(&service, Method::HEAD, "/v1/orders/2", peer, key).await;
    assert_eq!(head, (200, "2".to_owned()), "HEAD meets the GET route too");
    let third = send(&service, Method::GET, "/v1/orders/3", peer, key).await;
    assert_eq!(third.0, 429, "one counter for every order id");
    let post = send(&service, Method::POST, "/v1/orders/1", peer, key).await;
    assert_eq!(
        post,
        (200, "5".to_owned()),
        "other methods meet the any-method route"
    );
    let nested = send(&service, Method::GET, "/v1/orders/1/items", peer, key).await;
    assert_eq!(nested, (200, "100".to_owned()), "{{id}} is one segment");
    let conflict = TieredPlan::builder()
        .route("/a/{x}", RouteKey::Client, [per_minute("a", 1)])
        .route("/a/{y}", RouteKey::Client, [per_minute("b", 1)])
        .build()
        .unwrap_err();
    assert!(
        conflict.to_string().starts_with("routes[1]: `/a/{y}`"),
        "{conflict}"
    );
}
