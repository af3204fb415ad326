//! The response body: the inner service's body, holding the request's concurrency leases until
//! it ends or is dropped, or a complete body the limiter wrote itself (429, 503).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::detached::run_detached;
use crate::post_charge::PendingSettlement;
use crate::store::{Lease, Store};

/// Concurrency leases, released when dropped.
pub(crate) struct LeaseGuard {
    store: Arc<dyn Store>,
    leases: Vec<Lease>,
}

impl LeaseGuard {
    pub(crate) fn new(store: &Arc<dyn Store>, leases: Vec<Lease>) -> Option<LeaseGuard> {
        (!leases.is_empty()).then(|| LeaseGuard {
            store: store.clone(),
            leases,
        })
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        let leases = std::mem::take(&mut self.leases);
        let store = self.store.clone();
        run_detached(async move {
            if let Err(error) = store.release(leases).await {
                tracing::warn!(%error, "lease release failed; the leases expire with their window");
            }
        });
    }
}

impl std::fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("leases", &self.leases)
            .finish()
    }
}

pin_project! {
    /// The body of a response that went through the rate limit layer.
    #[project = BodyProjection]
    pub struct RateLimitBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProjection]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
            leases: Option<LeaseGuard>,
            settlement: Option<PendingSettlement>,
        },
        Full {
            data: Option<Bytes>,
        },
    }
}

impl<B> RateLimitBody<B> {
    pub(crate) fn inner(
        body: B,
        leases: Option<LeaseGuard>,
        settlement: Option<PendingSettlement>,
    ) -> Self {
        RateLimitBody {
            kind: Kind::Inner {
                body,
                leases,
                settlement,
            },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        RateLimitBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }
}

impl<B> std::fmt::Debug for RateLimitBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitBody").finish_non_exhaustive()
    }
}

impl<B> Body for RateLimitBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            KindProjection::Inner {
                body,
                leases,
                settlement,
            } => {
                let mut frame = std::task::ready!(body.poll_frame(cx));
                match &mut frame {
                    Some(Ok(frame)) => {
                        if let Some(trailers) = frame.trailers_mut()
                            && let Some(pending) = settlement.take()
                        {
                            pending.settle_from(trailers);
                        }
                    }
                    // The response is complete: the request no longer counts as in flight,
                    // and a cost it never reported settles nothing.
                    None => {
                        leases.take();
                        settlement.take();
                    }
                    Some(Err(_)) => {}
                }
                Poll::Ready(frame)
            }
            KindProjection::Full { data } => {
                Poll::Ready(data.take().map(|data| Ok(Frame::data(data))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |data| data.len() as u64))
            }
        }
    }
}
