//! Allowlist and denylist: clients that bypass every limit (without a store call), and clients
//! refused with 403.

use std::collections::HashSet;
use std::net::IpAddr;

use ipnet::IpNet;
use sha2::{Digest, Sha256};

use crate::key::Identity;

/// A set of clients by IP network, API key (held as SHA-256, so no secret is kept) and user id.
#[derive(Clone, Debug, Default)]
pub struct ClientList {
    ips: Vec<IpNet>,
    api_keys: HashSet<[u8; 32]>,
    users: HashSet<String>,
}

/// SHA-256 of an API key, the form in which lists hold keys.
pub fn api_key_digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl ClientList {
    /// An empty list.
    pub fn new() -> Self {
        ClientList::default()
    }

    /// Adds a network (or a single address as a /32 or /128).
    pub fn ip(mut self, network: IpNet) -> Self {
        self.ips.push(network);
        self
    }

    /// Adds an API key.
    pub fn api_key(self, key: &str) -> Self {
        self.api_key_digest(api_key_digest(key))
    }

    /// Adds an API key by its SHA-256 (as configuration files write `sha256:<hex>`).
    pub fn api_key_digest(mut self, digest: [u8; 32]) -> Self {
        self.api_keys.insert(digest);
        self
    }

    /// Adds a user id.
    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.users.insert(user.into());
        self
    }

    /// Whether the list is empty (then checking it costs nothing).
    pub fn is_empty(&self) -> bool {
        self.ips.is_empty() && self.api_keys.is_empty() && self.users.is_empty()
    }

    /// Whether a client with this IP, API key digest or user id is on the list.
    pub fn contains(
        &self,
        ip: Option<IpAddr>,
        api_key: Option<&[u8; 32]>,
        user: Option<&str>,
    ) -> bool {
        ip.is_some_and(|ip| self.ips.iter().any(|network| network.contains(&ip)))
            || api_key.is_some_and(|digest| self.api_keys.contains(digest))
            || user.is_some_and(|user| self.users.contains(user))
    }

    /// Whether the client identified as `identity`, at the exact address `ip`, is on the list.
    ///
    /// `ip` is the client's own address (after the trusted-proxy walk, before IPv6 grouping),
    /// so that a single-address entry matches that address only, and a proxy's range never
    /// stands for the clients behind it. Without it, an [`Identity::Ip`] is matched as is.
    pub fn contains_identity(&self, identity: &Identity, ip: Option<IpAddr>) -> bool {
        if self.is_empty() {
            return false;
        }
        let (ip, key, user) = match identity {
            Identity::Ip(address) => (ip.or(Some(*address)), None, None),
            Identity::ApiKey(key) => (ip, Some(api_key_digest(key)), None),
            Identity::User(user) => (ip, None, Some(user.as_str())),
            Identity::Custom { .. } | Identity::Unknown => (ip, None, None),
        };
        self.contains(ip, key.as_ref(), user)
    }
}
