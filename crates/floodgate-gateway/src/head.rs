//! What the gateway refuses in a request head before any limit or upstream sees it: requests
//! whose target host is ambiguous (RFC 9112 §3.2, RFC 9113 §8.3.1) and methods a reverse proxy
//! does not forward. The path's own rules are in [`crate::path`].

use http::header::HOST;
use http::{Method, Request, StatusCode, Version};

/// Why a request head is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeadRejection {
    /// More than one `Host` header, or none on HTTP/1.1: 400.
    BadHost,
    /// An HTTP/2 `host` header that disagrees with `:authority`: 400.
    HostAuthorityMismatch,
    /// `CONNECT`: a reverse proxy opens no tunnels to other hosts (405).
    Connect,
}

impl HeadRejection {
    /// The status answered.
    pub(crate) fn status(self) -> StatusCode {
        match self {
            HeadRejection::BadHost | HeadRejection::HostAuthorityMismatch => {
                StatusCode::BAD_REQUEST
            }
            HeadRejection::Connect => StatusCode::METHOD_NOT_ALLOWED,
        }
    }

    /// The `error` of the JSON answer, also the `reason` label of
    /// `floodgate_rejected_requests_total`.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            HeadRejection::BadHost => "bad_host",
            HeadRejection::HostAuthorityMismatch => "host_authority_mismatch",
            HeadRejection::Connect => "method_not_allowed",
        }
    }
}

/// Checks the head of `request`.
pub(crate) fn check<B>(request: &Request<B>) -> Result<(), HeadRejection> {
    if request.method() == Method::CONNECT {
        return Err(HeadRejection::Connect);
    }
    let mut hosts = request.headers().get_all(HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(HeadRejection::BadHost);
    }
    match request.version() {
        Version::HTTP_2 | Version::HTTP_3 => {
            if let (Some(host), Some(authority)) = (host, request.uri().authority())
                && !host
                    .as_bytes()
                    .eq_ignore_ascii_case(authority.as_str().as_bytes())
            {
                return Err(HeadRejection::HostAuthorityMismatch);
            }
        }
        Version::HTTP_11 if host.is_none() => return Err(HeadRejection::BadHost),
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(version: Version, uri: &str, hosts: &[&str]) -> Request<()> {
        let mut builder = Request::builder().version(version).uri(uri);
        for host in hosts {
            builder = builder.header(HOST, *host);
        }
        builder.body(()).unwrap()
    }

    #[test]
    fn host_rules() {
        assert_eq!(check(&request(Version::HTTP_11, "/", &["a"])), Ok(()));
        assert_eq!(
            check(&request(Version::HTTP_11, "/", &["a", "b"])),
            Err(HeadRejection::BadHost)
        );
        assert_eq!(
            check(&request(Version::HTTP_11, "/", &[])),
            Err(HeadRejection::BadHost)
        );
        assert_eq!(check(&request(Version::HTTP_10, "/", &[])), Ok(()));
        assert_eq!(check(&request(Version::HTTP_2, "https://a/", &[])), Ok(()));
        assert_eq!(
            check(&request(Version::HTTP_2, "https://a/", &["A"])),
            Ok(())
        );
        assert_eq!(
            check(&request(Version::HTTP_2, "https://a/", &["b"])),
            Err(HeadRejection::HostAuthorityMismatch)
        );
    }

    #[test]
    fn connect_is_refused() {
        let connect = Request::builder()
            .method(Method::CONNECT)
            .uri("other.host:443")
            .header(HOST, "other.host:443")
            .body(())
            .unwrap();
        assert_eq!(check(&connect), Err(HeadRejection::Connect));
    }
}
