//! The duration syntax of URLs and config files.

use std::time::Duration;

/// Parses a duration as written in URLs and config files: a whole number with a unit,
/// `ms`, `s`, `m` or `h` (`250ms`, `30s`, `2m`); a bare number means milliseconds.
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
/// assert_eq!(parse_duration("1500"), Ok(Duration::from_millis(1500)));
/// assert!(parse_duration("soon").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("`{text}` is not a duration such as 250ms, 30s or 2m");
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let millis = match unit {
        "" | "ms" => Some(n),
        "s" => n.checked_mul(1_000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        _ => None,
    };
    millis.map(Duration::from_millis).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_errors() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        for bad in [
            "",
            "s",
            "-1s",
            "1.5s",
            "10 s",
            "3d",
            "99999999999999999999h",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
