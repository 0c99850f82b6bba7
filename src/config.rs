//! [`Config`]: what to connect to, from a URL or a TOML config file.

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use fencelock_core::{Error, RetryPolicy};
use percent_encoding::utf8_percent_encode;
use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};

use crate::redact::{COMPONENT, redact_url};
use crate::requirement::{self, Requirement};
use crate::{file, migrate};

/// Query options that the facade reads itself, for every scheme; the rest of the query
/// goes to the backend.
const FACADE_OPTIONS: &[&str] = &[
    "require",
    "retry",
    "retry_min_delay",
    "retry_max_delay",
    "metrics",
    "metrics_names",
    "max_waiters",
];

/// Which lock service to use and what it must guarantee: the one thing both a URL and a
/// config file load into, and what [`connect_config`](crate::connect_config) takes.
///
/// - From a URL: [`Config::from_url`] (the forms are listed at [`connect`](crate::connect)).
///   On any scheme, `?require=linearizable,fencing=strong` adds
///   [requirements](Requirement); `retry=N` wraps the lock in a [`Retry`](crate::Retry)
///   layer with N retries (`retry_min_delay=200ms` and `retry_max_delay=1s` adjust its
///   default policy, 3 retries after 200 ms, 500 ms, 1 s, and also turn it on; a zero
///   `retry_min_delay` is refused, as it would make every delay zero);
///   `metrics=true` wraps it in the metrics layer (cargo feature `metrics`;
///   `metrics_names=true` adds the lock name as a label); `max_waiters=N` lets at most N
///   acquires of the client wait at once and refuses the next with
///   [`Error::TooManyWaiters`] ([`WaiterLimit`](fencelock_core::WaiterLimit)). Layers
///   compose as metrics → waiter limit → retry → migration → backend.
/// - From a TOML file: [`Config::from_file`] / [`Config::from_toml_str`]. A config file
///   is a structured way to write the same URL: it is turned into one, so both forms
///   accept exactly the same settings and are checked by the same code. See the
///   README's "Config file" section for every key.
///
/// Neither `Debug` nor `Display` shows a password: both print the URL with secrets
/// replaced by `***`, also inside the leg URLs of a `migrate://` URL. Otherwise
/// `Display` round-trips: parsing it gives an equal `Config` (retry delays included;
/// only a retry factor or jitter set in code has no URL form). `Config` implements
/// `FromStr` (a URL) and serde's `Deserialize` (a URL, or a table of config-file keys),
/// so it can sit inside an application's own configuration.
///
/// # Examples
///
/// ```
/// use fencelock::{Config, Requirement};
///
/// let from_url = Config::from_url("etcd://app:s3cret@10.0.0.1:2379/locks?require=linearizable")?;
/// let from_file = Config::from_toml_str(r#"
///     backend = "etcd"
///     endpoints = ["10.0.0.1:2379"]
///     prefix = "locks"
///     require = ["linearizable"]
///     [auth]
///     user = "app"
///     password = "s3cret"
/// "#)?;
/// assert_eq!(from_url.requirements(), [Requirement::Linearizable]);
/// assert_eq!(from_url.to_string(), from_file.to_string());
/// assert!(!format!("{from_file:?}").contains("s3cret"));
/// # Ok::<(), fencelock::Error>(())
/// ```
#[derive(Clone, PartialEq)]
pub struct Config {
    /// The backend URL without the facade's options. May hold a password: never printed.
    url: String,
    requirements: Vec<Requirement>,
    retry: Option<RetryPolicy>,
    metrics: bool,
    metrics_names: bool,
    max_waiters: Option<usize>,
}

impl Config {
    /// Reads a URL: `SCHEME://...`, with the facade's options (`require=`) taken out of
    /// its query.
    ///
    /// Checks the whole URL without connecting: the facade's options, the backend's own
    /// URL with the backend's parser (hosts, ports, options, values), and for
    /// `migrate://` the whole migration (phase, epochs, both leg URLs). Whether the
    /// scheme is known and compiled in is checked by
    /// [`connect_config`](crate::connect_config).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidUrl`] (password redacted) for a malformed URL: no scheme, a bad
    /// host or port, an unknown or malformed option; [`Error::InvalidConfig`] for an
    /// unknown requirement, a value out of range or a bad migration setting.
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let url = url.trim();
        let invalid = |reason: &str| Error::InvalidUrl {
            url: redact_url(url),
            reason: reason.to_owned(),
        };
        let Some((scheme, _)) = url.split_once("://") else {
            return Err(invalid(
                "expected SCHEME://..., for example mem:// or etcd://host:2379/locks",
            ));
        };
        if scheme.is_empty() {
            return Err(invalid("the scheme is empty"));
        }
        if !fencelock_core::urlparts::is_scheme(scheme) {
            return Err(invalid(
                "expected SCHEME://..., for example mem:// or etcd://host:2379/locks",
            ));
        }
        let (head, query) = match url.split_once('?') {
            Some((head, query)) => (head, Some(query)),
            None => (url, None),
        };
        let mut config = Config {
            url: String::new(),
            requirements: Vec::new(),
            retry: None,
            metrics: false,
            metrics_names: false,
            max_waiters: None,
        };
        let mut rest = Vec::new();
        let mut seen: Vec<&str> = Vec::new();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if !FACADE_OPTIONS.contains(&key) {
                rest.push(pair);
                continue;
            }
            // `require` lists add up; any other option given twice is ambiguous.
            if key != "require" {
                if seen.contains(&key) {
                    return Err(invalid(&format!("`{key}` is given twice; give it once")));
                }
                seen.push(key);
            }
            let value = percent_encoding::percent_decode_str(value)
                .decode_utf8()
                .map_err(|_| invalid(&format!("`{key}` is not valid percent-encoded UTF-8")))?;
            if key == "require" {
                config.requirements.extend(requirement::parse_list(&value)?);
            } else {
                config
                    .facade_option(key, &value)
                    .map_err(|reason| invalid(&reason))?;
            }
        }
        config.url = if rest.is_empty() {
            head.to_owned()
        } else {
            format!("{head}?{}", rest.join("&"))
        };
        if scheme.eq_ignore_ascii_case(migrate::SCHEME) {
            migrate::MigrationSpec::parse(&config.url)?;
        } else {
            crate::connect::check_backend_url(&config.url)?;
        }
        Ok(config)
    }

    /// Applies one of the facade's own URL options other than `require`.
    fn facade_option(&mut self, key: &str, value: &str) -> Result<(), String> {
        let delay = |value: &str| {
            fencelock_core::parse_duration(value).map_err(|reason| format!("{key}: {reason}"))
        };
        match key {
            "retry" => {
                let retries: usize = value
                    .parse()
                    .map_err(|_| format!("retry must be a number of retries, not {value:?}"))?;
                let policy = self.retry.unwrap_or_default();
                self.retry = Some(policy.max_retries(retries));
            }
            "retry_min_delay" => {
                let policy = self.retry.unwrap_or_default().min_delay(delay(value)?);
                self.retry = Some(policy.map_err(|error| format!("retry_min_delay: {error}"))?);
            }
            "retry_max_delay" => {
                self.retry = Some(self.retry.unwrap_or_default().max_delay(delay(value)?))
            }
            "max_waiters" => match value.parse::<usize>() {
                Ok(limit) if limit > 0 => self.max_waiters = Some(limit),
                _ => {
                    return Err(format!(
                        "max_waiters must be a number of waiting acquires of at least 1, not {value:?}"
                    ));
                }
            },
            _ => {
                let on = match value {
                    "true" | "1" | "on" => true,
                    "false" | "0" | "off" => false,
                    _ => return Err(format!("{key} must be true or false, not {value:?}")),
                };
                if key == "metrics" {
                    self.metrics = on;
                } else {
                    self.metrics_names = on;
                }
            }
        }
        Ok(())
    }

    /// Parses a TOML config file's text.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the line and the problem (never the value of a
    /// password), or as [`Config::from_url`] for the URL it describes.
    pub fn from_toml_str(text: &str) -> Result<Self, Error> {
        Config::from_url(&file::to_url(text)?)
    }

    /// Reads and parses a TOML config file.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when the file cannot be read; otherwise as
    /// [`Config::from_toml_str`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::InvalidConfig(format!("cannot read config file {}: {e}", path.display()))
        })?;
        Config::from_toml_str(&text)
    }

    /// Adds a requirement.
    pub fn require(mut self, requirement: Requirement) -> Self {
        if !self.requirements.contains(&requirement) {
            self.requirements.push(requirement);
        }
        self
    }

    /// The requirements checked when connecting.
    pub fn requirements(&self) -> &[Requirement] {
        &self.requirements
    }

    /// Wraps the lock in a [`Retry`](crate::Retry) layer with `policy`.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = Some(policy);
        self
    }

    /// The retry policy, if the lock is wrapped in a [`Retry`](crate::Retry) layer.
    pub fn retry_policy(&self) -> Option<&RetryPolicy> {
        self.retry.as_ref()
    }

    /// Wraps the lock in the metrics layer (needs the cargo feature `metrics`).
    pub fn metrics(mut self, on: bool) -> Self {
        self.metrics = on;
        self
    }

    /// Whether the lock is wrapped in the metrics layer.
    pub fn has_metrics(&self) -> bool {
        self.metrics
    }

    /// Labels the metrics with the lock name too (URL option `metrics_names=true`): only
    /// for a small, fixed set of names (see the metrics layer's "Cardinality").
    pub fn metrics_names(mut self, on: bool) -> Self {
        self.metrics_names = on;
        self
    }

    /// Whether the metrics carry the lock name.
    pub fn has_metrics_names(&self) -> bool {
        self.metrics_names
    }

    /// Lets at most `limit` acquires of the client wait at once (URL option
    /// `max_waiters=N`); the next is refused at once with [`Error::TooManyWaiters`].
    /// `None` removes the limit.
    pub fn max_waiters(mut self, limit: Option<usize>) -> Self {
        self.max_waiters = limit.filter(|&limit| limit > 0);
        self
    }

    /// The waiter limit, if any.
    pub fn waiter_limit(&self) -> Option<usize> {
        self.max_waiters
    }

    /// The URL scheme, which names the backend (`etcd`, `redis`, `migrate`, ...).
    pub fn scheme(&self) -> &str {
        self.url.split_once("://").map_or("", |(scheme, _)| scheme)
    }

    /// The backend URL without the facade's options. Holds the password, if any: do not
    /// log it (use `Display`).
    pub(crate) fn backend_url(&self) -> &str {
        &self.url
    }
}

impl fmt::Display for Config {
    /// The equivalent URL, with secrets replaced by `***`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(&self.url))?;
        let mut options = Vec::new();
        if !self.requirements.is_empty() {
            let list: Vec<String> = self.requirements.iter().map(|r| r.to_string()).collect();
            options.push(format!("require={}", list.join(",")));
        }
        if let Some(policy) = &self.retry {
            options.push(format!("retry={}", policy.retries()));
            let (min, max) = policy.delay_bounds();
            let (default_min, default_max) = RetryPolicy::default().delay_bounds();
            let text = |d: Duration| {
                utf8_percent_encode(&humantime::format_duration(d).to_string(), COMPONENT)
                    .to_string()
            };
            if min != default_min {
                options.push(format!("retry_min_delay={}", text(min)));
            }
            if max != default_max {
                options.push(format!("retry_max_delay={}", text(max)));
            }
        }
        if self.metrics {
            options.push("metrics=true".into());
        }
        if self.metrics_names {
            options.push("metrics_names=true".into());
        }
        if let Some(limit) = self.max_waiters {
            options.push(format!("max_waiters={limit}"));
        }
        for (i, option) in options.iter().enumerate() {
            let separator = if i == 0 && !self.url.contains('?') {
                '?'
            } else {
                '&'
            };
            write!(f, "{separator}{option}")?;
        }
        Ok(())
    }
}

impl FromStr for Config {
    type Err = Error;

    /// [`Config::from_url`].
    fn from_str(url: &str) -> Result<Self, Error> {
        Config::from_url(url)
    }
}

/// A `Config` inside an application's own configuration (any serde format): either a
/// URL string, or a table with the keys of a fencelock config file (see
/// [`Config::from_toml_str`]). Errors are fencelock's, with passwords redacted (a format
/// may still quote the application's document around them, as `toml` does).
///
/// ```
/// #[derive(serde::Deserialize)]
/// struct AppConfig {
///     name: String,
///     locks: fencelock::Config,
/// }
///
/// let app: AppConfig = toml::from_str(r#"
///     name = "billing"
///     [locks]
///     backend = "etcd"
///     endpoints = ["10.0.0.1:2379"]
///     prefix = "billing"
///     lease = "15s"
/// "#)?;
/// assert_eq!(app.locks.to_string(), "etcd://10.0.0.1:2379/billing?lease=15s");
///
/// let short: AppConfig = toml::from_str(r#"
///     name = "billing"
///     locks = "etcd://10.0.0.1:2379/billing?lease=15s"
/// "#)?;
/// assert_eq!(short.locks, app.locks);
/// # Ok::<(), toml::de::Error>(())
/// ```
impl<'de> Deserialize<'de> for Config {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ConfigVisitor;

        impl<'de> Visitor<'de> for ConfigVisitor {
            type Value = Config;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a lock backend URL or a table of fencelock settings")
            }

            fn visit_str<E: de::Error>(self, url: &str) -> Result<Config, E> {
                Config::from_url(url).map_err(E::custom)
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Config, A::Error> {
                let table =
                    file::FileConfig::deserialize(de::value::MapAccessDeserializer::new(map))?;
                table
                    .url()
                    .and_then(|url| Config::from_url(&url))
                    .map_err(de::Error::custom)
            }
        }

        deserializer.deserialize_any(ConfigVisitor)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("url", &redact_url(&self.url))
            .field("requirements", &self.requirements)
            .field("retry", &self.retry)
            .field("metrics", &self.metrics)
            .field("metrics_names", &self.metrics_names)
            .finish()
    }
}

#[cfg(test)]
mod tests;
