//! Where per-client overrides (the `overrides` module) are stored: the [`Override`] record as
//! every backend keeps it, the [`OverrideBackend`] a store offers, and the memory store's
//! backend ([`MemoryOverrides`]). The Redis stores' is `store::redis::overrides`. Here, beside
//! the stores, so that a store names its overrides' home without reaching back up into the
//! module that applies them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{Value, json};

use crate::limit::{Limit, LimitError};
use crate::store::{BoxFuture, StoreError};
use crate::time::{Timestamp, duration_to_micros};

/// One limit of one client, replaced until `expires_at`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Override {
    /// The storage key of the limit it replaces: which client, rule and limit.
    pub target: Arc<str>,
    /// The rule of that limit.
    pub rule: Arc<str>,
    /// The limit's name (kept: headers and metrics still name it).
    pub name: Arc<str>,
    /// Requests (or units) per window.
    pub limit: u64,
    /// The window.
    pub window: Duration,
    /// The burst, for the algorithms that have one.
    pub burst: Option<u64>,
    /// When it was set.
    pub set_at: Timestamp,
    /// When it stops applying.
    pub expires_at: Timestamp,
}

impl Override {
    /// The client's hash tag (`<scope>:<identity hash>`), as in its storage keys.
    pub fn client(&self) -> &str {
        crate::key::storage::hash_tag(&self.target)
    }

    /// Whole seconds left at `now` (rounded up), 0 once expired.
    pub fn remaining_secs(&self, now: Timestamp) -> u64 {
        self.expires_at
            .as_micros()
            .saturating_sub(now.as_micros())
            .div_ceil(1_000_000)
    }

    /// Whether it applies at `now`.
    pub fn is_active(&self, now: Timestamp) -> bool {
        self.expires_at > now
    }

    /// `original` with this override's settings: same name, algorithm and cost, and a limit
    /// on the calendar keeps its period (its window is the period's).
    pub fn apply_to(&self, original: &Limit) -> Result<Limit, LimitError> {
        let mut builder = Limit::builder(original.name())
            .algorithm(original.algorithm())
            .limit(self.limit);
        builder = match original.calendar() {
            Some(calendar) => builder.calendar(calendar.clone()),
            None => builder.window(self.window),
        };
        if let Some(burst) = self.burst {
            builder = builder.burst(burst);
        }
        if let Some(cost) = original.cost_override() {
            builder = builder.cost(cost);
        }
        builder.build()
    }

    /// The stored form (JSON), as every backend keeps it.
    pub fn to_json(&self) -> Value {
        json!({
            "target": &*self.target,
            "rule": &*self.rule,
            "name": &*self.name,
            "limit": self.limit,
            "window_ms": duration_to_micros(self.window) / 1000,
            "burst": self.burst,
            "set_at_ms": self.set_at.as_micros() / 1000,
            "expires_at_ms": self.expires_at.as_micros() / 1000,
        })
    }

    /// Reads [`Override::to_json`] back; `None` for anything else (a damaged entry is skipped).
    pub fn from_json(value: &Value) -> Option<Override> {
        let text = |field: &str| value.get(field)?.as_str().map(Arc::from);
        let number = |field: &str| value.get(field)?.as_u64();
        let millis = |field: &str| number(field).map(|ms| ms.saturating_mul(1000));
        Some(Override {
            target: text("target")?,
            rule: text("rule")?,
            name: text("name")?,
            limit: number("limit")?,
            window: Duration::from_millis(number("window_ms")?),
            burst: value.get("burst").and_then(Value::as_u64),
            set_at: Timestamp::from_micros(millis("set_at_ms")?),
            expires_at: Timestamp::from_micros(millis("expires_at_ms")?),
        })
    }
}

/// Where overrides are stored: every node deciding on one store reads the same ones. Each
/// operation is scoped to a `namespace` (a key prefix), so that deployments sharing a store
/// do not see each other's.
pub trait OverrideBackend: Send + Sync + 'static {
    /// Stores `entry` (replacing one with the same target) unless `max_active` others are in
    /// force at `now`: then `Ok(false)`, and nothing is stored.
    fn put<'a>(
        &'a self,
        namespace: &'a str,
        entry: &'a Override,
        max_active: usize,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Removes the override of `target`; whether there was one.
    fn remove<'a>(
        &'a self,
        namespace: &'a str,
        target: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Every override in force at `now`.
    fn all<'a>(
        &'a self,
        namespace: &'a str,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Vec<Override>, StoreError>>;

    /// A value that changes whenever an override is set or removed (expiry aside), and is
    /// never the one before, even after the store lost its data: a node whose copy was read
    /// at this value can tell cheaply that it is current.
    fn version<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Result<u64, StoreError>>;

    /// The store's clock, by which every node reckons expiry; `None` (the default) for a
    /// store in this process, whose clock is the node's.
    fn time<'a>(
        &'a self,
        _namespace: &'a str,
    ) -> BoxFuture<'a, Result<Option<Timestamp>, StoreError>> {
        Box::pin(std::future::ready(Ok(None)))
    }
}

/// Overrides by namespace and target.
type ByTarget = HashMap<(Arc<str>, Arc<str>), Override>;

/// Overrides kept in this process: the memory store's (one node, nothing shared).
#[derive(Debug, Default)]
pub struct MemoryOverrides {
    entries: Mutex<ByTarget>,
    version: AtomicU64,
}

impl MemoryOverrides {
    fn entries(&self) -> std::sync::MutexGuard<'_, ByTarget> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl OverrideBackend for MemoryOverrides {
    fn put<'a>(
        &'a self,
        namespace: &'a str,
        entry: &'a Override,
        max_active: usize,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let stored = {
            let mut entries = self.entries();
            entries.retain(|_, stored| stored.is_active(now));
            let key = (Arc::from(namespace), entry.target.clone());
            let in_force = entries.keys().filter(|(ns, _)| **ns == *namespace).count();
            if !entries.contains_key(&key) && in_force >= max_active {
                false
            } else {
                entries.insert(key, entry.clone());
                self.version.fetch_add(1, Ordering::AcqRel);
                true
            }
        };
        Box::pin(std::future::ready(Ok(stored)))
    }

    fn remove<'a>(
        &'a self,
        namespace: &'a str,
        target: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let removed = self
            .entries()
            .remove(&(Arc::from(namespace), Arc::from(target)))
            .is_some();
        if removed {
            self.version.fetch_add(1, Ordering::AcqRel);
        }
        Box::pin(std::future::ready(Ok(removed)))
    }

    fn all<'a>(
        &'a self,
        namespace: &'a str,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Vec<Override>, StoreError>> {
        let all = self
            .entries()
            .iter()
            .filter(|((ns, _), entry)| **ns == *namespace && entry.is_active(now))
            .map(|(_, entry)| entry.clone())
            .collect();
        Box::pin(std::future::ready(Ok(all)))
    }

    fn version<'a>(&'a self, _namespace: &'a str) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(std::future::ready(Ok(self.version.load(Ordering::Acquire))))
    }
}
