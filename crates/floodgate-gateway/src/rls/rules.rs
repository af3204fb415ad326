//! envoyproxy/ratelimit's configuration format: a directory of YAML files, one `domain` each,
//! with nested `descriptors`. Parsed into a tree per domain that a request descriptor walks
//! entry by entry; every error names its file and field path
//! (`rls/api.yaml: descriptors[0].rate_limit.unit: ...`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use floodgate::{Algorithm, Limit};
use serde::Deserialize;

use crate::config::ConfigError;

/// The largest domain file read (far above any real one).
const MAX_FILE_BYTES: usize = 16 * 1024 * 1024;

/// A domain file as written. Unknown fields are errors, as in envoyproxy/ratelimit.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDomain {
    domain: String,
    #[serde(default)]
    descriptors: Vec<RawDescriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    key: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<RawRateLimit>,
    #[serde(default)]
    descriptors: Vec<RawDescriptor>,
    #[serde(default)]
    shadow_mode: bool,
    /// Accepted for compatibility: floodgate never puts descriptor values in metric labels.
    #[serde(default)]
    #[allow(dead_code)]
    detailed_metric: bool,
    /// floodgate's addition (default `fixed_window`, as envoyproxy/ratelimit counts).
    #[serde(default)]
    algorithm: Option<String>,
    /// floodgate's addition, for the bucket algorithms.
    #[serde(default)]
    burst: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    requests_per_unit: Option<u64>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    unlimited: bool,
    /// Named limits that this one replaces when both match one request.
    #[serde(default)]
    replaces: Vec<RawReplace>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplace {
    name: String,
}

/// The time units of envoyproxy/ratelimit, in the protocol's numbering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// One second.
    Second,
    /// One minute.
    Minute,
    /// One hour.
    Hour,
    /// One day.
    Day,
    /// Seven days.
    Week,
    /// Thirty days, as envoyproxy/ratelimit counts a month.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    fn parse(text: &str) -> Option<Unit> {
        Some(match text.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    /// The window this unit counts over.
    pub fn window(self) -> Duration {
        const DAY: u64 = 86_400;
        Duration::from_secs(match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => DAY,
            Unit::Week => 7 * DAY,
            Unit::Month => 30 * DAY,
            Unit::Year => 365 * DAY,
        })
    }

    /// The protocol's `RateLimit.Unit` number.
    pub fn proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }
}

/// What a matched descriptor does.
#[derive(Clone, Debug)]
pub enum Action {
    /// `unlimited: true`: answered `OK`, never counted.
    Unlimited,
    /// `requests_per_unit: 0`: every request is over the limit, nothing is counted.
    DenyAll,
    /// Counted against `limit`.
    Limited(Arc<Limit>),
}

/// The rate limit of one configured descriptor.
#[derive(Clone, Debug)]
pub struct DescriptorLimit {
    /// The keys from the domain's root to this descriptor, joined by `.`: the metric's `limit`
    /// label (a path of keys, never a value).
    pub key_path: Arc<str>,
    /// `rate_limit.name`, or the key path: the name in `RateLimit` headers and in the
    /// response's `current_limit`.
    pub name: Arc<str>,
    /// `requests_per_unit`.
    pub requests_per_unit: u32,
    /// `unit`.
    pub unit: Unit,
    /// What a match does.
    pub action: Action,
    /// Counted, but always answered `OK`.
    pub shadow_mode: bool,
    /// `rate_limit.replaces`: the names of limits this one sets aside when both match one
    /// request (those descriptors are answered `OK` and not counted).
    pub replaces: Vec<Arc<str>>,
}

/// One level of a domain's descriptor tree.
#[derive(Debug, Default)]
pub struct Node {
    /// Children by `key` (value-less) or `key` + `\0` + `value`.
    children: HashMap<String, Node>,
    limit: Option<DescriptorLimit>,
}

fn child_key(key: &str, value: Option<&str>) -> String {
    match value {
        Some(value) => format!("{key}\0{value}"),
        None => key.to_owned(),
    }
}

impl Node {
    /// The limit for a request descriptor's entries: at each level the entry's `key` + `value`
    /// match wins over a value-less `key` (the most specific match); the limit is that of the
    /// node the last entry reaches. `None`: no limit applies.
    pub fn find<'a, 'e>(
        &self,
        mut entries: impl Iterator<Item = (&'e str, &'e str)>,
    ) -> Option<&DescriptorLimit> {
        let mut node = self;
        let mut entry = entries.next()?;
        loop {
            node = node
                .children
                .get(&child_key(entry.0, Some(entry.1)))
                .or_else(|| node.wildcard_child(entry.0, entry.1))
                .or_else(|| node.children.get(entry.0))?;
            match entries.next() {
                Some(next) => entry = next,
                None => return node.limit.as_ref(),
            }
        }
    }
}

impl Node {
    /// The child whose `value` ends in `*` and is a prefix of `value` (envoyproxy/ratelimit's
    /// wildcard values: `value: "user_*"`), the longest such prefix if several match. Tried
    /// after the exact value, before the value-less key.
    fn wildcard_child(&self, key: &str, value: &str) -> Option<&Node> {
        self.children
            .iter()
            .filter_map(|(name, child)| {
                let (child_key, pattern) = name.split_once('\0')?;
                let prefix = pattern.strip_suffix('*')?;
                (child_key == key && value.starts_with(prefix)).then_some((prefix.len(), child))
            })
            .max_by_key(|(length, _)| *length)
            .map(|(_, child)| child)
    }
}

/// Every domain's rules, as one version of the directory.
#[derive(Debug, Default)]
pub struct Rules {
    domains: HashMap<String, Node>,
    /// The files read, by name: what the directory held when this version was read.
    pub files: Vec<String>,
}

impl Rules {
    /// The tree of `domain`, if a file configures it.
    pub fn domain(&self, domain: &str) -> Option<&Node> {
        self.domains.get(domain)
    }

    /// How many domains are configured.
    pub fn domain_count(&self) -> usize {
        self.domains.len()
    }
}

/// A limit name made of the characters limit names allow: others become `_`, and long ones are
/// cut to 64 characters.
fn limit_name(text: &str) -> String {
    let name: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    if name.is_empty() {
        "_".to_owned()
    } else {
        name
    }
}

fn descriptor(
    errors: &mut Vec<ConfigError>,
    file: &str,
    path: &str,
    parent_keys: &str,
    raw: &RawDescriptor,
) -> (String, Node) {
    let push = |errors: &mut Vec<ConfigError>, field: &str, message: String| {
        errors.push(ConfigError {
            path: format!("{file}: {path}{field}"),
            message,
        });
    };
    if raw.key.is_empty() {
        push(errors, ".key", "must not be empty".to_owned());
    }
    let key_path = if parent_keys.is_empty() {
        raw.key.clone()
    } else {
        format!("{parent_keys}.{}", raw.key)
    };
    let mut node = Node::default();
    for (index, child) in raw.descriptors.iter().enumerate() {
        let child_path = format!("{path}.descriptors[{index}]");
        let (name, built) = descriptor(errors, file, &child_path, &key_path, child);
        if node.children.insert(name, built).is_some() {
            push(
                errors,
                &format!(".descriptors[{index}]"),
                "duplicate key and value at this level".to_owned(),
            );
        }
    }
    if let Some(rate_limit) = &raw.rate_limit {
        let unit = match rate_limit.unit.as_deref() {
            Some(text) => match Unit::parse(text) {
                Some(unit) => Some(unit),
                None => {
                    push(
                        errors,
                        ".rate_limit.unit",
                        format!(
                            "`{text}` is not a unit; expected second, minute, hour, day, week, month or year"
                        ),
                    );
                    None
                }
            },
            None if rate_limit.unlimited => Some(Unit::Second),
            None => {
                push(errors, ".rate_limit.unit", "is required".to_owned());
                None
            }
        };
        let requests = match rate_limit.requests_per_unit {
            Some(requests) if requests > u64::from(u32::MAX) => {
                push(
                    errors,
                    ".rate_limit.requests_per_unit",
                    format!("must be at most {}", u32::MAX),
                );
                None
            }
            Some(requests) => Some(requests),
            None if rate_limit.unlimited => Some(0),
            None => {
                push(
                    errors,
                    ".rate_limit.requests_per_unit",
                    "is required".to_owned(),
                );
                None
            }
        };
        let name = limit_name(rate_limit.name.as_deref().unwrap_or(&key_path));
        let algorithm = match raw.algorithm.as_deref().map(str::parse::<Algorithm>) {
            None => Some(Algorithm::FixedWindow),
            Some(Ok(Algorithm::Concurrency)) => {
                push(
                    errors,
                    ".algorithm",
                    "concurrency needs a release that the rate limit protocol has no call for"
                        .to_owned(),
                );
                None
            }
            Some(Ok(algorithm)) => Some(algorithm),
            Some(Err(error)) => {
                push(errors, ".algorithm", error.to_string());
                None
            }
        };
        if let (Some(unit), Some(requests), Some(algorithm)) = (unit, requests, algorithm) {
            let action = if rate_limit.unlimited {
                Some(Action::Unlimited)
            } else if requests == 0 {
                Some(Action::DenyAll)
            } else {
                let mut builder = Limit::builder(name.clone())
                    .algorithm(algorithm)
                    .limit(requests)
                    .window(unit.window());
                if let Some(burst) = raw.burst {
                    builder = builder.burst(burst);
                }
                match builder.build() {
                    Ok(limit) => Some(Action::Limited(Arc::new(limit))),
                    Err(error) => {
                        let field = match error.field() {
                            "limit" => ".rate_limit.requests_per_unit",
                            "window" => ".rate_limit.unit",
                            "burst" => ".burst",
                            "algorithm" => ".algorithm",
                            _ => ".rate_limit.name",
                        };
                        push(errors, field, error.problem());
                        None
                    }
                }
            };
            if let Some(action) = action {
                node.limit = Some(DescriptorLimit {
                    key_path: Arc::from(limit_name(&key_path)),
                    name: Arc::from(name),
                    requests_per_unit: u32::try_from(requests).unwrap_or(u32::MAX),
                    unit,
                    action,
                    shadow_mode: raw.shadow_mode,
                    replaces: rate_limit
                        .replaces
                        .iter()
                        .map(|replaced| Arc::from(limit_name(&replaced.name)))
                        .collect(),
                });
            }
        }
    } else if raw.burst.is_some() || raw.algorithm.is_some() {
        push(
            errors,
            "",
            "`algorithm` and `burst` need a `rate_limit` on the same descriptor".to_owned(),
        );
    }
    (child_key(&raw.key, raw.value.as_deref()), node)
}

/// Parses one domain file's text; `file` names it in errors.
pub fn parse_domain(file: &str, text: &str) -> Result<(String, Node), Vec<ConfigError>> {
    let whole = |message: String| {
        vec![ConfigError {
            path: file.to_owned(),
            message,
        }]
    };
    if text.len() > MAX_FILE_BYTES {
        return Err(whole(format!(
            "the file is {} bytes; the most a domain file may hold is {MAX_FILE_BYTES}",
            text.len()
        )));
    }
    let raw: RawDomain = crate::config::parse_yaml(text).map_err(|error| {
        vec![ConfigError {
            path: if error.path.is_empty() {
                file.to_owned()
            } else {
                format!("{file}: {}", error.path)
            },
            message: error.message,
        }]
    })?;
    let mut errors = Vec::new();
    if raw.domain.is_empty() {
        errors.push(ConfigError {
            path: format!("{file}: domain"),
            message: "must not be empty".to_owned(),
        });
    }
    let mut root = Node::default();
    for (index, raw_descriptor) in raw.descriptors.iter().enumerate() {
        let path = format!("descriptors[{index}]");
        let (name, node) = descriptor(&mut errors, file, &path, "", raw_descriptor);
        if root.children.insert(name, node).is_some() {
            errors.push(ConfigError {
                path: format!("{file}: {path}"),
                message: "duplicate key and value at this level".to_owned(),
            });
        }
    }
    if errors.is_empty() {
        Ok((raw.domain, root))
    } else {
        Err(errors)
    }
}

/// Reads every `*.yaml` / `*.yml` file of `directory` (hidden files, such as a Kubernetes
/// ConfigMap's `..data`, are skipped; files are read in name order). All or nothing: one bad
/// file, or two files of one domain, and every error is returned.
pub fn load_dir(directory: &Path) -> Result<Rules, Vec<ConfigError>> {
    let cannot = |message: String| {
        vec![ConfigError {
            path: directory.display().to_string(),
            message,
        }]
    };
    let entries = std::fs::read_dir(directory)
        .map_err(|error| cannot(format!("cannot read the directory: {error}")))?;
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter(|name| {
            !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"))
        })
        .collect();
    names.sort();
    let mut rules = Rules::default();
    let mut errors = Vec::new();
    let mut origin: HashMap<String, String> = HashMap::new();
    for name in &names {
        let text = match std::fs::read_to_string(directory.join(name)) {
            Ok(text) => text,
            Err(error) => {
                errors.push(ConfigError {
                    path: name.clone(),
                    message: format!("cannot read: {error}"),
                });
                continue;
            }
        };
        match parse_domain(name, &text) {
            Ok((domain, node)) => {
                if let Some(first) = origin.insert(domain.clone(), name.clone()) {
                    errors.push(ConfigError {
                        path: format!("{name}: domain"),
                        message: format!("`{domain}` is already configured by {first}"),
                    });
                }
                rules.domains.insert(domain, node);
            }
            Err(found) => errors.extend(found),
        }
    }
    rules.files = names;
    if errors.is_empty() {
        Ok(rules)
    } else {
        Err(errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit: { unit: second, requests_per_unit: 500 }
  - key: database
    value: default
    rate_limit: { unit: second, requests_per_unit: 500 }
  - key: remote_address
    rate_limit: { unit: second, requests_per_unit: 10 }
  - key: key1
    value: value1
    descriptors:
      - key: key2
        rate_limit: { unit: minute, requests_per_unit: 5, name: nested }
      - key: key2
        value: special
        rate_limit: { unlimited: true }
"#;

    fn find<'a>(node: &'a Node, entries: &[(&str, &str)]) -> Option<&'a DescriptorLimit> {
        node.find(entries.iter().copied())
    }

    #[test]
    fn the_most_specific_match_wins_and_unmatched_has_no_limit() {
        let (domain, root) = parse_domain("mongo.yaml", EXAMPLE).unwrap();
        assert_eq!(domain, "mongo_cps");
        let users = find(&root, &[("database", "users")]).unwrap();
        assert_eq!(users.requests_per_unit, 500);
        assert!(find(&root, &[("database", "other")]).is_none());
        let address = find(&root, &[("remote_address", "10.0.0.1")]).unwrap();
        assert_eq!(&*address.key_path, "remote_address");
        let nested = find(&root, &[("key1", "value1"), ("key2", "x")]).unwrap();
        assert_eq!(&*nested.name, "nested");
        assert_eq!(&*nested.key_path, "key1.key2");
        assert!(matches!(
            find(&root, &[("key1", "value1"), ("key2", "special")])
                .unwrap()
                .action,
            Action::Unlimited
        ));
        assert!(
            find(&root, &[("key1", "value1")]).is_none(),
            "no limit on the parent"
        );
        assert!(find(&root, &[]).is_none());
    }

    #[test]
    fn wildcard_values_match_by_prefix_after_exact_values() {
        let (_, root) = parse_domain(
            "wild.yaml",
            r#"
domain: wild
descriptors:
  - key: user
    value: "premium_*"
    rate_limit: { unit: second, requests_per_unit: 100, name: premium }
  - key: user
    value: "premium_gold_*"
    rate_limit: { unit: second, requests_per_unit: 1000, name: gold }
  - key: user
    value: premium_special
    rate_limit: { unit: second, requests_per_unit: 7, name: special }
  - key: user
    rate_limit: { unit: second, requests_per_unit: 10, name: anyone }
"#,
        )
        .unwrap();
        let name = |value: &str| {
            find(&root, &[("user", value)])
                .map(|limit| limit.name.to_string())
                .unwrap()
        };
        assert_eq!(name("premium_42"), "premium");
        assert_eq!(name("premium_gold_1"), "gold", "the longest prefix wins");
        assert_eq!(
            name("premium_special"),
            "special",
            "an exact value beats a wildcard"
        );
        assert_eq!(name("basic_1"), "anyone", "then the value-less key");
    }

    #[test]
    fn errors_name_the_file_and_the_field_path() {
        let text = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n  - key: b\n    algorithm: gcra\n    burst: 0\n    rate_limit: { unit: second, requests_per_unit: 1 }\n";
        let errors: Vec<String> = parse_domain("d.yaml", text)
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert!(
            errors.contains(&"d.yaml: descriptors[0].rate_limit.unit: `fortnight` is not a unit; expected second, minute, hour, day, week, month or year".to_owned()),
            "{errors:?}"
        );
        assert!(
            errors.contains(&"d.yaml: descriptors[1].burst: must be at least 1".to_owned()),
            "{errors:?}"
        );
        let unknown = parse_domain(
            "u.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    secret_field: hunter2\n",
        )
        .unwrap_err();
        let message = unknown[0].to_string();
        assert!(message.starts_with("u.yaml: descriptors[0]"), "{message}");
        assert!(!message.contains("hunter2"), "{message}");
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        for text in [
            "",
            "[",
            "domain: [1]",
            "domain: d\ndescriptors: 5",
            "\u{0}",
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: second, requests_per_unit: -1 }",
        ] {
            assert!(parse_domain("g.yaml", text).is_err(), "{text:?}");
        }
    }
}
