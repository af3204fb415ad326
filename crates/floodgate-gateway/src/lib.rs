//! The floodgate gateway: a reverse proxy that applies floodgate's rate limits from a YAML
//! configuration (SPEC §5), hot-reloaded, with an admin API (SPEC §7).
//!
//! By concern: `gateway` is the running gateway (the version in service, reloads, the
//! access log) and `version` one configuration version (its plan, layers, store and
//! upstream client); `client`, `plan` and `stores` decide who a request is from, which
//! limits it meets and where they are counted; `head` and `path` check and normalise a
//! request before that; `proxy` forwards it (the upstream pool, the client's body);
//! `serve` accepts connections (listeners, workers, watching the configuration); `admin`
//! answers operators (the API, client inspection, the status page) from what `status` observes; `rls` is Envoy's rate
//! limit service; `config` reads the file.
//!
//! The modules are the crate's own: what it offers is the binary's two commands ([`check`],
//! [`serve`]) and the few checks its tests and fuzzers drive from outside ([`check_text`],
//! [`normalize`], [`GATEWAY_METRICS`]).

mod access_log;
mod admin;
mod check;
mod client;
mod config;
mod credentials;
mod error;
mod gateway;
mod head;
mod outcome;
mod path;
mod plan;
mod proxy;
mod rlqs;
mod rls;
mod run;
mod serve;
mod status;
mod stores;
mod telemetry;
mod tls;
mod token;
mod version;

pub use check::check;
pub use config::{ConfigError, ConfigErrors, MAX_CONFIG_BYTES, check_text};
pub use error::GatewayError;
pub use path::{PathError, normalize};
pub use run::serve;
pub use telemetry::GATEWAY_METRICS;
