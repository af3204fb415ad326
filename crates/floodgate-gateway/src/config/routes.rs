//! `upstream` and `routes`: where requests go, and what a route sets for them.

use floodgate::post_charge::EstimateHeader;
use http::Uri;
use serde::{Deserialize, Serialize};

use super::errors::{Errors, Problem};
use super::{RoutePattern, RouteTable, redact_url};

/// One entry of `routes:`, as written.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRoute {
    /// The endpoint pattern the route applies to.
    #[serde(rename = "match")]
    pub pattern: String,
    /// Where its requests go instead of `upstream`.
    #[serde(default)]
    pub upstream: Option<String>,
    /// What one of its requests costs.
    #[serde(default)]
    pub cost: Option<u64>,
    /// A response header holding the request's real cost (SPEC §9), post-charged.
    #[serde(default)]
    pub cost_header: Option<String>,
    /// Whether the client still sees `cost_header` (default false: removed).
    #[serde(default)]
    pub cost_header_visible: bool,
    /// A request header holding the up-front estimate (a completion's `x-max-tokens`),
    /// settled against `cost_header`.
    #[serde(default)]
    pub estimate_header: Option<String>,
    /// The most an estimate charges up front.
    #[serde(default)]
    pub estimate_max: Option<u64>,
    /// The `adaptive_concurrency` class of its requests (SPEC §11), over their plan's.
    #[serde(default)]
    pub class: Option<String>,
}

/// Where requests go upstream.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Upstream {
    /// `http` or `https`.
    pub scheme: http::uri::Scheme,
    /// `host:port`.
    pub authority: http::uri::Authority,
}

/// What a route sets for matching requests.
#[derive(Clone, Debug)]
pub(crate) struct RouteTarget {
    /// The upstream, if not the default.
    pub upstream: Option<Upstream>,
    /// The request cost, if not 1.
    pub cost: Option<u64>,
    /// The upstream's response header that reports the request's real cost (SPEC §9), and
    /// whether the client still sees it.
    pub cost_header: Option<(http::HeaderName, bool)>,
    /// The up-front estimate read from the request (`cost` without one), settled against
    /// `cost_header`.
    pub estimate: Option<EstimateHeader>,
    /// The `adaptive_concurrency` class of its requests, checked against the classes.
    pub class: Option<String>,
}

impl RouteTarget {
    /// What a request to this route is charged up front: `cost` (1 unless set), or on a
    /// route with an estimate, `estimate_max`, reserved whatever the client's estimate says
    /// and settled against `cost_header` (SPEC §9: a low estimate buys no room).
    pub(crate) fn up_front_cost(&self) -> u64 {
        match &self.estimate {
            Some(estimate) => estimate.reserved(),
            None => self.cost.unwrap_or(1),
        }
    }
}

pub(super) fn upstream(url: &str) -> Result<Upstream, Problem> {
    // Messages quote the URL without its password.
    let text = redact_url(url);
    let uri: Uri = url
        .parse()
        .map_err(|_| problem!("`{text}` is not a URL such as http://127.0.0.1:3000"))?;
    let scheme = uri
        .scheme()
        .cloned()
        .ok_or_else(|| problem!("`{text}` has no scheme; write http://..."))?;
    if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
        return Err(problem!("`{text}`: an upstream is http:// or https://"));
    }
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| problem!("`{text}` has no host"))?;
    if authority.as_str().contains('@') {
        return Err(problem!(
            "`{text}`: credentials in an upstream URL are not supported"
        ));
    }
    if uri.path() != "/" && !uri.path().is_empty() {
        return Err(problem!(
            "`{text}`: an upstream is scheme://host:port, without a path"
        ));
    }
    Ok(Upstream { scheme, authority })
}

/// A route's `estimate_header` and `estimate_max`: both or neither, and only with a
/// `cost_header` to settle against (a client's own estimate, never settled, would let it
/// choose what it pays); `cost` is what a request without an estimate is charged.
fn estimate(errors: &mut Errors, path: &str, route: &RawRoute) -> Option<Option<EstimateHeader>> {
    let (name, max) = match (&route.estimate_header, route.estimate_max) {
        (None, None) => return Some(None),
        (Some(name), Some(max)) => (name, max),
        (Some(_), None) => {
            errors.push(
                format!("{path}.estimate_max"),
                "must be set with estimate_header",
            );
            return None;
        }
        (None, Some(_)) => {
            errors.push(
                format!("{path}.estimate_header"),
                "must be set with estimate_max",
            );
            return None;
        }
    };
    let before = errors.0.len();
    if route.cost_header.is_none() {
        errors.push(
            format!("{path}.estimate_header"),
            "needs a cost_header to settle against: an estimate the client sends is its own word",
        );
    }
    if max == 0 {
        errors.push(format!("{path}.estimate_max"), "must be at least 1");
    }
    let default = route.cost.unwrap_or(1);
    if default > max {
        errors.push(
            format!("{path}.cost"),
            format!("{default} is above estimate_max ({max}): a request without an estimate is charged cost"),
        );
    }
    let name = errors.ok(
        format!("{path}.estimate_header"),
        http::HeaderName::try_from(name.as_str())
            .map_err(|_| problem!("`{name}` is not a valid header name")),
    );
    if errors.0.len() > before {
        return None;
    }
    Some(Some(EstimateHeader::new(name?, max).default(default)))
}

/// `routes`: each route's upstream, cost and cost header, by endpoint.
pub(super) fn routes(errors: &mut Errors, raw: &[RawRoute]) -> RouteTable<RouteTarget> {
    let mut routes = RouteTable::default();
    for (index, route) in raw.iter().enumerate() {
        let path = format!("routes[{index}]");
        let target_upstream = match &route.upstream {
            Some(text) => errors
                .ok(format!("{path}.upstream"), upstream(text))
                .map(Some),
            None => Some(None),
        };
        if route.cost == Some(0) {
            errors.push(format!("{path}.cost"), "must be at least 1");
        }
        let cost_header = match &route.cost_header {
            Some(name) => errors
                .ok(
                    format!("{path}.cost_header"),
                    http::HeaderName::try_from(name.as_str())
                        .map_err(|_| problem!("`{name}` is not a valid header name")),
                )
                .map(|name| Some((name, route.cost_header_visible))),
            None => Some(None),
        };
        let estimate = estimate(errors, &path, route);
        let endpoint = errors.ok(format!("{path}.match"), RoutePattern::parse(&route.pattern));
        if let (Some(endpoint), Some(target_upstream), Some(cost_header), Some(estimate)) =
            (endpoint, target_upstream, cost_header, estimate)
        {
            let target = RouteTarget {
                upstream: target_upstream,
                cost: route.cost,
                cost_header,
                estimate,
                class: route.class.clone(),
            };
            errors.ok(format!("{path}.match"), routes.insert(endpoint, target));
        }
    }

    routes
}

#[cfg(test)]
mod tests {
    use crate::config::parse;

    fn errors_of(route: &str) -> Vec<String> {
        match parse(&format!("routes:\n  - {route}\n")) {
            Ok(_) => Vec::new(),
            Err(errors) => errors.0.iter().map(ToString::to_string).collect(),
        }
    }

    /// A limit smaller than the reservation would deny every request of the route: warned of.
    #[test]
    fn a_limit_smaller_than_estimate_max_is_warned_of() {
        let config = parse(
            "routes:\n  - { match: \"/v1/x\", cost_header: used, estimate_header: x-max-tokens, estimate_max: 400 }\n\
             plans:\n  free:\n    limits: [ { name: small, algorithm: fixed_window, limit: 100, window: 1h }, { name: large, algorithm: token_bucket, limit: 1000, window: 1h }, { name: streams, algorithm: concurrency, limit: 4 }, { name: counted, algorithm: concurrency, limit: 4, cost: 1 } ]\n  anonymous: {}\n",
        )
        .unwrap();
        let warnings = config.warnings(true);
        let warning = warnings
            .iter()
            .find(|warning| warning.starts_with("routes `/v1/x`"))
            .unwrap_or_else(|| panic!("{warnings:?}"));
        assert!(warning.contains("estimate_max (400)"), "{warning}");
        assert!(
            warning.contains("`small`") && !warning.contains("`large`"),
            "{warning}"
        );
        assert!(
            warning.contains("`streams`") && !warning.contains("`counted`"),
            "a concurrency limit counts the reservation too, unless it has a cost of its own: {warning}"
        );
    }

    #[test]
    fn an_estimate_is_bounded_and_always_settled() {
        let settled = r#"{ match: "/v1/x", cost_header: used, estimate_header: x-max-tokens, estimate_max: 400, cost: 50 }"#;
        assert_eq!(errors_of(settled), Vec::<String>::new());
        let config = parse(&format!("routes:\n  - {settled}\n")).unwrap();
        let route = config
            .routes
            .find_index(&http::Method::GET, "/v1/x")
            .and_then(|index| config.routes.entry(index))
            .map(|(_, route)| route)
            .unwrap();
        assert_eq!(
            route.up_front_cost(),
            400,
            "estimate_max is reserved, whatever the request estimates"
        );
        let mut headers = http::HeaderMap::new();
        let estimate = route.estimate.as_ref().unwrap();
        assert_eq!(estimate.estimate(&headers), 50, "cost, without an estimate");
        headers.insert("x-max-tokens", http::HeaderValue::from_static("120"));
        assert_eq!(estimate.estimate(&headers), 120);
        headers.insert("x-max-tokens", http::HeaderValue::from_static("100000"));
        assert_eq!(estimate.estimate(&headers), 400, "bounded");

        assert_eq!(
            errors_of(r#"{ match: "/x", estimate_header: x-max-tokens, estimate_max: 4 }"#),
            [
                "routes[0].estimate_header: needs a cost_header to settle against: an estimate the client sends is its own word"
            ]
        );
        assert_eq!(
            errors_of(r#"{ match: "/x", cost_header: used, estimate_header: x-max-tokens }"#),
            ["routes[0].estimate_max: must be set with estimate_header"]
        );
        assert_eq!(
            errors_of(r#"{ match: "/x", cost_header: used, estimate_max: 4 }"#),
            ["routes[0].estimate_header: must be set with estimate_max"]
        );
        assert_eq!(
            errors_of(
                r#"{ match: "/x", cost_header: used, estimate_header: x-max-tokens, estimate_max: 4, cost: 5 }"#
            ),
            [
                "routes[0].cost: 5 is above estimate_max (4): a request without an estimate is charged cost"
            ]
        );
    }
}
