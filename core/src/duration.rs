//! The one duration syntax of URLs, config files and the command line.

use std::time::Duration;

/// Parses a duration as written in URLs, config files and on the command line: numbers
/// with units, as the `humantime` crate reads them (`250ms`, `30s`, `2m`, `1h 30m`,
/// `1s 500ms`; `0` alone is zero).
///
/// A bare number is refused rather than guessed at (milliseconds? seconds?): write the
/// unit. Longer than 100 years ([`FOREVER`](crate::FOREVER)) is refused too.
///
/// # Errors
///
/// A message naming the text, for the caller to wrap into its own error kind.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::parse_duration;
///
/// assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
/// assert_eq!(parse_duration("1s 500ms"), Ok(Duration::from_millis(1500)));
/// assert!(parse_duration("1500").unwrap_err().contains("unit"));
/// assert!(parse_duration("soon").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(format!(
            "`{text}` is empty: write a duration such as 250ms, 30s or 2m"
        ));
    }
    if trimmed == "0" {
        return Ok(Duration::ZERO);
    }
    if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "`{text}` has no unit: write {trimmed}ms or {trimmed}s, for example"
        ));
    }
    // Each `<number><unit>` term is parsed alone and the sum is ours: `humantime` 2.4
    // panics when a later term carries exactly one second into a total of `u64::MAX`
    // seconds (`18446744073709551615s 1000ms`).
    let mut duration = Duration::ZERO;
    for term in terms(trimmed) {
        if !term.chars().any(char::is_alphabetic) {
            return Err(format!(
                "`{text}` has a number without a unit (`{}`)",
                term.trim()
            ));
        }
        let value = humantime::parse_duration(term.trim())
            .map_err(|e| format!("`{text}` is not a duration such as 250ms, 30s or 2m ({e})"))?;
        duration = duration.saturating_add(value);
        // Nothing configured is meant to be longer, and a longer one overflows the
        // arithmetic on it (a doubled timeout, a deadline) instead of meaning anything.
        if duration > crate::FOREVER {
            return Err(format!("`{text}` is longer than 100 years"));
        }
    }
    Ok(duration)
}

/// Splits `1h 30m`, `1h30m` or `1.5 s 20ms` into its terms as `humantime` reads them: a
/// term ends with its unit, at the first whitespace or digit after a letter.
fn terms(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.trim().is_empty() {
            return None;
        }
        let mut in_unit = false;
        let mut end = rest.len();
        for (at, c) in rest.char_indices() {
            if c.is_alphabetic() {
                in_unit = true;
            } else if in_unit {
                end = at;
                break;
            }
        }
        let (term, tail) = rest.split_at(end);
        rest = tail;
        Some(term)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_errors() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1m 30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert_eq!(
            parse_duration("99y"),
            Ok(Duration::from_secs(99 * 31_557_600))
        );
        for bad in [
            "",
            "s",
            "-1s",
            "1500",
            "10 parsecs",
            "99999999999999999999h",
            "10000000000000000000s",
            "101y",
            "5s 0",
            "1s 2",
            "1s -1s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn terms_are_read_as_humantime_reads_them() {
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1h 30m 15s"), Ok(Duration::from_secs(5415)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(
            parse_duration("1.5 s 20ms"),
            Ok(Duration::from_millis(1520))
        );
        assert_eq!(parse_duration(" 2 0s "), Ok(Duration::from_secs(20)));
        assert_eq!(parse_duration("500µs"), Ok(Duration::from_micros(500)));
        assert_eq!(parse_duration("1min 1sec"), Ok(Duration::from_secs(61)));
    }

    #[test]
    fn no_panic_when_a_term_carries_into_a_full_total() {
        for bad in [
            "18446744073709551615s 1000ms",
            "18446744073709551615s1000000000ns",
            "18446744073709551615s 999ms 1ms",
            "18446744073709551615s 1000000us",
            "1000000000ns 18446744073709551615s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_duration("999ms 1000000us"),
            Ok(Duration::from_millis(1999))
        );
    }
}
