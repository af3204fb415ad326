#![doc = include_str!("../README.md")]

pub mod algorithm;
mod body;
#[cfg(feature = "axum")]
#[doc = include_str!("cookbook.md")]
pub mod cookbook {}
mod decision;
mod future;
pub mod headers;
pub mod key;
mod layer;
mod limit;
mod lists;
pub mod plan;
pub mod post_charge;
mod response;
mod rollout;
mod service;
pub mod store;
pub mod telemetry;
mod time;
mod top;

pub use body::RateLimitBody;
pub use decision::{Decision, DecisionSource, LimitStatus};
pub use future::ResponseFuture;
pub use headers::HeaderStyle;
pub use key::{Identity, IdentityHash, PeerAddr, RequestInfo, UserId};
pub use layer::{BuildError, FailurePolicy, RateLimitLayer, RateLimitLayerBuilder};
pub use limit::{
    Algorithm, DEFAULT_LEASE_TTL, Limit, LimitBuilder, LimitError, MAX_NAME_LEN, MAX_QUANTITY,
    MAX_WINDOW,
};
pub use lists::{ClientList, api_key_digest};
pub use plan::{LimitPlan, StaticPlan, TieredPlan};
pub use post_charge::{CostHeader, ReportedCost, ResponseCost};
pub use response::{
    Denial, MakeLimitedResponse, forbidden_response, unavailable_response, unidentified_response,
};
pub use rollout::{Mode, Rollout};
pub use service::{RateLimit, RequestCost, UnknownIdentity};
pub use store::{Check, Lease, MemoryStore, Store, StoreError};
pub use time::{Clock, FakeClock, SystemClock, Timestamp};
pub use top::{TopClients, TopEntry};
