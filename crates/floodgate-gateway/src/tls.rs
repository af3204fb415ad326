//! TLS both ways (SPEC §5 "TLS and upstream protocols"): the upstream client's trust (the
//! system's roots plus `upstream_tls.ca`, an optional client certificate) and the listener's
//! certificate, re-read when its files change.
//!
//! Verification is never off: there is no setting to skip it. A certificate that does not
//! verify fails the handshake, which the proxy answers 502 and logs with rustls' reason.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

/// The cryptography every TLS object of the gateway uses (ring: no C toolchain needed).
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Why a certificate, a key or a TLS configuration could not be loaded. Messages name the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not PEM.
    #[error("{}: not a PEM certificate file: {source}", path.display())]
    NotPem {
        /// The file.
        path: PathBuf,
        /// Why.
        source: rustls::pki_types::pem::Error,
    },
    /// A PEM file without any certificate.
    #[error("{}: holds no certificate", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// A PEM file without a private key.
    #[error("{}: no private key found: {source}", path.display())]
    NoKey {
        /// The file.
        path: PathBuf,
        /// Why.
        source: rustls::pki_types::pem::Error,
    },
    /// A certificate and a key that do not belong together (or that rustls cannot use).
    #[error("{} and {} do not make a usable pair: {source}", cert.display(), key.display())]
    Pair {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// Why.
        source: rustls::Error,
    },
    /// A CA certificate rustls refuses as a root.
    #[error("{}: {source}", path.display())]
    Root {
        /// The CA file.
        path: PathBuf,
        /// Why.
        source: rustls::Error,
    },
    /// A client certificate rustls refuses.
    #[error("client certificate {}: {source}", path.display())]
    ClientCertificate {
        /// The certificate file.
        path: PathBuf,
        /// Why.
        source: rustls::Error,
    },
    /// `upstream_tls.server_name` is no name.
    #[error("`{0}` is not a name")]
    ServerName(String),
    /// rustls refused the configuration itself.
    #[error(transparent)]
    Rustls(#[from] rustls::Error),
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// The certificates of a PEM file, at least one.
pub(crate) fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let text = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::NotPem {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub(crate) fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let text = read(path)?;
    PrivateKeyDer::from_pem_slice(&text).map_err(|source| TlsError::NoKey {
        path: path.to_owned(),
        source,
    })
}

/// A certificate chain and its key, checked to belong together.
pub(crate) fn load_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain = load_certs(cert)?;
    let key_der = load_key(key)?;
    CertifiedKey::from_der(chain, key_der, &provider()).map_err(|source| TlsError::Pair {
        cert: cert.to_owned(),
        key: key.to_owned(),
        source,
    })
}

/// `upstream_tls:` as validated: files exist and parse; what they hold is read again when the
/// client is built.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct UpstreamTls {
    /// Extra trusted roots (PEM).
    pub ca: Option<PathBuf>,
    /// The name to verify (and send as SNI) instead of the URL's host.
    pub server_name: Option<String>,
    /// Client certificate and key for mTLS.
    pub client_auth: Option<(PathBuf, PathBuf)>,
}

/// The rustls configuration of the upstream client: the system's roots plus `ca`, and the
/// client certificate when set.
pub(crate) fn upstream_client_config(settings: &UpstreamTls) -> Result<ClientConfig, TlsError> {
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, _ignored) = roots.add_parsable_certificates(native.certs);
    if added == 0 && settings.ca.is_none() {
        tracing::warn!(
            "no system CA certificates found: https upstreams verify only against upstream_tls.ca"
        );
    }
    if let Some(ca) = &settings.ca {
        for cert in load_certs(ca)? {
            roots.add(cert).map_err(|source| TlsError::Root {
                path: ca.clone(),
                source,
            })?;
        }
    }
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    match &settings.client_auth {
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|source| TlsError::ClientCertificate {
                path: cert.clone(),
                source,
            }),
        None => Ok(builder.with_no_client_auth()),
    }
}

/// The listener's certificate, swapped when its files change on disk (cert-manager,
/// Kubernetes secret rotation). Handshakes in flight keep the pair they started with; a new
/// pair that does not load is logged and the old one kept.
#[derive(Debug)]
pub(crate) struct ReloadingCertificate {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: ArcSwap<CertifiedKey>,
}

impl ReloadingCertificate {
    /// Loads the pair once; fails if it does not load.
    pub(crate) fn load(cert_path: PathBuf, key_path: PathBuf) -> Result<Arc<Self>, TlsError> {
        let pair = load_pair(&cert_path, &key_path)?;
        Ok(Arc::new(ReloadingCertificate {
            cert_path,
            key_path,
            current: ArcSwap::from_pointee(pair),
        }))
    }

    /// A server configuration that offers h2 and HTTP/1.1 by ALPN and serves the current pair.
    pub(crate) fn server_config(self: &Arc<Self>) -> Result<ServerConfig, TlsError> {
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }

    /// Checks the files every `interval` and swaps in a changed pair. Runs until the process
    /// ends. Polling (of modification times and sizes) sees atomic renames, in-place writes and
    /// Kubernetes' symlink swaps alike.
    pub(crate) fn watch(self: Arc<Self>, interval: Duration) {
        tokio::spawn(async move {
            let mut seen = self.stamp();
            let mut ticks = tokio::time::interval(interval);
            loop {
                ticks.tick().await;
                let stamp = self.stamp();
                if stamp == seen {
                    continue;
                }
                seen = stamp;
                self.reload();
            }
        });
    }

    /// Re-reads the pair now: swapped in if it loads, logged and ignored if not.
    pub(crate) fn reload(&self) -> bool {
        match load_pair(&self.cert_path, &self.key_path) {
            Ok(pair) => {
                self.current.store(Arc::new(pair));
                metrics::counter!(crate::telemetry::TLS_RELOADS_TOTAL, "result" => "success")
                    .increment(1);
                tracing::info!(cert = %self.cert_path.display(), "listener certificate reloaded");
                true
            }
            Err(error) => {
                metrics::counter!(crate::telemetry::TLS_RELOADS_TOTAL, "result" => "failure")
                    .increment(1);
                tracing::error!(%error, "new listener certificate rejected; the previous one stays");
                false
            }
        }
    }

    fn stamp(&self) -> Option<[(SystemTime, u64); 2]> {
        let stamp = |path: &Path| {
            let metadata = std::fs::metadata(path).ok()?;
            Some((metadata.modified().ok()?, metadata.len()))
        };
        Some([stamp(&self.cert_path)?, stamp(&self.key_path)?])
    }
}

impl ResolvesServerCert for ReloadingCertificate {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}
