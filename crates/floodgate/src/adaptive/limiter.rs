//! The adaptive limiter apart from any service: classes by name, admission, permits whose
//! answers feed the controller, and the answer a shed request gets. The layer
//! ([`super::AdaptiveConcurrencyLayer`]) uses it around a service; the gateway uses it in its
//! proxy, one per upstream.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use http::{HeaderName, Response, StatusCode};

use super::controller::{Gradient, GradientSettings, WindowSample};
use super::gate::{Class, Gate, GateSnapshot, Refusal, Verdict};
use crate::headers::{retry_after_secs, write_retry_after};
use crate::outcome::{Outcome, RequestOutcome};
use crate::time::{Clock, Timestamp};

/// The IETF RateLimit draft's problem type for a service that sheds load.
pub const REDUCED_CAPACITY_PROBLEM: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// `floodgate_adaptive_limit{limiter}`: the concurrency limit in force.
pub const ADAPTIVE_LIMIT: &str = "floodgate_adaptive_limit";
/// `floodgate_adaptive_shed_total{limiter,class,mode}`: requests refused (`mode="enforce"`) or
/// that would have been (`mode="shadow"`).
pub const ADAPTIVE_SHED_TOTAL: &str = "floodgate_adaptive_shed_total";
/// `floodgate_adaptive_peak_in_flight{limiter}`: the most requests in flight at once in the
/// last window.
pub const ADAPTIVE_PEAK_IN_FLIGHT: &str = "floodgate_adaptive_peak_in_flight";
/// `floodgate_adaptive_latency_seconds{limiter}`: the last window's sampled latency.
pub const ADAPTIVE_LATENCY_SECONDS: &str = "floodgate_adaptive_latency_seconds";
/// `floodgate_adaptive_min_rtt_seconds{limiter}`: the minimum round trip learned.
pub const ADAPTIVE_MIN_RTT_SECONDS: &str = "floodgate_adaptive_min_rtt_seconds";
/// `floodgate_adaptive_waited_total{limiter,class}`: requests admitted after waiting for a
/// place ([`Class::wait`]).
pub const ADAPTIVE_WAITED_TOTAL: &str = "floodgate_adaptive_waited_total";

/// The limit, the gate and the controller one service (or upstream) is protected by. Clones
/// share them.
#[derive(Clone)]
pub struct AdaptiveLimiter {
    shared: Arc<LimiterState>,
}

struct LimiterState {
    /// The `limiter` label of its metrics.
    name: Arc<str>,
    gate: Gate,
    names: Vec<Arc<str>>,
    /// How long each class's requests may wait for a place.
    waits: Vec<Duration>,
    default_class: usize,
    enforce: bool,
    clock: Arc<dyn Clock>,
    window: Mutex<Window>,
}

/// What [`AdaptiveLimiter::snapshot`] shows.
#[derive(Clone, Debug, PartialEq)]
pub struct AdaptiveSnapshot {
    /// The limit, in flight, and each class's counts.
    pub gate: GateSnapshot,
    /// The minimum round trip learned.
    pub min_rtt: Option<Duration>,
    /// The last window's sampled latency.
    pub sample_latency: Option<Duration>,
}

/// What the limiter made of a request.
#[derive(Debug)]
pub enum Admission {
    /// Go on; hold the permit until the service answers.
    Admitted(AdaptivePermit),
    /// Refused: answer with [`ShedDecision::response`].
    Shed(ShedDecision),
    /// Its class is full and waits ([`Class::wait`]): [`Queued::wait`] for a place.
    Queued(Queued),
}

/// A request waiting for a place in its class. Dropped before its wait ends (its client
/// left), it leaves the queue, neither admitted nor refused.
#[derive(Debug)]
pub struct Queued {
    limiter: AdaptiveLimiter,
    class: usize,
    client: Option<u64>,
    /// Whether it left the queue, admitted or refused.
    settled: bool,
}

/// A refused request: its class, why, and when to come back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShedDecision {
    /// The class it was refused in.
    pub class: Arc<str>,
    /// Why.
    pub refusal: Refusal,
    /// `Retry-After`: about the service's latency, at least a second, jittered.
    pub retry_after_secs: u64,
}

/// On a response the limiter refused: the class it was refused in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shed {
    /// The class's name.
    pub class: Arc<str>,
}

impl AdaptiveLimiter {
    /// A limiter over `classes` (highest first; checked by the builder).
    pub(crate) fn new(
        name: Arc<str>,
        settings: GradientSettings,
        classes: &[Class],
        default_class: usize,
        client_share: f64,
        enforce: bool,
        clock: Arc<dyn Clock>,
    ) -> AdaptiveLimiter {
        AdaptiveLimiter {
            shared: Arc::new(LimiterState {
                name,
                gate: Gate::new(classes, settings.initial_limit, client_share),
                names: classes.iter().map(|class| class.name().clone()).collect(),
                waits: classes.iter().map(Class::waits).collect(),
                default_class,
                enforce,
                clock,
                window: Mutex::new(Window::new(Gradient::new(settings))),
            }),
        }
    }

    /// The classes' names, highest first.
    pub fn classes(&self) -> &[Arc<str>] {
        &self.shared.names
    }

    /// The index of the class named `name`; the default class for `None` or an unknown name.
    pub fn class_index(&self, name: Option<&str>) -> usize {
        name.and_then(|name| self.shared.names.iter().position(|known| **known == *name))
            .unwrap_or(self.shared.default_class)
    }

    /// Decides a request of the class at `class` (see [`AdaptiveLimiter::class_index`]) from
    /// `client`. In shadow, every request is admitted and what would have been refused is
    /// counted.
    /// A class that waits may answer [`Admission::Queued`] (never in shadow).
    pub fn admit(&self, class: usize, client: Option<u64>) -> Admission {
        let shared = &self.shared;
        let class = class.min(shared.names.len() - 1);
        match shared.gate.admit(class, client, shared.enforce) {
            Verdict::Admitted => Admission::Admitted(self.permit(class, client)),
            Verdict::Queued => Admission::Queued(Queued {
                limiter: self.clone(),
                class,
                client,
                settled: false,
            }),
            Verdict::Refused(refusal) => {
                self.count_shed(class);
                if shared.enforce {
                    Admission::Shed(self.shed(class, refusal))
                } else {
                    Admission::Admitted(self.permit(class, client))
                }
            }
        }
    }

    fn permit(&self, class: usize, client: Option<u64>) -> AdaptivePermit {
        AdaptivePermit {
            limiter: self.clone(),
            class,
            client,
            started: self.shared.clock.now(),
        }
    }

    fn shed(&self, class: usize, refusal: Refusal) -> ShedDecision {
        ShedDecision {
            class: self.shared.names[class].clone(),
            refusal,
            retry_after_secs: self.retry_after(),
        }
    }

    fn count_shed(&self, class: usize) {
        let shared = &self.shared;
        let mode = if shared.enforce { "enforce" } else { "shadow" };
        // Shared strings as labels: a refusal, frequent under overload, allocates nothing.
        let (limiter, name) = (shared.name.clone(), shared.names[class].clone());
        metrics::counter!(ADAPTIVE_SHED_TOTAL, "limiter" => limiter, "class" => name, "mode" => mode)
            .increment(1);
    }

    /// What the limiter shows: the limit, in flight, latencies, counts by class.
    pub fn snapshot(&self) -> AdaptiveSnapshot {
        let window = self.window();
        AdaptiveSnapshot {
            gate: self.shared.gate.snapshot(&self.shared.names),
            min_rtt: window.controller.min_rtt(),
            sample_latency: window.last_latency,
        }
    }

    fn window(&self) -> MutexGuard<'_, Window> {
        // Each change of the window completes under the lock.
        self.shared
            .window
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// One answered request took `latency`: the controller learns of it, and sets the limit
    /// at the end of a window.
    fn record_latency(&self, latency: Duration) {
        let mut window = self.window();
        let Some((sampled, min)) = window.record(latency, self.shared.clock.now()) else {
            return;
        };
        let (peak, refused) = self.shared.gate.take_window();
        let limit = window.controller.on_window(WindowSample {
            latency: sampled,
            min_latency: min,
            peak_in_flight: peak,
            refused,
        });
        self.shared.gate.set_limit(limit);
        let name = &self.shared.name;
        metrics::gauge!(ADAPTIVE_LIMIT, "limiter" => name.clone()).set(f64::from(limit));
        metrics::gauge!(ADAPTIVE_PEAK_IN_FLIGHT, "limiter" => name.clone()).set(f64::from(peak));
        metrics::gauge!(ADAPTIVE_LATENCY_SECONDS, "limiter" => name.clone())
            .set(sampled.as_secs_f64());
        if let Some(min_rtt) = window.controller.min_rtt() {
            metrics::gauge!(ADAPTIVE_MIN_RTT_SECONDS, "limiter" => name.clone())
                .set(min_rtt.as_secs_f64());
        }
    }

    /// When a refused client may come back: about the service's latency, at least a second.
    fn retry_after(&self) -> u64 {
        let latency = self.window().last_latency.unwrap_or_default();
        retry_after_secs(latency.max(Duration::from_secs(1)), 0.2, fastrand::f64())
    }
}

impl std::fmt::Debug for AdaptiveLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveLimiter")
            .field("classes", &self.shared.names)
            .finish_non_exhaustive()
    }
}

impl Queued {
    /// Waits for a place, up to its class's wait: a permit, or the refusal once the wait ran
    /// out (counted as shed then, once).
    pub async fn wait(mut self) -> Result<AdaptivePermit, ShedDecision> {
        let limiter = self.limiter.clone();
        let gate = &limiter.shared.gate;
        let deadline = tokio::time::Instant::now() + limiter.shared.waits[self.class];
        loop {
            let freed = gate.freed(self.class).notified();
            let mut freed = std::pin::pin!(freed);
            // Enabled before trying: a release between the try and the wait wakes it.
            freed.as_mut().enable();
            match gate.admit_waiting(self.class, self.client) {
                Ok(true) => {
                    self.settled = true;
                    let shared = &limiter.shared;
                    let (name, class) = (shared.name.clone(), shared.names[self.class].clone());
                    metrics::counter!(ADAPTIVE_WAITED_TOTAL, "limiter" => name, "class" => class)
                        .increment(1);
                    return Ok(limiter.permit(self.class, self.client));
                }
                Ok(false) => {}
                Err(refusal) => {
                    self.settled = true;
                    limiter.count_shed(self.class);
                    return Err(limiter.shed(self.class, refusal));
                }
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                self.settled = true;
                gate.stop_waiting(self.class, self.client, true);
                limiter.count_shed(self.class);
                return Err(limiter.shed(self.class, Refusal::ClassFull));
            }
        }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if !self.settled {
            self.limiter
                .shared
                .gate
                .stop_waiting(self.class, self.client, false);
        }
    }
}

/// A request counted in flight: released when dropped; [`AdaptivePermit::answered`] when the
/// service answered makes its latency a sample.
pub struct AdaptivePermit {
    limiter: AdaptiveLimiter,
    class: usize,
    client: Option<u64>,
    started: Timestamp,
}

impl AdaptivePermit {
    /// The service answered (or failed): its latency is a sample, and the place is free.
    pub fn answered(self) {
        let now = self.limiter.shared.clock.now();
        let latency =
            Duration::from_micros(now.as_micros().saturating_sub(self.started.as_micros()));
        self.limiter.record_latency(latency);
    }
}

impl Drop for AdaptivePermit {
    fn drop(&mut self) {
        self.limiter.shared.gate.release(self.class, self.client);
    }
}

impl std::fmt::Debug for AdaptivePermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptivePermit")
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
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

    /// Adds one latency; the window's sample (percentile, minimum) once it is long and full
    /// enough.
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

impl ShedDecision {
    /// 503 with `Retry-After`, `Cache-Control: no-store` and the draft's problem type; for a
    /// gRPC call (`grpc`), a trailers-only `UNAVAILABLE`. Carries the [`Shed`] extension.
    pub fn response(&self, grpc: bool) -> Response<Bytes> {
        let mut response = if grpc {
            grpc_unavailable()
        } else {
            let detail = match self.refusal {
                Refusal::ClassFull => "The service is at reduced capacity; retry later.",
                Refusal::ClientShare => {
                    "The service is at reduced capacity and this client holds its share; retry \
                     later."
                }
            };
            let body = serde_json::json!({
                "type": REDUCED_CAPACITY_PROBLEM,
                "title": "Service Unavailable",
                "status": 503,
                "detail": detail,
                "class": &*self.class,
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
        write_retry_after(response.headers_mut(), self.retry_after_secs);
        response.extensions_mut().insert(Shed {
            class: self.class.clone(),
        });
        // The typed outcome, for a rate limit layer around this one (it adds its binding
        // limit) or, with none, for whatever reports on requests.
        response
            .extensions_mut()
            .insert(RequestOutcome::undecided(Outcome::Shed));
        response
    }
}

fn grpc_unavailable() -> Response<Bytes> {
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
}

/// Whether `headers` say the request is a gRPC call.
pub fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"))
}
