//! Noticing a connection that has gone silent. A Redis whose host vanished (a crashed or
//! frozen machine, a firewall or NAT that forgot the connection) leaves the socket open and
//! answers nothing; the kernel declares it dead only when its retransmissions give up, about
//! fifteen minutes on Linux's defaults. Until then every call on it fails at its deadline, and
//! a breaker's probe, made on a connection of its own, succeeds and sends decisions back to the
//! dead socket. So a connection on which calls have gone unanswered for long enough is given
//! up, and the next call opens (or asks the sentinels for) a new one.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long calls may go unanswered on a connection before it is given up: four deadlines,
/// and at least a second, so that a Redis merely slower than the deadline for a moment (a fork
/// for a snapshot, one slow script) keeps its connection.
pub(super) fn silence_limit(deadline: Duration) -> Duration {
    (deadline * 4).max(Duration::from_secs(1))
}

/// One connection's watch: since when calls sent on it have gone unanswered.
#[derive(Debug)]
pub(super) struct SilenceWatch {
    anchor: Instant,
    /// Microseconds from `anchor`, plus one, to the first call sent after the last answer; 0
    /// while every call sent has been answered.
    unanswered_since: AtomicU64,
    /// The connection was given up and not yet replaced.
    given_up: AtomicBool,
    limit: Duration,
}

impl SilenceWatch {
    pub(super) fn new(limit: Duration) -> SilenceWatch {
        SilenceWatch {
            anchor: Instant::now(),
            unanswered_since: AtomicU64::new(0),
            given_up: AtomicBool::new(false),
            limit,
        }
    }

    /// A call is about to be sent: until [`Unanswered::answered`], or until the call is
    /// dropped unanswered (its deadline passed), it counts towards the silence.
    pub(super) fn sent(&self) -> Unanswered<'_> {
        if self.unanswered_since.load(Ordering::Relaxed) == 0 {
            let _ = self.unanswered_since.compare_exchange(
                0,
                self.now(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        Unanswered {
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

    /// A call was dropped before its answer: if calls have gone unanswered for the limit, the
    /// connection is given up (and the watch starts over for the next one).
    fn dropped_unanswered(&self) {
        let since = self.unanswered_since.load(Ordering::Relaxed);
        if since == 0 {
            return;
        }
        let silent_for = Duration::from_micros(self.now().saturating_sub(since));
        if silent_for >= self.limit
            && self
                .unanswered_since
                .compare_exchange(since, 0, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.given_up.store(true, Ordering::Release);
        }
    }
}

/// A call sent and not yet answered (see [`SilenceWatch::sent`]).
#[must_use = "a call's answer is what keeps its connection"]
pub(super) struct Unanswered<'a> {
    watch: &'a SilenceWatch,
    answered: bool,
}

impl Unanswered<'_> {
    /// The call came back (a reply or an error from the connection): it is not silent.
    pub(super) fn answered(mut self) {
        self.answered = true;
        self.watch.unanswered_since.store(0, Ordering::Relaxed);
    }
}

impl Drop for Unanswered<'_> {
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
    fn a_call_dropped_unanswered_past_the_limit_gives_the_connection_up_once() {
        let watch = SilenceWatch::new(Duration::ZERO);
        drop(watch.sent());
        assert!(watch.take_given_up());
        assert!(!watch.take_given_up(), "given up once, replaced once");
    }

    #[test]
    fn a_call_dropped_within_the_limit_keeps_the_connection() {
        let watch = SilenceWatch::new(Duration::from_secs(3600));
        drop(watch.sent());
        drop(watch.sent());
        assert!(!watch.take_given_up());
    }

    #[test]
    fn any_answer_ends_the_silence_of_the_calls_sent_before_it() {
        let watch = SilenceWatch::new(Duration::ZERO);
        let first = watch.sent();
        let second = watch.sent();
        second.answered();
        // The connection answered after `first` was sent: dropping `first` is its deadline,
        // not the connection's silence.
        drop(first);
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
