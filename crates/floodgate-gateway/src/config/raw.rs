//! The configuration file as written (SPEC §5): every field has a default, unknown fields are
//! errors. Values that need checking stay strings here and are validated, with their field
//! path, by the section that owns them. This file is the top level; each section's raw type
//! lives in its own module, with its defaults.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::adaptive::RawAdaptive;
use super::clients::{RawClients, RawIdentity, RawLists};
use super::limits::{RawLimit, RawPlan};
use super::operations::{RawAccessLog, RawAdmin};
use super::response::RawResponse;
use super::rls::RawRls;
use super::rollout::RawRollout;
use super::routes::RawRoute;
use super::server::RawServer;
use super::store::RawStore;
use super::tls::{RawListenTls, RawUpstreamTls};

/// The upstream when `upstream` is absent (and the proxy served).
pub(super) const DEFAULT_UPSTREAM: &str = "http://127.0.0.1:3000";

/// The whole file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawConfig {
    /// The proxy's address.
    pub listen: String,
    /// The admin API.
    pub admin: RawAdmin,
    /// What the listener enforces on every client connection.
    pub server: RawServer,
    /// Absent in an RLS-only deployment: then the proxy is not served (its `listen` is not
    /// bound), unless `routes` name upstreams of their own.
    pub upstream: Option<String>,
    /// The longest an upstream may take to answer.
    pub upstream_timeout: String,
    /// TLS on the proxy's listener.
    pub listen_tls: Option<RawListenTls>,
    /// TLS towards the upstreams.
    pub upstream_tls: Option<RawUpstreamTls>,
    /// `auto`, `http1` or `http2`.
    pub upstream_protocol: String,
    /// Upstreams and costs per endpoint.
    pub routes: Vec<RawRoute>,
    /// Where the counters live.
    pub store: RawStore,
    /// `open`, `closed` or `local`.
    pub on_store_error: String,
    /// How a client is identified.
    pub identity: RawIdentity,
    /// API keys and the plans they belong to.
    pub clients: RawClients,
    /// The plans, by name.
    pub plans: BTreeMap<String, RawPlan>,
    /// Limits on every client IP, whatever its plan.
    pub per_ip: Vec<RawLimit>,
    /// Ceilings every client shares, by endpoint pattern.
    pub global: BTreeMap<String, Vec<RawLimit>>,
    /// How limits are applied (enforced, shadowed, off).
    pub rollout: RawRollout,
    /// Clients never limited.
    pub allowlist: RawLists,
    /// Clients always refused.
    pub denylist: RawLists,
    /// The headers and bodies of answers.
    pub response: RawResponse,
    /// Envoy's rate limit service.
    pub rls: Option<RawRls>,
    /// One line per request.
    pub access_log: Option<RawAccessLog>,
    /// Shedding when an upstream slows down.
    pub adaptive_concurrency: Option<RawAdaptive>,
}

impl Default for RawConfig {
    fn default() -> Self {
        RawConfig {
            listen: "0.0.0.0:8080".to_owned(),
            admin: Default::default(),
            server: Default::default(),
            upstream: None,
            upstream_timeout: "30s".to_owned(),
            listen_tls: None,
            upstream_tls: None,
            upstream_protocol: "auto".to_owned(),
            routes: Vec::new(),
            store: Default::default(),
            on_store_error: "open".to_owned(),
            identity: Default::default(),
            clients: Default::default(),
            plans: BTreeMap::new(),
            per_ip: Vec::new(),
            global: BTreeMap::new(),
            rollout: Default::default(),
            allowlist: Default::default(),
            denylist: Default::default(),
            response: Default::default(),
            rls: None,
            access_log: None,
            adaptive_concurrency: None,
        }
    }
}

impl RawConfig {
    /// Every list of limits in the file, with its path: plans, their endpoints, per IP, global.
    pub(super) fn limit_lists(&self) -> Vec<(String, &[RawLimit])> {
        let mut lists: Vec<(String, &[RawLimit])> = Vec::new();
        for (name, plan) in &self.plans {
            lists.push((format!("plans.{name}.limits"), &plan.limits));
            for (pattern, limits) in &plan.endpoints {
                lists.push((format!("plans.{name}.endpoints.\"{pattern}\""), limits));
            }
        }
        lists.push(("per_ip".to_owned(), &self.per_ip));
        for (pattern, limits) in &self.global {
            lists.push((format!("global.\"{pattern}\""), limits));
        }
        lists
    }
}
