//! The [`ResponseFuture`] of [`crate::RateLimit`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;

use crate::body::RateLimitBody;

type Inner<B, E> = Pin<Box<dyn Future<Output = Result<Response<RateLimitBody<B>>, E>> + Send>>;

/// The response future of [`crate::RateLimit`]: the store's decision, an optional shaping
/// delay, then either the limiter's own response or the inner service's.
///
/// Boxed, because the decision awaits a store behind a trait object anyway; one allocation per
/// request buys a future that is `Send` and `'static` whatever the store.
pub struct ResponseFuture<B, E> {
    inner: Inner<B, E>,
}

impl<B, E> ResponseFuture<B, E> {
    pub(crate) fn new(inner: Inner<B, E>) -> Self {
        ResponseFuture { inner }
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<RateLimitBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
