//! Verified tenants (SPEC §3, `identity.jwt`): a signed JWT names the client and its plan.
//!
//! A token is trusted only when its signature verifies with a configured key (a shared secret,
//! or a key of the JWKS file named by the token's `kid`), its `alg` is one the configuration
//! allows and the key's own, it has not expired (`exp` is required), is already valid (`nbf`),
//! and its issuer and audience are the configured ones. Anything else (a malformed token,
//! `alg: none`, a key the gateway does not hold, a claim of the wrong type) is refused and
//! counted by [`TokenProblem`]; never trusted.

use std::collections::HashSet;

use http::HeaderMap;
use http::header::HeaderName;
use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, Validation, errors::ErrorKind};
use serde_json::{Map, Value};

/// The longest token read, in bytes: a longer one is refused before any decoding.
pub(crate) const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// The longest client name a token may carry, as for an API key (SPEC §3).
const MAX_CLIENT_BYTES: usize = 256;

/// What a request carrying a token is answered when the token is refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum InvalidToken {
    /// 401 `{"error":"invalid_token"}` with `WWW-Authenticate: Bearer error="invalid_token"`.
    #[default]
    Reject,
    /// Limited as its client IP under `clients.anonymous_plan`, as a request without
    /// credentials (its API key, if any, is not read either).
    Anonymous,
}

/// The keys a token may be signed with.
enum Keys {
    /// One shared secret (`HS256`, `HS384`, `HS512`).
    Secret(DecodingKey),
    /// Public keys from a JWKS file, each with its `kid` and the one algorithm it allows when
    /// the file says.
    Set(Vec<PublicKey>),
}

struct PublicKey {
    id: Option<String>,
    algorithm: Option<Algorithm>,
    family: AlgorithmFamily,
    key: DecodingKey,
}

/// Verifies the tokens of one configuration version.
pub(crate) struct TokenVerifier {
    header: HeaderName,
    /// Whether the header is `Authorization`, whose value is `Bearer <token>`.
    bearer: bool,
    keys: Keys,
    /// One validation per allowed algorithm: a key verifies tokens of its own family only,
    /// and the library checks every algorithm of a validation against the key.
    validations: Vec<Validation>,
    client_claim: String,
    plan_claim: Option<String>,
    class_claim: Option<String>,
    /// What a refused token's request gets.
    pub(crate) invalid: InvalidToken,
}

impl std::fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Key material is never printed.
        let keys = match &self.keys {
            Keys::Secret(_) => "secret".to_owned(),
            Keys::Set(keys) => format!("{} public keys", keys.len()),
        };
        f.debug_struct("TokenVerifier")
            .field("header", &self.header)
            .field("keys", &keys)
            .field(
                "algorithms",
                &self
                    .validations
                    .iter()
                    .map(|validation| validation.algorithms[0])
                    .collect::<Vec<_>>(),
            )
            .field("client_claim", &self.client_claim)
            .field("plan_claim", &self.plan_claim)
            .field("class_claim", &self.class_claim)
            .field("invalid", &self.invalid)
            .finish()
    }
}

/// Where the keys come from, as the configuration names them.
pub(crate) enum KeySource<'a> {
    /// A shared secret's bytes.
    Secret(&'a [u8]),
    /// A JWKS document's text.
    Jwks(&'a str),
}

/// What is checked besides the signature, as the configuration gives it.
pub(crate) struct TokenRules {
    /// The header the token comes in.
    pub header: HeaderName,
    /// The algorithms allowed; empty for those of the keys' kinds.
    pub algorithms: Vec<Algorithm>,
    /// The required `iss`, if any.
    pub issuer: Option<String>,
    /// The required `aud` (one of the token's), if any.
    pub audience: Option<String>,
    /// The claim that names the client.
    pub client_claim: String,
    /// The claim that names the plan, if any.
    pub plan_claim: Option<String>,
    /// The claim that names the `adaptive_concurrency` class, if any.
    pub class_claim: Option<String>,
    /// Seconds of clock skew allowed on `exp` and `nbf`.
    pub leeway_seconds: u64,
    /// What a refused token's request gets.
    pub invalid: InvalidToken,
}

/// Why a token was refused: the `reason` of `floodgate_tokens_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TokenProblem {
    /// Not a JWT: not three base64url parts, bad JSON, too long.
    Malformed,
    /// An algorithm not allowed (`none` included), or not the key's.
    Algorithm,
    /// No configured key has the token's `kid`.
    UnknownKey,
    /// The signature does not verify.
    Signature,
    /// `exp` is past.
    Expired,
    /// `nbf` is still ahead.
    NotYetValid,
    /// `iss` is not the configured issuer.
    Issuer,
    /// `aud` does not hold the configured audience.
    Audience,
    /// A required claim is missing or of the wrong type (`exp` as a string, no client claim).
    Claims,
}

impl TokenProblem {
    /// The metric label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            TokenProblem::Malformed => "malformed",
            TokenProblem::Algorithm => "algorithm",
            TokenProblem::UnknownKey => "unknown_key",
            TokenProblem::Signature => "signature",
            TokenProblem::Expired => "expired",
            TokenProblem::NotYetValid => "not_yet_valid",
            TokenProblem::Issuer => "issuer",
            TokenProblem::Audience => "audience",
            TokenProblem::Claims => "claims",
        }
    }

    fn of(kind: &ErrorKind) -> TokenProblem {
        match kind {
            ErrorKind::InvalidSignature => TokenProblem::Signature,
            ErrorKind::ExpiredSignature => TokenProblem::Expired,
            ErrorKind::ImmatureSignature => TokenProblem::NotYetValid,
            ErrorKind::InvalidIssuer => TokenProblem::Issuer,
            ErrorKind::InvalidAudience => TokenProblem::Audience,
            ErrorKind::MissingRequiredClaim(_) | ErrorKind::InvalidClaimFormat(_) => {
                TokenProblem::Claims
            }
            ErrorKind::InvalidAlgorithm
            | ErrorKind::InvalidAlgorithmName
            | ErrorKind::UnsupportedAlgorithm
            | ErrorKind::MissingAlgorithm => TokenProblem::Algorithm,
            // Keys that do not fit the algorithm were refused when loaded; what is left is the
            // token's own shape.
            _ => TokenProblem::Malformed,
        }
    }
}

/// A request's token, read and checked.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Token {
    /// The request carries none in the configured header.
    Absent,
    /// A trusted token: the client it names, and the plan and class claims' values if any.
    Verified {
        /// The client claim's value.
        client: String,
        /// The plan claim's value.
        plan: Option<String>,
        /// The class claim's value (`identity.jwt.class_claim`).
        class: Option<String>,
    },
    /// A token that is not trusted, and why.
    Refused(TokenProblem),
}

/// Why keys could not be loaded: reported under the configuration field that named them.
#[derive(Debug, thiserror::Error)]
pub(crate) enum KeyError {
    /// A JWKS document that does not parse.
    #[error("not a JWKS document ({0})")]
    Jwks(String),
    /// A JWKS document with no signing key.
    #[error("holds no key to verify signatures with")]
    Empty,
    /// A key that cannot verify.
    #[error("keys[{index}]: {problem}")]
    Key {
        /// Its position in `keys`.
        index: usize,
        /// What is wrong with it.
        problem: String,
    },
    /// A shared secret too short to resist guessing.
    #[error("the secret is {0} bytes; HMAC secrets must hold at least 32")]
    ShortSecret(usize),
    /// An algorithm the keys cannot verify.
    #[error("{0:?} cannot be verified with these keys")]
    Algorithm(Algorithm),
}

impl TokenVerifier {
    /// A verifier for `rules` with the keys of `source`.
    pub(crate) fn new(source: KeySource<'_>, rules: TokenRules) -> Result<Self, KeyError> {
        let keys = match source {
            KeySource::Secret(secret) => {
                if secret.len() < 32 {
                    return Err(KeyError::ShortSecret(secret.len()));
                }
                Keys::Secret(
                    DecodingKey::from_secret(secret).map_err(|error| KeyError::Key {
                        index: 0,
                        problem: error.to_string(),
                    })?,
                )
            }
            KeySource::Jwks(text) => Keys::Set(public_keys(text)?),
        };
        let families = keys.families();
        let algorithms = if rules.algorithms.is_empty() {
            families
                .iter()
                .flat_map(|family| family.algorithms().iter().copied())
                .collect()
        } else {
            rules.algorithms
        };
        if let Some(unusable) = algorithms
            .iter()
            .find(|algorithm| !families.contains(&algorithm.family()))
        {
            return Err(KeyError::Algorithm(*unusable));
        }
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = rules.leeway_seconds;
        validation.validate_nbf = true;
        let mut required = vec!["exp"];
        if let Some(issuer) = &rules.issuer {
            validation.set_issuer(&[issuer]);
            required.push("iss");
        }
        if let Some(audience) = &rules.audience {
            validation.set_audience(&[audience]);
            required.push("aud");
        } else {
            // No audience configured: a token's `aud` is not this gateway's to judge.
            validation.validate_aud = false;
        }
        validation.set_required_spec_claims(&required);
        let validations = algorithms
            .into_iter()
            .map(|algorithm| Validation {
                algorithms: vec![algorithm],
                ..validation.clone()
            })
            .collect();
        let bearer = rules.header == http::header::AUTHORIZATION;
        Ok(TokenVerifier {
            header: rules.header,
            bearer,
            keys,
            validations,
            client_claim: rules.client_claim,
            plan_claim: rules.plan_claim,
            class_claim: rules.class_claim,
            invalid: rules.invalid,
        })
    }

    /// The claims a token is not checked against: `iss` and `aud` when no issuer or audience
    /// is configured (any token these keys signed is trusted, whoever it was issued for).
    pub(crate) fn unchecked_claims(&self) -> Vec<&'static str> {
        let Some(validation) = self.validations.first() else {
            return Vec::new();
        };
        let mut unchecked = Vec::new();
        if validation.iss.is_none() {
            unchecked.push("issuer");
        }
        if validation.aud.is_none() {
            unchecked.push("audience");
        }
        unchecked
    }

    /// The header tokens come in.
    pub(crate) fn header(&self) -> &HeaderName {
        &self.header
    }

    /// Reads and checks the token of a request with `headers`.
    pub(crate) fn check(&self, headers: &HeaderMap) -> Token {
        let Some(value) = headers.get(&self.header) else {
            return Token::Absent;
        };
        let token = if self.bearer {
            // Any spelling an upstream reads as a bearer token (`Bearer<TAB>`, `BEARER`,
            // several spaces) is one here too: verified, never passed on unread.
            match floodgate::key::bearer_credential(value.as_bytes()) {
                Some(token) => token,
                // Another scheme (Basic, ...) is not a token of ours.
                None => return Token::Absent,
            }
        } else {
            value.as_bytes().trim_ascii()
        };
        match std::str::from_utf8(token) {
            Ok(token) => self.verify(token),
            Err(_) => Token::Refused(TokenProblem::Malformed),
        }
    }

    /// Checks one token.
    pub(crate) fn verify(&self, token: &str) -> Token {
        match self.claims(token) {
            Ok(claims) => self.named(&claims),
            Err(problem) => Token::Refused(problem),
        }
    }

    fn claims(&self, token: &str) -> Result<Map<String, Value>, TokenProblem> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(TokenProblem::Malformed);
        }
        let header = jsonwebtoken::decode_header(token).map_err(|error| match error.kind() {
            // `alg: none`, and names no JWS algorithm has.
            ErrorKind::Json(_) if token_names_unknown_algorithm(token) => TokenProblem::Algorithm,
            kind => TokenProblem::of(kind),
        })?;
        let validation = self
            .validations
            .iter()
            .find(|validation| validation.algorithms[0] == header.alg)
            .ok_or(TokenProblem::Algorithm)?;
        let decode = |key: &DecodingKey| {
            jsonwebtoken::decode::<Map<String, Value>>(token, key, validation)
                .map(|data| data.claims)
                .map_err(|error| TokenProblem::of(error.kind()))
        };
        match &self.keys {
            Keys::Secret(key) => decode(key),
            Keys::Set(keys) => {
                let family = header.alg.family();
                let fits = |key: &&PublicKey| {
                    key.family == family && key.algorithm.is_none_or(|alg| alg == header.alg)
                };
                match &header.kid {
                    Some(id) => {
                        let key = keys
                            .iter()
                            .find(|key| key.id.as_deref() == Some(id))
                            .ok_or(TokenProblem::UnknownKey)?;
                        if !fits(&key) {
                            return Err(TokenProblem::Algorithm);
                        }
                        decode(&key.key)
                    }
                    // No `kid`: each key that fits the algorithm is tried; the first answer
                    // other than a bad signature is the token's.
                    None => {
                        let mut outcome = Err(TokenProblem::UnknownKey);
                        for key in keys.iter().filter(fits) {
                            outcome = decode(&key.key);
                            if outcome != Err(TokenProblem::Signature) {
                                break;
                            }
                        }
                        outcome
                    }
                }
            }
        }
    }

    /// The client, plan and class a verified token's claims name.
    fn named(&self, claims: &Map<String, Value>) -> Token {
        let client = match claims.get(&self.client_claim) {
            Some(Value::String(text)) => text.clone(),
            Some(Value::Number(number)) if number.is_u64() || number.is_i64() => number.to_string(),
            _ => return Token::Refused(TokenProblem::Claims),
        };
        if client.is_empty() || client.len() > MAX_CLIENT_BYTES {
            return Token::Refused(TokenProblem::Claims);
        }
        let text_of = |claim: &Option<String>| {
            claim
                .as_ref()
                .and_then(|name| claims.get(name))
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        Token::Verified {
            client,
            plan: text_of(&self.plan_claim),
            class: text_of(&self.class_claim),
        }
    }
}

impl Keys {
    fn families(&self) -> Vec<AlgorithmFamily> {
        match self {
            Keys::Secret(_) => vec![AlgorithmFamily::Hmac],
            Keys::Set(keys) => {
                let mut families: Vec<AlgorithmFamily> = Vec::new();
                for key in keys {
                    if !families.contains(&key.family) {
                        families.push(key.family);
                    }
                }
                families
            }
        }
    }
}

/// The signing keys of a JWKS document. Keys for encryption (`use: enc`, an `RSA-OAEP` or
/// `RSA1_5` algorithm) or of an algorithm floodgate does not know are left out, as an
/// identity provider's published set holds them beside its signing keys. Symmetric (`oct`)
/// keys are refused: a shared secret is configured as one, never mixed with public keys.
fn public_keys(text: &str) -> Result<Vec<PublicKey>, KeyError> {
    let set: JwkSet =
        serde_json::from_str(text).map_err(|error| KeyError::Jwks(error.to_string()))?;
    let mut ids = HashSet::new();
    let mut keys = Vec::new();
    for (index, jwk) in set.keys.iter().enumerate() {
        let problem = |problem: String| KeyError::Key { index, problem };
        if jwk.common.public_key_use == Some(PublicKeyUse::Encryption) {
            continue;
        }
        let family = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => AlgorithmFamily::Rsa,
            AlgorithmParameters::EllipticCurve(_) => AlgorithmFamily::Ec,
            AlgorithmParameters::OctetKeyPair(_) => AlgorithmFamily::Ed,
            AlgorithmParameters::OctetKey(_) => {
                return Err(problem(
                    "a symmetric key: configure a shared secret as secret_env or secret_file"
                        .to_owned(),
                ));
            }
            // `Other` and kinds a later version adds: nothing floodgate verifies with.
            _ => continue,
        };
        let algorithm = match jwk.common.key_algorithm {
            Some(named) => match named.to_string().parse::<Algorithm>() {
                Ok(algorithm) if algorithm.family() == family => Some(algorithm),
                Ok(_) => return Err(problem(format!("alg {named} does not fit the key"))),
                // An encryption algorithm, or one no JWS verifier has.
                Err(_) => continue,
            },
            None => None,
        };
        if let Some(id) = &jwk.common.key_id
            && !ids.insert(id.clone())
        {
            return Err(problem(format!("kid `{id}` is given to two keys")));
        }
        let key = DecodingKey::from_jwk(jwk).map_err(|error| problem(error.to_string()))?;
        keys.push(PublicKey {
            id: jwk.common.key_id.clone(),
            algorithm,
            family,
            key,
        });
    }
    if keys.is_empty() {
        return Err(KeyError::Empty);
    }
    Ok(keys)
}

/// Whether a token's header names an `alg` the JWS algorithms do not hold (`none`): told
/// apart from a header that is not JSON at all, for the metric's reason.
fn token_names_unknown_algorithm(token: &str) -> bool {
    use base64::Engine as _;
    let Some(header) = token.split('.').next() else {
        return false;
    };
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(header)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<Map<String, Value>>(&bytes).ok())
        .is_some_and(|header| header.get("alg").is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;
    use jsonwebtoken::{EncodingKey, Header};
    use ring::rand::SystemRandom;
    use ring::signature::{
        ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, Ed25519KeyPair, KeyPair as _,
    };
    use serde_json::json;

    const SECRET: &[u8] = b"a shared secret of at least thirty-two bytes";

    fn now() -> u64 {
        jsonwebtoken::get_current_timestamp()
    }

    fn rules() -> TokenRules {
        TokenRules {
            header: http::header::AUTHORIZATION,
            algorithms: Vec::new(),
            issuer: Some("https://auth.example".to_owned()),
            audience: Some("api".to_owned()),
            client_claim: "sub".to_owned(),
            plan_claim: Some("plan".to_owned()),
            class_claim: Some("priority".to_owned()),
            leeway_seconds: 5,
            invalid: InvalidToken::Reject,
        }
    }

    /// Claims the rules above accept, for `sub`, valid for an hour.
    fn claims(sub: &str) -> Value {
        json!({
            "sub": sub, "plan": "gold", "iss": "https://auth.example", "aud": "api",
            "exp": now() + 3600, "iat": now(),
        })
    }

    fn hs256(claims: &Value, secret: &[u8]) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            claims,
            &EncodingKey::from_secret(secret).unwrap(),
        )
        .unwrap()
    }

    fn secret_verifier() -> TokenVerifier {
        TokenVerifier::new(KeySource::Secret(SECRET), rules()).unwrap()
    }

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    }

    /// A fresh P-256 key: its signing key and its JWK with `kid`.
    fn es256_key(kid: &str) -> (EncodingKey, Value) {
        let random = SystemRandom::new();
        let pkcs8 =
            EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &random).unwrap();
        let pair =
            EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &random)
                .unwrap();
        // An uncompressed point: 0x04, then x and y.
        let point = pair.public_key().as_ref();
        let jwk = json!({
            "kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256", "kid": kid,
            "x": b64(&point[1..33]), "y": b64(&point[33..65]),
        });
        (EncodingKey::from_ec_der(pkcs8.as_ref()), jwk)
    }

    /// A fresh Ed25519 key: its signing key and its JWK (no `kid`).
    fn ed25519_key() -> (EncodingKey, Value) {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).unwrap();
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap();
        let jwk = json!({"kty": "OKP", "crv": "Ed25519", "x": b64(pair.public_key().as_ref())});
        (EncodingKey::from_ed_der(pkcs8.as_ref()), jwk)
    }

    fn signed(
        algorithm: Algorithm,
        kid: Option<&str>,
        claims: &Value,
        key: &EncodingKey,
    ) -> String {
        let mut header = Header::new(algorithm);
        header.kid = kid.map(str::to_owned);
        jsonwebtoken::encode(&header, claims, key).unwrap()
    }

    fn jwks(keys: &[&Value]) -> String {
        json!({ "keys": keys }).to_string()
    }

    #[test]
    fn a_valid_token_names_its_client_plan_and_class() {
        let verifier = secret_verifier();
        assert_eq!(
            verifier.verify(&hs256(&claims("tenant-7"), SECRET)),
            Token::Verified {
                client: "tenant-7".to_owned(),
                plan: Some("gold".to_owned()),
                class: None,
            }
        );
        let mut critical = claims("tenant-7");
        critical["priority"] = json!("critical");
        assert_eq!(
            verifier.verify(&hs256(&critical, SECRET)),
            Token::Verified {
                client: "tenant-7".to_owned(),
                plan: Some("gold".to_owned()),
                class: Some("critical".to_owned()),
            }
        );
        // A numeric client claim is a name too; a token without the plan claim has none.
        let mut numeric = claims("x");
        numeric["sub"] = json!(42);
        numeric.as_object_mut().unwrap().remove("plan");
        assert_eq!(
            verifier.verify(&hs256(&numeric, SECRET)),
            Token::Verified {
                client: "42".to_owned(),
                plan: None,
                class: None,
            }
        );
    }

    #[test]
    fn forged_expired_and_misaddressed_tokens_are_refused() {
        let verifier = secret_verifier();
        let refused = |claims: &Value, secret: &[u8]| verifier.verify(&hs256(claims, secret));
        assert_eq!(
            refused(&claims("a"), b"another secret of at least thirty-two bytes"),
            Token::Refused(TokenProblem::Signature)
        );
        let mut expired = claims("a");
        expired["exp"] = json!(now() - 60);
        assert_eq!(
            refused(&expired, SECRET),
            Token::Refused(TokenProblem::Expired)
        );
        let mut early = claims("a");
        early["nbf"] = json!(now() + 600);
        assert_eq!(
            refused(&early, SECRET),
            Token::Refused(TokenProblem::NotYetValid)
        );
        let mut audience = claims("a");
        audience["aud"] = json!(["billing", "admin"]);
        assert_eq!(
            refused(&audience, SECRET),
            Token::Refused(TokenProblem::Audience)
        );
        let mut issuer = claims("a");
        issuer["iss"] = json!("https://evil.example");
        assert_eq!(
            refused(&issuer, SECRET),
            Token::Refused(TokenProblem::Issuer)
        );
        for missing in ["exp", "iss", "aud", "sub"] {
            let mut without = claims("a");
            without.as_object_mut().unwrap().remove(missing);
            assert_eq!(
                refused(&without, SECRET),
                Token::Refused(TokenProblem::Claims),
                "without {missing}"
            );
        }
        // GHSA-h395-gr6q-cpjc: a time claim of the wrong type is not an absent one.
        let mut confused = claims("a");
        confused["nbf"] = json!((now() + 600).to_string());
        assert!(matches!(refused(&confused, SECRET), Token::Refused(_)));
        let mut long = claims("a");
        long["sub"] = json!("x".repeat(MAX_CLIENT_BYTES + 1));
        assert_eq!(refused(&long, SECRET), Token::Refused(TokenProblem::Claims));
    }

    #[test]
    fn unsigned_and_malformed_tokens_are_refused_without_panic() {
        let verifier = secret_verifier();
        let payload = b64(claims("a").to_string().as_bytes());
        let none = format!("{}.{payload}.", b64(br#"{"alg":"none","typ":"JWT"}"#));
        assert_eq!(
            verifier.verify(&none),
            Token::Refused(TokenProblem::Algorithm)
        );
        // `none` with the signature of a valid token pasted on.
        let valid = hs256(&claims("a"), SECRET);
        let signature = valid.rsplit('.').next().unwrap();
        let pasted = format!("{}.{payload}.{signature}", b64(br#"{"alg":"none"}"#));
        assert_eq!(
            verifier.verify(&pasted),
            Token::Refused(TokenProblem::Algorithm)
        );
        let oversized = format!("{valid}{}", "A".repeat(MAX_TOKEN_BYTES));
        for malformed in ["", "a.b", "a.b.c", "....", "\u{1F600}.x.y", &oversized] {
            assert_eq!(
                verifier.verify(malformed),
                Token::Refused(TokenProblem::Malformed),
                "{malformed:.20}"
            );
        }
        // An algorithm the configuration does not allow.
        let only_hs512 = TokenVerifier::new(
            KeySource::Secret(SECRET),
            TokenRules {
                algorithms: vec![Algorithm::HS512],
                ..rules()
            },
        )
        .unwrap();
        assert_eq!(
            only_hs512.verify(&valid),
            Token::Refused(TokenProblem::Algorithm)
        );
    }

    #[test]
    fn the_bearer_scheme_is_read_and_other_schemes_are_not_tokens() {
        let verifier = secret_verifier();
        let token = hs256(&claims("a"), SECRET);
        let headers = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(
                http::header::AUTHORIZATION,
                http::HeaderValue::from_str(value).unwrap(),
            );
            headers
        };
        for spelling in [
            format!("bearer  {token}"),
            format!("Bearer\t{token}"),
            format!("BEARER {token} "),
        ] {
            assert!(
                matches!(verifier.check(&headers(&spelling)), Token::Verified { .. }),
                "{spelling:?}"
            );
        }
        assert_eq!(
            verifier.check(&headers("Bearer")),
            Token::Refused(TokenProblem::Malformed),
            "the scheme alone"
        );
        assert_eq!(
            verifier.check(&headers("Basic dXNlcjpwYXNz")),
            Token::Absent
        );
        assert_eq!(verifier.check(&HeaderMap::new()), Token::Absent);
        let mut opaque = HeaderMap::new();
        opaque.insert(
            http::header::AUTHORIZATION,
            http::HeaderValue::from_bytes(b"Bearer \xff").unwrap(),
        );
        assert_eq!(
            verifier.check(&opaque),
            Token::Refused(TokenProblem::Malformed)
        );
    }

    #[test]
    fn public_keys_verify_by_kid_and_refuse_what_they_do_not_hold() {
        let (signing, jwk) = es256_key("2026-12");
        let (ed_signing, ed_jwk) = ed25519_key();
        let encryption =
            json!({"kty": "RSA", "use": "enc", "alg": "RSA-OAEP", "n": "AQAB", "e": "AQAB"});
        let verifier = TokenVerifier::new(
            KeySource::Jwks(&jwks(&[&jwk, &ed_jwk, &encryption])),
            rules(),
        )
        .unwrap();
        let token = signed(Algorithm::ES256, Some("2026-12"), &claims("t"), &signing);
        assert!(
            matches!(verifier.verify(&token), Token::Verified { .. }),
            "{:?}",
            verifier.verify(&token)
        );
        // No kid: the keys that fit the algorithm are tried.
        let ed = signed(Algorithm::EdDSA, None, &claims("t"), &ed_signing);
        assert!(matches!(verifier.verify(&ed), Token::Verified { .. }));
        let unknown = signed(Algorithm::ES256, Some("2025-01"), &claims("t"), &signing);
        assert_eq!(
            verifier.verify(&unknown),
            Token::Refused(TokenProblem::UnknownKey)
        );
        // Another key under a kid the gateway holds.
        let (other, _) = es256_key("2026-12");
        let impostor = signed(Algorithm::ES256, Some("2026-12"), &claims("t"), &other);
        assert_eq!(
            verifier.verify(&impostor),
            Token::Refused(TokenProblem::Signature)
        );
        // Algorithm confusion: an HMAC token keyed with the public key's text.
        let confused = signed(
            Algorithm::HS256,
            Some("2026-12"),
            &claims("t"),
            &EncodingKey::from_secret(jwk.to_string().as_bytes()).unwrap(),
        );
        assert_eq!(
            verifier.verify(&confused),
            Token::Refused(TokenProblem::Algorithm)
        );
    }

    #[test]
    fn key_files_that_cannot_verify_are_refused_with_the_reason() {
        let (_, jwk) = es256_key("a");
        let error = |source: KeySource<'_>, rules: TokenRules| {
            TokenVerifier::new(source, rules).unwrap_err().to_string()
        };
        assert!(error(KeySource::Jwks("{}"), rules()).contains("not a JWKS"));
        assert!(error(KeySource::Jwks(r#"{"keys":[]}"#), rules()).contains("no key"));
        let oct = json!({"kty": "oct", "k": b64(SECRET)});
        assert!(
            error(KeySource::Jwks(&jwks(&[&oct])), rules()).contains("keys[0]: a symmetric key")
        );
        assert!(error(KeySource::Jwks(&jwks(&[&jwk, &jwk])), rules()).contains("keys[1]: kid `a`"));
        let mut misfit = jwk.clone();
        misfit["alg"] = json!("RS256");
        assert!(error(KeySource::Jwks(&jwks(&[&misfit])), rules()).contains("does not fit"));
        assert!(error(KeySource::Secret(b"short"), rules()).contains("at least 32"));
        let hmac_on_public = TokenRules {
            algorithms: vec![Algorithm::HS256],
            ..rules()
        };
        assert!(error(KeySource::Jwks(&jwks(&[&jwk])), hmac_on_public).contains("HS256"));
    }
}
