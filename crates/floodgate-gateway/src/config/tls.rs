//! `listen_tls`, `upstream_tls` and `upstream_protocol` (SPEC §5 "TLS and upstream
//! protocols"): every file is read and checked here, so `floodgate check` names the field of a
//! missing file, a file that is not PEM, or a key that does not match its certificate.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Errors;
use crate::tls::{UpstreamTls, load_certs, load_pair};

/// `listen_tls:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawListenTls {
    /// PEM certificate chain.
    pub cert: String,
    /// PEM private key.
    pub key: String,
}

/// `upstream_tls:` as written.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawUpstreamTls {
    /// Extra trusted roots.
    #[serde(default)]
    pub ca: Option<String>,
    /// The name to verify instead of the URL's host.
    #[serde(default)]
    pub server_name: Option<String>,
    /// mTLS certificate.
    #[serde(default)]
    pub client_cert: Option<String>,
    /// mTLS key.
    #[serde(default)]
    pub client_key: Option<String>,
}

/// Which HTTP version the gateway speaks to upstreams.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum UpstreamProtocol {
    /// h2 or HTTP/1.1 by ALPN on https; HTTP/1.1 on http.
    #[default]
    Auto,
    /// HTTP/1.1 only.
    Http1,
    /// HTTP/2 only: by ALPN on https, prior knowledge (h2c) on http.
    Http2,
}

/// The listener's certificate and key files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ListenTls {
    /// PEM chain.
    pub cert: PathBuf,
    /// PEM key.
    pub key: PathBuf,
}

pub(super) fn listen_tls(errors: &mut Errors, raw: Option<&RawListenTls>) -> Option<ListenTls> {
    let raw = raw?;
    let (cert, key) = (PathBuf::from(&raw.cert), PathBuf::from(&raw.key));
    // Which file is at fault, when one is: a missing or unparsable file names its own field.
    for (field, result) in [
        ("listen_tls.cert", load_certs(&cert).map(drop)),
        ("listen_tls.key", crate::tls::load_key(&key).map(drop)),
    ] {
        if let Err(problem) = result {
            errors.push(field, problem.to_string());
            return None;
        }
    }
    match load_pair(&cert, &key) {
        Ok(_) => Some(ListenTls { cert, key }),
        Err(problem) => {
            errors.push("listen_tls", problem.to_string());
            None
        }
    }
}

pub(super) fn upstream_tls(errors: &mut Errors, raw: Option<&RawUpstreamTls>) -> UpstreamTls {
    let Some(raw) = raw else {
        return UpstreamTls::default();
    };
    let ca = raw.ca.as_ref().map(PathBuf::from);
    if let Some(ca) = &ca
        && let Err(problem) = load_certs(ca)
    {
        errors.push("upstream_tls.ca", problem.to_string());
    }
    if let Some(name) = &raw.server_name
        && rustls::pki_types::ServerName::try_from(name.as_str()).is_err()
    {
        errors.push(
            "upstream_tls.server_name",
            format!("`{name}` is not a DNS name or IP address"),
        );
    }
    let client_auth = match (&raw.client_cert, &raw.client_key) {
        (Some(cert), Some(key)) => {
            let (cert, key) = (PathBuf::from(cert), PathBuf::from(key));
            match load_pair(&cert, &key) {
                Ok(_) => Some((cert, key)),
                Err(problem) => {
                    errors.push("upstream_tls.client_cert", problem.to_string());
                    None
                }
            }
        }
        (None, None) => None,
        (Some(_), None) => {
            errors.push("upstream_tls.client_key", "client_cert needs client_key");
            None
        }
        (None, Some(_)) => {
            errors.push("upstream_tls.client_cert", "client_key needs client_cert");
            None
        }
    };
    UpstreamTls {
        ca,
        server_name: raw.server_name.clone(),
        client_auth,
    }
}

pub(super) fn upstream_protocol(errors: &mut Errors, text: &str) -> UpstreamProtocol {
    match text {
        "auto" => UpstreamProtocol::Auto,
        "http1" => UpstreamProtocol::Http1,
        "http2" => UpstreamProtocol::Http2,
        other => {
            errors.push(
                "upstream_protocol",
                format!("`{other}` is not one of auto, http1, http2"),
            );
            UpstreamProtocol::Auto
        }
    }
}

// A certificate that cannot be loaded is a problem of the setting that names it.
impl From<crate::tls::TlsError> for super::Problem {
    fn from(error: crate::tls::TlsError) -> Self {
        super::Problem(error.to_string())
    }
}
