//! What on-call engineers reach for: the bounds of the admin API's per-client overrides
//! (`admin.overrides`) and the access log (`access_log`). Each raw section carries its own
//! defaults.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::duration::parse_duration;
use super::errors::Errors;

/// `admin:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawAdmin {
    /// The admin API's address (loopback by default).
    pub listen: String,
    /// Bounds of the per-client overrides.
    pub overrides: RawOverrides,
}

impl Default for RawAdmin {
    fn default() -> Self {
        RawAdmin {
            listen: "127.0.0.1:9090".to_owned(),
            overrides: Default::default(),
        }
    }
}

/// `admin.overrides` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawOverrides {
    /// The most overrides in force at once, across the store.
    pub max_active: usize,
    /// The longest `expires_in` an override may ask for.
    pub max_expires_in: String,
}

impl Default for RawOverrides {
    fn default() -> Self {
        RawOverrides {
            max_active: floodgate::overrides::DEFAULT_MAX_ACTIVE,
            max_expires_in: "7d".to_owned(),
        }
    }
}

/// The bounds on per-client overrides (`admin.overrides`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OverrideBounds {
    /// The most in force at once.
    pub max_active: usize,
    /// The longest `expires_in`.
    pub max_expires_in: Duration,
}

/// Validates `admin.overrides`.
pub(super) fn overrides(errors: &mut Errors, raw: &RawOverrides) -> Option<OverrideBounds> {
    let max_active = match raw.max_active {
        0 => {
            errors.push(
                "admin.overrides.max_active",
                "must be at least 1 (no override can be set at 0)",
            );
            None
        }
        count if count > 1_000_000 => {
            errors.push("admin.overrides.max_active", "must be at most 1000000");
            None
        }
        count => Some(count),
    };
    let max_expires_in = errors
        .ok(
            "admin.overrides.max_expires_in",
            parse_duration(&raw.max_expires_in),
        )
        .and_then(|duration| {
            if duration < Duration::from_secs(1) || duration > Duration::from_secs(366 * 86_400) {
                errors.push(
                    "admin.overrides.max_expires_in",
                    "must be between 1s and 366d",
                );
                None
            } else {
                Some(duration)
            }
        });
    Some(OverrideBounds {
        max_active: max_active?,
        max_expires_in: max_expires_in?,
    })
}

/// `access_log` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawAccessLog {
    /// `stdout` or a file path.
    pub path: String,
    /// `json` or `text`.
    pub format: String,
    /// The share of requests logged, 0 to 1.
    pub sample: f64,
    /// `all`, or `limited` (only requests answered 429 or refused).
    pub only: String,
    /// Lines waiting to be written at most; past it lines are dropped and counted.
    pub buffer: usize,
}

impl Default for RawAccessLog {
    fn default() -> Self {
        RawAccessLog {
            path: "stdout".to_owned(),
            format: "json".to_owned(),
            sample: 1.0,
            only: "all".to_owned(),
            buffer: 8192,
        }
    }
}

/// Where access log lines go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum AccessLogTarget {
    /// Standard output.
    Stdout,
    /// A file, appended to (reopened on `SIGUSR1`).
    File(PathBuf),
}

/// How each line is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AccessLogFormat {
    /// One JSON object per line.
    Json,
    /// `key=value` pairs, one request per line.
    Text,
}

/// The access log (`access_log`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AccessLogSettings {
    /// Where.
    pub target: AccessLogTarget,
    /// How.
    pub format: AccessLogFormat,
    /// The share of requests logged.
    pub sample: f64,
    /// Only requests that were limited or refused.
    pub only_limited: bool,
    /// Lines waiting at most.
    pub buffer: usize,
}

/// Validates `access_log`.
pub(super) fn access_log(
    errors: &mut Errors,
    raw: Option<&RawAccessLog>,
) -> Option<Option<AccessLogSettings>> {
    let Some(raw) = raw else {
        return Some(None);
    };
    let target = match raw.path.trim() {
        "" => {
            errors.push(
                "access_log.path",
                "is empty; expected stdout or a file path",
            );
            None
        }
        "stdout" | "-" => Some(AccessLogTarget::Stdout),
        path => Some(AccessLogTarget::File(PathBuf::from(path))),
    };
    let format = match raw.format.as_str() {
        "json" => Some(AccessLogFormat::Json),
        "text" => Some(AccessLogFormat::Text),
        other => {
            errors.push(
                "access_log.format",
                format!("`{other}` is not one of json, text"),
            );
            None
        }
    };
    let sample = if (0.0..=1.0).contains(&raw.sample) {
        Some(raw.sample)
    } else {
        errors.push(
            "access_log.sample",
            format!("must be between 0 and 1, got {}", raw.sample),
        );
        None
    };
    let only_limited = match raw.only.as_str() {
        "all" => Some(false),
        "limited" => Some(true),
        other => {
            errors.push(
                "access_log.only",
                format!("`{other}` is not one of all, limited"),
            );
            None
        }
    };
    let buffer = if (1..=1_000_000).contains(&raw.buffer) {
        Some(raw.buffer)
    } else {
        errors.push("access_log.buffer", "must be between 1 and 1000000 lines");
        None
    };
    Some(Some(AccessLogSettings {
        target: target?,
        format: format?,
        sample: sample?,
        only_limited: only_limited?,
        buffer: buffer?,
    }))
}
