//! One client as an operator names it (`/admin/clients?api_key=K`, SPEC §7): who it is, which
//! plan it gets, and the checks a request of it would meet, worked out the way the request path
//! works them out ([`crate::client::resolve`], [`GatewayPlan::client_checks`]).

use std::net::IpAddr;
use std::sync::Arc;

use floodgate::key::{IdentityHash, IdentityScope};
use floodgate::{Identity, store::Check};
use http::Method;

use crate::client::{ClientParts, Listed, resolve_parts};
use crate::config::Config;
use crate::plan::{ClientKeys, GatewayPlan};

/// The query of `/admin/clients`: one of `api_key`, `user`, `identity` (with `scope`, default
/// `key`) or `ip` names the client; `ip` alongside another adds its per-IP limits; `plan`
/// overrides the plan (clients whose plan a trusted proxy names). Without `method` and `path`,
/// every limit of the client on every endpoint; with them (either defaults: `GET`, `/`), the
/// limits that request meets, global ceilings included. `limit` keeps one limit name.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClientQuery {
    api_key: Option<String>,
    user: Option<String>,
    identity: Option<String>,
    scope: Option<String>,
    ip: Option<String>,
    plan: Option<String>,
    method: Option<String>,
    path: Option<String>,
    /// Only this limit (inspection, reset).
    pub limit: Option<String>,
    /// The limit an override is about (`/admin/clients/overrides`).
    pub name: Option<String>,
    /// Listing every override: the page after this cursor (the `next` of the page before).
    pub after: Option<String>,
    /// Listing every override: entries per page (default 100, at most 1000).
    pub per_page: Option<usize>,
}

/// Why a query names no client.
#[derive(Debug)]
pub(crate) enum SelectError {
    /// The query is wrong (400).
    BadQuery(String),
    /// An API key the configuration does not know, under `clients.unknown_keys: reject`
    /// (404: such a client is refused, it has no counters).
    UnknownKey,
}

/// A client, resolved.
#[derive(Debug)]
pub(crate) struct Selected {
    /// The identity's hash, as logs and `/admin/top` show it.
    pub hash: IdentityHash,
    /// The identity's scope.
    pub scope: String,
    /// The plan.
    pub plan: Arc<str>,
    /// `allowlist` or `denylist` when a list decides the client's requests (no limit applies).
    pub listed: Option<&'static str>,
    /// The checks a request of it meets, at the request's cost.
    pub checks: Vec<Check>,
}

impl ClientQuery {
    /// Whether the query names a client at all (listing every override names none).
    pub(crate) fn names_a_client(&self) -> bool {
        self.api_key.is_some()
            || self.user.is_some()
            || self.identity.is_some()
            || self.ip.is_some()
    }

    /// Checks the selectors against each other and `config`: one client named, `scope` only
    /// with `identity`, a `plan` that exists; the exact IP if one is given.
    fn checked_selectors(&self, config: &Config) -> Result<Option<IpAddr>, SelectError> {
        let bad = |message: &str| Err(SelectError::BadQuery(message.to_owned()));
        let exact_ip = match &self.ip {
            Some(text) => match text.trim().parse::<IpAddr>() {
                Ok(ip) => Some(ip),
                Err(_) => return bad("ip: not an IP address"),
            },
            None => None,
        };
        let named = [&self.api_key, &self.user, &self.identity]
            .iter()
            .filter(|selector| selector.is_some())
            .count();
        if named > 1 {
            return bad("name the client by one of api_key, user and identity");
        }
        if named == 0 && exact_ip.is_none() {
            return bad("name the client: api_key, user, identity or ip");
        }
        if self.scope.is_some() && self.identity.is_none() {
            return bad("scope: only with identity");
        }
        if self
            .plan
            .as_ref()
            .is_some_and(|plan| !config.plans.contains_key(plan))
        {
            return bad("plan: no such plan");
        }
        Ok(exact_ip)
    }

    /// The request named by `method` and `path` (GET and `/` when either is left out).
    fn named_request(&self) -> Result<(Method, &str), SelectError> {
        let bad = |message: &str| Err(SelectError::BadQuery(message.to_owned()));
        let method = match &self.method {
            Some(text) => match Method::from_bytes(text.to_ascii_uppercase().as_bytes()) {
                Ok(method) => method,
                Err(_) => return bad("method: not an HTTP method"),
            },
            None => Method::GET,
        };
        let path = self.path.as_deref().unwrap_or("/");
        if !path.starts_with('/') {
            return bad("path: must start with /");
        }
        Ok((method, path))
    }

    /// Resolves the client and the checks of `method path` under `config`.
    pub(crate) fn select(&self, config: &Arc<Config>) -> Result<Selected, SelectError> {
        let bad = |message: &str| Err(SelectError::BadQuery(message.to_owned()));
        let exact_ip = self.checked_selectors(config)?;
        // Resolved as the client's requests are (`identity=` names one by its hash only).
        let parts = ClientParts {
            api_key: self.api_key.as_deref(),
            user: self.user.as_deref(),
            exact_ip,
            named_plan: self.plan.as_deref(),
        };
        let Some(resolved) = resolve_parts(config, parts) else {
            return Err(SelectError::UnknownKey);
        };
        let listed = resolved.listed.map(Listed::as_str);
        let client_ip = resolved.client_ip;
        let identity = match resolved.identity {
            // An unknown key counted by IP, named without its IP.
            Identity::Unknown if self.api_key.is_some() => {
                return bad("this key is unknown and counted by IP: add ip");
            }
            _ if self.identity.is_some() => None,
            Identity::Unknown => None,
            identity => Some(identity),
        };
        let (hash, scope) = match (&identity, &self.identity) {
            (Some(identity), _) => (identity.hash(), identity.scope().to_owned()),
            (None, Some(hex)) => {
                let Some(hash) = parse_hash(hex) else {
                    return bad("identity: 32 hexadecimal digits, as /admin/top shows");
                };
                let scope = match self.scope.as_deref() {
                    None => IdentityScope::ApiKey,
                    Some(name) => match name.parse::<IdentityScope>() {
                        Ok(scope) => scope,
                        Err(_) => return bad("scope: one of key, user, ip, unknown"),
                    },
                };
                (hash, scope.as_str().to_owned())
            }
            (None, None) => return bad("name the client: api_key, user, identity or ip"),
        };
        // `plan=` names the plan outright (a client whose plan a trusted proxy names); a client
        // named by its hash alone gets its scope's default plan.
        let plan: &str = match (&self.plan, &identity) {
            (Some(plan), _) => plan,
            (None, Some(_)) => &resolved.plan,
            (None, None)
                if scope
                    .parse::<IdentityScope>()
                    .is_ok_and(IdentityScope::is_anonymous) =>
            {
                &config.anonymous_plan
            }
            (None, None) => &config.default_plan,
        };
        let keys = match &identity {
            Some(identity) => ClientKeys::Identity(identity),
            None => ClientKeys::Hashed {
                hash,
                scope: &scope,
            },
        };
        if self.method.is_none() && self.path.is_none() {
            // No request named: every limit of the client, on every endpoint.
            let checks = if listed.is_some() {
                Vec::new()
            } else {
                GatewayPlan::new(config.clone()).all_client_checks(client_ip, plan, keys)
            };
            return Ok(Selected {
                hash,
                scope,
                plan: Arc::from(plan),
                listed,
                checks,
            });
        }
        let (method, path) = self.named_request()?;
        let checks = if listed.is_some() {
            Vec::new()
        } else {
            // What a request there is charged up front (a route with an estimate reserves
            // its estimate_max).
            let cost = config
                .routes
                .find(&method, path)
                .map_or(1, |(_, route)| route.up_front_cost());
            GatewayPlan::new(config.clone())
                .client_checks(&method, path, client_ip, plan, keys, cost)
        };
        Ok(Selected {
            hash,
            scope,
            plan: Arc::from(plan),
            listed,
            checks,
        })
    }
}

impl Selected {
    /// The client's hash tag, `<scope>:<hash>`, as in its storage keys.
    pub(crate) fn tag(&self) -> String {
        format!("{}:{}", self.scope, self.hash)
    }

    /// The check of the limit `name` of the client's plan (what an override replaces), among
    /// every check of the client ([`ClientQuery::select`] without a request).
    pub(crate) fn plan_limit(&self, config: &Config, name: &str) -> Option<&Check> {
        let plan = config.plans.get(&*self.plan)?;
        self.checks
            .iter()
            .find(|check| check.rule == plan.rule && check.limit.name() == name)
    }
}

/// 32 hex digits.
fn parse_hash(hex: &str) -> Option<IdentityHash> {
    let hex = hex.trim().as_bytes();
    if hex.len() != 32 {
        return None;
    }
    let mut bytes = [0u8; 16];
    for (index, pair) in hex.chunks_exact(2).enumerate() {
        let text = std::str::from_utf8(pair).ok()?;
        bytes[index] = u8::from_str_radix(text, 16).ok()?;
    }
    Some(IdentityHash(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_round_trip_through_their_hex_form() {
        let hash = Identity::ApiKey("k".into()).hash();
        assert_eq!(parse_hash(&hash.to_string()), Some(hash));
        assert_eq!(parse_hash("xyz"), None);
        assert_eq!(parse_hash(&"g".repeat(32)), None);
    }
}
