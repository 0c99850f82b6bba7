//! The `zk://`, `zookeeper://` and `zks://` URL parser: a URL to a [`ZkConfig`].

use fencelock_core::{Error, parse_duration, urlparts};

use super::{AclPolicy, AuthMethod, DEFAULT_PORT, ZkConfig, ZkTls, normalize_chroot};

impl ZkConfig {
    /// Parses a `zk://`, `zookeeper://` or `zks://` URL (see the type's documentation).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidUrl`] (with the password redacted) for a malformed URL, an unknown
    /// query key or a bad value; [`Error::InvalidConfig`] for inconsistent settings.
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let bad = |reason: String| Error::InvalidUrl {
            url: fencelock_core::redact_url(url),
            reason,
        };
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected zk://host:port/chroot".into()))?;
        urlparts::check_userinfo_encoded(rest).map_err(&bad)?;
        let tls = match scheme.to_ascii_lowercase().as_str() {
            "zk" | "zookeeper" => false,
            "zks" => true,
            _ => {
                return Err(bad(format!(
                    "the scheme {scheme:?} is not zk, zookeeper or zks"
                )));
            }
        };
        let (rest, query) = match rest.split_once('?') {
            Some((rest, query)) => (rest, Some(query)),
            None => (rest, None),
        };
        if rest.contains('#') {
            return Err(bad("a fragment (#) is not allowed".into()));
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let mut config = ZkConfig::new(normalize_hosts(hosts).map_err(&bad)?);
        if tls {
            config.tls = Some(ZkTls::default());
        }
        if let Some(userinfo) = userinfo {
            let (user, password) = userinfo
                .split_once(':')
                .ok_or_else(|| bad("the user info must be user:password".into()))?;
            let user = urlparts::percent_decode(user, "the user name").map_err(&bad)?;
            let password = urlparts::percent_decode(password, "the password").map_err(&bad)?;
            if user.is_empty() {
                return Err(bad("the digest user name is empty".into()));
            }
            config = config.with_digest(user, password);
        }
        let chroot = urlparts::percent_decode(path, "the chroot").map_err(&bad)?;
        config.chroot = normalize_chroot(&chroot).map_err(&bad)?;
        for (key, value) in urlparts::parse_query(query.unwrap_or("")).map_err(&bad)? {
            let value = value.as_str();
            match key.as_str() {
                "session_timeout" => {
                    config.session_timeout =
                        parse_duration(value).map_err(|r| bad(format!("session_timeout: {r}")))?
                }
                "min_lease" => {
                    config.min_lease =
                        parse_duration(value).map_err(|r| bad(format!("min_lease: {r}")))?
                }
                "connect_timeout" => {
                    config.connect_timeout =
                        parse_duration(value).map_err(|r| bad(format!("connect_timeout: {r}")))?
                }
                "sasl" => {
                    config.auth_method = match value.to_ascii_lowercase().as_str() {
                        "digest-md5" => AuthMethod::SaslDigestMd5,
                        _ => {
                            return Err(bad(format!(
                                "sasl must be digest-md5 (the one SASL mechanism supported), \
                                 not {value:?}"
                            )));
                        }
                    }
                }
                "ca" | "cert" | "key" => {
                    let tls = config
                        .tls
                        .as_mut()
                        .ok_or_else(|| bad(format!("`{key}` is a TLS setting: use zks://")))?;
                    let slot = match key.as_str() {
                        "ca" => &mut tls.ca,
                        "cert" => &mut tls.cert,
                        _ => &mut tls.key,
                    };
                    if value.is_empty() {
                        return Err(bad(format!("`{key}` needs a file path")));
                    }
                    *slot = Some(value.to_owned());
                }
                "acl" => {
                    config.acl = match value {
                        "open" => Some(AclPolicy::Open),
                        "creator" => Some(AclPolicy::CreatorOnly),
                        _ => {
                            return Err(bad(format!("acl must be open or creator, not {value:?}")));
                        }
                    }
                }
                _ => {
                    return Err(bad(format!(
                        "unknown query key {key:?} (known: session_timeout, min_lease, acl, \
                         connect_timeout, sasl, and with zks:// ca, cert, key)"
                    )));
                }
            }
        }
        if let Some(reason) = config.digest_user_problem() {
            return Err(bad(reason.into()));
        }
        config.validate()?;
        Ok(config)
    }
}

fn normalize_hosts(hosts: &str) -> Result<String, String> {
    let hosts = urlparts::parse_hosts(hosts, DEFAULT_PORT)?;
    Ok(hosts
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(","))
}
