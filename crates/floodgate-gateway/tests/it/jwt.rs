//! Verified tenants, black-box (SPEC §3 `identity.jwt`): the real binary, real signed tokens.
//!
//! A valid token keys its client and picks its plan; forged, expired and unsigned tokens are
//! refused (401) or limited as anonymous, as configured; a JWKS rotated by a reload trusts the
//! new key and no longer the old.

use crate::support;

use base64::Engine as _;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use ring::rand::SystemRandom;
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair as _};
use serde_json::{Value, json};
use support::{Gateway, TempDir, Upstream, addresses, admin_reload, client, config_text, get};

/// Plans told apart by their limit: `gold` 3 a minute, `free` 1, `anonymous` 100.
const PLANS: &str = "plans:
  gold:
    limits: [ { name: m, algorithm: fixed_window, limit: 3, window: 60s } ]
  free:
    limits: [ { name: m, algorithm: fixed_window, limit: 1, window: 60s } ]
  anonymous:
    limits: [ { name: m, algorithm: fixed_window, limit: 100, window: 60s } ]
";

/// A fresh P-256 signing key, and its JWK under `kid`.
fn es256_key(kid: &str) -> (EncodingKey, Value) {
    let random = SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &random).unwrap();
    let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &random)
        .unwrap();
    let point = pair.public_key().as_ref();
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    let jwk = json!({
        "kty": "EC", "crv": "P-256", "use": "sig", "kid": kid,
        "x": b64(&point[1..33]), "y": b64(&point[33..65]),
    });
    (EncodingKey::from_ec_der(pkcs8.as_ref()), jwk)
}

fn now() -> i64 {
    jsonwebtoken::get_current_timestamp() as i64
}

/// A token for `sub` on `plan`, signed by `key` under `kid`, expiring `expires_in` seconds
/// from now (negative: already expired).
fn token(key: &EncodingKey, kid: &str, sub: &str, plan: &str, expires_in: i64) -> String {
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some(kid.to_owned());
    let claims = json!({
        "sub": sub, "plan": plan, "iss": "https://auth.test", "aud": "api",
        "exp": now() + expires_in,
    });
    jsonwebtoken::encode(&header, &claims, key).unwrap()
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// A gateway whose `identity.jwt` reads the JWKS `keys` from a file beside its configuration
/// (a relative path: resolved from the configuration's directory).
fn gateway_with_keys(upstream: &Upstream, keys: &[&Value], invalid: &str) -> (Gateway, TempDir) {
    gateway_with_keys_and(upstream, keys, invalid, "", "")
}

/// [`gateway_with_keys`], with `jwt_extra` (indented settings) added to `identity.jwt` and
/// `extra` (top-level sections) to the configuration.
fn gateway_with_keys_and(
    upstream: &Upstream,
    keys: &[&Value],
    invalid: &str,
    jwt_extra: &str,
    extra: &str,
) -> (Gateway, TempDir) {
    let directory = TempDir::new("jwt");
    std::fs::write(
        directory.file("jwks.json"),
        json!({ "keys": keys }).to_string(),
    )
    .unwrap();
    let (listen, admin) = addresses();
    let rest = format!(
        "identity:\n  jwt:\n    jwks_file: jwks.json\n    issuer: \"https://auth.test\"\n    audience: api\n    plan_claim: plan\n{jwt_extra}    invalid_token: {invalid}\n{PLANS}{extra}"
    );
    let path = directory.file("floodgate.yaml");
    std::fs::write(&path, config_text(listen, admin, &upstream.url(), &rest)).unwrap();
    (Gateway::start(&path, listen, admin), directory)
}

#[tokio::test]
async fn a_signed_token_keys_its_client_and_its_plan_and_forgeries_are_refused() {
    let upstream = Upstream::start().await;
    let (key, jwk) = es256_key("k1");
    let (gateway, _directory) = gateway_with_keys(&upstream, &[&jwk], "reject");
    let client = client();
    let url = gateway.url("/v1/x");

    let gold = token(&key, "k1", "tenant-a", "gold", 3600);
    for attempt in 1..=3 {
        let answer = get(&client, &url, &[("authorization", &bearer(&gold))]).await;
        assert_eq!(answer.status(), 200, "attempt {attempt}");
        assert_eq!(
            answer.headers()["x-ratelimit-limit"],
            "3",
            "the token's plan"
        );
    }
    let fourth = get(&client, &url, &[("authorization", &bearer(&gold))]).await;
    assert_eq!(fourth.status(), 429, "tenant-a's own budget of 3 is spent");
    // Another tenant in the same plan has its own budget; a plan the gateway does not have
    // falls back to clients.default_plan (free: 1).
    let other = token(&key, "k1", "tenant-b", "platinum", 3600);
    let answer = get(&client, &url, &[("authorization", &bearer(&other))]).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["x-ratelimit-limit"], "1");

    let (stranger, _) = es256_key("k1");
    let forged = token(&stranger, "k1", "tenant-a", "gold", 3600);
    let expired = token(&key, "k1", "tenant-c", "gold", -120);
    let b64 = |text: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text);
    let unsigned = format!(
        "{}.{}.",
        b64(r#"{"alg":"none","typ":"JWT"}"#),
        b64(&json!({"sub": "tenant-d", "plan": "gold", "exp": now() + 60}).to_string())
    );
    for (what, token) in [
        ("forged", forged),
        ("expired", expired),
        ("unsigned", unsigned),
    ] {
        let answer = get(&client, &url, &[("authorization", &bearer(&token))]).await;
        assert_eq!(answer.status(), 401, "{what}");
        assert_eq!(
            answer.headers()["www-authenticate"],
            "Bearer error=\"invalid_token\"",
            "{what}"
        );
        assert_eq!(
            serde_json::from_slice::<Value>(answer.body()).unwrap()["error"],
            "invalid_token",
            "{what}"
        );
    }
    // No token: the anonymous plan, by IP, as before.
    let anonymous = get(&client, &url, &[]).await;
    assert_eq!(anonymous.status(), 200);
    assert_eq!(anonymous.headers()["x-ratelimit-limit"], "100");

    let metrics = get(&client, &gateway.admin_url("/metrics"), &[]).await;
    let metrics = String::from_utf8_lossy(metrics.body()).into_owned();
    for line in [
        "floodgate_tokens_total{result=\"verified\"} 5",
        "floodgate_tokens_total{result=\"signature\"} 1",
        "floodgate_tokens_total{result=\"expired\"} 1",
        "floodgate_tokens_total{result=\"algorithm\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
}

#[tokio::test]
async fn a_refused_token_may_be_limited_as_anonymous_instead() {
    let upstream = Upstream::start().await;
    let (key, jwk) = es256_key("k1");
    let (gateway, _directory) = gateway_with_keys(&upstream, &[&jwk], "anonymous");
    let client = client();
    let url = gateway.url("/v1/x");
    let expired = token(&key, "k1", "tenant-a", "gold", -120);
    let answer = get(
        &client,
        &url,
        &[("authorization", &bearer(&expired)), ("x-api-key", "k")],
    )
    .await;
    assert_eq!(answer.status(), 200);
    assert_eq!(
        answer.headers()["x-ratelimit-limit"],
        "100",
        "the anonymous plan, not the token's nor the API key's"
    );
}

#[tokio::test]
async fn a_jwks_rotated_by_reload_trusts_the_new_key_and_not_the_old() {
    let upstream = Upstream::start().await;
    let (old_key, old_jwk) = es256_key("2026-11");
    let (gateway, directory) = gateway_with_keys(&upstream, &[&old_jwk], "reject");
    let client = client();
    let url = gateway.url("/v1/x");
    let old = token(&old_key, "2026-11", "tenant-a", "gold", 3600);
    let (new_key, new_jwk) = es256_key("2026-12");
    let new = token(&new_key, "2026-12", "tenant-a", "gold", 3600);
    assert_eq!(
        get(&client, &url, &[("authorization", &bearer(&old))])
            .await
            .status(),
        200
    );
    assert_eq!(
        get(&client, &url, &[("authorization", &bearer(&new))])
            .await
            .status(),
        401,
        "not yet published"
    );

    // Both keys while tokens of the old one are still out, then the new one alone.
    let jwks = directory.file("jwks.json");
    std::fs::write(&jwks, json!({ "keys": [&old_jwk, &new_jwk] }).to_string()).unwrap();
    assert_eq!(admin_reload(&client, &gateway).await.0, 200);
    for token in [&old, &new] {
        assert_eq!(
            get(&client, &url, &[("authorization", &bearer(token))])
                .await
                .status(),
            200
        );
    }
    std::fs::write(&jwks, json!({ "keys": [&new_jwk] }).to_string()).unwrap();
    assert_eq!(admin_reload(&client, &gateway).await.0, 200);
    assert_eq!(
        get(&client, &url, &[("authorization", &bearer(&old))])
            .await
            .status(),
        401,
        "the retired key"
    );
    // One tenant whichever key signed its tokens, through both reloads: gold's 3 are spent
    // (a 429, not a 401: the token verified).
    let last = get(&client, &url, &[("authorization", &bearer(&new))]).await;
    assert_eq!(last.status(), 429);

    // A JWKS file broken by a bad write is refused; the keys in service stay.
    std::fs::write(&jwks, "{\"keys\": [").unwrap();
    let (status, answer) = admin_reload(&client, &gateway).await;
    assert_ne!(status, 200);
    assert!(
        answer.to_string().contains("identity.jwt.jwks_file"),
        "{answer}"
    );
    assert_eq!(
        get(&client, &url, &[("authorization", &bearer(&new))])
            .await
            .status(),
        429,
        "the new key still verifies: tenant-a is at its limit"
    );
}

/// The watcher reloads when the JWKS file beside the configuration changes, as it does for the
/// configuration itself: a rotation needs no signal. (Within 2 s: SPEC's "within 1 s", doubled
/// for a loaded machine.)
#[tokio::test]
async fn a_jwks_file_written_beside_the_configuration_is_reloaded_by_the_watcher() {
    let upstream = Upstream::start().await;
    let (old_key, old_jwk) = es256_key("old");
    let (gateway, directory) = gateway_with_keys(&upstream, &[&old_jwk], "reject");
    let client = client();
    let url = gateway.url("/v1/x");
    let (new_key, new_jwk) = es256_key("new");
    let new = token(&new_key, "new", "tenant-w", "gold", 3600);
    let old = token(&old_key, "old", "tenant-w", "gold", 3600);
    assert_eq!(
        get(&client, &url, &[("authorization", &bearer(&new))])
            .await
            .status(),
        401
    );
    support::write_atomically(
        &directory.file("jwks.json"),
        &json!({ "keys": [&new_jwk] }).to_string(),
    );
    let started = std::time::Instant::now();
    loop {
        let status = get(&client, &url, &[("authorization", &bearer(&new))])
            .await
            .status();
        if status == 200 {
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "the new key is not trusted 2 s after the JWKS file changed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        get(&client, &url, &[("authorization", &bearer(&old))])
            .await
            .status(),
        401,
        "the old key is gone"
    );
}

/// The ways a lenient upstream reads a bearer credential (RFC 7235 puts one space; upstreams
/// split on any whitespace and take any case): `Bearer<TAB>`, `bearer`, `BEARER`, spaces.
fn lenient_bearers(token: &str) -> [(&'static str, String); 4] {
    [
        ("Bearer<TAB>", format!("Bearer\t{token}")),
        ("bearer", format!("bearer {token}")),
        ("BEARER", format!("BEARER {token}")),
        ("extra spaces", format!("Bearer   {token}")),
    ]
}

/// The upstream's echo of the headers it received (`authorization`, `x-api-key`, ...).
fn forwarded_headers(answer: &http::Response<bytes::Bytes>) -> serde_json::Map<String, Value> {
    let echo: Value = serde_json::from_slice(answer.body()).expect("the upstream's echo");
    echo["headers"].as_object().cloned().unwrap_or_default()
}

/// Sends a GET to `url` with `headers` (a name may repeat: each is its own field line).
async fn get_with(
    client: &support::TestClient,
    url: &str,
    headers: &[(&str, String)],
) -> http::Response<bytes::Bytes> {
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    get(client, url, &pairs).await
}

fn assert_invalid_request(answer: &http::Response<bytes::Bytes>, what: &str) {
    assert_eq!(answer.status(), 400, "{what}");
    assert_eq!(
        answer.body().as_ref(),
        br#"{"error":"invalid_request"}"#,
        "{what}"
    );
    assert_eq!(
        answer.headers()["www-authenticate"],
        "Bearer error=\"invalid_request\"",
        "{what}"
    );
}

/// Regression (issue 45, items 3 and 4): only the first `Authorization` header was verified
/// and all were forwarded (`Basic …` then `Bearer <valid>` was served as anonymous, the
/// tenant's counter untouched); `Bearer<TAB><token>` was not read as a token but forwarded as
/// it was (an expired one got 200 under `reject`); `?access_token=` was ignored and forwarded.
/// Now a bearer credential in any spelling is verified, and a request carrying two (two
/// `Authorization` headers, or one and `access_token`) is refused with 400.
#[tokio::test]
async fn a_bearer_token_in_any_spelling_is_verified_and_two_credentials_are_refused() {
    let upstream = Upstream::start().await;
    let (key, jwk) = es256_key("k1");
    let (gateway, _directory) = gateway_with_keys(&upstream, &[&jwk], "reject");
    let client = client();
    let url = gateway.url("/v1/x");

    for (index, (what, _)) in lenient_bearers("").iter().enumerate() {
        // One tenant per spelling: each spends one of gold's 3.
        let valid = token(&key, "k1", &format!("tenant-{index}"), "gold", 3600);
        let header = lenient_bearers(&valid)[index].1.clone();
        let answer = get_with(&client, &url, &[("authorization", header)]).await;
        assert_eq!(answer.status(), 200, "{what}");
        assert_eq!(
            answer.headers()["x-ratelimit-limit"],
            "3",
            "{what}: the token's plan"
        );
        assert_eq!(answer.headers()["x-ratelimit-remaining"], "2", "{what}");
        let expired = token(&key, "k1", &format!("tenant-{index}"), "gold", -120);
        let header = lenient_bearers(&expired)[index].1.clone();
        let answer = get_with(&client, &url, &[("authorization", header)]).await;
        assert_eq!(answer.status(), 401, "{what}: an expired token");
        assert_eq!(
            answer.headers()["www-authenticate"],
            "Bearer error=\"invalid_token\"",
            "{what}"
        );
    }

    let valid = token(&key, "k1", "tenant-a", "gold", 3600);
    let expired = token(&key, "k1", "tenant-a", "gold", -120);
    let basic = "Basic dXNlcjpwYXNz".to_owned();
    for (what, headers) in [
        (
            "Basic, then a valid bearer",
            vec![
                ("authorization", basic.clone()),
                ("authorization", bearer(&valid)),
            ],
        ),
        (
            "a valid bearer, then Basic",
            vec![
                ("authorization", bearer(&valid)),
                ("authorization", basic.clone()),
            ],
        ),
        (
            "Basic, then an expired bearer",
            vec![
                ("authorization", basic.clone()),
                ("authorization", bearer(&expired)),
            ],
        ),
        (
            "an expired bearer, then Basic",
            vec![
                ("authorization", bearer(&expired)),
                ("authorization", basic.clone()),
            ],
        ),
        (
            "an expired bearer, then a valid one",
            vec![
                ("authorization", bearer(&expired)),
                ("authorization", bearer(&valid)),
            ],
        ),
    ] {
        let answer = get_with(&client, &url, &headers).await;
        assert_invalid_request(&answer, what);
    }
    for (what, query, headers) in [
        (
            "a valid access_token",
            format!("access_token={valid}"),
            vec![],
        ),
        (
            "an expired access_token",
            format!("access_token={expired}"),
            vec![],
        ),
        (
            "a percent-encoded name",
            format!("a=1&access%5Ftoken={valid}"),
            vec![],
        ),
        (
            "Authorization and access_token",
            format!("access_token={expired}"),
            vec![("authorization", bearer(&valid))],
        ),
    ] {
        let answer = get_with(&client, &gateway.url(&format!("/v1/x?{query}")), &headers).await;
        assert_invalid_request(&answer, what);
    }
    // tenant-a's budget was never spent by the refused requests.
    let answer = get(&client, &url, &[("authorization", &bearer(&valid))]).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["x-ratelimit-remaining"], "2");
}

/// Regression (issue 45): under `invalid_token: anonymous`, a refused token (an expired one,
/// in every spelling) is limited as the client's IP and is not forwarded: the upstream sees
/// the anonymous request the gateway counted, without the token nor the API key beside it.
/// Two credentials are refused as under `reject`.
#[tokio::test]
async fn an_expired_token_limited_as_anonymous_is_not_forwarded() {
    let upstream = Upstream::start().await;
    let (key, jwk) = es256_key("k1");
    let (gateway, _directory) = gateway_with_keys(&upstream, &[&jwk], "anonymous");
    let client = client();
    let url = gateway.url("/v1/x");
    let expired = token(&key, "k1", "tenant-a", "gold", -120);
    let mut spellings = lenient_bearers(&expired).to_vec();
    spellings.push(("Bearer", bearer(&expired)));
    for (what, header) in spellings {
        let answer = get_with(
            &client,
            &url,
            &[("authorization", header), ("x-api-key", "k".to_owned())],
        )
        .await;
        assert_eq!(answer.status(), 200, "{what}");
        assert_eq!(
            answer.headers()["x-ratelimit-limit"],
            "100",
            "{what}: the anonymous plan"
        );
        let forwarded = forwarded_headers(&answer);
        assert!(
            !forwarded.contains_key("authorization") && !forwarded.contains_key("x-api-key"),
            "{what}: the upstream received {forwarded:?}"
        );
    }
    // A valid token is forwarded as it came; an API key beside it, which the token won over,
    // is not (an upstream that authenticates by it would read another client).
    let valid = token(&key, "k1", "tenant-a", "gold", 3600);
    let answer = get_with(
        &client,
        &url,
        &[
            ("authorization", bearer(&valid)),
            ("x-api-key", "k".to_owned()),
        ],
    )
    .await;
    assert_eq!(answer.headers()["x-ratelimit-limit"], "3");
    let forwarded = forwarded_headers(&answer);
    assert_eq!(forwarded["authorization"], bearer(&valid));
    assert!(!forwarded.contains_key("x-api-key"), "{forwarded:?}");

    let basic = "Basic dXNlcjpwYXNz".to_owned();
    for (what, headers) in [
        (
            "Basic, then an expired bearer",
            [basic.clone(), bearer(&expired)],
        ),
        ("an expired bearer, then Basic", [bearer(&expired), basic]),
    ] {
        let headers = headers.map(|value| ("authorization", value));
        let answer = get_with(&client, &url, &headers).await;
        assert_invalid_request(&answer, what);
    }
    for (what, query, headers) in [
        (
            "an expired access_token",
            format!("access_token={expired}"),
            vec![],
        ),
        (
            "Authorization and an expired access_token",
            format!("access_token={expired}"),
            vec![("authorization", bearer(&valid))],
        ),
        (
            "an expired bearer and a valid access_token",
            format!("access_token={valid}"),
            vec![("authorization", bearer(&expired))],
        ),
    ] {
        let answer = get_with(&client, &gateway.url(&format!("/v1/x?{query}")), &headers).await;
        assert_invalid_request(&answer, what);
    }
}

/// Regression (issue 45, item 3): with `unknown_keys: default_plan`, a tenant at 429 that
/// hid its token behind a `Basic` header and added a random `x-api-key` was served 20 of 20
/// on a fresh budget. A verified token wins over any API key; hiding it is refused.
#[tokio::test]
async fn a_tenant_at_its_limit_gets_nothing_from_an_invented_api_key() {
    let upstream = Upstream::start().await;
    let (key, jwk) = es256_key("k1");
    let (gateway, _directory) = gateway_with_keys(&upstream, &[&jwk], "reject");
    let client = client();
    let url = gateway.url("/v1/x");
    let valid = token(&key, "k1", "tenant-z", "gold", 3600);
    for _ in 0..3 {
        let answer = get(&client, &url, &[("authorization", &bearer(&valid))]).await;
        assert_eq!(answer.status(), 200);
    }
    let mut statuses = Vec::new();
    for attempt in 0..20 {
        let invented = format!("invented-{attempt}");
        let alone = get(
            &client,
            &url,
            &[("authorization", &bearer(&valid)), ("x-api-key", &invented)],
        )
        .await;
        statuses.push(alone.status().as_u16());
        let hidden = get_with(
            &client,
            &url,
            &[
                ("authorization", "Basic dXNlcjpwYXNz".to_owned()),
                ("authorization", bearer(&valid)),
                ("x-api-key", invented),
            ],
        )
        .await;
        statuses.push(hidden.status().as_u16());
    }
    assert!(
        statuses.chunks(2).all(|pair| pair == [429, 400]),
        "{statuses:?}"
    );
}

/// `identity.jwt.class_claim` (SPEC §11, amended): a verified token's claim places its
/// requests in an `adaptive_concurrency` class; a request without a token gets the default.
/// Here the plan claim doubles as the class claim, with classes named after plans.
#[tokio::test]
async fn a_verified_token_s_class_claim_places_its_requests() {
    let upstream = Upstream::start().await;
    let (key, jwk) = es256_key("k1");
    let extra = "adaptive_concurrency:\n  default_class: other\n  \
                 classes: [ { name: gold, reserve: 0.2 }, { name: other } ]\n";
    let (gateway, _directory) = gateway_with_keys_and(
        &upstream,
        &[&jwk],
        "reject",
        "    class_claim: plan\n",
        extra,
    );
    let client = client();
    let valid = token(&key, "k1", "tenant-c", "gold", 3600);
    for headers in [vec![("authorization", bearer(&valid))], vec![]] {
        let answer = get_with(&client, &gateway.url("/v1/x"), &headers).await;
        assert_eq!(answer.status(), 200, "{headers:?}");
    }
    let (status, answer) = support::admin_call(
        &client,
        &gateway,
        http::Method::GET,
        "/admin/adaptive",
        None,
        None,
    )
    .await;
    assert_eq!(status, 200);
    let classes = &answer["upstreams"][0]["classes"];
    assert_eq!(
        (&classes[0]["name"], &classes[0]["admitted"]),
        (&json!("gold"), &json!(1)),
        "{answer}"
    );
    assert_eq!(classes[1]["admitted"], 1, "{answer}");
}
