//! The gateway's own metrics (SPEC §8; the library's are in `floodgate::telemetry`): each name
//! once, with its `# HELP` text in [`GATEWAY_METRICS`].

use floodgate::telemetry::{MetricDescription, MetricKind};

/// `floodgate_access_log_dropped_total`: access log lines dropped because the writer could
/// not keep up (its queue was full).
pub(crate) const ACCESS_LOG_DROPPED_TOTAL: &str = "floodgate_access_log_dropped_total";
/// `floodgate_config_reloads_total{result}`: `success` or `failure`.
pub(crate) const CONFIG_RELOADS_TOTAL: &str = "floodgate_config_reloads_total";
/// `floodgate_config_version`: the version in service.
pub(crate) const CONFIG_VERSION: &str = "floodgate_config_version";
/// `floodgate_upstream_requests_total{status}`.
pub(crate) const UPSTREAM_REQUESTS_TOTAL: &str = "floodgate_upstream_requests_total";
/// `floodgate_upstream_duration_seconds`: until the upstream's response head.
pub(crate) const UPSTREAM_DURATION_SECONDS: &str = "floodgate_upstream_duration_seconds";
/// `floodgate_admin_resets_total`.
pub(crate) const ADMIN_RESETS_TOTAL: &str = "floodgate_admin_resets_total";
/// `floodgate_rejected_requests_total{reason}`: refused before any limit.
pub(crate) const REJECTED_REQUESTS_TOTAL: &str = "floodgate_rejected_requests_total";
/// `floodgate_tokens_total{result}`: requests that carried a token in `identity.jwt`'s header:
/// `verified`, or why it was refused (`expired`, `signature`, ...).
pub(crate) const TOKENS_TOTAL: &str = "floodgate_tokens_total";
/// `floodgate_client_errors_total{kind}`.
pub(crate) const CLIENT_ERRORS_TOTAL: &str = "floodgate_client_errors_total";
/// `floodgate_connections_closed_total{reason}`.
pub(crate) const CONNECTIONS_CLOSED_TOTAL: &str = "floodgate_connections_closed_total";
/// `floodgate_connections_at_limit_total`.
pub(crate) const CONNECTIONS_AT_LIMIT_TOTAL: &str = "floodgate_connections_at_limit_total";
/// `floodgate_accept_errors_total`.
pub(crate) const ACCEPT_ERRORS_TOTAL: &str = "floodgate_accept_errors_total";
/// `floodgate_tls_reloads_total{result}`.
pub(crate) const TLS_RELOADS_TOTAL: &str = "floodgate_tls_reloads_total";
/// `floodgate_tls_handshake_failures_total`.
pub(crate) const TLS_HANDSHAKE_FAILURES_TOTAL: &str = "floodgate_tls_handshake_failures_total";
/// `floodgate_rls_reloads_total{result}`: reloads of the rate limit service's domain files.
pub(crate) const RLS_RELOADS_TOTAL: &str = "floodgate_rls_reloads_total";
/// `floodgate_rls_limit_overrides_total{outcome}`: descriptors that carried Envoy's `limit`
/// override: `applied` or `invalid`.
pub(crate) const RLS_LIMIT_OVERRIDES_TOTAL: &str = "floodgate_rls_limit_overrides_total";
/// `floodgate_rls_override_evictions_total`: limits of Envoy's `limit` overrides evicted
/// (least recently used) to make room for a new override value past the bound.
pub(crate) const RLS_OVERRIDE_EVICTIONS_TOTAL: &str = "floodgate_rls_override_evictions_total";
/// The quota service's streams open (SPEC §10a).
pub(crate) const RLQS_STREAMS: &str = "floodgate_rlqs_streams";
/// Bucket usage reports received, by domain.
pub(crate) const RLQS_REPORTS_TOTAL: &str = "floodgate_rlqs_reports_total";
/// Requests the Envoys reported, by domain and decision.
pub(crate) const RLQS_REQUESTS_TOTAL: &str = "floodgate_rlqs_requests_total";
/// Assignments sent, by domain and strategy.
pub(crate) const RLQS_ASSIGNMENTS_TOTAL: &str = "floodgate_rlqs_assignments_total";
/// Buckets abandoned, by domain.
pub(crate) const RLQS_ABANDONED_TOTAL: &str = "floodgate_rlqs_abandoned_total";
/// Failed calls to the quota board.
pub(crate) const RLQS_STORE_ERRORS_TOTAL: &str = "floodgate_rlqs_store_errors_total";
/// Buckets not answered because a stream held its most.
pub(crate) const RLQS_BUCKETS_REFUSED_TOTAL: &str = "floodgate_rlqs_buckets_refused_total";

const fn counter(name: &'static str, help: &'static str) -> MetricDescription {
    MetricDescription {
        name,
        kind: MetricKind::Counter,
        seconds: false,
        help,
    }
}

/// Every metric the gateway records itself.
pub const GATEWAY_METRICS: &[MetricDescription] = &[
    counter(
        ACCESS_LOG_DROPPED_TOTAL,
        "Access log lines dropped because the writer could not keep up (its queue was full)",
    ),
    counter(
        CONFIG_RELOADS_TOTAL,
        "Configuration reloads, by result (success, failure)",
    ),
    MetricDescription {
        name: CONFIG_VERSION,
        kind: MetricKind::Gauge,
        seconds: false,
        help: "Version of the configuration in service",
    },
    counter(
        UPSTREAM_REQUESTS_TOTAL,
        "Upstream answers by status (502 and 504 are the gateway's own)",
    ),
    MetricDescription {
        name: UPSTREAM_DURATION_SECONDS,
        kind: MetricKind::Histogram,
        seconds: true,
        help: "Time until the upstream's response head",
    },
    counter(
        ADMIN_RESETS_TOTAL,
        "Clients whose counters an operator reset (DELETE /admin/clients)",
    ),
    counter(
        REJECTED_REQUESTS_TOTAL,
        "Requests refused before any limit, by reason (bad host, path, unknown API key, ...)",
    ),
    counter(
        TOKENS_TOTAL,
        "Requests that carried a token (identity.jwt): verified, or why it was refused",
    ),
    counter(
        CLIENT_ERRORS_TOTAL,
        "Request bodies the client broke (malformed_body) or stalled (body_timeout)",
    ),
    counter(
        CONNECTIONS_CLOSED_TOTAL,
        "Client connections closed by the gateway, by reason (header_timeout, idle_timeout)",
    ),
    counter(
        CONNECTIONS_AT_LIMIT_TOTAL,
        "Times the accept loop waited for a slot under server.max_connections",
    ),
    counter(
        ACCEPT_ERRORS_TOTAL,
        "Failed accepts (descriptor exhaustion, mostly)",
    ),
    counter(TLS_RELOADS_TOTAL, "Listener certificate reloads, by result"),
    counter(
        TLS_HANDSHAKE_FAILURES_TOTAL,
        "Client TLS handshakes that failed",
    ),
    counter(
        RLS_RELOADS_TOTAL,
        "Reloads of the rate limit service's domain directory, by result",
    ),
    counter(
        RLS_LIMIT_OVERRIDES_TOTAL,
        "Descriptors carrying Envoy's limit override, by outcome (applied, invalid)",
    ),
    counter(
        RLS_OVERRIDE_EVICTIONS_TOTAL,
        "Limits of Envoy's limit overrides evicted (least recently used) for a new override value past the bound of 1,024",
    ),
    MetricDescription {
        name: RLQS_STREAMS,
        kind: MetricKind::Gauge,
        seconds: false,
        help: "Rate limit quota service streams open (one per Envoy and domain)",
    },
    counter(
        RLQS_REPORTS_TOTAL,
        "Bucket usage reports the quota service received, by domain",
    ),
    counter(
        RLQS_REQUESTS_TOTAL,
        "Requests the Envoys reported to the quota service, by domain and decision (allowed, denied)",
    ),
    counter(
        RLQS_ASSIGNMENTS_TOTAL,
        "Quota assignments sent, by domain and strategy (token_bucket, allow_all, deny_all)",
    ),
    counter(
        RLQS_ABANDONED_TOTAL,
        "Quota buckets abandoned after reports without a request, by domain",
    ),
    counter(
        RLQS_STORE_ERRORS_TOTAL,
        "Calls to the quota board (memory or Redis) that failed",
    ),
    counter(
        RLQS_BUCKETS_REFUSED_TOTAL,
        "Quota buckets not answered because their stream held its most (50,000)",
    ),
];

/// Describes the library's metrics and the gateway's.
pub(crate) fn describe_all() {
    floodgate::telemetry::describe_metrics();
    floodgate::telemetry::describe(GATEWAY_METRICS);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `"floodgate_…"` name written in the source of the library or the gateway is in
    /// one of the two tables, so that every series `/metrics` can show has its `# HELP` (the
    /// gateway's metrics test checks the rendered text of the series a run produces).
    #[test]
    fn every_metric_name_in_the_source_is_described() {
        let described: std::collections::HashSet<&str> = floodgate::telemetry::METRICS
            .iter()
            .chain(GATEWAY_METRICS)
            .map(|metric| metric.name)
            .collect();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = Vec::new();
        for crate_dir in ["floodgate/src", "floodgate-gateway/src"] {
            collect_rust_files(&root.join(crate_dir), &mut files);
        }
        assert!(files.len() > 40, "the sources were found");
        let mut names = 0;
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for (start, _) in text.match_indices("\"floodgate_") {
                let name: String = text[start + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                // A whole literal of a metric's shape (not this test's own search pattern, nor
                // a format string such as a Lua function's name).
                let whole = text[start + 1 + name.len()..].starts_with('"');
                if name == "floodgate_" || !whole {
                    continue;
                }
                names += 1;
                assert!(
                    described.contains(name.as_str()),
                    "{}: `{name}` is recorded but not in METRICS or GATEWAY_METRICS",
                    file.display()
                );
            }
        }
        assert!(names >= described.len(), "every name was seen");
    }

    fn collect_rust_files(directory: &std::path::Path, files: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(directory).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                collect_rust_files(&path, files);
            } else if path.extension().is_some_and(|extension| extension == "rs") {
                files.push(path);
            }
        }
    }
}
