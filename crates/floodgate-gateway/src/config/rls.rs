//! `rls:` (SPEC §10): floodgate as Envoy's rate limit service.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Errors;
use super::quota::{QuotaSettings, RawQuota};

/// `rls:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRls {
    /// The gRPC (h2c) listen address.
    pub listen: String,
    /// The HTTP/1.1 listen address of envoyproxy/ratelimit's `POST /json` (and
    /// `/healthcheck`); off unless set.
    #[serde(default)]
    pub http_listen: Option<String>,
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
    /// Envoy's Rate Limit Quota Service on the same listener (`rls.quota:`), when set.
    #[serde(default)]
    pub quota: Option<RawQuota>,
}

fn default_response_headers() -> bool {
    true
}

/// `rls:`, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RlsSettings {
    /// The gRPC (h2c) listen address (read at start).
    pub listen: SocketAddr,
    /// The HTTP/1.1 listen address of `POST /json` and `/healthcheck` (read at start), when
    /// set.
    pub http_listen: Option<SocketAddr>,
    /// The directory of domain files (read at start; its files are hot-reloaded).
    pub config_dir: PathBuf,
    /// Whether answers carry the `RateLimit` headers (styles by `response.headers`).
    pub response_headers: bool,
    /// Several files of one domain are merged instead of refused.
    pub merge_domains: bool,
    /// The Rate Limit Quota Service's rules, when it is served.
    pub quota: Option<QuotaSettings>,
}

impl RlsSettings {
    /// `config_dir`, relative to the directory of the configuration file at `config_path`
    /// unless absolute.
    pub(crate) fn directory(&self, config_path: &std::path::Path) -> PathBuf {
        match config_path.parent() {
            Some(parent) if self.config_dir.is_relative() => parent.join(&self.config_dir),
            _ => self.config_dir.clone(),
        }
    }
}

/// Validates `rls:`. `taken` are the addresses the other listeners bind, with their field
/// paths: an RLS listener on one of them could never start.
pub(super) fn rls(
    errors: &mut Errors,
    raw: Option<&RawRls>,
    taken: &[(&str, Option<SocketAddr>)],
) -> Option<RlsSettings> {
    let raw = raw?;
    let listen = errors.ok("rls.listen", super::socket_addr(&raw.listen));
    // `None` inside: the address is invalid (and said so); the rest is still checked.
    let http_listen = raw
        .http_listen
        .as_deref()
        .map(|text| errors.ok("rls.http_listen", super::socket_addr(text)));
    if raw.config_dir.is_empty() {
        errors.push("rls.config_dir", "must name a directory");
    }
    let listeners = [
        ("rls.listen", listen),
        ("rls.http_listen", http_listen.flatten()),
    ];
    for (index, (field, address)) in listeners.iter().enumerate() {
        // Port 0 asks the system for a free port: never a clash.
        let Some(address) = address.filter(|address| address.port() != 0) else {
            continue;
        };
        let earlier = taken.iter().chain(&listeners[..index]);
        if let Some((other, _)) = earlier
            .into_iter()
            .find(|(_, other)| *other == Some(address))
        {
            errors.push(*field, format!("{address} is already {other}'s address"));
        }
    }
    let quota = super::quota::quota(errors, raw.quota.as_ref());
    let http_listen = match http_listen {
        Some(address) => Some(address?),
        None => None,
    };
    Some(RlsSettings {
        listen: listen?,
        http_listen,
        config_dir: PathBuf::from(&raw.config_dir),
        response_headers: raw.response_headers,
        merge_domains: raw.merge_domains,
        quota: quota?,
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

    #[test]
    fn the_http_listener_is_off_unless_set_and_must_be_an_address_of_its_own() {
        let off =
            super::super::parse("rls: { listen: \"127.0.0.1:8081\", config_dir: rls }\n").unwrap();
        assert_eq!(off.rls.unwrap().http_listen, None);
        let on = super::super::parse(
            "rls: { listen: \"127.0.0.1:8081\", http_listen: \"127.0.0.1:8082\", config_dir: rls }\n",
        )
        .unwrap();
        assert_eq!(
            on.rls.unwrap().http_listen,
            Some("127.0.0.1:8082".parse().unwrap())
        );
        let errors = |text: &str| super::super::parse(text).unwrap_err().to_string();
        let bad = errors(
            "rls: { listen: \"127.0.0.1:8081\", http_listen: \"port 8082\", config_dir: \"\" }\n",
        );
        assert!(
            bad.contains("rls.http_listen: `port 8082` is not an address"),
            "{bad}"
        );
        assert!(
            bad.contains("rls.config_dir: must name a directory"),
            "{bad}"
        );
        let clash = errors(
            "rls: { listen: \"127.0.0.1:8081\", http_listen: \"127.0.0.1:8081\", config_dir: rls }\n",
        );
        assert!(
            clash.contains("rls.http_listen: 127.0.0.1:8081 is already rls.listen's address"),
            "{clash}"
        );
        let admin = errors(
            "admin: { listen: \"127.0.0.1:9090\" }\nrls: { listen: \"127.0.0.1:9090\", config_dir: rls }\n",
        );
        assert!(
            admin.contains("rls.listen: 127.0.0.1:9090 is already admin.listen's address"),
            "{admin}"
        );
        // The proxy's `listen` is not bound in an RLS-only deployment: no clash with it.
        super::super::parse(
            "listen: \"127.0.0.1:8080\"\nrls: { listen: \"127.0.0.1:8081\", http_listen: \"127.0.0.1:8080\", config_dir: rls }\n",
        )
        .unwrap();
        let proxied = errors(
            "listen: \"127.0.0.1:8080\"\nupstream: \"http://127.0.0.1:3000\"\nrls: { listen: \"127.0.0.1:8081\", http_listen: \"127.0.0.1:8080\", config_dir: rls }\n",
        );
        assert!(
            proxied.contains("rls.http_listen: 127.0.0.1:8080 is already listen's address"),
            "{proxied}"
        );
    }
}
