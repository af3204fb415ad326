//! Per-client limits changed at runtime: an [`Override`] replaces one limit of one client
//! (its `limit`, and optionally `window` and `burst`) until it expires by itself.
//!
//! Overrides live in the store the counters live in ([`OverrideBackend`]: in this process for
//! the memory store, in Redis under the client's hash tag for the Redis stores), so that every
//! node on that store applies them. Each node keeps what is in force in memory
//! ([`Overrides`]) and refreshes it in the background at least every
//! [`Overrides::REFRESH_EVERY`]: the store's clock and the version while nothing changed (two
//! small reads), the whole list when something did. Expiry is reckoned on the store's clock. Deciding costs one hash lookup per check while some override is in force on
//! the node, and one atomic load when none is.
//!
//! An override keeps the limit's name and storage key, so the client's counters carry over:
//! the algorithms read the state they kept under the new settings (a bucket keeps its tokens,
//! capped at the new burst; a log keeps its entries; a fixed window of a new length counts in
//! windows of that length, so its current one may start afresh).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use arc_swap::ArcSwap;
use std::time::Duration;

use serde_json::Value;

pub use crate::store::override_backend::{MemoryOverrides, Override, OverrideBackend};

use crate::limit::Limit;
use crate::store::{Check, StoreError};
use crate::time::{Clock, SystemClock, Timestamp, duration_to_micros};

/// The shortest `expires_in`.
pub const MIN_EXPIRES_IN: Duration = Duration::from_secs(1);

/// The default longest `expires_in`.
pub const DEFAULT_MAX_EXPIRES_IN: Duration = Duration::from_secs(7 * 24 * 3600);

/// The default most overrides in force at once, per store.
pub const DEFAULT_MAX_ACTIVE: usize = 1000;

/// What an operator asks for: a new `limit` for the limit `name` of a client, for
/// `expires_in`. `window` and `burst` default to the limit's own (a burst equal to the limit,
/// the default, follows the new limit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverrideSpec {
    /// The limit to replace, by name.
    pub name: String,
    /// The new limit.
    pub limit: u64,
    /// The new window (default: the limit's).
    pub window: Option<Duration>,
    /// The new burst (default: the limit's, or the new limit where the burst was the limit).
    pub burst: Option<u64>,
    /// How long it stays in force.
    pub expires_in: Duration,
}

impl OverrideSpec {
    /// `limit` for the limit `name`, for `expires_in`, window and burst as they are.
    pub fn new(name: impl Into<String>, limit: u64, expires_in: Duration) -> Self {
        OverrideSpec {
            name: name.into(),
            limit,
            window: None,
            burst: None,
            expires_in,
        }
    }

    /// The spec as a JSON request body gives it:
    /// `{"name", "limit", "window", "burst", "expires_in"}`, durations as `"1s"`, `"500ms"`,
    /// `"2h"`, `"7d"` (or a number of seconds). Errors name the field.
    pub fn from_json(body: &Value) -> Result<OverrideSpec, OverrideError> {
        let Some(fields) = body.as_object() else {
            return Err(OverrideError::invalid("body", "must be a JSON object"));
        };
        if let Some(unknown) = fields.keys().find(|field| {
            !matches!(
                field.as_str(),
                "name" | "limit" | "window" | "burst" | "expires_in"
            )
        }) {
            return Err(OverrideError::invalid(
                unknown,
                "unknown field; expected name, limit, window, burst, expires_in",
            ));
        }
        let name = match fields.get("name") {
            Some(Value::String(name)) => name.clone(),
            Some(_) => return Err(OverrideError::invalid("name", "must be a string")),
            None => return Err(OverrideError::invalid("name", "is required")),
        };
        let count = |field: &'static str| -> Result<Option<u64>, OverrideError> {
            match fields.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(value) => value
                    .as_u64()
                    .map(Some)
                    .ok_or_else(|| OverrideError::invalid(field, "must be a whole number")),
            }
        };
        let duration = |field: &'static str| -> Result<Option<Duration>, OverrideError> {
            match fields.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Number(secs)) => secs
                    .as_u64()
                    .map(|secs| Some(Duration::from_secs(secs)))
                    .ok_or_else(|| {
                        OverrideError::invalid(field, "must be a whole number of seconds")
                    }),
                Some(Value::String(text)) => parse_duration(text).map(Some).ok_or_else(|| {
                    OverrideError::invalid(field, "must be a duration such as 500ms, 30s, 2h, 7d")
                }),
                Some(_) => Err(OverrideError::invalid(field, "must be a duration")),
            }
        };
        Ok(OverrideSpec {
            name,
            limit: count("limit")?.ok_or_else(|| OverrideError::invalid("limit", "is required"))?,
            window: duration("window")?,
            burst: count("burst")?,
            expires_in: duration("expires_in")?
                .ok_or_else(|| OverrideError::invalid("expires_in", "is required"))?,
        })
    }
}

/// `500ms`, `30s`, `5m`, `2h`, `7d`: a whole number and a unit.
fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().ok()?;
    let unit_millis: u64 = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    Some(Duration::from_millis(number.checked_mul(unit_millis)?))
}

/// Why an override could not be set, listed or removed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OverrideError {
    /// A field of the request is wrong: `field` names it.
    #[error("{field}: {problem}")]
    Invalid {
        /// The field (`name`, `limit`, `window`, `burst`, `expires_in`).
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The client meets no limit of that name.
    #[error("name: the client has no limit `{0}`")]
    UnknownLimit(String),
    /// No limit applies to the request's client (allowlisted, unidentified, no checks).
    #[error("no limit applies to this client")]
    NoClient,
    /// As many overrides as allowed are in force.
    #[error("{0} overrides are in force, the most allowed; remove one or wait for one to expire")]
    Full(usize),
    /// The store has no place for overrides.
    #[error("this store keeps no overrides")]
    Unsupported,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl OverrideError {
    fn invalid(field: &str, problem: impl Into<String>) -> Self {
        OverrideError::Invalid {
            field: field.to_owned(),
            problem: problem.into(),
        }
    }
}

/// An override in force on this node, with the limits made from it (by the address of the
/// limit they replace, which each entry holds so that no other limit can take the address).
struct InForce {
    stored: Override,
    /// Read on every decision of the client; written once per limit (and reload).
    limits: RwLock<Vec<MadeLimit>>,
}

/// A limit, and the one an override made of it (`None`: the override does not fit it).
type MadeLimit = (Arc<Limit>, Option<Arc<Limit>>);

impl InForce {
    /// The limit that replaces `original`, made once; `None` if the override does not fit it
    /// (a reload changed the limit's algorithm to one without a burst, say).
    fn limit_for(&self, original: &Arc<Limit>) -> Option<Arc<Limit>> {
        let made_before = |limits: &[MadeLimit]| {
            limits
                .iter()
                .find(|(seen, _)| Arc::ptr_eq(seen, original))
                .map(|(_, made)| made.clone())
        };
        if let Some(made) = made_before(&self.limits.read().unwrap_or_else(PoisonError::into_inner))
        {
            return made;
        }
        let mut limits = self.limits.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(made) = made_before(&limits) {
            return made;
        }
        let made = self.stored.apply_to(original).ok().map(Arc::new);
        // A few reloads' worth; past that, start again.
        if limits.len() >= 8 {
            limits.clear();
        }
        limits.push((original.clone(), made.clone()));
        made
    }
}

/// What this node has in force, by target.
type InForceMap = HashMap<Arc<str>, Arc<InForce>>;

/// This node's view of one store's overrides: operations go to the store, decisions read a
/// copy refreshed in the background. Clone the `Arc` to share it (a layer, the admin API).
pub struct Overrides {
    backend: Arc<dyn OverrideBackend>,
    namespace: Arc<str>,
    /// The copy, and the number of the refresh that made it.
    in_force: ArcSwap<(u64, InForceMap)>,
    /// Held while a refresh puts its copy in place.
    replacing: Mutex<()>,
    /// Refreshes started so far: a refresh that started earlier (and read earlier) never
    /// replaces the copy of one that started later.
    refreshes: AtomicU64,
    /// `in_force.len()`, read on every decision without the lock.
    count: AtomicUsize,
    /// When the whole list was last read, changed or not.
    read_all_at: AtomicU64,
    /// The backend's version the copy was read at.
    version: AtomicU64,
    /// Whether the background refresh was started.
    kept_fresh: AtomicBool,
    /// This node's clock (the system's, or a test's).
    clock: Arc<dyn Clock>,
    /// The store's clock minus this node's, in microseconds, as the last refresh measured it:
    /// expiry is reckoned on the store's clock, so that nodes whose clocks disagree agree on
    /// when an override ends (and a node whose clock runs behind does not store an override
    /// that Redis takes for expired at once).
    store_offset_micros: AtomicI64,
    /// Whether `store_offset_micros` was measured at least once.
    clock_measured: AtomicBool,
    max_active: AtomicUsize,
    max_expires_in_ms: AtomicU64,
}

impl std::fmt::Debug for Overrides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overrides")
            .field("namespace", &self.namespace)
            .field("in_force", &self.count.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Overrides {
    /// How stale a node's copy may get while it decides: a change on another node is in
    /// force here within this (plus one store call).
    pub const REFRESH_EVERY: Duration = Duration::from_millis(500);

    /// The slowest read of the store's clock that is taken as a measurement: half of it is the
    /// most the estimate can be off by.
    const CLOCK_CALL_AT_MOST: Duration = Duration::from_millis(100);

    /// The whole list is read at least this often even when the version says nothing changed
    /// (a change whose version could not be written, or entries a store lost without a change).
    const READ_ALL_EVERY: Duration = Duration::from_secs(10);

    /// Overrides kept in `backend` under `namespace`, at most [`DEFAULT_MAX_ACTIVE`] in force,
    /// each for at most [`DEFAULT_MAX_EXPIRES_IN`].
    pub fn new(backend: Arc<dyn OverrideBackend>, namespace: impl Into<Arc<str>>) -> Self {
        Overrides {
            backend,
            namespace: namespace.into(),
            in_force: ArcSwap::from_pointee((0, InForceMap::new())),
            replacing: Mutex::new(()),
            refreshes: AtomicU64::new(0),
            count: AtomicUsize::new(0),
            read_all_at: AtomicU64::new(0),
            version: AtomicU64::new(u64::MAX),
            kept_fresh: AtomicBool::new(false),
            clock: Arc::new(SystemClock),
            store_offset_micros: AtomicI64::new(0),
            clock_measured: AtomicBool::new(false),
            max_active: AtomicUsize::new(DEFAULT_MAX_ACTIVE),
            max_expires_in_ms: AtomicU64::new(DEFAULT_MAX_EXPIRES_IN.as_secs() * 1000),
        }
    }

    /// The same overrides, on `clock` instead of the system's (tests of clocks that disagree).
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The store's time as this node reckons it: its own clock, corrected by how far the
    /// store's was from it at the last refresh. Expiry is decided by this time.
    pub fn now(&self) -> Timestamp {
        let offset = self.store_offset_micros.load(Ordering::Relaxed);
        let local = self.clock.now().as_micros();
        Timestamp::from_micros(local.saturating_add_signed(offset))
    }

    /// Measures how far the store's clock is from this node's. A call slower than
    /// [`Overrides::CLOCK_CALL_AT_MOST`] says too little about when the store read its clock
    /// (it is taken only while nothing better was measured), and a store that cannot tell its
    /// time (a failure, a proxy without `TIME`) leaves the last measurement in place: both are
    /// logged at debug, and neither fails the refresh.
    async fn measure_store_clock(&self) {
        let asked = self.clock.now().as_micros();
        let store_time = match self.backend.time(&self.namespace).await {
            Ok(Some(time)) => time.as_micros(),
            Ok(None) => return,
            Err(error) => {
                tracing::debug!(%error, "could not read the store's clock; the last measurement stays");
                return;
            }
        };
        let answered = self.clock.now().as_micros();
        let call = answered.saturating_sub(asked);
        if call > duration_to_micros(Overrides::CLOCK_CALL_AT_MOST)
            && self.clock_measured.load(Ordering::Relaxed)
        {
            tracing::debug!(
                call_micros = call,
                "the store's clock took too long to read; the last measurement stays"
            );
            return;
        }
        // The store read its clock about halfway through the call.
        let midpoint = asked + call / 2;
        let offset = i64::try_from(store_time)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::try_from(midpoint).unwrap_or(i64::MAX));
        self.store_offset_micros.store(offset, Ordering::Relaxed);
        self.clock_measured.store(true, Ordering::Relaxed);
    }

    /// Overrides in this process only (a node of its own).
    pub fn in_memory() -> Self {
        Overrides::new(Arc::new(MemoryOverrides::default()), "fg")
    }

    /// At most `max_active` overrides in force at once (so that the admin API cannot fill the
    /// store), each for at most `max_expires_in`.
    pub fn with_bounds(self, max_active: usize, max_expires_in: Duration) -> Self {
        self.set_bounds(max_active, max_expires_in);
        self
    }

    /// [`Overrides::with_bounds`] on overrides in use (a configuration reload): applies to
    /// the next changes; overrides already in force stay.
    pub fn set_bounds(&self, max_active: usize, max_expires_in: Duration) {
        self.max_active.store(max_active, Ordering::Relaxed);
        let millis =
            u64::try_from(max_expires_in.max(MIN_EXPIRES_IN).as_millis()).unwrap_or(u64::MAX);
        self.max_expires_in_ms.store(millis, Ordering::Relaxed);
    }

    /// The most overrides in force at once.
    pub fn max_active(&self) -> usize {
        self.max_active.load(Ordering::Relaxed)
    }

    /// The longest `expires_in`.
    pub fn max_expires_in(&self) -> Duration {
        Duration::from_millis(self.max_expires_in_ms.load(Ordering::Relaxed))
    }

    /// Sets an override of the limit of `target` (one of the client's checks) as `spec` asks,
    /// in force on this node at once and on every node of the store within
    /// [`Overrides::REFRESH_EVERY`]. Answers what was stored.
    pub async fn set(
        &self,
        target: &Check,
        spec: &OverrideSpec,
    ) -> Result<Override, OverrideError> {
        let max_expires_in = self.max_expires_in();
        if spec.expires_in < MIN_EXPIRES_IN || spec.expires_in > max_expires_in {
            return Err(OverrideError::invalid(
                "expires_in",
                format!("must be between 1s and {}s", max_expires_in.as_secs()),
            ));
        }
        let original = &target.limit;
        if original.calendar().is_some() && spec.window.is_some() {
            // The period is the window: a window of another length would count elsewhere.
            return Err(OverrideError::invalid(
                "window",
                "a limit on the calendar keeps its period; override its limit only".to_owned(),
            ));
        }
        let burst = match spec.burst {
            Some(burst) => Some(burst),
            // A burst left at the limit (the default) follows the new limit.
            None if original.algorithm().uses_burst() && original.burst() != original.limit() => {
                Some(original.burst())
            }
            None => None,
        };
        // The store's clock, before reckoning expiry (the refresh after the put reads the rest).
        self.measure_store_clock().await;
        let now = self.now();
        let entry = Override {
            target: target.key.clone(),
            rule: target.rule.clone(),
            name: original.shared_name().clone(),
            limit: spec.limit,
            window: spec.window.unwrap_or_else(|| original.window()),
            burst,
            set_at: now,
            expires_at: now.saturating_add(spec.expires_in),
        };
        entry
            .apply_to(original)
            .map_err(|error| OverrideError::invalid(error.field().as_str(), error.problem()))?;
        let max_active = self.max_active();
        if !self
            .backend
            .put(&self.namespace, &entry, max_active, now)
            .await?
        {
            return Err(OverrideError::Full(max_active));
        }
        if let Err(error) = self.refresh().await {
            // Stored: in force here at once all the same, and on the others when they read it.
            tracing::debug!(%error, "override stored; this node's copy updated without a refresh");
            self.replace_locally(&entry.target, Some(entry.clone()));
        }
        Ok(entry)
    }

    /// Removes the override of `target` (a storage key); whether there was one. Out of force
    /// on this node at once, and on every node within [`Overrides::REFRESH_EVERY`].
    pub async fn remove(&self, target: &str) -> Result<bool, OverrideError> {
        let removed = self.backend.remove(&self.namespace, target).await?;
        if let Err(error) = self.refresh().await {
            // Removed: out of force here at once all the same.
            tracing::debug!(%error, "override removed; this node's copy updated without a refresh");
            self.replace_locally(target, None);
        }
        Ok(removed)
    }

    /// Every override in force, read from the store, ordered by client, rule and limit.
    pub async fn list(&self) -> Result<Vec<Override>, OverrideError> {
        let mut all = self.backend.all(&self.namespace, self.now()).await?;
        all.sort_by(|a, b| a.target.cmp(&b.target));
        Ok(all)
    }

    /// The overrides of the client with hash tag `client` (`<scope>:<hash>`), from the store.
    pub async fn of_client(&self, client: &str) -> Result<Vec<Override>, OverrideError> {
        let mut all = self.list().await?;
        all.retain(|entry| entry.client() == client);
        Ok(all)
    }

    /// What this node has in force now (its copy, as decisions see it).
    pub fn in_force(&self) -> Vec<Override> {
        let now = self.now();
        let mut all: Vec<Override> = self
            .copy()
            .1
            .values()
            .map(|entry| entry.stored.clone())
            .filter(|entry| entry.is_active(now))
            .collect();
        all.sort_by(|a, b| a.target.cmp(&b.target));
        all
    }

    /// The override in force on this node for `target`, if any.
    pub fn in_force_for(&self, target: &str) -> Option<Override> {
        let entry = self.copy().1.get(target)?.stored.clone();
        entry.is_active(self.now()).then_some(entry)
    }

    /// The override that decisions of `check` apply now: in force for its key, and fitting its
    /// limit (an override set before a reload changed the limit's algorithm may not).
    pub fn applied_to(&self, check: &Check) -> Option<Override> {
        let copy = self.copy();
        let entry = copy.1.get(&check.key)?;
        let applies = entry.stored.is_active(self.now()) && entry.limit_for(&check.limit).is_some();
        applies.then(|| entry.stored.clone())
    }

    /// Puts `entry` (or nothing) in this node's copy for `target`, without reading the store.
    fn replace_locally(&self, target: &str, entry: Option<Override>) {
        let _replacing = self
            .replacing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let current = self.in_force.load_full();
        let mut map = current.1.clone();
        match entry {
            Some(entry) => {
                let in_force = InForce {
                    stored: entry,
                    limits: RwLock::new(Vec::new()),
                };
                map.insert(Arc::from(target), Arc::new(in_force));
            }
            None => {
                map.remove(target);
            }
        }
        self.count.store(map.len(), Ordering::Release);
        self.in_force.store(Arc::new((current.0, map)));
    }

    fn copy(&self) -> Arc<(u64, InForceMap)> {
        self.in_force.load_full()
    }

    /// Replaces the limits of `checks` that have an override in force. The first call inside
    /// a Tokio runtime starts the background refresh ([`Overrides::keep_fresh`]); the
    /// decision never waits for it.
    pub fn apply(self: &Arc<Self>, checks: &mut [Check]) {
        self.keep_fresh();
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let now = self.now();
        let copy = self.in_force.load();
        for check in checks {
            let Some(entry) = copy.1.get(&check.key) else {
                continue;
            };
            if !entry.stored.is_active(now) {
                continue;
            }
            if let Some(limit) = entry.limit_for(&check.limit) {
                check.limit = limit;
            }
        }
    }

    /// Starts (once, from inside a Tokio runtime) the task that refreshes this node's copy
    /// every [`Overrides::REFRESH_EVERY`], traffic or not, for as long as the `Overrides`
    /// lives. A failed refresh keeps the last copy (its entries still expire on time).
    pub fn keep_fresh(self: &Arc<Self>) {
        if self.kept_fresh.load(Ordering::Acquire) || tokio::runtime::Handle::try_current().is_err()
        {
            return;
        }
        if self.kept_fresh.swap(true, Ordering::AcqRel) {
            return;
        }
        let overrides = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(Overrides::REFRESH_EVERY);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(overrides) = overrides.upgrade() else {
                    return;
                };
                if let Err(error) = overrides.refresh().await {
                    tracing::debug!(%error, "could not refresh the overrides; the last copy stays in force");
                }
            }
        });
    }

    /// Reads what is in force from the store now: the version, and the whole list if it
    /// changed (or at least every 10 s). A failure keeps the last copy (its entries still
    /// expire on time).
    pub async fn refresh(&self) -> Result<(), StoreError> {
        let refresh = self.refreshes.fetch_add(1, Ordering::AcqRel) + 1;
        self.measure_store_clock().await;
        let version = self.backend.version(&self.namespace).await?;
        let local = self.clock.now().as_micros();
        let read_all_due = local.saturating_sub(self.read_all_at.load(Ordering::Acquire))
            >= duration_to_micros(Overrides::READ_ALL_EVERY);
        if version != self.version.load(Ordering::Acquire) || read_all_due {
            let all = self.backend.all(&self.namespace, self.now()).await?;
            let previous = self.copy();
            let map: InForceMap = all
                .into_iter()
                .map(|entry| {
                    // An unchanged entry keeps the limits already made from it.
                    let kept = previous
                        .1
                        .get(&entry.target)
                        .filter(|old| old.stored == entry)
                        .cloned();
                    let in_force = kept.unwrap_or_else(|| {
                        Arc::new(InForce {
                            stored: entry.clone(),
                            limits: RwLock::new(Vec::new()),
                        })
                    });
                    (entry.target.clone(), in_force)
                })
                .collect();
            let _replacing = self
                .replacing
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if self.in_force.load().0 > refresh {
                // A later refresh read after this one did: its copy stays.
                return Ok(());
            }
            self.count.store(map.len(), Ordering::Release);
            metrics::gauge!(crate::telemetry::OVERRIDES_ACTIVE).set(map.len() as f64);
            self.in_force.store(Arc::new((refresh, map)));
            self.version.store(version, Ordering::Release);
            self.read_all_at.store(local, Ordering::Release);
        }
        Ok(())
    }
}

/// Counts an operator's change of overrides in `floodgate_overrides_total{action}`: `set`,
/// `removed` or `refused` (the bound on overrides in force).
pub fn record_change(action: &'static str) {
    metrics::counter!(crate::telemetry::OVERRIDES_TOTAL, "action" => action).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(name: &str, limit: Limit) -> Check {
        Check::new(format!("fg:{{key:abc}}:default:{name}"), Arc::new(limit), 1)
    }

    #[test]
    fn a_spec_reads_durations_and_names_its_bad_fields() {
        let spec = OverrideSpec::from_json(&json!({
            "name": "per-second", "limit": 100, "window": "1s", "burst": 100, "expires_in": "2h"
        }))
        .unwrap();
        assert_eq!(spec.window, Some(Duration::from_secs(1)));
        assert_eq!(spec.expires_in, Duration::from_secs(7200));
        let error = |body: Value| OverrideSpec::from_json(&body).unwrap_err().to_string();
        assert_eq!(
            error(json!({"name": "a", "limit": 1})),
            "expires_in: is required"
        );
        assert!(error(json!({"name": "a", "limit": -1, "expires_in": 5})).starts_with("limit:"));
        assert!(
            error(json!({"name": "a", "limit": 1, "expires_in": "soon"}))
                .starts_with("expires_in:")
        );
        assert!(error(json!({"name": "a", "limit": 1, "expires_in": 5, "x": 1})).starts_with("x:"));
        assert_eq!(error(json!([1])), "body: must be a JSON object");
    }

    #[test]
    fn an_override_round_trips_through_its_stored_form() {
        let now = Timestamp::from_secs(1_700_000_000);
        let entry = Override {
            target: Arc::from("fg:{key:abc}:default:m"),
            rule: Arc::from("default"),
            name: Arc::from("m"),
            limit: 7,
            window: Duration::from_millis(1500),
            burst: Some(3),
            set_at: now,
            expires_at: now.saturating_add(Duration::from_secs(60)),
        };
        assert_eq!(Override::from_json(&entry.to_json()), Some(entry.clone()));
        assert_eq!(entry.client(), "key:abc");
        assert_eq!(entry.remaining_secs(now), 60);
    }

    #[tokio::test]
    async fn set_apply_and_remove_on_one_node() {
        let overrides = Arc::new(Overrides::in_memory());
        let original = check(
            "m",
            Limit::token_bucket("m", 10, Duration::from_secs(1)).unwrap(),
        );
        let stored = overrides
            .set(
                &original,
                &OverrideSpec::new("m", 100, Duration::from_secs(60)),
            )
            .await
            .unwrap();
        // The burst was the limit: it follows the new limit.
        assert_eq!(stored.burst, None);
        let mut checks = vec![original.clone()];
        overrides.apply(&mut checks);
        assert_eq!(checks[0].limit.limit(), 100);
        assert_eq!(checks[0].limit.burst(), 100);
        assert_eq!(checks[0].limit.name(), "m");
        assert_eq!(checks[0].key, original.key);
        assert!(overrides.remove(&original.key).await.unwrap());
        let mut checks = vec![original.clone()];
        overrides.apply(&mut checks);
        assert_eq!(checks[0].limit.limit(), 10);
    }

    /// A calendar quota overridden keeps its period (its counter, its period's end); a
    /// `window` for it is refused. Fails when the override rebuilt the limit from its nominal
    /// window: a 30-day window from the epoch, counting elsewhere.
    #[tokio::test]
    async fn an_override_of_a_calendar_limit_keeps_its_period() {
        let month = crate::calendar::CalendarPeriod::new(crate::calendar::Period::Month, "UTC")
            .and_then(|month| month.anchored("15"))
            .unwrap();
        let limit = Limit::builder("monthly")
            .algorithm(crate::Algorithm::FixedWindow)
            .limit(1000)
            .calendar(month.clone())
            .build()
            .unwrap();
        let original = check("monthly", limit);
        let overrides = Arc::new(Overrides::in_memory());
        overrides
            .set(
                &original,
                &OverrideSpec::new("monthly", 5000, Duration::from_secs(60)),
            )
            .await
            .unwrap();
        let mut checks = vec![original.clone()];
        overrides.apply(&mut checks);
        assert_eq!(checks[0].limit.limit(), 5000);
        assert_eq!(checks[0].limit.calendar(), Some(&month));
        let now = 1_796_205_600_000_000; // 2026-12-02T10:00:00Z
        assert_eq!(
            checks[0].limit.window_bounds(now),
            original.limit.window_bounds(now),
            "the same period: November 15 to December 15"
        );
        let mut with_window = OverrideSpec::new("monthly", 5000, Duration::from_secs(60));
        with_window.window = Some(Duration::from_secs(86_400));
        assert!(matches!(
            overrides.set(&original, &with_window).await,
            Err(OverrideError::Invalid { ref field, .. }) if field == "window"
        ));
    }

    #[tokio::test]
    async fn the_bound_and_the_expiry_limits_are_enforced() {
        let overrides = Overrides::in_memory().with_bounds(1, Duration::from_secs(3600));
        let a = check(
            "a",
            Limit::fixed_window("a", 10, Duration::from_secs(60)).unwrap(),
        );
        let b = check(
            "b",
            Limit::fixed_window("b", 10, Duration::from_secs(60)).unwrap(),
        );
        let spec =
            |name: &str, expires: u64| OverrideSpec::new(name, 20, Duration::from_secs(expires));
        assert!(matches!(
            overrides.set(&a, &spec("a", 3601)).await,
            Err(OverrideError::Invalid { ref field, .. }) if field == "expires_in"
        ));
        overrides.set(&a, &spec("a", 60)).await.unwrap();
        // Replacing the one in force is not a new one.
        overrides.set(&a, &spec("a", 120)).await.unwrap();
        assert!(matches!(
            overrides.set(&b, &spec("b", 60)).await,
            Err(OverrideError::Full(1))
        ));
        // A burst for an algorithm without one is refused with its field.
        let mut with_burst = spec("a", 60);
        with_burst.burst = Some(5);
        assert!(matches!(
            overrides.set(&a, &with_burst).await,
            Err(OverrideError::Invalid { ref field, .. }) if field == "burst"
        ));
    }
}
