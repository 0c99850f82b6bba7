//! The TOML config file, turned into the URL it describes.
//!
//! ```toml
//! backend = "etcd"                    # or: url = "etcd://10.0.0.1:2379/locks"
//! endpoints = ["10.0.0.1:2379", "10.0.0.2:2379"]
//! prefix = "locks"                    # etcd key prefix, ZooKeeper chroot, Redis key prefix, mem namespace
//! lease = "30s"                       # etcd session lease, ZooKeeper session timeout
//! require = ["linearizable", "fencing=strong"]
//!
//! [auth]
//! user = "app"
//! password_env = "ETCD_PASSWORD"      # or: password = "..."
//!
//! [tls]                               # etcds:// (ca, cert, key, domain); zks:// and every Redis topology (ca, cert, key)
//! ca = "/etc/fencelock/ca.pem"
//!
//! [options]                           # any other URL option of the backend, as is
//! cleanup_timeout = "5s"
//! ```
//!
//! A `[migration]` table (with `phase`, `epoch`, `legacy_epoch`, `second_leg_wait` and
//! the sub-tables `[migration.legacy]` and `[migration.target]`, each a config of its
//! own) describes a `migrate://` URL instead of `backend`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use fencelock_core::Error;
use percent_encoding::utf8_percent_encode;
use serde::Deserialize;

use crate::redact::COMPONENT;

/// What may appear in user info: everything but the unreserved characters is encoded.
const USERINFO: &percent_encoding::AsciiSet = COMPONENT;

/// The keys of a config file (also a table in an application's own configuration, see
/// `Config`'s `Deserialize`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    url: Option<String>,
    backend: Option<String>,
    endpoints: Option<Vec<String>>,
    prefix: Option<String>,
    lease: Option<toml::Value>,
    service: Option<String>,
    db: Option<u32>,
    #[serde(default)]
    require: Vec<String>,
    retry: Option<RetrySetting>,
    metrics: Option<bool>,
    max_waiters: Option<u64>,
    auth: Option<Auth>,
    tls: Option<Tls>,
    #[serde(default)]
    options: BTreeMap<String, toml::Value>,
    migration: Option<Migration>,
}

/// `retry = 3`, or a table with `retries`, `min_delay` and `max_delay`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RetrySetting {
    Retries(u32),
    Policy(RetryTable),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RetryTable {
    retries: Option<u32>,
    min_delay: Option<toml::Value>,
    max_delay: Option<toml::Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Auth {
    user: Option<String>,
    password: Option<String>,
    password_env: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Tls {
    enabled: Option<bool>,
    ca: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    domain: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Migration {
    phase: String,
    epoch: Option<u8>,
    legacy_epoch: Option<u8>,
    second_leg_wait: Option<toml::Value>,
    legacy: Option<Box<FileConfig>>,
    target: Option<Box<FileConfig>>,
}

/// Parses a config file's text into the URL it describes.
pub(crate) fn to_url(text: &str) -> Result<String, Error> {
    let file: FileConfig = toml::from_str(text).map_err(|e| parse_error(text, &e))?;
    file.url()
}

/// A TOML error that names the line but never shows a secret's value: serde's messages
/// quote the offending value, so on a line that holds a secret only the line is named.
fn parse_error(text: &str, error: &toml::de::Error) -> Error {
    // A byte offset moved back onto a character boundary (never slice inside a
    // character: the panic message would print the file, secrets and all).
    let floor = |offset: usize| {
        let mut offset = offset.min(text.len());
        while !text.is_char_boundary(offset) {
            offset -= 1;
        }
        offset
    };
    let Some(span) = error.span() else {
        return Error::InvalidConfig(format!("config file: {}", error.message()));
    };
    let (span_start, span_end) = (floor(span.start), floor(span.end));
    let start = text[..span_start].rfind('\n').map_or(0, |i| i + 1);
    let end = text[span_end..]
        .find('\n')
        .map_or(text.len(), |i| span_end + i);
    let lines = &text[start..end.max(start)].to_ascii_lowercase();
    let line = text[..span_start].matches('\n').count() + 1;
    if ["password", "secret", "token", "@"]
        .iter()
        .any(|s| lines.contains(s))
    {
        Error::InvalidConfig(format!(
            "config file line {line}: invalid value for a secret setting (not shown)"
        ))
    } else {
        Error::InvalidConfig(format!("config file line {line}: {}", error.message()))
    }
}

fn invalid(message: String) -> Error {
    Error::InvalidConfig(format!("config file: {message}"))
}

fn enc(text: &str) -> String {
    utf8_percent_encode(text, COMPONENT).to_string()
}

/// A duration given as a string with its unit (`"30s"`, `"500ms"`), the syntax of
/// URLs and the command line ([`fencelock_core::parse_duration`]); `0` may be a number.
/// Any other bare number is refused rather than guessed at.
fn duration_text(key: &str, value: &toml::Value) -> Result<String, Error> {
    match value {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(0) => Ok("0".into()),
        toml::Value::Integer(n) => Err(invalid(format!(
            "`{key}` = {n} has no unit: write \"{n}s\" or \"{n}ms\", for example"
        ))),
        _ => Err(invalid(format!(
            "`{key}` must be a duration such as \"30s\""
        ))),
    }
}

fn option_text(key: &str, value: &toml::Value) -> Result<String, Error> {
    match value {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(n) => Ok(n.to_string()),
        toml::Value::Float(x) => Ok(x.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        _ => Err(invalid(format!(
            "option `{key}` must be a string, number or boolean"
        ))),
    }
}

impl FileConfig {
    /// The URL this config describes.
    pub(crate) fn url(&self) -> Result<String, Error> {
        let mut query: Vec<(String, String)> = Vec::new();
        let base = match (&self.migration, &self.url, &self.backend) {
            (Some(migration), None, None | Some(_)) => {
                if self.backend.as_deref().is_some_and(|b| b != "migrate") {
                    return Err(invalid(
                        "`backend` and [migration] exclude each other".into(),
                    ));
                }
                self.refuse_backend_fields("[migration]")?;
                migration.push_query(&mut query)?;
                "migrate://".to_owned()
            }
            (None, Some(url), None) => {
                self.refuse_backend_fields("`url`")?;
                self.with_auth(url)?
            }
            (None, None, Some(backend)) => self.build(backend, &mut query)?,
            (Some(_), Some(_), _) => {
                return Err(invalid("`url` and [migration] exclude each other".into()));
            }
            (None, Some(_), Some(_)) => {
                return Err(invalid("give either `url` or `backend`, not both".into()));
            }
            (None, None, None) => {
                return Err(invalid(
                    "say which lock service to use: `backend = \"etcd\"` (with endpoints), \
                     `url = \"...\"`, or a [migration] table"
                        .into(),
                ));
            }
        };
        for (key, value) in &self.options {
            query.push((key.clone(), option_text(key, value)?));
        }
        if !self.require.is_empty() {
            query.push(("require".into(), self.require.join(",")));
        }
        match &self.retry {
            Some(RetrySetting::Retries(n)) => query.push(("retry".into(), n.to_string())),
            Some(RetrySetting::Policy(table)) => {
                let retries = table.retries.unwrap_or(3);
                query.push(("retry".into(), retries.to_string()));
                for (key, value) in [
                    ("retry_min_delay", &table.min_delay),
                    ("retry_max_delay", &table.max_delay),
                ] {
                    if let Some(value) = value {
                        query.push((key.into(), duration_text(key, value)?));
                    }
                }
            }
            None => {}
        }
        if let Some(metrics) = self.metrics {
            query.push(("metrics".into(), metrics.to_string()));
        }
        if let Some(limit) = self.max_waiters {
            query.push(("max_waiters".into(), limit.to_string()));
        }
        for (i, (key, _)) in query.iter().enumerate() {
            if key != "require" && query[..i].iter().any(|(earlier, _)| earlier == key) {
                return Err(invalid(format!(
                    "`{key}` is set twice (as a setting and in [options]); give it once"
                )));
            }
        }
        let mut url = base;
        for (i, (key, value)) in query.iter().enumerate() {
            let separator = if i == 0 && !url.contains('?') {
                '?'
            } else {
                '&'
            };
            let _ = write!(url, "{separator}{}={}", enc(key), enc(value));
        }
        Ok(url)
    }

    fn refuse_backend_fields(&self, because: &str) -> Result<(), Error> {
        let set = [
            ("endpoints", self.endpoints.is_some()),
            ("prefix", self.prefix.is_some()),
            ("lease", self.lease.is_some()),
            ("service", self.service.is_some()),
            ("db", self.db.is_some()),
            ("[tls]", self.tls.is_some()),
            ("[auth]", self.auth.is_some() && because != "`url`"),
        ];
        match set.iter().find(|(_, present)| *present) {
            Some((field, _)) => Err(invalid(format!(
                "{field} cannot be combined with {because}; put it in {}",
                if because == "`url`" {
                    "the URL"
                } else {
                    "[migration.legacy] or [migration.target]"
                }
            ))),
            None => Ok(()),
        }
    }

    /// `user:password@`, percent-encoded, or nothing.
    fn userinfo(&self) -> Result<String, Error> {
        let Some(auth) = &self.auth else {
            return Ok(String::new());
        };
        let password = match (&auth.password, &auth.password_env) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "[auth] takes `password` or `password_env`, not both".into(),
                ));
            }
            (Some(p), None) => Some(p.clone()),
            (None, Some(var)) => Some(std::env::var(var).map_err(|_| {
                invalid(format!(
                    "[auth] password_env: the variable {var} is not set"
                ))
            })?),
            (None, None) => None,
        };
        let user = auth.user.as_deref().map(enc).unwrap_or_default();
        Ok(match password {
            Some(p) => format!("{user}:{}@", utf8_percent_encode(&p, USERINFO)),
            None if !user.is_empty() => format!("{user}@"),
            None => String::new(),
        })
    }

    /// Adds `[auth]` to a URL given as `url`, unless it already has user info.
    fn with_auth(&self, url: &str) -> Result<String, Error> {
        let userinfo = self.userinfo()?;
        if userinfo.is_empty() {
            return Ok(url.to_owned());
        }
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| invalid("`url` must look like SCHEME://...".into()))?;
        let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
        if authority.contains('@') {
            return Err(invalid(
                "[auth] and user info in `url` exclude each other".into(),
            ));
        }
        Ok(format!("{scheme}://{userinfo}{rest}"))
    }

    fn build(&self, backend: &str, query: &mut Vec<(String, String)>) -> Result<String, Error> {
        let backend = backend.trim().to_ascii_lowercase();
        let endpoints = self.endpoints.clone().unwrap_or_default().join(",");
        let tls = self.tls.as_ref().filter(|t| t.enabled != Some(false));
        let prefix = self.prefix.clone().unwrap_or_default();
        let lease = self
            .lease
            .as_ref()
            .map(|l| duration_text("lease", l))
            .transpose()?;
        let unsupported = |what: &str| {
            Err(invalid(format!(
                "`{what}` is not a setting of the {backend} backend"
            )))
        };
        let tls_files = |tls: &Tls| tls.ca.is_some() || tls.cert.is_some() || tls.key.is_some();
        let userinfo = self.userinfo()?;
        if endpoints.is_empty() && backend != "mem" {
            return Err(invalid(format!("the {backend} backend needs `endpoints`")));
        }
        if self.service.is_some()
            && !matches!(backend.as_str(), "redis+sentinel" | "rediss+sentinel")
        {
            return unsupported("service");
        }
        if self.db.is_some()
            && !matches!(
                backend.as_str(),
                "redis" | "rediss" | "redis+sentinel" | "rediss+sentinel"
            )
        {
            return unsupported("db");
        }
        let url = match backend.as_str() {
            "mem" => {
                if !endpoints.is_empty() || lease.is_some() || tls.is_some() || self.auth.is_some()
                {
                    return Err(invalid(
                        "the mem backend takes only `prefix` (its namespace)".into(),
                    ));
                }
                format!("mem://{}", enc(&prefix))
            }
            "etcd" | "etcds" => {
                if let Some(lease) = lease {
                    query.push(("lease".into(), lease));
                }
                let scheme = if tls.is_some() || backend == "etcds" {
                    "etcds"
                } else {
                    "etcd"
                };
                if let Some(tls) = tls {
                    for (key, value) in [
                        ("ca", &tls.ca),
                        ("cert", &tls.cert),
                        ("key", &tls.key),
                        ("domain", &tls.domain),
                    ] {
                        if let Some(value) = value {
                            query.push((key.into(), value.clone()));
                        }
                    }
                }
                format!("{scheme}://{userinfo}{endpoints}/{}", enc_path(&prefix))
            }
            "zk" | "zookeeper" | "zks" => {
                if tls.is_some_and(|t| t.domain.is_some()) {
                    return Err(invalid(
                        "the ZooKeeper backend checks each server's own name; [tls] takes \
                         `enabled`, `ca`, `cert` and `key`"
                            .into(),
                    ));
                }
                if let Some(lease) = lease {
                    query.push(("session_timeout".into(), lease));
                }
                if let Some(tls) = tls.filter(|t| tls_files(t)) {
                    for (key, value) in [("ca", &tls.ca), ("cert", &tls.cert), ("key", &tls.key)] {
                        if let Some(value) = value {
                            query.push((key.into(), value.clone()));
                        }
                    }
                }
                let scheme = if tls.is_some() || backend == "zks" {
                    "zks"
                } else {
                    "zk"
                };
                format!(
                    "{scheme}://{userinfo}{endpoints}/{}",
                    enc_path(prefix.trim_start_matches('/'))
                )
            }
            "redis" | "rediss" | "redis+sentinel" | "rediss+sentinel" | "redis+cluster"
            | "rediss+cluster" | "redlock" | "redlocks" => {
                if lease.is_some() {
                    return Err(invalid(
                        "Redis has no client-wide lease: the lease is chosen per acquire \
                         (AcquireOptions)"
                            .into(),
                    ));
                }
                if tls.is_some_and(|t| t.domain.is_some()) {
                    return Err(invalid(
                        "the Redis backend checks the endpoint's own name; [tls] takes \
                         `enabled`, `ca`, `cert` and `key`"
                            .into(),
                    ));
                }
                // A [tls] table picks each topology's TLS scheme.
                let scheme = match (backend.as_str(), tls.is_some()) {
                    ("redis", true) => "rediss",
                    ("redis+sentinel", true) => "rediss+sentinel",
                    ("redis+cluster", true) => "rediss+cluster",
                    ("redlock", true) => "redlocks",
                    (scheme, _) => scheme,
                };
                if let Some(prefix) = &self.prefix {
                    query.push(("prefix".into(), prefix.clone()));
                }
                if let Some(tls) = tls.filter(|t| tls_files(t)) {
                    for (key, value) in [("ca", &tls.ca), ("cert", &tls.cert), ("key", &tls.key)] {
                        if let Some(value) = value {
                            query.push((key.into(), value.clone()));
                        }
                    }
                }
                let path = match (scheme, &self.service, self.db) {
                    ("redis+sentinel" | "rediss+sentinel", Some(service), db) => {
                        if let Some(db) = db {
                            query.push(("db".into(), db.to_string()));
                        }
                        format!("/{}", enc(service))
                    }
                    ("redis+sentinel" | "rediss+sentinel", None, _) => {
                        return Err(invalid(format!("{scheme} needs `service`")));
                    }
                    (_, _, Some(db)) => format!("/{db}"),
                    _ => String::new(),
                };
                format!("{scheme}://{userinfo}{endpoints}{path}")
            }
            "migrate" => return Err(invalid("use a [migration] table for migrations".into())),
            other => format!("{other}://{userinfo}{endpoints}"),
        };
        Ok(url)
    }
}

/// A path: each segment percent-encoded, `/` kept.
fn enc_path(path: &str) -> String {
    path.split('/').map(enc).collect::<Vec<_>>().join("/")
}

impl Migration {
    fn push_query(&self, query: &mut Vec<(String, String)>) -> Result<(), Error> {
        query.push(("phase".into(), self.phase.clone()));
        if let Some(legacy) = &self.legacy {
            query.push(("legacy".into(), legacy.url()?));
        }
        if let Some(target) = &self.target {
            query.push(("target".into(), target.url()?));
        }
        if let Some(epoch) = self.epoch {
            query.push(("epoch".into(), epoch.to_string()));
        }
        if let Some(epoch) = self.legacy_epoch {
            query.push(("legacy_epoch".into(), epoch.to_string()));
        }
        if let Some(wait) = &self.second_leg_wait {
            query.push((
                "second_leg_wait".into(),
                duration_text("second_leg_wait", wait)?,
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
