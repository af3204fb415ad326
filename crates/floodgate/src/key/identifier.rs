//! Deciding who a request counts against: what an identifier sees of a request
//! ([`RequestInfo`]), the [`IdentifyClient`] trait, and the [`DefaultIdentifier`] of SPEC §3.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use http::header::{AUTHORIZATION, HeaderName};
use http::{Extensions, HeaderMap, Method, Uri};
use ipnet::IpNet;

use super::{ClientIpResolver, ForwardedHeader, Identity};

/// The longest API key or user id accepted; longer values are treated as absent.
pub const MAX_IDENTITY_LEN: usize = 256;

/// What an identifier sees of a request.
#[derive(Clone, Copy, Debug)]
pub struct RequestInfo<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI.
    pub uri: &'a Uri,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// The extensions (connection info, the app's auth results).
    pub extensions: &'a Extensions,
}

impl<'a> RequestInfo<'a> {
    /// A view of `request`.
    pub fn new<B>(request: &'a http::Request<B>) -> Self {
        RequestInfo {
            method: request.method(),
            uri: request.uri(),
            headers: request.headers(),
            extensions: request.extensions(),
        }
    }

    /// The socket peer: [`PeerAddr`], or axum's `ConnectInfo<SocketAddr>`.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        if let Some(PeerAddr(addr)) = self.extensions.get::<PeerAddr>() {
            return Some(*addr);
        }
        #[cfg(feature = "axum")]
        if let Some(axum::extract::ConnectInfo(addr)) = self
            .extensions
            .get::<axum::extract::ConnectInfo<SocketAddr>>()
        {
            return Some(*addr);
        }
        None
    }
}

/// The socket address of the connection's peer, as a request extension. Servers other than
/// axum's `into_make_service_with_connect_info` insert this so the IP identity works.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerAddr(pub SocketAddr);

/// An authenticated user id, as a request extension set by the app's auth layer. Always
/// trusted, unlike the user header.
///
/// The auth layer must run **before** the rate limit layer sees the request. With axum's
/// `Router::layer`, layers added later run first, so add the auth layer after the limit:
/// `Router::new().route(..).layer(limits).layer(auth)`; with `tower::ServiceBuilder`, list the
/// auth layer first. Otherwise the limit sees no `UserId` and counts the client by key or IP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserId(pub String);

/// Decides who a request counts against. Closures `Fn(&RequestInfo) -> Identity` implement it.
pub trait IdentifyClient: Send + Sync + 'static {
    /// The identity of the request's client.
    fn identify(&self, request: &RequestInfo<'_>) -> Identity;

    /// The client's exact address, as allowlists and denylists match it (SPEC §3): after the
    /// trusted-proxy walk, before IPv6 grouping. The default is the socket peer, which is
    /// right only when no proxy stands in front; [`DefaultIdentifier`] walks its trusted
    /// proxies' forwarding header.
    fn client_addr(&self, request: &RequestInfo<'_>) -> Option<IpAddr> {
        request.peer_addr().map(|peer| peer.ip())
    }
}

impl<F> IdentifyClient for F
where
    F: Fn(&RequestInfo<'_>) -> Identity + Send + Sync + 'static,
{
    fn identify(&self, request: &RequestInfo<'_>) -> Identity {
        self(request)
    }
}

impl<T: IdentifyClient> IdentifyClient for Arc<T> {
    fn identify(&self, request: &RequestInfo<'_>) -> Identity {
        (**self).identify(request)
    }

    fn client_addr(&self, request: &RequestInfo<'_>) -> Option<IpAddr> {
        (**self).client_addr(request)
    }
}

/// Why an identity configuration is invalid: [`field`](IdentityError::field) says which
/// setting, [`problem`](IdentityError::problem) what is wrong; the message is `field: problem`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdentityError {
    /// A trusted proxy entry is not an address or CIDR.
    InvalidTrustedProxy {
        /// Position in the list.
        index: usize,
        /// The offending text.
        value: String,
    },
    /// The IPv6 prefix is longer than 128 bits.
    InvalidIpv6Prefix(u8),
    /// A header name is not a valid HTTP header name.
    InvalidHeaderName {
        /// Which setting.
        field: &'static str,
        /// The offending text.
        value: String,
    },
}

impl IdentityError {
    /// The setting the error is about: `trusted_proxies[2]`, `ipv6_prefix`, `api_key_header`, ...
    pub fn field(&self) -> String {
        match self {
            IdentityError::InvalidTrustedProxy { index, .. } => format!("trusted_proxies[{index}]"),
            IdentityError::InvalidIpv6Prefix(_) => "ipv6_prefix".to_owned(),
            IdentityError::InvalidHeaderName { field, .. } => (*field).to_owned(),
        }
    }

    /// What is wrong with it, without its name.
    pub fn problem(&self) -> String {
        match self {
            IdentityError::InvalidTrustedProxy { value, .. } => {
                format!("`{value}` is not an IP address or CIDR")
            }
            IdentityError::InvalidIpv6Prefix(prefix) => {
                format!("must be between 0 and 128, got {prefix}")
            }
            IdentityError::InvalidHeaderName { value, .. } => {
                format!("`{value}` is not a valid header name")
            }
        }
    }
}

impl std::fmt::Display for IdentityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field(), self.problem())
    }
}

impl std::error::Error for IdentityError {}

/// Decides whether an API key is one the application issued; closures `Fn(&str) -> bool`
/// implement it. See [`DefaultIdentifier::verify_api_key`].
pub trait VerifyApiKey: Send + Sync + 'static {
    /// Whether `key` is a known key.
    fn is_known(&self, key: &str) -> bool;
}

impl<F> VerifyApiKey for F
where
    F: Fn(&str) -> bool + Send + Sync + 'static,
{
    fn is_known(&self, key: &str) -> bool {
        self(key)
    }
}

/// The default identifier of SPEC §3.
///
/// **API keys are not verified** unless you say how ([`verify_api_key`](Self::verify_api_key)):
/// any string in the key header is an identity, so a client can invent a fresh key, and get a
/// fresh budget, on every request. Either verify keys here, or also apply a limit by client IP
/// to every request (a second layer keyed with [`Identity::Ip`]).
///
/// Clones share their counters ([`malformed_count`](Self::malformed_count),
/// [`unverified_count`](Self::unverified_count)), so one identifier can serve several layers.
#[derive(Clone)]
pub struct DefaultIdentifier {
    api_key_header: Option<HeaderName>,
    bearer: bool,
    user_header: Option<HeaderName>,
    client_ip: ClientIpResolver,
    verify_api_key: Option<Arc<dyn VerifyApiKey>>,
    malformed: Arc<AtomicU64>,
    unverified: Arc<AtomicU64>,
}

impl fmt::Debug for DefaultIdentifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DefaultIdentifier")
            .field("api_key_header", &self.api_key_header)
            .field("bearer", &self.bearer)
            .field("user_header", &self.user_header)
            .field("client_ip", &self.client_ip)
            .field("verifies_api_keys", &self.verify_api_key.is_some())
            .finish_non_exhaustive()
    }
}

impl Default for DefaultIdentifier {
    fn default() -> Self {
        DefaultIdentifier {
            api_key_header: Some(HeaderName::from_static("x-api-key")),
            bearer: true,
            user_header: None,
            client_ip: ClientIpResolver::default(),
            verify_api_key: None,
            malformed: Arc::default(),
            unverified: Arc::default(),
        }
    }
}

impl DefaultIdentifier {
    /// API key in `x-api-key` or a bearer token, no user header, no trusted proxies, IPv6
    /// grouped by /64.
    pub fn new() -> Self {
        DefaultIdentifier::default()
    }

    /// The API key header (`None` disables it).
    pub fn api_key_header(mut self, name: Option<&str>) -> Result<Self, IdentityError> {
        self.api_key_header = name
            .map(|name| header_name("api_key.header", name))
            .transpose()?;
        Ok(self)
    }

    /// Whether `Authorization: Bearer <key>` carries an API key (default true). The scheme is
    /// read in any case and followed by any spaces or tabs ([`bearer_credential`](super::bearer_credential)),
    /// as lenient upstreams read it.
    pub fn bearer(mut self, enabled: bool) -> Self {
        self.bearer = enabled;
        self
    }

    /// The user id header, honoured only from a trusted proxy (`None` disables it).
    pub fn user_header(mut self, name: Option<&str>) -> Result<Self, IdentityError> {
        self.user_header = name
            .map(|name| header_name("user_header", name))
            .transpose()?;
        Ok(self)
    }

    /// Proxies whose forwarding headers are believed: addresses or CIDRs.
    pub fn trusted_proxies<I, T>(mut self, proxies: I) -> Result<Self, IdentityError>
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        let nets = proxies
            .into_iter()
            .enumerate()
            .map(|(index, text)| {
                parse_net(text.as_ref()).ok_or_else(|| IdentityError::InvalidTrustedProxy {
                    index,
                    value: text.as_ref().to_owned(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.client_ip = ClientIpResolver::new(nets, self.client_ip.ipv6_prefix())
            .with_forwarded(self.client_ip.forwarded());
        Ok(self)
    }

    /// The forwarding header family the trusted proxies write (default `X-Forwarded-For`);
    /// the other family is ignored, since proxies pass a client's own copy through.
    pub fn forwarded(mut self, forwarded: ForwardedHeader) -> Self {
        self.client_ip = self.client_ip.with_forwarded(forwarded);
        self
    }

    /// Only keys for which `verify` answers true are API-key identities; any other key is
    /// treated as absent (the client is identified by user or IP instead) and counted in
    /// [`unverified_count`](Self::unverified_count). Closures `Fn(&str) -> bool` work.
    pub fn verify_api_key(mut self, verify: impl VerifyApiKey) -> Self {
        self.verify_api_key = Some(Arc::new(verify));
        self
    }

    /// The prefix by which IPv6 clients are grouped (default 64).
    pub fn ipv6_prefix(mut self, prefix: u8) -> Result<Self, IdentityError> {
        if prefix > 128 {
            return Err(IdentityError::InvalidIpv6Prefix(prefix));
        }
        self.client_ip = ClientIpResolver::new(self.client_ip.trusted_proxies().to_vec(), prefix)
            .with_forwarded(self.client_ip.forwarded());
        Ok(self)
    }

    /// How many requests carried an API key or user id that was oversized or not visible
    /// ASCII, and was therefore ignored.
    pub fn malformed_count(&self) -> u64 {
        self.malformed.load(Ordering::Relaxed)
    }

    /// The client IP resolver (trusted proxies and IPv6 grouping).
    pub fn client_ip(&self) -> &ClientIpResolver {
        &self.client_ip
    }

    /// How many requests carried an API key that [`verify_api_key`](Self::verify_api_key)
    /// refused.
    pub fn unverified_count(&self) -> u64 {
        self.unverified.load(Ordering::Relaxed)
    }

    /// The exact client address of a request (after the trusted-proxy walk, before IPv6
    /// grouping), if its peer address is known. Allow and deny lists match this one.
    pub fn exact_client_ip(&self, request: &RequestInfo<'_>) -> Option<IpAddr> {
        let peer = request.peer_addr()?;
        Some(self.client_ip.client_ip(peer.ip(), request.headers))
    }

    /// The grouped client IP of a request (the one limits count), if its peer address is known.
    pub fn client_ip_of(&self, request: &RequestInfo<'_>) -> Option<IpAddr> {
        self.exact_client_ip(request)
            .map(|ip| self.client_ip.group(ip))
    }

    /// The API key of a request, if it carries a well-formed one that passes
    /// [`verify_api_key`](Self::verify_api_key) (when set).
    pub fn api_key<'r>(&self, request: &RequestInfo<'r>) -> Option<&'r str> {
        let key = self.presented_api_key(request)?;
        match &self.verify_api_key {
            Some(verify) if !verify.is_known(key) => {
                self.unverified.fetch_add(1, Ordering::Relaxed);
                None
            }
            _ => Some(key),
        }
    }

    /// The well-formed API key a request presents, verified or not.
    fn presented_api_key<'r>(&self, request: &RequestInfo<'r>) -> Option<&'r str> {
        if let Some(name) = &self.api_key_header
            && let Some(value) = self.only_value(request, name)
        {
            match self.well_formed(value.as_bytes()) {
                Some(key) => return Some(key),
                None => self.count_malformed(),
            }
        }
        if self.bearer {
            let value = self.only_value(request, &AUTHORIZATION)?.as_bytes();
            // `Bearer<TAB>key` and `BEARER  key` too: the upstream reads them as the key.
            let token = super::bearer_credential(value)?;
            match self.well_formed(token) {
                Some(key) => return Some(key),
                None => self.count_malformed(),
            }
        }
        None
    }

    /// The value of `name` when the request carries it once. Carried twice, a credential is
    /// ambiguous (the application behind may read the other copy) and counts as malformed: no
    /// key, rather than a key the client may not be.
    fn only_value<'r>(
        &self,
        request: &RequestInfo<'r>,
        name: &HeaderName,
    ) -> Option<&'r http::HeaderValue> {
        let mut values = request.headers.get_all(name).iter();
        let first = values.next()?;
        if values.next().is_some() {
            self.count_malformed();
            return None;
        }
        Some(first)
    }

    /// The user id of a request: the [`UserId`] extension, or the user header if the peer is a
    /// trusted proxy.
    pub fn user_id<'r>(&self, request: &RequestInfo<'r>) -> Option<&'r str> {
        if let Some(UserId(user)) = request.extensions.get::<UserId>() {
            return Some(user);
        }
        let name = self.user_header.as_ref()?;
        let value = request.headers.get(name)?;
        let peer = request.peer_addr()?;
        if !self.client_ip.is_trusted(peer.ip()) {
            return None;
        }
        let user = self.well_formed(value.as_bytes());
        if user.is_none() {
            self.count_malformed();
        }
        user
    }

    /// Visible ASCII, 1 to 256 bytes; anything else is treated as absent.
    fn well_formed<'v>(&self, value: &'v [u8]) -> Option<&'v str> {
        let valid = !value.is_empty()
            && value.len() <= MAX_IDENTITY_LEN
            && value.iter().all(|byte| (0x21..=0x7e).contains(byte));
        // Visible ASCII is valid UTF-8.
        valid.then(|| std::str::from_utf8(value).ok()).flatten()
    }

    fn count_malformed(&self) {
        let total = self.malformed.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::debug!(total, "ignored an oversized or malformed identity header");
    }
}

impl IdentifyClient for DefaultIdentifier {
    fn identify(&self, request: &RequestInfo<'_>) -> Identity {
        if let Some(key) = self.api_key(request) {
            return Identity::ApiKey(key.to_owned());
        }
        if let Some(user) = self.user_id(request) {
            return Identity::User(user.to_owned());
        }
        match self.client_ip_of(request) {
            Some(ip) => Identity::Ip(ip),
            None => Identity::Unknown,
        }
    }

    fn client_addr(&self, request: &RequestInfo<'_>) -> Option<IpAddr> {
        self.exact_client_ip(request)
    }
}

fn header_name(field: &'static str, name: &str) -> Result<HeaderName, IdentityError> {
    HeaderName::try_from(name).map_err(|_| IdentityError::InvalidHeaderName {
        field,
        value: name.to_owned(),
    })
}

/// `10.0.0.0/8`, or a bare address meaning just that host.
fn parse_net(text: &str) -> Option<IpNet> {
    let text = text.trim();
    text.parse::<IpNet>()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from))
}
