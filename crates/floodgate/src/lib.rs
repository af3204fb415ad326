#![doc = include_str!("../README.md")]

pub mod algorithm;
mod decision;
mod limit;
pub mod store;
mod time;

pub use decision::{Decision, DecisionSource, LimitStatus};
pub use limit::{
    Algorithm, DEFAULT_LEASE_TTL, Limit, LimitBuilder, LimitError, MAX_NAME_LEN, MAX_QUANTITY,
    MAX_WINDOW,
};
pub use store::{Check, Lease, MemoryStore, Store, StoreError};
pub use time::{Clock, FakeClock, SystemClock, Timestamp};
