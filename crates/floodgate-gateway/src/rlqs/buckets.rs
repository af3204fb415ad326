//! A reported bucket matched to its rule, and the key its shared limit is kept under.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use crate::config::{BucketMatch, BucketRule, QuotaLimit, QuotaSettings, RuleAction};

/// What a bucket's rule gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// No rule matches (or the domain has none): the bucket is not limited.
    Unmatched,
    /// A blanket rule: every request.
    AllowAll {
        /// The rule's name.
        rule: Arc<str>,
    },
    /// A blanket rule: no request.
    DenyAll {
        /// The rule's name.
        rule: Arc<str>,
    },
    /// A share of one limit, shared by every holder of `key`.
    Limit {
        /// The rule's name.
        rule: Arc<str>,
        /// The board key: the rule, and the values of its `"*"` entries.
        key: String,
        /// The limit.
        limit: QuotaLimit,
    },
}

impl Target {
    /// The rule's name, if a rule matched.
    pub(crate) fn rule(&self) -> Option<&str> {
        match self {
            Target::Unmatched => None,
            Target::AllowAll { rule } | Target::DenyAll { rule } | Target::Limit { rule, .. } => {
                Some(rule)
            }
        }
    }

    /// The board key, for a limit.
    pub(crate) fn key(&self) -> Option<&str> {
        match self {
            Target::Limit { key, .. } => Some(key),
            _ => None,
        }
    }
}

/// The target of `bucket` in `domain` under `settings`: its first matching rule.
pub(crate) fn resolve(
    settings: &QuotaSettings,
    prefix: &str,
    domain: &str,
    bucket: &BTreeMap<&str, &str>,
) -> Target {
    let Some(rules) = settings.domains.get(domain) else {
        return Target::Unmatched;
    };
    let Some(rule) = rules.iter().find(|rule| rule.matches(bucket)) else {
        return Target::Unmatched;
    };
    let name = rule.name.clone();
    match &rule.action {
        RuleAction::Allow => Target::AllowAll { rule: name },
        RuleAction::Deny => Target::DenyAll { rule: name },
        RuleAction::Limit(limit) => Target::Limit {
            key: board_key(prefix, domain, rule, bucket),
            rule: name,
            limit: *limit,
        },
    }
}

/// `<prefix>rlqs:<domain>:<rule>` and, per `"*"` entry, its key and value, each
/// length-prefixed so that no two buckets' keys can collide whatever their values hold.
fn board_key(
    prefix: &str,
    domain: &str,
    rule: &BucketRule,
    bucket: &BTreeMap<&str, &str>,
) -> String {
    let mut key = String::with_capacity(64);
    let _ = write!(
        key,
        "{prefix}rlqs:{}:{domain}:{}:{}",
        domain.len(),
        rule.name.len(),
        rule.name
    );
    for (entry, wanted) in &rule.matches {
        if *wanted == BucketMatch::Each {
            let value = bucket.get(entry.as_str()).copied().unwrap_or_default();
            let _ = write!(key, ":{}:{entry}={}:{value}", entry.len(), value.len());
        }
    }
    key
}

/// A bucket's entries in one canonical text (sorted by key, length-prefixed): the stream's
/// name for it.
pub(crate) fn canonical(bucket: &BTreeMap<&str, &str>) -> String {
    let mut text = String::new();
    for (key, value) in bucket {
        let _ = write!(text, "{}:{key}={}:{value};", key.len(), value.len());
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> QuotaSettings {
        let config = crate::config::parse(
            "rls: { listen: \"127.0.0.1:8081\", config_dir: rls, quota: { domains: { api: [ \
             { name: per_user, bucket: { name: chat, user: \"*\" }, limit: { limit: 10, window: 1s } }, \
             { name: shared, bucket: { name: mail }, limit: { limit: 10, window: 1s } }, \
             { name: off, bucket: { name: admin }, blanket: deny } ] } } }\n",
        )
        .unwrap();
        config.rls.unwrap().quota.unwrap()
    }

    #[test]
    fn a_wildcard_gives_each_value_its_own_key_and_an_exact_rule_one_key_for_all() {
        let settings = settings();
        let key = |pairs: &[(&str, &str)]| {
            let bucket = pairs.iter().copied().collect();
            resolve(&settings, "fg:", "api", &bucket)
                .key()
                .map(str::to_owned)
        };
        let alice = key(&[("name", "chat"), ("user", "alice")]);
        let bob = key(&[("name", "chat"), ("user", "bob")]);
        assert_ne!(alice, bob);
        assert!(alice.as_deref().unwrap().starts_with("fg:rlqs:"));
        assert_eq!(
            key(&[("name", "mail"), ("user", "alice")]),
            key(&[("name", "mail"), ("user", "bob")]),
            "one limit for every bucket the exact rule matches"
        );
        assert_eq!(key(&[("name", "admin")]), None);
        let bucket = [("name", "admin")].into_iter().collect();
        assert!(matches!(
            resolve(&settings, "", "api", &bucket),
            Target::DenyAll { .. }
        ));
        assert_eq!(resolve(&settings, "", "other", &bucket), Target::Unmatched);
        let bucket = [("name", "video")].into_iter().collect();
        assert_eq!(resolve(&settings, "", "api", &bucket), Target::Unmatched);
    }

    #[test]
    fn values_that_hold_separators_do_not_collide() {
        let settings = settings();
        let key = |user: &str| {
            let bucket = [("name", "chat"), ("user", user)].into_iter().collect();
            resolve(&settings, "", "api", &bucket)
                .key()
                .map(str::to_owned)
        };
        assert_ne!(key("a:1=b"), key("a"));
        let one: BTreeMap<&str, &str> = [("a", "b;1:c=d")].into_iter().collect();
        let two: BTreeMap<&str, &str> = [("a", "b"), ("c", "d")].into_iter().collect();
        assert_ne!(canonical(&one), canonical(&two));
    }
}
