//! Limits: what a client may do per window, validated when built so bad configuration cannot
//! reach the algorithms.

use crate::calendar::CalendarPeriod;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use crate::key::KeyChars;
use crate::time::duration_to_micros;

/// The longest window a limit may have. Bounding it keeps every intermediate value of the
/// algorithms below 2^53, where the Lua scripts' doubles are still exact integers.
pub const MAX_WINDOW: Duration = Duration::from_secs(366 * 24 * 3600);

/// The largest `limit` or `burst`.
pub const MAX_QUANTITY: u64 = 1 << 40;

/// The lease lifetime of a `concurrency` limit when no window is given.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

/// The longest limit name; names travel in storage keys, metric labels and headers.
pub const MAX_NAME_LEN: usize = 64;

/// Whether `name` may name a limit or a rule: 1 to 64 characters among `A-Z a-z 0-9 - _ .`,
/// so that it is safe in storage keys, metric labels and structured header strings.
pub(crate) fn is_valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_LEN && name.chars().all(|c| KeyChars::Name.keeps(c))
}

/// The rate limiting algorithms; see SPEC §1 for their exact semantics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Capacity `burst`, refilled continuously at `limit / window`.
    TokenBucket,
    /// Generic cell rate algorithm: the token bucket's admission with one timestamp of state.
    Gcra,
    /// At most `limit` per window, windows aligned to multiples of `window` since the epoch.
    FixedWindow,
    /// At most `limit` in any trailing `window`; admitted requests are logged.
    SlidingWindowLog,
    /// The previous window's count weighted by its overlap, plus the current count.
    SlidingWindowCounter,
    /// Shaping: requests leave at `limit / window`; a request is delayed by its wait, or
    /// rejected when that wait exceeds `burst` emission intervals.
    LeakyBucket,
    /// At most `limit` requests in flight; leases expire after `window`.
    Concurrency,
}

impl Algorithm {
    /// Every algorithm, in the order of SPEC §1.
    pub const ALL: [Algorithm; 7] = [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowLog,
        Algorithm::SlidingWindowCounter,
        Algorithm::LeakyBucket,
        Algorithm::Concurrency,
    ];

    /// The configuration name (`token_bucket`, `gcra`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindowLog => "sliding_window_log",
            Algorithm::SlidingWindowCounter => "sliding_window_counter",
            Algorithm::LeakyBucket => "leaky_bucket",
            Algorithm::Concurrency => "concurrency",
        }
    }

    /// Whether `burst` means something for this algorithm.
    pub const fn uses_burst(self) -> bool {
        matches!(
            self,
            Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::LeakyBucket
        )
    }

    /// Whether limits of this algorithm can be decided from batched counters (batched mode):
    /// their state is a few counters that a node can take from locally and settle with the
    /// shared store later. The sliding log, the leaky bucket's queue and concurrency leases
    /// need every request at the shared store, so they cannot.
    pub const fn is_batchable(self) -> bool {
        matches!(
            self,
            Algorithm::TokenBucket
                | Algorithm::Gcra
                | Algorithm::FixedWindow
                | Algorithm::SlidingWindowCounter
        )
    }

    /// Whether the algorithm counts in windows aligned to the epoch (`fixed_window`,
    /// `sliding_window_counter`): units belong to the window they were counted in.
    pub const fn counts_in_windows(self) -> bool {
        matches!(
            self,
            Algorithm::FixedWindow | Algorithm::SlidingWindowCounter
        )
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Algorithm {
    type Err = LimitError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Algorithm::ALL
            .into_iter()
            .find(|algorithm| algorithm.as_str() == name)
            .ok_or_else(|| LimitError::UnknownAlgorithm(name.to_owned()))
    }
}

/// The field of a limit a [`LimitError`] is about, named as configurations name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LimitField {
    /// `name`.
    Name,
    /// `algorithm`.
    Algorithm,
    /// `limit`.
    Limit,
    /// `window`.
    Window,
    /// `burst`.
    Burst,
    /// `cost`.
    Cost,
    /// `period` (a calendar period).
    Period,
}

impl LimitField {
    /// The field's name: `name`, `algorithm`, `limit`, `window`, `burst` or `cost`.
    pub const fn as_str(self) -> &'static str {
        match self {
            LimitField::Name => "name",
            LimitField::Algorithm => "algorithm",
            LimitField::Limit => "limit",
            LimitField::Window => "window",
            LimitField::Burst => "burst",
            LimitField::Cost => "cost",
            LimitField::Period => "period",
        }
    }
}

impl fmt::Display for LimitField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a limit could not be built: [`field`](LimitError::field) says which setting,
/// [`problem`](LimitError::problem) what is wrong with it; the message is `field: problem`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitError {
    /// The name is empty, too long or has characters other than `A-Z a-z 0-9 - _ .`.
    InvalidName(String),
    /// No algorithm of that name.
    UnknownAlgorithm(String),
    /// `limit` is zero.
    ZeroLimit,
    /// `limit` was never set on the builder.
    MissingLimit,
    /// `limit` is larger than [`MAX_QUANTITY`].
    LimitTooLarge,
    /// `window` was not given (only `concurrency` has a default).
    MissingWindow(Algorithm),
    /// `window` is shorter than a millisecond.
    WindowTooShort,
    /// `window` is longer than [`MAX_WINDOW`].
    WindowTooLong,
    /// `burst` is zero.
    ZeroBurst,
    /// `burst` is larger than [`MAX_QUANTITY`], or so large that refilling it takes over a year.
    BurstTooLarge,
    /// `burst` was given for an algorithm that has none.
    BurstNotSupported(Algorithm),
    /// `cost` is zero.
    ZeroCost,
    /// A calendar period was given for an algorithm other than `fixed_window`.
    PeriodNotSupported(Algorithm),
    /// Both a calendar period and a window were given.
    WindowWithPeriod,
}

impl LimitError {
    /// The field the error is about.
    pub fn field(&self) -> LimitField {
        match self {
            LimitError::InvalidName(_) => LimitField::Name,
            LimitError::UnknownAlgorithm(_) => LimitField::Algorithm,
            LimitError::ZeroLimit | LimitError::MissingLimit | LimitError::LimitTooLarge => {
                LimitField::Limit
            }
            LimitError::MissingWindow(_)
            | LimitError::WindowTooShort
            | LimitError::WindowTooLong => LimitField::Window,
            LimitError::ZeroBurst
            | LimitError::BurstTooLarge
            | LimitError::BurstNotSupported(_) => LimitField::Burst,
            LimitError::ZeroCost => LimitField::Cost,
            LimitError::PeriodNotSupported(_) => LimitField::Period,
            LimitError::WindowWithPeriod => LimitField::Window,
        }
    }

    /// What is wrong with the field, without its name (a configuration file prefixes its own
    /// path: `plans.free.limits[1].window: must be greater than 0 (at least 1ms)`).
    pub fn problem(&self) -> String {
        match self {
            LimitError::InvalidName(name) => format!(
                "`{name}` is not a valid limit name (1 to 64 characters among A-Z a-z 0-9 - _ .)"
            ),
            LimitError::UnknownAlgorithm(name) => format!(
                "unknown algorithm `{name}`; expected one of token_bucket, gcra, fixed_window, \
                 sliding_window_log, sliding_window_counter, leaky_bucket, concurrency"
            ),
            LimitError::ZeroLimit => "must be greater than 0".to_owned(),
            LimitError::MissingLimit => "is required (LimitBuilder::limit)".to_owned(),
            LimitError::LimitTooLarge => format!("must be at most {MAX_QUANTITY}"),
            LimitError::MissingWindow(algorithm) => format!("is required for {algorithm}"),
            LimitError::WindowTooShort => "must be greater than 0 (at least 1ms)".to_owned(),
            LimitError::WindowTooLong => "must be at most 366 days".to_owned(),
            LimitError::ZeroBurst => "must be at least 1".to_owned(),
            LimitError::BurstTooLarge => {
                "too large; refilling it at limit/window must take at most 366 days".to_owned()
            }
            LimitError::BurstNotSupported(algorithm) => {
                format!("not used by {algorithm}; remove it")
            }
            LimitError::ZeroCost => "must be at least 1".to_owned(),
            LimitError::PeriodNotSupported(algorithm) => {
                format!("counts fixed_window limits only, not {algorithm}")
            }
            LimitError::WindowWithPeriod => {
                "not used with a calendar period (the period is the window); remove it".to_owned()
            }
        }
    }
}

impl std::fmt::Display for LimitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field(), self.problem())
    }
}

impl std::error::Error for LimitError {}

/// A validated limit: `limit` requests (or cost units) per `window` under one algorithm.
///
/// Built with [`Limit::builder`] or the per-algorithm shortcuts; every value is checked, so a
/// `Limit` that exists can be evaluated without panics or overflow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limit {
    name: Arc<str>,
    algorithm: Algorithm,
    limit: u64,
    window_micros: u64,
    burst: u64,
    cost: Option<u64>,
    /// Microseconds per unit at `limit / window`, rounded up so that quantisation can only make
    /// the limiter stricter, never looser.
    emission_micros: u64,
    /// The calendar period whose days, weeks, months or years are the windows, if any
    /// (`fixed_window` only); `window` is then the period's nominal length.
    calendar: Option<CalendarPeriod>,
}

impl Limit {
    /// Starts a limit named `name`.
    pub fn builder(name: impl Into<String>) -> LimitBuilder {
        LimitBuilder {
            name: name.into(),
            algorithm: Ok(Algorithm::TokenBucket),
            limit: None,
            window: None,
            burst: None,
            cost: None,
            calendar: None,
        }
    }

    /// A limit of `limit` per `window` with `algorithm` and no burst or cost override.
    pub fn new(
        name: impl Into<String>,
        algorithm: Algorithm,
        limit: u64,
        window: Duration,
    ) -> Result<Limit, LimitError> {
        Limit::builder(name)
            .algorithm(algorithm)
            .limit(limit)
            .window(window)
            .build()
    }

    /// The limit's name, as used in headers, keys and metrics.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name as a shared string.
    pub fn shared_name(&self) -> &Arc<str> {
        &self.name
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Requests (or cost units) per window; for `concurrency`, requests in flight.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window (for `concurrency`, the lease lifetime).
    pub fn window(&self) -> Duration {
        Duration::from_micros(self.window_micros)
    }

    /// The window in microseconds (a calendar period's nominal length).
    pub fn window_micros(&self) -> u64 {
        self.window_micros
    }

    /// The calendar period whose days, weeks, months or years are this limit's windows.
    pub fn calendar(&self) -> Option<&CalendarPeriod> {
        self.calendar.as_ref()
    }

    /// The window containing `now` (microseconds since the epoch), `(start, end)`: aligned to
    /// multiples of the window since the epoch, or the calendar period.
    pub fn window_bounds(&self, now: u64) -> (u64, u64) {
        match &self.calendar {
            Some(calendar) => calendar.bounds(now),
            None => {
                let start = now - now % self.window_micros.max(1);
                (start, start + self.window_micros)
            }
        }
    }

    /// The burst: bucket capacity for `token_bucket` and `gcra`, queue depth in units for
    /// `leaky_bucket`; equal to `limit` for the others.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// The most units that can ever be admitted at once; a larger cost is never admitted.
    pub fn capacity(&self) -> u64 {
        self.burst
    }

    /// The fixed cost this limit charges per request, overriding the request's cost.
    pub fn cost_override(&self) -> Option<u64> {
        self.cost
    }

    /// What a request of `request_cost` costs against this limit.
    pub fn cost_for(&self, request_cost: u64) -> u64 {
        self.cost.unwrap_or(request_cost)
    }

    /// This limit with `limit` and `burst` multiplied by `share` (rounded down, at least 1):
    /// what one node enforces on its own when the shared store is down and the failure
    /// policy is `local`. `share` outside (0, 1] is clamped into it.
    pub fn scaled(&self, share: f64) -> Limit {
        let share = if share.is_finite() {
            share.clamp(f64::MIN_POSITIVE, 1.0)
        } else {
            1.0
        };
        let scale = |value: u64| ((value as f64 * share).floor() as u64).max(1);
        self.rescaled(scale(self.limit), scale(self.burst))
    }

    /// This limit cut to `units` of its `limit` (at least 1, at most all of it), its burst in
    /// proportion (rounded down, at least 1): a region's share of it (see
    /// `store::region`). Exact in integers, unlike [`Limit::scaled`].
    pub fn with_share(&self, units: u64) -> Limit {
        let units = units.clamp(1, self.limit);
        if units == self.limit {
            return self.clone();
        }
        let burst = (u128::from(self.burst) * u128::from(units) / u128::from(self.limit)) as u64;
        self.rescaled(units, burst.max(1))
    }

    /// This limit with another `limit` and `burst` (no greater than its own), all else kept.
    fn rescaled(&self, limit: u64, burst: u64) -> Limit {
        let mut builder = Limit::builder(self.name())
            .algorithm(self.algorithm)
            .limit(limit);
        builder = match &self.calendar {
            Some(calendar) => builder.calendar(calendar.clone()),
            None => builder.window(self.window()),
        };
        if self.algorithm.uses_burst() {
            builder = builder.burst(burst);
        }
        if let Some(cost) = self.cost {
            builder = builder.cost(cost);
        }
        // Scaling down keeps every bound that the original satisfied.
        builder.build().unwrap_or_else(|_| self.clone())
    }

    /// Microseconds per unit at `limit / window`, rounded up.
    pub fn emission_micros(&self) -> u64 {
        self.emission_micros
    }
}

/// Builds a [`Limit`], validating every field in [`LimitBuilder::build`].
#[derive(Clone, Debug)]
#[must_use]
pub struct LimitBuilder {
    name: String,
    algorithm: Result<Algorithm, LimitError>,
    limit: Option<u64>,
    window: Option<Duration>,
    burst: Option<u64>,
    cost: Option<u64>,
    calendar: Option<CalendarPeriod>,
}

impl LimitBuilder {
    /// The algorithm (default `token_bucket`).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = Ok(algorithm);
        self
    }

    /// The algorithm by configuration name; an unknown name fails in [`build`](Self::build).
    pub fn algorithm_name(mut self, name: &str) -> Self {
        self.algorithm = name.parse();
        self
    }

    /// Requests (or cost units) per window.
    pub fn limit(mut self, limit: u64) -> Self {
        self.limit = Some(limit);
        self
    }

    /// The window.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = Some(window);
        self
    }

    /// The burst (`token_bucket`, `gcra`, `leaky_bucket` only).
    pub fn burst(mut self, burst: u64) -> Self {
        self.burst = Some(burst);
        self
    }

    /// A fixed cost per request for this limit.
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = Some(cost);
        self
    }

    /// Windows on the calendar (`fixed_window` only, with no `window`): the days, weeks,
    /// months or years of `calendar`.
    pub fn calendar(mut self, calendar: CalendarPeriod) -> Self {
        self.calendar = Some(calendar);
        self
    }

    /// Validates and builds the limit.
    pub fn build(self) -> Result<Limit, LimitError> {
        if !is_valid_name(&self.name) {
            return Err(LimitError::InvalidName(self.name));
        }
        let algorithm = self.algorithm?;
        let limit = match self.limit {
            None => return Err(LimitError::MissingLimit),
            Some(0) => return Err(LimitError::ZeroLimit),
            Some(limit) if limit > MAX_QUANTITY => return Err(LimitError::LimitTooLarge),
            Some(limit) => limit,
        };
        if self.calendar.is_some() && algorithm != Algorithm::FixedWindow {
            return Err(LimitError::PeriodNotSupported(algorithm));
        }
        let window = match (self.window, algorithm, &self.calendar) {
            (Some(_), _, Some(_)) => return Err(LimitError::WindowWithPeriod),
            (None, _, Some(calendar)) => calendar.period().nominal(),
            (Some(window), _, None) => window,
            (None, Algorithm::Concurrency, None) => DEFAULT_LEASE_TTL,
            (None, algorithm, None) => return Err(LimitError::MissingWindow(algorithm)),
        };
        if window < Duration::from_millis(1) {
            return Err(LimitError::WindowTooShort);
        }
        if window > MAX_WINDOW {
            return Err(LimitError::WindowTooLong);
        }
        let window_micros = duration_to_micros(window);
        let burst = match self.burst {
            None => limit,
            Some(_) if !algorithm.uses_burst() => {
                return Err(LimitError::BurstNotSupported(algorithm));
            }
            Some(0) => return Err(LimitError::ZeroBurst),
            Some(burst) if burst > MAX_QUANTITY => return Err(LimitError::BurstTooLarge),
            Some(burst) => burst,
        };
        if self.cost == Some(0) {
            return Err(LimitError::ZeroCost);
        }
        let emission_micros = window_micros.div_ceil(limit);
        // The full bucket expressed as time must stay below a year so that timestamps plus
        // it stay exact in Lua's doubles.
        let fill_micros = u128::from(burst) * u128::from(emission_micros);
        if fill_micros > u128::from(duration_to_micros(MAX_WINDOW)) {
            return Err(LimitError::BurstTooLarge);
        }
        Ok(Limit {
            name: self.name.into(),
            algorithm,
            limit,
            window_micros,
            burst,
            cost: self.cost,
            emission_micros,
            calendar: self.calendar,
        })
    }
}

macro_rules! shortcut {
    ($(#[$doc:meta] $fn_name:ident => $algorithm:ident),* $(,)?) => {
        impl Limit {
            $(
                #[$doc]
                pub fn $fn_name(
                    name: impl Into<String>,
                    limit: u64,
                    window: Duration,
                ) -> Result<Limit, LimitError> {
                    Limit::new(name, Algorithm::$algorithm, limit, window)
                }
            )*
        }
    };
}

shortcut! {
    /// A `token_bucket` limit with capacity `limit`.
    token_bucket => TokenBucket,
    /// A `gcra` limit with capacity `limit`.
    gcra => Gcra,
    /// A `fixed_window` limit.
    fixed_window => FixedWindow,
    /// A `sliding_window_log` limit.
    sliding_window_log => SlidingWindowLog,
    /// A `sliding_window_counter` limit.
    sliding_window_counter => SlidingWindowCounter,
    /// A `leaky_bucket` limit with a queue of `limit` units.
    leaky_bucket => LeakyBucket,
    /// A `concurrency` limit of `limit` in flight; `window` is the lease lifetime.
    concurrency => Concurrency,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_each_invalid_field_with_its_name() {
        let second = Duration::from_secs(1);
        let cases: Vec<(LimitBuilder, &str)> = vec![
            (Limit::builder("").limit(1).window(second), "name"),
            (Limit::builder("a:b").limit(1).window(second), "name"),
            (Limit::builder("x").limit(0).window(second), "limit"),
            (Limit::builder("x").window(second), "limit"),
            (
                Limit::builder("x").limit(1).window(Duration::ZERO),
                "window",
            ),
            (Limit::builder("x").limit(1), "window"),
            (
                Limit::builder("x")
                    .limit(1)
                    .window(Duration::from_secs(400 * 86400)),
                "window",
            ),
            (
                Limit::builder("x").limit(1).window(second).burst(0),
                "burst",
            ),
            (
                Limit::builder("x")
                    .algorithm(Algorithm::FixedWindow)
                    .limit(1)
                    .window(second)
                    .burst(3),
                "burst",
            ),
            (
                Limit::builder("x")
                    .limit(1)
                    .window(Duration::from_secs(86400))
                    .burst(1000),
                "burst",
            ),
            (Limit::builder("x").limit(1).window(second).cost(0), "cost"),
            (
                Limit::builder("x")
                    .algorithm_name("leaky")
                    .limit(1)
                    .window(second),
                "algorithm",
            ),
        ];
        for (builder, field) in cases {
            let error = builder.clone().build().expect_err(&format!("{builder:?}"));
            assert_eq!(error.field().as_str(), field, "{error}");
            assert!(error.to_string().starts_with(field), "{error}");
        }
    }

    #[test]
    fn defaults_burst_to_limit_and_concurrency_window_to_30s() {
        let limit = Limit::token_bucket("per-second", 10, Duration::from_secs(1)).unwrap();
        assert_eq!(limit.burst(), 10);
        assert_eq!(limit.emission_micros(), 100_000);
        let leases = Limit::builder("inflight")
            .algorithm(Algorithm::Concurrency)
            .limit(4)
            .build()
            .unwrap();
        assert_eq!(leases.window(), DEFAULT_LEASE_TTL);
    }

    #[test]
    fn emission_interval_rounds_up_so_the_rate_never_exceeds_the_limit() {
        let limit = Limit::gcra("odd", 3, Duration::from_secs(1)).unwrap();
        assert_eq!(limit.emission_micros(), 333_334);
    }

    #[test]
    fn scaling_keeps_at_least_one() {
        let limit = Limit::builder("x")
            .limit(10)
            .window(Duration::from_secs(1))
            .burst(20)
            .build()
            .unwrap();
        let half = limit.scaled(0.5);
        assert_eq!(
            (half.limit(), half.burst(), half.window()),
            (5, 10, limit.window())
        );
        assert_eq!(limit.scaled(0.001).limit(), 1);
        assert_eq!(limit.scaled(7.0).limit(), 10, "never above the original");
        let window = Limit::fixed_window("w", 3, Duration::from_secs(60)).unwrap();
        assert_eq!(window.scaled(0.5).limit(), 1);
    }

    #[test]
    fn algorithm_names_round_trip() {
        for algorithm in Algorithm::ALL {
            assert_eq!(algorithm.as_str().parse::<Algorithm>(), Ok(algorithm));
        }
        let error = "bucket".parse::<Algorithm>().unwrap_err();
        assert!(error.to_string().contains("unknown algorithm `bucket`"));
    }
}
