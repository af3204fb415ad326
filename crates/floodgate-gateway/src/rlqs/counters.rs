//! A stream's counters, registered once per domain rather than looked up per bucket: a report
//! of thousands of buckets counted each of them through the recorder's registry (the label
//! hashed, the key built and dropped), about a sixth of the server's time per report.

use metrics::Counter;

use super::assignment::Strategy;
use crate::telemetry;

/// The counters of one stream's domain label.
pub(super) struct StreamCounters {
    /// The domain label they count under.
    label: String,
    reports: Counter,
    allowed: Counter,
    denied: Counter,
    abandoned: Counter,
    /// Assignments sent, by strategy: allow all, deny all, token bucket.
    assignments: [Counter; 3],
}

impl StreamCounters {
    /// The counters of the domain labelled `label`.
    pub(super) fn new(label: String) -> StreamCounters {
        let requests = |decision: &'static str| metrics::counter!(telemetry::RLQS_REQUESTS_TOTAL, "domain" => label.clone(), "decision" => decision);
        let assignments = |strategy: Strategy| metrics::counter!(telemetry::RLQS_ASSIGNMENTS_TOTAL, "domain" => label.clone(), "strategy" => strategy.label());
        let token_bucket = Strategy::TokenBucket {
            max_tokens: 1,
            tokens_per_fill: 1,
            fill_interval_secs: 1,
        };
        StreamCounters {
            reports: metrics::counter!(telemetry::RLQS_REPORTS_TOTAL, "domain" => label.clone()),
            allowed: requests("allowed"),
            denied: requests("denied"),
            abandoned: metrics::counter!(telemetry::RLQS_ABANDONED_TOTAL, "domain" => label.clone()),
            assignments: [
                assignments(Strategy::AllowAll),
                assignments(Strategy::DenyAll),
                assignments(token_bucket),
            ],
            label,
        }
    }

    /// The domain label they count under.
    pub(super) fn label(&self) -> &str {
        &self.label
    }

    /// One bucket's report: `allowed` and `denied` requests.
    pub(super) fn report(&self, allowed: u64, denied: u64) {
        self.reports.increment(1);
        self.allowed.increment(allowed);
        self.denied.increment(denied);
    }

    /// A bucket abandoned.
    pub(super) fn abandoned(&self) {
        self.abandoned.increment(1);
    }

    /// An assignment of `strategy` sent.
    pub(super) fn assigned(&self, strategy: Strategy) {
        let index = match strategy {
            Strategy::AllowAll => 0,
            Strategy::DenyAll => 1,
            Strategy::TokenBucket { .. } => 2,
        };
        self.assignments[index].increment(1);
    }
}
