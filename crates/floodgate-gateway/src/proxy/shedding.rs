//! `adaptive_concurrency` in the proxy: one [`AdaptiveLimiter`] per upstream, made at the
//! upstream's first request and kept across reloads that leave the settings as they were (the
//! limit and the round trip it learned go on). A request is classed by the class header when
//! a trusted proxy sent it (`identity.trusted_proxies`), else its route's `class`, else the
//! class its verified token names (`identity.jwt.class_claim`), else its plan's, else the
//! default class; its client, for fairness within a class, is its identity.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use floodgate::adaptive::{AdaptiveLimiter, AdaptiveSnapshot, Admission};
use http::Request;

use crate::client::ResolvedClient;
use crate::config::{AdaptiveSettings, RouteTarget, Upstream};

/// The limiters of the upstreams, under one set of settings.
#[derive(Debug)]
pub(crate) struct Shedding {
    settings: AdaptiveSettings,
    limiters: Mutex<HashMap<Upstream, AdaptiveLimiter>>,
}

impl Shedding {
    /// No limiter yet: each upstream gets its own at its first request.
    pub(crate) fn new(settings: AdaptiveSettings) -> Shedding {
        Shedding {
            settings,
            limiters: Mutex::new(HashMap::new()),
        }
    }

    /// Whether these limiters were made of `settings` (a reload that keeps them keeps them).
    pub(crate) fn has_settings(&self, settings: &AdaptiveSettings) -> bool {
        self.settings == *settings
    }

    /// Admits `request` to `upstream`: a permit to hold until the upstream answers, why it is
    /// shed, or its place in its class's wait. The class header is read only from a trusted proxy (`trusted_peer`), as the
    /// plan header is: a client that names its own class would call itself critical. The
    /// operator's own words come next: the request's route's class, then the class a verified
    /// token names, then its plan's.
    pub(crate) fn admit<B>(
        &self,
        upstream: &Upstream,
        route: Option<&RouteTarget>,
        request: &Request<B>,
        trusted_peer: bool,
    ) -> Admission {
        let limiter = self.limiter(upstream);
        let resolved = request.extensions().get::<ResolvedClient>();
        let known = |name: &&str| limiter.classes().iter().any(|known| **known == **name);
        let class = self
            .settings
            .class_header
            .as_ref()
            .filter(|_| trusted_peer)
            .and_then(|header| request.headers().get(header)?.to_str().ok())
            .filter(known)
            .or_else(|| route?.class.as_deref())
            .or_else(|| resolved?.token_class.as_deref().filter(known))
            .or_else(|| {
                let plan = &resolved?.plan;
                self.settings.plan_classes.get(&**plan).map(String::as_str)
            });
        let client = resolved.map(|resolved| {
            let hash = resolved.identity.hash().0;
            u64::from_le_bytes(hash[..8].try_into().unwrap_or_default())
        });
        limiter.admit(limiter.class_index(class), client)
    }

    /// What each upstream's limiter shows, by upstream.
    pub(crate) fn snapshots(&self) -> Vec<(String, AdaptiveSnapshot)> {
        let mut snapshots: Vec<_> = self
            .lock()
            .iter()
            .map(|(upstream, limiter)| (name_of(upstream), limiter.snapshot()))
            .collect();
        snapshots.sort_by(|a, b| a.0.cmp(&b.0));
        snapshots
    }

    fn limiter(&self, upstream: &Upstream) -> AdaptiveLimiter {
        let mut limiters = self.lock();
        if let Some(limiter) = limiters.get(upstream) {
            return limiter.clone();
        }
        limiters
            .entry(upstream.clone())
            .or_insert_with(|| self.settings.limiter(&name_of(upstream)))
            .clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Upstream, AdaptiveLimiter>> {
        // One insert or read per use: nothing is left half done by a panic.
        self.limiters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// `scheme://host:port`.
fn name_of(upstream: &Upstream) -> String {
    format!("{}://{}", upstream.scheme, upstream.authority)
}

/// The shedding of the next version: the current one's when the settings are the same.
pub(crate) fn carried_over(
    current: Option<&Arc<Shedding>>,
    settings: Option<&AdaptiveSettings>,
) -> Option<Arc<Shedding>> {
    let settings = settings?;
    match current {
        Some(current) if current.has_settings(settings) => Some(current.clone()),
        _ => Some(Arc::new(Shedding::new(settings.clone()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;
    use floodgate::adaptive::AdaptivePermit;

    /// The permit of an admitted request.
    fn permit_of(admission: Admission) -> AdaptivePermit {
        match admission {
            Admission::Admitted(permit) => permit,
            other => panic!("not admitted: {other:?}"),
        }
    }

    fn settings(initial_limit: u32) -> AdaptiveSettings {
        let text = format!("adaptive_concurrency:\n  initial_limit: {initial_limit}\n");
        parse(&text).unwrap().adaptive.unwrap()
    }

    #[test]
    fn a_reload_keeps_the_limiters_while_the_settings_are_the_same() {
        let first = carried_over(None, Some(&settings(20))).unwrap();
        let upstream = crate::config::parse("upstream: \"http://127.0.0.1:9\"\n")
            .unwrap()
            .upstream;
        let request = Request::new(());
        let permit = permit_of(first.admit(&upstream, None, &request, false));
        let kept = carried_over(Some(&first), Some(&settings(20))).unwrap();
        assert!(Arc::ptr_eq(&first, &kept));
        assert_eq!(kept.snapshots()[0].1.gate.in_flight, 1, "the same limiter");
        drop(permit);
        let changed = carried_over(Some(&first), Some(&settings(30))).unwrap();
        assert!(!Arc::ptr_eq(&first, &changed));
        assert!(
            changed.snapshots().is_empty(),
            "new limiters, made on first use"
        );
        assert!(carried_over(Some(&first), None).is_none());
    }

    #[test]
    fn the_class_header_counts_only_from_a_trusted_proxy() {
        let settings = parse(
            "adaptive_concurrency:\n  class_header: x-priority\n  default_class: default\n  \
             classes:\n    - { name: critical, reserve: 0.2 }\n    - { name: default }\n",
        )
        .unwrap()
        .adaptive
        .unwrap();
        let shedding = Shedding::new(settings);
        let upstream = crate::config::parse("upstream: \"http://127.0.0.1:9\"\n")
            .unwrap()
            .upstream;
        let claiming = Request::builder()
            .header("x-priority", "critical")
            .body(())
            .unwrap();
        let admitted = |class: &str| {
            let snapshot = &shedding.snapshots()[0].1;
            let class = snapshot.gate.classes.iter().find(|c| &*c.name == class);
            class.map_or(0, |class| class.admitted)
        };
        let _from_a_client = permit_of(shedding.admit(&upstream, None, &claiming, false));
        assert_eq!(
            (admitted("critical"), admitted("default")),
            (0, 1),
            "a client's own claim is not a class"
        );
        let _through_a_trusted_proxy = permit_of(shedding.admit(&upstream, None, &claiming, true));
        assert_eq!((admitted("critical"), admitted("default")), (1, 1));
    }

    #[test]
    fn a_trusted_header_then_the_route_then_the_token_then_the_plan_class_a_request() {
        let config = parse(
            "identity: { trusted_proxies: [\"127.0.0.1/32\"] }\n\
             plans:\n  free: {}\n  anonymous: {}\n\
             routes:\n  - { match: \"/checkout\", class: critical }\n\
             adaptive_concurrency:\n  class_header: x-priority\n  plan_classes: { free: sheddable }\n  \
             classes:\n    - { name: critical, reserve: 0.2 }\n    - { name: default }\n    - { name: sheddable }\n",
        )
        .unwrap();
        let shedding = Shedding::new(config.adaptive.clone().unwrap());
        let admitted = || {
            let snapshot = &shedding.snapshots()[0].1;
            let count = |name: &str| {
                let class = snapshot.gate.classes.iter().find(|c| &*c.name == name);
                class.map_or(0, |class| class.admitted)
            };
            (count("critical"), count("default"), count("sheddable"))
        };
        let request = |path: &str, priority: Option<&str>, token_class: Option<&str>| {
            let mut request = Request::builder().uri(path);
            if let Some(priority) = priority {
                request = request.header("x-priority", priority);
            }
            let mut request = request.body(()).unwrap();
            request.extensions_mut().insert(ResolvedClient {
                identity: floodgate::Identity::ApiKey("k".to_owned()),
                plan: "free".into(),
                client_ip: None,
                bypass: false,
                route: config.routes.find_index(&http::Method::GET, path),
                anonymized: false,
                token_verified: token_class.is_some(),
                token_class: token_class.map(Arc::from),
            });
            request
        };
        let route_of = |request: &Request<()>| {
            let index = request.extensions().get::<ResolvedClient>()?.route?;
            config.routes.entry(index).map(|(_, route)| route)
        };
        let mut permits = Vec::new();
        let mut admit = |request: Request<()>, trusted: bool| {
            let route = route_of(&request);
            permits.push(permit_of(shedding.admit(
                &config.upstream,
                route,
                &request,
                trusted,
            )));
        };
        admit(request("/other", None, None), false);
        assert_eq!(admitted(), (0, 0, 1), "the plan's class");
        admit(request("/other", None, Some("default")), false);
        assert_eq!(admitted(), (0, 1, 1), "the token's class over the plan's");
        admit(request("/other", None, Some("platinum")), false);
        assert_eq!(admitted(), (0, 1, 2), "a token's unknown class: the plan's");
        admit(request("/checkout", None, Some("default")), false);
        assert_eq!(admitted(), (1, 1, 2), "the route's class over the token's");
        admit(request("/checkout", Some("sheddable"), None), false);
        assert_eq!(admitted(), (2, 1, 2), "a client's own header is not read");
        admit(request("/checkout", Some("default"), None), true);
        assert_eq!(
            admitted(),
            (2, 2, 2),
            "a trusted proxy's header over the route's"
        );
    }
}
