//! The client's IP address: the socket peer, unless that peer is a trusted proxy, in which case
//! the forwarding chain is walked from the right past trusted proxies.
//!
//! Only the right end of a chain can be trusted: every proxy appends the address it saw, so
//! entries left of the first untrusted hop were written by the client and may be forged.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::HeaderMap;
use http::header::FORWARDED;
use ipnet::IpNet;

/// How many hops of a forwarding chain are looked at, from the right. A chain longer than any
/// real proxy path is an attack, and walking it would cost time per request.
const MAX_HOPS: usize = 32;

const X_FORWARDED_FOR: &str = "x-forwarded-for";

/// Resolves client IPs from the peer address and forwarding headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientIpResolver {
    trusted_proxies: Vec<IpNet>,
    ipv6_prefix: u8,
}

impl Default for ClientIpResolver {
    fn default() -> Self {
        ClientIpResolver {
            trusted_proxies: Vec::new(),
            ipv6_prefix: 64,
        }
    }
}

impl ClientIpResolver {
    /// A resolver trusting `trusted_proxies` and grouping IPv6 clients by `/ipv6_prefix`
    /// (clamped to 0..=128).
    pub fn new(trusted_proxies: Vec<IpNet>, ipv6_prefix: u8) -> Self {
        ClientIpResolver {
            trusted_proxies,
            ipv6_prefix: ipv6_prefix.min(128),
        }
    }

    /// The trusted proxies.
    pub fn trusted_proxies(&self) -> &[IpNet] {
        &self.trusted_proxies
    }

    /// The prefix length by which IPv6 clients are grouped.
    pub fn ipv6_prefix(&self) -> u8 {
        self.ipv6_prefix
    }

    /// Whether `ip` is one of the trusted proxies.
    pub fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.trusted_proxies.iter().any(|net| net.contains(&ip))
    }

    /// The client address for a request from `peer` with `headers`, before IPv6 grouping.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = canonical(peer);
        if !self.is_trusted(peer) {
            return peer;
        }
        let hops = forwarding_chain(headers);
        let mut client = peer;
        for hop in hops.iter().rev().take(MAX_HOPS) {
            match hop {
                Some(ip) => {
                    client = canonical(*ip);
                    if !self.is_trusted(client) {
                        return client;
                    }
                }
                // An entry a trusted proxy wrote but we cannot read: the nearest address we
                // could vouch for is the proxy that sent it.
                None => return client,
            }
        }
        client
    }

    /// The address under which the client is counted: IPv6 addresses are grouped by prefix,
    /// since one subscriber usually holds a whole /64.
    pub fn group(&self, ip: IpAddr) -> IpAddr {
        match canonical(ip) {
            IpAddr::V6(v6) => {
                let bits = u128::from(v6);
                let mask = match self.ipv6_prefix {
                    0 => 0,
                    prefix => u128::MAX << (128 - u32::from(prefix)),
                };
                IpAddr::V6(Ipv6Addr::from(bits & mask))
            }
            v4 => v4,
        }
    }
}

/// IPv4-mapped IPv6 addresses (`::ffff:1.2.3.4`, as dual-stack sockets report them) are IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The forwarding chain, left (client side) to right (nearest proxy). `Forwarded` (RFC 7239)
/// wins over `X-Forwarded-For` when present. `None` marks an entry that is not an address
/// (`unknown`, an obfuscated identifier, garbage).
fn forwarding_chain(headers: &HeaderMap) -> Vec<Option<IpAddr>> {
    if headers.contains_key(FORWARDED) {
        headers
            .get_all(FORWARDED)
            .iter()
            .flat_map(|value| match value.to_str() {
                Ok(text) => text.split(',').map(forwarded_for).collect::<Vec<_>>(),
                Err(_) => vec![None],
            })
            .collect()
    } else {
        headers
            .get_all(X_FORWARDED_FOR)
            .iter()
            .flat_map(|value| match value.to_str() {
                Ok(text) => text.split(',').map(parse_node).collect::<Vec<_>>(),
                Err(_) => vec![None],
            })
            .collect()
    }
}

/// The `for=` address of one `Forwarded` element (`for=192.0.2.60;proto=http`).
fn forwarded_for(element: &str) -> Option<IpAddr> {
    element.split(';').find_map(|pair| {
        let (name, value) = pair.split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("for") {
            return None;
        }
        parse_node(value.trim().trim_matches('"'))
    })
}

/// An address as proxies write it: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1`, `[2001:db8::1]`,
/// `[2001:db8::1]:443`.
fn parse_node(node: &str) -> Option<IpAddr> {
    let node = node.trim();
    if let Ok(ip) = node.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(socket) = node.parse::<SocketAddr>() {
        return Some(socket.ip());
    }
    node.strip_prefix('[')
        .and_then(|rest| rest.strip_suffix(']'))
        .and_then(|inner| inner.parse::<IpAddr>().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn resolver() -> ClientIpResolver {
        ClientIpResolver::new(
            vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()],
            64,
        )
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn untrusted_peer_ignores_forwarding_headers() {
        let forged = headers(&[("x-forwarded-for", "1.1.1.1"), ("forwarded", "for=2.2.2.2")]);
        assert_eq!(
            resolver().client_ip(ip("203.0.113.9"), &forged),
            ip("203.0.113.9")
        );
    }

    #[test]
    fn trusted_chain_is_walked_from_the_right() {
        // The client forged "6.6.6.6"; the real client 198.51.100.7 reached proxy 10.0.0.2,
        // which reached proxy 10.0.0.1, our peer.
        let chain = headers(&[("x-forwarded-for", "6.6.6.6, 198.51.100.7, 10.0.0.2")]);
        assert_eq!(
            resolver().client_ip(ip("10.0.0.1"), &chain),
            ip("198.51.100.7")
        );
    }

    #[test]
    fn several_header_lines_form_one_chain() {
        let chain = headers(&[
            ("x-forwarded-for", "6.6.6.6"),
            ("x-forwarded-for", "198.51.100.7:5123, 10.1.2.3"),
        ]);
        assert_eq!(
            resolver().client_ip(ip("10.0.0.1"), &chain),
            ip("198.51.100.7")
        );
    }

    #[test]
    fn forwarded_header_is_preferred_and_parsed() {
        let chain = headers(&[
            ("x-forwarded-for", "9.9.9.9"),
            (
                "forwarded",
                "for=6.6.6.6, for=\"[2001:db8:cafe::17]:4711\";proto=https, For=10.0.0.3",
            ),
        ]);
        assert_eq!(
            resolver().client_ip(ip("10.0.0.1"), &chain),
            ip("2001:db8:cafe::17")
        );
    }

    #[test]
    fn unreadable_entry_stops_at_the_last_trusted_hop() {
        let chain = headers(&[("x-forwarded-for", "198.51.100.7, garbage, 10.0.0.2")]);
        assert_eq!(resolver().client_ip(ip("10.0.0.1"), &chain), ip("10.0.0.2"));
        let obfuscated = headers(&[("forwarded", "for=_hidden")]);
        assert_eq!(
            resolver().client_ip(ip("10.0.0.1"), &obfuscated),
            ip("10.0.0.1")
        );
    }

    #[test]
    fn all_trusted_chain_yields_the_leftmost() {
        let chain = headers(&[("x-forwarded-for", "10.9.9.9, 10.0.0.2")]);
        assert_eq!(resolver().client_ip(ip("10.0.0.1"), &chain), ip("10.9.9.9"));
    }

    #[test]
    fn ipv4_mapped_peers_are_ipv4() {
        assert_eq!(
            resolver().client_ip(
                ip("::ffff:10.0.0.1"),
                &headers(&[("x-forwarded-for", "1.2.3.4")])
            ),
            ip("1.2.3.4")
        );
    }

    #[test]
    fn ipv6_is_grouped_by_prefix() {
        let resolver = resolver();
        assert_eq!(
            resolver.group(ip("2001:db8:1:2:aaaa::1")),
            ip("2001:db8:1:2::")
        );
        assert_eq!(
            resolver.group(ip("2001:db8:1:2:ffff::9")),
            ip("2001:db8:1:2::")
        );
        assert_ne!(resolver.group(ip("2001:db8:1:3::1")), ip("2001:db8:1:2::"));
        assert_eq!(resolver.group(ip("192.0.2.1")), ip("192.0.2.1"));
        let whole = ClientIpResolver::new(Vec::new(), 128);
        assert_eq!(whole.group(ip("2001:db8::1")), ip("2001:db8::1"));
        assert_eq!(
            ClientIpResolver::new(Vec::new(), 0).group(ip("2001:db8::1")),
            ip("::")
        );
    }
}
