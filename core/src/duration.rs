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
    if trimmed == "0" {
        return Ok(Duration::ZERO);
    }
    if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "`{text}` has no unit: write {trimmed}ms or {trimmed}s, for example"
        ));
    }
    let duration = humantime::parse_duration(trimmed)
        .map_err(|e| format!("`{text}` is not a duration such as 250ms, 30s or 2m ({e})"))?;
    // Nothing configured is meant to be longer, and a longer one overflows the arithmetic
    // on it (a doubled timeout, a deadline) instead of meaning anything.
    if duration > crate::FOREVER {
        return Err(format!("`{text}` is longer than 100 years"));
    }
    Ok(duration)
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
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
