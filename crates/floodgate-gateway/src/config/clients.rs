//! Who clients are: `identity` (the identifier and the plan header), `clients` (API keys and
//! their plans, unknown keys) and the allow and deny lists.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use floodgate::key::DefaultIdentifier;
use floodgate::lists::ClientList;
use http::header::HeaderName;
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::errors::{Errors, Problem};
use super::jwt::RawJwt;
use super::key_digest;
use super::limits::RawPlan;
use crate::credentials::{AuthorizationUse, CredentialHeaders};
use crate::token::TokenVerifier;

/// `identity:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawIdentity {
    /// Where an API key is read from.
    pub api_key: RawApiKey,
    /// Off unless configured: a header that lets a client pick its user is opt-in.
    pub user_header: Option<String>,
    /// Off unless configured, like `user_header`.
    pub plan_header: Option<String>,
    /// Networks whose forwarding headers are believed (CIDRs or addresses).
    pub trusted_proxies: Vec<String>,
    /// The header family the trusted proxies write: `x-forwarded-for` or `forwarded`.
    pub forwarded: String,
    /// IPv6 clients are grouped by this prefix length.
    pub ipv6_prefix: u8,
    /// Verified tenants: a signed token names the client and its plan.
    pub jwt: Option<RawJwt>,
}

impl Default for RawIdentity {
    fn default() -> Self {
        RawIdentity {
            api_key: RawApiKey::default(),
            user_header: None,
            plan_header: None,
            trusted_proxies: Vec::new(),
            forwarded: "x-forwarded-for".to_owned(),
            ipv6_prefix: 64,
            jwt: None,
        }
    }
}

/// `identity.api_key:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawApiKey {
    /// The header that carries the key.
    pub header: String,
    /// Whether `Authorization: Bearer <key>` carries one too.
    pub bearer: bool,
}

impl Default for RawApiKey {
    fn default() -> Self {
        RawApiKey {
            header: "x-api-key".to_owned(),
            bearer: true,
        }
    }
}

/// `clients:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawClients {
    /// The plan of a client identified by API key or user id.
    pub default_plan: String,
    /// The plan of a client identified by its IP only.
    pub anonymous_plan: String,
    /// What a key not in `api_keys` gets: `default_plan`, `anonymous` or `reject`.
    pub unknown_keys: String,
    /// Each key (raw, or `sha256:<hex>`) and its plan.
    pub api_keys: BTreeMap<String, String>,
}

impl Default for RawClients {
    fn default() -> Self {
        RawClients {
            default_plan: "free".to_owned(),
            anonymous_plan: "anonymous".to_owned(),
            unknown_keys: "default_plan".to_owned(),
            api_keys: BTreeMap::new(),
        }
    }
}

/// `allowlist:` or `denylist:` as written.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawLists {
    /// Addresses and CIDRs.
    pub ips: Vec<String>,
    /// API keys (raw, or `sha256:<hex>`).
    pub api_keys: Vec<String>,
    /// User ids.
    pub users: Vec<String>,
}

/// `clients.unknown_keys`: what an API key not in `clients.api_keys` gets (SPEC §3).
///
/// Any string in the key header is an identity, so under `default_plan` a client can invent a
/// key, and a fresh budget, per request; `per_ip` limits still cap it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum UnknownKeys {
    /// Limited under `clients.default_plan`, as its own identity (the default).
    #[default]
    DefaultPlan,
    /// Limited as its client IP, under `clients.anonymous_plan`.
    Anonymous,
    /// Answered 401 `{"error":"unknown_api_key"}`.
    Reject,
}

impl std::str::FromStr for UnknownKeys {
    type Err = Problem;

    fn from_str(text: &str) -> Result<Self, Problem> {
        match text {
            "default_plan" => Ok(UnknownKeys::DefaultPlan),
            "anonymous" => Ok(UnknownKeys::Anonymous),
            "reject" => Ok(UnknownKeys::Reject),
            other => Err(problem!(
                "`{other}` is not one of default_plan, anonymous, reject"
            )),
        }
    }
}

/// `identity.*` beyond what the identifier holds.
#[derive(Debug)]
pub(crate) struct IdentitySettings {
    /// The identifier (API key, user header, trusted proxies, IPv6 grouping).
    pub identifier: Arc<DefaultIdentifier>,
    /// The header a trusted proxy uses to name the client's plan.
    pub plan_header: Option<HeaderName>,
    /// Verified tenants (`identity.jwt`), with their keys.
    pub jwt: Option<Arc<TokenVerifier>>,
    /// The file `identity.jwt` read its keys from (`jwks_file`, `secret_file`), if any: a
    /// change to it reloads the configuration as a change to the file itself does.
    pub key_file: Option<std::path::PathBuf>,
    /// The headers credentials come in: a request carrying two is refused, and a request
    /// limited as anonymous after a refused token is forwarded without them.
    pub credentials: CredentialHeaders,
}

/// Parses `sha256:<64 hex>`, or hashes a raw key.
pub(super) fn key_entry(text: &str) -> Result<[u8; 32], Problem> {
    let Some(hex) = text.strip_prefix("sha256:") else {
        return Ok(key_digest(text));
    };
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("`sha256:` must be followed by 64 hex digits".into());
    }
    let mut digest = [0u8; 32];
    for (index, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * index..2 * index + 2], 16)
            .map_err(|_| "bad hex".to_owned())?;
    }
    Ok(digest)
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

pub(super) fn client_list(errors: &mut Errors, path: &str, raw: &RawLists) -> ClientList {
    let mut list = ClientList::new();
    for (index, text) in raw.ips.iter().enumerate() {
        let parsed = text
            .parse::<IpNet>()
            .ok()
            .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from));
        match parsed {
            Some(net) => list = list.ip(net),
            None => errors.push(
                format!("{path}.ips[{index}]"),
                format!("`{text}` is not an IP address or CIDR"),
            ),
        }
    }
    for (index, key) in raw.api_keys.iter().enumerate() {
        if let Some(digest) = errors.ok(format!("{path}.api_keys[{index}]"), key_entry(key)) {
            list = list.api_key_digest(digest);
        }
    }
    raw.users
        .iter()
        .fold(list, |list, user| list.user(user.clone()))
}

/// `identity`: the identifier, the plan header and verified tenants, whose key files are
/// read from `base`.
pub(super) fn identity(
    errors: &mut Errors,
    identity: &RawIdentity,
    base: &std::path::Path,
) -> Option<IdentitySettings> {
    let jwt = super::jwt::verifier(errors, identity.jwt.as_ref(), base);
    // With tokens in `Authorization`, a bearer credential is a token, never an API key.
    let token_header = jwt
        .as_ref()
        .and_then(Option::as_ref)
        .map(|verifier| verifier.header().clone());
    let bearer_is_token = token_header.as_ref() == Some(&http::header::AUTHORIZATION);
    let authorization = match (bearer_is_token, identity.api_key.bearer) {
        (true, _) => AuthorizationUse::Token,
        (false, true) => AuthorizationUse::ApiKey,
        (false, false) => AuthorizationUse::Ignored,
    };
    let identifier = match DefaultIdentifier::new()
        .bearer(identity.api_key.bearer && !bearer_is_token)
        .api_key_header(Some(&identity.api_key.header))
        .and_then(|next| next.user_header(identity.user_header.as_deref()))
        .and_then(|next| next.trusted_proxies(&identity.trusted_proxies))
        .and_then(|next| next.ipv6_prefix(identity.ipv6_prefix))
    {
        Ok(built) => match identity
            .forwarded
            .parse::<floodgate::key::ForwardedHeader>()
        {
            Ok(forwarded) => Some(built.forwarded(forwarded)),
            Err(problem) => {
                errors.push("identity.forwarded", problem);
                None
            }
        },
        Err(error) => {
            let field = error.field();
            errors.push(
                format!("identity.{}", field.trim_start_matches("identity.")),
                error.problem(),
            );
            None
        }
    };
    let plan_header = match &identity.plan_header {
        Some(name) => errors
            .ok(
                "identity.plan_header",
                HeaderName::try_from(name.as_str())
                    .map_err(|_| problem!("`{name}` is not a header name")),
            )
            .map(Some),
        None => Some(None),
    };

    // The identifier has checked the name (and said so under its field).
    let api_key = HeaderName::try_from(identity.api_key.header.as_str()).ok();
    Some(IdentitySettings {
        identifier: Arc::new(identifier?),
        credentials: CredentialHeaders {
            api_key: api_key?,
            authorization,
            token: token_header.filter(|header| *header != http::header::AUTHORIZATION),
        },
        plan_header: plan_header?,
        jwt: jwt?,
        key_file: identity
            .jwt
            .as_ref()
            .and_then(|jwt| jwt.jwks_file.as_ref().or(jwt.secret_file.as_ref()))
            .map(|file| base.join(file)),
    })
}

/// `clients.default_plan` and `clients.anonymous_plan`, which must name plans when any are
/// defined.
pub(super) fn default_plans(
    errors: &mut Errors,
    clients: &RawClients,
    plans: &BTreeMap<String, RawPlan>,
) {
    if plans.is_empty() {
        return;
    }
    for (field, plan) in [
        ("clients.default_plan", &clients.default_plan),
        ("clients.anonymous_plan", &clients.anonymous_plan),
    ] {
        if !plans.contains_key(plan) {
            errors.push(field, format!("plan `{plan}` is not defined under plans"));
        }
    }
}

/// `clients.api_keys`: plan by key digest; every plan named must exist.
pub(super) fn api_keys(
    errors: &mut Errors,
    clients: &RawClients,
    plans: &BTreeMap<String, RawPlan>,
) -> HashMap<[u8; 32], String> {
    let mut api_keys = HashMap::new();
    for (key, plan) in &clients.api_keys {
        // The path names the key by its hash: error messages must not print secrets.
        let shown = if key.starts_with("sha256:") {
            key.clone()
        } else {
            format!("sha256:{}…", &hex(&key_digest(key))[..12])
        };
        let path = format!("clients.api_keys[{shown}]");
        if let Some(digest) = errors.ok(path.clone(), key_entry(key)) {
            api_keys.insert(digest, plan.clone());
        }
        if !plans.contains_key(plan) {
            errors.push(path, format!("plan `{plan}` is not defined under plans"));
        }
    }

    api_keys
}

#[cfg(test)]
mod tests {
    use crate::config::*;

    #[test]
    fn keys_may_be_given_as_hashes_and_are_redacted() {
        let config = parse(
            "plans: { free: {}, anonymous: {}, gold: {} }\nclients:\n  api_keys:\n    \"secret-1\": gold\n    \"sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\": gold\n",
        )
        .unwrap();
        assert_eq!(
            config
                .api_keys
                .get(&key_digest("secret-1"))
                .map(String::as_str),
            Some("gold")
        );
        assert_eq!(
            config.api_keys.get(&key_digest("test")).map(String::as_str),
            Some("gold"),
            "sha256 of `test`"
        );
        let redacted = config.redacted.to_string();
        assert!(!redacted.contains("secret-1"), "{redacted}");
    }
}
