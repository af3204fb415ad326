//! What the status page shows (SPEC §7 `GET /`): decisions per second by outcome over the last
//! minute, the 429 share of the last ten seconds with the baseline's anomaly flag, the recent
//! reload errors, and each upstream's adaptive concurrency limit, in flight and sampled
//! latency over the last minute. Sampled once a second from the process's decision totals and
//! the limiters; bounded memory. And [`Observers`]: everything the configuration versions report into, kept across
//! reloads, that the admin API reads.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use floodgate::adaptive::AdaptiveSnapshot;
use floodgate::telemetry::{DecisionLabel, LimitedRateBaseline, decision_totals};
use floodgate::top::TopClients;
use serde::Serialize;

/// One-second samples kept: a minute of history, plus the one the first difference needs.
const SAMPLES: usize = 61;
/// The window of the `per_second` means.
const RATE_WINDOW: usize = 10;
/// Reload errors kept.
const RELOAD_ERRORS: usize = 10;
/// Upstreams whose adaptive limits are kept (one limiter each; a bound against a
/// configuration with many routes' upstreams).
const ADAPTIVE_UPSTREAMS: usize = 32;

/// The page's shared state; the gateway keeps one across configuration versions.
#[derive(Debug)]
pub(crate) struct StatusBoard {
    started: Instant,
    samples: Mutex<VecDeque<Sample>>,
    /// Whether the 429 share of the baseline's last interval was an anomaly.
    anomaly: std::sync::atomic::AtomicBool,
    reload_errors: Mutex<VecDeque<(u64, String)>>,
    /// Each upstream's adaptive limit, second by second (the last minute).
    adaptive: Mutex<BTreeMap<String, VecDeque<AdaptivePoint>>>,
}

/// One second of an upstream's adaptive concurrency limiter.
#[derive(Clone, Copy, Debug, Serialize)]
struct AdaptivePoint {
    at: u64,
    limit: u32,
    in_flight: u32,
    /// The last window's sampled latency, in milliseconds.
    latency_ms: Option<f64>,
    /// Requests refused (or, in shadow, that would have been) so far, every class.
    refused: u64,
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    at: u64,
    totals: [u64; 7],
}

impl Default for StatusBoard {
    fn default() -> Self {
        StatusBoard {
            started: Instant::now(),
            samples: Mutex::new(VecDeque::with_capacity(SAMPLES)),
            anomaly: std::sync::atomic::AtomicBool::new(false),
            reload_errors: Mutex::new(VecDeque::with_capacity(RELOAD_ERRORS)),
            adaptive: Mutex::new(BTreeMap::new()),
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

impl StatusBoard {
    /// Takes this second's sample of the decision totals (called once a second).
    pub(crate) fn sample(&self) {
        let totals = decision_totals().map(|(_, count)| count);
        let mut samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        if samples.len() == SAMPLES {
            samples.pop_front();
        }
        samples.push_back(Sample {
            at: unix_now(),
            totals,
        });
    }

    /// Takes this second's sample of the adaptive limiters in service, by upstream (called
    /// once a second, after [`StatusBoard::sample`]). An upstream no limiter reports any more
    /// (a reload without `adaptive_concurrency`, or another upstream) is forgotten.
    pub(crate) fn sample_adaptive(&self, snapshots: Vec<(String, AdaptiveSnapshot)>) {
        let at = unix_now();
        let mut kept = self.adaptive.lock().unwrap_or_else(PoisonError::into_inner);
        kept.retain(|upstream, _| snapshots.iter().any(|(name, _)| name == upstream));
        for (upstream, snapshot) in snapshots {
            if !kept.contains_key(&upstream) && kept.len() == ADAPTIVE_UPSTREAMS {
                continue;
            }
            let points = kept
                .entry(upstream)
                .or_insert_with(|| VecDeque::with_capacity(SAMPLES));
            if points.len() == SAMPLES {
                points.pop_front();
            }
            points.push_back(AdaptivePoint {
                at,
                limit: snapshot.gate.limit,
                in_flight: snapshot.gate.in_flight,
                latency_ms: snapshot
                    .sample_latency
                    .map(|latency| (latency.as_secs_f64() * 10_000.0).round() / 10.0),
                refused: snapshot
                    .gate
                    .classes
                    .iter()
                    .map(|class| class.refused)
                    .sum(),
            });
        }
    }

    /// Records whether the 429 share of the baseline's interval that just closed is an
    /// anomaly (more than 2σ from its trailing five minutes).
    pub(crate) fn record_anomaly(&self, anomaly: bool) {
        self.anomaly
            .store(anomaly, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records a rejected reload (its message names the field; no secret is in it).
    pub(crate) fn record_reload_error(&self, error: String) {
        let mut errors = self
            .reload_errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if errors.len() == RELOAD_ERRORS {
            errors.pop_front();
        }
        errors.push_back((unix_now(), error));
    }

    /// The `decisions`, `limited_share`, `reload_errors`, `adaptive` and `uptime_seconds`
    /// parts of `/admin/status`.
    pub(crate) fn report(&self) -> Observed {
        let samples: Vec<Sample> = self
            .samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .copied()
            .collect();
        let difference = |older: &Sample, newer: &Sample| -> [f64; 7] {
            std::array::from_fn(|index| {
                newer.totals[index].saturating_sub(older.totals[index]) as f64
            })
        };
        let series = samples
            .windows(2)
            .map(|pair| SeriesPoint {
                at: pair[1].at,
                counts: by_outcome(difference(&pair[0], &pair[1])),
            })
            .collect();
        // Decisions of the last ten seconds (or fewer, right after start), and over how long.
        let (recent, seconds) = match samples.len() {
            0 | 1 => ([0.0; 7], 1.0),
            len => {
                let newest = &samples[len - 1];
                let oldest = &samples[len.saturating_sub(RATE_WINDOW + 1)];
                let seconds = newest.at.saturating_sub(oldest.at).max(1) as f64;
                (difference(oldest, newest), seconds)
            }
        };
        let per_second = recent.map(|count| (count / seconds * 10.0).round() / 10.0);
        // The 429 share of the same ten seconds: denied over decided (bypassed and
        // denylisted requests were never decided by a limit).
        let [
            allowed,
            limited,
            shadow_limited,
            _,
            _,
            fallback_allowed,
            fallback_limited,
        ] = per_second;
        let decided = allowed + limited + shadow_limited + fallback_allowed + fallback_limited;
        let share = if decided > 0.0 {
            ((limited + fallback_limited) / decided * 1000.0).round() / 1000.0
        } else {
            0.0
        };
        let reload_errors = self
            .reload_errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(at, error)| ReloadError {
                at: *at,
                error: error.clone(),
            })
            .collect();
        Observed {
            uptime_seconds: self.started.elapsed().as_secs(),
            decisions: DecisionRates {
                per_second: by_outcome(per_second),
                series,
            },
            limited_share: LimitedShare {
                last_interval: share,
                anomaly: self.anomaly.load(std::sync::atomic::Ordering::Relaxed),
            },
            reload_errors,
            adaptive: self
                .adaptive
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .map(|(upstream, points)| AdaptiveSeries {
                    upstream: upstream.clone(),
                    series: points.iter().copied().collect(),
                })
                .collect(),
        }
    }
}

/// Counts by outcome, named as the `decision` label names them.
fn by_outcome(counts: [f64; 7]) -> BTreeMap<&'static str, f64> {
    DecisionLabel::ALL
        .iter()
        .map(|label| label.as_str())
        .zip(counts)
        .collect()
}

/// What the status board observed, in `/admin/status`.
#[derive(Debug, Serialize)]
pub(crate) struct Observed {
    uptime_seconds: u64,
    decisions: DecisionRates,
    limited_share: LimitedShare,
    /// The last ten, oldest first.
    reload_errors: Vec<ReloadError>,
    /// Each upstream's adaptive limiter over the last minute (none without
    /// `adaptive_concurrency`).
    adaptive: Vec<AdaptiveSeries>,
}

/// An upstream's adaptive limiter, second by second.
#[derive(Debug, Serialize)]
struct AdaptiveSeries {
    upstream: String,
    series: Vec<AdaptivePoint>,
}

/// Decisions per second by outcome: the mean of the last ten seconds, and each second of the
/// last minute.
#[derive(Debug, Serialize)]
struct DecisionRates {
    per_second: BTreeMap<&'static str, f64>,
    series: Vec<SeriesPoint>,
}

/// One second of [`DecisionRates::series`].
#[derive(Debug, Serialize)]
struct SeriesPoint {
    at: u64,
    #[serde(flatten)]
    counts: BTreeMap<&'static str, f64>,
}

/// The 429 share of the last ten seconds, and whether the baseline flagged it.
#[derive(Debug, Serialize)]
struct LimitedShare {
    last_interval: f64,
    anomaly: bool,
}

/// A reload that failed: when (Unix seconds) and why.
#[derive(Debug, Serialize)]
struct ReloadError {
    at: u64,
    error: String,
}

/// What every configuration version reports into: kept across reloads.
#[derive(Default)]
pub(crate) struct Observers {
    /// The top clients of the last five minutes.
    pub top: Arc<TopClients>,
    /// The 429-rate baseline.
    pub baseline: Arc<LimitedRateBaseline>,
    /// What the status page shows.
    pub status: Arc<StatusBoard>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reload_errors_are_bounded_and_kept_in_order() {
        let board = StatusBoard::default();
        for index in 0..15 {
            board.record_reload_error(format!("error {index}"));
        }
        let report = serde_json::to_value(board.report()).unwrap();
        let errors = report["reload_errors"].as_array().unwrap();
        assert_eq!(errors.len(), RELOAD_ERRORS);
        assert_eq!(errors[0]["error"], "error 5");
        assert_eq!(errors[9]["error"], "error 14");
    }

    #[test]
    fn the_series_is_bounded_to_a_minute() {
        let board = StatusBoard::default();
        for _ in 0..100 {
            board.sample();
        }
        let report = serde_json::to_value(board.report()).unwrap();
        assert_eq!(
            report["decisions"]["series"].as_array().unwrap().len(),
            SAMPLES - 1
        );
    }

    #[test]
    fn each_upstream_s_adaptive_limit_is_kept_a_minute_and_forgotten_with_its_limiter() {
        let settings = crate::config::parse("adaptive_concurrency:\n  initial_limit: 20\n")
            .unwrap()
            .adaptive
            .unwrap();
        let limiter = settings.limiter("http://127.0.0.1:9");
        let _held = limiter.admit(0, None);
        let board = StatusBoard::default();
        for _ in 0..100 {
            board.sample_adaptive(vec![("http://127.0.0.1:9".to_owned(), limiter.snapshot())]);
        }
        let report = serde_json::to_value(board.report()).unwrap();
        let adaptive = report["adaptive"].as_array().unwrap();
        assert_eq!(adaptive.len(), 1);
        assert_eq!(adaptive[0]["upstream"], "http://127.0.0.1:9");
        let series = adaptive[0]["series"].as_array().unwrap();
        assert_eq!(series.len(), SAMPLES);
        assert_eq!(series[0]["limit"], 20);
        assert_eq!(series[0]["in_flight"], 1);
        assert_eq!(series[0]["refused"], 0);

        // Many upstreams: a bounded number is kept.
        let many = (0..100)
            .map(|index| (format!("http://127.0.0.1:{index}"), limiter.snapshot()))
            .collect();
        board.sample_adaptive(many);
        let report = serde_json::to_value(board.report()).unwrap();
        assert_eq!(
            report["adaptive"].as_array().unwrap().len(),
            ADAPTIVE_UPSTREAMS
        );
        // A reload without adaptive_concurrency: nothing is shown any more.
        board.sample_adaptive(Vec::new());
        let report = serde_json::to_value(board.report()).unwrap();
        assert_eq!(report["adaptive"], serde_json::json!([]));
    }
}
