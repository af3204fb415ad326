//! The layer end to end through `oneshot`: who a request is from (peer addresses, trusted proxy chains, IPv6 grouping, API keys, bearer tokens, user ids, custom identities, unidentified clients).

use crate::common;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use floodgate::key::DefaultIdentifier;
use floodgate::{Identity, Limit, RateLimitLayer, RequestInfo, UserId};
use http::{Request, Response, StatusCode};
use http_body::Body;
use tower::{Layer, Service, service_fn};

#[tokio::test]
async fn forged_forwarded_for_from_an_untrusted_peer_changes_nothing() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(3))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let mut statuses = Vec::new();
    for forged in 0..6 {
        let request = from_peer("203.0.113.66:5000")
            .header("x-forwarded-for", format!("198.51.100.{forged}"))
            .header("forwarded", format!("for=192.0.2.{forged}"));
        statuses.push(send(&service, request).await.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
}

#[tokio::test]
async fn a_trusted_proxy_chain_is_walked_to_the_client() {
    let identify = DefaultIdentifier::new()
        .trusted_proxies(["10.0.0.0/8"])
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .identify(identify)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let via_proxies = |client: &str| {
        from_peer("10.0.0.1:80").header("x-forwarded-for", format!("6.6.6.6, {client}, 10.0.0.2"))
    };
    assert_eq!(
        send(&service, via_proxies("198.51.100.7")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, via_proxies("198.51.100.8")).await.status(),
        StatusCode::OK,
        "another client"
    );
    assert_eq!(
        send(&service, via_proxies("198.51.100.7")).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "same client behind the same proxies"
    );
}

#[tokio::test]
async fn ipv6_clients_are_grouped_by_prefix() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    assert_eq!(
        send(&service, from_peer("[2001:db8:1:2::1]:1"))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, from_peer("[2001:db8:1:2:ffff::9]:1"))
            .await
            .status(),
        StatusCode::TOO_MANY_REQUESTS,
        "same /64"
    );
    assert_eq!(
        send(&service, from_peer("[2001:db8:1:3::1]:1"))
            .await
            .status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn api_keys_and_bearer_tokens_identify_clients() {
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let peer = "203.0.113.1:1";
    assert_eq!(
        send(&service, from_peer(peer).header("x-api-key", "key-a"))
            .await
            .status(),
        StatusCode::OK
    );
    // Same key by bearer token: the same client, in every spelling an upstream reads as
    // the key (regression, issue 45: `Bearer<TAB>key-a` was counted as the IP).
    for spelling in [
        "Bearer key-a",
        "Bearer\tkey-a",
        "bearer key-a",
        "BEARER key-a",
        "Bearer   key-a",
    ] {
        let bearer = from_peer(peer).header("authorization", spelling);
        assert_eq!(
            send(&service, bearer).await.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{spelling:?}"
        );
    }
    assert_eq!(
        send(&service, from_peer(peer).header("x-api-key", "key-b"))
            .await
            .status(),
        StatusCode::OK
    );
    // Keys are not IPs: the IP itself still has its own budget.
    assert_eq!(
        send(&service, from_peer(peer)).await.status(),
        StatusCode::OK
    );
}

/// A layer of one request per second per client, identified by a `DefaultIdentifier` the test
/// keeps (to read its malformed count), around `ok_handler`.
fn one_per_second_by_default_identity() -> (
    Arc<DefaultIdentifier>,
    impl Service<
        Request<()>,
        Response = Response<impl Body<Data = Bytes, Error: std::fmt::Debug>>,
        Error = Infallible,
    > + Clone,
) {
    let identify = Arc::new(DefaultIdentifier::new());
    let counting = identify.clone();
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .identify(move |request: &RequestInfo<'_>| {
            use floodgate::key::IdentifyClient;
            counting.identify(request)
        })
        .build()
        .unwrap();
    (identify, layer.layer(service_fn(ok_handler)))
}

#[tokio::test]
async fn oversized_or_malformed_keys_are_treated_as_absent() {
    let (identify, service) = one_per_second_by_default_identity();
    let peer = "203.0.113.1:1";
    let oversized = "k".repeat(300);
    // Each falls back to the peer IP: one budget for all of them.
    assert_eq!(
        send(
            &service,
            from_peer(peer).header("x-api-key", oversized.as_str())
        )
        .await
        .status(),
        StatusCode::OK
    );
    let with_space = from_peer(peer).header("x-api-key", "two words");
    assert_eq!(
        send(&service, with_space).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let non_ascii = from_peer(peer).header(
        "x-api-key",
        http::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
    );
    assert_eq!(
        send(&service, non_ascii).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let empty_bearer = from_peer(peer).header("authorization", "Bearer ");
    assert_eq!(
        send(&service, empty_bearer).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(identify.malformed_count(), 4);
    // 256 visible ASCII bytes is still a key.
    let longest = "k".repeat(256);
    assert_eq!(
        send(
            &service,
            from_peer(peer).header("x-api-key", longest.as_str())
        )
        .await
        .status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_credential_header_sent_twice_identifies_no_key() {
    // An application behind the layer may read either copy (many frameworks keep the last):
    // a client sending a victim's key first and its own second would be counted on the
    // victim's budget while the application serves it as itself. Ambiguous, it is no key.
    let (identify, service) = one_per_second_by_default_identity();
    let victim = from_peer("198.51.100.7:1").header("x-api-key", "victim-key");
    assert_eq!(send(&service, victim).await.status(), StatusCode::OK);
    // The attacker, from elsewhere: victim's key first, its own second.
    let twice = from_peer("203.0.113.9:1")
        .header("x-api-key", "victim-key")
        .header("x-api-key", "attacker-key");
    assert_eq!(
        send(&service, twice).await.status(),
        StatusCode::OK,
        "counted on its own address, not on the victim's spent budget"
    );
    let two_bearers = from_peer("203.0.113.9:1")
        .header("authorization", "Bearer victim-key")
        .header("authorization", "Bearer attacker-key");
    assert_eq!(
        send(&service, two_bearers).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the same address's budget, already spent"
    );
    assert_eq!(identify.malformed_count(), 2);
}

#[tokio::test]
async fn user_ids_come_from_the_extension_or_a_trusted_header() {
    let identify = DefaultIdentifier::new()
        .user_header(Some("x-user-id"))
        .unwrap()
        .trusted_proxies(["10.0.0.1"])
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .identify(identify)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let user = |peer: &str, id: &str| from_peer(peer).header("x-user-id", id.to_owned());
    assert_eq!(
        send(&service, user("10.0.0.1:1", "alice")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, user("10.0.0.1:1", "bob")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, user("10.0.0.1:1", "alice")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // From an untrusted peer the header is ignored: identified by IP.
    assert_eq!(
        send(&service, user("203.0.113.5:1", "carol"))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, user("203.0.113.5:1", "dave")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // The typed extension from the app's auth layer is always trusted.
    let authenticated = from_peer("203.0.113.5:1").extension(UserId("erin".into()));
    assert_eq!(send(&service, authenticated).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn custom_identity_and_cost_functions() {
    let layer = RateLimitLayer::builder()
        .limit(Limit::fixed_window("units", 10, Duration::from_secs(60)).unwrap())
        .identify(|request: &RequestInfo<'_>| Identity::Custom {
            scope: "tenant".into(),
            value: request
                .headers
                .get("x-tenant")
                .map_or("none", |v| v.to_str().unwrap_or("bad"))
                .to_owned(),
        })
        .cost(|request: &RequestInfo<'_>| {
            if request.method == http::Method::POST {
                4
            } else {
                1
            }
        })
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let post = || {
        Request::builder()
            .method("POST")
            .uri("/")
            .header("x-tenant", "acme")
    };
    assert_eq!(send(&service, post()).await.body(), "6");
    assert_eq!(send(&service, post()).await.body(), "2");
    assert_eq!(
        send(&service, post()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let get = Request::builder().uri("/").header("x-tenant", "acme");
    assert_eq!(
        send(&service, get).await.body(),
        "1",
        "a cheaper request still fits"
    );
    let other = Request::builder()
        .method("POST")
        .uri("/")
        .header("x-tenant", "globex");
    assert_eq!(send(&service, other).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn unverified_api_keys_fall_back_to_the_client_address() {
    // Regression: invented API keys each got a fresh budget; with a verification hook they
    // are treated as absent and the client is limited by IP.
    let identifier = DefaultIdentifier::new().verify_api_key(|key: &str| key == "issued-key");
    let layer = RateLimitLayer::builder()
        .limit(per_second(2))
        .identify(identifier)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let statuses: Vec<u16> = statuses_of(
        &service,
        (0..4).map(|n| from_peer("198.51.100.1:1").header("x-api-key", format!("invented-{n}"))),
    )
    .await;
    assert_eq!(statuses, [200, 200, 429, 429]);
    let issued = send(
        &service,
        from_peer("198.51.100.1:1").header("x-api-key", "issued-key"),
    )
    .await;
    assert_eq!(
        issued.status(),
        StatusCode::OK,
        "a known key has its own budget"
    );
}

async fn statuses_of<S, B>(
    service: &S,
    requests: impl Iterator<Item = http::request::Builder>,
) -> Vec<u16>
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible> + Clone,
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let mut statuses = Vec::new();
    for request in requests {
        statuses.push(send(service, request).await.status().as_u16());
    }
    statuses
}

#[tokio::test]
async fn unidentified_clients_are_counted_and_can_be_rejected() {
    // Regression: requests without a peer address all shared one budget in silence. By
    // default they still pass; `UnknownIdentity::Reject` refuses them (500, client_unidentified).
    let shared = RateLimitLayer::builder()
        .limit(per_second(5))
        .build()
        .unwrap()
        .layer(service_fn(ok_handler));
    let no_peer = || Request::builder().uri("/v1/things");
    assert_eq!(send(&shared, no_peer()).await.status(), StatusCode::OK);

    let strict = RateLimitLayer::builder()
        .limit(per_second(5))
        .on_unknown_identity(floodgate::service::UnknownIdentity::Reject)
        .build()
        .unwrap()
        .layer(service_fn(ok_handler));
    let rejected = send(&strict, no_peer()).await;
    assert_eq!(rejected.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        json(&rejected),
        serde_json::json!({"error": "client_unidentified"})
    );
    assert_eq!(
        send(&strict, from_peer("198.51.100.1:1")).await.status(),
        StatusCode::OK,
        "identified clients are unaffected"
    );
}

#[tokio::test]
async fn one_identifier_serves_several_layers() {
    // Regression: DefaultIdentifier was not Clone and `Arc<T>` was no identifier, so a per-route
    // limit keyed like the global one needed a second identifier built the same way.
    let identifier = Arc::new(
        DefaultIdentifier::new()
            .trusted_proxies(["10.0.0.0/8"])
            .unwrap(),
    );
    let global = RateLimitLayer::builder()
        .limit(per_second(10))
        .identify(identifier.clone())
        .build()
        .unwrap();
    let login = RateLimitLayer::builder()
        .limit(Limit::fixed_window("login", 1, Duration::from_secs(60)).unwrap())
        .rule("login")
        .identify(identifier.clone())
        .build()
        .unwrap();
    let cloned = RateLimitLayer::builder()
        .limit(per_second(10))
        .identify(DefaultIdentifier::clone(&identifier))
        .build()
        .unwrap();
    let service = cloned.layer(global.layer(login.layer(service_fn(ok_handler))));
    let behind_proxy = || from_peer("10.0.0.1:1").header("x-forwarded-for", "198.51.100.40");
    assert_eq!(
        send(&service, behind_proxy()).await.status(),
        StatusCode::OK
    );
    let denied = send(&service, behind_proxy()).await;
    assert_eq!(
        denied.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the client, not the proxy"
    );
    assert_eq!(
        send(
            &service,
            from_peer("10.0.0.1:1").header("x-forwarded-for", "198.51.100.41")
        )
        .await
        .status(),
        StatusCode::OK,
        "another client behind the same proxy"
    );
}
