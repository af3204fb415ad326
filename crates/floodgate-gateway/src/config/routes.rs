//! `upstream` and `routes`: where requests go, and what a route sets for them.

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
}

/// Where requests go upstream.
#[derive(Clone, Debug, PartialEq, Eq)]
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
        let endpoint = errors.ok(format!("{path}.match"), RoutePattern::parse(&route.pattern));
        if let (Some(endpoint), Some(target_upstream), Some(cost_header)) =
            (endpoint, target_upstream, cost_header)
        {
            let target = RouteTarget {
                upstream: target_upstream,
                cost: route.cost,
                cost_header,
            };
            errors.ok(format!("{path}.match"), routes.insert(endpoint, target));
        }
    }

    routes
}
