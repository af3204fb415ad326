//! How limits are applied: `rollout` (enforce, shadow, off; canary share) and the failure
//! policies (`on_store_error`, globally and per plan).

use floodgate::FailurePolicy;

use super::errors::{Errors, Problem};
use super::raw;

/// `rollout.mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RolloutMode {
    /// Limits are enforced (for `enforce_percent` of identities).
    Enforce,
    /// Counted and reported, never enforced.
    Shadow,
    /// Kill switch: no limiting and no store calls at all.
    Off,
}

/// `rollout`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rollout {
    /// The mode.
    pub mode: RolloutMode,
    /// Share of identities enforced, by stable hash; the rest are shadowed.
    pub enforce_percent: f64,
}

pub(super) fn policy(text: &str) -> Result<FailurePolicy, Problem> {
    text.parse::<FailurePolicy>()
        .map_err(|_| problem!("unknown policy `{text}`; expected open, closed or local"))
}

pub(super) fn rollout(errors: &mut Errors, path: &str, raw: &raw::RawRollout) -> Option<Rollout> {
    let mode = match raw.mode.as_str() {
        "enforce" => Some(RolloutMode::Enforce),
        "shadow" => Some(RolloutMode::Shadow),
        "off" => Some(RolloutMode::Off),
        other => {
            errors.push(
                format!("{path}.mode"),
                format!("unknown mode `{other}`; expected enforce, shadow or off"),
            );
            None
        }
    };
    if !(0.0..=100.0).contains(&raw.enforce_percent) {
        errors.push(
            format!("{path}.enforce_percent"),
            "must be between 0 and 100",
        );
        return None;
    }
    mode.map(|mode| Rollout {
        mode,
        enforce_percent: raw.enforce_percent,
    })
}
