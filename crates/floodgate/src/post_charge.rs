//! Costs known only after the response (SPEC §9): tokens of an LLM completion, rows of an
//! export.
//!
//! A request is checked with its up-front cost (1 unless a cost function says otherwise). When
//! the response head arrives, the cost it reports minus the up-front cost is charged to the same
//! limits as a *post-charge*: it never denies the finished request, and may leave the client in
//! debt, which the next requests wait out (their `Retry-After` includes it). A reported cost
//! below the up-front one is not refunded; one post-charge is capped at sixteen times the
//! limit's capacity.
//!
//! The cost comes from a [`ResponseCost`] set with
//! [`RateLimitLayerBuilder::charge_from_response`](crate::RateLimitLayerBuilder::charge_from_response)
//! (usually a [`CostHeader`]), or from a [`ReportedCost`] the inner service puts in the
//! response's extensions (a proxy that knows its routes does so).

use http::{HeaderMap, HeaderName};

use crate::store::{Check, Store};
use crate::telemetry;

/// What a response says its request cost in total.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportedCost {
    /// The request's whole cost, up-front part included.
    Total(u64),
    /// The response reports no cost: nothing more is charged, and it is counted.
    Missing,
    /// The response reports something that is not a cost: nothing more is charged, and it is
    /// counted apart from missing values.
    Malformed,
}

impl ReportedCost {
    /// Reads a header holding a non-negative integer (surrounding spaces allowed).
    pub fn from_header(headers: &HeaderMap, name: &HeaderName) -> ReportedCost {
        let Some(value) = headers.get(name) else {
            return ReportedCost::Missing;
        };
        value
            .to_str()
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .map_or(ReportedCost::Malformed, ReportedCost::Total)
    }
}

/// Reads a request's real cost from its response's headers; it may remove what it read.
/// Closures `Fn(&mut HeaderMap) -> ReportedCost` implement it.
pub trait ResponseCost: Send + Sync + 'static {
    /// The cost `headers` report.
    fn reported_cost(&self, headers: &mut HeaderMap) -> ReportedCost;
}

impl<F> ResponseCost for F
where
    F: Fn(&mut HeaderMap) -> ReportedCost + Send + Sync + 'static,
{
    fn reported_cost(&self, headers: &mut HeaderMap) -> ReportedCost {
        self(headers)
    }
}

/// The cost in one response header (`x-tokens-used: 40`), removed from what the client
/// receives unless made [`visible`](CostHeader::visible).
///
/// ```
/// use std::time::Duration;
/// use floodgate::post_charge::CostHeader;
/// use floodgate::{Limit, RateLimitLayer};
///
/// let layer = RateLimitLayer::builder()
///     .limit(Limit::token_bucket("tokens", 10_000, Duration::from_secs(60))?)
///     .charge_from_response(CostHeader::new(http::HeaderName::from_static("x-tokens-used")))
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct CostHeader {
    name: HeaderName,
    visible: bool,
}

impl CostHeader {
    /// Reads `name`, and removes it from the response.
    pub fn new(name: HeaderName) -> CostHeader {
        CostHeader {
            name,
            visible: false,
        }
    }

    /// Whether the client still sees the header (default false: it is the upstream's
    /// accounting, not the client's business).
    pub fn visible(mut self, visible: bool) -> CostHeader {
        self.visible = visible;
        self
    }
}

impl ResponseCost for CostHeader {
    fn reported_cost(&self, headers: &mut HeaderMap) -> ReportedCost {
        let reported = ReportedCost::from_header(headers, &self.name);
        if !self.visible {
            headers.remove(&self.name);
        }
        reported
    }
}

/// The most one response may post-charge a limit: sixteen times its capacity, sixteen full
/// refills of debt. A reported value is the upstream's word, and a hostile or broken one
/// (`x-tokens-used: 18446744073709551615`) must not overflow a counter or leave a debt measured
/// in centuries; sixteen capacities keep every time and count far below 2^53, where the Lua
/// scripts' numbers stay exact.
fn max_post_charge(limit: &crate::Limit) -> u64 {
    limit.capacity().saturating_mul(16)
}

/// Charges what `reported` adds to the up-front cost of `checks`, which admitted the request.
/// Limits with a fixed cost of their own (`cost:` on the limit) and `concurrency` limits are
/// not charged. Never fails the request: a store error is logged and counted.
pub(crate) async fn charge(store: &dyn Store, checks: &[Check], reported: ReportedCost) {
    let total = match reported {
        ReportedCost::Total(total) => total,
        ReportedCost::Missing => return telemetry::record_post_charge_skipped("missing"),
        ReportedCost::Malformed => return telemetry::record_post_charge_skipped("malformed"),
    };
    let extra: Vec<Check> = checks
        .iter()
        .filter(|check| {
            check.limit.cost_override().is_none()
                && check.limit.algorithm() != crate::Algorithm::Concurrency
        })
        .filter_map(|check| {
            let units = total.checked_sub(check.cost).filter(|&units| units > 0)?;
            Some(Check {
                cost: units.min(max_post_charge(&check.limit)),
                ..check.clone()
            })
        })
        .collect();
    let Some(units) = extra.iter().map(|check| check.cost).max() else {
        return;
    };
    match store.charge(&extra, None).await {
        Ok(()) => telemetry::record_post_charge_units(units),
        Err(error) => {
            tracing::warn!(%error, units, "post-charge failed; the units are not counted");
            telemetry::record_post_charge_skipped("store_error");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_are_read_strictly() {
        let name = HeaderName::from_static("x-tokens-used");
        let read = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(name.clone(), http::HeaderValue::from_static(value));
            ReportedCost::from_header(&headers, &name)
        };
        assert_eq!(read("40"), ReportedCost::Total(40));
        assert_eq!(read(" 7 "), ReportedCost::Total(7));
        assert_eq!(read("-1"), ReportedCost::Malformed);
        assert_eq!(read("4.5"), ReportedCost::Malformed);
        assert_eq!(read("lots"), ReportedCost::Malformed);
        assert_eq!(read("99999999999999999999999"), ReportedCost::Malformed);
        assert_eq!(
            ReportedCost::from_header(&HeaderMap::new(), &name),
            ReportedCost::Missing
        );
    }

    #[test]
    fn the_header_is_removed_unless_visible() {
        let name = HeaderName::from_static("x-tokens-used");
        let mut headers = HeaderMap::new();
        headers.insert(name.clone(), http::HeaderValue::from_static("3"));
        let hidden = CostHeader::new(name.clone());
        assert_eq!(
            hidden.reported_cost(&mut headers.clone()),
            ReportedCost::Total(3)
        );
        let mut seen = headers.clone();
        hidden.reported_cost(&mut seen);
        assert!(!seen.contains_key(&name));
        let mut kept = headers.clone();
        CostHeader::new(name.clone())
            .visible(true)
            .reported_cost(&mut kept);
        assert!(kept.contains_key(&name));
    }
}
