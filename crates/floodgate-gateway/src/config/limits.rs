//! Limits: `plans` (their limits and endpoints), `per_ip` and `global`, each limit built and
//! validated by the library's `Limit` builder.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use floodgate::Limit;
use floodgate::calendar::{CalendarPeriod, Period};
use serde::{Deserialize, Serialize};

use super::errors::{Errors, Problem};
use super::rollout::{RawRollout, policy, rollout};
use super::{Rollout, RoutePattern, RouteTable, positive_duration};
use floodgate::FailurePolicy;

/// One plan under `plans:`, as written.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawPlan {
    /// Limits on every request of the plan's clients.
    pub limits: Vec<RawLimit>,
    /// Limits on the requests of one endpoint, by pattern.
    pub endpoints: BTreeMap<String, Vec<RawLimit>>,
    /// Overrides the top-level `on_store_error` for this plan's rules.
    pub on_store_error: Option<String>,
    /// Overrides the top-level `rollout` for this plan (shadow one plan while enforcing others).
    pub rollout: Option<RawRollout>,
}

/// One limit, as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLimit {
    /// Its name, unique within its list (headers, metrics and storage keys carry it).
    pub name: String,
    /// `token_bucket`, `gcra`, `fixed_window`, `sliding_window_log`,
    /// `sliding_window_counter`, `leaky_bucket` or `concurrency`.
    pub algorithm: String,
    /// Requests (or cost units) per window; for `concurrency`, at once.
    pub limit: u64,
    /// The window or refill period (for `concurrency`, how long a lease lives).
    #[serde(default)]
    pub window: Option<String>,
    /// The burst a bucket admits at once, by default `limit`.
    #[serde(default)]
    pub burst: Option<u64>,
    /// What a request costs against this limit, whatever its route says.
    #[serde(default)]
    pub cost: Option<u64>,
    /// A response header holding the request's real cost (SPEC §9), post-charged.
    #[serde(default)]
    pub cost_header: Option<String>,
    /// Whether the client still sees `cost_header` (default false: removed).
    #[serde(default)]
    pub cost_header_visible: bool,
    /// A calendar period instead of `window` (`fixed_window`): `day`, `week`, `month`, `year`.
    #[serde(default)]
    pub period: Option<String>,
    /// The period's time zone (an IANA name), UTC by default.
    #[serde(default)]
    pub time_zone: Option<String>,
    /// A month's billing day (1 to 31), a week's first day (`monday` to `sunday`).
    #[serde(default)]
    pub anchor: Option<String>,
}

/// `period`, `time_zone` and `anchor` of a limit: its calendar period, if any.
fn calendar(errors: &mut Errors, path: &str, raw: &RawLimit) -> Option<Option<CalendarPeriod>> {
    let Some(period) = &raw.period else {
        for (field, given) in [("time_zone", &raw.time_zone), ("anchor", &raw.anchor)] {
            if given.is_some() {
                errors.push(format!("{path}.{field}"), "is only used with a period");
            }
        }
        return (raw.time_zone.is_none() && raw.anchor.is_none()).then_some(None);
    };
    let period: Period = errors.ok(format!("{path}.period"), period.parse().map_err(problem_of))?;
    let zone = raw.time_zone.as_deref().unwrap_or("UTC");
    let calendar = errors.ok(
        format!("{path}.time_zone"),
        CalendarPeriod::new(period, zone).map_err(problem_of),
    )?;
    match &raw.anchor {
        Some(anchor) => errors
            .ok(
                format!("{path}.anchor"),
                calendar.anchored(anchor).map_err(problem_of),
            )
            .map(Some),
        None => Some(Some(calendar)),
    }
}

fn problem_of(error: floodgate::calendar::CalendarError) -> Problem {
    Problem(error.to_string())
}

/// Limits on one endpoint, with the rule name their counters are kept under.
#[derive(Debug)]
pub(crate) struct EndpointLimits {
    /// `plan.<plan>.<endpoint>` or `global.<endpoint>`.
    pub rule: Arc<str>,
    /// The limits.
    pub limits: Vec<Arc<Limit>>,
}

/// One plan's limits.
#[derive(Debug, Default)]
pub(crate) struct PlanLimits {
    /// `plan.<name>`: the rule of the plan's limits in keys, metrics and logs.
    pub rule: Arc<str>,
    /// Limits on every request of the plan's clients.
    pub limits: Vec<Arc<Limit>>,
    /// Limits on particular endpoints.
    pub endpoints: RouteTable<EndpointLimits>,
    /// The plan's own failure policy, if it overrides the global one.
    pub on_store_error: Option<FailurePolicy>,
    /// The plan's own rollout, if it overrides the global one.
    pub rollout: Option<Rollout>,
}

pub(super) fn limit(
    errors: &mut Errors,
    path: &str,
    raw: &RawLimit,
    names: &mut HashSet<String>,
) -> Option<Arc<Limit>> {
    let mut builder = Limit::builder(raw.name.clone())
        .algorithm_name(&raw.algorithm)
        .limit(raw.limit);
    if let Some(window) = &raw.window {
        match positive_duration(window) {
            Ok(window) => builder = builder.window(window),
            Err(message) => {
                errors.push(format!("{path}.window"), message);
                return None;
            }
        }
    }
    if let Some(burst) = raw.burst {
        builder = builder.burst(burst);
    }
    if let Some(cost) = raw.cost {
        builder = builder.cost(cost);
    }
    if let Some(calendar) = calendar(errors, path, raw)? {
        builder = builder.calendar(calendar);
    }
    if !names.insert(raw.name.clone()) {
        errors.push(
            format!("{path}.name"),
            format!("`{}` is used twice in this list", raw.name),
        );
        return None;
    }
    match builder.build() {
        Ok(limit) => Some(Arc::new(limit)),
        Err(error) => {
            errors.push(format!("{path}.{}", error.field()), error.problem());
            None
        }
    }
}

pub(super) fn limits(errors: &mut Errors, path: &str, raws: &[RawLimit]) -> Vec<Arc<Limit>> {
    let mut names = HashSet::new();
    raws.iter()
        .enumerate()
        .filter_map(|(index, raw)| limit(errors, &format!("{path}[{index}]"), raw, &mut names))
        .collect()
}

pub(super) fn endpoint_limits(
    errors: &mut Errors,
    path: &str,
    rule_prefix: &str,
    raw: &BTreeMap<String, Vec<RawLimit>>,
) -> RouteTable<EndpointLimits> {
    let mut table = RouteTable::default();
    for (pattern, raws) in raw {
        let entry_path = format!("{path}.\"{pattern}\"");
        let parsed = limits(errors, &entry_path, raws);
        if let Some(endpoint) = errors.ok(entry_path.clone(), RoutePattern::parse(pattern)) {
            let entry = EndpointLimits {
                rule: Arc::from(format!("{rule_prefix}.{}", endpoint.key_id())),
                limits: parsed,
            };
            errors.ok(entry_path, table.insert(endpoint, entry));
        }
    }
    table
}

/// `plans`, each with its rule, limits, endpoint limits and overrides.
pub(super) fn plans(
    errors: &mut Errors,
    raw_plans: &BTreeMap<String, RawPlan>,
) -> HashMap<String, PlanLimits> {
    let mut plans = HashMap::new();
    for (name, raw_plan) in raw_plans {
        let path = format!("plans.{name}");
        let rule = format!("plan.{name}");
        // The plan's rule names its counters: the library's rule for rule names applies.
        if name.is_empty() || floodgate::plan::check_rule_name(&rule).is_err() {
            errors.push(
                path.clone(),
                "plan names are made of A-Z a-z 0-9 - _ . (at most 59 characters)",
            );
        }
        let plan = PlanLimits {
            limits: limits(errors, &format!("{path}.limits"), &raw_plan.limits),
            endpoints: endpoint_limits(
                errors,
                &format!("{path}.endpoints"),
                &rule,
                &raw_plan.endpoints,
            ),
            rule: Arc::from(rule),
            on_store_error: raw_plan
                .on_store_error
                .as_deref()
                .and_then(|text| errors.ok(format!("{path}.on_store_error"), policy(text))),
            rollout: raw_plan
                .rollout
                .as_ref()
                .and_then(|raw| rollout(errors, &format!("{path}.rollout"), raw)),
        };
        plans.insert(name.clone(), plan);
    }
    plans
}

/// `plan`'s limits and endpoint limits scaled by the regional `share` ([`scaled`]).
pub(super) fn scaled_plan(plan: PlanLimits, share: f64) -> PlanLimits {
    PlanLimits {
        limits: scaled(plan.limits, share),
        endpoints: scaled_endpoints(plan.endpoints, share),
        ..plan
    }
}

/// Each endpoint's limits scaled by the regional `share` ([`scaled`]).
pub(super) fn scaled_endpoints(
    table: RouteTable<EndpointLimits>,
    share: f64,
) -> RouteTable<EndpointLimits> {
    table.map(|entry| EndpointLimits {
        rule: entry.rule,
        limits: scaled(entry.limits, share),
    })
}

/// `limits` with `limit` and `burst` scaled by the regional `share` (`store.share`): each
/// region enforces its part of a limit.
pub(super) fn scaled(limits: Vec<Arc<Limit>>, share: f64) -> Vec<Arc<Limit>> {
    if share >= 1.0 {
        return limits;
    }
    limits
        .into_iter()
        .map(|limit| Arc::new(limit.scaled(share)))
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::config::tests::errors_of;
    use crate::config::*;

    #[test]
    fn a_limit_may_count_on_the_calendar() {
        let config = parse(
            "plans:\n  free:\n    limits:\n      - { name: monthly, algorithm: fixed_window, limit: 10000, period: month, time_zone: America/New_York, anchor: \"15\" }\n  anonymous: {}\n",
        )
        .unwrap();
        let monthly = &config.plans["free"].limits[0];
        assert_eq!(
            monthly.calendar().map(ToString::to_string).as_deref(),
            Some("month from day 15 (America/New_York)")
        );
        let limit = |fields: &str| {
            errors_of(&format!(
                "plans:\n  free:\n    limits: [ {{ name: q, algorithm: fixed_window, limit: 5, {fields} }} ]\n  anonymous: {{}}\n"
            ))
        };
        assert_eq!(
            limit("period: fortnight"),
            ["plans.free.limits[0].period: `fortnight` is not one of day, week, month, year"]
        );
        assert_eq!(
            limit("period: day, time_zone: Mars/Base"),
            [
                "plans.free.limits[0].time_zone: `Mars/Base` is not a time zone (an IANA name such as Europe/Lisbon, or UTC)"
            ]
        );
        assert_eq!(
            limit("period: week, anchor: someday"),
            [
                "plans.free.limits[0].anchor: a week's anchor is its first day, monday to sunday, not `someday`"
            ]
        );
        assert_eq!(
            limit("window: 1d, time_zone: UTC"),
            ["plans.free.limits[0].time_zone: is only used with a period"]
        );
        assert_eq!(
            limit("period: day, window: 1d"),
            [
                "plans.free.limits[0].window: not used with a calendar period (the period is the window); remove it"
            ]
        );
        assert_eq!(
            errors_of(
                "plans:\n  free:\n    limits: [ { name: q, algorithm: token_bucket, limit: 5, period: day } ]\n  anonymous: {}\n"
            ),
            ["plans.free.limits[0].period: counts fixed_window limits only, not token_bucket"]
        );
    }

    #[test]
    fn a_regional_share_scales_every_limit() {
        let config = parse(
            r#"
store: { share: 0.25 }
plans:
  free:
    limits: [ { name: per-second, algorithm: token_bucket, limit: 100, window: 1s, burst: 200 } ]
    endpoints: { "POST /x": [ { name: x, algorithm: fixed_window, limit: 8, window: 60s } ] }
  anonymous: {}
per_ip: [ { name: ip, algorithm: gcra, limit: 40, window: 1s } ]
global: { "/search": [ { name: g, algorithm: sliding_window_counter, limit: 1000, window: 1s } ] }
"#,
        )
        .unwrap();
        let free = &config.plans["free"];
        assert_eq!((free.limits[0].limit(), free.limits[0].burst()), (25, 50));
        let (_, endpoint) = free.endpoints.find(&http::Method::POST, "/x").unwrap();
        assert_eq!(endpoint.limits[0].limit(), 2);
        assert_eq!(config.per_ip[0].limit(), 10);
        let (_, global) = config.global.find(&http::Method::GET, "/search").unwrap();
        assert_eq!(global.limits[0].limit(), 250);
        assert!(
            errors_of("store: { share: 0 }")
                .iter()
                .any(|error| error.starts_with("store.share:"))
        );
    }

    #[test]
    fn plan_names_follow_the_library_rule_for_rule_names() {
        let plan = |name: &str| {
            format!(
                "clients: {{ default_plan: {name}, anonymous_plan: {name} }}\nplans:\n  {name}: {{}}\n"
            )
        };
        // `plan.` and 59 characters make a 64-character rule.
        assert!(errors_of(&plan(&"a".repeat(59))).is_empty());
        let errors = errors_of(&plan(&"a".repeat(60)));
        assert!(
            errors.iter().any(|error| error.starts_with("plans.aaaa")),
            "{errors:?}"
        );
    }
}
