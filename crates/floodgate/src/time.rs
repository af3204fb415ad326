//! Time as the limiter sees it: whole microseconds since the Unix epoch.
//!
//! Every algorithm works on integer microseconds so that the Rust functions and the Lua scripts
//! (whose numbers are IEEE doubles, exact for integers below 2^53) compute identical results.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time: microseconds since the Unix epoch.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The Unix epoch.
    pub const EPOCH: Timestamp = Timestamp(0);

    /// A timestamp `micros` microseconds after the Unix epoch.
    pub const fn from_micros(micros: u64) -> Self {
        Timestamp(micros)
    }

    /// A timestamp `secs` seconds after the Unix epoch.
    pub const fn from_secs(secs: u64) -> Self {
        Timestamp(secs * 1_000_000)
    }

    /// Microseconds since the Unix epoch.
    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// Whole seconds since the Unix epoch, rounded up (for `X-RateLimit-Reset`).
    pub const fn as_secs_ceil(self) -> u64 {
        self.0.div_ceil(1_000_000)
    }

    /// The current wall-clock time.
    pub fn now() -> Self {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Timestamp(duration_to_micros(since_epoch))
    }

    /// This timestamp moved `by` later, saturating.
    pub fn saturating_add(self, by: Duration) -> Self {
        Timestamp(self.0.saturating_add(duration_to_micros(by)))
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Timestamp({}.{:06}s)",
            self.0 / 1_000_000,
            self.0 % 1_000_000
        )
    }
}

/// Converts a duration to whole microseconds, saturating at `u64::MAX`.
pub(crate) fn duration_to_micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

/// A source of the current time, injected into the memory store so that tests control time.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The system's wall clock, read cheaply.
///
/// Reading `SystemTime` costs a system call's worth of time (30+ ns on virtual machines), more
/// than the rest of a memory-store decision. This clock reads the CPU's invariant time-stamp
/// counter through `quanta` (a few ns) and adds an offset to the wall clock that is re-taken
/// every second, so it follows NTP adjustments within a second; where no usable TSC exists,
/// `quanta` falls back to the OS clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

struct Anchor {
    counter: quanta::Clock,
    start: quanta::Instant,
    /// Wall-clock micros minus counter micros since `start`.
    offset_micros: std::sync::atomic::AtomicI64,
    /// Counter micros at which the offset is re-taken.
    next_anchor_micros: AtomicU64,
}

const REANCHOR_EVERY_MICROS: u64 = 1_000_000;

fn anchor() -> &'static Anchor {
    static ANCHOR: std::sync::OnceLock<Anchor> = std::sync::OnceLock::new();
    ANCHOR.get_or_init(|| {
        let counter = quanta::Clock::new();
        let start = counter.now();
        Anchor {
            counter,
            start,
            offset_micros: std::sync::atomic::AtomicI64::new(Timestamp::now().as_micros() as i64),
            next_anchor_micros: AtomicU64::new(REANCHOR_EVERY_MICROS),
        }
    })
}

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let anchor = anchor();
        let elapsed = duration_to_micros(anchor.counter.now().duration_since(anchor.start));
        if elapsed >= anchor.next_anchor_micros.load(Ordering::Relaxed) {
            // Racing threads compute the same offset to within microseconds; either wins.
            let wall = Timestamp::now().as_micros() as i64;
            anchor
                .offset_micros
                .store(wall - elapsed as i64, Ordering::Relaxed);
            anchor
                .next_anchor_micros
                .store(elapsed + REANCHOR_EVERY_MICROS, Ordering::Relaxed);
        }
        let offset = anchor.offset_micros.load(Ordering::Relaxed);
        Timestamp((elapsed as i64 + offset).max(0) as u64)
    }
}

/// A clock that never steps: the wall clock's time when it was made, advanced since by the
/// CPU's monotonic counter alone (through `quanta`, as [`SystemClock`]).
///
/// For what measures elapsed time against another clock: a batched node adds the offset to
/// the shared store's clock it measured at its last trade. [`SystemClock`] re-takes the wall
/// clock every second, so a step of the host's clock (NTP stepping it, a resumed virtual
/// machine, an operator's `date`) would reach such a node between two trades: a step back
/// would hold its idea of the shared store's time behind, and it could spend an ended window's
/// lease in the next one. This clock lets the node's next trade measure the offset again
/// instead. It drifts from the wall clock as the counter does (parts per million).
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock {
    /// The wall clock's micros when the clock was made, minus the counter's micros then.
    offset_micros: i64,
}

impl MonotonicClock {
    /// A clock that starts at the wall clock's time now.
    pub fn new() -> Self {
        MonotonicClock::starting_at(Timestamp::now())
    }

    /// A clock that starts at `start` and advances with the monotonic counter.
    pub fn starting_at(start: Timestamp) -> Self {
        MonotonicClock {
            offset_micros: start.as_micros() as i64 - counter_micros() as i64,
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        MonotonicClock::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Timestamp {
        Timestamp((counter_micros() as i64 + self.offset_micros).max(0) as u64)
    }
}

/// Micros of the monotonic counter since the process first read it.
fn counter_micros() -> u64 {
    let anchor = anchor();
    duration_to_micros(anchor.counter.now().duration_since(anchor.start))
}

/// A clock that moves only when told to. Clones share one time, so a test can keep a handle
/// while the store owns another.
#[derive(Clone, Debug, Default)]
pub struct FakeClock {
    micros: Arc<AtomicU64>,
}

impl FakeClock {
    /// A fake clock stopped at `start`.
    pub fn new(start: Timestamp) -> Self {
        FakeClock {
            micros: Arc::new(AtomicU64::new(start.as_micros())),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.micros
            .fetch_add(duration_to_micros(by), Ordering::SeqCst);
    }

    /// Sets the clock to `to` (which may be earlier: the algorithms tolerate a clock that steps back).
    pub fn set(&self, to: Timestamp) {
        self.micros.store(to.as_micros(), Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.micros.load(Ordering::SeqCst))
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A monotonic clock starts where it is told and moves only with the counter: a start far
    /// from the wall clock (as after the host's clock stepped) stays that far, never re-taken.
    #[test]
    fn a_monotonic_clock_keeps_its_start_and_never_steps_back() {
        let wall = Timestamp::now().as_micros();
        let start = Timestamp::from_micros(wall - 30_000_000);
        let clock = MonotonicClock::starting_at(start);
        let mut last = clock.now().as_micros();
        assert!(last >= start.as_micros() && last - start.as_micros() < 50_000);
        let until = std::time::Instant::now() + Duration::from_millis(1_100);
        // Across a second, when SystemClock re-takes the wall clock.
        while std::time::Instant::now() < until {
            let now = clock.now().as_micros();
            assert!(now >= last, "stepped back from {last} to {now}");
            last = now;
        }
        let behind = Timestamp::now().as_micros() - last;
        assert!(
            (29_900_000..30_100_000).contains(&behind),
            "still 30 s behind the wall clock: {behind} µs"
        );
    }

    #[test]
    fn system_clock_tracks_the_wall_clock() {
        for _ in 0..1000 {
            let fast = SystemClock.now().as_micros();
            let wall = Timestamp::now().as_micros();
            // Generous: the two reads are not simultaneous and the offset is refreshed each second.
            assert!(fast.abs_diff(wall) < 50_000, "fast {fast} vs wall {wall}");
        }
    }
}
