//! The library's integration tests, as one test binary: each file beside this one is a module,
//! so the crate and its dependencies are linked once instead of once per file. A test that
//! needs the process to itself (a global allocator, a metrics recorder, process-wide totals, its
//! own `main`) stays a file of its own in `tests/`; `Cargo.toml` says why for each, and
//! `layout::only_the_process_wide_tests_have_a_binary_of_their_own` keeps it so.

// Shared helpers, before the tests: `conformance`'s suite macros are in scope for the modules
// declared after it.
mod common;
#[macro_use]
mod conformance;
mod layout;

mod at_most_once;
mod batched;
mod builder_misuse;
mod calendar_skew;
mod chaos;
mod coalescing;
mod conformance_memory;
mod conformance_redis;
mod deny_cache;
mod estimates;
mod fleet;
mod hostile_input;
mod hot_identities;
mod layer_identity;
mod layer_lists_and_rollout;
mod layer_outcome;
mod layer_responses;
mod layer_shaping_and_leases;
mod layer_sharing_and_failure;
mod lease_edges;
mod memory_store;
mod operator;
mod overrides;
mod partial_failures;
mod properties;
mod quota;
mod redis_differential;
mod redis_drops;
mod redis_exactness;
mod redis_failover;
mod redis_faults;
mod redis_fixed_window;
mod redis_persistence;
mod regions;
mod store_wrappers;
mod tiered_plan;
