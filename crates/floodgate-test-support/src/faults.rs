//! A fault-injecting TCP proxy, placed between a store (or any Redis client) and a Redis server,
//! so that a test can make the network misbehave in the ways that decide a limiter's edges:
//! replies that come late, commands applied but never answered, a node gone silent, a node
//! gone.
//!
//! ```no_run
//! use std::time::Duration;
//! use floodgate_test_support::{RedisServer, faults::{Fault, FaultProxy}};
//!
//! let server = RedisServer::start();
//! let proxy = FaultProxy::start(server.port());
//! // A store built on `proxy.url()` now talks to `server` through the proxy.
//! proxy.set(Fault::DelayReplies(Duration::from_millis(300)));
//! // ... every reply reaches the client 300ms after Redis sent it ...
//! proxy.set(Fault::None);
//! ```
//!
//! The proxy runs on a thread of its own with its own single-threaded Tokio runtime, so it
//! works the same under any test runtime (or none), and a test's runtime being busy or blocked
//! never delays it. [`FaultProxy::set`] may be called from any thread at any moment: every byte
//! that reaches the proxy after `set` returns is handled under the new fault, on new and
//! existing connections alike. Dropping the proxy stops it and closes every connection.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

/// How the proxy treats traffic, switchable at any time with [`FaultProxy::set`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fault {
    /// Plain forwarding both ways.
    #[default]
    None,
    /// Commands reach the server at once (so they run); each reply reaches the client this long
    /// after the server sent it. A client whose deadline is shorter sees an error although the
    /// server applied the command. Replies already held when the fault changes keep their time.
    DelayReplies(Duration),
    /// A link with this one-way delay: what the client sends reaches the server this long
    /// after it reached the proxy, and each reply reaches the client this long after the
    /// server sent it (a round trip of twice the delay, as across an ocean). Bytes already
    /// held when the fault changes keep their time.
    Latency(Duration),
    /// What the client sends is forwarded; once the server answers, the answer is discarded and
    /// the connection closed on both sides: applied, but never seen by the client.
    DropAfterForward,
    /// [`Fault::DropAfterForward`] once, for a script call: the next `FCALL`, `EVALSHA` or
    /// `EVAL` forwarded on any connection is applied, its answer discarded and that connection
    /// closed, and the proxy is back to [`Fault::None`] (what a client library sees when a
    /// connection breaks after Redis ran its call; whatever it sends next, a re-send included,
    /// goes through). Other commands (a pool's `PING`, a slot map) pass meanwhile.
    DropNextCall,
    /// [`Fault::DropNextCall`] for the next script call whose bytes hold this text (a mode
    /// such as floodgate's `refund` or `lease`): the fault aimed at one kind of call.
    DropNextCallWith(&'static str),
    /// [`Fault::DropNextCall`] for every script call while it is set: each is applied and its
    /// connection closed before the answer, while other commands (a new connection's
    /// handshake, a pool's `PING`) pass, so a client that sends a call again on a new
    /// connection has it applied again.
    DropCalls,
    /// A node gone silent: connections are accepted and read, nothing is forwarded either way
    /// and nothing answered (replies already held back are lost too). A connection that
    /// swallowed anything is closed when the fault changes, since the client and the server can
    /// no longer agree on which reply answers which command; one that did not carries on.
    BlackHole,
    /// A connection gone silent for good, the server being fine: the connections open when it
    /// is set swallow everything from then on and are never closed, whatever the fault later
    /// becomes (a peer whose host vanished, a firewall or NAT that forgot the connection:
    /// nothing answers, nothing closes, and the kernel of a real client would go on
    /// retransmitting for minutes), while connections accepted after it was set forward
    /// plainly, so that a client that gives up the silent connection for a new one is served.
    Strand,
    /// A node gone: existing connections are closed, and new ones closed as soon as they are
    /// accepted (the port stays bound, so a later [`Fault::None`] brings it back on the same
    /// address: clients see a reset, not a refused connect).
    Refuse,
}

/// What went through the proxy so far.
#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    forwarded: AtomicU64,
    delivered: AtomicU64,
    swallowed: AtomicU64,
}

/// A fault-injecting TCP proxy on a free loopback port in front of an upstream address. See
/// the [module docs](self).
pub struct FaultProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    fault: Arc<watch::Sender<Fault>>,
    counters: Arc<Counters>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.upstream)
            .field("fault", &self.fault())
            .finish_non_exhaustive()
    }
}

/// How long the proxy waits for the upstream to accept a connection before closing the
/// client's: an upstream that is gone (a killed server) refuses at once on loopback, so this
/// only bounds an upstream that is itself stuck.
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

impl FaultProxy {
    /// Starts a proxy in front of `127.0.0.1:upstream_port`, forwarding plainly.
    pub fn start(upstream_port: u16) -> FaultProxy {
        FaultProxy::start_to(SocketAddr::from(([127, 0, 0, 1], upstream_port)))
    }

    /// Starts a proxy in front of `upstream`, forwarding plainly. The upstream need not be up
    /// yet: the proxy connects to it once per accepted connection.
    pub fn start_to(upstream: SocketAddr) -> FaultProxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let addr = listener.local_addr().expect("the listener's address");
        let (fault, watching) = watch::channel(Fault::None);
        let fault = Arc::new(fault);
        let control = fault.clone();
        let counters = Arc::new(Counters::default());
        let (stop, stopped) = oneshot::channel();
        let thread_counters = counters.clone();
        let thread = std::thread::Builder::new()
            .name(format!("fault-proxy-{}", addr.port()))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the proxy's runtime");
                runtime.block_on(async move {
                    let listener = TcpListener::from_std(listener).expect("a tokio listener");
                    tokio::select! {
                        () = accept_loop(listener, upstream, (watching, control), thread_counters) => {}
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime here drops every connection's task, closing its sockets.
            })
            .expect("spawn the proxy's thread");
        FaultProxy {
            addr,
            upstream,
            fault,
            counters,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Switches to `fault`, for new and existing connections: every byte that reaches the proxy
    /// after this returns is handled under it.
    pub fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// The fault in effect.
    pub fn fault(&self) -> Fault {
        *self.fault.borrow()
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `redis://127.0.0.1:<port>`: the proxy's address as a Redis URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port())
    }

    /// The address the proxy forwards to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Connections accepted so far (including those closed at once under [`Fault::Refuse`]).
    pub fn connections_accepted(&self) -> u64 {
        self.counters.accepted.load(Ordering::SeqCst)
    }

    /// Bytes forwarded from clients to the upstream so far.
    pub fn bytes_forwarded(&self) -> u64 {
        self.counters.forwarded.load(Ordering::SeqCst)
    }

    /// Bytes of replies delivered from the upstream to clients so far.
    pub fn bytes_delivered(&self) -> u64 {
        self.counters.delivered.load(Ordering::SeqCst)
    }

    /// Bytes read and thrown away so far, either way ([`Fault::BlackHole`], the reply that
    /// [`Fault::DropAfterForward`] discards).
    pub fn bytes_swallowed(&self) -> u64 {
        self.counters.swallowed.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The fault as every connection reads it, and the handle a one-shot fault
/// ([`Fault::DropNextCall`]) uses to end itself.
type FaultWatch = (watch::Receiver<Fault>, Arc<watch::Sender<Fault>>);

/// Whether `bytes` (as a client sent them) hold a script call.
fn is_script_call(bytes: &[u8]) -> bool {
    [&b"FCALL"[..], b"EVALSHA", b"EVAL"]
        .iter()
        .any(|name| holds(bytes, name))
}

/// Whether `bytes` hold `text`, in any case.
fn holds(bytes: &[u8], text: &[u8]) -> bool {
    bytes
        .windows(text.len())
        .any(|window| window.eq_ignore_ascii_case(text))
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    (fault, control): FaultWatch,
    counters: Arc<Counters>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        counters.accepted.fetch_add(1, Ordering::SeqCst);
        if *fault.borrow() == Fault::Refuse {
            drop(client);
            continue;
        }
        let (watch, counters) = ((fault.clone(), control.clone()), counters.clone());
        tokio::spawn(async move {
            let _ = client.set_nodelay(true);
            Connection::new(client, upstream, watch, counters)
                .serve()
                .await;
        });
    }
}

/// One client connection and, once it is needed, its connection to the upstream.
struct Connection {
    client: TcpStream,
    upstream_addr: SocketAddr,
    /// Connected when the first byte is to be forwarded, so that a connection accepted while
    /// the node is a black hole does not reach the server at all.
    upstream: Option<TcpStream>,
    fault: watch::Receiver<Fault>,
    /// Ends a one-shot fault once a connection has taken it.
    control: Arc<watch::Sender<Fault>>,
    counters: Arc<Counters>,
    /// Replies held back by [`Fault::DelayReplies`] and [`Fault::Latency`], with when each
    /// may go, in order.
    held: VecDeque<(Instant, Vec<u8>)>,
    /// Commands held back by [`Fault::Latency`], with when each may go, in order.
    outbound: VecDeque<(Instant, Vec<u8>)>,
    /// [`Fault::DropAfterForward`] (or [`Fault::DropNextCall`]) forwarded something: the next
    /// reply is discarded and the connection closed.
    dropping: bool,
    /// [`Fault::BlackHole`] threw bytes away on this connection.
    swallowed: bool,
    /// Silent for good ([`Fault::Strand`] was set while it was open).
    stranded: bool,
    /// Accepted while [`Fault::Strand`] was in effect: not one of the connections it strands.
    accepted_after_strand: bool,
}

/// Why a connection's loop goes on or ends.
enum Next {
    Continue,
    Close,
}

impl Connection {
    fn new(
        client: TcpStream,
        upstream_addr: SocketAddr,
        (fault, control): FaultWatch,
        counters: Arc<Counters>,
    ) -> Connection {
        let accepted_after_strand = *fault.borrow() == Fault::Strand;
        Connection {
            client,
            upstream_addr,
            upstream: None,
            fault,
            control,
            counters,
            held: VecDeque::new(),
            outbound: VecDeque::new(),
            dropping: false,
            swallowed: false,
            stranded: false,
            accepted_after_strand,
        }
    }

    /// The fault in effect now: read at the moment bytes are handled (not when the loop last
    /// went round), so that bytes arriving after [`FaultProxy::set`] returned see the new one.
    /// [`Fault::Strand`] is this connection's for good once it saw it, and [`Fault::None`] for
    /// a connection accepted while it was in effect.
    fn current(&mut self) -> Fault {
        let fault = *self.fault.borrow_and_update();
        if fault != Fault::Strand {
            self.accepted_after_strand = false;
        } else if !self.accepted_after_strand {
            self.stranded = true;
        }
        match fault {
            _ if self.stranded => Fault::Strand,
            Fault::Strand => Fault::None,
            fault => fault,
        }
    }

    /// Whether the connection must end under `fault` before handling anything more.
    fn must_close(&self, fault: Fault) -> bool {
        fault == Fault::Refuse
            || (self.swallowed && !matches!(fault, Fault::BlackHole | Fault::Strand))
    }

    async fn serve(mut self) {
        if self.current() != Fault::BlackHole && self.connect().await.is_err() {
            return;
        }
        let mut from_client = vec![0u8; 64 * 1024];
        let mut from_upstream = vec![0u8; 64 * 1024];
        loop {
            let fault = self.current();
            if self.must_close(fault) {
                return;
            }
            let next_release = self.held.front().map(|(at, _)| *at);
            let next_send = self.outbound.front().map(|(at, _)| *at);
            let upstream = self.upstream.as_mut();
            let next = tokio::select! {
                changed = self.fault.changed() => {
                    if changed.is_err() { Next::Close } else { Next::Continue }
                }
                read = self.client.read(&mut from_client) => match read {
                    Ok(0) | Err(_) => Next::Close,
                    Ok(read) => self.on_client_bytes(&from_client[..read]).await,
                },
                read = read_from(upstream, &mut from_upstream) => match read {
                    Ok(0) | Err(_) => Next::Close,
                    Ok(read) => self.on_upstream_bytes(&from_upstream[..read]).await,
                },
                () = tokio::time::sleep_until(next_release.unwrap_or_else(Instant::now)),
                    if next_release.is_some() => self.release_due().await,
                () = tokio::time::sleep_until(next_send.unwrap_or_else(Instant::now)),
                    if next_send.is_some() => self.send_due().await,
            };
            if let Next::Close = next {
                return;
            }
        }
    }

    async fn connect(&mut self) -> std::io::Result<()> {
        let connect = TcpStream::connect(self.upstream_addr);
        let upstream = tokio::time::timeout(UPSTREAM_CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        let _ = upstream.set_nodelay(true);
        self.upstream = Some(upstream);
        Ok(())
    }

    async fn on_client_bytes(&mut self, bytes: &[u8]) -> Next {
        match self.current() {
            Fault::Refuse => Next::Close,
            Fault::BlackHole | Fault::Strand => self.swallow(bytes),
            fault => {
                if self.must_close(fault) {
                    return Next::Close;
                }
                if let Fault::Latency(delay) = fault {
                    self.outbound
                        .push_back((Instant::now() + delay, bytes.to_vec()));
                    return Next::Continue;
                }
                if !self.outbound.is_empty() {
                    // Behind the commands still held, so that commands keep their order.
                    self.outbound.push_back((Instant::now(), bytes.to_vec()));
                    return Next::Continue;
                }
                self.forward(bytes, fault).await
            }
        }
    }

    /// Sends every held command whose time has come.
    async fn send_due(&mut self) -> Next {
        let now = Instant::now();
        while self.outbound.front().is_some_and(|(at, _)| *at <= now) {
            let Some((_, bytes)) = self.outbound.pop_front() else {
                break;
            };
            let fault = self.current();
            let next = match fault {
                Fault::Refuse => Next::Close,
                Fault::BlackHole | Fault::Strand => self.swallow(&bytes),
                _ => self.forward(&bytes, fault).await,
            };
            if let Next::Close = next {
                return Next::Close;
            }
        }
        Next::Continue
    }

    /// Writes `bytes` to the upstream (connecting first if needed), under `fault`.
    async fn forward(&mut self, bytes: &[u8], fault: Fault) -> Next {
        if self.upstream.is_none() && self.connect().await.is_err() {
            return Next::Close;
        }
        let Some(upstream) = self.upstream.as_mut() else {
            return Next::Close;
        };
        if upstream.write_all(bytes).await.is_err() {
            return Next::Close;
        }
        self.counters
            .forwarded
            .fetch_add(bytes.len() as u64, Ordering::SeqCst);
        if fault == Fault::DropAfterForward
            || (fault == Fault::DropCalls && is_script_call(bytes))
            || (fault == Fault::DropNextCall && is_script_call(bytes) && self.take_once(fault))
            || (matches!(fault, Fault::DropNextCallWith(text) if holds(bytes, text.as_bytes()))
                && is_script_call(bytes)
                && self.take_once(fault))
        {
            self.dropping = true;
        }
        Next::Continue
    }

    /// Takes [`Fault::DropNextCall`] for this connection, if no other connection took it
    /// first, and puts the proxy back to [`Fault::None`].
    fn take_once(&mut self, once: Fault) -> bool {
        let taken = self.control.send_if_modified(|fault| {
            let this_one = *fault == once;
            if this_one {
                *fault = Fault::None;
            }
            this_one
        });
        // The change is this connection's own doing: not one to wake its loop for.
        self.fault.borrow_and_update();
        taken
    }

    async fn on_upstream_bytes(&mut self, bytes: &[u8]) -> Next {
        if self.dropping {
            // The server answered what was forwarded under DropAfterForward: it was applied,
            // and the client never learns.
            self.swallow(bytes);
            return Next::Close;
        }
        match self.current() {
            Fault::Refuse => Next::Close,
            Fault::BlackHole | Fault::Strand => self.swallow(bytes),
            Fault::DropAfterForward => {
                self.swallow(bytes);
                Next::Close
            }
            Fault::DelayReplies(delay) | Fault::Latency(delay) => {
                self.held
                    .push_back((Instant::now() + delay, bytes.to_vec()));
                Next::Continue
            }
            Fault::None | Fault::DropNextCall | Fault::DropNextCallWith(_) | Fault::DropCalls
                if !self.held.is_empty() =>
            {
                // Behind the replies still held, so that replies keep their order.
                self.held.push_back((Instant::now(), bytes.to_vec()));
                Next::Continue
            }
            Fault::None | Fault::DropNextCall | Fault::DropNextCallWith(_) | Fault::DropCalls => {
                self.deliver(bytes).await
            }
        }
    }

    /// Delivers every held reply whose time has come.
    async fn release_due(&mut self) -> Next {
        let now = Instant::now();
        while self.held.front().is_some_and(|(at, _)| *at <= now) {
            let Some((_, bytes)) = self.held.pop_front() else {
                break;
            };
            let next = match self.current() {
                Fault::Refuse => Next::Close,
                Fault::BlackHole | Fault::Strand => self.swallow(&bytes),
                _ => self.deliver(&bytes).await,
            };
            if let Next::Close = next {
                return Next::Close;
            }
        }
        Next::Continue
    }

    async fn deliver(&mut self, bytes: &[u8]) -> Next {
        if self.client.write_all(bytes).await.is_err() {
            return Next::Close;
        }
        self.counters
            .delivered
            .fetch_add(bytes.len() as u64, Ordering::SeqCst);
        Next::Continue
    }

    fn swallow(&mut self, bytes: &[u8]) -> Next {
        self.swallowed = true;
        self.counters
            .swallowed
            .fetch_add(bytes.len() as u64, Ordering::SeqCst);
        Next::Continue
    }
}

/// Reads from the upstream if there is one; never completes if not.
async fn read_from(upstream: Option<&mut TcpStream>, buffer: &mut [u8]) -> std::io::Result<usize> {
    match upstream {
        Some(upstream) => upstream.read(buffer).await,
        None => std::future::pending().await,
    }
}
