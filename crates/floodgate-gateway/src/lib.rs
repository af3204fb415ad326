//! The floodgate gateway: a reverse proxy that applies floodgate's rate limits from a YAML
//! configuration (SPEC §5), hot-reloaded, with an admin API (SPEC §7).
//!
//! By concern: [`gateway`] is the running gateway (the version in service, reloads, the
//! access log) and [`version`] one configuration version (its plan, layers, store and
//! upstream client); [`client`], [`plan`] and [`stores`] decide who a request is from, which
//! limits it meets and where they are counted; [`head`] and [`path`] check and normalise a
//! request before that; [`proxy`] forwards it (the upstream pool, the client's body);
//! [`serve`] accepts connections (listeners, workers, watching the configuration); [`admin`]
//! answers operators (the API, client inspection, the status page) from what [`status`] observes; [`rls`] is Envoy's rate
//! limit service; [`config`] reads the file.

pub mod access_log;
pub mod admin;
pub mod client;
pub mod config;
pub mod error;
pub mod gateway;
pub mod head;
pub mod path;
pub mod plan;
pub mod proxy;
pub mod rls;
pub mod serve;
pub mod status;
pub mod stores;
pub mod telemetry;
pub mod tls;
pub mod version;
