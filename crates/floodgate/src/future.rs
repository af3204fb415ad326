//! The [`ResponseFuture`] of [`crate::RateLimit`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::Response;
use http_body::Body;
use pin_project_lite::pin_project;

use crate::admitted::{Admitted, Boxed, complete, finish_boxed};
use crate::body::RateLimitBody;
use crate::shared::Shared;

pin_project! {
    /// The response future of [`crate::RateLimit`]: the store's decision, an optional shaping
    /// delay, then either the limiter's own response or the inner service's.
    ///
    /// A request the store decided at once and admitted (the memory store's), or one no limit
    /// applies to, waits on the inner service's future `F` in place, with no allocation of its
    /// own. Everything else (a decision that awaits a store behind a trait object, a denial,
    /// a cost to settle after the response) is boxed, so that the future stays `Send` and
    /// `'static` whatever the store.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

pin_project! {
    #[project = StateProjection]
    enum State<F, B, E> {
        /// Awaiting the inner service's response to an admitted request.
        Inner {
            #[pin]
            response: F,
            shared: Arc<Shared>,
            // Taken when the response comes.
            admitted: Option<Admitted>,
        },
        /// Everything else.
        Boxed { future: Boxed<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    /// Awaits `response`, then completes it with what `admitted` says.
    pub(crate) fn admitted(response: F, shared: Arc<Shared>, admitted: Admitted) -> Self {
        ResponseFuture {
            state: State::Inner {
                response,
                shared,
                admitted: Some(admitted),
            },
        }
    }

    /// Any other answer.
    pub(crate) fn boxed(future: Boxed<B, E>) -> Self {
        ResponseFuture {
            state: State::Boxed { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body<Data = Bytes> + Send + 'static,
    E: 'static,
{
    type Output = Result<Response<RateLimitBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.as_mut().project().state;
        let (response, shared, admitted) = match state.as_mut().project() {
            StateProjection::Boxed { future } => return future.as_mut().poll(cx),
            StateProjection::Inner {
                response,
                shared,
                admitted,
            } => {
                // Taken when the response came: the inner future is done, and is not polled
                // again.
                if admitted.is_none() {
                    panic!("ResponseFuture polled after it completed");
                }
                let polled = ready!(response.poll(cx));
                // Out of the future now, so that an error releases the leases at once.
                let Some(admitted) = admitted.take() else {
                    unreachable!("checked above");
                };
                (polled?, shared.clone(), admitted)
            }
        };
        if !shared.may_report_cost(&response) {
            return Poll::Ready(Ok(complete(response, admitted, None)));
        }
        // A reported cost is settled on the store, which may wait.
        let mut future = finish_boxed(shared, response, admitted);
        let polled = future.as_mut().poll(cx);
        state.set(State::Boxed { future });
        polled
    }
}

impl<F, B, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
