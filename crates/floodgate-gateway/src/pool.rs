//! A `per_core` worker's own HTTP/1.1 connections to plain-`http` upstreams.
//!
//! hyper-util's pooled client is general: a pool behind a mutex, a checkout future racing a new
//! connection against an idle one, and, when a response's body is still being read, a task
//! spawned per request to put the connection back once it is idle. On a worker thread none of
//! that is needed: the thread owns its connections, so they sit in a thread-local list, and a
//! connection goes back to it when the response body that was using it is dropped after its
//! end (an incomplete body closes the connection instead, as HTTP/1.1 requires).
//!
//! Each connection is still driven by a task of its own (hyper's `Connection`), on the worker
//! that made it. A connection the upstream closed while idle is noticed at checkout; a request
//! a stale connection refused before anything was written goes out once more on another
//! connection (hyper hands the unsent request back), as hyper-util's client does.

use std::cell::RefCell;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::client_body::ClientBody;

/// Idle connections kept per upstream and worker (hyper-util's client kept 256 per host).
const MAX_IDLE: usize = 256;

/// An idle connection older than this is closed rather than reused (hyper-util's default).
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

struct Idle {
    sender: SendRequest<ClientBody>,
    since: Instant,
}

thread_local! {
    /// The calling worker's idle connections, by upstream: a deployment has few upstreams, so
    /// a list beats a hash map.
    static IDLE: RefCell<Vec<(Authority, Vec<Idle>)>> = const { RefCell::new(Vec::new()) };
}

/// Why an upstream request failed before a response head came back.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The connection could not be made.
    #[error("connect to {authority}: {source}")]
    Connect {
        /// The upstream.
        authority: Authority,
        /// What the socket said.
        source: std::io::Error,
    },
    /// The HTTP exchange failed (handshake, a closed connection, a malformed response).
    #[error(transparent)]
    Http(#[from] hyper::Error),
}

/// Sends `request` (origin-form URI, `Host` set) to `authority` over one of the worker's
/// connections, or a new one; the response's body gives the connection back when it is done.
pub async fn send(
    authority: &Authority,
    mut request: Request<ClientBody>,
) -> Result<Response<UpstreamBody>, PoolError> {
    loop {
        let (mut sender, reused) = match checkout(authority) {
            Some(sender) => (sender, true),
            None => (connect(authority).await?, false),
        };
        match sender.try_send_request(request).await {
            Ok(response) => {
                let give_back =
                    (response.status() != http::StatusCode::SWITCHING_PROTOCOLS).then(|| {
                        GiveBack {
                            authority: authority.clone(),
                            sender,
                        }
                    });
                return Ok(response.map(|body| UpstreamBody {
                    body,
                    ended: false,
                    give_back,
                }));
            }
            Err(mut error) => match error.take_message() {
                // A stale idle connection that refused the request before writing any of
                // it: the request is intact, try the next connection.
                Some(unsent) if reused => request = unsent,
                _ => return Err(error.into_error().into()),
            },
        }
    }
}

/// The most recently used idle connection to `authority` that can take a request now. Closed
/// and expired ones are dropped on the way; one still finishing its last exchange is kept.
fn checkout(authority: &Authority) -> Option<SendRequest<ClientBody>> {
    IDLE.with_borrow_mut(|upstreams| {
        let (_, idle) = upstreams.iter_mut().find(|(known, _)| known == authority)?;
        let now = Instant::now();
        let mut busy = Vec::new();
        let mut found = None;
        while let Some(entry) = idle.pop() {
            if entry.sender.is_closed() || now.duration_since(entry.since) > IDLE_TIMEOUT {
                continue;
            }
            if entry.sender.is_ready() {
                found = Some(entry.sender);
                break;
            }
            busy.push(entry);
        }
        // Under the ready ones, oldest first: the next checkout looks at them last.
        idle.splice(0..0, busy.into_iter().rev());
        found
    })
}

/// Puts a connection that finished its exchange back on the calling worker's list.
fn give_back(authority: Authority, sender: SendRequest<ClientBody>) {
    if sender.is_closed() {
        return;
    }
    // A body dropped while its thread is being torn down has no list to go back to.
    let _ = IDLE.try_with(|upstreams| {
        let mut upstreams = upstreams.borrow_mut();
        let idle = match upstreams.iter().position(|(known, _)| *known == authority) {
            Some(index) => &mut upstreams[index].1,
            None => {
                upstreams.push((authority, Vec::new()));
                &mut upstreams.last_mut().expect("just pushed").1
            }
        };
        if idle.len() < MAX_IDLE {
            idle.push(Idle {
                sender,
                since: Instant::now(),
            });
        }
    });
}

/// A new connection to `authority` (port 80 unless it names one), driven by a task of the
/// calling worker.
async fn connect(authority: &Authority) -> Result<SendRequest<ClientBody>, PoolError> {
    let connected = match authority.port_u16() {
        Some(_) => TcpStream::connect(authority.as_str()).await,
        None => TcpStream::connect((authority.host(), 80)).await,
    };
    let stream = connected.map_err(|source| PoolError::Connect {
        authority: authority.clone(),
        source,
    })?;
    let _ = stream.set_nodelay(true);
    let (sender, connection) = http1::Builder::new()
        .handshake(TokioIo::new(stream))
        .await?;
    tokio::spawn(async move {
        if let Err(error) = connection.with_upgrades().await {
            tracing::debug!(%error, "upstream connection ended with an error");
        }
    });
    Ok(sender)
}

/// The connection a response came on, to go back to the worker's list after its body.
struct GiveBack {
    authority: Authority,
    sender: SendRequest<ClientBody>,
}

/// An upstream response's body. Read to its end and dropped, it gives its connection back for
/// the next request; dropped earlier, the connection closes.
pub struct UpstreamBody {
    body: Incoming,
    ended: bool,
    give_back: Option<GiveBack>,
}

impl From<Incoming> for UpstreamBody {
    /// A body whose connection is not this module's (hyper-util's client, an upgrade).
    fn from(body: Incoming) -> Self {
        UpstreamBody {
            body,
            ended: false,
            give_back: None,
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.ended = true,
            Poll::Ready(Some(Err(_))) => self.give_back = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        if (self.ended || self.body.is_end_stream())
            && let Some(GiveBack { authority, sender }) = self.give_back.take()
        {
            give_back(authority, sender);
        }
    }
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("pooled", &self.give_back.is_some())
            .finish_non_exhaustive()
    }
}
