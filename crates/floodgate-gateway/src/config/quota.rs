//! `rls.quota:` (SPEC §10a): Envoy's Rate Limit Quota Service, the rules that map a bucket to
//! what its Envoys may do.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Errors, positive_duration};

/// `rls.quota:` as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawQuota {
    /// How often the Envoys report (Envoy's filter: 5 s, whatever it is configured with).
    #[serde(default = "default_report_interval")]
    pub report_interval: String,
    /// Reports without a request after which a bucket is abandoned.
    #[serde(default = "default_abandon_after")]
    pub abandon_after: u32,
    /// Per domain (Envoy's filter's `domain`), its bucket rules, the first that matches wins.
    #[serde(default)]
    pub domains: BTreeMap<String, Vec<RawBucketRule>>,
}

fn default_report_interval() -> String {
    "5s".to_owned()
}

fn default_abandon_after() -> u32 {
    6
}

/// One bucket rule as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawBucketRule {
    /// Its name (metrics, the admin API and storage keys carry it); `<domain>.<index>` if unset.
    #[serde(default)]
    pub name: Option<String>,
    /// The `BucketId` entries it matches: a value, or `"*"` for one limit per distinct value.
    /// Empty: every bucket of the domain.
    #[serde(default)]
    pub bucket: BTreeMap<String, String>,
    /// The limit shared by every Envoy reporting a matching bucket.
    #[serde(default)]
    pub limit: Option<RawQuotaLimit>,
    /// `allow` or `deny`: every matching bucket, on every Envoy (a kill switch).
    #[serde(default)]
    pub blanket: Option<String>,
}

/// A rule's limit as written: what Envoy enforces is a token bucket.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawQuotaLimit {
    /// `token_bucket` (the default) or `gcra`, which admits the same.
    #[serde(default)]
    pub algorithm: Option<String>,
    /// Requests per `window`.
    pub limit: u64,
    /// The refill period of `limit`.
    pub window: String,
    /// The burst the Envoys together may admit at once, by default `limit`.
    #[serde(default)]
    pub burst: Option<u64>,
}

/// `rls.quota:`, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct QuotaSettings {
    /// How often the Envoys report.
    pub report_interval: Duration,
    /// Reports without a request after which a bucket is abandoned.
    pub abandon_after: u32,
    /// Each domain's rules, in order.
    pub domains: BTreeMap<String, Vec<BucketRule>>,
}

impl QuotaSettings {
    /// An assignment's time to live: three report intervals, in whole seconds (Envoy reads
    /// only the seconds).
    pub(crate) fn assignment_ttl(&self) -> Duration {
        Duration::from_secs((self.report_interval * 3).as_secs_f64().ceil() as u64)
    }
}

/// One bucket rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BucketRule {
    /// `<name>` or `<domain>.<index>`.
    pub name: Arc<str>,
    /// The entries a bucket must carry, sorted by key.
    pub matches: Vec<(String, BucketMatch)>,
    /// What its buckets get.
    pub action: RuleAction,
}

/// How a rule matches one entry of a `BucketId`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum BucketMatch {
    /// This value only.
    Exact(String),
    /// Any value, one limit per distinct value.
    Each,
}

/// What a rule's buckets get.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RuleAction {
    /// Every request, on every Envoy.
    Allow,
    /// No request.
    Deny,
    /// A share of one limit per rule (per distinct value of its `"*"` entries).
    Limit(QuotaLimit),
}

/// A limit as the board shares it: a rate and a burst.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QuotaLimit {
    /// Thousandths of a request per second.
    pub rate_milli: u64,
    /// Requests the Envoys together may admit at once.
    pub burst: u64,
}

impl BucketRule {
    /// Whether `bucket` carries every entry this rule names.
    pub(crate) fn matches(&self, bucket: &BTreeMap<&str, &str>) -> bool {
        self.matches
            .iter()
            .all(|(key, wanted)| match (bucket.get(key.as_str()), wanted) {
                (Some(value), BucketMatch::Exact(exact)) => value == exact,
                (Some(_), BucketMatch::Each) => true,
                (None, _) => false,
            })
    }
}

/// Validates `rls.quota`.
pub(super) fn quota(errors: &mut Errors, raw: Option<&RawQuota>) -> Option<Option<QuotaSettings>> {
    let Some(raw) = raw else {
        return Some(None);
    };
    let report_interval = errors.ok(
        "rls.quota.report_interval",
        positive_duration(&raw.report_interval),
    );
    if raw.abandon_after == 0 {
        errors.push("rls.quota.abandon_after", "must be at least 1");
    }
    let mut domains = BTreeMap::new();
    let mut valid = true;
    for (domain, rules) in &raw.domains {
        let path = format!("rls.quota.domains.{domain}");
        if domain.is_empty() {
            errors.push(&path, "a domain must have a name");
        }
        let mut names = std::collections::HashSet::new();
        let mut validated = Vec::new();
        for (index, rule) in rules.iter().enumerate() {
            let path = format!("{path}[{index}]");
            let name = rule
                .name
                .clone()
                .unwrap_or_else(|| format!("{domain}.{index}"));
            if !names.insert(name.clone()) {
                errors.push(format!("{path}.name"), format!("`{name}` is used twice"));
            }
            match bucket_rule(errors, &path, name, rule) {
                Some(rule) => validated.push(rule),
                None => valid = false,
            }
        }
        domains.insert(domain.clone(), validated);
    }
    let report_interval = report_interval?;
    valid.then_some(Some(QuotaSettings {
        report_interval,
        abandon_after: raw.abandon_after.max(1),
        domains,
    }))
}

fn bucket_rule(
    errors: &mut Errors,
    path: &str,
    name: String,
    raw: &RawBucketRule,
) -> Option<BucketRule> {
    let matches = raw
        .bucket
        .iter()
        .map(|(key, value)| {
            let wanted = if value == "*" {
                BucketMatch::Each
            } else {
                BucketMatch::Exact(value.clone())
            };
            (key.clone(), wanted)
        })
        .collect();
    let action = match (&raw.limit, raw.blanket.as_deref()) {
        (Some(_), Some(_)) => {
            errors.push(path, "has both `limit` and `blanket`: give one");
            return None;
        }
        (None, None) => {
            errors.push(path, "needs a `limit` or a `blanket` (allow or deny)");
            return None;
        }
        (None, Some("allow")) => RuleAction::Allow,
        (None, Some("deny")) => RuleAction::Deny,
        (None, Some(other)) => {
            errors.push(
                format!("{path}.blanket"),
                format!("`{other}` is not allow or deny"),
            );
            return None;
        }
        (Some(limit), None) => {
            RuleAction::Limit(quota_limit(errors, &format!("{path}.limit"), limit)?)
        }
    };
    Some(BucketRule {
        name: name.into(),
        matches,
        action,
    })
}

fn quota_limit(errors: &mut Errors, path: &str, raw: &RawQuotaLimit) -> Option<QuotaLimit> {
    let algorithm = raw.algorithm.as_deref().unwrap_or("token_bucket");
    let algorithm_ok = matches!(algorithm, "token_bucket" | "gcra");
    if !algorithm_ok {
        errors.push(
            format!("{path}.algorithm"),
            format!(
                "`{algorithm}`: an Envoy enforces its assignment as a token bucket, so a quota \
                 limit is `token_bucket` (or `gcra`, which admits the same); a window's count \
                 cannot be split into rates without admitting more than it"
            ),
        );
    }
    let window = errors.ok(format!("{path}.window"), positive_duration(&raw.window));
    if raw.limit == 0 {
        errors.push(
            format!("{path}.limit"),
            "must be at least 1 (a blanket deny refuses all)",
        );
    }
    let burst = raw.burst.unwrap_or(raw.limit);
    if burst == 0 {
        errors.push(format!("{path}.burst"), "must be at least 1");
    }
    let window = window?;
    let rate_milli = (raw.limit as f64 * 1000.0 / window.as_secs_f64()).floor() as u64;
    if rate_milli == 0 {
        errors.push(
            format!("{path}.window"),
            "is too long for the limit: less than a thousandth of a request per second",
        );
    }
    (algorithm_ok && raw.limit > 0 && burst > 0 && rate_milli > 0)
        .then_some(QuotaLimit { rate_milli, burst })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(yaml: &str) -> String {
        crate::config::parse(yaml).unwrap_err().to_string()
    }

    const HEAD: &str = "rls: { listen: \"127.0.0.1:8081\", config_dir: rls, quota: ";

    #[test]
    fn a_rule_is_a_limit_or_a_blanket_and_its_limit_a_token_bucket() {
        let text = errors(&format!(
            "{HEAD}{{ domains: {{ api: [ {{ bucket: {{ name: a }} }}, \
             {{ blanket: maybe }}, {{ limit: {{ algorithm: fixed_window, limit: 10, window: 1s }} }}, \
             {{ limit: {{ limit: 10, window: 1s }}, blanket: deny }} ] }} }} }}\n"
        ));
        assert!(
            text.contains("rls.quota.domains.api[0]: needs a `limit` or a `blanket`"),
            "{text}"
        );
        assert!(
            text.contains("rls.quota.domains.api[1].blanket: `maybe`"),
            "{text}"
        );
        assert!(
            text.contains("rls.quota.domains.api[2].limit.algorithm: `fixed_window`"),
            "{text}"
        );
        assert!(
            text.contains("rls.quota.domains.api[3]: has both"),
            "{text}"
        );
    }

    #[test]
    fn the_report_interval_and_durations_are_checked_with_their_paths() {
        let text = errors(&format!(
            "{HEAD}{{ report_interval: soon, abandon_after: 0, domains: {{ api: [ \
             {{ limit: {{ limit: 0, window: 0s }} }} ] }} }} }}\n"
        ));
        for path in [
            "rls.quota.report_interval",
            "rls.quota.abandon_after",
            "rls.quota.domains.api[0].limit.limit",
            "rls.quota.domains.api[0].limit.window",
        ] {
            assert!(text.contains(path), "{path} missing from {text}");
        }
    }

    #[test]
    fn the_shares_live_on_any_store() {
        for store in [
            "{ backend: memory }",
            "{ backend: redis, url: \"redis://127.0.0.1:6379\" }",
            "{ backend: redis_cluster, nodes: [\"redis://127.0.0.1:7000\"] }",
            "{ backend: redis_sharded, nodes: [\"redis://127.0.0.1:7000\", \"redis://127.0.0.1:7001\"] }",
            "{ backend: redis, sentinel: { master: main, nodes: [\"redis://127.0.0.1:26379\"] } }",
        ] {
            let parsed = crate::config::parse(&format!(
                "store: {store}\n{HEAD}{{ domains: {{ api: [ {{ blanket: allow }} ] }} }} }}\n"
            ));
            assert!(parsed.is_ok(), "{store}: {:?}", parsed.err());
        }
    }

    #[test]
    fn rules_match_exact_values_and_any_value_of_a_wildcard() {
        let config = crate::config::parse(&format!(
            "{HEAD}{{ domains: {{ api: [ {{ name: per_user, bucket: {{ name: chat, user: \"*\" }}, \
             limit: {{ limit: 100, window: 1m, burst: 20 }} }}, {{ blanket: deny }} ] }} }} }}\n"
        ))
        .unwrap();
        let quota = config.rls.unwrap().quota.unwrap();
        assert_eq!(quota.assignment_ttl(), Duration::from_secs(15));
        let rules = &quota.domains["api"];
        let bucket = |pairs: &[(&'static str, &'static str)]| pairs.iter().copied().collect();
        assert!(rules[0].matches(&bucket(&[("name", "chat"), ("user", "u1"), ("x", "y")])));
        assert!(!rules[0].matches(&bucket(&[("name", "chat")])));
        assert!(!rules[0].matches(&bucket(&[("name", "mail"), ("user", "u1")])));
        assert!(rules[1].matches(&bucket(&[])));
        assert_eq!(
            rules[0].action,
            RuleAction::Limit(QuotaLimit {
                rate_milli: 1666,
                burst: 20
            })
        );
        assert_eq!(&*rules[1].name, "api.1");
    }
}
