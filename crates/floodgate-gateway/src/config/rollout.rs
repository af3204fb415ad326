//! How limits are applied: `rollout` (enforce, shadow, off; canary share) and the failure
//! policies (`on_store_error`, globally and per plan).

use floodgate::FailurePolicy;
use floodgate::rollout::{Mode, Rollout};
use serde::{Deserialize, Serialize};

use super::errors::{Errors, Problem};

/// `rollout:` (or a plan's), as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawRollout {
    /// `enforce`, `shadow` or `off`.
    pub mode: String,
    /// The share of clients, in percent, whose limits are enforced; the others are shadowed.
    pub enforce_percent: f64,
}

impl Default for RawRollout {
    fn default() -> Self {
        RawRollout {
            mode: "enforce".to_owned(),
            enforce_percent: 100.0,
        }
    }
}

pub(super) fn policy(text: &str) -> Result<FailurePolicy, Problem> {
    text.parse::<FailurePolicy>()
        .map_err(|_| problem!("unknown policy `{text}`; expected open, closed or local"))
}

/// `rollout` (or a plan's): the library's live rollout controls, starting as the file says.
pub(super) fn rollout(errors: &mut Errors, path: &str, raw: &RawRollout) -> Option<Rollout> {
    let mode = errors.ok(format!("{path}.mode"), raw.mode.parse::<Mode>());
    if !(0.0..=100.0).contains(&raw.enforce_percent) {
        errors.push(
            format!("{path}.enforce_percent"),
            "must be between 0 and 100",
        );
        return None;
    }
    mode.map(|mode| Rollout::new(mode, raw.enforce_percent))
}
