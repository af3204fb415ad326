//! Durations as the configuration writes them: `500ms`, `1s`, `2m`, `1h30m`, `1d`.

use super::errors::Problem;
use std::time::Duration;

/// Parses `<number><unit>` pairs (units `us`, `ms`, `s`, `m`, `h`, `d`), concatenated.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, Problem> {
    let text = text.trim();
    if text.is_empty() {
        return Err("is empty; expected a duration such as 500ms, 1s or 1d".into());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(problem!(
                "`{text}` is not a duration; expected e.g. 500ms, 1s, 1h30m, 1d"
            ));
        }
        let number: u64 = rest[..digits]
            .parse()
            .map_err(|_| problem!("`{text}`: number too large"))?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let part = match unit {
            "us" => Duration::from_micros(number),
            "ms" => Duration::from_millis(number),
            "s" => Duration::from_secs(number),
            "m" => Duration::from_secs(number.saturating_mul(60)),
            "h" => Duration::from_secs(number.saturating_mul(3600)),
            "d" => Duration::from_secs(number.saturating_mul(86_400)),
            "" => {
                return Err(problem!(
                    "`{text}` has no unit; write e.g. {number}s or {number}ms"
                ));
            }
            other => {
                return Err(problem!(
                    "`{text}`: unknown unit `{other}`; use us, ms, s, m, h or d"
                ));
            }
        };
        total = total.saturating_add(part);
    }
    Ok(total)
}

/// Formats a duration the way the configuration writes it.
#[cfg(test)]
fn format_duration(duration: Duration) -> String {
    let micros = duration.as_micros();
    if micros.is_multiple_of(86_400_000_000) && micros > 0 {
        format!("{}d", micros / 86_400_000_000)
    } else if micros.is_multiple_of(1_000_000) {
        format!("{}s", micros / 1_000_000)
    } else if micros.is_multiple_of(1000) {
        format!("{}ms", micros / 1000)
    } else {
        format!("{micros}us")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_combinations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration(" 60s "), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn rejects_what_is_not_a_duration() {
        for bad in [
            "",
            "s",
            "10",
            "1 s",
            "1x",
            "-1s",
            "1.5s",
            "99999999999999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn formats_round_trip() {
        for text in ["1d", "30s", "500ms", "250us"] {
            assert_eq!(format_duration(parse_duration(text).unwrap()), text);
        }
    }
}
