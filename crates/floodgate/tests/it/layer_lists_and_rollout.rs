//! The layer end to end through `oneshot`: allowlists and denylists, shadow mode and the kill switch.

use crate::common;

use common::*;
use floodgate::key::DefaultIdentifier;
use floodgate::{MemoryStore, RateLimitLayer, UserId};
use http::StatusCode;
use tower::{Layer, service_fn};

#[tokio::test]
async fn allowlisted_clients_skip_the_store_and_denylisted_get_403() {
    use floodgate::lists::ClientList;
    let store = MemoryStore::new();
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .store(store.clone())
        .allowlist(
            ClientList::new()
                .api_key("partner")
                .ip("192.0.2.0/24".parse().unwrap()),
        )
        .denylist(
            ClientList::new()
                .ip("203.0.113.66/32".parse().unwrap())
                .user("mallory"),
        )
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    for _ in 0..5 {
        let partner = send(
            &service,
            from_peer("198.51.100.1:1").header("x-api-key", "partner"),
        )
        .await;
        assert_eq!(partner.status(), StatusCode::OK);
        assert!(
            !partner.headers().contains_key("x-ratelimit-limit"),
            "no limit applies"
        );
        assert_eq!(
            send(&service, from_peer("192.0.2.44:1")).await.status(),
            StatusCode::OK
        );
    }
    assert!(store.is_empty(), "allowlisted traffic made no store call");
    let denied = send(&service, from_peer("203.0.113.66:1")).await;
    assert_eq!(denied.status(), StatusCode::FORBIDDEN);
    assert_eq!(json(&denied), serde_json::json!({"error": "forbidden"}));
    let user = send(
        &service,
        from_peer("198.51.100.2:1").extension(UserId("mallory".into())),
    )
    .await;
    assert_eq!(user.status(), StatusCode::FORBIDDEN);
    assert!(store.is_empty(), "denied before any store call");
    assert_eq!(
        send(&service, from_peer("198.51.100.3:1")).await.status(),
        StatusCode::OK
    );
    assert_eq!(store.len(), 1, "others are limited as usual");
}

#[tokio::test]
async fn shadow_mode_and_the_kill_switch_switch_at_runtime() {
    use floodgate::{rollout::Mode, rollout::Rollout};
    let store = MemoryStore::new();
    let rollout = Rollout::new(Mode::Shadow, 100.0);
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .store(store.clone())
        .rollout(rollout.clone())
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    for _ in 0..3 {
        assert_eq!(
            send(&service, from_peer("198.51.100.1:1")).await.status(),
            StatusCode::OK,
            "shadow"
        );
    }
    rollout.set_mode(Mode::Enforce);
    assert_eq!(
        send(&service, from_peer("198.51.100.1:1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    rollout.set_mode(Mode::Off);
    let entries = store.len();
    for _ in 0..3 {
        assert_eq!(
            send(&service, from_peer("198.51.100.9:1")).await.status(),
            StatusCode::OK,
            "kill switch"
        );
    }
    assert_eq!(store.len(), entries, "no store call while off");
}

#[tokio::test]
async fn lists_match_the_exact_resolved_client_address() {
    // Regression: lists saw the /64-grouped address for IP clients (a denylisted
    // 2001:db8::5 was admitted, a single allowlisted IPv6 address allowlisted its /64) and the
    // raw socket peer for keyed clients (an allowlisted load balancer range let every keyed
    // client through; an IP denylist never matched a keyed client behind it).
    use floodgate::lists::ClientList;
    let store = MemoryStore::new();
    let identifier = DefaultIdentifier::new()
        .trusted_proxies(["10.0.0.0/8"])
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(per_second(1))
        .store(store.clone())
        .identify(identifier)
        .allowlist(
            ClientList::new()
                .ip("10.0.0.0/8".parse().unwrap())
                .ip("2001:db8::7/128".parse().unwrap()),
        )
        .denylist(ClientList::new().ip("2001:db8::5/128".parse().unwrap()))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));

    let denied = send(&service, from_peer("[2001:db8::5]:1")).await;
    assert_eq!(
        denied.status(),
        StatusCode::FORBIDDEN,
        "exact address denied"
    );
    let neighbour = send(&service, from_peer("[2001:db8::6]:1")).await;
    assert_eq!(
        neighbour.status(),
        StatusCode::OK,
        "its /64 neighbour is not"
    );
    assert!(
        neighbour.headers().contains_key("x-ratelimit-limit"),
        "and is not allowlisted either: the allowlisted 2001:db8::7 is one address"
    );

    // A keyed client behind the (allowlisted) proxy range is limited by its own address.
    let behind_proxy = || {
        from_peer("10.0.0.1:1")
            .header("x-forwarded-for", "198.51.100.9")
            .header("x-api-key", "client-key")
    };
    assert_eq!(
        send(&service, behind_proxy()).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&service, behind_proxy()).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the proxy's allowlisted range does not stand for the clients behind it"
    );
    let denied_behind_proxy = send(
        &service,
        from_peer("10.0.0.1:1")
            .header("x-forwarded-for", "2001:db8::5")
            .header("x-api-key", "other-key"),
    )
    .await;
    assert_eq!(
        denied_behind_proxy.status(),
        StatusCode::FORBIDDEN,
        "an IP denylist matches a keyed client behind a trusted proxy"
    );
}
