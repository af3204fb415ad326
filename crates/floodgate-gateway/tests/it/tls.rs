//! TLS both ways and HTTP/2 upstreams (SPEC §5 "TLS and upstream protocols"), through the
//! binary. Certificates are made here: a private CA, server certificates, a client certificate.

use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use support::{Gateway, TempDir};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A private CA that issues certificates into a directory.
struct Pki {
    directory: TempDir,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            format!("floodgate test CA {name}"),
        );
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let pki = Pki {
            directory: TempDir::new(&format!("pki-{name}")),
            ca,
        };
        std::fs::write(pki.ca_path(), pki.ca.pem()).unwrap();
        pki
    }

    fn ca_path(&self) -> PathBuf {
        self.directory.file("ca.pem")
    }

    /// Issues a certificate for `names` into `<file>.crt` and `<file>.key`.
    fn issue(&self, file: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(
            names
                .iter()
                .map(|name| name.to_string())
                .collect::<Vec<_>>(),
        )
        .unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        let (cert_path, key_path) = (
            self.directory.file(&format!("{file}.crt")),
            self.directory.file(&format!("{file}.key")),
        );
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (cert_path, key_path)
    }

    /// A client configuration trusting this CA only.
    fn client_config(&self) -> rustls::ClientConfig {
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(self.roots())
            .with_no_client_auth()
    }

    fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.der().clone()).unwrap();
        roots
    }
}

fn certs(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

fn key(path: &Path) -> PrivateKeyDer<'static> {
    PrivateKeyDer::from_pem_file(path).unwrap()
}

/// What the test upstreams answer: the protocol version, path and a few headers they saw.
async fn echo(
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let body = serde_json::json!({
        "version": format!("{:?}", request.version()),
        "path": request.uri().path(),
        "x-forwarded-proto": header("x-forwarded-proto"),
    });
    Ok(Response::new(Full::new(Bytes::from(body.to_string()))))
}

/// An HTTPS upstream with `cert`/`key`, offering h2 and HTTP/1.1, optionally requiring a client
/// certificate issued by `client_ca`.
async fn https_upstream(cert: &Path, key_path: &Path, client_ca: Option<&Pki>) -> SocketAddr {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match client_ca {
        Some(pki) => builder.with_client_cert_verifier(
            rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(pki.roots()),
                provider(),
            )
            .build()
            .unwrap(),
        ),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs(cert), key(key_path))
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), hyper::service::service_fn(echo))
                    .await;
            });
        }
    });
    addr
}

fn start(rest: &str, upstream: &str) -> (Gateway, TempDir) {
    support::start_gateway(upstream, rest)
}

async fn get_status(gateway: &Gateway, path: &str) -> (StatusCode, String) {
    let response = support::get(&support::client(), &gateway.url(path), &[]).await;
    (
        response.status(),
        String::from_utf8_lossy(response.body()).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_upstreams_are_verified_against_the_configured_ca() {
    let pki = Pki::new("upstream");
    let (cert, key_path) = pki.issue("upstream", &["api.internal", "127.0.0.1"]);
    let upstream = https_upstream(&cert, &key_path, None).await;
    let url = format!("https://127.0.0.1:{}", upstream.port());
    let with_ca = format!("upstream_tls: {{ ca: \"{}\" }}\n", pki.ca_path().display());

    let (trusted, _a) = start(&with_ca, &url);
    let (status, body) = get_status(&trusted, "/over-tls").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let seen: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(seen["path"], "/over-tls");
    assert_eq!(seen["version"], "HTTP/2.0", "auto: h2 by ALPN");

    let (untrusted, _b) = start("", &url);
    let (status, body) = get_status(&untrusted, "/").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert!(
        !body.contains("certificate"),
        "no detail to the client: {body}"
    );
    // The line may follow the answer: waited for, not read at once (a suite run read the log
    // before the line was in it).
    let logged = untrusted.wait_for_log(
        |line| line.contains("upstream request failed"),
        "saying the upstream request failed",
    );
    assert!(
        logged.contains("UnknownIssuer"),
        "the reason is logged: {logged}"
    );

    // The name to verify can differ from the URL's host; a wrong one fails.
    let named = format!(
        "upstream_tls: {{ ca: \"{}\", server_name: api.internal }}\nupstream_protocol: http1\n",
        pki.ca_path().display()
    );
    let (by_name, _c) = start(&named, &url);
    let (status, body) = get_status(&by_name, "/").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("HTTP/1.1"), "http1 as asked: {body}");
    let wrong = format!(
        "upstream_tls: {{ ca: \"{}\", server_name: other.internal }}\n",
        pki.ca_path().display()
    );
    let (wrong_name, _d) = start(&wrong, &url);
    assert_eq!(
        get_status(&wrong_name, "/").await.0,
        StatusCode::BAD_GATEWAY
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_to_the_upstream() {
    let pki = Pki::new("mtls");
    let (cert, key_path) = pki.issue("upstream", &["127.0.0.1"]);
    let (client_cert, client_key) = pki.issue("client", &["floodgate-gateway"]);
    let upstream = https_upstream(&cert, &key_path, Some(&pki)).await;
    let url = format!("https://127.0.0.1:{}", upstream.port());
    let ca = pki.ca_path();
    let with_cert = format!(
        "upstream_tls: {{ ca: \"{}\", client_cert: \"{}\", client_key: \"{}\" }}\n",
        ca.display(),
        client_cert.display(),
        client_key.display()
    );
    let (gateway, _a) = start(&with_cert, &url);
    assert_eq!(get_status(&gateway, "/").await.0, StatusCode::OK);
    let (without, _b) = start(
        &format!("upstream_tls: {{ ca: \"{}\" }}\n", ca.display()),
        &url,
    );
    assert_eq!(get_status(&without, "/").await.0, StatusCode::BAD_GATEWAY);
}

#[test]
fn bad_tls_files_are_config_errors_with_their_field() {
    let pki = Pki::new("check");
    let (cert, key_path) = pki.issue("server", &["127.0.0.1"]);
    let (_, other_key) = pki.issue("other", &["127.0.0.1"]);
    let missing = pki.directory.file("missing.pem");
    let cases = [
        (
            format!(
                "listen_tls: {{ cert: \"{}\", key: \"{}\" }}\n",
                missing.display(),
                key_path.display()
            ),
            "listen_tls.cert: cannot read",
        ),
        (
            format!(
                "listen_tls: {{ cert: \"{}\", key: \"{}\" }}\n",
                cert.display(),
                cert.display()
            ),
            "listen_tls.key:",
        ),
        (
            format!(
                "listen_tls: {{ cert: \"{}\", key: \"{}\" }}\n",
                cert.display(),
                other_key.display()
            ),
            "listen_tls: ",
        ),
        (
            format!("upstream_tls: {{ ca: \"{}\" }}\n", key_path.display()),
            "upstream_tls.ca:",
        ),
        (
            format!("upstream_tls: {{ client_cert: \"{}\" }}\n", cert.display()),
            "upstream_tls.client_key: client_cert needs client_key",
        ),
        (
            "upstream_protocol: h3\n".to_owned(),
            "upstream_protocol: `h3`",
        ),
        ("upstream: \"ftp://x\"\n".to_owned(), "upstream: `ftp://x`"),
    ];
    for (text, expected) in cases {
        let errors = floodgate_gateway::check_text(&text)
            .expect_err("invalid")
            .to_string();
        assert!(errors.contains(expected), "{text}\n=> {errors}");
    }
}

/// A client of the TLS listener trusting `pki`, over HTTP/1.1 or h2 only, with no connection
/// reuse (every request makes its own handshake).
fn tls_client(
    pki: &Pki,
    http2: bool,
) -> Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>> {
    let config = pki.client_config();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only();
    let connector = if http2 {
        connector.enable_http2().build()
    } else {
        connector.enable_http1().build()
    };
    Client::builder(TokioExecutor::new())
        .http2_only(http2)
        .pool_max_idle_per_host(0)
        .build(connector)
}

/// The certificate the listener presents to a fresh handshake.
async fn presented_certificate(pki: &Pki, listen: SocketAddr) -> Option<CertificateDer<'static>> {
    let config = pki.client_config();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let stream = tokio::net::TcpStream::connect(listen).await.ok()?;
    let tls = connector
        .connect(ServerName::try_from("127.0.0.1").unwrap(), stream)
        .await
        .ok()?;
    tls.get_ref().1.peer_certificates()?.first().cloned()
}

/// A gateway with `listen_tls` serving `cert`/`key`, in front of `upstream`.
fn start_tls_gateway(upstream: &support::Upstream, cert: &Path, key: &Path) -> (Gateway, TempDir) {
    let rest = format!(
        "listen_tls: {{ cert: \"{}\", key: \"{}\" }}\n",
        cert.display(),
        key.display()
    );
    support::start_gateway(&upstream.url(), &rest)
}

fn replace(path: &Path, contents: &[u8]) {
    let temporary = path.with_extension("new");
    std::fs::write(&temporary, contents).unwrap();
    std::fs::rename(&temporary, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_listener_serves_h1_and_h2_and_follows_certificate_rotation() {
    let upstream = support::Upstream::start().await;
    let pki = Pki::new("listener");
    let (cert, key_path) = pki.issue("listener", &["127.0.0.1"]);
    let (gateway, _directory) = start_tls_gateway(&upstream, &cert, &key_path);
    let listen = gateway.listen;
    let url = format!("https://127.0.0.1:{}/over-tls", listen.port());
    for http2 in [false, true] {
        let client = tls_client(&pki, http2);
        let response = client
            .request(Request::get(&url).body(Full::new(Bytes::new())).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.version(),
            if http2 {
                http::Version::HTTP_2
            } else {
                http::Version::HTTP_11
            }
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let seen: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(seen["headers"]["x-forwarded-proto"], "https");
    }

    // Rotation under load: a new handshake per request, none may fail.
    let first = presented_certificate(&pki, listen).await.unwrap();
    let failures = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(tokio::sync::Notify::new());
    let load = {
        let (client, url, failures, sent, stop) = (
            tls_client(&pki, false),
            url.clone(),
            failures.clone(),
            sent.clone(),
            stop.clone(),
        );
        tokio::spawn(async move {
            loop {
                let request =
                    client.request(Request::get(&url).body(Full::new(Bytes::new())).unwrap());
                tokio::select! {
                    result = request => {
                        sent.fetch_add(1, Ordering::Relaxed);
                        if !matches!(result, Ok(ref response) if response.status() == StatusCode::OK) {
                            failures.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    () = stop.notified() => return,
                }
            }
        })
    };
    let (new_cert, new_key) = pki.issue("rotated", &["127.0.0.1"]);
    // Key first, then certificate, each by an atomic rename, as a secret update does.
    replace(&key_path, &std::fs::read(&new_key).unwrap());
    replace(&cert, &std::fs::read(&new_cert).unwrap());
    let rotated = certs(&cert).remove(0);
    let started = std::time::Instant::now();
    loop {
        if presented_certificate(&pki, listen).await.as_ref() == Some(&rotated) {
            break;
        }
        // The files are polled every second; ten leave room for a loaded CI machine.
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the new certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.notify_one();
    load.await.unwrap();
    assert!(sent.load(Ordering::Relaxed) > 0);
    assert_eq!(
        failures.load(Ordering::Relaxed),
        0,
        "no request failed during the rotation"
    );
    assert_ne!(first, rotated);

    // A broken new key is rejected, logged, and the served pair stays.
    replace(
        &key_path,
        b"-----BEGIN PRIVATE KEY-----\nbroken\n-----END PRIVATE KEY-----\n",
    );
    let started = std::time::Instant::now();
    while !gateway
        .log
        .lock()
        .unwrap()
        .iter()
        .any(|line| line.contains("new listener certificate rejected"))
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the broken key was never noticed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(presented_certificate(&pki, listen).await, Some(rotated));
}

/// A gRPC-style answer: one data frame, then trailers with `grpc-status: 0`.
struct GrpcReply {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl http_body::Body for GrpcReply {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(data) = self.data.take() {
            return std::task::Poll::Ready(Some(Ok(Frame::data(data))));
        }
        std::task::Poll::Ready(
            self.trailers
                .take()
                .map(|trailers| Ok(Frame::trailers(trailers))),
        )
    }
}

/// An h2c (prior knowledge) upstream that echoes a gRPC message back with trailers.
async fn grpc_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|request: Request<Incoming>| async move {
                    let message = request.into_body().collect().await.unwrap().to_bytes();
                    let mut trailers = HeaderMap::new();
                    trailers.insert("grpc-status", "0".parse().unwrap());
                    trailers.insert("grpc-message", "echoed".parse().unwrap());
                    let mut response = Response::new(GrpcReply {
                        data: Some(message),
                        trailers: Some(trailers),
                    });
                    response
                        .headers_mut()
                        .insert("content-type", "application/grpc".parse().unwrap());
                    Ok::<_, std::convert::Infallible>(response)
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_passes_through_with_trailers_and_denials_are_grpc_shaped() {
    let upstream = grpc_upstream().await;
    let rest = "upstream_protocol: http2\nidentity:\n  trusted_proxies: [\"127.0.0.1/32\"]\nper_ip:\n  - { name: ip, algorithm: fixed_window, limit: 1, window: 60s }\n";
    let (gateway, _directory) = start(rest, &format!("http://{upstream}"));
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let call = || {
        let request = Request::post(gateway.url("/echo.Echo/Say"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(Full::new(Bytes::from_static(b"\0\0\0\0\x05hello")))
            .unwrap();
        client.request(request)
    };
    let response = call().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let collected = response.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned().expect("trailers forwarded");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(
        collected.to_bytes(),
        Bytes::from_static(b"\0\0\0\0\x05hello")
    );

    let denied = call().await.unwrap();
    assert_eq!(
        denied.status(),
        StatusCode::OK,
        "gRPC carries its status in grpc-status"
    );
    assert_eq!(denied.headers()["grpc-status"], "8");
    assert_eq!(denied.headers()["content-type"], "application/grpc");
    assert!(denied.headers().contains_key("retry-after"));
    assert!(denied.headers().contains_key("ratelimit-policy"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_and_streaming_work_over_the_tls_listener() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = support::Upstream::start().await;
    let pki = Pki::new("ws");
    let (cert, key_path) = pki.issue("listener", &["127.0.0.1"]);
    let (gateway, _directory) = start_tls_gateway(&upstream, &cert, &key_path);
    let listen = gateway.listen;
    let tls_config = pki.client_config();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls_config));
    let tcp = tokio::net::TcpStream::connect(listen).await.unwrap();
    let mut stream = connector
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap();
    stream
        .write_all(b"GET /ws HTTP/1.1\r\nHost: ws.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        stream.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    stream.write_all(b"ping over tls").await.unwrap();
    let mut echoed = [0u8; 13];
    stream.read_exact(&mut echoed).await.unwrap();
    assert_eq!(&echoed, b"ping over tls");

    // A 32 MiB download streams through.
    let client = tls_client(&pki, false);
    let url = format!(
        "https://127.0.0.1:{}/download?bytes={}",
        listen.port(),
        32 << 20
    );
    let response = client
        .request(Request::get(&url).body(Full::new(Bytes::new())).unwrap())
        .await
        .unwrap();
    let mut body = response.into_body();
    let mut received = 0usize;
    while let Some(frame) = body.frame().await {
        received += frame.unwrap().into_data().map_or(0, |data| data.len());
    }
    assert_eq!(received, 32 << 20);
}
