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
//! connection (hyper hands the unsent request back), as hyper-util's client does. Idle
//! connections older than 90 s are closed by the worker's next checkout after its periodic
//! sweep (a worker with no traffic keeps them until then). A host name's addresses are tried
//! in turn, without hyper-util's IPv6-to-IPv4 fallback after 300 ms.

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

use crate::proxy::client_body::ClientBody;

/// Idle connections kept per upstream and worker (hyper-util's client kept 256 per host).
const MAX_IDLE: usize = 256;

/// An idle connection older than this is closed rather than reused (hyper-util's default).
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// How often a worker that is checking connections out also closes every expired or closed
/// idle connection it holds, for every upstream (those deep in a list, and those of upstreams a
/// reload removed, which no checkout reaches).
const SWEEP_EVERY: Duration = Duration::from_secs(30);

struct Idle {
    sender: SendRequest<ClientBody>,
    since: Instant,
}

impl Idle {
    /// Closed by the upstream, or idle too long to be trusted.
    fn is_stale(&self, now: Instant) -> bool {
        self.sender.is_closed() || now.duration_since(self.since) > IDLE_TIMEOUT
    }
}

/// A worker's idle connections, by upstream: a deployment has few upstreams, so a list beats a
/// hash map.
struct IdleLists {
    upstreams: Vec<(Authority, Vec<Idle>)>,
    swept_at: Option<Instant>,
}

impl IdleLists {
    /// Every [`SWEEP_EVERY`], drops every stale connection, and the lists left empty.
    fn sweep_if_due(&mut self, now: Instant) {
        if self
            .swept_at
            .is_some_and(|swept| now.duration_since(swept) < SWEEP_EVERY)
        {
            return;
        }
        self.swept_at = Some(now);
        for (_, idle) in &mut self.upstreams {
            idle.retain(|entry| !entry.is_stale(now));
        }
        self.upstreams.retain(|(_, idle)| !idle.is_empty());
    }

    fn list(&mut self, authority: &Authority) -> Option<&mut Vec<Idle>> {
        self.upstreams
            .iter_mut()
            .find(|(known, _)| known == authority)
            .map(|(_, idle)| idle)
    }
}

thread_local! {
    /// The calling worker's idle connections.
    static IDLE: RefCell<IdleLists> = const {
        RefCell::new(IdleLists { upstreams: Vec::new(), swept_at: None })
    };
}

/// Why an upstream request failed before a response head came back.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PoolError {
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
pub(crate) async fn send(
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
    IDLE.with_borrow_mut(|lists| {
        let now = Instant::now();
        lists.sweep_if_due(now);
        let idle = lists.list(authority)?;
        let mut busy = Vec::new();
        let mut found = None;
        while let Some(entry) = idle.pop() {
            if entry.is_stale(now) {
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
    let _ = IDLE.try_with(|lists| {
        let mut lists = lists.borrow_mut();
        let entry = Idle {
            sender,
            since: Instant::now(),
        };
        match lists.list(&authority) {
            Some(idle) if idle.len() < MAX_IDLE => idle.push(entry),
            // Full: this connection closes.
            Some(_) => {}
            None => lists.upstreams.push((authority, vec![entry])),
        }
    });
}

/// The host (an IPv6 address without its brackets) and port (80 unless named) to dial.
fn dial_target(authority: &Authority) -> (&str, u16) {
    let host = authority.host();
    let host = host
        .strip_prefix('[')
        .and_then(|inner| inner.strip_suffix(']'))
        .unwrap_or(host);
    (host, authority.port_u16().unwrap_or(80))
}

/// A new connection to `authority`, driven by a task of the calling worker.
async fn connect(authority: &Authority) -> Result<SendRequest<ClientBody>, PoolError> {
    let connected = TcpStream::connect(dial_target(authority)).await;
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
pub(crate) struct UpstreamBody {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection over an in-memory pipe, its task running; and the pipe's other end.
    async fn connection() -> (SendRequest<ClientBody>, tokio::io::DuplexStream) {
        let (ours, theirs) = tokio::io::duplex(1024);
        let (mut sender, connection) = http1::handshake(TokioIo::new(ours)).await.unwrap();
        tokio::spawn(connection);
        sender.ready().await.unwrap();
        (sender, theirs)
    }

    /// Regression: a checkout only looked at the top of its own upstream's list, so idle
    /// connections under it, and every connection of an upstream no longer used (a reload
    /// removed it), stayed open for good.
    #[tokio::test]
    async fn a_checkout_also_closes_stale_connections_deep_in_every_list() {
        let (used, _pipe) = connection().await;
        let (expired, _other_pipe) = connection().await;
        let (closed, pipe) = connection().await;
        drop(pipe);
        while !closed.is_closed() {
            tokio::task::yield_now().await;
        }
        let current: Authority = "current:80".parse().unwrap();
        let removed: Authority = "removed:80".parse().unwrap();
        let now = Instant::now();
        let long_ago = now.checked_sub(IDLE_TIMEOUT * 2).unwrap();
        IDLE.with_borrow_mut(|lists| {
            lists.upstreams.push((
                current.clone(),
                vec![
                    Idle {
                        sender: expired,
                        since: long_ago,
                    },
                    Idle {
                        sender: used,
                        since: now,
                    },
                ],
            ));
            lists.upstreams.push((
                removed,
                vec![Idle {
                    sender: closed,
                    since: now,
                }],
            ));
        });

        assert!(checkout(&current).is_some(), "the fresh connection on top");
        IDLE.with_borrow(|lists| {
            let held: Vec<(String, usize)> = lists
                .upstreams
                .iter()
                .map(|(authority, idle)| (authority.to_string(), idle.len()))
                .collect();
            assert_eq!(held, [("current:80".to_owned(), 0)]);
        });
    }

    #[test]
    fn the_dial_target_has_a_bare_ipv6_address_and_port_80_by_default() {
        let cases = [
            ("[::1]", ("::1", 80)),
            ("[::1]:8080", ("::1", 8080)),
            ("127.0.0.1", ("127.0.0.1", 80)),
            ("api.internal:9000", ("api.internal", 9000)),
        ];
        for (authority, expected) in cases {
            let authority: Authority = authority.parse().unwrap();
            assert_eq!(dial_target(&authority), expected, "{authority}");
        }
    }
}
