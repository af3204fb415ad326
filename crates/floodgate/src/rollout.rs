//! Safe rollout: shadow mode, a canary share of enforced identities, and a kill switch, all
//! changeable at runtime through [`Rollout`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

use crate::key::IdentityHash;

/// How limits are applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Denials are enforced (for the canary share of identities; the rest are shadowed).
    #[default]
    Enforce,
    /// Counters are consumed and would-be denials counted and logged; nothing is blocked.
    Shadow,
    /// Kill switch: no limiting and no store calls at all.
    Off,
}

impl Mode {
    /// The name configuration files use: `enforce`, `shadow`, `off`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
            Mode::Off => "off",
        }
    }

    fn from_u8(value: u8) -> Mode {
        match value {
            1 => Mode::Shadow,
            2 => Mode::Off,
            _ => Mode::Enforce,
        }
    }

    fn as_u8(self) -> u8 {
        match self {
            Mode::Enforce => 0,
            Mode::Shadow => 1,
            Mode::Off => 2,
        }
    }
}

/// A request extension the layer adds next to the request's [`Decision`](crate::Decision)
/// when that decision is not enforced (shadow mode, or a canary outside its share): whoever
/// logs the request can tell a shadow denial from one the client got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shadowed;

/// The rollout controls of one layer; clones share them, so a handle kept by the app switches
/// a running service (the kill switch takes effect on the next request).
#[derive(Clone, Debug)]
pub struct Rollout {
    inner: Arc<RolloutInner>,
}

#[derive(Debug)]
struct RolloutInner {
    mode: AtomicU8,
    /// Enforced share of identities, in hundredths of a percent (10,000 = all).
    enforce_basis_points: AtomicU32,
    /// Second and count of the shadow log lines, to bound them.
    log_window: AtomicU64,
}

/// At most this many shadow denials are logged per second; all are counted.
const SHADOW_LOGS_PER_SECOND: u64 = 10;

impl Default for Rollout {
    fn default() -> Self {
        Rollout::new(Mode::Enforce, 100.0)
    }
}

impl std::str::FromStr for Mode {
    type Err = String;

    /// `enforce`, `shadow` or `off`; the error says which names exist.
    fn from_str(text: &str) -> Result<Mode, String> {
        match text {
            "enforce" => Ok(Mode::Enforce),
            "shadow" => Ok(Mode::Shadow),
            "off" => Ok(Mode::Off),
            other => Err(format!(
                "unknown mode `{other}`; expected enforce, shadow or off"
            )),
        }
    }
}

impl Rollout {
    /// Controls starting in `mode`, enforcing `enforce_percent` of identities (clamped to 0..=100).
    pub fn new(mode: Mode, enforce_percent: f64) -> Self {
        let rollout = Rollout {
            inner: Arc::new(RolloutInner {
                mode: AtomicU8::new(mode.as_u8()),
                enforce_basis_points: AtomicU32::new(10_000),
                log_window: AtomicU64::new(0),
            }),
        };
        rollout.set_enforce_percent(enforce_percent);
        rollout
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        Mode::from_u8(self.inner.mode.load(Ordering::Relaxed))
    }

    /// Switches the mode at runtime.
    pub fn set_mode(&self, mode: Mode) {
        self.inner.mode.store(mode.as_u8(), Ordering::Relaxed);
    }

    /// Sets the enforced share of identities (0 to 100; a stable hash decides who is in).
    pub fn set_enforce_percent(&self, percent: f64) {
        let basis_points = if percent.is_finite() {
            (percent.clamp(0.0, 100.0) * 100.0).round() as u32
        } else {
            10_000
        };
        self.inner
            .enforce_basis_points
            .store(basis_points, Ordering::Relaxed);
    }

    /// The enforced share of identities, in percent.
    pub fn enforce_percent(&self) -> f64 {
        f64::from(self.inner.enforce_basis_points.load(Ordering::Relaxed)) / 100.0
    }

    /// Whether every identity is enforced (no canary), so no identity needs hashing.
    pub fn enforces_everyone(&self) -> bool {
        self.inner.enforce_basis_points.load(Ordering::Relaxed) >= 10_000
    }

    /// Whether `identity` is enforced (rather than shadowed) under the canary share. The same
    /// identity gets the same answer on every request and across restarts.
    pub fn enforces(&self, identity: &IdentityHash) -> bool {
        let basis_points = self.inner.enforce_basis_points.load(Ordering::Relaxed);
        if basis_points >= 10_000 {
            return true;
        }
        let mut first = [0u8; 8];
        first.copy_from_slice(&identity.0[..8]);
        (u64::from_be_bytes(first) % 10_000) < u64::from(basis_points)
    }

    /// Whether a shadow denial may be logged now (a few per second; the rest only counted).
    pub(crate) fn may_log_shadow(&self) -> bool {
        let second = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        let window = &self.inner.log_window;
        let mut current = window.load(Ordering::Relaxed);
        loop {
            let (window_second, count) = (current >> 16, current & 0xffff);
            let next = if window_second == second & 0xffff_ffff_ffff {
                if count >= SHADOW_LOGS_PER_SECOND {
                    return false;
                }
                current + 1
            } else {
                ((second & 0xffff_ffff_ffff) << 16) | 1
            };
            match window.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Identity;

    #[test]
    fn the_canary_share_is_stable_and_close_to_the_percent() {
        let rollout = Rollout::new(Mode::Enforce, 30.0);
        let hashes: Vec<IdentityHash> = (0..10_000)
            .map(|client| Identity::ApiKey(format!("key-{client}")).hash())
            .collect();
        let enforced = hashes.iter().filter(|hash| rollout.enforces(hash)).count();
        assert!((2_800..=3_200).contains(&enforced), "{enforced} of 10,000");
        // Stable: another instance (a restart, another replica) built from the identities anew
        // enforces exactly the same ones, and widening the canary only adds identities.
        let restarted = Rollout::new(Mode::Enforce, 30.0);
        let wider = Rollout::new(Mode::Enforce, 50.0);
        for (client, hash) in hashes.iter().enumerate() {
            let rehashed = Identity::ApiKey(format!("key-{client}")).hash();
            assert_eq!(rollout.enforces(hash), restarted.enforces(&rehashed));
            assert!(
                !rollout.enforces(hash) || wider.enforces(hash),
                "key-{client}"
            );
        }
        rollout.set_enforce_percent(100.0);
        assert!(hashes.iter().all(|hash| rollout.enforces(hash)));
        rollout.set_enforce_percent(0.0);
        assert!(!hashes.iter().any(|hash| rollout.enforces(hash)));
    }

    #[test]
    fn shadow_logs_are_bounded_per_second() {
        let rollout = Rollout::default();
        let logged = (0..1000).filter(|_| rollout.may_log_shadow()).count() as u64;
        // Two seconds at most can be spanned by this loop.
        assert!(
            (SHADOW_LOGS_PER_SECOND..=2 * SHADOW_LOGS_PER_SECOND).contains(&logged),
            "{logged}"
        );
    }
}
