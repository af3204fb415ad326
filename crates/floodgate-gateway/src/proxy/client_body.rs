//! The client's request body on its way upstream, watched for the client's own faults.
//!
//! When the client stalls mid-body or sends a malformed one (bad chunked framing), the upstream
//! request fails; without this watch the gateway blamed the upstream (502, a WARN, a 502 in the
//! upstream metrics), which let any client trip upstream alerts at will. Faults are recorded
//! here so that the proxy answers 408 or 400 and counts them apart.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

/// A fault of the client's, found while reading its body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ClientFault {
    /// The client sent nothing for `server.body_read_timeout` mid-body: 408.
    Timeout,
    /// The body could not be read (malformed framing, reset): 400.
    Malformed,
}

const NONE: u8 = 0;
const TIMEOUT: u8 = 1;
const MALFORMED: u8 = 2;
/// Not a fault: the body is waiting for bytes from the client right now.
const WAITING: u8 = 3;

/// What the proxy learns of the body after the upstream call.
#[derive(Debug, Default)]
pub(crate) struct BodyWatch(AtomicU8);

impl BodyWatch {
    /// The fault, if the client caused one.
    pub(crate) fn fault(&self) -> Option<ClientFault> {
        match self.0.load(Ordering::Relaxed) {
            TIMEOUT => Some(ClientFault::Timeout),
            MALFORMED => Some(ClientFault::Malformed),
            _ => None,
        }
    }

    /// Whether the body was stalled on the client when this was asked: an upstream that times
    /// out meanwhile was waiting for the client, not the other way round.
    pub(crate) fn waiting_on_client(&self) -> bool {
        self.0.load(Ordering::Relaxed) == WAITING
    }

    fn set(&self, state: u8) {
        self.0.store(state, Ordering::Relaxed);
    }
}

/// The error the upstream client sees when the client's body fails.
#[derive(Debug)]
pub(crate) struct ClientBodyError(ClientFault);

impl std::fmt::Display for ClientBodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            ClientFault::Timeout => f.write_str("the client stopped sending its request body"),
            ClientFault::Malformed => f.write_str("the client's request body is malformed"),
        }
    }
}

impl std::error::Error for ClientBodyError {}

/// The request body forwarded upstream: the client's, with a deadline between its pieces.
pub(crate) struct ClientBody {
    inner: Incoming,
    gap: Duration,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    watch: Arc<BodyWatch>,
}

impl ClientBody {
    /// Wraps `inner`; pieces more than `gap` apart are a [`ClientFault::Timeout`].
    pub(crate) fn new(inner: Incoming, gap: Duration) -> (ClientBody, Arc<BodyWatch>) {
        let watch = Arc::new(BodyWatch::default());
        let body = ClientBody {
            inner,
            gap,
            deadline: None,
            watch: watch.clone(),
        };
        (body, watch)
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.deadline = None;
                this.watch.set(NONE);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(_))) => {
                this.watch.set(MALFORMED);
                Poll::Ready(Some(Err(ClientBodyError(ClientFault::Malformed))))
            }
            Poll::Ready(None) => {
                this.watch.set(NONE);
                Poll::Ready(None)
            }
            Poll::Pending => {
                let gap = this.gap;
                let deadline = this
                    .deadline
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(gap)));
                if deadline.as_mut().poll(cx).is_ready() {
                    this.watch.set(TIMEOUT);
                    return Poll::Ready(Some(Err(ClientBodyError(ClientFault::Timeout))));
                }
                this.watch.set(WAITING);
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
