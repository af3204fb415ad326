//! envoyproxy/ratelimit's configuration format: a directory of YAML files, one `domain` each,
//! with nested `descriptors`. Parsed into a tree per domain that a request descriptor walks
//! entry by entry; every error names its file and field path
//! (`rls/api.yaml: descriptors[0].rate_limit.unit: ...`).

use floodgate::calendar::{CalendarPeriod, Period};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use floodgate::key::{KeyChars, key_part};
use floodgate::limit::LimitField;
use floodgate::{Algorithm, Limit};
use serde::Deserialize;

use crate::config::ConfigError;

/// The largest domain file read (far above any real one).
const MAX_FILE_BYTES: usize = 16 * 1024 * 1024;

/// A domain file as written. Unknown fields are errors, as in envoyproxy/ratelimit.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDomain {
    /// Missing or empty: refused with envoyproxy/ratelimit's reason.
    #[serde(default)]
    domain: Option<String>,
    /// May be empty, or `null` (`descriptors:` with nothing under it).
    #[serde(default)]
    descriptors: Option<Vec<RawDescriptor>>,
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
    descriptors: Option<Vec<RawDescriptor>>,
    #[serde(default)]
    shadow_mode: bool,
    /// A wildcard `value` whose matching values share one counter.
    #[serde(default)]
    share_threshold: bool,
    /// envoyproxy/ratelimit's allow-but-report mode: refused with the reason.
    #[serde(default)]
    quota_mode: bool,
    /// Accepted for compatibility, and deliberately without effect: floodgate never puts
    /// descriptor values in metric labels (they are client IPs, user ids, paths).
    #[serde(default)]
    #[allow(dead_code)]
    detailed_metric: bool,
    /// As `detailed_metric`.
    #[serde(default)]
    #[allow(dead_code)]
    value_to_metric: bool,
    /// envoyproxy/ratelimit's free-form descriptor metadata: accepted, not interpreted.
    #[serde(default)]
    #[allow(dead_code)]
    metadata: Option<serde_json::Value>,
    /// floodgate's addition (default `fixed_window`, as envoyproxy/ratelimit counts).
    #[serde(default)]
    algorithm: Option<String>,
    /// floodgate's addition, for the bucket algorithms.
    #[serde(default)]
    burst: Option<u64>,
    /// floodgate's addition: count a `day`, `week`, `month` or `year` unit on the calendar
    /// (a month from its billing day, 28 to 31 days) instead of envoyproxy/ratelimit's equal
    /// spans (a month of 30 days).
    #[serde(default)]
    calendar: Option<RawCalendar>,
    /// floodgate's addition: count every hit, past the limit too, as envoyproxy/ratelimit
    /// counts (for usage reported after the fact).
    #[serde(default)]
    count_every_hit: bool,
}

/// A descriptor's `calendar`: the unit's period in a time zone, with its anchor.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCalendar {
    #[serde(default)]
    time_zone: Option<String>,
    #[serde(default)]
    anchor: Option<String>,
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
pub(crate) enum Unit {
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
    pub(crate) fn window(self) -> Duration {
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

    /// The unit of the protocol's number (`RateLimitUnit`; `UNKNOWN`, 0, is none).
    pub(crate) fn from_proto(number: i32) -> Option<Unit> {
        Some(match number {
            1 => Unit::Second,
            2 => Unit::Minute,
            3 => Unit::Hour,
            4 => Unit::Day,
            5 => Unit::Month,
            6 => Unit::Year,
            7 => Unit::Week,
            _ => return None,
        })
    }

    /// The unit's name, as domain files write it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    /// The protocol's `RateLimit.Unit` number.
    pub(crate) fn proto(self) -> i32 {
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
pub(crate) enum Action {
    /// `unlimited: true`: answered `OK`, never counted.
    Unlimited,
    /// `requests_per_unit: 0`: every request is over the limit, nothing is counted.
    DenyAll,
    /// Counted against `limit`.
    Limited(Arc<Limit>),
}

/// The rate limit of one configured descriptor (or of Envoy's `limit` override).
#[derive(Clone, Debug)]
pub(crate) struct DescriptorLimit {
    /// The keys from the domain's root to this descriptor, joined by `.`: the metric's `limit`
    /// label (a path of keys, never a value).
    pub key_path: Arc<str>,
    /// `rate_limit.name` as configured: the response's `current_limit.name` (empty without
    /// one, as envoyproxy/ratelimit answers) and what `replaces` names.
    pub name: Option<Arc<str>>,
    /// `requests_per_unit`.
    pub requests_per_unit: u32,
    /// `unit`.
    pub unit: Unit,
    /// What a match does.
    pub action: Action,
    /// Counted, but always answered `OK`.
    pub shadow_mode: bool,
    /// `count_every_hit: true`: decided on its own, every hit counted even past the limit, and
    /// a descriptor's own `hits_addend: 0` a check that counts nothing.
    pub count_every_hit: bool,
    /// `rate_limit.replaces`: the names of limits this one sets aside when both match one
    /// request (those descriptors are answered `OK` and not counted).
    pub replaces: Vec<Arc<str>>,
}

impl DescriptorLimit {
    /// Whether it is decided on its own rather than in the request's all-or-nothing decision:
    /// in shadow mode (never enforced) or with `count_every_hit` (its hits count whatever the
    /// others decide).
    pub(crate) fn decided_apart(&self) -> bool {
        self.shadow_mode || self.count_every_hit
    }

    /// The counter's name in storage keys and `RateLimit` headers (`name`, else the key path;
    /// an override's own): the name of the limit it applies, if it applies one.
    #[cfg(test)]
    pub(crate) fn counter_name(&self) -> Option<&str> {
        match &self.action {
            Action::Limited(limit) => Some(limit.name()),
            Action::DenyAll | Action::Unlimited => None,
        }
    }
}

/// One level of a domain's descriptor tree.
#[derive(Debug, Default)]
pub(crate) struct Node {
    /// Children by `key` (value-less) or `key` + `\0` + `value`.
    children: HashMap<String, Node>,
    /// The children whose `value` holds a `*`, in the order the file declares them: the first
    /// that matches wins (envoyproxy/ratelimit's order). Each with its key, and its value
    /// split on `*`.
    wildcards: Vec<Wildcard>,
    limit: Option<DescriptorLimit>,
    /// `share_threshold`: this node's wildcard value, which stands for every value it matches
    /// in the counter's identity.
    shared_value: Option<Arc<str>>,
}

#[derive(Debug)]
struct Wildcard {
    /// The child's key in `children`.
    child: String,
    key: String,
    /// The value split on `*`: each `*` matches any run of characters, possibly empty.
    parts: Vec<String>,
}

impl Wildcard {
    fn matches(&self, key: &str, value: &str) -> bool {
        if key != self.key {
            return false;
        }
        let (first, rest) = match self.parts.split_first() {
            Some(split) => split,
            None => return false,
        };
        let Some(last) = rest.last() else {
            return value == first;
        };
        let fixed: usize = self.parts.iter().map(String::len).sum();
        if value.len() < fixed
            || !value.starts_with(first.as_str())
            || !value.ends_with(last.as_str())
        {
            return false;
        }
        // The middle parts, in order, between the first and the last.
        let mut middle = &value[first.len()..value.len() - last.len()];
        for part in &rest[..rest.len() - 1] {
            match middle.find(part.as_str()) {
                Some(at) => middle = &middle[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

/// The limit a request descriptor matched, and the values standing for its entries'.
#[derive(Debug)]
pub(crate) struct Match<'a> {
    /// The matched descriptor's limit.
    pub limit: &'a DescriptorLimit,
    /// Per entry of the request descriptor: the `share_threshold` wildcard value it matched,
    /// which counts for the entry's own value in the counter's identity (so every matching
    /// value shares one counter), or `None`.
    pub shared_values: Vec<Option<&'a str>>,
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
    pub(crate) fn find<'a, 'e>(
        &'a self,
        entries: impl Iterator<Item = (&'e str, &'e str)>,
    ) -> Option<Match<'a>> {
        let mut node = self;
        let mut shared_values = Vec::new();
        for (key, value) in entries {
            let (next, shared) = match node.children.get(&child_key(key, Some(value))) {
                Some(exact) => (exact, None),
                None => match node.wildcard_child(key, value) {
                    Some(wild) => (wild, wild.shared_value.as_deref()),
                    None => (node.children.get(key)?, None),
                },
            };
            shared_values.push(shared);
            node = next;
        }
        Some(Match {
            limit: node.limit.as_ref()?,
            shared_values,
        })
    }

    /// The first child, in the file's order, whose wildcard `value` matches (`*` anywhere,
    /// any number of them, as envoyproxy/ratelimit matches). Tried after the exact value,
    /// before the value-less key.
    fn wildcard_child(&self, key: &str, value: &str) -> Option<&Node> {
        self.wildcards
            .iter()
            .find(|wildcard| wildcard.matches(key, value))
            .and_then(|wildcard| self.children.get(&wildcard.child))
    }

    /// Adds a built child under `name`; `false` if the name was taken.
    fn adopt(&mut self, name: String, child: Node, wildcard: Option<(String, &str)>) -> bool {
        if self.children.contains_key(&name) {
            return false;
        }
        if let Some((key, value)) = wildcard {
            self.wildcards.push(Wildcard {
                child: name.clone(),
                key,
                parts: value.split('*').map(str::to_owned).collect(),
            });
        }
        self.children.insert(name, child);
        true
    }
}

/// Every domain's rules, as one version of the directory.
#[derive(Debug, Default)]
pub(crate) struct Rules {
    domains: HashMap<String, Node>,
    /// The files read, by name: what the directory held when this version was read.
    pub files: Vec<String>,
}

impl Rules {
    /// The tree of `domain`, if a file configures it.
    pub(crate) fn domain(&self, domain: &str) -> Option<&Node> {
        self.domains.get(domain)
    }

    /// How many domains are configured.
    pub(crate) fn domain_count(&self) -> usize {
        self.domains.len()
    }

    /// The configured domains' names, sorted.
    pub(crate) fn domain_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }
}

impl DescriptorLimit {
    /// The limit of Envoy's per-descriptor override (`requests_per_unit` per `unit`, from route
    /// metadata): a fixed window, as envoyproxy/ratelimit counts it, never shadowed, without a
    /// configured name; its counter is its own (`override_<n>_per_<unit>`), so each override
    /// value counts apart from the file's limit and from other overrides.
    pub(crate) fn from_override(requests_per_unit: u32, unit: Unit) -> Option<DescriptorLimit> {
        let counter_name = format!("override_{requests_per_unit}_per_{}", unit.as_str());
        let action = if requests_per_unit == 0 {
            Action::DenyAll
        } else {
            Action::Limited(Arc::new(
                Limit::fixed_window(counter_name, u64::from(requests_per_unit), unit.window())
                    .ok()?,
            ))
        };
        Some(DescriptorLimit {
            key_path: Arc::from("override"),
            name: None,
            requests_per_unit,
            unit,
            action,
            shadow_mode: false,
            count_every_hit: false,
            replaces: Vec::new(),
        })
    }
}

/// A limit name made of the characters limit names allow: others become `_`, and long ones are
/// cut to 64 characters.
fn limit_name(text: &str) -> String {
    // Every character is ASCII once made a name's: cutting at a byte cuts at a character.
    let mut name = key_part(text, KeyChars::Name);
    name.truncate(64);
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
    let at = At { file, path };
    if raw.key.is_empty() {
        at.push(errors, ".key", "must not be empty".to_owned());
    }
    let key_path = if parent_keys.is_empty() {
        raw.key.clone()
    } else {
        format!("{parent_keys}.{}", raw.key)
    };
    if raw.quota_mode {
        at.push(
            errors,
            ".quota_mode",
            "is not supported: floodgate enforces a limit or, with shadow_mode: true, counts it without enforcing (shadow_limited in its metrics)".to_owned(),
        );
    }
    let mut node = Node::default();
    let wildcard = raw.value.as_deref().filter(|value| value.contains('*'));
    if raw.share_threshold {
        match wildcard {
            Some(value) => node.shared_value = Some(Arc::from(value)),
            None => at.push(
                errors,
                ".share_threshold",
                format!(
                    "share_threshold can only be used with wildcard values (containing '*'), but found key '{}'",
                    envoy_key(&raw.key, raw.value.as_deref())
                ),
            ),
        }
    }
    add_children(
        errors,
        file,
        path,
        &key_path,
        raw.descriptors.as_deref().unwrap_or_default(),
        &mut node,
    );
    if let Some(rate_limit) = &raw.rate_limit {
        node.limit = descriptor_limit(at, errors, raw, rate_limit, &key_path);
    } else if raw.burst.is_some() || raw.algorithm.is_some() || raw.count_every_hit {
        at.push(
            errors,
            "",
            "`algorithm`, `burst` and `count_every_hit` need a `rate_limit` on the same descriptor"
                .to_owned(),
        );
    }
    (child_key(&raw.key, raw.value.as_deref()), node)
}

/// Where a descriptor is in its file, for its errors' paths.
#[derive(Clone, Copy)]
struct At<'a> {
    file: &'a str,
    path: &'a str,
}

impl At<'_> {
    /// An error at `field` of this descriptor.
    fn push(self, errors: &mut Vec<ConfigError>, field: &str, message: String) {
        errors.push(ConfigError {
            path: format!("{}: {}{field}", self.file, self.path),
            message,
        });
    }
}

/// A descriptor's `rate_limit` (with its `algorithm` and `burst`), checked as
/// envoyproxy/ratelimit checks it; `None` where it has errors (pushed).
fn descriptor_limit(
    at: At<'_>,
    errors: &mut Vec<ConfigError>,
    raw: &RawDescriptor,
    rate_limit: &RawRateLimit,
    key_path: &str,
) -> Option<DescriptorLimit> {
    if rate_limit.unlimited && rate_limit.unit.is_some() {
        at.push(
            errors,
            ".rate_limit.unit",
            "should not specify rate limit unit when unlimited".to_owned(),
        );
    }
    for (index, replaced) in rate_limit.replaces.iter().enumerate() {
        let field = format!(".rate_limit.replaces[{index}].name");
        if replaced.name.is_empty() {
            at.push(
                errors,
                &field,
                "should not have an empty replaces entry".to_owned(),
            );
        } else if rate_limit.name.as_deref() == Some(replaced.name.as_str()) {
            at.push(
                errors,
                &field,
                "replaces should not contain name of same descriptor".to_owned(),
            );
        }
    }
    let unit = rate_limit_unit(at, errors, rate_limit);
    let requests = requests_per_unit(at, errors, rate_limit);
    let counter_name = limit_name(rate_limit.name.as_deref().unwrap_or(key_path));
    let algorithm = descriptor_algorithm(at, errors, raw);
    let (unit, requests, algorithm) = (unit?, requests?, algorithm?);
    if raw.count_every_hit {
        count_every_hit_fits(at, errors, rate_limit, algorithm)?;
    }
    let action = if rate_limit.unlimited {
        Action::Unlimited
    } else if requests == 0 {
        Action::DenyAll
    } else {
        let mut builder = Limit::builder(counter_name.clone())
            .algorithm(algorithm)
            .limit(requests);
        builder = match &raw.calendar {
            Some(calendar) => builder.calendar(calendar_period(at, errors, unit, calendar)?),
            None => builder.window(unit.window()),
        };
        if let Some(burst) = raw.burst {
            builder = builder.burst(burst);
        }
        match builder.build() {
            Ok(limit) => Action::Limited(Arc::new(limit)),
            Err(error) => {
                let field = match error.field() {
                    LimitField::Limit => ".rate_limit.requests_per_unit",
                    LimitField::Window => ".rate_limit.unit",
                    LimitField::Burst => ".burst",
                    LimitField::Algorithm | LimitField::Period => ".algorithm",
                    LimitField::Name | LimitField::Cost => ".rate_limit.name",
                };
                at.push(errors, field, error.problem());
                return None;
            }
        }
    };
    Some(DescriptorLimit {
        key_path: Arc::from(limit_name(key_path)),
        name: rate_limit.name.as_deref().map(Arc::from),
        requests_per_unit: u32::try_from(requests).unwrap_or(u32::MAX),
        unit,
        action,
        shadow_mode: raw.shadow_mode,
        count_every_hit: raw.count_every_hit,
        replaces: rate_limit
            .replaces
            .iter()
            .map(|replaced| Arc::from(replaced.name.as_str()))
            .collect(),
    })
}

/// Whether `count_every_hit` can hold on this limit; `None` where it cannot (pushed).
fn count_every_hit_fits(
    at: At<'_>,
    errors: &mut Vec<ConfigError>,
    rate_limit: &RawRateLimit,
    algorithm: Algorithm,
) -> Option<()> {
    let problem = if rate_limit.unlimited {
        "has nothing to count on an unlimited descriptor"
    } else {
        match algorithm {
            // Every hit past the limit would be one more entry in the log, without bound.
            Algorithm::SlidingWindowLog => {
                "cannot count past the limit of a sliding_window_log (an entry per hit, without bound); use sliding_window_counter"
            }
            // A queue of requests that wait their turn: hits past it wait for nothing.
            Algorithm::LeakyBucket => {
                "cannot count past the limit of a leaky_bucket (it queues requests); use token_bucket"
            }
            _ => return Some(()),
        }
    };
    at.push(errors, ".count_every_hit", problem.to_owned());
    None
}

/// A descriptor's `calendar`: its unit (`day`, `week`, `month`, `year`) as a calendar period.
fn calendar_period(
    at: At<'_>,
    errors: &mut Vec<ConfigError>,
    unit: Unit,
    raw: &RawCalendar,
) -> Option<CalendarPeriod> {
    let period = match unit {
        Unit::Day => Period::Day,
        Unit::Week => Period::Week,
        Unit::Month => Period::Month,
        Unit::Year => Period::Year,
        Unit::Second | Unit::Minute | Unit::Hour => {
            at.push(
                errors,
                ".calendar",
                "counts a day, week, month or year unit only".to_owned(),
            );
            return None;
        }
    };
    let zone = raw.time_zone.as_deref().unwrap_or("UTC");
    let calendar = CalendarPeriod::new(period, zone)
        .map_err(|error| at.push(errors, ".calendar.time_zone", error.to_string()))
        .ok()?;
    match &raw.anchor {
        Some(anchor) => calendar
            .anchored(anchor)
            .map_err(|error| at.push(errors, ".calendar.anchor", error.to_string()))
            .ok(),
        None => Some(calendar),
    }
}

/// `rate_limit.unit`: required unless `unlimited`.
fn rate_limit_unit(
    at: At<'_>,
    errors: &mut Vec<ConfigError>,
    rate_limit: &RawRateLimit,
) -> Option<Unit> {
    match rate_limit.unit.as_deref() {
        Some(text) => {
            let unit = Unit::parse(text);
            if unit.is_none() {
                at.push(
                    errors,
                    ".rate_limit.unit",
                    format!(
                        "`{text}` is not a unit; expected second, minute, hour, day, week, month or year"
                    ),
                );
            }
            unit
        }
        None if rate_limit.unlimited => Some(Unit::Second),
        None => {
            at.push(errors, ".rate_limit.unit", "is required".to_owned());
            None
        }
    }
}

/// `rate_limit.requests_per_unit`: at most `u32::MAX`, required unless `unlimited`.
fn requests_per_unit(
    at: At<'_>,
    errors: &mut Vec<ConfigError>,
    rate_limit: &RawRateLimit,
) -> Option<u64> {
    match rate_limit.requests_per_unit {
        Some(requests) if requests > u64::from(u32::MAX) => {
            at.push(
                errors,
                ".rate_limit.requests_per_unit",
                format!("must be at most {}", u32::MAX),
            );
            None
        }
        Some(requests) => Some(requests),
        None if rate_limit.unlimited => Some(0),
        None => {
            at.push(
                errors,
                ".rate_limit.requests_per_unit",
                "is required".to_owned(),
            );
            None
        }
    }
}

/// The descriptor's `algorithm` (a fixed window by default); `concurrency` has no place in
/// the rate limit protocol.
fn descriptor_algorithm(
    at: At<'_>,
    errors: &mut Vec<ConfigError>,
    raw: &RawDescriptor,
) -> Option<Algorithm> {
    match raw.algorithm.as_deref().map(str::parse::<Algorithm>) {
        None => Some(Algorithm::FixedWindow),
        Some(Ok(Algorithm::Concurrency)) => {
            at.push(
                errors,
                ".algorithm",
                "concurrency needs a release that the rate limit protocol has no call for"
                    .to_owned(),
            );
            None
        }
        Some(Ok(algorithm)) => Some(algorithm),
        Some(Err(error)) => {
            at.push(errors, ".algorithm", error.to_string());
            None
        }
    }
}

/// envoyproxy/ratelimit's composite key of a descriptor, `key_value` (or `key`), as its
/// messages name it.
fn envoy_key(key: &str, value: Option<&str>) -> String {
    match value {
        Some(value) => format!("{key}_{value}"),
        None => key.to_owned(),
    }
}

/// Builds `raws` (the descriptors at `path`, under the keys `key_path`) into `node`'s
/// children; a key and value already there is an error (as a second file of a merged domain
/// may bring).
fn add_children(
    errors: &mut Vec<ConfigError>,
    file: &str,
    path: &str,
    key_path: &str,
    raws: &[RawDescriptor],
    node: &mut Node,
) {
    let prefix = if path.is_empty() {
        String::new()
    } else {
        format!("{path}.")
    };
    for (index, raw) in raws.iter().enumerate() {
        let child_path = format!("{prefix}descriptors[{index}]");
        let (name, built) = descriptor(errors, file, &child_path, key_path, raw);
        let wildcard = raw
            .value
            .as_deref()
            .filter(|value| value.contains('*'))
            .map(|value| (raw.key.clone(), value));
        if !node.adopt(name, built, wildcard) {
            let composite = if key_path.is_empty() {
                envoy_key(&raw.key, raw.value.as_deref())
            } else {
                format!("{key_path}.{}", envoy_key(&raw.key, raw.value.as_deref()))
            };
            errors.push(ConfigError {
                path: format!("{file}: {child_path}"),
                message: format!("duplicate descriptor composite key '{composite}'"),
            });
        }
    }
}

/// Parses one domain file's text; `file` names it in errors.
pub(crate) fn parse_domain(file: &str, text: &str) -> Result<(String, Node), Vec<ConfigError>> {
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
    let domain = raw.domain.unwrap_or_default();
    if domain.is_empty() {
        errors.push(ConfigError {
            path: format!("{file}: domain"),
            message: "config file cannot have empty domain".to_owned(),
        });
    }
    let mut root = Node::default();
    add_children(
        &mut errors,
        file,
        "",
        "",
        raw.descriptors.as_deref().unwrap_or_default(),
        &mut root,
    );
    if errors.is_empty() {
        Ok((domain, root))
    } else {
        Err(errors)
    }
}

/// Merges `node`, a later file's tree of a domain that an earlier file began
/// (`rls.merge_domains`), into `into`: a key and value already there is an error naming
/// `file`. Wildcards keep their order: the earlier file's first, then this one's.
fn merge_into(file: &str, node: Node, into: &mut Node) -> Result<(), Vec<ConfigError>> {
    let Node {
        mut children,
        wildcards,
        ..
    } = node;
    let mut errors = Vec::new();
    let mut graft = |name: String, child: Node, wildcard: Option<Wildcard>| {
        if into.children.contains_key(&name) {
            let (key, value) = match name.split_once('\0') {
                Some((key, value)) => (key, Some(value)),
                None => (name.as_str(), None),
            };
            errors.push(ConfigError {
                path: format!("{file}: descriptors"),
                message: format!(
                    "duplicate descriptor composite key '{}' (another file of this domain configures it)",
                    envoy_key(key, value)
                ),
            });
            return;
        }
        into.wildcards.extend(wildcard);
        into.children.insert(name, child);
    };
    for wildcard in wildcards {
        if let Some(child) = children.remove(&wildcard.child) {
            graft(wildcard.child.clone(), child, Some(wildcard));
        }
    }
    let mut rest: Vec<(String, Node)> = children.into_iter().collect();
    rest.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, child) in rest {
        graft(name, child, None);
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// Reads every `*.yaml` / `*.yml` file of `directory` (hidden files, such as a Kubernetes
/// ConfigMap's `..data`, are skipped; files are read in name order). All or nothing: one bad
/// file, or two files of one domain (unless `merge_domains`, envoyproxy/ratelimit's
/// `MERGE_DOMAIN_CONFIG`: then their descriptors are merged, a descriptor in both an error),
/// and every error is returned.
pub(crate) fn load_dir(directory: &Path, merge_domains: bool) -> Result<Rules, Vec<ConfigError>> {
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
            Ok((domain, node)) => match origin.get(&domain) {
                None => {
                    origin.insert(domain.clone(), name.clone());
                    rules.domains.insert(domain, node);
                }
                Some(_) if merge_domains => {
                    let into = rules.domains.get_mut(&domain).expect("configured");
                    if let Err(found) = merge_into(name, node, into) {
                        errors.extend(found);
                    }
                }
                Some(first) => errors.push(ConfigError {
                    path: format!("{name}: domain"),
                    message: format!(
                        "duplicate domain '{domain}' in config file (also in {first}; set rls.merge_domains: true to merge them)"
                    ),
                }),
            },
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
        node.find(entries.iter().copied()).map(|found| found.limit)
    }

    fn errors_of(text: &str) -> Vec<String> {
        parse_domain("t.yaml", text)
            .err()
            .unwrap_or_default()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn a_descriptor_may_count_its_unit_on_the_calendar() {
        let (_, root) = parse_domain(
            "quota.yaml",
            r#"
domain: quota
descriptors:
  - key: tenant
    rate_limit: { unit: month, requests_per_unit: 10000 }
    calendar: { time_zone: Europe/Lisbon, anchor: "15" }
  - key: plain
    rate_limit: { unit: month, requests_per_unit: 10000 }
"#,
        )
        .unwrap();
        let limit = |key: &str| match &find(&root, &[(key, "x")]).unwrap().action {
            Action::Limited(limit) => limit.clone(),
            _ => panic!("a limit"),
        };
        let tenant = limit("tenant");
        let calendar = tenant.calendar().expect("on the calendar");
        assert_eq!(calendar.to_string(), "month from day 15 (Europe/Lisbon)");
        // 2026-12-02T10:00:00Z: the period began on November 15 at midnight in Lisbon (UTC+0
        // in winter) and ends on December 15.
        let (start, end) = tenant.window_bounds(1_796_205_600_000_000);
        assert_eq!((start, end), (1_794_700_800_000_000, 1_797_292_800_000_000));
        // Without `calendar`, a month stays envoyproxy/ratelimit's 30 days from the epoch.
        let plain = limit("plain");
        assert!(plain.calendar().is_none());
        assert_eq!(plain.window(), Duration::from_secs(30 * 86_400));

        let errors = errors_of(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n    calendar: {}\n  - key: b\n    rate_limit: { unit: day, requests_per_unit: 1 }\n    calendar: { time_zone: Mars/Base }\n  - key: c\n    rate_limit: { unit: month, requests_per_unit: 1 }\n    calendar: { anchor: \"40\" }\n  - key: e\n    rate_limit: { unit: month, requests_per_unit: 1 }\n    calendar: {}\n    algorithm: token_bucket\n",
        );
        for expected in [
            "descriptors[0].calendar: counts a day, week, month or year unit only",
            "descriptors[1].calendar.time_zone: `Mars/Base` is not a time zone",
            "descriptors[2].calendar.anchor: the billing day of a month is 1 to 31, not 40",
            "descriptors[3].algorithm: counts fixed_window limits only, not token_bucket",
        ] {
            assert!(
                errors.iter().any(|error| error.contains(expected)),
                "{expected} in {errors:?}"
            );
        }
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
        assert_eq!(nested.name.as_deref(), Some("nested"));
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
    fn wildcard_values_match_in_the_files_order_after_exact_values() {
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
                .and_then(|limit| limit.name.as_deref().map(str::to_owned))
                .unwrap()
        };
        assert_eq!(name("premium_42"), "premium");
        assert_eq!(
            name("premium_gold_1"),
            "premium",
            "the first wildcard in the file wins, as envoyproxy/ratelimit matches"
        );
        assert_eq!(
            name("premium_special"),
            "special",
            "an exact value beats a wildcard"
        );
        assert_eq!(name("basic_1"), "anyone", "then the value-less key");
    }

    /// envoyproxy/ratelimit's `test/config/wildcard.yaml`, and what its tests match.
    #[test]
    fn wildcards_match_anywhere_in_the_value() {
        let (_, root) = parse_domain(
            "wildcard.yaml",
            r#"
domain: test-domain
descriptors:
  - { key: wild, value: foo*, rate_limit: { unit: minute, requests_per_unit: 20 } }
  - { key: noWild, value: foo, rate_limit: { unit: minute, requests_per_unit: 20 } }
  - { key: noVal, rate_limit: { unit: minute, requests_per_unit: 20 } }
  - { key: midWild, value: bar*b, rate_limit: { unit: minute, requests_per_unit: 20 } }
  - { key: multiWild, value: foo*bar*baz, rate_limit: { unit: minute, requests_per_unit: 10 } }
  - key: nestedWild
    value: val1
    descriptors:
      - { key: wild, value: goo*, rate_limit: { unit: minute, requests_per_unit: 20 } }
"#,
        )
        .unwrap();
        let matches = |key: &str, value: &str| find(&root, &[(key, value)]).is_some();
        for value in ["foo", "foo1", "foobar"] {
            assert!(matches("wild", value), "wild {value}");
        }
        assert!(!matches("wild", "fo") && !matches("wild", "xfoo"));
        assert!(matches("noWild", "foo") && !matches("noWild", "foo1"));
        assert!(matches("noVal", "anything"));
        for value in ["barb", "barab", "bar-xyz-b"] {
            assert!(matches("midWild", value), "midWild {value}");
        }
        for value in ["bab", "barbx", "xbarb"] {
            assert!(!matches("midWild", value), "midWild {value}");
        }
        for value in ["foobarbaz", "foo1bar2baz", "foo-bar--baz"] {
            assert!(matches("multiWild", value), "multiWild {value}");
        }
        for value in ["foobaz", "foobazbar", "fobarbaz"] {
            assert!(!matches("multiWild", value), "multiWild {value}");
        }
        assert_eq!(
            find(&root, &[("nestedWild", "val1"), ("wild", "goo1")])
                .map(|limit| limit.requests_per_unit),
            Some(20)
        );
        assert!(find(&root, &[("nestedWild", "val1"), ("wild", "foo1")]).is_none());
    }

    #[test]
    fn share_threshold_makes_matching_values_one_counter_and_needs_a_wildcard() {
        let (_, root) = parse_domain(
            "share.yaml",
            r#"
domain: test-domain
descriptors:
  - { key: files, value: files/*, share_threshold: true, rate_limit: { unit: minute, requests_per_unit: 100 } }
  - key: path
    value: path/*
    share_threshold: true
    descriptors:
      - key: file
        value: file/*
        descriptors:
          - { key: type, rate_limit: { unit: minute, requests_per_unit: 3 } }
  - { key: other, value: o*, rate_limit: { unit: minute, requests_per_unit: 5 } }
"#,
        )
        .unwrap();
        let shared = |entries: &[(&str, &str)]| {
            root.find(entries.iter().copied())
                .unwrap()
                .shared_values
                .into_iter()
                .map(|value| value.map(str::to_owned))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            shared(&[("files", "files/a")]),
            [Some("files/*".to_owned())]
        );
        assert_eq!(
            shared(&[("path", "path/x"), ("file", "file/y"), ("type", "t")]),
            [Some("path/*".to_owned()), None, None],
            "tracked at a level without a limit, and only where share_threshold is set"
        );
        assert_eq!(shared(&[("other", "o1")]), [None]);
        let errors = errors_of(
            "domain: d\ndescriptors:\n  - { key: k, value: plain, share_threshold: true, rate_limit: { unit: second, requests_per_unit: 1 } }\n",
        );
        assert_eq!(
            errors,
            [
                "t.yaml: descriptors[0].share_threshold: share_threshold can only be used with wildcard values (containing '*'), but found key 'k_plain'"
            ]
        );
    }

    #[test]
    fn count_every_hit_is_refused_where_it_cannot_hold() {
        let cases = [
            (
                "domain: d\ndescriptors:\n  - { key: k, count_every_hit: true, algorithm: sliding_window_log, rate_limit: { unit: second, requests_per_unit: 1 } }\n",
                "t.yaml: descriptors[0].count_every_hit: cannot count past the limit of a sliding_window_log (an entry per hit, without bound); use sliding_window_counter",
            ),
            (
                "domain: d\ndescriptors:\n  - { key: k, count_every_hit: true, algorithm: leaky_bucket, rate_limit: { unit: second, requests_per_unit: 1 } }\n",
                "t.yaml: descriptors[0].count_every_hit: cannot count past the limit of a leaky_bucket (it queues requests); use token_bucket",
            ),
            (
                "domain: d\ndescriptors:\n  - { key: k, count_every_hit: true, rate_limit: { unlimited: true } }\n",
                "t.yaml: descriptors[0].count_every_hit: has nothing to count on an unlimited descriptor",
            ),
            (
                "domain: d\ndescriptors:\n  - { key: k, count_every_hit: true }\n",
                "t.yaml: descriptors[0]: `algorithm`, `burst` and `count_every_hit` need a `rate_limit` on the same descriptor",
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(errors_of(text), [expected], "{text:?}");
        }
        let (_, root) = parse_domain(
            "ok.yaml",
            "domain: d\ndescriptors:\n  - { key: k, count_every_hit: true, algorithm: token_bucket, rate_limit: { unit: second, requests_per_unit: 1 } }\n",
        )
        .unwrap();
        assert!(find(&root, &[("k", "v")]).unwrap().count_every_hit);
    }

    #[test]
    fn envoyproxy_ratelimits_validation_rules() {
        // Accepted: an empty or null descriptor list, metadata, value_to_metric, detailed_metric.
        for text in [
            "domain: d\ndescriptors: []\n",
            "domain: d\ndescriptors:\n",
            "domain: d\n",
            "domain: d\ndescriptors:\n  - key: k\n    value_to_metric: true\n    detailed_metric: true\n    metadata: { name: service_1, nested: { a: [1, 2] } }\n    rate_limit: { unit: second, requests_per_unit: 5 }\n",
        ] {
            assert!(parse_domain("ok.yaml", text).is_ok(), "{text:?}");
        }
        let cases = [
            (
                "descriptors: []\n",
                "t.yaml: domain: config file cannot have empty domain",
            ),
            (
                "domain: d\ndescriptors:\n  - { key: k, quota_mode: true, rate_limit: { unit: second, requests_per_unit: 1 } }\n",
                "t.yaml: descriptors[0].quota_mode: is not supported: floodgate enforces a limit or, with shadow_mode: true, counts it without enforcing (shadow_limited in its metrics)",
            ),
            (
                "domain: \"\"\n",
                "t.yaml: domain: config file cannot have empty domain",
            ),
            (
                "domain: d\ndescriptors:\n  - { key: k, rate_limit: { unlimited: true, unit: second } }\n",
                "t.yaml: descriptors[0].rate_limit.unit: should not specify rate limit unit when unlimited",
            ),
            (
                "domain: d\ndescriptors:\n  - { key: k, rate_limit: { unit: second, requests_per_unit: 1, name: a, replaces: [ { name: a } ] } }\n",
                "t.yaml: descriptors[0].rate_limit.replaces[0].name: replaces should not contain name of same descriptor",
            ),
            (
                "domain: d\ndescriptors:\n  - { key: k, rate_limit: { unit: second, requests_per_unit: 1, replaces: [ { name: \"\" } ] } }\n",
                "t.yaml: descriptors[0].rate_limit.replaces[0].name: should not have an empty replaces entry",
            ),
            (
                "domain: d\ndescriptors:\n  - { key: k, value: v }\n  - { key: k, value: v }\n",
                "t.yaml: descriptors[1]: duplicate descriptor composite key 'k_v'",
            ),
        ];
        for (text, expected) in cases {
            let errors = errors_of(text);
            assert!(
                errors.iter().any(|error| error == expected),
                "{text:?}: {errors:?}"
            );
        }
        // A limit without a name answers with none (`current_limit.name` empty); its counter
        // is still named by its key path.
        let (_, root) = parse_domain(
            "n.yaml",
            "domain: d\ndescriptors:\n  - { key: a, descriptors: [ { key: b, rate_limit: { unit: second, requests_per_unit: 1 } } ] }\n",
        )
        .unwrap();
        let limit = find(&root, &[("a", "x"), ("b", "y")]).unwrap();
        assert_eq!(limit.name, None);
        assert_eq!(limit.counter_name(), Some("a.b"));
    }

    #[test]
    fn several_files_of_one_domain_are_refused_unless_merged() {
        let directory = std::env::temp_dir().join(format!(
            "floodgate-rls-merge-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&directory).unwrap();
        let write = |name: &str, text: &str| std::fs::write(directory.join(name), text).unwrap();
        write(
            "a.yaml",
            "domain: api\ndescriptors:\n  - { key: k1, rate_limit: { unit: second, requests_per_unit: 1 } }\n  - { key: w, value: a*, rate_limit: { unit: second, requests_per_unit: 1, name: first } }\n",
        );
        write(
            "b.yaml",
            "domain: api\ndescriptors:\n  - { key: k2, rate_limit: { unit: second, requests_per_unit: 2 } }\n  - { key: w, value: ab*, rate_limit: { unit: second, requests_per_unit: 1, name: second } }\n",
        );
        let refused: Vec<String> = load_dir(&directory, false)
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(
            refused[0].starts_with("b.yaml: domain: duplicate domain 'api' in config file"),
            "{refused:?}"
        );
        let merged = load_dir(&directory, true).unwrap();
        let api = merged.domain("api").unwrap();
        assert_eq!(find(api, &[("k1", "x")]).unwrap().requests_per_unit, 1);
        assert_eq!(find(api, &[("k2", "x")]).unwrap().requests_per_unit, 2);
        assert_eq!(
            find(api, &[("w", "abc")]).unwrap().name.as_deref(),
            Some("first"),
            "the earlier file's wildcards come first"
        );
        // The same descriptor in both: refused, merged or not.
        write(
            "c.yaml",
            "domain: api\ndescriptors:\n  - { key: k1, rate_limit: { unit: second, requests_per_unit: 9 } }\n",
        );
        let collision: Vec<String> = load_dir(&directory, true)
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert!(
            collision.iter().any(|error| error
                .starts_with("c.yaml: descriptors: duplicate descriptor composite key 'k1'")),
            "{collision:?}"
        );
        let _ = std::fs::remove_dir_all(&directory);
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
