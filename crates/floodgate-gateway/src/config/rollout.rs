//! How limits are applied: `rollout` (enforce, shadow, off; canary share) and the failure
//! policies (`on_store_error`, globally and per plan).

use floodgate::FailurePolicy;
use floodgate::rollout::{Mode, Rollout};

use super::errors::{Errors, Problem};
use super::raw;

pub(super) fn policy(text: &str) -> Result<FailurePolicy, Problem> {
    text.parse::<FailurePolicy>()
        .map_err(|_| problem!("unknown policy `{text}`; expected open, closed or local"))
}

/// `rollout` (or a plan's): the library's live rollout controls, starting as the file says.
pub(super) fn rollout(errors: &mut Errors, path: &str, raw: &raw::RawRollout) -> Option<Rollout> {
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
