//! One `writev` for the answers that are ready together, not one per answer.
//!
//! Decisions coalesced into one Redis call come back together, and each wakes its own HTTP/2
//! stream task. Each of those wakes the connection task, which tokio runs next (its LIFO slot):
//! the connection flushed after every single answer, one `writev` (and on loopback, the
//! receiver's whole TCP path) per call, about a fifth of the gateway's CPU under load
//! (BENCHMARKS.md). [`BatchedWrites`] keeps what h2 writes and, at the first flush, yields once
//! to the scheduler (the task wakes itself and goes to the back of the run queue), so that the
//! stream tasks already woken add their answers first; the next flush writes them all. It
//! yields only while other calls are under way ([`CallsInFlight`], counted by [`Counted`] from
//! the moment the connection hands a request to the service): a lone caller's answer has
//! nothing to wait for, and a yield would cost it a scheduler round (measured: 30% more CPU
//! per call at one caller when every flush yielded).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes held before a write goes through without waiting for the flush (h2 frames answers of
/// a few hundred bytes; a large body is not delayed behind its own buffer).
const HOLD_AT_MOST: usize = 64 * 1024;

/// The calls under way now, on every connection of the service. Clones share the count.
#[derive(Clone, Debug, Default)]
pub(crate) struct CallsInFlight(Arc<AtomicUsize>);

impl CallsInFlight {
    /// Counts a call until the guard is dropped (with the call's future, once its answer is
    /// handed to h2).
    pub(crate) fn enter(&self) -> InFlight {
        self.0.fetch_add(1, Ordering::Relaxed);
        InFlight(self.0.clone())
    }

    /// Whether some call is being decided now.
    fn any(&self) -> bool {
        self.0.load(Ordering::Relaxed) > 0
    }
}

/// One call counted in [`CallsInFlight`].
#[derive(Debug)]
pub(crate) struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An IO whose writes are held until a flush, and whose flush yields once while other calls
/// are being decided, to let their answers join (see the module docs).
pub(crate) struct BatchedWrites<IO> {
    inner: IO,
    calls: CallsInFlight,
    held: Vec<u8>,
    /// Bytes of `held` already written to `inner`.
    written: usize,
    /// Whether this flush already yielded once.
    yielded: bool,
}

impl<IO> BatchedWrites<IO> {
    /// Wraps `inner`, a connection of the service whose calls `calls` counts.
    pub(crate) fn new(inner: IO, calls: CallsInFlight) -> Self {
        BatchedWrites {
            inner,
            calls,
            held: Vec::new(),
            written: 0,
            yielded: false,
        }
    }
}

impl<IO: AsyncWrite + Unpin> BatchedWrites<IO> {
    /// Writes everything held to `inner`.
    fn poll_write_held(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.held.len() {
            let n = std::task::ready!(
                Pin::new(&mut self.inner).poll_write(cx, &self.held[self.written..])
            )?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.held.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }

    /// Makes room for more: writes what is held first once it reached [`HOLD_AT_MOST`].
    fn poll_room(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.held.len() >= HOLD_AT_MOST {
            std::task::ready!(self.poll_write_held(cx))?;
        }
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for BatchedWrites<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for BatchedWrites<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        std::task::ready!(self.poll_room(cx))?;
        self.held.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        std::task::ready!(self.poll_room(cx))?;
        let mut taken = 0;
        for buf in bufs {
            self.held.extend_from_slice(buf);
            taken += buf.len();
        }
        Poll::Ready(Ok(taken))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.held.is_empty() {
            return Pin::new(&mut self.inner).poll_flush(cx);
        }
        if !self.yielded && self.calls.any() {
            self.yielded = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        std::task::ready!(self.poll_write_held(cx))?;
        self.yielded = false;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_write_held(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected
    for BatchedWrites<IO>
{
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// A gRPC service whose calls are counted in a [`CallsInFlight`] while under way.
#[derive(Clone, Debug)]
pub(crate) struct Counted<S> {
    inner: S,
    calls: CallsInFlight,
}

impl<S> Counted<S> {
    /// `inner`, its calls counted in `calls`.
    pub(crate) fn new(inner: S, calls: CallsInFlight) -> Self {
        Counted { inner, calls }
    }
}

impl<S, Request> tower_service::Service<Request> for Counted<S>
where
    S: tower_service::Service<Request>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = CountedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        CountedFuture {
            in_flight: self.calls.enter(),
            inner: self.inner.call(request),
        }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Counted<S> {
    const NAME: &'static str = S::NAME;
}

pin_project_lite::pin_project! {
    /// A call's future, counted until it is dropped.
    pub struct CountedFuture<F> {
        #[pin]
        inner: F,
        in_flight: InFlight,
    }
}

impl<F: std::future::Future> std::future::Future for CountedFuture<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.project().inner.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn writes_reach_the_peer_at_the_flush_in_order() {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let calls = CallsInFlight::default();
        let deciding = calls.enter();
        let mut batched = BatchedWrites::new(client, calls);
        batched.write_all(b"one ").await.unwrap();
        let written = batched
            .write_vectored(&[io::IoSlice::new(b"two "), io::IoSlice::new(b"three")])
            .await
            .unwrap();
        assert_eq!(written, 9, "a vectored write is held whole");
        // Yields once (a call is being decided), then writes.
        batched.flush().await.unwrap();
        drop(deciding);
        let mut read = vec![0; 13];
        server.read_exact(&mut read).await.unwrap();
        assert_eq!(read, b"one two three");
    }

    #[tokio::test]
    async fn a_large_write_goes_through_before_the_flush() {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let mut batched = BatchedWrites::new(client, CallsInFlight::default());
        let large = vec![7u8; HOLD_AT_MOST + 1];
        batched.write_all(&large).await.unwrap();
        // Room for the next write means writing out what is held.
        batched.write_all(b"x").await.unwrap();
        let mut read = vec![0; HOLD_AT_MOST + 1];
        server.read_exact(&mut read).await.unwrap();
        assert_eq!(read, large);
    }
}
