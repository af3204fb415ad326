//! Noticing a connection that has gone silent. A Redis whose host vanished (a crashed or
//! frozen machine, a firewall or NAT that forgot the connection) leaves the socket open and
//! answers nothing; the kernel declares it dead only when its retransmissions give up, about
//! fifteen minutes on Linux's defaults. Until then every call on it fails at its deadline, and
//! a breaker's probe, made on a connection of its own, succeeds and sends decisions back to the
//! dead socket. So a connection that has answered nothing for long enough since a call on it
//! missed its deadline is given up, and the next call opens (or asks the sentinels for) a new
//! one.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a connection may answer nothing, from the first call on it that missed its
/// deadline, before it is given up: four deadlines, and at least a second, so that a Redis merely slower than the deadline for a moment (a fork
/// for a snapshot, one slow script) keeps its connection.
pub(super) fn silence_limit(deadline: Duration) -> Duration {
    (deadline * 4).max(Duration::from_secs(1))
}

/// Calls cut short, with no answer between them, before a silence may give a connection up: a
/// connection on which a client that left cut a call now and then, with no traffic between,
/// has answered nothing for as long, and is not silent for that.
const CUT_CALLS: u32 = 3;

/// One connection's watch: since when it has answered nothing while calls were cut short.
///
/// Nothing on the path of a call that is answered writes or reads a clock: an answer only
/// reads one atomic (and clears the watch after a silence). A call dropped unanswered (its
/// deadline passed) starts the silence, or finds it long enough, and [`CUT_CALLS`] calls cut in
/// it, to give the connection up; so the silence is counted from the first deadline missed, a
/// deadline after the call was sent.
#[derive(Debug)]
pub(super) struct SilenceWatch {
    anchor: Instant,
    /// Microseconds from `anchor`, plus one, to the first call dropped unanswered since the
    /// last answer; 0 when none was.
    silent_since: AtomicU64,
    /// Calls dropped unanswered since the last answer.
    cut: AtomicU32,
    /// The connection was given up and not yet replaced.
    given_up: AtomicBool,
    limit: Duration,
}

impl SilenceWatch {
    pub(super) fn new(limit: Duration) -> SilenceWatch {
        SilenceWatch {
            anchor: Instant::now(),
            silent_since: AtomicU64::new(0),
            cut: AtomicU32::new(0),
            given_up: AtomicBool::new(false),
            limit,
        }
    }

    /// Runs `call` on the watched connection: its answer (a reply or an error) ends a silence;
    /// dropped before it (its deadline passed), it counts towards one.
    pub(super) async fn watch<T>(&self, call: impl Future<Output = T>) -> T {
        let in_flight = self.sent();
        let answer = call.await;
        in_flight.answered();
        answer
    }

    /// A call is about to be sent: [`InFlight::answered`] when it comes back; dropped before
    /// that, it counts towards the silence.
    fn sent(&self) -> InFlight<'_> {
        InFlight {
            watch: self,
            answered: false,
        }
    }

    /// Whether the connection was given up since the last time this was asked: the caller
    /// replaces it.
    pub(super) fn take_given_up(&self) -> bool {
        self.given_up.load(Ordering::Relaxed) && self.given_up.swap(false, Ordering::AcqRel)
    }

    fn now(&self) -> u64 {
        u64::try_from(self.anchor.elapsed().as_micros()).unwrap_or(u64::MAX - 1) + 1
    }

    fn answered(&self) {
        if self.silent_since.load(Ordering::Relaxed) != 0 {
            self.silent_since.store(0, Ordering::Relaxed);
            self.cut.store(0, Ordering::Relaxed);
        }
    }

    /// A call was dropped before its answer: the silence starts, or, if it has lasted the
    /// limit, the connection is given up (and the watch starts over for the next one).
    fn dropped_unanswered(&self) {
        let cut = self.cut.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        let since = self.silent_since.load(Ordering::Relaxed);
        if since == 0 {
            let _ = self.silent_since.compare_exchange(
                0,
                self.now(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            return;
        }
        let silent_for = Duration::from_micros(self.now().saturating_sub(since));
        if silent_for >= self.limit
            && cut >= CUT_CALLS
            && self
                .silent_since
                .compare_exchange(since, 0, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.cut.store(0, Ordering::Relaxed);
            self.given_up.store(true, Ordering::Release);
        }
    }
}

/// A call sent and not yet answered (see [`SilenceWatch::sent`]).
#[must_use = "a call's answer is what keeps its connection"]
struct InFlight<'a> {
    watch: &'a SilenceWatch,
    answered: bool,
}

impl InFlight<'_> {
    /// The call came back (a reply or an error from the connection): it is not silent.
    fn answered(mut self) {
        self.answered = true;
        self.watch.answered();
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.watch.dropped_unanswered();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_dropped_unanswered_past_the_limit_give_the_connection_up_once() {
        let watch = SilenceWatch::new(Duration::ZERO);
        drop(watch.sent());
        assert!(
            !watch.take_given_up(),
            "the first missed deadline starts the silence"
        );
        drop(watch.sent());
        assert!(
            !watch.take_given_up(),
            "two calls cut are not yet a silence"
        );
        drop(watch.sent());
        assert!(watch.take_given_up());
        assert!(!watch.take_given_up(), "given up once, replaced once");
        drop(watch.sent());
        drop(watch.sent());
        assert!(
            !watch.take_given_up(),
            "the next connection's silence starts over"
        );
    }

    #[test]
    fn calls_dropped_within_the_limit_keep_the_connection() {
        let watch = SilenceWatch::new(Duration::from_secs(3600));
        for _ in 0..10 {
            drop(watch.sent());
        }
        assert!(!watch.take_given_up());
    }

    #[test]
    fn any_answer_ends_the_silence() {
        let watch = SilenceWatch::new(Duration::ZERO);
        drop(watch.sent());
        drop(watch.sent());
        watch.sent().answered();
        // The connection answered after two deadlines were missed: the next ones missed start
        // a new silence rather than ending a long one.
        drop(watch.sent());
        drop(watch.sent());
        assert!(!watch.take_given_up());
    }

    #[test]
    fn silence_is_four_deadlines_and_at_least_a_second() {
        assert_eq!(
            silence_limit(Duration::from_millis(50)),
            Duration::from_secs(1)
        );
        assert_eq!(
            silence_limit(Duration::from_millis(500)),
            Duration::from_secs(2)
        );
    }
}
