//! The gateway's integration tests, as one test binary: each file beside this one is a module,
//! so the crate and its dependencies are linked once instead of once per file. They run the
//! real `floodgate` binary in child processes, so none needs this process to itself;
//! `layout::the_suite_is_one_binary` keeps it so.

mod layout;
mod support;

mod access_log;
mod adaptive;
mod batched;
mod deploy;
mod estimates;
mod gateway;
mod hostile_input;
mod jwt;
mod metrics;
mod operator;
mod overrides;
mod per_core;
mod regions;
mod reload;
mod rlqs;
mod rls;
mod rollout;
mod security;
mod status_page;
mod store_health;
mod streaming;
mod tls;
mod upstream_pool;
