//! The client's IP address: the socket peer, unless that peer is a trusted proxy, in which case
//! the forwarding chain is walked from the right past trusted proxies.
//!
//! Only the right end of a chain can be trusted: every proxy appends the address it saw, so
//! entries left of the first untrusted hop were written by the client and may be forged.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::HeaderMap;
use http::header::{FORWARDED, HeaderName};
use ipnet::IpNet;

/// How many hops of a forwarding chain are looked at, from the right. A chain longer than any
/// real proxy path is an attack, and walking it would cost time per request.
const MAX_HOPS: usize = 32;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The one forwarding header family that the trusted proxies write (SPEC §3).
///
/// Only one family can be believed: a proxy appends to the header it writes and passes the
/// other through untouched, so the other one holds whatever the client put there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (nginx, HAProxy, cloud load balancers).
    #[default]
    XForwardedFor,
    /// `Forwarded: for=client, for=proxy1` (RFC 7239).
    Forwarded,
}

impl ForwardedHeader {
    /// The configuration spelling: `x-forwarded-for` or `forwarded`.
    pub fn as_str(self) -> &'static str {
        match self {
            ForwardedHeader::XForwardedFor => "x-forwarded-for",
            ForwardedHeader::Forwarded => "forwarded",
        }
    }

    fn header_name(self) -> &'static HeaderName {
        match self {
            ForwardedHeader::XForwardedFor => &X_FORWARDED_FOR,
            ForwardedHeader::Forwarded => &FORWARDED,
        }
    }
}

impl std::str::FromStr for ForwardedHeader {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "x-forwarded-for" => Ok(ForwardedHeader::XForwardedFor),
            "forwarded" => Ok(ForwardedHeader::Forwarded),
            other => Err(format!(
                "`{other}` is not a forwarding header family: expected x-forwarded-for or forwarded"
            )),
        }
    }
}

/// Resolves client IPs from the peer address and forwarding headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientIpResolver {
    trusted_proxies: Vec<IpNet>,
    ipv6_prefix: u8,
    forwarded: ForwardedHeader,
}

impl Default for ClientIpResolver {
    fn default() -> Self {
        ClientIpResolver {
            trusted_proxies: Vec::new(),
            ipv6_prefix: 64,
            forwarded: ForwardedHeader::default(),
        }
    }
}

impl ClientIpResolver {
    /// A resolver trusting `trusted_proxies` and grouping IPv6 clients by `/ipv6_prefix`
    /// (clamped to 0..=128); it reads `X-Forwarded-For` (see [`with_forwarded`](Self::with_forwarded)).
    pub fn new(trusted_proxies: Vec<IpNet>, ipv6_prefix: u8) -> Self {
        ClientIpResolver {
            trusted_proxies,
            ipv6_prefix: ipv6_prefix.min(128),
            forwarded: ForwardedHeader::default(),
        }
    }

    /// The header family the trusted proxies write; the other family is ignored.
    pub fn with_forwarded(mut self, forwarded: ForwardedHeader) -> Self {
        self.forwarded = forwarded;
        self
    }

    /// The trusted proxies.
    pub fn trusted_proxies(&self) -> &[IpNet] {
        &self.trusted_proxies
    }

    /// The prefix length by which IPv6 clients are grouped.
    pub fn ipv6_prefix(&self) -> u8 {
        self.ipv6_prefix
    }

    /// The header family that is read.
    pub fn forwarded(&self) -> ForwardedHeader {
        self.forwarded
    }

    /// Whether `ip` is one of the trusted proxies.
    pub fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.trusted_proxies.iter().any(|net| net.contains(&ip))
    }

    /// The client address for a request from `peer` with `headers`, before IPv6 grouping.
    ///
    /// The chain is walked from its right end, at most 32 entries, without reading
    /// (or allocating for) the part left of them. Entries are parsed as bytes, one at a time,
    /// so a byte that is not UTF-8 spoils only the entry it is in.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = canonical(peer);
        if !self.is_trusted(peer) {
            return peer;
        }
        let parse: fn(&[u8]) -> Option<IpAddr> = match self.forwarded {
            ForwardedHeader::XForwardedFor => parse_node,
            ForwardedHeader::Forwarded => forwarded_for,
        };
        let hops = headers
            .get_all(self.forwarded.header_name())
            .iter()
            .rev()
            .flat_map(|value| value.as_bytes().rsplit(|&byte| byte == b','))
            .take(MAX_HOPS);
        let mut client = peer;
        for hop in hops {
            match parse(hop) {
                Some(ip) => {
                    client = canonical(ip);
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

/// The `for=` address of one `Forwarded` element (`for=192.0.2.60;proto=http`). `None` for an
/// element without one, or one that is not an address (`unknown`, an obfuscated identifier).
fn forwarded_for(element: &[u8]) -> Option<IpAddr> {
    element.split(|&byte| byte == b';').find_map(|pair| {
        let equals = pair.iter().position(|&byte| byte == b'=')?;
        let (name, value) = (&pair[..equals], &pair[equals + 1..]);
        if !name.trim_ascii().eq_ignore_ascii_case(b"for") {
            return None;
        }
        let value = value.trim_ascii();
        let unquoted = value
            .strip_prefix(b"\"")
            .and_then(|rest| rest.strip_suffix(b"\""))
            .unwrap_or(value);
        parse_node(unquoted)
    })
}

/// An address as proxies write it: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1`, `[2001:db8::1]`,
/// `[2001:db8::1]:443`. Bytes that are not UTF-8 make it unreadable.
fn parse_node(node: &[u8]) -> Option<IpAddr> {
    let node = std::str::from_utf8(node.trim_ascii()).ok()?;
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
    fn a_client_written_forwarded_header_is_ignored_by_default() {
        // Regression: `Forwarded` used to win over `X-Forwarded-For`, so a client
        // behind nginx (which appends to X-Forwarded-For and passes Forwarded through) chose
        // its own address.
        let chain = headers(&[
            ("forwarded", "for=6.6.6.6"),
            ("x-forwarded-for", "198.51.100.7"),
        ]);
        assert_eq!(
            resolver().client_ip(ip("10.0.0.1"), &chain),
            ip("198.51.100.7")
        );
        let only_forwarded = headers(&[("forwarded", "for=6.6.6.6")]);
        assert_eq!(
            resolver().client_ip(ip("10.0.0.1"), &only_forwarded),
            ip("10.0.0.1"),
            "no X-Forwarded-For: the trusted proxy itself is the nearest known client"
        );
    }

    #[test]
    fn the_forwarded_family_reads_rfc_7239_and_ignores_x_forwarded_for() {
        let rfc = resolver().with_forwarded(ForwardedHeader::Forwarded);
        let chain = headers(&[
            ("x-forwarded-for", "9.9.9.9"),
            (
                "forwarded",
                "for=6.6.6.6, for=\"[2001:db8:cafe::17]:4711\";proto=https, For=10.0.0.3",
            ),
        ]);
        assert_eq!(
            rfc.client_ip(ip("10.0.0.1"), &chain),
            ip("2001:db8:cafe::17")
        );
        let only_xff = headers(&[("x-forwarded-for", "9.9.9.9")]);
        assert_eq!(rfc.client_ip(ip("10.0.0.1"), &only_xff), ip("10.0.0.1"));
    }

    #[test]
    fn a_byte_that_is_not_utf8_spoils_only_its_own_entry() {
        // Regression: invalid UTF-8 anywhere made the whole header unreadable,
        // so the client was counted as the trusted proxy.
        let mut chain = HeaderMap::new();
        chain.append(
            "x-forwarded-for",
            HeaderValue::from_bytes(b"\xff\xfe, 198.51.100.7, 10.0.0.2").unwrap(),
        );
        assert_eq!(
            resolver().client_ip(ip("10.0.0.1"), &chain),
            ip("198.51.100.7")
        );
        let mut bad_right = HeaderMap::new();
        bad_right.append(
            "x-forwarded-for",
            HeaderValue::from_bytes(b"198.51.100.7, 10.0.0.\xff").unwrap(),
        );
        assert_eq!(
            resolver().client_ip(ip("10.0.0.1"), &bad_right),
            ip("10.0.0.1"),
            "an unreadable entry a trusted proxy wrote stops the walk at that proxy"
        );
    }

    #[test]
    fn only_the_rightmost_hops_are_walked() {
        let mut long = "198.51.100.7, ".to_owned();
        long.push_str(&vec!["10.0.0.9"; MAX_HOPS].join(", "));
        let chain = headers(&[("x-forwarded-for", Box::leak(long.into_boxed_str()))]);
        assert_eq!(
            resolver().client_ip(ip("10.0.0.1"), &chain),
            ip("10.0.0.9"),
            "the client beyond the cap is never reached"
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
