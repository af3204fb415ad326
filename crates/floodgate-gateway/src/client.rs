//! Who a request is from, and which plan applies: decided once per request, before the limits.

use std::net::IpAddr;
use std::sync::Arc;

use floodgate::{Identity, RequestInfo};

use crate::config::{Config, UnknownKeys, key_digest};

/// The resolved client, carried as a request extension to the limit plan.
#[derive(Clone, Debug)]
pub struct ResolvedClient {
    /// Who the plan's limits count against.
    pub identity: Identity,
    /// The plan's name.
    pub plan: Arc<str>,
    /// The client's IP (for `per_ip`), when the peer is known.
    pub client_ip: Option<IpAddr>,
    /// Allowlisted, or limiting switched off: no limit applies, no store call is made.
    pub bypass: bool,
}

/// What to do with a request.
#[derive(Debug)]
pub enum Resolution {
    /// Denylisted: 403.
    Denied,
    /// An API key not in `clients.api_keys`, under `clients.unknown_keys: reject`: 401.
    UnknownKey,
    /// Go on with this client.
    Client(ResolvedClient),
}

/// Resolves the client of `request` under `config`.
pub fn resolve(config: &Config, request: &RequestInfo<'_>) -> Resolution {
    let identifier = &config.identity.identifier;
    let api_key = identifier.api_key(request);
    let key_digest = api_key.map(key_digest);
    let user = if api_key.is_none() {
        identifier.user_id(request)
    } else {
        None
    };
    // Lists match the exact address (SPEC §3); limits count the grouped one.
    let exact_ip = identifier.exact_client_ip(request);
    let client_ip = exact_ip.map(|ip| identifier.client_ip().group(ip));
    if config
        .denylist
        .contains(exact_ip, key_digest.as_ref(), user)
    {
        return Resolution::Denied;
    }
    let bypass = config
        .allowlist
        .contains(exact_ip, key_digest.as_ref(), user);
    let known_plan = key_digest
        .as_ref()
        .and_then(|digest| config.api_keys.get(digest));
    let api_key = match (api_key, known_plan, config.unknown_keys) {
        (Some(_), None, UnknownKeys::Reject) if !bypass => return Resolution::UnknownKey,
        (Some(_), None, UnknownKeys::Anonymous) => None,
        _ => api_key,
    };

    // A plan named by a trusted proxy; honoured only from one.
    let trusted_peer = request
        .peer_addr()
        .is_some_and(|peer| identifier.client_ip().is_trusted(peer.ip()));
    let header_plan = config
        .identity
        .plan_header
        .as_ref()
        .filter(|_| trusted_peer)
        .and_then(|name| request.headers.get(name))
        .and_then(|value| value.to_str().ok())
        .filter(|plan| config.plans.contains_key(*plan));

    let (identity, plan) = match (api_key, user, client_ip) {
        (Some(key), _, _) => {
            let plan = known_plan
                .map(String::as_str)
                .or(header_plan)
                .unwrap_or(&config.default_plan);
            (Identity::ApiKey(key.to_owned()), plan)
        }
        (None, Some(user), _) => (
            Identity::User(user.to_owned()),
            header_plan.unwrap_or(&config.default_plan),
        ),
        (None, None, Some(ip)) => (Identity::Ip(ip), config.anonymous_plan.as_str()),
        (None, None, None) => (Identity::Unknown, config.anonymous_plan.as_str()),
    };
    Resolution::Client(ResolvedClient {
        identity,
        plan: Arc::from(plan),
        client_ip,
        bypass,
    })
}
