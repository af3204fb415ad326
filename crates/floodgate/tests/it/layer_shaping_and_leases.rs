//! The layer end to end through `oneshot`: shaping (the leaky bucket delays) and concurrency leases held for a response body's life.

use crate::common;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use floodgate::{Algorithm, Limit, MemoryStore, RateLimitLayer, time::Timestamp};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Either, Full};
use tower::{Layer, Service, ServiceExt, service_fn};

#[tokio::test(start_paused = true)]
async fn leaky_bucket_delays_requests_instead_of_rejecting() {
    let limit = Limit::builder("shaped")
        .algorithm(Algorithm::LeakyBucket)
        .limit(10)
        .window(Duration::from_secs(1))
        .burst(2)
        .build()
        .unwrap();
    let store = MemoryStore::builder()
        .clock(TokioClock(tokio::time::Instant::now()))
        .build();
    let layer = RateLimitLayer::builder()
        .limit(limit)
        .store(store)
        .build()
        .unwrap();
    let service = layer.layer(service_fn(ok_handler));
    let started = tokio::time::Instant::now();
    let (a, b, c) = tokio::join!(
        send(&service, from_peer("203.0.113.1:1")),
        send(&service, from_peer("203.0.113.1:1")),
        send(&service, from_peer("203.0.113.1:1")),
    );
    assert!(
        [&a, &b, &c]
            .iter()
            .all(|response| response.status() == StatusCode::OK)
    );
    // The third waited two emission intervals (with paused time, exactly the sleeps taken).
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(199) && elapsed < Duration::from_millis(300),
        "{elapsed:?}"
    );
    let fourth = send(&service, from_peer("203.0.113.1:1")).await;
    assert_eq!(
        fourth.status(),
        StatusCode::OK,
        "time has moved on: the queue drained by 200ms"
    );
}

#[tokio::test]
async fn concurrency_lease_is_held_until_the_body_ends() {
    let limit = Limit::builder("in-flight")
        .algorithm(Algorithm::Concurrency)
        .limit(1)
        .build()
        .unwrap();
    let store = MemoryStore::new();
    let layer = RateLimitLayer::builder()
        .limit(limit)
        .store(store.clone())
        .build()
        .unwrap();
    let (sender, receiver) = tokio::sync::mpsc::channel::<Bytes>(1);
    let receiver = Arc::new(std::sync::Mutex::new(Some(receiver)));
    let streaming = service_fn(move |_request: Request<()>| {
        let receiver = receiver.lock().unwrap().take();
        async move {
            let body = match receiver {
                Some(receiver) => Either::Left(ChannelBody(receiver)),
                None => Either::Right(Full::new(Bytes::from_static(b"quick"))),
            };
            Ok::<_, Infallible>(Response::new(body))
        }
    });
    let service = layer.layer(streaming);
    let request = || from_peer("203.0.113.1:1").body(()).unwrap();

    let first = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // The first response's body is still streaming: the client is at its limit.
    let second = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);

    sender.send(Bytes::from_static(b"chunk")).await.unwrap();
    drop(sender);
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "chunk");
    // Body finished: lease released.
    let third = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    // A response dropped before its end releases too.
    drop(third);
    let fourth = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(fourth.status(), StatusCode::OK);
    drop(fourth);
    assert!(store.is_empty(), "no lease left behind");
}

/// The store's clock following Tokio's (paused) time, so sleeps and decisions agree.
struct TokioClock(tokio::time::Instant);

impl floodgate::time::Clock for TokioClock {
    fn now(&self) -> Timestamp {
        START.saturating_add(self.0.elapsed())
    }
}

/// A response body fed chunk by chunk from a channel; it ends when the sender is dropped.
struct ChannelBody(tokio::sync::mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|data| Ok(Frame::data(data))))
    }
}

#[tokio::test]
async fn concurrency_denials_can_promise_a_short_retry() {
    // Regression: a concurrency 429 said `Retry-After: 34` (the 30 s lease lifetime plus
    // jitter) for streams that end in seconds. The bound stays the default; a hint shortens it.
    let limit = || {
        Limit::builder("in-flight")
            .algorithm(Algorithm::Concurrency)
            .limit(1)
            .build()
            .unwrap()
    };
    let held = |hint: Option<Duration>| {
        let builder = RateLimitLayer::builder()
            .limit(limit())
            .retry_after_jitter(0.0);
        let builder = match hint {
            Some(hint) => builder.concurrency_retry_hint(hint),
            None => builder,
        };
        // Responses whose bodies never end (their senders are kept) hold their leases.
        let senders = Arc::new(std::sync::Mutex::new(Vec::new()));
        builder
            .build()
            .unwrap()
            .layer(service_fn(move |_request: Request<()>| {
                let (sender, receiver) = tokio::sync::mpsc::channel::<Bytes>(1);
                senders.lock().unwrap().push(sender);
                async move { Ok::<_, Infallible>(Response::new(ChannelBody(receiver))) }
            }))
    };
    for (hint, expected) in [(None, "30"), (Some(Duration::from_secs(2)), "2")] {
        let service = held(hint);
        let first = service
            .clone()
            .oneshot(from_peer("203.0.113.7:1").body(()).unwrap())
            .await
            .unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        let second = service
            .clone()
            .oneshot(from_peer("203.0.113.7:1").body(()).unwrap())
            .await
            .unwrap();
        assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(second.headers()["retry-after"], expected, "hint {hint:?}");
        drop(first);
    }
}

/// The inner service fails: the request's lease goes back when the error is returned, not when
/// the caller gets round to dropping the future that returned it.
#[tokio::test]
async fn an_inner_error_releases_the_lease_as_it_is_returned() {
    let limit = Limit::builder("in-flight")
        .algorithm(Algorithm::Concurrency)
        .limit(1)
        .build()
        .unwrap();
    let store = MemoryStore::new();
    let layer = RateLimitLayer::builder()
        .limit(limit)
        .store(store.clone())
        .build()
        .unwrap();
    let mut failing = layer.layer(service_fn(|_request: Request<()>| async {
        Err::<Response<Full<Bytes>>, _>("upstream failed")
    }));
    let request = from_peer("203.0.113.1:1").body(()).unwrap();
    let mut future = std::pin::pin!(failing.ready().await.unwrap().call(request));
    assert_eq!(future.as_mut().await.unwrap_err(), "upstream failed");
    // The future that returned the error is still held here.
    assert!(store.is_empty(), "the lease is released with the error");
}

/// A future polled again after it answered panics, as an `async` block does, without polling
/// the inner service's finished future (which could answer `Pending` for ever).
#[tokio::test]
async fn polling_the_answered_future_again_panics() {
    use std::future::Future;
    use std::task::{Context, Poll};

    let layer = RateLimitLayer::builder()
        .limit(Limit::token_bucket("per-second", 100, Duration::from_secs(1)).unwrap())
        .build()
        .unwrap();
    let mut service = layer.layer(service_fn(|_request: Request<()>| {
        // Answers once, then `Pending` for ever: a finished future that does not panic.
        let mut answered = false;
        std::future::poll_fn(move |_| {
            if std::mem::replace(&mut answered, true) {
                Poll::Pending
            } else {
                Poll::Ready(Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))))
            }
        })
    }));
    let request = from_peer("203.0.113.1:1").body(()).unwrap();
    let mut future = Box::pin(service.ready().await.unwrap().call(request));
    let mut context = Context::from_waker(std::task::Waker::noop());
    assert!(matches!(
        future.as_mut().poll(&mut context),
        Poll::Ready(Ok(_))
    ));
    let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        future.as_mut().poll(&mut context).is_pending()
    }));
    assert!(again.is_err(), "a second poll panics");
}
