#![doc = include_str!("../README.md")]

pub mod adaptive;
mod admitted;
pub mod algorithm;
mod body;
#[cfg(feature = "axum")]
#[doc = include_str!("cookbook.md")]
pub mod cookbook {}
pub mod calendar;
pub mod decision;
mod derived;
mod detached;
mod error;
pub mod fallback;
mod future;
pub mod headers;
pub mod key;
mod layer;
pub mod limit;
pub mod lists;
mod operator;
pub mod outcome;
pub mod overrides;
pub mod plan;
mod planning;
pub mod post_charge;
pub mod response;
pub mod rollout;
pub mod route;
pub mod service;
mod shared;
pub mod store;
pub mod telemetry;
pub mod time;
pub mod top;

// What an app writes: the layer, its limits, who a client is, what was decided, the stores.
// Everything else lives in its module (`floodgate::time::FakeClock`, `floodgate::rollout::Mode`).
pub use decision::Decision;
pub use error::BuildError;
pub use fallback::{LocalFallback, OnStoreError};
pub use headers::HeaderStyle;
pub use key::{Identity, PeerAddr, RequestInfo, UserId};
pub use layer::{RateLimitLayer, RateLimitLayerBuilder};
pub use limit::{Algorithm, Limit};
pub use outcome::{Outcome, RequestOutcome};
pub use plan::TieredPlan;
pub use response::Denial;
pub use service::RateLimit;
pub use store::resilience::FailurePolicy;
pub use store::{MemoryStore, Store, StoreError};
