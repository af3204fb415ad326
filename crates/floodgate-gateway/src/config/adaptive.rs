//! `adaptive_concurrency:`: shedding when an upstream slows down (SPEC §11), one limit per
//! upstream, requests classed by a trusted header, their route or their plan.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use floodgate::adaptive::{AdaptiveConcurrencyLayer, AdaptiveLimiter, Class, GradientSettings};
use http::HeaderName;
use serde::{Deserialize, Serialize};

use super::duration::parse_duration;
use super::errors::Errors;

/// `adaptive_concurrency:`, as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawAdaptive {
    /// Compute and report, refuse nothing.
    pub shadow: bool,
    /// The classes, highest first.
    pub classes: Vec<RawClass>,
    /// The class of a request nothing places (the lowest if absent).
    pub default_class: Option<String>,
    /// A header naming the request's class, set by a trusted hop in front of the gateway.
    pub class_header: Option<String>,
    /// The class of each plan's clients.
    pub plan_classes: BTreeMap<String, String>,
    /// The most of its class one client may hold once the class is half full.
    pub client_share: f64,
    /// The controller's settings.
    pub initial_limit: u32,
    /// The lowest limit.
    pub min_limit: u32,
    /// The highest limit.
    pub max_limit: u32,
    /// The latency percentile sampled.
    pub percentile: f64,
    /// The share above the minimum round trip that counts as no queueing.
    pub buffer: f64,
    /// A sampled latency at or below it never shrinks the limit.
    pub latency_floor: String,
    /// The shortest sampling window.
    pub window: String,
    /// The fewest answers a window needs.
    pub min_samples: usize,
}

/// One class, as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawClass {
    /// Its name.
    pub name: String,
    /// The share of the limit classes below it never take.
    #[serde(default)]
    pub reserve: f64,
    /// How long a request that finds the class full waits for a place (none if absent).
    #[serde(default)]
    pub wait: Option<String>,
}

impl Default for RawAdaptive {
    fn default() -> Self {
        let gradient = GradientSettings::default();
        RawAdaptive {
            shadow: false,
            classes: Vec::new(),
            default_class: None,
            class_header: None,
            plan_classes: BTreeMap::new(),
            client_share: 0.5,
            initial_limit: gradient.initial_limit,
            min_limit: gradient.min_limit,
            max_limit: gradient.max_limit,
            percentile: gradient.percentile,
            buffer: gradient.buffer,
            latency_floor: "5ms".to_owned(),
            window: "500ms".to_owned(),
            min_samples: gradient.min_samples,
        }
    }
}

/// `adaptive_concurrency`, validated.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AdaptiveSettings {
    gradient: GradientSettings,
    classes: Vec<Class>,
    default_class: Option<String>,
    shadow: bool,
    client_share: f64,
    /// A header naming the request's class.
    pub class_header: Option<HeaderName>,
    /// The class of each plan's clients.
    pub plan_classes: HashMap<String, String>,
}

impl AdaptiveSettings {
    /// A limiter of these settings for the upstream named `name` (one per upstream).
    pub(crate) fn limiter(&self, name: &str) -> AdaptiveLimiter {
        self.builder()
            .name(name)
            .build_limiter()
            .expect("validated when the configuration was read")
    }

    fn builder(&self) -> floodgate::adaptive::AdaptiveConcurrencyBuilder {
        let mut builder = AdaptiveConcurrencyLayer::builder()
            .gradient(self.gradient.clone())
            .classes(self.classes.iter().cloned())
            .client_share(self.client_share)
            .shadow(self.shadow);
        if let Some(default) = &self.default_class {
            builder = builder.default_class(default.clone());
        }
        builder
    }
}

/// `routes[].class` and `identity.jwt.class_claim`: only with `adaptive_concurrency` (a class
/// nothing reads is a setting that silently does nothing), and a route's class one of its
/// classes when it names them.
pub(super) fn classes_named(
    errors: &mut Errors,
    adaptive: Option<&RawAdaptive>,
    routes: &[super::routes::RawRoute],
    class_claim: Option<&str>,
) {
    for (index, route) in routes.iter().enumerate() {
        let Some(class) = &route.class else { continue };
        let path = format!("routes[{index}].class");
        match adaptive {
            None => errors.push(path, "needs adaptive_concurrency"),
            Some(adaptive)
                if !adaptive.classes.is_empty()
                    && !adaptive.classes.iter().any(|known| known.name == *class) =>
            {
                errors.push(path, format!("`{class}` is not one of the classes"));
            }
            Some(_) => {}
        }
    }
    // An empty claim is an error of its own (`identity.jwt.class_claim: must not be empty`).
    if class_claim.is_some_and(|claim| !claim.is_empty()) && adaptive.is_none() {
        errors.push("identity.jwt.class_claim", "needs adaptive_concurrency");
    }
}

/// `adaptive_concurrency`, checked against the plans it names.
pub(super) fn adaptive(
    errors: &mut Errors,
    raw: Option<&RawAdaptive>,
    plans: &BTreeMap<String, impl Sized>,
) -> Option<AdaptiveSettings> {
    let raw = raw?;
    let path = "adaptive_concurrency";
    let window = errors.ok(format!("{path}.window"), parse_duration(&raw.window));
    let latency_floor = errors.ok(
        format!("{path}.latency_floor"),
        parse_duration(&raw.latency_floor),
    );
    let class_header = raw.class_header.as_ref().and_then(|name| {
        let parsed = HeaderName::try_from(name.as_str())
            .map_err(|_| super::errors::Problem::from(format!("`{name}` is not a header name")));
        errors.ok(format!("{path}.class_header"), parsed)
    });
    let classes: Vec<Class> = raw
        .classes
        .iter()
        .enumerate()
        .map(|(index, class)| {
            let wait = class.wait.as_deref().and_then(|wait| {
                errors.ok(
                    format!("{path}.classes[{index}].wait"),
                    parse_duration(wait),
                )
            });
            Class::new(class.name.as_str())
                .reserve(class.reserve)
                .wait(wait.unwrap_or_default())
        })
        .collect();
    for (plan, class) in &raw.plan_classes {
        if !plans.contains_key(plan) {
            errors.push(format!("{path}.plan_classes.{plan}"), "no such plan");
        }
        if !classes.iter().any(|known| **known.name() == **class) && !classes.is_empty() {
            errors.push(
                format!("{path}.plan_classes.{plan}"),
                format!("`{class}` is not one of the classes"),
            );
        }
    }
    let settings = AdaptiveSettings {
        gradient: GradientSettings {
            initial_limit: raw.initial_limit,
            min_limit: raw.min_limit,
            max_limit: raw.max_limit,
            percentile: raw.percentile,
            buffer: raw.buffer,
            latency_floor: latency_floor.unwrap_or(GradientSettings::default().latency_floor),
            window: window.unwrap_or(Duration::from_millis(500)),
            min_samples: raw.min_samples,
            ..GradientSettings::default()
        },
        classes,
        default_class: raw.default_class.clone(),
        shadow: raw.shadow,
        client_share: raw.client_share,
        class_header,
        plan_classes: raw.plan_classes.clone().into_iter().collect(),
    };
    // The library names the setting in each of its refusals (`field: problem`).
    if let Err(refused) = settings.builder().build_limiter() {
        let (field, problem) = refused.split_once(": ").unwrap_or(("", &refused));
        errors.push(format!("{path}.{field}"), problem.to_owned());
        return None;
    }
    Some(settings)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use floodgate::adaptive::Class;

    use crate::config::parse;
    use crate::config::tests::errors_of;

    const PLANS: &str = "plans:\n  free: {}\n  gold: {}\n  anonymous: {}\n";

    #[test]
    fn every_setting_is_checked_with_its_field_path() {
        let errors = errors_of(&format!(
            "{PLANS}adaptive_concurrency:\n  window: soon\n  latency_floor: low\n  \
             class_header: \"bad header\"\n  \
             classes: [ {{ name: critical, wait: soon }}, {{ name: rest }} ]\n  \
             plan_classes: {{ platinum: critical, free: bronze }}\n"
        ));
        let expected = [
            "adaptive_concurrency.window: ",
            "adaptive_concurrency.latency_floor: ",
            "adaptive_concurrency.class_header: `bad header` is not a header name",
            "adaptive_concurrency.classes[0].wait: ",
            "adaptive_concurrency.plan_classes.free: `bronze` is not one of the classes",
            "adaptive_concurrency.plan_classes.platinum: no such plan",
        ];
        assert_eq!(errors.len(), expected.len(), "{errors:?}");
        for (error, start) in errors.iter().zip(expected) {
            assert!(
                error.starts_with(start),
                "{error} does not start with {start}"
            );
        }
    }

    #[test]
    fn the_controllers_and_classes_refusals_name_their_field() {
        for (setting, expected) in [
            (
                "percentile: 0.2",
                "adaptive_concurrency.percentile: 0.5 to 1",
            ),
            (
                "initial_limit: 5000",
                "adaptive_concurrency.initial_limit: between min_limit and max_limit",
            ),
            (
                "classes: [ { name: a, reserve: 1.5 }, { name: b } ]",
                "adaptive_concurrency.classes[0].reserve: 0 to 1, below 1",
            ),
            (
                "classes: [ { name: a }, { name: a } ]",
                "adaptive_concurrency.classes: `a` is named twice",
            ),
            (
                "default_class: gold",
                "adaptive_concurrency.default_class: `gold` is not one of the classes",
            ),
            (
                "client_share: 0",
                "adaptive_concurrency.client_share: above 0, at most 1",
            ),
        ] {
            let errors = errors_of(&format!("adaptive_concurrency:\n  {setting}\n"));
            assert_eq!(errors, [expected.to_owned()], "{setting}");
        }
    }

    #[test]
    fn a_route_s_class_is_one_of_the_classes_and_needs_adaptive_concurrency() {
        let routes = "routes:\n  - { match: \"/checkout\", class: critical }\n  \
                      - { match: \"/export\", class: bronze }\n";
        assert_eq!(
            errors_of(&format!(
                "{routes}adaptive_concurrency:\n  classes: [ {{ name: critical }}, {{ name: rest }} ]\n"
            )),
            ["routes[1].class: `bronze` is not one of the classes".to_owned()]
        );
        assert_eq!(
            errors_of(routes),
            [
                "routes[0].class: needs adaptive_concurrency".to_owned(),
                "routes[1].class: needs adaptive_concurrency".to_owned(),
            ]
        );
    }

    #[test]
    fn plan_classes_and_a_class_header_are_read() {
        let config = parse(&format!(
            "{PLANS}adaptive_concurrency:\n  class_header: x-priority\n  \
             classes: [ {{ name: critical, reserve: 0.2, wait: 50ms }}, {{ name: rest }} ]\n  \
             plan_classes: {{ gold: critical }}\n"
        ))
        .unwrap();
        let adaptive = config.adaptive.unwrap();
        assert_eq!(
            adaptive.class_header.as_ref().unwrap().as_str(),
            "x-priority"
        );
        assert_eq!(adaptive.plan_classes["gold"], "critical");
        let waits: Vec<_> = adaptive.classes.iter().map(Class::waits).collect();
        assert_eq!(waits, [Duration::from_millis(50), Duration::ZERO]);
        let limiter = adaptive.limiter("test");
        assert_eq!(limiter.class_index(Some("critical")), 0);
        assert_eq!(limiter.class_index(None), 1, "the lowest by default");
        assert!(parse("").unwrap().adaptive.is_none());
    }

    #[test]
    fn a_class_header_without_a_trusted_proxy_is_warned_of() {
        let warned = |text: &str| {
            parse(text)
                .unwrap()
                .warnings(false)
                .iter()
                .any(|warning| warning.starts_with("adaptive_concurrency.class_header"))
        };
        assert!(warned(&format!(
            "{PLANS}adaptive_concurrency:\n  class_header: x-priority\n"
        )));
        assert!(!warned(&format!(
            "{PLANS}identity:\n  trusted_proxies: [\"10.0.0.0/8\"]\nadaptive_concurrency:\n  class_header: x-priority\n"
        )));
    }
}
