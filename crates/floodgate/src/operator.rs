//! The operator's side of a layer: looking a client up, reading what it has left, resetting
//! it, and overriding one of its limits for a while. Each takes a request that stands for the
//! client (its API key header, a [`crate::PeerAddr`]), planned as the layer plans requests,
//! without recording anything.

use std::sync::Arc;

use crate::decision::Decision;
use crate::key::Identity;
use crate::layer::RateLimitLayer;
use crate::overrides::{Override, OverrideError, OverrideSpec, Overrides};
use crate::planning::{Planned, Route};
use crate::store::Check;

impl RateLimitLayer {
    /// Who `request` is from and the checks it would meet, decided by nothing: build a
    /// request that stands for a client (its API key header, a [`crate::PeerAddr`]) to look
    /// that client up. `None` when no limit applies (allowlisted, or no check) or the request
    /// would be answered before any check (denylisted, unidentified under
    /// [`UnknownIdentity::Reject`](crate::service::UnknownIdentity::Reject)).
    pub fn checks_for<B>(&self, request: &http::Request<B>) -> Option<(Identity, Vec<Check>)> {
        match self.shared.planner.plan(request) {
            Planned {
                identity,
                route: Route::Checks { checks, .. },
            } if !checks.is_empty() => Some((identity, checks)),
            _ => None,
        }
    }

    /// What the client of `request` has left on every limit it meets, read from the store
    /// without consuming anything (an operator's "why is this client limited?"). With the
    /// batched store, this node's view.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use floodgate::{Limit, RateLimitLayer};
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .limit(Limit::fixed_window("per-minute", 100, Duration::from_secs(60))?)
    ///     .build()?;
    /// // A request standing for the client with API key "k1".
    /// let client = http::Request::get("/").header("x-api-key", "k1").body(())?;
    /// let decision = layer.peek(&client).await?.expect("a limit applies");
    /// assert_eq!(decision.limits()[0].remaining, 100);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn peek<B>(
        &self,
        request: &http::Request<B>,
    ) -> Result<Option<Decision>, crate::StoreError> {
        let Some((_, checks)) = self.checks_for(request) else {
            return Ok(None);
        };
        self.shared.store.peek(&checks, None).await.map(Some)
    }

    /// Resets the state of every limit the client of `request` meets, or only of the limit
    /// named `only`, on whichever store is in use (leases included); returns how many keys held
    /// state. Log who asked: this unblocks a client at once.
    pub async fn reset<B>(
        &self,
        request: &http::Request<B>,
        only: Option<&str>,
    ) -> Result<u64, crate::StoreError> {
        let Some((_, checks)) = self.checks_for(request) else {
            return Ok(0);
        };
        let keys: Vec<Arc<str>> = checks
            .iter()
            .filter(|check| only.is_none_or(|name| check.limit.name() == name))
            .map(|check| check.key.clone())
            .collect();
        self.shared.store.reset(&keys).await
    }

    /// The per-client overrides this layer applies (from its store, or as given to
    /// [`RateLimitLayerBuilder::overrides`](crate::RateLimitLayerBuilder::overrides)); `None` if its store keeps none.
    pub fn overrides(&self) -> Option<&Arc<Overrides>> {
        self.shared.planner.overrides.as_ref()
    }

    /// Replaces, until it expires, the limit named `spec.name` of the client of `request` (a
    /// request that stands for the client, as for [`peek`](Self::peek)), on every node of the
    /// layer's store: at once here, within [`Overrides::REFRESH_EVERY`] on the others. The
    /// limit keeps its name and counters. Log who asked.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use floodgate::overrides::OverrideSpec;
    /// use floodgate::{Limit, RateLimitLayer};
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .limit(Limit::token_bucket("per-second", 10, Duration::from_secs(1))?)
    ///     .build()?;
    /// let client = http::Request::get("/").header("x-api-key", "k1").body(())?;
    /// // Ten times the limit for two hours.
    /// let spec = OverrideSpec::new("per-second", 100, Duration::from_secs(7200));
    /// layer.set_override(&client, &spec).await?;
    /// let decision = layer.peek(&client).await?.expect("a limit applies");
    /// assert_eq!(decision.limits()[0].limit, 100);
    /// assert_eq!(layer.overrides_of(&client).await?.len(), 1);
    /// assert!(layer.remove_override(&client, "per-second").await?);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn set_override<B>(
        &self,
        request: &http::Request<B>,
        spec: &OverrideSpec,
    ) -> Result<Override, OverrideError> {
        let overrides = self.overrides().ok_or(OverrideError::Unsupported)?;
        let target = self
            .client_checks(request)?
            .into_iter()
            .find(|check| check.limit.name() == spec.name)
            .ok_or_else(|| OverrideError::UnknownLimit(spec.name.clone()))?;
        overrides.set(&target, spec).await
    }

    /// The overrides in force for the client of `request`, read from the store.
    pub async fn overrides_of<B>(
        &self,
        request: &http::Request<B>,
    ) -> Result<Vec<Override>, OverrideError> {
        let overrides = self.overrides().ok_or(OverrideError::Unsupported)?;
        let targets: Vec<Arc<str>> = self
            .client_checks(request)?
            .into_iter()
            .map(|check| check.key)
            .collect();
        let mut all = overrides.list().await?;
        all.retain(|entry| targets.contains(&entry.target));
        Ok(all)
    }

    /// Ends the override of the limit `name` of the client of `request` at once on this
    /// node, and within [`Overrides::REFRESH_EVERY`] on the others; whether there was one.
    pub async fn remove_override<B>(
        &self,
        request: &http::Request<B>,
        name: &str,
    ) -> Result<bool, OverrideError> {
        let overrides = self.overrides().ok_or(OverrideError::Unsupported)?;
        let Some(target) = self
            .client_checks(request)?
            .into_iter()
            .find(|check| check.limit.name() == name)
        else {
            return Ok(false);
        };
        overrides.remove(&target.key).await
    }

    /// The checks of the client of `request` that count its own identity (not a per-IP or
    /// global limit it shares), as configured.
    fn client_checks<B>(&self, request: &http::Request<B>) -> Result<Vec<Check>, OverrideError> {
        let Planned {
            identity,
            route: Route::Checks { checks, .. },
        } = self.shared.planner.plan_as_configured(request)
        else {
            return Err(OverrideError::NoClient);
        };
        let client = format!("{}:{}", identity.scope(), identity.hash());
        let own: Vec<Check> = checks
            .into_iter()
            .filter(|check| crate::key::storage::hash_tag(&check.key) == client)
            .collect();
        if own.is_empty() {
            return Err(OverrideError::NoClient);
        }
        Ok(own)
    }
}
