//! The layer and its service: admission by class under the adaptive limit, a 503 (or a gRPC
//! `UNAVAILABLE`) for what is shed, and each answered request's latency fed to the controller.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use http::{HeaderName, Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::controller::{Gradient, GradientSettings, WindowSample};
use super::gate::{Class, Gate, GateSnapshot, Refusal};
use crate::body::RateLimitBody;
use crate::headers::{retry_after_secs, write_retry_after};
use crate::key::RequestInfo;
use crate::time::{Clock, SystemClock, Timestamp};

/// The IETF RateLimit draft's problem type for a service that sheds load.
pub const REDUCED_CAPACITY_PROBLEM: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// `floodgate_adaptive_limit`: the concurrency limit in force.
pub const ADAPTIVE_LIMIT: &str = "floodgate_adaptive_limit";
/// `floodgate_adaptive_shed_total{class,mode}`: requests refused (`mode="enforce"`) or that
/// would have been (`mode="shadow"`).
pub const ADAPTIVE_SHED_TOTAL: &str = "floodgate_adaptive_shed_total";

/// A request's class from what it carries: the name of one of the layer's classes, or `None`
/// for the default class.
pub type Classify = dyn Fn(&RequestInfo<'_>) -> Option<&'static str> + Send + Sync;

/// Who a request is from, for fairness within a class (`None`: no one in particular).
pub type ClientOf = dyn Fn(&RequestInfo<'_>) -> Option<u64> + Send + Sync;

/// Builds an [`AdaptiveConcurrencyLayer`].
pub struct AdaptiveConcurrencyBuilder {
    settings: GradientSettings,
    classes: Vec<Class>,
    default_class: Option<&'static str>,
    classify: Option<Arc<Classify>>,
    client: Option<Arc<ClientOf>>,
    client_share: f64,
    shadow: bool,
    clock: Arc<dyn Clock>,
}

impl AdaptiveConcurrencyBuilder {
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
    pub fn default_class(mut self, name: &'static str) -> Self {
        self.default_class = Some(name);
        self
    }

    /// How a request's class is found.
    pub fn classify(
        mut self,
        classify: impl Fn(&RequestInfo<'_>) -> Option<&'static str> + Send + Sync + 'static,
    ) -> Self {
        self.classify = Some(Arc::new(classify));
        self
    }

    /// How a request's client is found, for fairness within a class.
    pub fn client(
        mut self,
        client: impl Fn(&RequestInfo<'_>) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.client = Some(Arc::new(client));
        self
    }

    /// The most of a class one client may hold once the class is half full (0 to 1; 0.5 if
    /// never called).
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
    pub fn build(self) -> Result<AdaptiveConcurrencyLayer, String> {
        self.settings.validate().map_err(str::to_owned)?;
        let classes = if self.classes.is_empty() {
            vec![Class::new("default")]
        } else {
            self.classes
        };
        let names: Vec<&'static str> = classes.iter().map(Class::name).collect();
        if let Some(twice) = names
            .iter()
            .enumerate()
            .find(|(index, name)| names[..*index].contains(name))
        {
            return Err(format!("classes: `{}` is named twice", twice.1));
        }
        let default_class = match self.default_class {
            None => classes.len() - 1,
            Some(name) => names
                .iter()
                .position(|&known| known == name)
                .ok_or_else(|| format!("default_class: `{name}` is not one of the classes"))?,
        };
        if !(0.0..=1.0).contains(&self.client_share) || self.client_share == 0.0 {
            return Err("client_share: above 0, at most 1".to_owned());
        }
        let gate = Gate::new(&classes, self.settings.initial_limit, self.client_share);
        Ok(AdaptiveConcurrencyLayer {
            shared: Arc::new(Adaptive {
                gate,
                names,
                default_class,
                classify: self.classify,
                client: self.client,
                enforce: !self.shadow,
                clock: self.clock,
                window: Mutex::new(Window::new(Gradient::new(self.settings))),
            }),
        })
    }
}

/// Sheds load when the service behind it slows down: an in-flight limit that follows its
/// latency, with requests admitted by priority class. See the README's "Adaptive
/// concurrency".
#[derive(Clone)]
pub struct AdaptiveConcurrencyLayer {
    shared: Arc<Adaptive>,
}

impl AdaptiveConcurrencyLayer {
    /// A builder with the default settings: one class, Envoy's gradient with a 25 % buffer.
    pub fn builder() -> AdaptiveConcurrencyBuilder {
        AdaptiveConcurrencyBuilder {
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
        let window = self.shared.window();
        AdaptiveSnapshot {
            gate: self.shared.gate.snapshot(&self.shared.names),
            min_rtt: window.controller.min_rtt(),
            sample_latency: window.last_latency,
        }
    }
}

impl std::fmt::Debug for AdaptiveConcurrencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveConcurrencyLayer")
            .field("classes", &self.shared.names)
            .finish_non_exhaustive()
    }
}

/// What [`AdaptiveConcurrencyLayer::snapshot`] shows.
#[derive(Clone, Debug, PartialEq)]
pub struct AdaptiveSnapshot {
    /// The limit, in flight, and each class's counts.
    pub gate: GateSnapshot,
    /// The minimum round trip learned.
    pub min_rtt: Option<Duration>,
    /// The last window's sampled latency.
    pub sample_latency: Option<Duration>,
}

impl<S> Layer<S> for AdaptiveConcurrencyLayer {
    type Service = AdaptiveConcurrency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AdaptiveConcurrency {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// What the layer and its services share.
struct Adaptive {
    gate: Gate,
    names: Vec<&'static str>,
    default_class: usize,
    classify: Option<Arc<Classify>>,
    client: Option<Arc<ClientOf>>,
    enforce: bool,
    clock: Arc<dyn Clock>,
    window: Mutex<Window>,
}

/// The latencies of the window being sampled, and the controller they go to.
struct Window {
    controller: Gradient,
    latencies: Vec<Duration>,
    started: Option<Timestamp>,
    last_latency: Option<Duration>,
}

impl Window {
    fn new(controller: Gradient) -> Window {
        Window {
            controller,
            latencies: Vec::new(),
            started: None,
            last_latency: None,
        }
    }

    /// Adds one latency; the window's sample once it is long and full enough.
    fn record(&mut self, latency: Duration, now: Timestamp) -> Option<(Duration, Duration)> {
        let started = *self.started.get_or_insert(now);
        self.latencies.push(latency);
        let settings = self.controller.settings();
        let elapsed = now.as_micros().saturating_sub(started.as_micros());
        if elapsed < crate::time::duration_to_micros(settings.window)
            || self.latencies.len() < settings.min_samples
        {
            return None;
        }
        let rank = ((self.latencies.len() as f64 * settings.percentile).ceil() as usize)
            .clamp(1, self.latencies.len());
        let (_, &mut sampled, _) = self.latencies.select_nth_unstable(rank - 1);
        let min = self.latencies.iter().copied().min().unwrap_or(sampled);
        self.latencies.clear();
        self.started = Some(now);
        self.last_latency = Some(sampled);
        Some((sampled, min))
    }
}

impl Adaptive {
    fn window(&self) -> std::sync::MutexGuard<'_, Window> {
        // Each change of the window completes under the lock.
        self.window
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn class_of(&self, request: &RequestInfo<'_>) -> usize {
        self.classify
            .as_ref()
            .and_then(|classify| classify(request))
            .and_then(|name| self.names.iter().position(|&known| known == name))
            .unwrap_or(self.default_class)
    }

    /// One answered request took `latency`: the controller learns of it, and sets the limit
    /// at the end of a window.
    fn record_latency(&self, latency: Duration) {
        let mut window = self.window();
        let Some((sampled, min)) = window.record(latency, self.clock.now()) else {
            return;
        };
        let peak = self.gate.take_peak();
        let limit = window.controller.on_window(WindowSample {
            latency: sampled,
            min_latency: min,
            peak_in_flight: peak,
        });
        self.gate.set_limit(limit);
        metrics::gauge!(ADAPTIVE_LIMIT).set(f64::from(limit));
    }

    /// When a refused client may come back: about the upstream's latency, at least a second.
    fn retry_after(&self) -> u64 {
        let latency = self.window().last_latency.unwrap_or_default();
        retry_after_secs(latency.max(Duration::from_secs(1)), 0.2, fastrand::f64())
    }
}

/// The service of [`AdaptiveConcurrencyLayer`].
#[derive(Clone)]
pub struct AdaptiveConcurrency<S> {
    inner: S,
    shared: Arc<Adaptive>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for AdaptiveConcurrency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveConcurrency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// On a response the layer refused: the class it was refused in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shed {
    /// The class's name.
    pub class: &'static str,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for AdaptiveConcurrency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<RateLimitBody<ResBody>>;
    type Error = S::Error;
    type Future = AdaptiveFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let shared = &self.shared;
        let info = RequestInfo::new(&request);
        let class = shared.class_of(&info);
        let client = shared.client.as_ref().and_then(|client| client(&info));
        let verdict = shared.gate.admit(class, client, shared.enforce);
        if let Err(refusal) = verdict {
            let mode = if shared.enforce { "enforce" } else { "shadow" };
            metrics::counter!(ADAPTIVE_SHED_TOTAL, "class" => shared.names[class], "mode" => mode)
                .increment(1);
            if shared.enforce {
                let grpc = is_grpc(&request);
                let shed = Shed {
                    class: shared.names[class],
                };
                let answer = shed_response(grpc, shared.retry_after(), refusal, shed);
                return AdaptiveFuture::shed(answer);
            }
        }
        let permit = Permit {
            shared: shared.clone(),
            class,
            client,
            started: shared.clock.now(),
        };
        AdaptiveFuture {
            state: FutureState::Inner {
                future: self.inner.call(request),
                permit: Some(permit),
            },
        }
    }
}

/// A request counted in flight: released when the response comes or the future is dropped.
struct Permit {
    shared: Arc<Adaptive>,
    class: usize,
    client: Option<u64>,
    started: Timestamp,
}

impl Permit {
    /// The service answered (or failed): its latency is a sample.
    fn answered(self) {
        let now = self.shared.clock.now();
        let latency =
            Duration::from_micros(now.as_micros().saturating_sub(self.started.as_micros()));
        self.shared.record_latency(latency);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.shared.gate.release(self.class, self.client);
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
        Inner { #[pin] future: F, permit: Option<Permit> },
        Shed { answer: Option<Response<Bytes>> },
    }
}

impl<F> AdaptiveFuture<F> {
    fn shed(answer: Response<Bytes>) -> Self {
        AdaptiveFuture {
            state: FutureState::Shed {
                answer: Some(answer),
            },
        }
    }
}

impl<F, B, E> Future for AdaptiveFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<RateLimitBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProjection::Shed { answer } => {
                let answer = answer
                    .take()
                    .expect("AdaptiveFuture polled after it completed");
                Poll::Ready(Ok(answer.map(RateLimitBody::full)))
            }
            StateProjection::Inner { future, permit } => {
                let answered = ready!(future.poll(cx));
                if let Some(permit) = permit.take() {
                    permit.answered();
                }
                Poll::Ready(
                    answered.map(|response| {
                        response.map(|body| RateLimitBody::inner(body, None, None))
                    }),
                )
            }
        }
    }
}

fn is_grpc<B>(request: &Request<B>) -> bool {
    request
        .headers()
        .get(CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"))
}

/// 503 with `Retry-After` and the draft's problem type; a gRPC call's trailers-only
/// `UNAVAILABLE`.
fn shed_response(grpc: bool, retry_after: u64, refusal: Refusal, shed: Shed) -> Response<Bytes> {
    let detail = match refusal {
        Refusal::ClassFull => "The service is at reduced capacity; retry later.",
        Refusal::ClientShare => {
            "The service is at reduced capacity and this client holds its share; retry later."
        }
    };
    let mut response = if grpc {
        let mut response = Response::new(Bytes::new());
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(
            HeaderName::from_static("grpc-status"),
            HeaderValue::from_static("14"),
        );
        headers.insert(
            HeaderName::from_static("grpc-message"),
            HeaderValue::from_static("reduced%20capacity"),
        );
        response
    } else {
        let body = serde_json::json!({
            "type": REDUCED_CAPACITY_PROBLEM,
            "title": "Service Unavailable",
            "status": 503,
            "detail": detail,
            "class": shed.class,
        });
        let mut response = Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        response
    };
    write_retry_after(response.headers_mut(), retry_after);
    response.extensions_mut().insert(shed);
    response
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use tokio::sync::oneshot;
    use tower::{ServiceExt, service_fn};

    use super::*;
    use crate::time::FakeClock;

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
            Some(&Shed { class: "default" })
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
