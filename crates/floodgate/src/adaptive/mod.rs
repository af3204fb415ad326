//! Adaptive concurrency: when the service behind the layer slows down (a slow database, a
//! deploy, a lost zone), every client may be within its rate limit while the service's queue
//! grows for all. This layer keeps an in-flight limit that follows the service's latency
//! ([`controller`]: a gradient, as Envoy's `adaptive_concurrency` filter, with its minimum
//! round trip learned from live traffic) and admits requests by priority class under it
//! ([`Class`]: ordered, each able to reserve a share of the limit from the classes below it,
//! one client held to a share of its class, a class able to wait briefly for a place), so
//! that what matters is served while the rest is shed with a 503 and a `Retry-After` of about
//! the service's latency.
//!
//! ```
//! use std::time::Duration;
//!
//! use floodgate::adaptive::{AdaptiveConcurrencyLayer, Class};
//!
//! let layer = AdaptiveConcurrencyLayer::builder()
//!     .classes([
//!         Class::new("critical")
//!             .reserve(0.2)
//!             .wait(Duration::from_millis(100)),
//!         Class::new("default"),
//!         Class::new("sheddable"),
//!     ])
//!     .default_class("default")
//!     .classify(|request| match request.headers.get("x-priority")?.as_bytes() {
//!         b"critical" => Some("critical"),
//!         b"sheddable" => Some("sheddable"),
//!         _ => None,
//!     })
//!     .build()
//!     .unwrap();
//! # let _ = layer;
//! ```

pub mod controller;
mod gate;
mod limiter;
mod service;
#[cfg(test)]
mod simulation;

pub use controller::{Gradient, GradientSettings, WindowSample};
pub use gate::{Class, ClassSnapshot, GateSnapshot, Refusal};
pub use limiter::{
    ADAPTIVE_LATENCY_SECONDS, ADAPTIVE_LIMIT, ADAPTIVE_MIN_RTT_SECONDS, ADAPTIVE_PEAK_IN_FLIGHT,
    ADAPTIVE_SHED_TOTAL, ADAPTIVE_WAITED_TOTAL, AdaptiveLimiter, AdaptivePermit, AdaptiveSnapshot,
    Admission, Queued, REDUCED_CAPACITY_PROBLEM, Shed, ShedDecision, is_grpc,
};
pub use service::{
    AdaptiveConcurrency, AdaptiveConcurrencyBuilder, AdaptiveConcurrencyLayer, AdaptiveFuture,
    Classify, ClientOf,
};
