//! The layer and its service: each request classified and admitted by the
//! [`AdaptiveLimiter`], a 503 (or a gRPC `UNAVAILABLE`) for what is shed, each answer's
//! latency fed to the controller.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::controller::GradientSettings;
use super::gate::Class;
use super::limiter::{
    AdaptiveLimiter, AdaptivePermit, AdaptiveSnapshot, Admission, ShedDecision, is_grpc,
};
use crate::body::RateLimitBody;
use crate::key::RequestInfo;
use crate::time::{Clock, SystemClock};

/// A request's class from what it carries: the name of one of the layer's classes, or `None`
/// for the default class.
pub type Classify = dyn Fn(&RequestInfo<'_>) -> Option<&'static str> + Send + Sync;

/// Who a request is from, for fairness within a class (`None`: no one in particular).
pub type ClientOf = dyn Fn(&RequestInfo<'_>) -> Option<u64> + Send + Sync;

/// Builds an [`AdaptiveConcurrencyLayer`] or an [`AdaptiveLimiter`].
pub struct AdaptiveConcurrencyBuilder {
    name: Arc<str>,
    settings: GradientSettings,
    classes: Vec<Class>,
    default_class: Option<String>,
    classify: Option<Arc<Classify>>,
    client: Option<Arc<ClientOf>>,
    client_share: f64,
    shadow: bool,
    clock: Arc<dyn Clock>,
}

impl AdaptiveConcurrencyBuilder {
    /// The `limiter` label of its metrics (`default` if never called).
    pub fn name(mut self, name: impl Into<Arc<str>>) -> Self {
        self.name = name.into();
        self
    }

    /// How the limit follows latency.
    pub fn gradient(mut self, settings: GradientSettings) -> Self {
        self.settings = settings;
        self
    }

    /// The priority classes, highest first (one class, `default`, if never called).
    pub fn classes(mut self, classes: impl IntoIterator<Item = Class>) -> Self {
        self.classes = classes.into_iter().collect();
        self
    }

    /// The class of a request the classifier does not place (the lowest if never called).
    pub fn default_class(mut self, name: impl Into<String>) -> Self {
        self.default_class = Some(name.into());
        self
    }

    /// How a request's class is found (the layer only).
    pub fn classify(
        mut self,
        classify: impl Fn(&RequestInfo<'_>) -> Option<&'static str> + Send + Sync + 'static,
    ) -> Self {
        self.classify = Some(Arc::new(classify));
        self
    }

    /// How a request's client is found, for fairness within a class (the layer only).
    pub fn client(
        mut self,
        client: impl Fn(&RequestInfo<'_>) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.client = Some(Arc::new(client));
        self
    }

    /// The most of a class one client may hold once the class is half full (above 0, at most
    /// 1; 0.5 if never called).
    pub fn client_share(mut self, share: f64) -> Self {
        self.client_share = share;
        self
    }

    /// Computes and reports, refuses nothing.
    pub fn shadow(mut self, shadow: bool) -> Self {
        self.shadow = shadow;
        self
    }

    /// The clock latencies are measured with (tests use [`crate::time::FakeClock`]).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The layer, or what is wrong with its settings, by name.
    pub fn build(mut self) -> Result<AdaptiveConcurrencyLayer, String> {
        let classify = self.classify.take();
        let client = self.client.take();
        Ok(AdaptiveConcurrencyLayer {
            limiter: self.build_limiter()?,
            classify,
            client,
        })
    }

    /// The limiter alone (its user classifies and admits), or what is wrong with its
    /// settings, by name.
    pub fn build_limiter(self) -> Result<AdaptiveLimiter, String> {
        self.settings.validate().map_err(str::to_owned)?;
        let classes = if self.classes.is_empty() {
            vec![Class::new("default")]
        } else {
            self.classes
        };
        for (index, class) in classes.iter().enumerate() {
            if classes[..index]
                .iter()
                .any(|seen| seen.name() == class.name())
            {
                return Err(format!("classes: `{}` is named twice", class.name()));
            }
            if !(0.0..1.0).contains(&class.reserved()) {
                return Err(format!("classes[{index}].reserve: 0 to 1, below 1"));
            }
        }
        let default_class = match &self.default_class {
            None => classes.len() - 1,
            Some(name) => classes
                .iter()
                .position(|class| **class.name() == **name)
                .ok_or_else(|| format!("default_class: `{name}` is not one of the classes"))?,
        };
        if !(self.client_share > 0.0 && self.client_share <= 1.0) {
            return Err("client_share: above 0, at most 1".to_owned());
        }
        Ok(AdaptiveLimiter::new(
            self.name,
            self.settings,
            &classes,
            default_class,
            self.client_share,
            !self.shadow,
            self.clock,
        ))
    }
}

/// Sheds load when the service behind it slows down: an in-flight limit that follows its
/// latency, with requests admitted by priority class. See the README's "Adaptive
/// concurrency".
#[derive(Clone)]
pub struct AdaptiveConcurrencyLayer {
    limiter: AdaptiveLimiter,
    classify: Option<Arc<Classify>>,
    client: Option<Arc<ClientOf>>,
}

impl AdaptiveConcurrencyLayer {
    /// A builder with the default settings: one class, Envoy's gradient with a 25 % buffer.
    pub fn builder() -> AdaptiveConcurrencyBuilder {
        AdaptiveConcurrencyBuilder {
            name: Arc::from("default"),
            settings: GradientSettings::default(),
            classes: Vec::new(),
            default_class: None,
            classify: None,
            client: None,
            client_share: 0.5,
            shadow: false,
            clock: Arc::new(SystemClock),
        }
    }

    /// What the limiter shows: the limit, in flight, latencies, counts by class.
    pub fn snapshot(&self) -> AdaptiveSnapshot {
        self.limiter.snapshot()
    }

    /// The limiter.
    pub fn limiter(&self) -> &AdaptiveLimiter {
        &self.limiter
    }
}

impl std::fmt::Debug for AdaptiveConcurrencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveConcurrencyLayer")
            .field("limiter", &self.limiter)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for AdaptiveConcurrencyLayer {
    type Service = AdaptiveConcurrency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AdaptiveConcurrency {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service of [`AdaptiveConcurrencyLayer`].
#[derive(Clone)]
pub struct AdaptiveConcurrency<S> {
    inner: S,
    layer: AdaptiveConcurrencyLayer,
}

impl<S: std::fmt::Debug> std::fmt::Debug for AdaptiveConcurrency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveConcurrency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for AdaptiveConcurrency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    ReqBody: Send + 'static,
{
    type Response = Response<RateLimitBody<ResBody>>;
    type Error = S::Error;
    type Future = AdaptiveFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let layer = &self.layer;
        let info = RequestInfo::new(&request);
        let class = layer.classify.as_ref().and_then(|classify| classify(&info));
        let class = layer.limiter.class_index(class);
        let client = layer.client.as_ref().and_then(|client| client(&info));
        let permit = match layer.limiter.admit(class, client) {
            Admission::Admitted(permit) => permit,
            Admission::Shed(shed) => {
                let answer = shed.response(is_grpc(request.headers()));
                return AdaptiveFuture {
                    state: FutureState::Shed {
                        answer: Some(answer),
                    },
                };
            }
            Admission::Queued(queued) => {
                // The service made ready goes with the request; this one keeps a clone.
                let ready = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, ready);
                let grpc = is_grpc(request.headers());
                return AdaptiveFuture {
                    state: FutureState::Queued {
                        wait: Box::pin(queued.wait()),
                        call: Some(Box::new(move || inner.call(request))),
                        grpc,
                    },
                };
            }
        };
        AdaptiveFuture {
            state: FutureState::Inner {
                future: self.inner.call(request),
                permit: Some(permit),
            },
        }
    }
}

pin_project! {
    /// The response future of [`AdaptiveConcurrency`].
    pub struct AdaptiveFuture<F> {
        #[pin]
        state: FutureState<F>,
    }
}

pin_project! {
    #[project = StateProjection]
    enum FutureState<F> {
        Inner { #[pin] future: F, permit: Option<AdaptivePermit> },
        Shed { answer: Option<Response<Bytes>> },
        Queued { wait: WaitForPlace, call: Option<CallInner<F>>, grpc: bool },
    }
}

/// A queued request's wait for a place.
type WaitForPlace = Pin<Box<dyn Future<Output = Result<AdaptivePermit, ShedDecision>> + Send>>;

/// Calls the inner service with the request once it has a place.
type CallInner<F> = Box<dyn FnOnce() -> F + Send>;

impl<F, B, E> Future for AdaptiveFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<RateLimitBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let next = match self.as_mut().project().state.project() {
                StateProjection::Shed { answer } => {
                    let answer = answer
                        .take()
                        .expect("AdaptiveFuture polled after it completed");
                    return Poll::Ready(Ok(answer.map(RateLimitBody::full)));
                }
                StateProjection::Inner { future, permit } => {
                    let answered = ready!(future.poll(cx));
                    if let Some(permit) = permit.take() {
                        permit.answered();
                    }
                    return Poll::Ready(answered.map(|response| {
                        response.map(|body| RateLimitBody::inner(body, None, None))
                    }));
                }
                StateProjection::Queued { wait, call, grpc } => {
                    match ready!(wait.as_mut().poll(cx)) {
                        Ok(permit) => {
                            let call = call
                                .take()
                                .expect("AdaptiveFuture polled after it completed");
                            FutureState::Inner {
                                future: call(),
                                permit: Some(permit),
                            }
                        }
                        Err(shed) => FutureState::Shed {
                            answer: Some(shed.response(*grpc)),
                        },
                    }
                }
            };
            self.as_mut().project().state.set(next);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use tokio::sync::oneshot;
    use tower::{ServiceExt, service_fn};

    use super::*;
    use crate::adaptive::{REDUCED_CAPACITY_PROBLEM, Shed};
    use crate::time::FakeClock;
    use http::StatusCode;
    use http::header::CONTENT_TYPE;
    use std::time::Duration;

    /// Where the test answers each call the service received.
    type Calls = tokio::sync::mpsc::UnboundedReceiver<oneshot::Sender<()>>;

    /// A service whose every response waits for the test to send it.
    fn held_service() -> (
        impl Service<Request<()>, Response = Response<String>, Error = Infallible, Future: Send>
        + Clone
        + Send
        + 'static,
        Calls,
    ) {
        let (calls, received) = tokio::sync::mpsc::unbounded_channel();
        let service = service_fn(move |_: Request<()>| {
            let (answer, answered) = oneshot::channel();
            calls.send(answer).unwrap();
            async move {
                let _ = answered.await;
                Ok::<_, Infallible>(Response::new("served".to_owned()))
            }
        });
        (service, received)
    }

    fn layer(limit: u32, shadow: bool, clock: FakeClock) -> AdaptiveConcurrencyLayer {
        AdaptiveConcurrencyLayer::builder()
            .gradient(GradientSettings {
                initial_limit: limit,
                min_limit: 1,
                window: Duration::from_secs(1),
                min_samples: 1,
                ..GradientSettings::default()
            })
            .classes([Class::new("critical").reserve(0.5), Class::new("default")])
            .classify(|request| {
                request
                    .headers
                    .contains_key("x-critical")
                    .then_some("critical")
            })
            .shadow(shadow)
            .clock(Arc::new(clock))
            .build()
            .unwrap()
    }

    fn request(critical: bool, grpc: bool) -> Request<()> {
        let mut builder = Request::builder();
        if critical {
            builder = builder.header("x-critical", "1");
        }
        if grpc {
            builder = builder.header(CONTENT_TYPE, "application/grpc+proto");
        }
        builder.body(()).unwrap()
    }

    #[tokio::test]
    async fn a_shed_request_gets_503_with_the_problem_type_and_retry_after() {
        let layer = layer(4, false, FakeClock::default());
        let (inner, mut calls) = held_service();
        let service = layer.layer(inner);
        // The default class may fill half of 4: two held, the third is shed.
        let first = tokio::spawn(service.clone().oneshot(request(false, false)));
        let second = tokio::spawn(service.clone().oneshot(request(false, false)));
        let held = [calls.recv().await.unwrap(), calls.recv().await.unwrap()];
        let shed = service
            .clone()
            .oneshot(request(false, false))
            .await
            .unwrap();
        assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(shed.headers()[CONTENT_TYPE], "application/problem+json");
        let retry_after: u64 = shed.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=2).contains(&retry_after), "{retry_after}");
        assert_eq!(
            shed.extensions().get::<Shed>(),
            Some(&Shed {
                class: Arc::from("default")
            })
        );
        // The typed outcome, without a rate limit layer around.
        assert_eq!(
            shed.extensions().get::<crate::RequestOutcome>(),
            Some(&crate::RequestOutcome::undecided(crate::Outcome::Shed))
        );
        let body = http_body_util::BodyExt::collect(shed.into_body())
            .await
            .unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body.to_bytes()).unwrap();
        assert_eq!(body["type"], REDUCED_CAPACITY_PROBLEM);
        assert_eq!(body["status"], 503);
        // The reserved half is still there for a critical request.
        let critical = tokio::spawn(service.clone().oneshot(request(true, false)));
        let held_critical = calls.recv().await.unwrap();
        // A gRPC call is told UNAVAILABLE in gRPC's own terms.
        let grpc = service.clone().oneshot(request(false, true)).await.unwrap();
        assert_eq!(grpc.status(), StatusCode::OK);
        assert_eq!(grpc.headers()["grpc-status"], "14");
        for answer in held.into_iter().chain([held_critical]) {
            answer.send(()).unwrap();
        }
        for served in [first, second, critical] {
            assert_eq!(served.await.unwrap().unwrap().status(), StatusCode::OK);
        }
        let snapshot = layer.snapshot();
        assert_eq!(snapshot.gate.in_flight, 0, "every permit released");
        let refused: Vec<u64> = snapshot.gate.classes.iter().map(|c| c.refused).collect();
        assert_eq!(refused, [0, 2]);
    }

    #[tokio::test]
    async fn a_request_whose_client_left_releases_its_place() {
        let layer = layer(2, false, FakeClock::default());
        let (inner, mut calls) = held_service();
        let service = layer.layer(inner);
        let waiting = tokio::spawn(service.clone().oneshot(request(false, false)));
        let _held = calls.recv().await.unwrap();
        assert_eq!(layer.snapshot().gate.in_flight, 1);
        waiting.abort();
        assert!(waiting.await.unwrap_err().is_cancelled());
        assert_eq!(layer.snapshot().gate.in_flight, 0);
        // The place is free again.
        let next = tokio::spawn(service.clone().oneshot(request(false, false)));
        calls.recv().await.unwrap().send(()).unwrap();
        assert_eq!(next.await.unwrap().unwrap().status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn shadow_mode_lets_everything_through_and_counts_what_it_would_shed() {
        let layer = layer(2, true, FakeClock::default());
        let (inner, mut calls) = held_service();
        let service = layer.layer(inner);
        let requests: Vec<_> = (0..4)
            .map(|_| tokio::spawn(service.clone().oneshot(request(false, false))))
            .collect();
        for _ in 0..4 {
            calls.recv().await.unwrap().send(()).unwrap();
        }
        for served in requests {
            assert_eq!(served.await.unwrap().unwrap().status(), StatusCode::OK);
        }
        let default = &layer.snapshot().gate.classes[1];
        // Half of 2 for the default class: one fits, three would have been shed.
        assert_eq!((default.admitted, default.refused), (1, 3));
    }

    #[tokio::test]
    async fn answered_latencies_set_the_limit_at_each_window() {
        let clock = FakeClock::default();
        let layer = layer(10, false, clock.clone());
        let (inner, mut calls) = held_service();
        let service = layer.layer(inner);
        for took in [1_500, 4_500] {
            let served = tokio::spawn(service.clone().oneshot(request(true, false)));
            let answer = calls.recv().await.unwrap();
            clock.advance(Duration::from_millis(took));
            answer.send(()).unwrap();
            served.await.unwrap().unwrap();
        }
        // One window (1 s, at least one answer) closed at the second answer: p90 4.5 s, the
        // minimum 1.5 s, so the gradient is clamped at 0.5 and the limit moves halfway from
        // 10 toward 10 × 0.5 + √10.
        let snapshot = layer.snapshot();
        assert_eq!(snapshot.min_rtt, Some(Duration::from_millis(1_500)));
        assert_eq!(snapshot.sample_latency, Some(Duration::from_millis(4_500)));
        assert_eq!(snapshot.gate.limit, 9);
    }

    /// Critical requests wait up to `wait` for a place; the default class never.
    fn waiting_layer(limit: u32, wait: Duration) -> AdaptiveConcurrencyLayer {
        AdaptiveConcurrencyLayer::builder()
            .gradient(GradientSettings {
                initial_limit: limit,
                min_limit: 1,
                ..GradientSettings::default()
            })
            .classes([Class::new("critical").wait(wait), Class::new("default")])
            .classify(|request| {
                request
                    .headers
                    .contains_key("x-critical")
                    .then_some("critical")
            })
            .build()
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_class_is_served_when_a_place_frees_within_its_wait() {
        let layer = waiting_layer(1, Duration::from_millis(100));
        let (inner, mut calls) = held_service();
        let service = layer.layer(inner);
        let first = tokio::spawn(service.clone().oneshot(request(true, false)));
        let held = calls.recv().await.unwrap();
        let waiting = tokio::spawn(service.clone().oneshot(request(true, false)));
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(layer.snapshot().gate.classes[0].waiting, 1);
        held.send(()).unwrap();
        assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
        // The freed place went to the waiter, 60 ms into its 100 ms wait.
        calls.recv().await.unwrap().send(()).unwrap();
        assert_eq!(waiting.await.unwrap().unwrap().status(), StatusCode::OK);
        let critical = &layer.snapshot().gate.classes[0];
        assert_eq!(
            (critical.admitted, critical.waited, critical.refused),
            (2, 1, 0)
        );
        assert_eq!(critical.waiting, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_runs_out_is_shed_once_and_a_client_that_leaves_leaves_the_queue() {
        let layer = waiting_layer(1, Duration::from_millis(100));
        let (inner, mut calls) = held_service();
        let service = layer.layer(inner);
        let first = tokio::spawn(service.clone().oneshot(request(true, false)));
        let held = calls.recv().await.unwrap();
        let started = tokio::time::Instant::now();
        let shed = service.clone().oneshot(request(true, true)).await.unwrap();
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(100),
            "its whole wait"
        );
        assert_eq!(
            shed.headers()["grpc-status"],
            "14",
            "answered as it was asked"
        );
        let critical = &layer.snapshot().gate.classes[0];
        assert_eq!((critical.refused, critical.waiting), (1, 0));
        // A waiter whose client leaves: neither admitted nor refused, and out of the queue.
        let leaving = tokio::spawn(service.clone().oneshot(request(true, false)));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(layer.snapshot().gate.classes[0].waiting, 1);
        leaving.abort();
        assert!(leaving.await.unwrap_err().is_cancelled());
        let critical = &layer.snapshot().gate.classes[0];
        assert_eq!((critical.refused, critical.waiting), (1, 0));
        held.send(()).unwrap();
        assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
        assert_eq!(layer.snapshot().gate.in_flight, 0);
    }

    #[test]
    fn bad_settings_are_named() {
        let twice = AdaptiveConcurrencyLayer::builder()
            .classes([Class::new("a"), Class::new("a")])
            .build();
        assert_eq!(twice.unwrap_err(), "classes: `a` is named twice");
        let unknown = AdaptiveConcurrencyLayer::builder()
            .default_class("gold")
            .build();
        assert_eq!(
            unknown.unwrap_err(),
            "default_class: `gold` is not one of the classes"
        );
        let share = AdaptiveConcurrencyLayer::builder()
            .client_share(0.0)
            .build();
        assert_eq!(share.unwrap_err(), "client_share: above 0, at most 1");
    }
}
