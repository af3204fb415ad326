//! One credential per request (SPEC §3, issue 45): the headers a request's credentials come
//! in, and what makes a request's credentials ambiguous.
//!
//! The gateway counts a request under the credential it reads; the upstream authenticates the
//! one *it* reads. When a request carries two (two `Authorization` field lines, an API key
//! header beside a different bearer key, a token in the query as well as or instead of the
//! header), the two may read different ones, and a tenant would be served while another
//! identity (or none) is counted. Such a request is refused before any limit, never forwarded
//! as it is; and a request whose refused token is limited as anonymous is forwarded without
//! its credentials ([`CredentialHeaders::strip`]).

use floodgate::RequestInfo;
use http::HeaderMap;
use http::header::{AUTHORIZATION, HeaderName};

/// What `Authorization` carries for this configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AuthorizationUse {
    /// Nothing the gateway reads: it passes through like any header.
    Ignored,
    /// A bearer API key (`identity.api_key.bearer`, without `identity.jwt` in it).
    ApiKey,
    /// `identity.jwt`'s bearer token.
    Token,
}

/// The headers a request's credentials come in, as one configuration reads them.
#[derive(Clone, Debug)]
pub(crate) struct CredentialHeaders {
    /// `identity.api_key.header`.
    pub api_key: HeaderName,
    /// What `Authorization` carries.
    pub authorization: AuthorizationUse,
    /// `identity.jwt.header` when it is another header than `Authorization`.
    pub token: Option<HeaderName>,
}

/// Why a request's credentials are ambiguous: answered 400 `invalid_request` (RFC 6750 §3.1:
/// a request that "uses more than one method for including an access token").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ambiguity {
    /// A credential header given more than once (two `Authorization` lines, two API keys).
    Repeated,
    /// An `access_token` query parameter (RFC 6750 §2.3), never verified: refused.
    QueryToken,
    /// An API key header beside a different bearer API key.
    TwoKeys,
}

impl Ambiguity {
    /// The `reason` of `floodgate_rejected_requests_total`.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Ambiguity::Repeated => "repeated_credential",
            Ambiguity::QueryToken => "access_token_in_query",
            Ambiguity::TwoKeys => "two_api_keys",
        }
    }
}

impl CredentialHeaders {
    /// Every header this configuration reads a credential from.
    fn read(&self) -> impl Iterator<Item = &HeaderName> {
        let authorization =
            (self.authorization != AuthorizationUse::Ignored).then_some(&AUTHORIZATION);
        std::iter::once(&self.api_key)
            .chain(authorization)
            .chain(self.token.as_ref())
    }

    /// Refuses a request whose credentials the upstream could read otherwise than the gateway
    /// does: a credential header given twice, an `access_token` in the query while bearer
    /// credentials are read, or an API key header beside a different bearer API key. With
    /// `identity.jwt`, a token and an API key are not ambiguous: the verified token wins
    /// (SPEC §3).
    pub(crate) fn check(&self, request: &RequestInfo<'_>) -> Result<(), Ambiguity> {
        let headers = request.headers;
        if self
            .read()
            .any(|name| headers.get_all(name).iter().nth(1).is_some())
        {
            return Err(Ambiguity::Repeated);
        }
        if self.authorization != AuthorizationUse::Ignored
            && request.uri.query().is_some_and(carries_access_token)
        {
            return Err(Ambiguity::QueryToken);
        }
        if self.authorization == AuthorizationUse::ApiKey
            && let Some(key) = headers.get(&self.api_key)
            && let Some(bearer) = headers
                .get(AUTHORIZATION)
                .and_then(|value| floodgate::key::bearer_credential(value.as_bytes()))
            && !bearer.is_empty()
            && bearer != key.as_bytes()
        {
            return Err(Ambiguity::TwoKeys);
        }
        Ok(())
    }

    /// Takes the API key header off a request identified by its verified token: the token
    /// wins (SPEC §3), so the key was neither counted nor looked up, and an upstream that
    /// authenticates by it would read another client than the gateway counted.
    pub(crate) fn strip_beside_token(&self, headers: &mut HeaderMap) {
        let token_header = self.token.as_ref().unwrap_or(&AUTHORIZATION);
        if self.api_key != *token_header {
            headers.remove(&self.api_key);
        }
    }

    /// Takes every credential the gateway reads off `headers`: a request limited as
    /// anonymous (a refused token under `invalid_token: anonymous`) reaches the upstream as
    /// the anonymous request it was counted as, not with a credential the upstream may trust.
    pub(crate) fn strip(&self, headers: &mut HeaderMap) {
        for name in self.read() {
            headers.remove(name);
        }
    }
}

/// The query parameter of RFC 6750 §2.3.
const ACCESS_TOKEN: &[u8] = b"access_token";

/// Whether a query names `access_token`, spelled as any upstream may decode it: split on `&`
/// and `;`, the name percent-decoded, in any case.
fn carries_access_token(query: &str) -> bool {
    query.split(['&', ';']).any(|pair| {
        let name = pair.split_once('=').map_or(pair, |(name, _)| name);
        decoded_name_is_access_token(name.as_bytes())
    })
}

fn decoded_name_is_access_token(name: &[u8]) -> bool {
    let mut expected = ACCESS_TOKEN.iter();
    let mut rest = name;
    while let [first, tail @ ..] = rest {
        let (byte, tail) = match (first, tail) {
            (b'%', [high, low, after @ ..]) => match (hex_digit(*high), hex_digit(*low)) {
                (Some(high), Some(low)) => (high << 4 | low, after),
                _ => (b'%', tail),
            },
            (b'+', _) => (b' ', tail),
            _ => (*first, tail),
        };
        match expected.next() {
            Some(want) if want.eq_ignore_ascii_case(&byte) => rest = tail,
            _ => return false,
        }
    }
    expected.next().is_none()
}

fn hex_digit(byte: u8) -> Option<u8> {
    char::from(byte)
        .to_digit(16)
        .and_then(|digit| u8::try_from(digit).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(
        config: &CredentialHeaders,
        pairs: &[(&str, &[u8])],
        uri: &str,
    ) -> Result<(), Ambiguity> {
        let mut request = http::Request::builder().uri(uri);
        for (name, value) in pairs {
            request = request.header(*name, http::HeaderValue::from_bytes(value).unwrap());
        }
        let request = request.body(()).unwrap();
        config.check(&RequestInfo::new(&request))
    }

    fn api_keys() -> CredentialHeaders {
        CredentialHeaders {
            api_key: HeaderName::from_static("x-api-key"),
            authorization: AuthorizationUse::ApiKey,
            token: None,
        }
    }

    #[test]
    fn an_access_token_is_found_however_its_name_is_spelled() {
        for query in [
            "access_token=x",
            "a=1&access_token=x",
            "a=1;access_token",
            "ACCESS_TOKEN=x",
            "access%5Ftoken=x",
            "access%5ftoken=x",
            "%61ccess_token=",
        ] {
            assert!(carries_access_token(query), "{query}");
        }
        for query in [
            "",
            "access_tokens=x",
            "my_access_token=x",
            "access=token",
            "x=access_token",
            "access%5",
            "access%zztoken=x",
            "%",
            "access_toke",
        ] {
            assert!(!carries_access_token(query), "{query}");
        }
    }

    #[test]
    fn two_credentials_are_ambiguous_one_is_not() {
        let config = api_keys();
        assert_eq!(
            headers(&config, &[("authorization", b"Bearer k")], "/"),
            Ok(())
        );
        assert_eq!(
            headers(
                &config,
                &[
                    ("authorization", b"Basic a"),
                    ("authorization", b"Bearer k")
                ],
                "/"
            ),
            Err(Ambiguity::Repeated)
        );
        assert_eq!(
            headers(&config, &[("x-api-key", b"a"), ("x-api-key", b"b")], "/"),
            Err(Ambiguity::Repeated)
        );
        assert_eq!(
            headers(
                &config,
                &[("x-api-key", b"a"), ("authorization", b"Bearer\tb")],
                "/"
            ),
            Err(Ambiguity::TwoKeys)
        );
        assert_eq!(
            headers(
                &config,
                &[("x-api-key", b"a"), ("authorization", b"bearer a")],
                "/"
            ),
            Ok(())
        );
        assert_eq!(
            headers(
                &config,
                &[("x-api-key", b"a"), ("authorization", b"Basic b")],
                "/"
            ),
            Ok(())
        );
        // `Bearer` with nothing after it names no key an upstream could read.
        assert_eq!(
            headers(
                &config,
                &[("x-api-key", b"a"), ("authorization", b"Bearer")],
                "/"
            ),
            Ok(())
        );
        assert_eq!(
            headers(&config, &[], "/x?access_token=t"),
            Err(Ambiguity::QueryToken)
        );
        // Bytes that are not text change nothing but the outcome.
        assert_eq!(
            headers(
                &config,
                &[("x-api-key", b"\xff"), ("authorization", b"Bearer \xfe")],
                "/"
            ),
            Err(Ambiguity::TwoKeys)
        );
        // A configuration that reads no Authorization leaves it, and the query, alone.
        let ignored = CredentialHeaders {
            authorization: AuthorizationUse::Ignored,
            ..api_keys()
        };
        assert_eq!(
            headers(
                &ignored,
                &[
                    ("authorization", b"Basic a"),
                    ("authorization", b"Bearer k")
                ],
                "/x?access_token=t"
            ),
            Ok(())
        );
        // With tokens, a token beside an API key is not ambiguous: the token wins.
        let tokens = CredentialHeaders {
            authorization: AuthorizationUse::Token,
            ..api_keys()
        };
        assert_eq!(
            headers(
                &tokens,
                &[("x-api-key", b"a"), ("authorization", b"Bearer t")],
                "/"
            ),
            Ok(())
        );
    }

    #[test]
    fn stripping_takes_every_credential_read_and_nothing_else() {
        let config = CredentialHeaders {
            token: Some(HeaderName::from_static("x-token")),
            ..api_keys()
        };
        let mut map = HeaderMap::new();
        for name in ["x-api-key", "authorization", "x-token", "accept"] {
            map.insert(name, http::HeaderValue::from_static("v"));
        }
        config.strip(&mut map);
        assert_eq!(
            map.keys().map(HeaderName::as_str).collect::<Vec<_>>(),
            ["accept"]
        );
    }
}
