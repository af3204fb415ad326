#![doc = include_str!("../README.md")]

pub mod algorithm;
mod body;
#[cfg(feature = "axum")]
#[doc = include_str!("cookbook.md")]
pub mod cookbook {}
pub mod decision;
mod error;
mod fallback;
mod future;
pub mod headers;
pub mod key;
mod layer;
pub mod limit;
pub mod lists;
mod operator;
pub mod overrides;
pub mod plan;
mod planning;
pub mod post_charge;
pub mod response;
pub mod rollout;
pub mod service;
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
pub use plan::TieredPlan;
pub use response::Denial;
pub use service::RateLimit;
pub use store::resilience::FailurePolicy;
pub use store::{MemoryStore, Store, StoreError};

// The crate root's earlier names, kept so that code written against them still compiles; not
// shown in the documentation. Use the module paths.
#[doc(hidden)]
pub use body::RateLimitBody;
#[doc(hidden)]
pub use decision::{DecisionSource, LimitStatus};
#[doc(hidden)]
pub use future::ResponseFuture;
#[doc(hidden)]
pub use key::IdentityHash;
#[doc(hidden)]
pub use limit::{
    DEFAULT_LEASE_TTL, LimitBuilder, LimitError, MAX_NAME_LEN, MAX_QUANTITY, MAX_WINDOW,
};
#[doc(hidden)]
pub use lists::{ClientList, api_key_digest};
#[doc(hidden)]
pub use plan::{LimitPlan, StaticPlan};
#[doc(hidden)]
pub use post_charge::{CostHeader, ReportedCost, ResponseCost};
#[doc(hidden)]
pub use response::{
    MakeLimitedResponse, forbidden_response, unavailable_response, unidentified_response,
};
#[doc(hidden)]
pub use rollout::{Mode, Rollout};
#[doc(hidden)]
pub use service::{RequestCost, UnknownIdentity};
#[doc(hidden)]
pub use store::{Check, Lease};
#[doc(hidden)]
pub use time::{Clock, FakeClock, SystemClock, Timestamp};
#[doc(hidden)]
pub use top::{TopClients, TopEntry};
