//! Black-box test support: the real `floodgate` binary, a real upstream, real sockets.

#![allow(dead_code, unreachable_pub)]

use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let path = floodgate_test_support::unique_temp_path(&format!("test-{name}"));
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `text` to `path` by atomic rename, as editors and ConfigMaps do.
pub fn write_atomically(path: &Path, text: &str) {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let temporary = path.with_extension(format!("tmp{}", NEXT.fetch_add(1, Ordering::Relaxed)));
    std::fs::write(&temporary, text).unwrap();
    std::fs::rename(&temporary, path).unwrap();
}

/// Two free loopback addresses: the proxy's and the admin API's.
pub fn addresses() -> (SocketAddr, SocketAddr) {
    let [listen, admin] = distinct_addresses();
    (listen, admin)
}

/// `N` free loopback addresses, all different: each port stays bound until all are chosen
/// (ports picked one at a time may repeat, and a gateway given one address twice refuses
/// its configuration).
pub fn distinct_addresses<const N: usize>() -> [SocketAddr; N] {
    let listeners: Vec<StdListener> = (0..N)
        .map(|_| StdListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::array::from_fn(|index| listeners[index].local_addr().unwrap())
}

/// A config file's text: `listen`, `admin.listen` and `upstream`, then `rest`.
pub fn config_text(listen: SocketAddr, admin: SocketAddr, upstream: &str, rest: &str) -> String {
    format!("listen: \"{listen}\"\nadmin:\n  listen: \"{admin}\"\nupstream: \"{upstream}\"\n{rest}")
}

/// Starts a gateway in front of `upstream` on a fresh config; returns it with its directory.
/// A free port can be taken by another process between its choice and the gateway's bind
/// (tests run in parallel): then the gateway is started again on new ports, up to five times.
pub fn start_gateway(upstream: &str, rest: &str) -> (Gateway, TempDir) {
    let directory = TempDir::new("gw");
    let path = directory.file("floodgate.yaml");
    let mut attempts = 0;
    loop {
        let (listen, admin) = addresses();
        std::fs::write(&path, config_text(listen, admin, upstream, rest)).unwrap();
        let command = Command::new(env!("CARGO_BIN_EXE_floodgate"));
        match Gateway::try_spawn(command, &path, listen, admin) {
            Ok(gateway) => return (gateway, directory),
            Err(log) if attempts < 4 && log.contains("Address already in use") => attempts += 1,
            Err(log) => panic!("gateway did not start:\n{log}"),
        }
    }
}

/// A keep-alive HTTP/1.1 connection of the test's own to `addr` (the gateway), driven by a
/// task.
pub async fn connect(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    sender
}

/// A running `floodgate serve`.
pub struct Gateway {
    pub child: Child,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Gateway {
    /// Starts the gateway on `config` (which must use `listen` and `admin`), and returns once it
    /// logs that it is serving.
    pub fn start(config: &Path, listen: SocketAddr, admin: SocketAddr) -> Gateway {
        Gateway::start_with_env(config, listen, admin, &[])
    }

    /// Like [`Gateway::start`], with extra environment variables for the process.
    pub fn start_with_env(
        config: &Path,
        listen: SocketAddr,
        admin: SocketAddr,
        env: &[(&str, &str)],
    ) -> Gateway {
        let mut command = Command::new(env!("CARGO_BIN_EXE_floodgate"));
        command.envs(env.iter().copied());
        Gateway::spawn(command, config, listen, admin)
    }

    /// Like [`Gateway::start`], under an open-file limit of `descriptors` (set by the shell's
    /// `ulimit -n` before it execs the binary).
    pub fn start_with_open_file_limit(
        config: &Path,
        listen: SocketAddr,
        admin: SocketAddr,
        descriptors: u32,
    ) -> Gateway {
        let mut command = Command::new("sh");
        command.args([
            "-c",
            &format!("ulimit -n {descriptors} && exec \"$0\" \"$@\""),
            env!("CARGO_BIN_EXE_floodgate"),
        ]);
        Gateway::spawn(command, config, listen, admin)
    }

    fn spawn(command: Command, config: &Path, listen: SocketAddr, admin: SocketAddr) -> Gateway {
        Gateway::try_spawn(command, config, listen, admin)
            .unwrap_or_else(|log| panic!("gateway did not start:\n{log}"))
    }

    /// Starts the gateway; its log when it does not say it serves within 20 s.
    fn try_spawn(
        mut command: Command,
        config: &Path,
        listen: SocketAddr,
        admin: SocketAddr,
    ) -> Result<Gateway, String> {
        // Many tests count in one-minute fixed windows, which are aligned to the epoch: a
        // gateway started in a minute's last seconds would see its counts restart mid-test.
        floodgate_test_support::clear_of_window_end(
            Duration::from_secs(60),
            Duration::from_secs(3),
        );
        let mut child = command
            .args(["--log-format", "json", "serve", "--config"])
            .arg(config)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the floodgate binary runs");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("floodgate serving") {
                    let _ = ready_tx.send(());
                }
                lines.lock().unwrap().push(line);
            }
        });
        if ready_rx.recv_timeout(Duration::from_secs(20)).is_err() {
            let _ = child.kill();
            let _ = child.wait();
            return Err(log.lock().unwrap().join("\n"));
        }
        Ok(Gateway {
            child,
            listen,
            admin,
            log,
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.listen)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args(["-s", signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// The first log line for which `what` holds, waiting up to 5 s for it (the process
    /// writes its log as it goes; a line may follow the answer that caused it).
    pub fn wait_for_log(&self, what: impl Fn(&str) -> bool, description: &str) -> String {
        let started = std::time::Instant::now();
        loop {
            if let Some(line) = self.log.lock().unwrap().iter().find(|line| what(line)) {
                return line.clone();
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "no log line {description}:\n{}",
                self.log.lock().unwrap().join("\n")
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Peak resident memory of the gateway process, in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        self.memory_kib("VmHWM:")
    }

    /// Resident memory of the gateway process now, in KiB.
    pub fn rss_kib(&self) -> u64 {
        self.memory_kib("VmRSS:")
    }

    /// The `field` line of the process's `/proc/<pid>/status`, in KiB.
    fn memory_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|line| line.strip_prefix(field))
            .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `store:` section of a gateway on the Redis at `url`, with a deadline generous for tests.
pub fn redis_store(url: &str) -> String {
    format!("store: {{ backend: redis, url: \"{url}\", timeout: 2s }}\n")
}

/// The `store:` section of a gateway on a Redis Cluster seeded by `urls`.
pub fn cluster_store(urls: &[String]) -> String {
    let nodes = floodgate_test_support::yaml_items(urls);
    format!("store: {{ backend: redis_cluster, nodes: [{nodes}], timeout: 2s }}\n")
}

/// The `store:` section of a gateway on sharded Redis over `urls`.
pub fn sharded_store(urls: &[String]) -> String {
    let nodes = floodgate_test_support::yaml_items(urls);
    format!("store: {{ backend: redis_sharded, nodes: [{nodes}], timeout: 2s }}\n")
}

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

/// One admin API call: `method` on `path_and_query`, with a JSON `body` and the bearer
/// `token` when given; the status and the JSON answer (`null` when it is not JSON).
pub async fn admin_call(
    client: &TestClient,
    gateway: &Gateway,
    method: http::Method,
    path_and_query: &str,
    body: Option<serde_json::Value>,
    token: Option<&str>,
) -> (StatusCode, serde_json::Value) {
    let mut request = Request::builder()
        .method(method)
        .uri(gateway.admin_url(path_and_query));
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let body = body.map_or_else(Bytes::new, |body| Bytes::from(body.to_string()));
    let response = client
        .request(request.body(Full::new(body)).unwrap())
        .await
        .expect("admin answers");
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    )
}

/// `POST /admin/reload`: its status and JSON body.
pub async fn admin_reload(
    client: &TestClient,
    gateway: &Gateway,
) -> (StatusCode, serde_json::Value) {
    let response = client
        .request(
            Request::post(gateway.admin_url("/admin/reload"))
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap())
}

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// Sends a GET with `headers`; returns status, headers and body.
pub async fn get(client: &TestClient, url: &str, headers: &[(&str, &str)]) -> Response<Bytes> {
    let mut request = Request::builder().uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = client
        .request(request.body(Full::new(Bytes::new())).unwrap())
        .await
        .expect("gateway answers");
    let (parts, body) = response.into_parts();
    Response::from_parts(parts, body.collect().await.unwrap().to_bytes())
}

/// The upstream: echoes what it received, streams large bodies, sleeps, upgrades.
pub struct Upstream {
    pub addr: SocketAddr,
    /// Notified whenever a `/slow` request arrives.
    pub slow_arrived: Arc<tokio::sync::Notify>,
    /// Connections accepted so far.
    pub connections: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn query_number(request: &Request<Incoming>, name: &str) -> u64 {
    request
        .uri()
        .query()
        .and_then(|query| {
            query
                .split('&')
                .find_map(|pair| pair.strip_prefix(&format!("{name}=")))
        })
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

type UpstreamBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

async fn upstream_handler(
    mut request: Request<Incoming>,
    slow_arrived: Arc<tokio::sync::Notify>,
) -> Result<Response<UpstreamBody>, Infallible> {
    let full = |text: String| Full::new(Bytes::from(text)).boxed();
    match request.uri().path() {
        "/download" => {
            let total = query_number(&request, "bytes");
            let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
            Ok(Response::new(
                ChunkBody {
                    chunk,
                    remaining: total,
                }
                .boxed(),
            ))
        }
        "/upload" => {
            let mut received = 0u64;
            let mut body = request.into_body();
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.map(|frame| frame.into_data()) {
                    received += data.map_or(0, |data| data.len() as u64);
                }
            }
            Ok(Response::new(full(received.to_string())))
        }
        "/tokens" => {
            // Reports the query's `used` (any text) as the request's real cost.
            let used = request
                .uri()
                .query()
                .and_then(|query| query.split('&').find_map(|pair| pair.strip_prefix("used=")))
                .unwrap_or("")
                .to_owned();
            let mut response = Response::new(full("completion".to_owned()));
            response
                .headers_mut()
                .insert("x-tokens-used", used.parse().unwrap());
            Ok(response)
        }
        "/slow" => {
            slow_arrived.notify_one();
            tokio::time::sleep(Duration::from_millis(query_number(&request, "ms"))).await;
            Ok(Response::new(full("slow done".to_owned())))
        }
        "/ws" => {
            let upgrade = hyper::upgrade::on(&mut request);
            tokio::spawn(async move {
                if let Ok(upgraded) = upgrade.await {
                    let mut io = TokioIo::new(upgraded);
                    let (mut reader, mut writer) = tokio::io::split(&mut io);
                    let _ = tokio::io::copy(&mut reader, &mut writer).await;
                }
            });
            let mut response = Response::new(full(String::new()));
            *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            response
                .headers_mut()
                .insert("connection", "upgrade".parse().unwrap());
            response
                .headers_mut()
                .insert("upgrade", "websocket".parse().unwrap());
            Ok(response)
        }
        _ => {
            let headers: serde_json::Map<String, serde_json::Value> = request
                .headers()
                .iter()
                .map(|(name, value)| (name.to_string(), value.to_str().unwrap_or("").into()))
                .collect();
            let echo = serde_json::json!({
                "method": request.method().as_str(),
                "path": request.uri().path(),
                "query": request.uri().query(),
                "headers": headers,
            });
            let mut response = Response::new(full(echo.to_string()));
            // Hop-by-hop headers the gateway must strip on the way back.
            response
                .headers_mut()
                .insert("keep-alive", "timeout=5".parse().unwrap());
            response
                .headers_mut()
                .insert("x-upstream-private", "1".parse().unwrap());
            response
                .headers_mut()
                .insert("connection", "x-upstream-private".parse().unwrap());
            Ok(response)
        }
    }
}

/// A body of `remaining` bytes sent in 64 KiB frames, generated as it is read.
pub struct ChunkBody {
    pub chunk: Bytes,
    pub remaining: u64,
}

impl http_body::Body for ChunkBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.remaining == 0 {
            return std::task::Poll::Ready(None);
        }
        let size = self.remaining.min(self.chunk.len() as u64) as usize;
        self.remaining -= size as u64;
        std::task::Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..size)))))
    }
}

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let slow_arrived = Arc::new(tokio::sync::Notify::new());
        let notify = slow_arrived.clone();
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let accepted = connections.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let notify = notify.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        upstream_handler(request, notify.clone())
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .with_upgrades()
                        .await;
                });
            }
        });
        Upstream {
            addr,
            slow_arrived,
            connections,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}
