//! `identity.jwt`: verified tenants (SPEC §3). The section is validated with its field paths,
//! and its keys (a secret from the environment or a file, or a JWKS file) are read here, so a
//! reload reads them again: a rotated JWKS takes effect with the configuration's next version.

use std::path::Path;
use std::sync::Arc;

use http::header::HeaderName;
use jsonwebtoken::Algorithm;
use serde::{Deserialize, Serialize};

use super::errors::{Errors, Problem};
use super::parse_duration;
use crate::token::{InvalidToken, KeySource, TokenRules, TokenVerifier};

/// `identity.jwt:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawJwt {
    /// The header the token comes in: `authorization` (as `Bearer <token>`) or another that
    /// holds the token alone.
    pub header: String,
    /// The environment variable that holds an HMAC secret.
    pub secret_env: Option<String>,
    /// A file that holds an HMAC secret (trailing newlines are not part of it).
    pub secret_file: Option<String>,
    /// A JWKS file of public keys, relative to the configuration file's directory.
    pub jwks_file: Option<String>,
    /// The algorithms allowed; by default every one of the keys' kinds.
    pub algorithms: Vec<String>,
    /// The required `iss`.
    pub issuer: Option<String>,
    /// The required `aud`.
    pub audience: Option<String>,
    /// The claim that names the client.
    pub client_claim: String,
    /// The claim that names the client's plan.
    pub plan_claim: Option<String>,
    /// The claim that names the client's `adaptive_concurrency` class.
    pub class_claim: Option<String>,
    /// What a request with a refused token gets: `reject` (401) or `anonymous`.
    pub invalid_token: String,
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway: String,
}

impl Default for RawJwt {
    fn default() -> Self {
        RawJwt {
            header: "authorization".to_owned(),
            secret_env: None,
            secret_file: None,
            jwks_file: None,
            algorithms: Vec::new(),
            issuer: None,
            audience: None,
            client_claim: "sub".to_owned(),
            plan_claim: None,
            class_claim: None,
            invalid_token: "reject".to_owned(),
            leeway: "60s".to_owned(),
        }
    }
}

/// The most clock skew `leeway` may allow.
const MAX_LEEWAY_SECONDS: u64 = 600;

/// Validates `identity.jwt` and reads its keys; `base` is the directory relative paths start
/// from. `Some(None)` when the section is absent; `None` after an error.
pub(super) fn verifier(
    errors: &mut Errors,
    raw: Option<&RawJwt>,
    base: &Path,
) -> Option<Option<Arc<TokenVerifier>>> {
    let Some(raw) = raw else {
        return Some(None);
    };
    let before = errors.0.len();
    let header = errors.ok(
        "identity.jwt.header",
        HeaderName::try_from(raw.header.as_str())
            .map_err(|_| Problem(format!("`{}` is not a header name", raw.header))),
    );
    let algorithms: Vec<Algorithm> = raw
        .algorithms
        .iter()
        .enumerate()
        .filter_map(|(index, name)| {
            errors.ok(
                format!("identity.jwt.algorithms[{index}]"),
                name.parse::<Algorithm>().map_err(|_| {
                    Problem(format!(
                        "`{name}` is not one of HS256, HS384, HS512, RS256, RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA"
                    ))
                }),
            )
        })
        .collect();
    let invalid = errors.ok(
        "identity.jwt.invalid_token",
        match raw.invalid_token.as_str() {
            "reject" => Ok(InvalidToken::Reject),
            "anonymous" => Ok(InvalidToken::Anonymous),
            other => Err(Problem(format!(
                "`{other}` is not one of reject, anonymous"
            ))),
        },
    );
    let leeway = errors.ok(
        "identity.jwt.leeway",
        parse_duration(&raw.leeway).and_then(|leeway| {
            if leeway.as_secs() > MAX_LEEWAY_SECONDS {
                Err(Problem(format!(
                    "at most {MAX_LEEWAY_SECONDS}s: a longer one keeps expired tokens trusted"
                )))
            } else {
                Ok(leeway.as_secs())
            }
        }),
    );
    for (field, value) in [
        ("identity.jwt.client_claim", Some(&raw.client_claim)),
        ("identity.jwt.plan_claim", raw.plan_claim.as_ref()),
        ("identity.jwt.class_claim", raw.class_claim.as_ref()),
        ("identity.jwt.issuer", raw.issuer.as_ref()),
        ("identity.jwt.audience", raw.audience.as_ref()),
    ] {
        if value.is_some_and(|value| value.is_empty()) {
            errors.push(field, "must not be empty");
        }
    }
    let material = key_material(errors, raw, base);
    if errors.0.len() > before {
        return None;
    }
    let (field, material) = material?;
    let rules = TokenRules {
        header: header?,
        algorithms,
        issuer: raw.issuer.clone(),
        audience: raw.audience.clone(),
        client_claim: raw.client_claim.clone(),
        plan_claim: raw.plan_claim.clone(),
        class_claim: raw.class_claim.clone(),
        leeway_seconds: leeway?,
        invalid: invalid?,
    };
    let source = match &material {
        Material::Secret(bytes) => KeySource::Secret(bytes),
        Material::Jwks(text) => KeySource::Jwks(text),
    };
    let verifier = errors.ok(
        field,
        TokenVerifier::new(source, rules).map_err(|error| {
            // An algorithm the keys cannot verify is the `algorithms` list's fault.
            Problem(error.to_string())
        }),
    )?;
    Some(Some(Arc::new(verifier)))
}

/// Key material as read, and the field it came from.
enum Material {
    Secret(Vec<u8>),
    Jwks(String),
}

fn key_material(
    errors: &mut Errors,
    raw: &RawJwt,
    base: &Path,
) -> Option<(&'static str, Material)> {
    let named = [
        raw.secret_env.is_some(),
        raw.secret_file.is_some(),
        raw.jwks_file.is_some(),
    ]
    .into_iter()
    .filter(|named| *named)
    .count();
    if named != 1 {
        errors.push(
            "identity.jwt",
            "name exactly one of secret_env, secret_file, jwks_file",
        );
        return None;
    }
    if let Some(variable) = &raw.secret_env {
        let field = "identity.jwt.secret_env";
        return match std::env::var(variable) {
            Ok(secret) => Some((field, Material::Secret(secret.into_bytes()))),
            Err(_) => {
                errors.push(
                    field,
                    format!("the environment variable `{variable}` is not set"),
                );
                None
            }
        };
    }
    if let Some(file) = &raw.secret_file {
        let field = "identity.jwt.secret_file";
        let mut secret = errors.ok(field, read(base, file))?;
        while secret
            .last()
            .is_some_and(|byte| *byte == b'\n' || *byte == b'\r')
        {
            secret.pop();
        }
        return Some((field, Material::Secret(secret)));
    }
    let file = raw.jwks_file.as_ref()?;
    let field = "identity.jwt.jwks_file";
    let bytes = errors.ok(field, read(base, file))?;
    let text = errors.ok(
        field,
        String::from_utf8(bytes).map_err(|_| Problem(format!("{file} is not UTF-8 text"))),
    )?;
    Some((field, Material::Jwks(text)))
}

/// The most a key file may hold: a JWKS of many keys is a few kilobytes.
const MAX_KEY_FILE_BYTES: u64 = 1024 * 1024;

fn read(base: &Path, file: &str) -> Result<Vec<u8>, Problem> {
    let path = base.join(file);
    let size = std::fs::metadata(&path)
        .map_err(|error| Problem(format!("cannot read {}: {error}", path.display())))?
        .len();
    if size > MAX_KEY_FILE_BYTES {
        return Err(Problem(format!(
            "{} is {size} bytes; a key file may hold at most {MAX_KEY_FILE_BYTES}",
            path.display()
        )));
    }
    std::fs::read(&path)
        .map_err(|error| Problem(format!("cannot read {}: {error}", path.display())))
}

#[cfg(test)]
mod tests {
    use crate::config::parse_in;

    fn errors_of(section: &str, base: &std::path::Path) -> Vec<String> {
        let text = format!("identity:\n  jwt:\n{section}");
        match parse_in(&text, base) {
            Ok(_) => Vec::new(),
            Err(errors) => errors.0.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn the_section_is_validated_with_its_field_paths() {
        let directory = std::env::temp_dir().join(format!("floodgate-jwt-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        std::fs::write(
            directory.join("secret"),
            "0123456789abcdef0123456789abcdef\n",
        )
        .unwrap();
        std::fs::write(directory.join("empty.json"), r#"{"keys":[]}"#).unwrap();

        assert_eq!(
            errors_of("    secret_file: secret\n", &directory),
            Vec::<String>::new()
        );
        let config = parse_in(
            "identity:\n  jwt: { secret_file: secret, audience: api }\n",
            &directory,
        )
        .unwrap();
        assert!(
            config.warnings(false).iter().any(|warning| warning
                == "identity.jwt: no issuer is set; a token these keys signed for another service is trusted here too"),
            "{:?}",
            config.warnings(false)
        );
        let neither = errors_of("    issuer: x\n", &directory);
        assert_eq!(
            neither,
            ["identity.jwt: name exactly one of secret_env, secret_file, jwks_file"]
        );
        let both = errors_of(
            "    secret_file: secret\n    jwks_file: empty.json\n",
            &directory,
        );
        assert_eq!(both.len(), 1, "{both:?}");
        let all = errors_of(
            "    secret_file: secret\n    algorithms: [HS256, none]\n    invalid_token: ignore\n    leeway: 1h\n    header: \"bad header\"\n    client_claim: \"\"\n    class_claim: \"\"\n",
            &directory,
        );
        for expected in [
            "identity.jwt.algorithms[1]: `none` is not one of",
            "identity.jwt.invalid_token: `ignore` is not one of reject, anonymous",
            "identity.jwt.leeway: at most 600s",
            "identity.jwt.header: `bad header` is not a header name",
            "identity.jwt.client_claim: must not be empty",
            "identity.jwt.class_claim: must not be empty",
        ] {
            assert!(
                all.iter().any(|error| error.starts_with(expected)),
                "{expected} in {all:?}"
            );
        }
        // A class claim nothing reads: no adaptive_concurrency to place its requests in.
        assert_eq!(
            errors_of(
                "    secret_file: secret\n    class_claim: tier\n",
                &directory
            ),
            ["identity.jwt.class_claim: needs adaptive_concurrency"]
        );
        let missing = errors_of("    jwks_file: absent.json\n", &directory);
        assert!(
            missing[0].starts_with("identity.jwt.jwks_file: cannot read"),
            "{missing:?}"
        );
        assert_eq!(
            errors_of("    jwks_file: empty.json\n", &directory),
            ["identity.jwt.jwks_file: holds no key to verify signatures with"]
        );
        assert_eq!(
            errors_of(
                "    secret_file: secret\n    algorithms: [ES256]\n",
                &directory
            ),
            ["identity.jwt.secret_file: ES256 cannot be verified with these keys"]
        );
        let unset = errors_of(
            "    secret_env: FLOODGATE_TEST_NO_SUCH_VARIABLE\n",
            &directory,
        );
        assert_eq!(
            unset,
            [
                "identity.jwt.secret_env: the environment variable `FLOODGATE_TEST_NO_SUCH_VARIABLE` is not set"
            ]
        );
        std::fs::remove_dir_all(&directory).unwrap();
    }

    #[test]
    fn with_tokens_in_authorization_a_bearer_credential_is_never_an_api_key() {
        let directory =
            std::env::temp_dir().join(format!("floodgate-jwt-bearer-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        std::fs::write(directory.join("secret"), "0123456789abcdef0123456789abcdef").unwrap();
        let request = |config: &crate::config::Config| {
            let request = http::Request::get("/")
                .header("authorization", "Bearer some-key")
                .body(())
                .unwrap();
            config
                .identity
                .identifier
                .api_key(&floodgate::RequestInfo::new(&request))
                .map(str::to_owned)
        };
        let plain = parse_in("", &directory).unwrap();
        assert_eq!(request(&plain).as_deref(), Some("some-key"));
        let tokens = parse_in("identity:\n  jwt: { secret_file: secret }\n", &directory).unwrap();
        assert_eq!(request(&tokens), None);
        let elsewhere = parse_in(
            "identity:\n  jwt: { secret_file: secret, header: x-token }\n",
            &directory,
        )
        .unwrap();
        assert_eq!(request(&elsewhere).as_deref(), Some("some-key"));
        std::fs::remove_dir_all(&directory).unwrap();
    }
}
