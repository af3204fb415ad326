//! `rls:` (SPEC §10): floodgate as Envoy's rate limit service.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Errors;

/// `rls:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawRls {
    /// The gRPC (h2c) listen address.
    pub listen: String,
    /// The directory of envoyproxy/ratelimit-format domain files.
    pub config_dir: String,
    /// Whether answers carry rate limit headers in `response_headers_to_add` (default true, as
    /// SPEC §10's example shows).
    #[serde(default = "default_response_headers")]
    pub response_headers: bool,
    /// Several files of one domain are merged (envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG`)
    /// instead of refused.
    #[serde(default)]
    pub merge_domains: bool,
}

fn default_response_headers() -> bool {
    true
}

/// `rls:`, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RlsSettings {
    /// The gRPC (h2c) listen address (read at start).
    pub listen: SocketAddr,
    /// The directory of domain files (read at start; its files are hot-reloaded).
    pub config_dir: PathBuf,
    /// Whether answers carry the `RateLimit` headers (styles by `response.headers`).
    pub response_headers: bool,
    /// Several files of one domain are merged instead of refused.
    pub merge_domains: bool,
}

pub(super) fn rls(errors: &mut Errors, raw: Option<&RawRls>) -> Option<RlsSettings> {
    let raw = raw?;
    let listen = errors.ok("rls.listen", super::socket_addr(&raw.listen));
    if raw.config_dir.is_empty() {
        errors.push("rls.config_dir", "must name a directory");
    }
    Some(RlsSettings {
        listen: listen?,
        config_dir: PathBuf::from(&raw.config_dir),
        response_headers: raw.response_headers,
        merge_domains: raw.merge_domains,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn answers_carry_headers_unless_switched_off() {
        let on =
            super::super::parse("rls: { listen: \"127.0.0.1:8081\", config_dir: rls }\n").unwrap();
        assert!(on.rls.as_ref().unwrap().response_headers, "SPEC §10: true");
        let off = super::super::parse(
            "rls: { listen: \"127.0.0.1:8081\", config_dir: rls, response_headers: false }\n",
        )
        .unwrap();
        assert!(!off.rls.as_ref().unwrap().response_headers);
    }
}
