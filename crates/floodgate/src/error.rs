//! [`BuildError`]: why a layer could not be built. A leaf module, so that the validators beside
//! each type (key prefixes, rule names, failure policies) can name it without a module circle.

/// Why a layer could not be built.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// No limit was given and no custom plan either.
    #[error("limits: at least one limit is required")]
    NoLimits,
    /// Two limits share a name; names key the counters, so they must differ.
    #[error("limits[{index}].name: `{name}` is used by an earlier limit")]
    DuplicateLimitName {
        /// Position of the second limit.
        index: usize,
        /// The name.
        name: String,
    },
    /// The rule name has characters outside `A-Z a-z 0-9 - _ .` or is empty or too long.
    #[error("rule: `{0}` is not a valid rule name (1 to 64 characters among A-Z a-z 0-9 - _ .)")]
    InvalidRule(String),
    /// The key prefix is empty, too long, or contains `{`, `}` or `:`.
    #[error("prefix: `{0}` is not a valid key prefix (1 to 64 characters, no braces or colons)")]
    InvalidPrefix(String),
    /// The jitter is negative, not finite, or above 10.
    #[error("retry_after_jitter: must be between 0 and 10, got {0}")]
    InvalidJitter(f64),
    /// The fallback share is not in (0, 1].
    #[error("fallback_share: must be greater than 0 and at most 1, got {0}")]
    InvalidFallbackShare(f64),
    /// No such failure policy.
    #[error("on_store_error: unknown policy `{0}`; expected open, closed or local")]
    UnknownFailurePolicy(String),
    /// `limit`, `limits`, `rule` or `key_prefix` were set together with a custom plan, which
    /// chooses its own limits and keys: they would be ignored.
    #[error(
        "plan: a custom plan picks its own limits, rule and key prefix; `{0}` would be ignored"
    )]
    IgnoredWithPlan(&'static str),
    /// The store cannot decide a limit's algorithm (a batched store counts; it holds no
    /// concurrency leases, and shaping needs an exact store).
    #[error("limits[{index}].algorithm: the {store} store cannot decide `{algorithm}` limits")]
    UnsupportedAlgorithm {
        /// Position of the limit.
        index: usize,
        /// The algorithm.
        algorithm: crate::Algorithm,
        /// The store's backend name.
        store: &'static str,
    },
    /// A limit could not be built.
    #[error(transparent)]
    Limit(#[from] crate::limit::LimitError),
}
