//! [`RedisConfig::from_url`]: the URL forms of the configuration (listed in
//! [`RedisConfig`]'s documentation).

use fencelock_core::{Error, parse_duration, urlparts};

use crate::config::RedisConfig;
use crate::keys::KeyLayout;
use crate::topology::{Endpoint, Topology};

impl RedisConfig {
    /// Parses one of the URL forms in the type's documentation.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidUrl`] (with the password redacted) for malformed URLs, unknown
    /// options, out-of-range values or a Redlock instance given twice; [`Error::InvalidConfig`] for TLS settings the URL
    /// cannot use (see [`RedisConfig::check_tls`]).
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let bad = |reason: String| Error::InvalidUrl {
            url: fencelock_core::redact_url(url),
            reason,
        };
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected SCHEME://HOST:PORT".into()))?;
        urlparts::check_userinfo_encoded(rest).map_err(&bad)?;
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match rest.split_once('/') {
            Some((a, p)) => (a, p),
            None => (rest, ""),
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let endpoints: Vec<Endpoint> = urlparts::parse_hosts(hosts, 6379)
            .map_err(&bad)?
            .into_iter()
            .map(|hp| Endpoint {
                host: hp.bare_host().to_owned(),
                port: hp.port,
            })
            .collect();
        let mut query_db = None;
        let mut config = RedisConfig::new(Topology::Cluster {
            seeds: Vec::new(),
            tls: false,
        });
        let mut prefix = None;
        let mut raw = false;
        for (key, value) in urlparts::parse_query(query.unwrap_or("")).map_err(&bad)? {
            match key.as_str() {
                "prefix" => prefix = Some(value),
                "layout" => {
                    raw = match value.as_str() {
                        "raw" => true,
                        "tagged" => false,
                        _ => return Err(bad("layout must be `tagged` or `raw`".into())),
                    }
                }
                "wait_replicas" => {
                    config.wait_replicas = value
                        .parse()
                        .map_err(|_| bad("wait_replicas must be a number".into()))?
                }
                "wait_timeout" => config.wait_timeout = parse_duration(&value).map_err(&bad)?,
                "timeout" => config.timeout = parse_duration(&value).map_err(&bad)?,
                "connect_timeout" => {
                    config.connect_timeout = parse_duration(&value).map_err(&bad)?
                }
                "token_ttl" => config.token_ttl = parse_duration(&value).map_err(&bad)?,
                "poll_min" => config.poll_min = parse_duration(&value).map_err(&bad)?,
                "poll_max" => config.poll_max = parse_duration(&value).map_err(&bad)?,
                "sentinel_username" => config.sentinel_username = Some(value),
                "sentinel_password" => config.sentinel_password = Some(value),
                "ca" => config.tls.ca = Some(value),
                "cert" => config.tls.cert = Some(value),
                "key" => config.tls.key = Some(value),
                "domain" => {
                    return Err(bad(
                        "`domain` is not supported for Redis: connect by a name or address \
                         the server certificate lists"
                            .into(),
                    ));
                }
                "db" => {
                    query_db =
                        Some(database(&value).ok_or_else(|| {
                            bad("db must be a database number (0, 1, ...)".into())
                        })?)
                }
                other => return Err(bad(format!("unknown option `{other}`"))),
            }
        }
        if let Err(Error::InvalidConfig(reason)) = config.check_durations() {
            return Err(bad(reason.trim_start_matches("redis: ").to_owned()));
        }
        config.layout = if raw {
            KeyLayout::raw(prefix.unwrap_or_default())
        } else {
            KeyLayout::tagged(prefix.unwrap_or_else(|| KeyLayout::DEFAULT_PREFIX.into()))
                .map_err(|e| bad(e.into()))?
        };
        if let Some(userinfo) = userinfo {
            (config.username, config.password) =
                urlparts::parse_userinfo(userinfo).map_err(&bad)?;
        }
        let single_host = |what: &str| {
            if endpoints.len() == 1 {
                Ok(endpoints[0].clone())
            } else {
                Err(bad(format!("{what} takes exactly one host")))
            }
        };
        let scheme = scheme.to_ascii_lowercase();
        config.topology = match scheme.as_str() {
            "redis" | "rediss" => {
                let db = match (path.is_empty(), query_db) {
                    (true, db) => db.unwrap_or(0),
                    (false, None) => database(path).ok_or_else(|| {
                        bad("the path must be a database number (0, 1, ...)".into())
                    })?,
                    // Even when equal: one of them would otherwise win silently.
                    (false, Some(_)) => {
                        return Err(bad(
                            "the database is given twice: use the path (/N) or db=N, not both"
                                .into(),
                        ));
                    }
                };
                Topology::Single {
                    endpoint: single_host("redis://")?,
                    tls: scheme == "rediss",
                    db,
                }
            }
            "redis+sentinel" | "rediss+sentinel" => {
                // Percent-encoded like any path (the facade's config file writes it so).
                let service = urlparts::percent_decode(path, "the service name").map_err(&bad)?;
                if service.is_empty() {
                    return Err(bad("expected /SERVICE_NAME after the sentinels".into()));
                }
                Topology::Sentinel {
                    sentinels: endpoints,
                    service,
                    db: query_db.unwrap_or(0),
                    tls: scheme == "rediss+sentinel",
                }
            }
            "redis+cluster" | "rediss+cluster" => {
                if !path.is_empty() || query_db.is_some() {
                    return Err(bad("a cluster URL has no path or database".into()));
                }
                Topology::Cluster {
                    seeds: endpoints,
                    tls: scheme == "rediss+cluster",
                }
            }
            "redlock" | "redlocks" => {
                if !path.is_empty() || query_db.is_some() {
                    return Err(bad("a redlock URL has no path or database".into()));
                }
                if endpoints.len() % 2 == 0 {
                    return Err(bad("redlock needs an odd number of instances".into()));
                }
                Topology::Redlock {
                    instances: endpoints,
                    tls: scheme == "redlocks",
                }
            }
            other => return Err(bad(format!("`{other}` is not a Redis scheme"))),
        };
        if (config.sentinel_username.is_some() || config.sentinel_password.is_some())
            && !matches!(config.topology, Topology::Sentinel { .. })
        {
            return Err(bad(
                "sentinel_username and sentinel_password are for redis+sentinel:// and \
                 rediss+sentinel:// only"
                    .into(),
            ));
        }
        if let Err(Error::InvalidConfig(reason)) = config.check_instances() {
            return Err(bad(reason.trim_start_matches("redis: ").to_owned()));
        }
        config.check_tls()?;
        Ok(config)
    }
}

/// A logical database number as written in a URL: decimal digits only (no sign), so a
/// negative number is refused here rather than by the server at connect time.
fn database(text: &str) -> Option<i64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}
