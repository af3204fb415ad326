//! Who a request is from, and which plan applies: decided once per request, before the limits.

use std::net::IpAddr;
use std::sync::Arc;

use floodgate::{Identity, RequestInfo};

use crate::config::{Config, RouteTable, RouteTarget, UnknownKeys, key_digest};
use crate::credentials::Ambiguity;
use crate::token::{InvalidToken, Token};

/// The resolved client, carried as a request extension to the limit plan.
#[derive(Clone, Debug)]
pub(crate) struct ResolvedClient {
    /// Who the plan's limits count against.
    pub identity: Identity,
    /// The plan's name.
    pub plan: Arc<str>,
    /// The client's IP (for `per_ip`), when the peer is known.
    pub client_ip: Option<IpAddr>,
    /// Allowlisted, or limiting switched off: no limit applies, no store call is made.
    pub bypass: bool,
    /// The request's route in its configuration's `routes` ([`RouteTable::find_index`]),
    /// found once for the limiter's cost and the proxy's upstream.
    pub route: Option<usize>,
    /// Limited as anonymous because its token was refused (`invalid_token: anonymous`): its
    /// credentials are taken off before it is forwarded, so that the upstream does not trust
    /// what the gateway did not.
    pub anonymized: bool,
    /// Identified by a verified token: an API key beside it, which the token won over, is
    /// taken off before it is forwarded.
    pub token_verified: bool,
    /// The `adaptive_concurrency` class the verified token names (`identity.jwt.class_claim`).
    pub token_class: Option<Arc<str>>,
}

/// What to do with a request.
#[derive(Debug)]
pub(crate) enum Resolution {
    /// Credentials the upstream could read otherwise than the gateway (two of them, or a
    /// token in the query): 400 `invalid_request`.
    InvalidRequest(Ambiguity),
    /// Denylisted: 403.
    Denied,
    /// An API key not in `clients.api_keys`, under `clients.unknown_keys: reject`: 401.
    UnknownKey,
    /// A token `identity.jwt` does not trust, under `invalid_token: reject`: 401.
    InvalidToken,
    /// Go on with this client.
    Client(ResolvedClient),
}

/// Who names a client: what a request carries, or what an operator's query gives
/// ([`crate::admin::inspect`]). Both resolve through [`resolve_parts`], so an inspection
/// resolves a client exactly as its requests are.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ClientParts<'a> {
    /// The API key.
    pub api_key: Option<&'a str>,
    /// The user id (ignored next to an API key, as a request's is).
    pub user: Option<&'a str>,
    /// The exact client address (lists match it; limits count its group).
    pub exact_ip: Option<IpAddr>,
    /// A plan named besides the key's own (a trusted proxy's header, an operator's `plan=`):
    /// used when it names a plan and the key has none of its own.
    pub named_plan: Option<&'a str>,
}

/// Which list, if any, decides a client's requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Listed {
    /// Refused with 403.
    Denylist,
    /// No limit applies.
    Allowlist,
}

impl Listed {
    /// `denylist` or `allowlist`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Listed::Denylist => "denylist",
            Listed::Allowlist => "allowlist",
        }
    }
}

/// A client, resolved from its parts.
#[derive(Clone, Debug)]
pub(crate) struct ResolvedParts {
    /// Who the plan's limits count against.
    pub identity: Identity,
    /// The plan's name.
    pub plan: Arc<str>,
    /// The client's IP grouped as limits count it (for `per_ip`), when known.
    pub client_ip: Option<IpAddr>,
    /// The list that decides its requests, if any.
    pub listed: Option<Listed>,
}

/// Resolves a client from its parts under `config`: `None` for an API key not in
/// `clients.api_keys` under `clients.unknown_keys: reject` (a listed client is resolved all
/// the same: its list decides first).
pub(crate) fn resolve_parts(config: &Config, parts: ClientParts<'_>) -> Option<ResolvedParts> {
    let key_digest = parts.api_key.map(key_digest);
    let user = if parts.api_key.is_none() {
        parts.user
    } else {
        None
    };
    let client_ip = parts
        .exact_ip
        .map(|ip| config.identity.identifier.client_ip().group(ip));
    // Lists match the exact address (SPEC §3); limits count the grouped one.
    let listed = if config
        .denylist
        .contains(parts.exact_ip, key_digest.as_ref(), user)
    {
        Some(Listed::Denylist)
    } else if config
        .allowlist
        .contains(parts.exact_ip, key_digest.as_ref(), user)
    {
        Some(Listed::Allowlist)
    } else {
        None
    };
    let known_plan = key_digest
        .as_ref()
        .and_then(|digest| config.api_keys.get(digest));
    let api_key = match (parts.api_key, known_plan, config.unknown_keys) {
        (Some(_), None, UnknownKeys::Reject) if listed.is_none() => return None,
        (Some(_), None, UnknownKeys::Anonymous) => None,
        _ => parts.api_key,
    };
    let named_plan = parts
        .named_plan
        .filter(|plan| config.plans.contains_key(*plan));
    let (identity, plan) = match (api_key, user, client_ip) {
        (Some(key), _, _) => {
            let plan = known_plan
                .map(String::as_str)
                .or(named_plan)
                .unwrap_or(&config.default_plan);
            (Identity::ApiKey(key.to_owned()), plan)
        }
        (None, Some(user), _) => (
            Identity::User(user.to_owned()),
            named_plan.unwrap_or(&config.default_plan),
        ),
        (None, None, Some(ip)) => (Identity::Ip(ip), config.anonymous_plan.as_str()),
        (None, None, None) => (Identity::Unknown, config.anonymous_plan.as_str()),
    };
    Some(ResolvedParts {
        identity,
        plan: Arc::from(plan),
        client_ip,
        listed,
    })
}

/// Resolves the client of `request` under `config`.
pub(crate) fn resolve(config: &Config, request: &RequestInfo<'_>) -> Resolution {
    if let Err(ambiguity) = config.identity.credentials.check(request) {
        return Resolution::InvalidRequest(ambiguity);
    }
    let identifier = &config.identity.identifier;
    let exact_ip = identifier.exact_client_ip(request);
    let token = match &config.identity.jwt {
        Some(verifier) => verifier.check(request.headers),
        None => Token::Absent,
    };
    if !matches!(token, Token::Absent) {
        let result = match &token {
            Token::Refused(problem) => problem.as_str(),
            _ => "verified",
        };
        metrics::counter!(crate::telemetry::TOKENS_TOTAL, "result" => result).increment(1);
    }
    let parts = match &token {
        // A verified token names the client (as a user: SPEC §3) and, signed, its plan.
        Token::Verified { client, plan, .. } => ClientParts {
            api_key: None,
            user: Some(client),
            exact_ip,
            named_plan: plan.as_deref(),
        },
        Token::Refused(_) => match config.identity.jwt.as_ref().map(|jwt| jwt.invalid) {
            Some(InvalidToken::Anonymous) => ClientParts {
                exact_ip,
                ..ClientParts::default()
            },
            _ => return Resolution::InvalidToken,
        },
        Token::Absent => {
            let api_key = identifier.api_key(request);
            let user = if api_key.is_none() {
                identifier.user_id(request)
            } else {
                None
            };
            // A plan named by a trusted proxy; honoured only from one.
            let trusted_peer = request
                .peer_addr()
                .is_some_and(|peer| identifier.client_ip().is_trusted(peer.ip()));
            let named_plan = config
                .identity
                .plan_header
                .as_ref()
                .filter(|_| trusted_peer)
                .and_then(|name| request.headers.get(name))
                .and_then(|value| value.to_str().ok());
            ClientParts {
                api_key,
                user,
                exact_ip,
                named_plan,
            }
        }
    };
    let Some(resolved) = resolve_parts(config, parts) else {
        return Resolution::UnknownKey;
    };
    if resolved.listed == Some(Listed::Denylist) {
        return Resolution::Denied;
    }
    Resolution::Client(ResolvedClient {
        identity: resolved.identity,
        plan: resolved.plan,
        client_ip: resolved.client_ip,
        bypass: resolved.listed == Some(Listed::Allowlist),
        route: config.routes.find_index(request.method, request.uri.path()),
        anonymized: matches!(token, Token::Refused(_)),
        token_verified: matches!(token, Token::Verified { .. }),
        token_class: match &token {
            Token::Verified { class, .. } => class.as_deref().map(Arc::from),
            _ => None,
        },
    })
}

impl ResolvedClient {
    /// The route `request` was resolved with, from its `ResolvedClient` (or, for a request
    /// without one, found in `routes`).
    pub(crate) fn route_of<'c>(
        routes: &'c RouteTable<RouteTarget>,
        extensions: &http::Extensions,
        method: &http::Method,
        path: &str,
    ) -> Option<&'c RouteTarget> {
        let index = match extensions.get::<ResolvedClient>() {
            Some(client) => client.route?,
            None => routes.find_index(method, path)?,
        };
        routes.entry(index).map(|(_, route)| route)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resolved_route_is_looked_up_by_its_index_not_found_again() {
        let config = crate::config::parse(
            "routes:\n  - { match: \"POST /v1/chat\", cost: 5 }\n  - { match: \"/v1/{*rest}\", cost: 2 }\n",
        )
        .unwrap();
        let routes = &config.routes;
        let chat = routes.find_index(&http::Method::POST, "/v1/chat");
        assert_eq!(
            chat.and_then(|index| routes.entry(index))
                .map(|(_, route)| route.cost),
            Some(Some(5))
        );
        let mut extensions = http::Extensions::new();
        // No resolved client: found from the method and path.
        let found = ResolvedClient::route_of(routes, &extensions, &http::Method::GET, "/v1/x");
        assert_eq!(found.and_then(|route| route.cost), Some(2));
        // A resolved client: its route, whatever the method and path say now.
        extensions.insert(ResolvedClient {
            identity: Identity::Unknown,
            plan: Arc::from("free"),
            client_ip: None,
            bypass: false,
            route: chat,
            anonymized: false,
            token_verified: false,
            token_class: None,
        });
        let resolved = ResolvedClient::route_of(routes, &extensions, &http::Method::GET, "/v1/x");
        assert_eq!(resolved.and_then(|route| route.cost), Some(5));
        extensions.insert(ResolvedClient {
            identity: Identity::Unknown,
            plan: Arc::from("free"),
            client_ip: None,
            bypass: false,
            route: None,
            anonymized: false,
            token_verified: false,
            token_class: None,
        });
        assert!(
            ResolvedClient::route_of(routes, &extensions, &http::Method::GET, "/v1/x").is_none()
        );
    }
}
