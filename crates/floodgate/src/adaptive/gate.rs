//! Admission under the concurrency limit, by priority class.
//!
//! Classes are ordered, highest first. Class `i` may fill the limit only up to what the
//! classes above it reserve: with `critical` reserving 20 % and `default` 10 %, `sheddable`
//! is admitted while fewer than 70 % of the limit are in flight, `default` under 80 %,
//! `critical` up to the whole limit. As the in-flight count climbs, the lowest class is
//! refused first, and no request of a class is refused while one of a lower class would be
//! admitted. Within a class, once it is half full, one client may hold at most `client_share`
//! of what the class may fill, so that one client cannot take its class's whole share.
//!
//! A class may `wait`: a request of it that finds its class full waits up to that long for a
//! place instead of being refused at once. While a class has requests waiting, no request of
//! a lower class is admitted (the place a release frees goes up, not down), and a new request
//! of the class joins the wait behind them. A release wakes one waiter of the highest class
//! that has any. At most as many requests of a class wait as its ceiling admits in flight:
//! beyond that, the wait would outlast about one round trip of the service, and the request
//! is refused at once.
//!
//! Every decision and release happens under one lock: the counts a decision reads are the
//! counts it changes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

/// A priority class: its name and the share of the limit it keeps from the classes below it.
#[derive(Clone, Debug, PartialEq)]
pub struct Class {
    name: Arc<str>,
    reserve: f64,
    wait: Duration,
}

impl Class {
    /// A class named `name` that reserves nothing.
    pub fn new(name: impl Into<Arc<str>>) -> Class {
        Class {
            name: name.into(),
            reserve: 0.0,
            wait: Duration::ZERO,
        }
    }

    /// Lets a request that finds the class full wait up to `wait` for a place (see the
    /// module's documentation) instead of being refused at once. Zero, the default: no wait.
    pub fn wait(mut self, wait: Duration) -> Class {
        self.wait = wait;
        self
    }

    /// How long a request of the class may wait for a place.
    pub fn waits(&self) -> Duration {
        self.wait
    }

    /// Keeps `share` of the limit (0 to 1) from every class below this one.
    pub fn reserve(mut self, share: f64) -> Class {
        self.reserve = share;
        self
    }

    /// The class's name.
    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// The share of the limit it keeps from the classes below it.
    pub fn reserved(&self) -> f64 {
        self.reserve
    }
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Its class may not fill more of the limit.
    ClassFull,
    /// Its client holds its share of the class.
    ClientShare,
}

/// The in-flight counts and the limit, by class and by client.
#[derive(Debug)]
pub(crate) struct Gate {
    /// The fill ceiling of each class as a share of the limit (1 minus what the classes above
    /// it reserve).
    ceilings: Vec<f64>,
    /// Whether each class's requests may wait for a place.
    may_wait: Vec<bool>,
    /// Each class's waiters, woken one at a time as places free.
    freed: Vec<Notify>,
    client_share: f64,
    state: Mutex<GateState>,
}

/// What [`Gate::admit`] made of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Counted in flight.
    Admitted,
    /// Counted as waiting: [`Gate::admit_waiting`] when woken, [`Gate::stop_waiting`] at the end.
    Queued,
    /// Refused (counted in flight all the same when not enforcing).
    Refused(Refusal),
}

#[derive(Debug, Default)]
struct GateState {
    limit: u32,
    in_flight: u32,
    peak_in_flight: u32,
    /// Whether a request was refused since the last [`Gate::take_window`].
    refused_in_window: bool,
    by_class: Vec<u32>,
    by_client: HashMap<(usize, u64), u32>,
    admitted: Vec<u64>,
    refused: Vec<u64>,
    /// Requests waiting for a place, by class.
    waiting: Vec<u32>,
    /// Requests waiting for a place, by class and client.
    waiting_by_client: HashMap<(usize, u64), u32>,
    /// Requests admitted after a wait, by class.
    waited: Vec<u64>,
}

/// What the gate shows of itself.
#[derive(Clone, Debug, PartialEq)]
pub struct GateSnapshot {
    /// The limit in force.
    pub limit: u32,
    /// Requests in flight.
    pub in_flight: u32,
    /// Requests in flight, admitted and refused (or, in shadow, that would have been), by
    /// class in the order the classes were given.
    pub classes: Vec<ClassSnapshot>,
}

/// One class's counts.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassSnapshot {
    /// Its name.
    pub name: Arc<str>,
    /// Its requests in flight.
    pub in_flight: u32,
    /// Requests admitted since the start.
    pub admitted: u64,
    /// Requests refused since the start.
    pub refused: u64,
    /// Requests waiting for a place now.
    pub waiting: u32,
    /// Requests admitted after a wait since the start (also in `admitted`).
    pub waited: u64,
}

impl Gate {
    /// A gate over `classes` (highest first) at `limit`; `client_share` of a class per client
    /// once the class is half full.
    pub(crate) fn new(classes: &[Class], limit: u32, client_share: f64) -> Gate {
        let mut reserved_above = 0.0_f64;
        let ceilings = classes
            .iter()
            .map(|class| {
                let ceiling = (1.0 - reserved_above).max(0.0);
                reserved_above += class.reserve;
                ceiling
            })
            .collect();
        let count = classes.len();
        Gate {
            ceilings,
            may_wait: classes.iter().map(|class| !class.wait.is_zero()).collect(),
            freed: (0..count).map(|_| Notify::new()).collect(),
            client_share,
            state: Mutex::new(GateState {
                limit,
                by_class: vec![0; count],
                admitted: vec![0; count],
                refused: vec![0; count],
                waiting: vec![0; count],
                waited: vec![0; count],
                ..GateState::default()
            }),
        }
    }

    /// Decides a request of `class` from `client`. Admitted (or, with `enforce` false, let
    /// through whatever the answer) requests are counted in flight until [`Gate::release`].
    /// Only when enforcing may a request of a class that waits be queued.
    pub(crate) fn admit(&self, class: usize, client: Option<u64>, enforce: bool) -> Verdict {
        let mut state = self.lock();
        let ceiling = self.class_ceiling(class, state.limit);
        // Behind those of its class already waiting: a newcomer does not take the place a
        // release freed for them.
        let verdict = if self.may_wait[class] && state.waiting[class] > 0 {
            Err(Refusal::ClassFull)
        } else {
            self.verdict(&state, class, client, ceiling)
        };
        let verdict = match verdict {
            Err(Refusal::ClassFull)
                if enforce && self.may_wait[class] && state.waiting[class] < ceiling =>
            {
                match client {
                    // Its place in the queue counts toward its share: one client filling the
                    // queue would have the class's other clients refused at once.
                    Some(client)
                        if state.held_or_waiting(class, client) >= self.client_cap(ceiling) =>
                    {
                        Err(Refusal::ClientShare)
                    }
                    _ => {
                        state.join_queue(class, client);
                        // The limit binds: the controller must not read the queue as the
                        // service's.
                        state.refused_in_window = true;
                        return Verdict::Queued;
                    }
                }
            }
            other => other,
        };
        match verdict {
            Ok(()) => {
                state.admitted[class] += 1;
                state.count_in(class, client);
                Verdict::Admitted
            }
            Err(refusal) => {
                state.refused[class] += 1;
                state.refused_in_window = true;
                if !enforce {
                    state.count_in(class, client);
                }
                Verdict::Refused(refusal)
            }
        }
    }

    /// A queued request of `class` tries again: admitted (`Ok(true)`, no longer waiting),
    /// still waiting for a place (`Ok(false)`), or refused because its client now holds its
    /// share (the limit fell): out of the queue, counted refused.
    pub(crate) fn admit_waiting(&self, class: usize, client: Option<u64>) -> Result<bool, Refusal> {
        let next = {
            let mut state = self.lock();
            let ceiling = self.class_ceiling(class, state.limit);
            match self.verdict(&state, class, client, ceiling) {
                Err(Refusal::ClassFull) => return Ok(false),
                Ok(()) => {
                    state.leave_queue(class, client);
                    state.admitted[class] += 1;
                    state.waited[class] += 1;
                    state.count_in(class, client);
                    return Ok(true);
                }
                Err(Refusal::ClientShare) => {
                    state.leave_queue(class, client);
                    state.refused[class] += 1;
                    state.refused_in_window = true;
                    // It may have been woken for a place it now leaves: the next waiter's.
                    Self::highest_waiting(&state)
                }
            }
        };
        if let Some(next) = next {
            self.freed[next].notify_one();
        }
        Err(Refusal::ClientShare)
    }

    /// A queued request of `class` stops waiting unadmitted: refused when its wait ran out
    /// (`refused`), neither admitted nor refused when its client left.
    pub(crate) fn stop_waiting(&self, class: usize, client: Option<u64>, refused: bool) {
        let next = {
            let mut state = self.lock();
            state.leave_queue(class, client);
            if refused {
                state.refused[class] += 1;
                state.refused_in_window = true;
            }
            // It may have been woken for a place it now leaves: the next waiter's.
            Self::highest_waiting(&state)
        };
        if let Some(next) = next {
            self.freed[next].notify_one();
        }
    }

    /// The waiters of `class`, woken as places free: a waiter enables its
    /// [`tokio::sync::futures::Notified`] before [`Gate::admit_waiting`], so that no release
    /// between the two is missed.
    pub(crate) fn freed(&self, class: usize) -> &Notify {
        &self.freed[class]
    }

    /// A request of `class` from `client` that [`Gate::admit`] counted is done.
    pub(crate) fn release(&self, class: usize, client: Option<u64>) {
        let next = {
            let mut state = self.lock();
            state.in_flight = state.in_flight.saturating_sub(1);
            state.by_class[class] = state.by_class[class].saturating_sub(1);
            if let Some(client) = client
                && let Some(held) = state.by_client.get_mut(&(class, client))
            {
                *held -= 1;
                if *held == 0 {
                    state.by_client.remove(&(class, client));
                }
            }
            Self::highest_waiting(&state)
        };
        if let Some(next) = next {
            self.freed[next].notify_one();
        }
    }

    /// Sets the limit in force; a higher one wakes every waiter to try the new places.
    pub(crate) fn set_limit(&self, limit: u32) {
        let (raised, waiting) = {
            let mut state = self.lock();
            let raised = limit > state.limit;
            state.limit = limit;
            (raised, state.waiting.clone())
        };
        if raised {
            for (class, waiting) in waiting.into_iter().enumerate() {
                if waiting > 0 {
                    self.freed[class].notify_waiters();
                }
            }
        }
    }

    /// The peak in flight since the last call, and whether a request was refused; the next
    /// peak starts from what is in flight.
    pub(crate) fn take_window(&self) -> (u32, bool) {
        let mut state = self.lock();
        let in_flight = state.in_flight;
        let refused = std::mem::take(&mut state.refused_in_window);
        (
            std::mem::replace(&mut state.peak_in_flight, in_flight),
            refused,
        )
    }

    /// The counts, with `names` the classes' names.
    pub(crate) fn snapshot(&self, names: &[Arc<str>]) -> GateSnapshot {
        let state = self.lock();
        GateSnapshot {
            limit: state.limit,
            in_flight: state.in_flight,
            classes: names
                .iter()
                .enumerate()
                .map(|(index, name)| ClassSnapshot {
                    name: name.clone(),
                    in_flight: state.by_class[index],
                    admitted: state.admitted[index],
                    refused: state.refused[index],
                    waiting: state.waiting[index],
                    waited: state.waited[index],
                })
                .collect(),
        }
    }

    /// Whether a request of `class` from `client` fits, with `ceiling` its class's.
    fn verdict(
        &self,
        state: &GateState,
        class: usize,
        client: Option<u64>,
        ceiling: u32,
    ) -> Result<(), Refusal> {
        if state.in_flight >= ceiling || state.waiting[..class].iter().any(|&w| w > 0) {
            Err(Refusal::ClassFull)
        } else if let Some(client) = client
            && state.by_class[class] * 2 >= ceiling
            && state.by_client.get(&(class, client)).copied().unwrap_or(0)
                >= self.client_cap(ceiling)
        {
            Err(Refusal::ClientShare)
        } else {
            Ok(())
        }
    }

    /// The highest class with requests waiting.
    fn highest_waiting(state: &GateState) -> Option<usize> {
        state.waiting.iter().position(|&waiting| waiting > 0)
    }

    /// How many requests may be in flight in all when one of `class` is admitted.
    fn class_ceiling(&self, class: usize, limit: u32) -> u32 {
        // At least one: a class with no room at all would never be served, even alone.
        ((f64::from(limit) * self.ceilings[class]).floor() as u32).max(1)
    }

    fn client_cap(&self, ceiling: u32) -> u32 {
        ((f64::from(ceiling) * self.client_share).ceil() as u32).max(1)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        // The state is counts only, each change complete under the lock: a panic elsewhere
        // cannot leave it half changed.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl GateState {
    /// What `client` holds of `class`, in flight and waiting.
    fn held_or_waiting(&self, class: usize, client: u64) -> u32 {
        let held = self.by_client.get(&(class, client)).copied().unwrap_or(0);
        held + self
            .waiting_by_client
            .get(&(class, client))
            .copied()
            .unwrap_or(0)
    }

    /// Counts a request of `class` from `client` as waiting.
    fn join_queue(&mut self, class: usize, client: Option<u64>) {
        self.waiting[class] += 1;
        if let Some(client) = client {
            *self.waiting_by_client.entry((class, client)).or_insert(0) += 1;
        }
    }

    /// A waiting request of `class` from `client` leaves the queue.
    fn leave_queue(&mut self, class: usize, client: Option<u64>) {
        self.waiting[class] = self.waiting[class].saturating_sub(1);
        if let Some(client) = client
            && let Some(waiting) = self.waiting_by_client.get_mut(&(class, client))
        {
            *waiting -= 1;
            if *waiting == 0 {
                self.waiting_by_client.remove(&(class, client));
            }
        }
    }

    /// Counts a request of `class` from `client` in flight.
    fn count_in(&mut self, class: usize, client: Option<u64>) {
        self.in_flight += 1;
        self.peak_in_flight = self.peak_in_flight.max(self.in_flight);
        self.by_class[class] += 1;
        if let Some(client) = client {
            *self.by_client.entry((class, client)).or_insert(0) += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three_classes() -> Vec<Class> {
        vec![
            Class::new("critical").reserve(0.2),
            Class::new("default").reserve(0.1),
            Class::new("sheddable"),
        ]
    }

    fn names(names: &[&str]) -> Vec<Arc<str>> {
        names.iter().map(|&name| Arc::from(name)).collect()
    }

    const CRITICAL: usize = 0;
    const DEFAULT: usize = 1;
    const SHEDDABLE: usize = 2;

    #[test]
    fn the_lowest_class_is_refused_first_and_the_reservation_holds() {
        let gate = Gate::new(&three_classes(), 100, 1.0);
        // Sheddable fills up to 70 % of the limit, no further.
        let sheddable = (0..100)
            .filter(|_| gate.admit(SHEDDABLE, None, true) == Verdict::Admitted)
            .count();
        assert_eq!(sheddable, 70);
        // Default gets the next 10 %, critical the last 20 %: nothing lower took them.
        let default = (0..100)
            .filter(|_| gate.admit(DEFAULT, None, true) == Verdict::Admitted)
            .count();
        assert_eq!(default, 10);
        let critical = (0..100)
            .filter(|_| gate.admit(CRITICAL, None, true) == Verdict::Admitted)
            .count();
        assert_eq!(critical, 20);
        let snapshot = gate.snapshot(&names(&["critical", "default", "sheddable"]));
        assert_eq!(snapshot.in_flight, 100);
        assert_eq!(
            snapshot
                .classes
                .iter()
                .map(|c| c.refused)
                .collect::<Vec<_>>(),
            [80, 90, 30]
        );
    }

    #[test]
    fn no_lower_class_is_admitted_while_a_higher_one_is_refused() {
        let gate = Gate::new(&three_classes(), 50, 1.0);
        // Any interleaving: at every refusal of a class, every lower class is refused too.
        let mut rng = fastrand::Rng::with_seed(7);
        let mut held: Vec<usize> = Vec::new();
        for _ in 0..10_000 {
            if !held.is_empty() && rng.bool() {
                let class = held.swap_remove(rng.usize(..held.len()));
                gate.release(class, None);
                continue;
            }
            let class = rng.usize(..3);
            match gate.admit(class, None, true) {
                Verdict::Admitted => held.push(class),
                _ => {
                    for lower in class + 1..3 {
                        let admitted = gate.admit(lower, None, true);
                        assert!(
                            admitted != Verdict::Admitted,
                            "class {lower} admitted, {class} refused"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn one_client_cannot_take_its_classs_whole_share() {
        let gate = Gate::new(&[Class::new("default")], 20, 0.25);
        let greedy = (0..20)
            .filter(|_| gate.admit(0, Some(1), true) == Verdict::Admitted)
            .count();
        // Free until the class is half full (10 of 20); from then on a client holding a
        // quarter of it (5) or more is refused, and the greedy client holds 10.
        assert_eq!(greedy, 10);
        let others = (2..12u64)
            .filter(|&c| gate.admit(0, Some(c), true) == Verdict::Admitted)
            .count();
        assert_eq!(others, 10, "the rest of the class is left to other clients");
        assert_eq!(
            gate.admit(0, Some(1), true),
            Verdict::Refused(Refusal::ClassFull)
        );
        // The greedy client gives one back: it is still over its share, another client is not.
        gate.release(0, Some(1));
        assert_eq!(
            gate.admit(0, Some(1), true),
            Verdict::Refused(Refusal::ClientShare)
        );
        assert_eq!(gate.admit(0, Some(99), true), Verdict::Admitted);
    }

    #[test]
    fn not_enforcing_counts_what_would_be_refused_and_lets_it_through() {
        let gate = Gate::new(&[Class::new("only")], 2, 1.0);
        let verdicts: Vec<_> = (0..4).map(|_| gate.admit(0, None, false)).collect();
        assert_eq!(
            verdicts.iter().filter(|&&v| v != Verdict::Admitted).count(),
            2
        );
        let snapshot = gate.snapshot(&names(&["only"]));
        assert_eq!(snapshot.in_flight, 4, "all four went through");
        assert_eq!(
            (snapshot.classes[0].admitted, snapshot.classes[0].refused),
            (2, 2)
        );
        for _ in 0..4 {
            gate.release(0, None);
        }
        assert_eq!(gate.snapshot(&names(&["only"])).in_flight, 0);
    }

    #[test]
    fn the_peak_covers_the_window_and_restarts_from_what_is_in_flight() {
        let gate = Gate::new(&[Class::new("only")], 10, 1.0);
        for _ in 0..6 {
            assert_eq!(gate.admit(0, None, true), Verdict::Admitted);
        }
        for _ in 0..4 {
            gate.release(0, None);
        }
        assert_eq!(gate.take_window(), (6, false));
        assert_eq!(gate.take_window(), (2, false), "the two still in flight");
        for _ in 0..9 {
            let _ = gate.admit(0, None, true);
        }
        assert_eq!(gate.take_window(), (10, true), "a refusal is reported once");
        assert_eq!(gate.take_window(), (10, false));
    }

    fn waiting_critical() -> Vec<Class> {
        vec![
            Class::new("critical").wait(Duration::from_millis(50)),
            Class::new("default"),
        ]
    }

    #[test]
    fn a_waiting_class_takes_the_freed_place_before_any_lower_or_newer_request() {
        let gate = Gate::new(&waiting_critical(), 2, 1.0);
        assert_eq!(gate.admit(DEFAULT, None, true), Verdict::Admitted);
        assert_eq!(gate.admit(DEFAULT, None, true), Verdict::Admitted);
        assert_eq!(gate.admit(CRITICAL, None, true), Verdict::Queued);
        assert_eq!(
            gate.admit_waiting(CRITICAL, None),
            Ok(false),
            "nothing freed yet"
        );
        gate.release(DEFAULT, None);
        // A place is free, and a default request would fit: it goes to the waiter.
        assert_eq!(
            gate.admit(DEFAULT, None, true),
            Verdict::Refused(Refusal::ClassFull)
        );
        // A newer critical request queues behind the waiter rather than taking it.
        assert_eq!(gate.admit(CRITICAL, None, true), Verdict::Queued);
        assert_eq!(gate.admit_waiting(CRITICAL, None), Ok(true));
        let snapshot = gate.snapshot(&names(&["critical", "default"]));
        let critical = &snapshot.classes[CRITICAL];
        assert_eq!(
            (critical.in_flight, critical.waiting, critical.waited),
            (1, 1, 1)
        );
        assert_eq!((critical.admitted, critical.refused), (1, 0));
        // The second waiter gives up: refused once, the queue empty, default admitted again.
        gate.stop_waiting(CRITICAL, None, true);
        gate.release(CRITICAL, None);
        assert_eq!(gate.admit(DEFAULT, None, true), Verdict::Admitted);
        let snapshot = gate.snapshot(&names(&["critical", "default"]));
        assert_eq!(snapshot.classes[CRITICAL].waiting, 0);
        assert_eq!(snapshot.classes[CRITICAL].refused, 1);
        assert_eq!(snapshot.classes[DEFAULT].refused, 1);
    }

    #[test]
    fn no_more_wait_than_the_class_may_hold_in_flight_and_never_for_a_clients_share() {
        let gate = Gate::new(&waiting_critical(), 2, 0.5);
        assert_eq!(gate.admit(CRITICAL, Some(1), true), Verdict::Admitted);
        // Half the class is held by client 1, which holds half of it: its share.
        assert_eq!(
            gate.admit(CRITICAL, Some(1), true),
            Verdict::Refused(Refusal::ClientShare)
        );
        assert_eq!(gate.admit(CRITICAL, Some(2), true), Verdict::Admitted);
        assert_eq!(gate.admit(CRITICAL, Some(3), true), Verdict::Queued);
        assert_eq!(gate.admit(CRITICAL, Some(4), true), Verdict::Queued);
        assert_eq!(
            gate.admit(CRITICAL, Some(5), true),
            Verdict::Refused(Refusal::ClassFull),
            "two wait, as many as the class may hold in flight"
        );
        // In shadow nothing waits: it goes through and is counted as it would have been.
        let shadow = Gate::new(&waiting_critical(), 1, 1.0);
        assert_eq!(shadow.admit(CRITICAL, None, false), Verdict::Admitted);
        assert_eq!(
            shadow.admit(CRITICAL, None, false),
            Verdict::Refused(Refusal::ClassFull)
        );
        assert_eq!(
            shadow.snapshot(&names(&["critical", "default"])).in_flight,
            2
        );
    }

    #[tokio::test]
    async fn a_release_wakes_a_waiter_of_the_highest_waiting_class() {
        let classes = [
            Class::new("critical").wait(Duration::from_secs(1)),
            Class::new("default").wait(Duration::from_secs(1)),
        ];
        let gate = Gate::new(&classes, 1, 1.0);
        assert_eq!(gate.admit(DEFAULT, None, true), Verdict::Admitted);
        assert_eq!(gate.admit(DEFAULT, None, true), Verdict::Queued);
        assert_eq!(gate.admit(CRITICAL, None, true), Verdict::Queued);
        let mut default = std::pin::pin!(gate.freed(DEFAULT).notified());
        let mut critical = std::pin::pin!(gate.freed(CRITICAL).notified());
        default.as_mut().enable();
        critical.as_mut().enable();
        gate.release(DEFAULT, None);
        let woken = |notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>| {
            let waker = std::task::Waker::noop();
            notified
                .poll(&mut std::task::Context::from_waker(waker))
                .is_ready()
        };
        assert!(woken(critical.as_mut()), "the critical waiter is woken");
        assert!(!woken(default.as_mut()), "the default one is not");
        assert_eq!(
            gate.admit_waiting(DEFAULT, None),
            Ok(false),
            "critical goes first"
        );
        assert_eq!(gate.admit_waiting(CRITICAL, None), Ok(true));
        // A higher limit wakes every waiter.
        gate.set_limit(3);
        assert!(woken(default.as_mut()));
        assert_eq!(gate.admit_waiting(DEFAULT, None), Ok(true));
    }

    #[test]
    fn one_client_cannot_fill_its_classs_queue() {
        let gate = Gate::new(&waiting_critical(), 4, 0.5);
        for _ in 0..4 {
            assert_eq!(gate.admit(DEFAULT, None, true), Verdict::Admitted);
        }
        // A client may hold half the class (2 of 4), in flight and waiting together: two of
        // its requests queue, the third is refused at once and leaves room for others.
        assert_eq!(gate.admit(CRITICAL, Some(1), true), Verdict::Queued);
        assert_eq!(gate.admit(CRITICAL, Some(1), true), Verdict::Queued);
        assert_eq!(
            gate.admit(CRITICAL, Some(1), true),
            Verdict::Refused(Refusal::ClientShare)
        );
        assert_eq!(gate.admit(CRITICAL, Some(2), true), Verdict::Queued);
        gate.release(DEFAULT, None);
        assert_eq!(gate.admit_waiting(CRITICAL, Some(1)), Ok(true));
        // The limit falls to 2 and the default requests end: client 1's share is now 1, which
        // it holds in flight, so its second waiter is refused (and leaves the queue) rather
        // than wait for a place it may not take while holding lower classes off; client 2's
        // takes the place.
        gate.set_limit(2);
        for _ in 0..3 {
            gate.release(DEFAULT, None);
        }
        assert_eq!(
            gate.admit_waiting(CRITICAL, Some(1)),
            Err(Refusal::ClientShare)
        );
        assert_eq!(gate.admit_waiting(CRITICAL, Some(2)), Ok(true));
        let snapshot = gate.snapshot(&names(&["critical", "default"]));
        let critical = &snapshot.classes[CRITICAL];
        assert_eq!((critical.waiting, critical.waited), (0, 2));
        assert_eq!((critical.admitted, critical.refused), (2, 2));
    }
}
