//! The arithmetic of a claim, in memory: what `lua/quota_share.lua` does in Redis. A
//! differential test (`tests/it/quota.rs`) runs the same claims through both.

use std::collections::HashMap;

/// One holder's record: what it may enforce, until when, and what it wants.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Record {
    /// The share granted.
    pub share: u64,
    /// When the grant ends (ms).
    pub until_ms: u64,
    /// What the holder wanted at its last claim.
    pub want: u64,
    /// What the holder may still enforce from before it was lowered.
    pub prior: u64,
    /// When `prior` ends (ms).
    pub prior_until_ms: u64,
}

impl Record {
    /// What the holder may enforce at `now`.
    pub(super) fn counted(&self, now: u64) -> u64 {
        let share = if self.until_ms > now { self.share } else { 0 };
        let prior = if self.prior_until_ms > now {
            self.prior
        } else {
            0
        };
        share.max(prior)
    }

    /// Whether the record still counts at `now`.
    pub(super) fn lives(&self, now: u64) -> bool {
        self.until_ms > now || self.prior_until_ms > now
    }
}

/// The level of a max-min fair split of `limit` among `wants`: every want at or under it is
/// met, the others get it.
pub(super) fn fair_level(mut wants: Vec<u64>, limit: u64) -> u64 {
    wants.sort_unstable();
    let mut left = limit;
    let count = wants.len() as u64;
    for (index, want) in wants.into_iter().enumerate() {
        let even = left / (count - index as u64);
        if want > even {
            return even;
        }
        left -= want;
    }
    limit
}

/// What a holder should have: its max-min fair part of what the holders share, then, of what
/// the holders' wants together leave, a part in proportion to its want, at most a quarter more
/// (room to grow before its next report, never taken from another holder's want).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Target {
    /// The holder's share.
    pub share: u64,
    /// The fair level.
    pub level: u64,
}

/// The target of a holder wanting `want` among `wants` (its own included) of `shared`.
pub(super) fn target(wants: &[u64], want: u64, shared: u64) -> Target {
    let level = fair_level(wants.to_vec(), shared);
    let met = wants
        .iter()
        .fold(0u64, |sum, other| sum.saturating_add((*other).min(level)));
    let wanted = wants
        .iter()
        .fold(0u64, |sum, other| sum.saturating_add(*other));
    let left = shared.saturating_sub(met);
    // In floating point as `lua/quota_share.lua` computes it (Redis' Lua has only doubles), so
    // that both boards grant alike.
    let room = if wanted == 0 {
        0
    } else {
        (left as f64 * want as f64 / wanted as f64).floor() as u64
    };
    Target {
        share: want.min(level) + room.min(want / 4),
        level,
    }
}

/// A claim's inputs, in the board's units and milliseconds.
#[derive(Clone, Copy, Debug)]
pub(super) struct ClaimArgs {
    pub limit: u64,
    pub floor: u64,
    pub want: u64,
    pub in_force: u64,
    pub lifetime_ms: u64,
    pub settle_ms: u64,
}

/// A claim's outcome: the grant, the fair level, whether some holder has less than it should.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Claimed {
    pub grant: u64,
    pub fair: u64,
    pub pressed: bool,
}

/// Whether a holder with `held` is short of min(`want`, `fair`) by more than the tenth a raise
/// must exceed to be made: then claiming again moves shares to it. (Within the tenth, a raise
/// would not be made, and calling it short would only make every holder claim again, forever.)
pub(super) fn short(held: u64, want: u64, fair: u64) -> bool {
    u128::from(held) * 11 < u128::from(want.min(fair)) * 10
}

/// Records that `holder` may still enforce `share` for `lifetime_ms` and `prior` for
/// `prior_ms`, whatever it wants; never shortening what its record already counts.
pub(super) fn hold(records: &mut HashMap<String, Record>, holder: &str, held: [u64; 4], now: u64) {
    let [share, lifetime_ms, prior, prior_ms] = held;
    let record = records.entry(holder.to_owned()).or_default();
    // Alive, a part is kept whole: the larger share, to the later end (never less than it was).
    let merge = |part: u64, until: u64, new: u64, new_until: u64| {
        if until > now {
            (part.max(new), until.max(new_until))
        } else {
            (new, new_until)
        }
    };
    (record.share, record.until_ms) =
        merge(record.share, record.until_ms, share, now + lifetime_ms);
    (record.prior, record.prior_until_ms) =
        merge(record.prior, record.prior_until_ms, prior, now + prior_ms);
    record.want = 0;
}

/// Counts `holder`'s prior share (a lowered one) for `settle_ms` from `now` at least: its lower
/// assignment has just been sent.
pub(super) fn settle(
    records: &mut HashMap<String, Record>,
    holder: &str,
    settle_ms: u64,
    now: u64,
) {
    if let Some(record) = records.get_mut(holder)
        && record.prior > 0
        && record.prior_until_ms > now
    {
        record.prior_until_ms = record.prior_until_ms.max(now + settle_ms);
    }
}

/// Claims for `holder` among `records` (one limit's) at `now`, dropping ended records.
pub(super) fn claim(
    records: &mut HashMap<String, Record>,
    holder: &str,
    args: ClaimArgs,
    now: u64,
) -> Claimed {
    records.retain(|_, record| record.lives(now));
    let own = records.get(holder).copied();
    let others = || records.iter().filter(|(name, _)| name.as_str() != holder);
    let held = others().fold(0u64, |sum, (_, record)| {
        sum.saturating_add(record.counted(now))
    });
    let mut wants: Vec<u64> = others()
        .filter(|(_, record)| record.until_ms > now)
        .map(|(_, record)| record.want)
        .collect();
    wants.push(args.want);
    let target = target(&wants, args.want, args.limit.saturating_sub(args.floor));
    let fair = target.level;
    let target = target.share;
    let available = args.limit.saturating_sub(held);
    let mut grant = target.min(
        args.floor
            .min(available)
            .max(available.saturating_sub(args.floor)),
    );
    let others_short = others()
        .any(|(_, record)| record.until_ms > now && short(record.counted(now), record.want, fair));
    // A change by less than a tenth of what is in force is not made (the Envoy would start a
    // fresh, full bucket for it): not a raise, nor a cut while nobody is short and what is in
    // force still fits beside the others.
    let small_raise = grant > args.in_force && grant * 10 < args.in_force * 11;
    let small_cut = grant < args.in_force
        && grant * 10 >= args.in_force * 9
        && args.in_force <= available
        && !others_short;
    if small_raise || small_cut {
        grant = args.in_force;
    }
    let (mut prior, mut prior_until_ms) = (0, 0);
    if args.in_force > grant {
        (prior, prior_until_ms) = (args.in_force, now + args.settle_ms);
    }
    if let Some(own) = own
        && own.prior_until_ms > now
        && own.prior > prior
    {
        (prior, prior_until_ms) = (own.prior, own.prior_until_ms);
    }
    let pressed = short(grant, args.want, fair) || others_short;
    records.insert(
        holder.to_owned(),
        Record {
            share: grant,
            until_ms: now + args.lifetime_ms,
            want: args.want,
            prior,
            prior_until_ms,
        },
    );
    Claimed {
        grant,
        fair,
        pressed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(limit: u64, want: u64, in_force: u64) -> ClaimArgs {
        ClaimArgs {
            limit,
            floor: limit / 25,
            want,
            in_force,
            lifetime_ms: 15_000,
            settle_ms: 1_000,
        }
    }

    #[test]
    fn the_fair_level_meets_small_wants_and_splits_the_rest_evenly() {
        assert_eq!(fair_level(vec![10, 500, 500], 100), 45);
        assert_eq!(fair_level(vec![10, 20], 100), 100);
        assert_eq!(fair_level(vec![], 100), 100);
        assert_eq!(fair_level(vec![100, 100, 100, 100], 100), 25);
    }

    #[test]
    fn a_lone_holder_gets_all_but_the_newcomers_floor_and_a_newcomer_gets_the_floor_at_once() {
        let mut records = HashMap::new();
        let first = claim(&mut records, "a", args(1000, 5000, 0), 0);
        assert_eq!(first.grant, 960, "the limit less the floor (1/25)");
        let newcomer = claim(&mut records, "b", args(1000, 5000, 0), 10);
        assert_eq!(newcomer.grant, 40, "the floor, at once");
        assert!(newcomer.pressed, "b wants its fair half");
        let total: u64 = records.values().map(|record| record.counted(10)).sum();
        assert!(total <= 1000);
    }

    #[test]
    fn a_lowered_holder_counts_at_what_it_had_until_the_lower_share_has_reached_it() {
        let mut records = HashMap::new();
        claim(&mut records, "a", args(1000, 5000, 0), 0);
        claim(&mut records, "b", args(1000, 5000, 0), 10);
        let lowered = claim(&mut records, "a", args(1000, 5000, 960), 20);
        assert_eq!(
            lowered.grant, 480,
            "a lowers to the fair level of what the floor leaves"
        );
        let waiting = claim(&mut records, "b", args(1000, 5000, 40), 30);
        assert_eq!(
            waiting.grant, 40,
            "a may still enforce 960 until its settle ends"
        );
        let settled = claim(&mut records, "b", args(1000, 5000, 40), 1_030);
        assert_eq!(settled.grant, 480);
        assert!(!settled.pressed, "both hold their fair level");
        let total: u64 = records.values().map(|record| record.counted(1_030)).sum();
        assert_eq!(total, 960, "the floor is free for the next newcomer");
    }

    #[test]
    fn a_small_raise_is_not_made_and_a_holder_that_left_is_reclaimed_when_its_grant_ends() {
        let mut records = HashMap::new();
        let alone = claim(&mut records, "a", args(1000, 500, 0), 0);
        assert_eq!(
            alone.grant, 625,
            "its want and a quarter more, as nobody else wants any"
        );
        let kept = claim(&mut records, "a", args(1000, 540, 625), 10);
        assert_eq!(kept.grant, 625, "675 is 8 % more: not worth a fresh bucket");
        let b = claim(&mut records, "b", args(1000, 5000, 0), 20);
        assert_eq!(b.grant, 335, "what a holds leaves, less the floor");
        assert!(b.pressed);
        let after = claim(&mut records, "b", args(1000, 5000, 335), 15_011);
        assert_eq!(after.grant, 960, "a's grant ended at 15,010 ms");
        assert!(!records.contains_key("a"), "its record is gone");
    }

    #[test]
    fn room_to_grow_comes_only_from_what_the_wants_together_leave() {
        // Eight holders wanting 10, one wanting 50, of 96 shared: the eight get their wants
        // and the ninth the 16 left, with no room for anyone.
        let mut wants = vec![10; 8];
        wants.push(50);
        assert_eq!(
            target(&wants, 50, 96),
            Target {
                share: 16,
                level: 16
            }
        );
        assert_eq!(
            target(&wants, 10, 96),
            Target {
                share: 10,
                level: 16
            }
        );
        // Wants of 10 and 20 of 96: each gets a quarter more.
        assert_eq!(target(&[10, 20], 20, 96).share, 25);
        assert_eq!(target(&[10, 20], 10, 96).share, 12);
    }

    #[test]
    fn a_raise_held_back_by_the_tenth_does_not_leave_the_limit_pressed_forever() {
        let mut records = HashMap::new();
        claim(&mut records, "a", args(1000, 5000, 0), 0);
        claim(&mut records, "b", args(1000, 5000, 0), 10);
        claim(&mut records, "a", args(1000, 5000, 960), 20);
        let b = claim(&mut records, "b", args(1000, 5000, 40), 2_000);
        assert_eq!(b.grant, 480);
        // b's want drops, then comes back a little: a's raise would be under a tenth.
        claim(&mut records, "b", args(1000, 440, 480), 2_010);
        let a = claim(&mut records, "a", args(1000, 5000, 480), 2_020);
        assert_eq!(
            a.grant, 480,
            "520 is less than a tenth more than 480: not made"
        );
        assert!(!a.pressed, "and nobody is short for it");
    }

    #[test]
    fn a_hold_never_shortens_what_a_record_counts() {
        let mut records = HashMap::new();
        claim(&mut records, "a", args(1000, 5000, 0), 0);
        hold(&mut records, "a", [500, 1_000, 0, 0], 100);
        let record = records["a"];
        assert_eq!((record.share, record.until_ms), (960, 15_000));
        hold(&mut records, "a", [500, 20_000, 0, 0], 16_000);
        let record = records["a"];
        assert_eq!(
            (record.share, record.until_ms),
            (500, 36_000),
            "an ended part is replaced"
        );
    }

    #[test]
    fn a_small_cut_is_not_made_unless_someone_is_short() {
        let mut records = HashMap::new();
        assert_eq!(claim(&mut records, "a", args(1000, 500, 0), 0).grant, 625);
        let kept = claim(&mut records, "a", args(1000, 480, 625), 10);
        assert_eq!(
            kept.grant, 625,
            "600 is less than a tenth below: not worth a fresh bucket"
        );
        claim(&mut records, "b", args(1000, 5000, 0), 20);
        let cut = claim(&mut records, "a", args(1000, 480, 625), 30);
        assert_eq!(cut.grant, 480, "b is short: a goes to its fair level");
    }
}
