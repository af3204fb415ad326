//! Calendar periods (SPEC §1 "Calendar periods"): a `fixed_window` whose windows are the days,
//! weeks, months or years of a time zone's calendar instead of equal spans since the epoch.
//!
//! A quota sold as "10,000 calls a month from the 15th" counts from the 15th at midnight, in
//! the customer's time zone, to the next 15th: 28 to 31 days, and a day of a daylight-saving
//! change is 23 or 25 hours long. A billing day the month does not have (the 31st in April)
//! is the month's last day. Periods are counted by the store's clock like every window: the
//! library computes the boundaries around its own clock, and the store picks the period its
//! own time falls in among three consecutive ones ([`CalendarPeriod::boundaries`]).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{Span, Timestamp};

/// The calendar unit of a period.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Period {
    /// From midnight to midnight.
    Day,
    /// Seven days from the first weekday (Monday unless anchored).
    Week,
    /// From the billing day (the 1st unless anchored) to the next month's.
    Month,
    /// From the 1st of January.
    Year,
}

impl Period {
    /// `day`, `week`, `month` or `year`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
            Period::Year => "year",
        }
    }

    /// The period's usual length, for what needs one number (the `w=` of `RateLimit-Policy`,
    /// a lease's size): a day, 7 days, 30 days, 365 days. Counting never uses it.
    pub const fn nominal(self) -> Duration {
        const DAY: u64 = 86_400;
        Duration::from_secs(match self {
            Period::Day => DAY,
            Period::Week => 7 * DAY,
            Period::Month => 30 * DAY,
            Period::Year => 365 * DAY,
        })
    }
}

impl FromStr for Period {
    type Err = CalendarError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "day" => Ok(Period::Day),
            "week" => Ok(Period::Week),
            "month" => Ok(Period::Month),
            "year" => Ok(Period::Year),
            other => Err(CalendarError::UnknownPeriod(other.to_owned())),
        }
    }
}

/// Why a calendar period could not be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CalendarError {
    /// Not `day`, `week`, `month` or `year`.
    #[error("`{0}` is not one of day, week, month, year")]
    UnknownPeriod(String),
    /// A time zone the database does not have.
    #[error("`{0}` is not a time zone (an IANA name such as Europe/Lisbon, or UTC)")]
    UnknownTimeZone(String),
    /// A billing day outside 1 to 31.
    #[error("the billing day of a month is 1 to 31, not {0}")]
    BillingDay(u8),
    /// An anchor the period does not take.
    #[error("{0}")]
    Anchor(String),
}

/// A calendar period in a time zone, with its anchor.
#[derive(Clone)]
pub struct CalendarPeriod {
    inner: Arc<Inner>,
}

struct Inner {
    period: Period,
    zone_name: String,
    zone: TimeZone,
    /// A month's billing day (1 to 31), a week's first day (0 Monday to 6 Sunday); 0 else.
    anchor: i8,
    /// The last period computed, `(start, end)` in microseconds: most decisions fall in it,
    /// and read it without a lock.
    last: ArcSwap<(u64, u64)>,
}

const WEEKDAYS: [&str; 7] = [
    "monday",
    "tuesday",
    "wednesday",
    "thursday",
    "friday",
    "saturday",
    "sunday",
];

impl CalendarPeriod {
    /// `period` in `time_zone` (an IANA name; `UTC` is UTC), from its first day: midnight,
    /// Monday, the 1st of the month, the 1st of January.
    pub fn new(period: Period, time_zone: &str) -> Result<CalendarPeriod, CalendarError> {
        let zone = TimeZone::get(time_zone)
            .map_err(|_| CalendarError::UnknownTimeZone(time_zone.to_owned()))?;
        let anchor = match period {
            Period::Month => 1,
            _ => 0,
        };
        Ok(CalendarPeriod {
            inner: Arc::new(Inner {
                period,
                zone_name: time_zone.to_owned(),
                zone,
                anchor,
                last: ArcSwap::from_pointee((0, 0)),
            }),
        })
    }

    /// Anchors the period: a month's billing day (`"15"`, 1 to 31; in a month without that
    /// day, its last day), a week's first day (`"sunday"`). Days and years take none.
    pub fn anchored(self, anchor: &str) -> Result<CalendarPeriod, CalendarError> {
        let inner = &self.inner;
        let anchor = match inner.period {
            Period::Month => {
                let day: u8 = anchor.parse().map_err(|_| {
                    CalendarError::Anchor(format!(
                        "a month's anchor is its billing day, 1 to 31, not `{anchor}`"
                    ))
                })?;
                if !(1..=31).contains(&day) {
                    return Err(CalendarError::BillingDay(day));
                }
                day as i8
            }
            Period::Week => WEEKDAYS
                .iter()
                .position(|name| name.eq_ignore_ascii_case(anchor))
                .ok_or_else(|| {
                    CalendarError::Anchor(format!(
                        "a week's anchor is its first day, monday to sunday, not `{anchor}`"
                    ))
                })? as i8,
            period => {
                return Err(CalendarError::Anchor(format!(
                    "a {} takes no anchor",
                    period.as_str()
                )));
            }
        };
        Ok(CalendarPeriod {
            inner: Arc::new(Inner {
                period: inner.period,
                zone_name: inner.zone_name.clone(),
                zone: inner.zone.clone(),
                anchor,
                last: ArcSwap::from_pointee((0, 0)),
            }),
        })
    }

    /// The unit.
    pub fn period(&self) -> Period {
        self.inner.period
    }

    /// The time zone's name, as given.
    pub fn time_zone(&self) -> &str {
        &self.inner.zone_name
    }

    /// The period containing `now` (microseconds since the epoch): `(start, end)`.
    pub fn bounds(&self, now: u64) -> (u64, u64) {
        let last = **self.inner.last.load();
        if last.0 <= now && now < last.1 {
            return last;
        }
        let bounds = self.compute(now);
        self.inner.last.store(Arc::new(bounds));
        bounds
    }

    /// Four consecutive boundaries around `now`: the start of the period before `now`'s, its
    /// start, its end, and the end of the one after. A store whose clock is a little behind
    /// or ahead of `now` finds its own period among the three.
    pub fn boundaries(&self, now: u64) -> [u64; 4] {
        let (start, end) = self.bounds(now);
        let (before, _) = self.compute(start.saturating_sub(1));
        let (_, after) = self.compute(end);
        [before, start, end, after]
    }

    /// The period containing `now`, computed; a time outside what the calendar can say (far
    /// beyond any clock) falls back to the period's nominal length from the epoch.
    fn compute(&self, now: u64) -> (u64, u64) {
        self.calendar_bounds(now).unwrap_or_else(|| {
            let length = self.inner.period.nominal().as_micros() as u64;
            let start = now - now % length;
            (start, start + length)
        })
    }

    fn calendar_bounds(&self, now: u64) -> Option<(u64, u64)> {
        let inner = &self.inner;
        let here = Timestamp::from_microsecond(i64::try_from(now).ok()?)
            .ok()?
            .to_zoned_datetime(inner.zone.clone())
            .date();
        let (start, end) = match inner.period {
            Period::Day => (here, here.tomorrow().ok()?),
            Period::Week => {
                let back = (here.weekday().to_monday_zero_offset() - inner.anchor).rem_euclid(7);
                let start = here.checked_sub(Span::new().days(back)).ok()?;
                (start, start.checked_add(Span::new().days(7)).ok()?)
            }
            Period::Month => {
                let this_month = billing_day(here, inner.anchor)?;
                let start = if here >= this_month {
                    this_month
                } else {
                    let earlier = here
                        .first_of_month()
                        .checked_sub(Span::new().months(1))
                        .ok()?;
                    billing_day(earlier, inner.anchor)?
                };
                let next = start
                    .first_of_month()
                    .checked_add(Span::new().months(1))
                    .ok()?;
                (start, billing_day(next, inner.anchor)?)
            }
            Period::Year => {
                let start = Date::new(here.year(), 1, 1).ok()?;
                (start, Date::new(here.year().checked_add(1)?, 1, 1).ok()?)
            }
        };
        Some((self.midnight(start)?, self.midnight(end)?))
    }

    /// The first instant of `date` in the zone (after the gap, where midnight is skipped).
    fn midnight(&self, date: Date) -> Option<u64> {
        let start = date.to_zoned_datetime(self.inner.zone.clone()).ok()?;
        u64::try_from(start.timestamp().as_microsecond()).ok()
    }
}

/// The billing day `anchor` in `date`'s month: the month's last day when it is shorter.
fn billing_day(date: Date, anchor: i8) -> Option<Date> {
    let day = anchor.min(date.days_in_month());
    Date::new(date.year(), date.month(), day).ok()
}

impl PartialEq for CalendarPeriod {
    fn eq(&self, other: &Self) -> bool {
        self.inner.period == other.inner.period
            && self.inner.zone_name == other.inner.zone_name
            && self.inner.anchor == other.inner.anchor
    }
}

impl Eq for CalendarPeriod {}

impl fmt::Debug for CalendarPeriod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CalendarPeriod")
            .field("period", &self.inner.period)
            .field("time_zone", &self.inner.zone_name)
            .field("anchor", &self.inner.anchor)
            .finish()
    }
}

impl fmt::Display for CalendarPeriod {
    /// `month from the 15th (Europe/Lisbon)`, `week from sunday (UTC)`, `day (UTC)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        match inner.period {
            Period::Month if inner.anchor != 1 => write!(f, "month from day {}", inner.anchor)?,
            Period::Week if inner.anchor != 0 => {
                write!(f, "week from {}", WEEKDAYS[inner.anchor as usize])?
            }
            period => f.write_str(period.as_str())?,
        }
        write!(f, " ({})", inner.zone_name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Microseconds of an RFC 3339 instant.
    fn at(text: &str) -> u64 {
        text.parse::<Timestamp>().unwrap().as_microsecond() as u64
    }

    fn period(unit: Period, zone: &str, anchor: Option<&str>) -> CalendarPeriod {
        let period = CalendarPeriod::new(unit, zone).unwrap();
        match anchor {
            Some(anchor) => period.anchored(anchor).unwrap(),
            None => period,
        }
    }

    fn days(bounds: (u64, u64)) -> f64 {
        (bounds.1 - bounds.0) as f64 / 86_400e6
    }

    #[test]
    fn months_end_after_28_29_30_or_31_days() {
        let month = period(Period::Month, "UTC", None);
        for (now, start, end) in [
            (
                "2026-02-10T12:00:00Z",
                "2026-02-01T00:00:00Z",
                "2026-03-01T00:00:00Z",
            ),
            (
                "2028-02-29T23:59:59Z",
                "2028-02-01T00:00:00Z",
                "2028-03-01T00:00:00Z",
            ),
            (
                "2026-04-30T00:00:00Z",
                "2026-04-01T00:00:00Z",
                "2026-05-01T00:00:00Z",
            ),
            (
                "2026-12-31T23:59:59.999999Z",
                "2026-12-01T00:00:00Z",
                "2027-01-01T00:00:00Z",
            ),
        ] {
            assert_eq!(month.bounds(at(now)), (at(start), at(end)), "{now}");
        }
        let lengths: Vec<f64> = [
            "2026-02-10T00:00:00Z",
            "2028-02-10T00:00:00Z",
            "2026-04-10T00:00:00Z",
            "2026-01-10T00:00:00Z",
        ]
        .iter()
        .map(|now| days(month.bounds(at(now))))
        .collect();
        assert_eq!(lengths, [28.0, 29.0, 30.0, 31.0]);
    }

    #[test]
    fn a_billing_day_the_month_lacks_is_its_last_day() {
        let billing = period(Period::Month, "UTC", Some("31"));
        // April has 30 days: its period runs from March 31 to April 30, then to May 31.
        assert_eq!(
            billing.bounds(at("2026-04-15T00:00:00Z")),
            (at("2026-03-31T00:00:00Z"), at("2026-04-30T00:00:00Z"))
        );
        assert_eq!(
            billing.bounds(at("2026-04-30T00:00:00Z")),
            (at("2026-04-30T00:00:00Z"), at("2026-05-31T00:00:00Z"))
        );
        // February of a leap year ends on the 29th, of another on the 28th.
        assert_eq!(
            billing.bounds(at("2028-02-29T10:00:00Z")).0,
            at("2028-02-29T00:00:00Z")
        );
        assert_eq!(
            billing.bounds(at("2027-03-01T10:00:00Z")),
            (at("2027-02-28T00:00:00Z"), at("2027-03-31T00:00:00Z"))
        );
        let fifteenth = period(Period::Month, "UTC", Some("15"));
        assert_eq!(
            fifteenth.bounds(at("2026-01-14T23:59:59Z")),
            (at("2025-12-15T00:00:00Z"), at("2026-01-15T00:00:00Z"))
        );
    }

    #[test]
    fn a_period_changes_exactly_at_midnight() {
        let day = period(Period::Day, "UTC", None);
        let midnight = at("2026-03-10T00:00:00Z");
        assert_eq!(
            day.bounds(midnight - 1).1,
            midnight,
            "the microsecond before"
        );
        assert_eq!(
            day.bounds(midnight).0,
            midnight,
            "midnight itself is the new day"
        );
        let year = period(Period::Year, "UTC", None);
        assert_eq!(
            year.bounds(at("2027-01-01T00:00:00Z")),
            (at("2027-01-01T00:00:00Z"), at("2028-01-01T00:00:00Z"))
        );
        assert_eq!(
            year.bounds(at("2026-12-31T23:59:59.999999Z")).1,
            at("2027-01-01T00:00:00Z")
        );
    }

    #[test]
    fn days_of_a_daylight_saving_change_last_23_or_25_hours() {
        let day = period(Period::Day, "America/New_York", None);
        // 2026-03-08: clocks go from 02:00 to 03:00 (EST to EDT).
        let spring = day.bounds(at("2026-03-08T12:00:00-04:00"));
        assert_eq!(
            spring,
            (
                at("2026-03-08T00:00:00-05:00"),
                at("2026-03-09T00:00:00-04:00")
            )
        );
        assert_eq!((spring.1 - spring.0) / 3_600_000_000, 23);
        // 2026-11-01: clocks go from 02:00 back to 01:00.
        let autumn = day.bounds(at("2026-11-01T12:00:00-05:00"));
        assert_eq!((autumn.1 - autumn.0) / 3_600_000_000, 25);
        // The month of the spring change is an hour shorter than 31 days.
        let month = period(Period::Month, "America/New_York", None);
        let march = month.bounds(at("2026-03-20T00:00:00Z"));
        assert_eq!(march.0, at("2026-03-01T00:00:00-05:00"));
        assert_eq!(march.1, at("2026-04-01T00:00:00-04:00"));
        assert_eq!((march.1 - march.0) / 3_600_000_000, 31 * 24 - 1);
        // Midnight in the zone, not in UTC: 03:00 UTC on the 10th is still the 9th there.
        assert_eq!(
            day.bounds(at("2026-03-10T03:00:00Z")).0,
            at("2026-03-09T00:00:00-04:00")
        );
    }

    #[test]
    fn weeks_start_on_their_anchor() {
        let monday = period(Period::Week, "UTC", None);
        // 2026-12-02 is a Wednesday.
        assert_eq!(
            monday.bounds(at("2026-12-02T10:00:00Z")),
            (at("2026-11-30T00:00:00Z"), at("2026-12-07T00:00:00Z"))
        );
        let sunday = period(Period::Week, "UTC", Some("Sunday"));
        assert_eq!(
            sunday.bounds(at("2026-12-02T10:00:00Z")),
            (at("2026-11-29T00:00:00Z"), at("2026-12-06T00:00:00Z"))
        );
        assert_eq!(
            sunday.bounds(at("2026-12-06T00:00:00Z")).0,
            at("2026-12-06T00:00:00Z")
        );
    }

    #[test]
    fn the_boundaries_around_now_cover_a_skewed_store() {
        let month = period(Period::Month, "UTC", None);
        assert_eq!(
            month.boundaries(at("2026-03-10T00:00:00Z")),
            [
                at("2026-02-01T00:00:00Z"),
                at("2026-03-01T00:00:00Z"),
                at("2026-04-01T00:00:00Z"),
                at("2026-05-01T00:00:00Z"),
            ]
        );
    }

    #[test]
    fn bad_settings_are_refused_with_the_reason() {
        assert_eq!(
            CalendarPeriod::new(Period::Day, "Mars/Olympus").unwrap_err(),
            CalendarError::UnknownTimeZone("Mars/Olympus".to_owned())
        );
        let month = CalendarPeriod::new(Period::Month, "UTC").unwrap();
        assert_eq!(
            month.clone().anchored("32").unwrap_err(),
            CalendarError::BillingDay(32)
        );
        assert!(month.anchored("first").is_err());
        assert!(
            CalendarPeriod::new(Period::Week, "UTC")
                .unwrap()
                .anchored("funday")
                .is_err()
        );
        assert!(
            CalendarPeriod::new(Period::Day, "UTC")
                .unwrap()
                .anchored("1")
                .is_err()
        );
        assert_eq!(
            "fortnight".parse::<Period>().unwrap_err().to_string(),
            "`fortnight` is not one of day, week, month, year"
        );
    }
}
