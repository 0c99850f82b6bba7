//! Durations on the command line: `250ms`, `2s`, `1.5s`, `5m`, `1h`, or plain seconds.

use std::time::Duration;

/// Parses a duration for clap.
///
/// # Errors
///
/// A message naming the accepted forms.
pub fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale = match unit.trim() {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => {
            return Err(format!(
                "{text:?} is not a duration (try 250ms, 2s, 5m, 1h)"
            ));
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (try 250ms, 2s, 5m, 1h)"))?;
    Duration::try_from_secs_f64(value * scale).map_err(|_| format!("{text:?} is out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse("3"), Ok(Duration::from_secs(3)));
        assert_eq!(parse("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("0"), Ok(Duration::ZERO));
        for bad in ["", "s", "-1s", "2 weeks", "1e999s", "1.2.3s"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
