//! Costs known only after the response (SPEC §9): tokens of an LLM completion, rows of an
//! export.
//!
//! A request is checked with its up-front cost (1 unless a cost function says otherwise: an
//! *estimate*, such as a completion's `max_tokens`). When the response reports its real cost,
//! the request is *settled* against the same limits:
//! - more than the estimate: the difference is charged as a *post-charge*, which never denies
//!   the finished request and may leave the client in debt, which the next requests wait out
//!   (their `Retry-After` includes it); one post-charge is capped at sixteen times the limit's
//!   capacity;
//! - less: the difference is given back ([`Store::refund`]): never more than was charged, never
//!   above the limit's capacity, and a window's units only to the window they were counted in;
//! - a response that reports nothing (or nothing readable) settles nothing: the up-front
//!   charge stands (an [`EstimateHeader`]'s reservation, its `max`), and it is counted.
//!
//! The cost comes from a [`ResponseCost`] set with
//! [`RateLimitLayerBuilder::charge_from_response`](crate::RateLimitLayerBuilder::charge_from_response)
//! (usually a [`CostHeader`]), or from a [`ReportedCost`] the inner service puts in the
//! response's extensions (a proxy that knows its routes does so).

use std::sync::Arc;

use http::{HeaderMap, HeaderName};

use crate::store::{Check, Store};
use crate::telemetry;
use crate::time::Timestamp;

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

/// An estimated cost, read from a request header (a completion's `x-max-tokens: 512`), with
/// `max`, the most one request may cost (its `estimate_max`).
///
/// A request is admitted only with room for `max`, which it *reserves* (is charged up front)
/// whatever estimate it sends, and is then settled against the response's reported cost with
/// [`charge_from_response`](crate::RateLimitLayerBuilder::charge_from_response): given back
/// what it used less, charged what it used more (SPEC §9). A client's estimate is its own word,
/// and a low one must not buy room: charged up front, ten requests estimated at 1 that each
/// cost 100 would be admitted with 10 units left. Reserved, a window serves one client at most
/// its limit while every request costs at most `max`, and a request that is never settled (its
/// client left before the trailers, its upstream reported nothing) stays charged `max`:
/// leaving early never lowers the charge. An honest client's reservation is given back down to
/// what it used. The estimate itself ([`EstimateHeader::estimate`]) is the client's statement,
/// for whoever wants to read it; `default` is what it is without one.
///
/// ```
/// use std::time::Duration;
/// use floodgate::post_charge::{CostHeader, EstimateHeader};
/// use floodgate::{Limit, RateLimitLayer};
///
/// let layer = RateLimitLayer::builder()
///     .limit(Limit::token_bucket("tokens", 100_000, Duration::from_secs(60))?)
///     .cost(EstimateHeader::new(http::HeaderName::from_static("x-max-tokens"), 4_096).default(256))
///     .charge_from_response(CostHeader::new(http::HeaderName::from_static("x-tokens-used")))
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct EstimateHeader {
    name: HeaderName,
    max: u64,
    default: u64,
}

impl EstimateHeader {
    /// Reads `name`, reserving `max` (at least 1) up front; a request without the header is
    /// estimated at 1 unless [`default`](EstimateHeader::default) says otherwise.
    pub fn new(name: HeaderName, max: u64) -> EstimateHeader {
        EstimateHeader {
            name,
            max: max.max(1),
            default: 1,
        }
    }

    /// What a request without a readable estimate is estimated at (bounded by `max`).
    pub fn default(mut self, default: u64) -> EstimateHeader {
        self.default = default;
        self
    }

    /// The estimate `headers` carry, bounded; `default` without one.
    pub fn estimate(&self, headers: &HeaderMap) -> u64 {
        let estimate = match ReportedCost::from_header(headers, &self.name) {
            ReportedCost::Total(value) => value,
            ReportedCost::Missing | ReportedCost::Malformed => self.default,
        };
        estimate.clamp(1, self.max)
    }

    /// What every request reserves up front, whatever its estimate: `max`.
    pub fn reserved(&self) -> u64 {
        self.max
    }
}

/// The up-front charge is the reservation, never the client's estimate.
impl crate::planning::RequestCost for EstimateHeader {
    fn cost(&self, _request: &crate::RequestInfo<'_>) -> u64 {
        self.reserved()
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

/// Put in a response's extensions by an inner service whose response reports its cost only
/// at the end of its stream: the layer settles from the body's trailers, read by this
/// reader (usually the same [`CostHeader`] the head was read with). A stream that ends without
/// the cost in its trailers, or that the client leaves before its end, settles nothing: the
/// up-front charge stands (an [`EstimateHeader`]'s reservation: leaving early never pays less).
#[derive(Clone)]
pub struct CostInTrailers(pub Arc<dyn ResponseCost>);

impl CostInTrailers {
    /// Settles from the trailers `reader` reads.
    pub fn new(reader: impl ResponseCost) -> CostInTrailers {
        CostInTrailers(Arc::new(reader))
    }
}

impl std::fmt::Debug for CostInTrailers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CostInTrailers").finish_non_exhaustive()
    }
}

/// A settlement waiting for a streamed response's trailers: settled when they arrive,
/// counted as `missing` if the stream ends (or is dropped) without them.
pub(crate) struct PendingSettlement {
    store: Arc<dyn Store>,
    charged: Charged,
    reader: Arc<dyn ResponseCost>,
    settled: bool,
}

impl PendingSettlement {
    pub(crate) fn new(
        store: Arc<dyn Store>,
        charged: Charged,
        reader: Arc<dyn ResponseCost>,
    ) -> PendingSettlement {
        PendingSettlement {
            store,
            charged,
            reader,
            settled: false,
        }
    }

    /// Settles from `trailers` (and removes the cost from them unless the reader keeps it
    /// visible), in the background when the store must wait.
    pub(crate) fn settle_from(mut self, trailers: &mut HeaderMap) {
        self.settled = true;
        let reported = self.reader.reported_cost(trailers);
        let store = self.store.clone();
        let charged = self.charged.clone();
        crate::detached::run_detached(async move { charged.settle(&*store, reported).await });
    }
}

impl Drop for PendingSettlement {
    fn drop(&mut self) {
        if !self.settled {
            telemetry::record_post_charge_skipped("missing");
        }
    }
}

impl std::fmt::Debug for PendingSettlement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingSettlement")
            .field("charged", &self.charged)
            .finish_non_exhaustive()
    }
}

/// What an admitted request is settled against: the checks the store admitted it with, at
/// their up-front cost, and the decision's time.
#[derive(Clone, Debug)]
pub(crate) struct Charged {
    /// The checks, each with the cost it charged.
    pub(crate) checks: Vec<Check>,
    /// When they were charged.
    pub(crate) at: Timestamp,
}

impl Charged {
    /// Settles against the total cost the response `reported` ([`settle`]).
    pub(crate) async fn settle(&self, store: &dyn Store, reported: ReportedCost) {
        settle(store, &self.checks, self.at, reported).await;
    }
}

/// Settles `checks`, which admitted the request at `charged_at` at their up-front cost,
/// against the total cost the response `reported`: the difference is charged when it is
/// more, refunded when it is less. Limits with a fixed cost of their own (`cost:` on the
/// limit) and `concurrency` limits are left alone. Never fails the request: a store error is
/// logged and counted.
async fn settle(
    store: &dyn Store,
    checks: &[Check],
    charged_at: Timestamp,
    reported: ReportedCost,
) {
    let total = match reported {
        ReportedCost::Total(total) => total,
        ReportedCost::Missing => return telemetry::record_post_charge_skipped("missing"),
        ReportedCost::Malformed => return telemetry::record_post_charge_skipped("malformed"),
    };
    let mut extra = Vec::new();
    let mut refund = Vec::new();
    for check in checks.iter().filter(|check| {
        check.limit.cost_override().is_none()
            && check.limit.algorithm() != crate::Algorithm::Concurrency
    }) {
        if total > check.cost {
            extra.push(Check {
                cost: (total - check.cost).min(max_post_charge(&check.limit)),
                ..check.clone()
            });
        } else if total < check.cost {
            // Never more than the check charged: the difference to a total of zero or more.
            refund.push(Check {
                cost: check.cost - total,
                ..check.clone()
            });
        }
    }
    if let Some(units) = extra.iter().map(|check| check.cost).max() {
        match store.charge(&extra, None).await {
            Ok(()) => telemetry::record_post_charge_units(units),
            Err(error) => {
                tracing::warn!(%error, units, "post-charge failed; the units are not counted");
                telemetry::record_post_charge_skipped("store_error");
            }
        }
    }
    if let Some(units) = refund.iter().map(|check| check.cost).max() {
        match store.refund(&refund, charged_at, None).await {
            Ok(()) => telemetry::record_refunded_units(units),
            Err(error) => {
                tracing::warn!(%error, units, "refund failed; the estimate stays charged");
                telemetry::record_post_charge_skipped("store_error");
            }
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
