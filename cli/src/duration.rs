//! Durations on the command line: the syntax of URLs and config files
//! ([`fencelock::parse_duration`]), remembered as written so messages repeat the
//! user's own words.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Parses a duration for clap.
///
/// # Errors
///
/// A message naming the accepted forms.
pub fn parse(text: &str) -> Result<Duration, String> {
    fencelock::parse_duration(text)
}

/// A duration and the text it was written as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurationArg {
    /// As written (trimmed).
    pub text: String,
    /// Its value.
    pub value: Duration,
}

impl FromStr for DurationArg {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Ok(DurationArg {
            text: text.trim().to_owned(),
            value: parse(text)?,
        })
    }
}

impl fmt::Display for DurationArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse("1s 500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("0"), Ok(Duration::ZERO));
        for bad in ["", "s", "-1s", "2 weeks ago", "3"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let arg: DurationArg = " 1s ".parse().unwrap();
        assert_eq!(
            (arg.to_string(), arg.value),
            ("1s".into(), Duration::from_secs(1))
        );
    }
}
