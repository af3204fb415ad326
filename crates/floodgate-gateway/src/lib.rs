//! The floodgate gateway: a reverse proxy that applies floodgate's rate limits from a YAML
//! configuration (SPEC §5), hot-reloaded, with an admin API (SPEC §7).

pub mod access_log;
pub mod admin;
pub mod client;
pub mod client_body;
pub mod config;
pub mod error;
pub mod head;
pub mod inspect;
pub mod path;
pub mod plan;
pub mod pool;
pub mod proxy;
pub mod rls;
pub mod runtime;
pub mod server;
pub mod status;
pub mod stores;
pub mod telemetry;
pub mod tls;
pub mod watch;
