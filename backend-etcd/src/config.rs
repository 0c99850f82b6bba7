//! `etcd://` URLs and typed configuration.

use std::fmt;
use std::time::Duration;

use fencelock_core::{Error, urlparts};

/// etcd's smallest lease TTL with its default timing (heartbeat 100 ms, election 1 s): it
/// turns anything shorter into 2 s by itself. fencelock refuses shorter leases instead.
pub const MIN_LEASE: Duration = Duration::from_secs(2);

/// Configuration of an etcd lock client.
///
/// Built from a URL with [`EtcdConfig::from_url`] or field by field; settings made after
/// parsing win over the URL's query pairs.
///
/// ```text
/// etcd://[user:password@]host:port[,host:port...]/prefix[?lease=30s&connect_timeout=5s&cleanup_timeout=5s]
/// etcds://...                 TLS (needs the `tls` feature); ?ca=PATH[&cert=PATH&key=PATH]&domain=NAME
/// ```
///
/// The prefix is the URL path without its first `/` (`etcd://h:2379//locks` gives
/// `/locks`); it must not be empty. Keys are `{prefix}/{encoded name}/{lease id in hex}`,
/// the layout of etcd's Go `concurrency.Mutex` for the prefix `{prefix}/{encoded name}`.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `host:port` of each member.
    pub endpoints: Vec<String>,
    /// The key prefix under which locks live, without a trailing `/`.
    pub prefix: String,
    /// The session lease shared by all renewing locks with the default lease: whole
    /// seconds, at least [`MIN_LEASE`]. Default 30 s, kept alive every third of it.
    pub lease: Duration,
    /// User name for etcd authentication.
    pub user: Option<String>,
    /// Password for etcd authentication. Never printed.
    pub password: Option<String>,
    /// TLS settings; `Some` for `etcds://`.
    pub tls: Option<EtcdTls>,
    /// Time allowed to establish the connection. Default 5 s.
    pub connect_timeout: Duration,
    /// Upper bound on background clean-ups (deleting a cancelled waiter's key, releasing
    /// a dropped guard), so they never hang on an unreachable server. Default 5 s.
    pub cleanup_timeout: Duration,
}

/// TLS settings for `etcds://`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EtcdTls {
    /// PEM file with the CA certificate(s) to trust; `None`: the system's root certificates.
    pub ca: Option<String>,
    /// PEM client certificate, for mutual TLS.
    pub cert: Option<String>,
    /// PEM client key, for mutual TLS.
    pub key: Option<String>,
    /// Server name to verify, when it differs from the endpoint host.
    pub domain: Option<String>,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        EtcdConfig {
            endpoints: vec!["127.0.0.1:2379".into()],
            prefix: "fencelock".into(),
            lease: Duration::from_secs(30),
            user: None,
            password: None,
            tls: None,
            connect_timeout: Duration::from_secs(5),
            cleanup_timeout: Duration::from_secs(5),
        }
    }
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("lease", &self.lease)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("tls", &self.tls)
            .field("connect_timeout", &self.connect_timeout)
            .field("cleanup_timeout", &self.cleanup_timeout)
            .finish()
    }
}

impl EtcdConfig {
    /// Parses an `etcd://` or `etcds://` URL.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidUrl`] for a malformed URL (passwords redacted),
    /// [`Error::InvalidConfig`] for values out of range (see [`EtcdConfig::validate`]).
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let bad = |reason: &str| Error::InvalidUrl {
            url: fencelock_core::redact_url(url),
            reason: reason.to_owned(),
        };
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected etcd://host:port/prefix"))?;
        urlparts::check_userinfo_encoded(rest).map_err(|r| bad(&r))?;
        let tls = match scheme.to_ascii_lowercase().as_str() {
            "etcd" => None,
            "etcds" => Some(EtcdTls::default()),
            _ => return Err(bad("the scheme must be etcd or etcds")),
        };
        let (rest, query) = match rest.split_once('?') {
            Some((rest, query)) => (rest, Some(query)),
            None => (rest, None),
        };
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let mut config = EtcdConfig {
            tls,
            ..EtcdConfig::default()
        };
        if let Some(userinfo) = userinfo {
            let (user, password) = urlparts::parse_userinfo(userinfo).map_err(|r| bad(&r))?;
            config.user = Some(user.unwrap_or_default());
            config.password = password;
        }
        config.endpoints = urlparts::parse_hosts(hosts, 2379)
            .map_err(|r| bad(&r))?
            .iter()
            .map(ToString::to_string)
            .collect();
        config.prefix = decode(path.trim_end_matches('/'))
            .map_err(|_| bad("the prefix is not valid percent-encoded UTF-8"))?;
        for (key, value) in urlparts::parse_query(query.unwrap_or("")).map_err(|r| bad(&r))? {
            let key = key.as_str();
            match key {
                "lease" | "connect_timeout" | "cleanup_timeout" => {
                    let duration = fencelock_core::parse_duration(&value)
                        .map_err(|reason| bad(&format!("`{key}`: {reason}")))?;
                    match key {
                        "lease" => config.lease = duration,
                        "connect_timeout" => config.connect_timeout = duration,
                        _ => config.cleanup_timeout = duration,
                    }
                }
                "ca" | "cert" | "key" | "domain" => {
                    let tls = config
                        .tls
                        .as_mut()
                        .ok_or_else(|| bad(&format!("`{key}` is a TLS setting: use etcds://")))?;
                    let slot = match key {
                        "ca" => &mut tls.ca,
                        "cert" => &mut tls.cert,
                        "key" => &mut tls.key,
                        _ => &mut tls.domain,
                    };
                    *slot = Some(value);
                }
                other => return Err(bad(&format!("unknown setting `{other}`"))),
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks every setting; nothing is ever adjusted silently.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when there is no endpoint, the prefix is empty, the lease
    /// is shorter than [`MIN_LEASE`] or not whole seconds, a timeout is zero, or a
    /// password is given without a user.
    pub fn validate(&self) -> Result<(), Error> {
        let fail = |m: String| Err(Error::InvalidConfig(m));
        if self.endpoints.is_empty() {
            return fail("etcd: at least one endpoint is needed".into());
        }
        if self.prefix.is_empty() {
            return fail("etcd: the key prefix must not be empty (etcd://host:port/PREFIX)".into());
        }
        lease_seconds(self.lease)?;
        if self.connect_timeout.is_zero() || self.cleanup_timeout.is_zero() {
            return fail("etcd: timeouts must be longer than zero".into());
        }
        if self.password.is_some() && self.user.is_none() {
            return fail("etcd: a password needs a user name".into());
        }
        Ok(())
    }
}

/// The lease as whole seconds, refusing what etcd would silently change.
///
/// # Errors
///
/// [`Error::InvalidConfig`] if `lease` is shorter than [`MIN_LEASE`] or has a fraction of
/// a second.
pub fn lease_seconds(lease: Duration) -> Result<i64, Error> {
    if lease < MIN_LEASE {
        return Err(Error::InvalidConfig(format!(
            "etcd: a lease of {lease:?} is shorter than etcd's minimum of {MIN_LEASE:?}"
        )));
    }
    if lease > fencelock_core::MAX_LEASE {
        return Err(Error::InvalidConfig(format!(
            "etcd: a lease of {lease:?} is longer than the maximum of {:?} (365 days)",
            fencelock_core::MAX_LEASE
        )));
    }
    if lease.subsec_nanos() != 0 {
        return Err(Error::InvalidConfig(format!(
            "etcd: leases are whole seconds; {lease:?} is not"
        )));
    }
    i64::try_from(lease.as_secs())
        .map_err(|_| Error::InvalidConfig(format!("etcd: a lease of {lease:?} is too long")))
}

fn decode(s: &str) -> Result<String, std::str::Utf8Error> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .map(std::borrow::Cow::into_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(url: &str) -> Result<EtcdConfig, String> {
        EtcdConfig::from_url(url).map_err(|e| match e {
            Error::InvalidUrl { .. } => "invalid-url".into(),
            Error::InvalidConfig(_) => "invalid-config".into(),
            other => format!("{other:?}"),
        })
    }

    #[test]
    fn url_table() {
        let ok = parsed("etcd://127.0.0.1:2379/locks").unwrap();
        assert_eq!(ok.endpoints, ["127.0.0.1:2379"]);
        assert_eq!(ok.prefix, "locks");
        assert_eq!(ok.lease, Duration::from_secs(30));

        let multi =
            parsed("etcd://root:p%40ss@a:1,b:2,c/app/locks/?lease=10s&cleanup_timeout=250ms")
                .unwrap();
        assert_eq!(multi.endpoints, ["a:1", "b:2", "c:2379"]);
        assert_eq!(multi.prefix, "app/locks");
        assert_eq!(multi.lease, Duration::from_secs(10));
        assert_eq!(multi.cleanup_timeout, Duration::from_millis(250));
        assert_eq!(multi.user.as_deref(), Some("root"));
        assert_eq!(multi.password.as_deref(), Some("p@ss"));

        assert_eq!(parsed("etcd://h:1//abs").unwrap().prefix, "/abs");
        let tls = parsed("etcds://h:1/p?ca=/etc/ca.pem&domain=etcd.local").unwrap();
        assert_eq!(tls.tls.unwrap().ca.as_deref(), Some("/etc/ca.pem"));

        for (url, expected) in [
            ("etcd://h:1", "invalid-config"),  // no prefix
            ("etcd://h:1/", "invalid-config"), // empty prefix
            ("etcd://h:1/p?lease=1s", "invalid-config"),
            ("etcd://h:1/p?lease=0", "invalid-config"),
            ("etcd://h:1/p?lease=2500ms", "invalid-config"),
            ("etcd://h:1/p?lease=soon", "invalid-url"),
            ("etcd://h:1/p?ttl=3", "invalid-url"),
            ("etcd://h:1/p?ca=x", "invalid-url"), // TLS setting without etcds
            ("etcd://h:port/p", "invalid-url"),
            ("etcd://h:1,,h:2/p", "invalid-url"),
            ("etcd:///p", "invalid-url"),
            ("etc://h/p", "invalid-url"),
        ] {
            assert_eq!(
                parsed(url).map(|_| "ok".to_string()),
                Err(expected.to_string()),
                "{url}"
            );
        }
    }

    #[test]
    fn a_lease_beyond_the_maximum_is_refused_at_parse() {
        assert_eq!(
            parsed("etcd://127.0.0.1:2379/locks?lease=9000h").unwrap_err(),
            "invalid-config"
        );
        assert!(parsed("etcd://127.0.0.1:2379/locks?lease=8760h").is_ok());
    }

    #[test]
    fn passwords_stay_hidden() {
        let config = EtcdConfig::from_url("etcd://root:hunter2@h:1/p").unwrap();
        assert!(!format!("{config:?}").contains("hunter2"));
        let err = EtcdConfig::from_url("etcd://root:hunter2@h:port/p").unwrap_err();
        assert!(!err.to_string().contains("hunter2") && !format!("{err:?}").contains("hunter2"));
    }
}
