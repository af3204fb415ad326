//! The concurrency limit's controller: a gradient on latency, as Envoy's
//! `adaptive_concurrency` filter computes it, with its minimum round trip learned from live
//! traffic instead of by pinning concurrency low (which refuses requests to measure).
//!
//! Each window of completed requests gives a sample latency (a percentile) and the peak
//! number in flight. Then
//!
//! ```text
//! gradient  = clamp(max(min_rtt × (1 + buffer), latency_floor) / sample, 0.5, 2)
//! target    = gradient × limit + √limit          (√limit: room for a short queue)
//! limit     = clamp(limit + smoothing × (target − limit), min_limit, max_limit)
//! ```
//!
//! Latency at the upstream's minimum (plus the buffer) lets the limit grow by up to √limit a
//! window; latency above it shrinks the limit in proportion, by at most half a window.
//! Latency under `latency_floor` (5 ms) never shrinks it: a fast upstream's round trip of tens
//! of microseconds grows to a millisecond or two when the gateway's own CPU is busy, and read
//! as queueing that collapsed the limit to its minimum, the 503s it then sent kept the CPU busy
//! (measured: a gateway whose 64 connections saturated it served 8 % of what it served
//! without the limiter). A queue of a few milliseconds is not what shedding protects against.
//! The limit does not grow from a window whose peak in flight stayed under half the limit
//! and in which nothing was refused: the traffic, not the upstream, set that window's latency.
//!
//! `min_rtt` follows the lowest window minimum at once. It rises only from windows in which
//! the limit did not bind (nothing refused, the limit never reached) (a queue the limit itself builds must not read as the upstream's
//! own latency), by `min_rtt_drift` of the way each window: an upstream that got slower for
//! good is followed once the pressure lifts. Under sustained pressure, a slower upstream is
//! therefore served at a limit lower than it could take, never a higher one.

use std::time::Duration;

/// How the limit follows latency.
#[derive(Clone, Debug, PartialEq)]
pub struct GradientSettings {
    /// The limit before the first window.
    pub initial_limit: u32,
    /// The lowest limit: requests always get through this many at a time.
    pub min_limit: u32,
    /// The highest limit.
    pub max_limit: u32,
    /// The latency percentile sampled per window (0.5 to 1).
    pub percentile: f64,
    /// The share above `min_rtt` that counts as no queueing (Envoy's default, 25 %).
    pub buffer: f64,
    /// A sampled latency at or below it never shrinks the limit (5 ms; zero: Envoy's gradient
    /// as it is).
    pub latency_floor: Duration,
    /// How far the limit moves toward its target per window (0 to 1).
    pub smoothing: f64,
    /// How far `min_rtt` rises toward a higher window minimum per window in which the limit
    /// did not bind (0 to 1).
    pub min_rtt_drift: f64,
    /// The shortest window.
    pub window: Duration,
    /// The fewest completed requests a window needs: a window with fewer goes on.
    pub min_samples: usize,
}

impl Default for GradientSettings {
    fn default() -> Self {
        GradientSettings {
            initial_limit: 20,
            min_limit: 2,
            max_limit: 1_000,
            percentile: 0.9,
            buffer: 0.25,
            latency_floor: Duration::from_millis(5),
            smoothing: 0.5,
            min_rtt_drift: 0.1,
            window: Duration::from_millis(500),
            min_samples: 20,
        }
    }
}

impl GradientSettings {
    /// The first setting out of range, by name.
    pub fn validate(&self) -> Result<(), &'static str> {
        let checks: [(bool, &'static str); 8] = [
            (self.min_limit >= 1, "min_limit: at least 1"),
            (
                self.max_limit >= self.min_limit,
                "max_limit: at least min_limit",
            ),
            (
                (self.min_limit..=self.max_limit).contains(&self.initial_limit),
                "initial_limit: between min_limit and max_limit",
            ),
            (
                (0.5..=1.0).contains(&self.percentile),
                "percentile: 0.5 to 1",
            ),
            ((0.0..=10.0).contains(&self.buffer), "buffer: 0 to 10"),
            (
                self.smoothing > 0.0 && self.smoothing <= 1.0,
                "smoothing: above 0, at most 1",
            ),
            (
                (0.0..=1.0).contains(&self.min_rtt_drift),
                "min_rtt_drift: 0 to 1",
            ),
            (!self.window.is_zero(), "window: above zero"),
        ];
        match checks.into_iter().find(|(ok, _)| !ok) {
            Some((_, error)) => Err(error),
            None => Ok(()),
        }
    }
}

/// What one window of completed requests showed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowSample {
    /// The sampled percentile of their latencies.
    pub latency: Duration,
    /// The lowest latency among them.
    pub min_latency: Duration,
    /// The most requests in flight at once during the window.
    pub peak_in_flight: u32,
    /// Whether the limit refused a request during the window (a class's ceiling below the
    /// limit can bind while the total in flight stays under it).
    pub refused: bool,
}

/// The gradient controller: the limit, and the minimum round trip it compares against.
#[derive(Clone, Debug)]
pub struct Gradient {
    settings: GradientSettings,
    limit: f64,
    min_rtt: Option<Duration>,
}

impl Gradient {
    /// A controller at `settings.initial_limit`, with no round trip seen yet.
    pub fn new(settings: GradientSettings) -> Gradient {
        Gradient {
            limit: f64::from(settings.initial_limit),
            settings,
            min_rtt: None,
        }
    }

    /// The limit in force: how many requests may be in flight.
    pub fn limit(&self) -> u32 {
        // Within [min_limit, max_limit], both u32.
        self.limit.round() as u32
    }

    /// The minimum round trip learned so far.
    pub fn min_rtt(&self) -> Option<Duration> {
        self.min_rtt
    }

    /// The settings.
    pub fn settings(&self) -> &GradientSettings {
        &self.settings
    }

    /// Takes one window's `sample` into account; returns the new limit.
    pub fn on_window(&mut self, sample: WindowSample) -> u32 {
        let limit = self.limit;
        let bound = sample.refused || f64::from(sample.peak_in_flight) >= limit.round();
        let min_rtt = self.learn_min_rtt(sample, bound);
        let latency = sample.latency.as_secs_f64().max(1e-6);
        let expected = (min_rtt.as_secs_f64() * (1.0 + self.settings.buffer))
            .max(self.settings.latency_floor.as_secs_f64());
        let gradient = (expected / latency).clamp(0.5, 2.0);
        let mut target = gradient * limit + limit.sqrt();
        if f64::from(sample.peak_in_flight) < limit / 2.0 && !sample.refused {
            // The traffic kept the window's concurrency low: nothing says more would do. A
            // refusal does (a client held to its share of a class under half the limit): the
            // limit then grows as far as the latency allows.
            target = target.min(limit);
        }
        let next = limit + self.settings.smoothing * (target - limit);
        self.limit = next.clamp(
            f64::from(self.settings.min_limit),
            f64::from(self.settings.max_limit),
        );
        self.limit()
    }

    /// Updates `min_rtt` from a window (`bound`: the limit was reached in it).
    fn learn_min_rtt(&mut self, sample: WindowSample, bound: bool) -> Duration {
        let seen = sample.min_latency;
        let learned = match self.min_rtt {
            None => seen,
            Some(known) if seen <= known => seen,
            Some(known) if bound => known,
            Some(known) => known + (seen - known).mul_f64(self.settings.min_rtt_drift),
        };
        self.min_rtt = Some(learned);
        learned
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream of `workers` workers, each request taking `service`: with `in_flight`
    /// requests at once, those beyond the workers queue, and every request waits its share
    /// (Little's law: latency = service × in_flight / workers once the workers are busy).
    struct Upstream {
        workers: f64,
        service: Duration,
    }

    impl Upstream {
        fn window_at(&self, in_flight: u32) -> WindowSample {
            let load = (f64::from(in_flight) / self.workers).max(1.0);
            WindowSample {
                latency: self.service.mul_f64(load * 1.05),
                min_latency: self.service.mul_f64(load),
                peak_in_flight: in_flight,
                refused: false,
            }
        }
    }

    /// Drives `controller` for `windows` windows of traffic that always fills the limit.
    fn saturate(controller: &mut Gradient, upstream: &Upstream, windows: usize) -> Vec<u32> {
        (0..windows)
            .map(|_| controller.on_window(upstream.window_at(controller.limit())))
            .collect()
    }

    fn upstream(workers: f64, service_ms: u64) -> Upstream {
        Upstream {
            workers,
            service: Duration::from_millis(service_ms),
        }
    }

    #[test]
    fn converges_near_the_upstreams_capacity_from_below_and_from_above() {
        let up = upstream(50.0, 20);
        for initial in [5, 400] {
            let mut controller = Gradient::new(GradientSettings {
                initial_limit: initial,
                ..GradientSettings::default()
            });
            // Learn the minimum round trip first, as live traffic under the capacity does.
            controller.on_window(up.window_at(10));
            let limits = saturate(&mut controller, &up, 60);
            let settled = &limits[40..];
            for &limit in settled {
                // At least the workers (no capacity left idle), at most a short queue on top.
                assert!(
                    (50..=90).contains(&limit),
                    "from {initial}: {limit} ({limits:?})"
                );
            }
        }
    }

    #[test]
    fn follows_a_capacity_that_halves_and_returns_within_ten_windows() {
        let mut controller = Gradient::new(GradientSettings::default());
        controller.on_window(upstream(40.0, 20).window_at(10));
        saturate(&mut controller, &upstream(40.0, 20), 40);
        let full = controller.limit();
        // Half the workers: the queue doubles the latency and the limit follows down.
        let halved = saturate(&mut controller, &upstream(20.0, 20), 10);
        assert!(
            *halved.last().unwrap() <= full * 2 / 3,
            "{full} then {halved:?}"
        );
        assert!(
            *halved.last().unwrap() >= 20,
            "never below the capacity: {halved:?}"
        );
        let back = saturate(&mut controller, &upstream(40.0, 20), 10);
        assert!(
            *back.last().unwrap() >= 40,
            "back at the full capacity within 10 windows: {back:?}"
        );
    }

    #[test]
    fn a_sudden_stall_halves_the_limit_per_window_down_to_the_floor() {
        let settings = GradientSettings {
            initial_limit: 512,
            min_limit: 4,
            smoothing: 1.0,
            ..GradientSettings::default()
        };
        let mut controller = Gradient::new(settings);
        controller.on_window(upstream(1_000.0, 10).window_at(10));
        let stalled = WindowSample {
            latency: Duration::from_secs(10),
            min_latency: Duration::from_secs(5),
            peak_in_flight: 1_000,
            refused: true,
        };
        let limits: Vec<u32> = (0..24).map(|_| controller.on_window(stalled)).collect();
        for pair in limits.windows(2) {
            let (before, after) = (f64::from(pair[0]), f64::from(pair[1]));
            // Gradient clamped at 0.5: halved plus the √limit allowance, never faster.
            assert!(after >= (before * 0.5).floor(), "{limits:?}");
            assert!(after <= (before * 0.5 + before.sqrt()).ceil(), "{limits:?}");
        }
        assert!(limits[3] <= 64, "an eighth within four windows: {limits:?}");
        // 0.5 × 4 + √4 = 4: the floor is also where the allowance holds the limit.
        assert_eq!(*limits.last().unwrap(), 4, "down to min_limit: {limits:?}");
        assert_eq!(
            controller.min_rtt(),
            Some(Duration::from_millis(10)),
            "a stall under pressure does not raise min_rtt"
        );
    }

    #[test]
    fn the_limit_is_clamped_and_grows_at_most_twofold_plus_its_root() {
        let mut controller = Gradient::new(GradientSettings {
            initial_limit: 10,
            max_limit: 30,
            smoothing: 1.0,
            latency_floor: Duration::ZERO,
            ..GradientSettings::default()
        });
        // No queueing at all, every window full: growth as fast as the clamp allows.
        let quiet = |limit: u32| WindowSample {
            latency: Duration::from_millis(1),
            min_latency: Duration::from_millis(1),
            peak_in_flight: limit,
            refused: false,
        };
        controller.on_window(quiet(10));
        // gradient = 1.25 (min_rtt × 1.25 over the same latency): 10 × 1.25 + √10.
        assert_eq!(controller.limit(), 16);
        for _ in 0..5 {
            controller.on_window(quiet(controller.limit()));
        }
        assert_eq!(controller.limit(), 30, "held at max_limit");
    }

    /// Measured through the gateway (BENCHMARKS, "adaptive concurrency's cost"): a fast
    /// upstream's round trip of 25 µs, sampled at 1.1-1.6 ms while 64 connections kept the
    /// gateway's CPU busy, drove the limit from 20 to 5, and the 503s kept the CPU as busy.
    #[test]
    fn a_latency_under_the_floor_never_shrinks_the_limit() {
        let busy = WindowSample {
            latency: Duration::from_micros(1_500),
            min_latency: Duration::from_micros(25),
            peak_in_flight: 20,
            refused: true,
        };
        let mut floored = Gradient::new(GradientSettings::default());
        let mut bare = Gradient::new(GradientSettings {
            latency_floor: Duration::ZERO,
            ..GradientSettings::default()
        });
        for _ in 0..10 {
            floored.on_window(busy);
            bare.on_window(busy);
        }
        // Refused while under half the limit (one client held to its share of its class):
        // the latency allows more, so the limit grows.
        assert!(floored.limit() > 100, "{}", floored.limit());
        assert!(
            bare.limit() <= 7,
            "Envoy's gradient alone falls toward 4, where √limit holds it: {}",
            bare.limit()
        );
        // Above the floor the gradient applies as before: 10 ms against 5 ms halves it.
        let slow = WindowSample {
            latency: Duration::from_millis(10),
            ..busy
        };
        let before = floored.limit();
        floored.on_window(slow);
        assert!(
            floored.limit() < before,
            "{} then {}",
            before,
            floored.limit()
        );
    }

    #[test]
    fn a_window_the_traffic_kept_small_does_not_raise_the_limit() {
        let mut controller = Gradient::new(GradientSettings::default());
        for _ in 0..20 {
            controller.on_window(upstream(100.0, 10).window_at(3));
        }
        assert_eq!(
            controller.limit(),
            20,
            "idle windows leave the limit where it was"
        );
    }

    #[test]
    fn min_rtt_drifts_up_only_from_windows_the_limit_did_not_bind() {
        let mut controller = Gradient::new(GradientSettings::default());
        controller.on_window(upstream(100.0, 10).window_at(5));
        assert_eq!(controller.min_rtt(), Some(Duration::from_millis(10)));
        // The upstream is slower for good (40 ms), and the limit binds: min_rtt stays, so the
        // limit can only be too low, never too high.
        let slow = upstream(100.0, 40);
        for _ in 0..10 {
            controller.on_window(slow.window_at(controller.limit()));
        }
        assert_eq!(controller.min_rtt(), Some(Duration::from_millis(10)));
        // Pressure lifts (half the limit in flight): min_rtt follows the slower upstream.
        for _ in 0..60 {
            let limit = controller.limit();
            controller.on_window(slow.window_at((limit / 2).max(1)));
        }
        let learned = controller.min_rtt().unwrap();
        assert!(
            learned >= Duration::from_millis(39) && learned <= Duration::from_millis(40),
            "{learned:?}"
        );
        // A faster upstream is learned at once.
        controller.on_window(upstream(100.0, 5).window_at(2));
        assert_eq!(controller.min_rtt(), Some(Duration::from_millis(5)));
    }

    #[test]
    fn a_window_with_refusals_does_not_raise_min_rtt_even_under_the_limit() {
        let mut controller = Gradient::new(GradientSettings::default());
        controller.on_window(upstream(100.0, 10).window_at(5));
        // A class's ceiling refused requests while the total stayed at half the limit: the
        // queue behind the latency may be the limit's own.
        let queued = WindowSample {
            latency: Duration::from_millis(60),
            min_latency: Duration::from_millis(50),
            peak_in_flight: controller.limit() / 2,
            refused: true,
        };
        for _ in 0..20 {
            controller.on_window(queued);
        }
        assert_eq!(controller.min_rtt(), Some(Duration::from_millis(10)));
    }

    #[test]
    fn settings_out_of_range_are_named() {
        let bad = GradientSettings {
            percentile: 0.2,
            ..GradientSettings::default()
        };
        assert_eq!(bad.validate(), Err("percentile: 0.5 to 1"));
        let bad = GradientSettings {
            initial_limit: 5_000,
            ..GradientSettings::default()
        };
        assert_eq!(
            bad.validate(),
            Err("initial_limit: between min_limit and max_limit")
        );
        assert_eq!(GradientSettings::default().validate(), Ok(()));
    }
}
