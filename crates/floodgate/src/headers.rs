//! Rate limit response headers: legacy `X-RateLimit-*` and the IETF `RateLimit` /
//! `RateLimit-Policy` fields (draft-ietf-httpapi-ratelimit-headers-10, Structured Fields).

use std::cell::RefCell;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use http::HeaderMap;
use http::header::{HeaderName, HeaderValue, RETRY_AFTER};

use crate::Limit;
use crate::decision::Decision;
use crate::derived::DerivedCache;

/// `X-RateLimit-Limit`.
pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`.
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset` (Unix epoch seconds).
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// `RateLimit` (IETF draft).
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `RateLimit-Policy` (IETF draft).
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// Which rate limit headers responses carry (`response.headers`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HeaderStyle {
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    Legacy,
    /// `RateLimit-Policy` and `RateLimit`.
    Ietf,
    /// Both sets (the default).
    #[default]
    Both,
    /// No rate limit headers (429s still carry `Retry-After`).
    None,
}

impl HeaderStyle {
    fn legacy(self) -> bool {
        matches!(self, HeaderStyle::Legacy | HeaderStyle::Both)
    }

    fn ietf(self) -> bool {
        matches!(self, HeaderStyle::Ietf | HeaderStyle::Both)
    }

    /// How many headers a response gets in this style.
    fn count(self) -> usize {
        usize::from(self.legacy()) * 3 + usize::from(self.ietf()) * 2
    }
}

/// An unknown header style name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown header style `{0}`; expected legacy, ietf, both or none")]
pub struct UnknownHeaderStyle(pub String);

impl FromStr for HeaderStyle {
    type Err = UnknownHeaderStyle;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "legacy" => Ok(HeaderStyle::Legacy),
            "ietf" => Ok(HeaderStyle::Ietf),
            "both" => Ok(HeaderStyle::Both),
            "none" => Ok(HeaderStyle::None),
            other => Err(UnknownHeaderStyle(other.to_owned())),
        }
    }
}

/// Whole seconds, rounded up: a client told to wait must never come back early.
pub(crate) fn ceil_secs(duration: Duration) -> u64 {
    let whole = duration.as_secs();
    if duration.subsec_nanos() > 0 {
        whole.saturating_add(1)
    } else {
        whole
    }
}

/// The most that jitter ever adds to `Retry-After`, whatever the wait (SPEC §2): a client is
/// never told to come back more than this after the instant it would be admitted again. A
/// share of the wait alone would send a monthly quota's clients back days after its end.
pub const MAX_RETRY_AFTER_JITTER: Duration = Duration::from_secs(60);

/// The `Retry-After` seconds for a true wait of `wait`: at least 1, never below the wait
/// rounded up, plus a uniform extra (`unit` is uniform in [0, 1)) of up to
/// `min(jitter × wait, MAX_RETRY_AFTER_JITTER)`, so that denied clients do not return in one
/// herd, and never more than a minute after the reset.
pub fn retry_after_secs(wait: Duration, jitter: f64, unit: f64) -> u64 {
    // `Duration::mul_f64` panics on NaN and overflow: the share is computed in `f64` and
    // anything that is not a finite, positive figure adds nothing.
    let positive = |figure: f64| if figure > 0.0 { figure } else { 0.0 };
    let bound = Duration::try_from_secs_f64(wait.as_secs_f64() * positive(jitter))
        .unwrap_or(MAX_RETRY_AFTER_JITTER)
        .min(MAX_RETRY_AFTER_JITTER);
    let extra = bound.mul_f64(positive(unit).min(1.0));
    ceil_secs(wait.saturating_add(extra)).max(1)
}

/// The rate limit headers of one decision, computed before the decision moves into the
/// request's extensions and added to the response once the service has answered.
///
/// It keeps the binding limit's figures, not the header values: they are written when the
/// headers are set, straight into the response's map.
#[derive(Debug, Default)]
pub struct RateLimitHeaders {
    /// `None` when no limit applied, or the style sets no header.
    binding: Option<BindingFigures>,
    /// The binding limit's remaining share (0 to 1), to rank against a nested layer's.
    remaining_share: f64,
}

/// What the headers of a decision's binding limit say.
#[derive(Debug)]
struct BindingFigures {
    style: HeaderStyle,
    /// `X-RateLimit-Limit`.
    limit: HeaderValue,
    /// `RateLimit-Policy`: every limit that applied.
    policy: HeaderValue,
    name: Arc<str>,
    remaining: u64,
    /// `X-RateLimit-Reset`: Unix seconds.
    reset_at_secs: u64,
    /// `RateLimit`'s `t`: seconds from now.
    reset_after_secs: u64,
}

impl BindingFigures {
    /// Hands each header, name and value, to `set`, in the order of the style.
    fn each(self, mut set: impl FnMut(&'static HeaderName, HeaderValue)) {
        // The computed values are written into one buffer and shared out of it: one
        // allocation for all of them, not one each.
        let mut text = BytesMut::with_capacity(64 + self.name.len());
        let mut digits = itoa::Buffer::new();
        if self.style.legacy() {
            set(&X_RATELIMIT_LIMIT, self.limit);
            text.extend_from_slice(digits.format(self.remaining).as_bytes());
            if let Some(value) = value_of(&mut text) {
                set(&X_RATELIMIT_REMAINING, value);
            }
            text.extend_from_slice(digits.format(self.reset_at_secs).as_bytes());
            if let Some(value) = value_of(&mut text) {
                set(&X_RATELIMIT_RESET, value);
            }
        }
        if self.style.ietf() {
            set(&RATELIMIT_POLICY, self.policy);
            // "<name>";r=<remaining>;t=<seconds>
            text.extend_from_slice(b"\"");
            text.extend_from_slice(self.name.as_bytes());
            text.extend_from_slice(b"\";r=");
            text.extend_from_slice(digits.format(self.remaining).as_bytes());
            text.extend_from_slice(b";t=");
            text.extend_from_slice(digits.format(self.reset_after_secs).as_bytes());
            if let Some(value) = value_of(&mut text) {
                set(&RATELIMIT, value);
            }
        }
    }
}

/// A response extension saying whose rate limit headers a response carries, so that nested
/// layers (a global limit around a per-route one) agree on which limit binds (SPEC §2: the
/// headers describe the binding limit): a denial binds; otherwise the smaller remaining share.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BindingHeaders {
    /// The remaining share of the limit whose headers are set (0 to 1).
    pub remaining_share: f64,
    /// Whether they are a denial's.
    pub denied: bool,
}

impl RateLimitHeaders {
    /// The headers for `decision` in `style` (none when no limit applied).
    pub fn new(decision: &Decision, style: HeaderStyle) -> Self {
        let Some(binding) = decision.binding_limit() else {
            return RateLimitHeaders {
                binding: None,
                remaining_share: 1.0,
            };
        };
        let remaining_share = binding.remaining as f64 / binding.capacity.max(1) as f64;
        let figures = (style != HeaderStyle::None).then(|| BindingFigures {
            style,
            limit: with_limit_values(binding.definition(), |values| values.limit.clone()),
            policy: policy(decision),
            name: binding.name.clone(),
            remaining: binding.remaining,
            reset_at_secs: decision
                .decided_at()
                .saturating_add(binding.reset_after)
                .as_secs_ceil(),
            reset_after_secs: ceil_secs(binding.reset_after),
        });
        RateLimitHeaders {
            binding: figures,
            remaining_share,
        }
    }

    /// Sets the headers on `headers`, replacing any of the same name.
    pub fn apply(self, headers: &mut HeaderMap) {
        let Some(figures) = self.binding else {
            return;
        };
        headers.reserve(figures.style.count());
        figures.each(|name, value| {
            headers.insert(name, value);
        });
    }

    /// Sets the headers on a response an inner service produced. When a nested rate limit
    /// layer already set its own ([`BindingHeaders`]), the binding one's stay: the inner
    /// layer's if it denied or has the smaller remaining share, else these; `RateLimit-Policy`
    /// lists the limits of both.
    pub fn apply_to_response<B>(self, response: &mut http::Response<B>) {
        self.apply_within(response, true);
    }

    /// [`RateLimitHeaders::apply_to_response`], leaving out the [`BindingHeaders`] mark when
    /// no rate limit layer is around this one (`outer_layer: false`): nobody would read it.
    pub(crate) fn apply_within<B>(self, response: &mut http::Response<B>, outer_layer: bool) {
        let ours = BindingHeaders {
            remaining_share: self.remaining_share,
            denied: false,
        };
        let Some(inner) = response.extensions().get::<BindingHeaders>().copied() else {
            if outer_layer && self.binding.is_some() {
                response.extensions_mut().insert(ours);
            }
            self.apply(response.headers_mut());
            return;
        };
        let inner_binds = inner.denied || inner.remaining_share <= ours.remaining_share;
        let headers = response.headers_mut();
        if let Some(figures) = self.binding {
            figures.each(|name, value| {
                if name == RATELIMIT_POLICY {
                    let merged = match headers.get(name) {
                        Some(existing) => {
                            let mut joined = existing.as_bytes().to_vec();
                            joined.extend_from_slice(b", ");
                            joined.extend_from_slice(value.as_bytes());
                            HeaderValue::from_bytes(&joined).unwrap_or(value)
                        }
                        None => value,
                    };
                    headers.insert(name, merged);
                } else if !inner_binds {
                    headers.insert(name, value);
                }
            });
        }
        if !inner_binds {
            response.extensions_mut().insert(ours);
        }
    }
}

/// What was written into `text` since the last value, split off as a header value (`None`,
/// and the header left out, if it is not a valid one).
fn value_of(text: &mut BytesMut) -> Option<HeaderValue> {
    HeaderValue::from_maybe_shared(text.split().freeze()).ok()
}

/// `RateLimit-Policy`: every applied limit. A single limit's item is shared, not rebuilt.
fn policy(decision: &Decision) -> HeaderValue {
    match decision.limits() {
        [only] => with_limit_values(only.definition(), |values| values.policy_item.clone()),
        limits => {
            let mut joined = Vec::with_capacity(limits.len() * 32);
            for (index, limit) in limits.iter().enumerate() {
                if index > 0 {
                    joined.extend_from_slice(b", ");
                }
                with_limit_values(limit.definition(), |values| {
                    joined.extend_from_slice(values.policy_item.as_bytes());
                });
            }
            // Joining valid header values with ", " yields a valid header value.
            HeaderValue::from_bytes(&joined).unwrap_or_else(|_| HeaderValue::from_static(""))
        }
    }
}

/// The header values of one limit, built once per limit (and thread), so that responses do
/// not format them per request.
struct LimitValues {
    /// `limit` as a header value, for `X-RateLimit-Limit`.
    limit: HeaderValue,
    /// The limit's item of `RateLimit-Policy`: `"name";q=<limit>;w=<seconds>`.
    policy_item: HeaderValue,
}

impl LimitValues {
    fn of(limit: &Limit) -> LimitValues {
        LimitValues {
            limit: HeaderValue::from(limit.limit()),
            policy_item: policy_item(limit),
        }
    }
}

/// A limit's item of the IETF `RateLimit-Policy` field: `"name";q=<limit>;w=<seconds>`.
pub fn policy_item(limit: &Limit) -> HeaderValue {
    let window_secs = limit.window_micros().div_ceil(1_000_000).max(1);
    // A limit's name is checked when it is built: every character is valid in a header
    // value and needs no escaping in a structured string.
    HeaderValue::try_from(format!(
        "\"{}\";q={};w={window_secs}",
        limit.name(),
        limit.limit()
    ))
    .unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Runs `read` with `limit`'s header values, from this thread's cache.
fn with_limit_values<T>(limit: &Arc<Limit>, read: impl FnOnce(&LimitValues) -> T) -> T {
    thread_local! {
        /// 512 slots: enough for every limit a deployment decides on, each built again only
        /// when a colliding one evicted it.
        static VALUES: RefCell<DerivedCache<Arc<Limit>, LimitValues, 512>> =
            RefCell::new(DerivedCache::new());
    }
    VALUES.with_borrow_mut(|cache| read(cache.get_or_derive(limit, || LimitValues::of(limit))))
}

/// Adds the rate limit headers for `decision` in `style` to `headers`.
pub fn write_rate_limit_headers(headers: &mut HeaderMap, decision: &Decision, style: HeaderStyle) {
    RateLimitHeaders::new(decision, style).apply(headers);
}

/// Sets `Retry-After: <seconds>`.
pub(crate) fn write_retry_after(headers: &mut HeaderMap, seconds: u64) {
    headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        assert_eq!(retry_after_secs(Duration::from_millis(1), 0.0, 0.0), 1);
        assert_eq!(retry_after_secs(Duration::ZERO, 0.2, 0.9), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001), 0.0, 0.0), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(42), 0.0, 0.99), 42);
    }

    #[test]
    fn jitter_stays_within_its_bound() {
        let wait = Duration::from_secs(10);
        for step in 0..100 {
            let unit = f64::from(step) / 100.0;
            let secs = retry_after_secs(wait, 0.2, unit);
            assert!((10..=12).contains(&secs), "{secs}");
        }
        assert_eq!(retry_after_secs(wait, 0.2, 0.999_999), 12);
    }

    #[test]
    fn jitter_is_bounded_by_a_minute_whatever_the_wait() {
        let month = Duration::from_secs(30 * 86_400);
        for step in 0..=100 {
            let unit = f64::from(step) / 100.0;
            let secs = retry_after_secs(month, 10.0, unit);
            assert!(
                (month.as_secs()..=month.as_secs() + 60).contains(&secs),
                "{secs}"
            );
        }
        assert_eq!(
            retry_after_secs(month, 0.2, 0.999_999),
            month.as_secs() + 60
        );
        // Values no caller should pass change nothing for the worse.
        assert_eq!(retry_after_secs(month, f64::NAN, 0.5), month.as_secs());
        assert_eq!(retry_after_secs(month, 0.2, 7.0), month.as_secs() + 60);
        assert_eq!(retry_after_secs(Duration::MAX, 0.2, 0.5), u64::MAX);
    }

    #[test]
    fn header_styles_parse() {
        assert_eq!("ietf".parse(), Ok(HeaderStyle::Ietf));
        assert!("IETF".parse::<HeaderStyle>().is_err());
    }
}
