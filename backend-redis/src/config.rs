//! Typed configuration of the Redis backend and its URL parser.

use std::fmt;
use std::time::Duration;

use fencelock_core::Error;
use fencelock_core::{parse_duration, urlparts};

use crate::keys::KeyLayout;

/// The shortest lease accepted.
pub const MIN_LEASE: Duration = Duration::from_millis(100);

/// A `host:port` pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Host name or IP address.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Which Redis deployment to talk to, and how.
///
/// Every topology can use TLS: `tls: true` is the `rediss` form of its URL scheme
/// (`rediss://`, `rediss+sentinel://`, `rediss+cluster://`, `redlocks://`), with the
/// settings of [`RedisConfig::tls`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Topology {
    /// One server (`redis://`, `rediss://`).
    Single {
        /// The server.
        endpoint: Endpoint,
        /// Whether to use TLS (`rediss://`).
        tls: bool,
        /// The logical database (`/N` or `?db=N` in the URL, not both).
        db: i64,
    },
    /// A master found through Sentinels (`redis+sentinel://s1,s2,s3/service`).
    Sentinel {
        /// The Sentinels to ask.
        sentinels: Vec<Endpoint>,
        /// The monitored master's name (percent-decoded from the URL's path: `cache%3Aeu`
        /// is `cache:eu`).
        service: String,
        /// The logical database (`?db=N`).
        db: i64,
        /// Whether to use TLS (`rediss+sentinel://`), to the Sentinels and to the master
        /// alike.
        tls: bool,
    },
    /// A Redis Cluster, found from its seed nodes (`redis+cluster://a,b,c`).
    Cluster {
        /// Seed nodes.
        seeds: Vec<Endpoint>,
        /// Whether to use TLS (`rediss+cluster://`) to every node: the nodes must announce
        /// their TLS ports (`tls-cluster yes`).
        tls: bool,
    },
    /// Redlock over independent masters (`redlock://a,b,c`).
    Redlock {
        /// The independent instances; a lock needs a majority of them.
        instances: Vec<Endpoint>,
        /// Whether to use TLS (`redlocks://`) to every instance.
        tls: bool,
    },
}

impl Topology {
    /// Whether the connections use TLS.
    pub fn uses_tls(&self) -> bool {
        match self {
            Topology::Single { tls, .. }
            | Topology::Sentinel { tls, .. }
            | Topology::Cluster { tls, .. }
            | Topology::Redlock { tls, .. } => *tls,
        }
    }

    /// The URL scheme of this topology: `redis`, `rediss`, `redis+sentinel`,
    /// `rediss+sentinel`, `redis+cluster`, `rediss+cluster`, `redlock` or `redlocks`.
    pub fn scheme(&self) -> &'static str {
        match (self, self.uses_tls()) {
            (Topology::Single { .. }, false) => "redis",
            (Topology::Single { .. }, true) => "rediss",
            (Topology::Sentinel { .. }, false) => "redis+sentinel",
            (Topology::Sentinel { .. }, true) => "rediss+sentinel",
            (Topology::Cluster { .. }, false) => "redis+cluster",
            (Topology::Cluster { .. }, true) => "rediss+cluster",
            (Topology::Redlock { .. }, false) => "redlock",
            (Topology::Redlock { .. }, true) => "redlocks",
        }
    }

    /// The scheme of the same topology over TLS.
    pub(crate) fn tls_scheme(&self) -> &'static str {
        match self {
            Topology::Single { .. } => "rediss",
            Topology::Sentinel { .. } => "rediss+sentinel",
            Topology::Cluster { .. } => "rediss+cluster",
            Topology::Redlock { .. } => "redlocks",
        }
    }
}

/// TLS settings of a TLS connection (`rediss://`, `rediss+sentinel://`,
/// `rediss+cluster://`, `redlocks://`): which certificate authorities to trust and, for
/// mutual TLS, the client certificate. The same settings apply to every server of the
/// deployment (for Sentinel: the Sentinels, the master and the replicas).
///
/// The URL options `ca=PATH`, `cert=PATH` and `key=PATH` (the names and meaning of
/// `etcds://`'s). The files are read when connecting, before any connection is made; a
/// missing or unreadable file, a file without the expected PEM item, or `cert` without
/// `key` (or the reverse) is an [`Error::InvalidConfig`]. All empty (the default): the
/// system's root certificates, no client certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisTls {
    /// PEM file with the CA certificate(s) to trust *instead of* the system's root
    /// certificates (`ca=PATH`).
    pub ca: Option<String>,
    /// PEM file with the client certificate (chain) for mutual TLS (`cert=PATH`); needs
    /// [`RedisTls::key`].
    pub cert: Option<String>,
    /// PEM file with the private key of [`RedisTls::cert`] (`key=PATH`).
    pub key: Option<String>,
}

impl RedisTls {
    /// Whether no setting is made (system roots, no client certificate).
    pub fn is_empty(&self) -> bool {
        self.ca.is_none() && self.cert.is_none() && self.key.is_none()
    }
}

/// The configuration of a [`RedisLock`](crate::RedisLock).
///
/// Built from a URL with [`RedisConfig::from_url`] or by hand. `Debug` never shows the
/// password.
///
/// | URL | topology |
/// |---|---|
/// | `redis://[user:pass@]host:port[/db]` | single server |
/// | `rediss://...` | single server over TLS (cargo feature `tls`) |
/// | `redis+sentinel://[user:pass@]s1:port,s2:port/service` | master found through Sentinels |
/// | `rediss+sentinel://...` | the same over TLS, to the Sentinels and the master |
/// | `redis+cluster://[user:pass@]a:port,b:port` | Redis Cluster |
/// | `rediss+cluster://...` | Redis Cluster over TLS (`tls-cluster yes` on the nodes) |
/// | `redlock://[user:pass@]a:port,b:port,c:port` | Redlock over distinct independent masters (see [`RedisConfig::check_instances`]; two names of one server are refused at connect by `run_id`) |
/// | `redlocks://...` | Redlock over TLS to every instance |
///
/// Query options (all optional): `prefix=STR` (key prefix, default `fencelock:`),
/// `layout=tagged|raw` (`raw`: the key is exactly prefix + name, default prefix empty),
/// `wait_replicas=N` and `wait_timeout=DUR` (replica check after every grant),
/// `timeout=DUR` (response timeout, default 2 s), `connect_timeout=DUR` (default 5 s),
/// `token_ttl=DUR` (how long the token counter outlives the last grant, default 24 h,
/// never less than that grant's lease),
/// `poll_min=DUR` and `poll_max=DUR` (raw layout: how often a waiter looks at a
/// hand-written lock, default 50 ms doubling to 1 s; see [`RedisConfig::poll_min`]),
/// `db=N` (the logical database, a number from 0; Sentinel, or a single server instead
/// of the path `/N`: giving both is an error), `sentinel_username=USER` and
/// `sentinel_password=PASS` (the Sentinels' own credentials, when they require a
/// password) (Sentinel only), and for the TLS schemes
/// only `ca=PATH`, `cert=PATH`, `key=PATH` (see [`RedisTls`]). Durations are `250ms`, `2s`, `5m` (see
/// [`fencelock_core::parse_duration`]).
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisConfig {
    /// The deployment.
    pub topology: Topology,
    /// ACL user name, if any.
    pub username: Option<String>,
    /// Password, if any. Never printed.
    pub password: Option<String>,
    /// How lock names map to keys.
    pub layout: KeyLayout,
    /// Replicas that must acknowledge every grant (`WAIT`): a lock's, a term's, a
    /// semaphore's or read-write lock's; 0 = no check. A grant acknowledged by fewer is
    /// released and refused with a retryable error.
    pub wait_replicas: u32,
    /// How long to wait for those acknowledgements.
    pub wait_timeout: Duration,
    /// Response timeout of every command.
    pub timeout: Duration,
    /// How long opening a connection may take (`connect_timeout=`, default 5 s, as on
    /// every backend).
    pub connect_timeout: Duration,
    /// Lifetime of a name's token counter after its last grant; a grant keeps the
    /// counter for its own lease at least, however short this is (the counter must live
    /// as long as the lock key set with it: a re-sent acquire, an expired key's release
    /// and Redlock's tokens read it).
    pub token_ttl: Duration,
    /// TLS settings; only for a topology with `tls: true` (see [`Topology::uses_tls`]),
    /// empty otherwise.
    pub tls: RedisTls,
    /// ACL user name for the Sentinels themselves (`sentinel_username=`), if they require
    /// one; Sentinel only.
    pub sentinel_username: Option<String>,
    /// Password for the Sentinels themselves (`sentinel_password=`), if they require one
    /// (`requirepass` on the Sentinels); Sentinel only. Never printed.
    pub sentinel_password: Option<String>,
    /// In the raw layout, how often a waiter looks at a lock held by someone else, from
    /// `poll_min=` (default 50 ms) doubling to `poll_max=` (default 1 s). A hand-written
    /// `SET NX PX` locker publishes nothing when it deletes its key, so without this a
    /// waiter would notice only when the key's TTL ran out; with it, a waiter gets the
    /// lock within `poll_max` of its release. The tagged layout never polls: every
    /// release by this library is published.
    pub poll_min: Duration,
    /// See [`poll_min`](Self::poll_min).
    pub poll_max: Duration,
}

impl RedisConfig {
    /// A configuration with defaults for `topology`.
    pub fn new(topology: Topology) -> Self {
        RedisConfig {
            topology,
            username: None,
            password: None,
            layout: KeyLayout::default(),
            wait_replicas: 0,
            wait_timeout: Duration::from_secs(1),
            timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
            token_ttl: Duration::from_secs(24 * 3600),
            tls: RedisTls::default(),
            sentinel_username: None,
            sentinel_password: None,
            poll_min: Duration::from_millis(50),
            poll_max: Duration::from_secs(1),
        }
    }

    /// Checks the durations of a configuration built by hand, as
    /// [`from_url`](Self::from_url) does for a URL's (and
    /// [`RedisLock::connect`](crate::RedisLock::connect) for every configuration): `timeout` and
    /// `connect_timeout` positive, `token_ttl` at least 1 s, `poll_min` positive and at
    /// most `poll_max`, none longer than 100 years; with `wait_replicas`, a `wait_timeout`
    /// that is positive and shorter than `timeout` (the replica check's `WAIT` holds the
    /// client's connection that long, and `WAIT n 0` would hold it for ever).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the offending setting.
    pub fn check_durations(&self) -> Result<(), Error> {
        let bad = |reason: String| Err(Error::InvalidConfig(format!("redis: {reason}")));
        for (setting, value) in [
            ("timeout", self.timeout),
            ("connect_timeout", self.connect_timeout),
            ("wait_timeout", self.wait_timeout),
            ("token_ttl", self.token_ttl),
            ("poll_min", self.poll_min),
            ("poll_max", self.poll_max),
        ] {
            if value > fencelock_core::FOREVER {
                return bad(format!("{setting} of {value:?} is longer than 100 years"));
            }
        }
        if self.timeout.is_zero()
            || self.connect_timeout.is_zero()
            || self.token_ttl < Duration::from_secs(1)
        {
            return bad(
                "timeout and connect_timeout must be positive and token_ttl at least 1s".into(),
            );
        }
        if self.poll_min.is_zero() || self.poll_min > self.poll_max {
            return bad("poll_min must be positive and at most poll_max".into());
        }
        if self.wait_replicas > 0
            && (self.wait_timeout.is_zero() || self.wait_timeout >= self.timeout)
        {
            return bad(format!(
                "wait_timeout ({:?}) must be positive and shorter than timeout ({:?}): the \
                 replica check's WAIT holds the connection that long (WAIT with 0 for ever)",
                self.wait_timeout, self.timeout
            ));
        }
        Ok(())
    }

    /// Checks that no Redlock instance is named twice (host compared without case, an IP
    /// address by its value, so `[::1]` and `[0::1]` are one): a server named twice
    /// would count twice toward the majority, and one server's grant could then be a
    /// "majority" of three. Other names for one server, such as `localhost` and
    /// `127.0.0.1`, cannot be told apart here: [`RedisLock::connect`](crate::RedisLock::connect)
    /// refuses them by the servers' `run_id`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the instance given twice.
    pub fn check_instances(&self) -> Result<(), Error> {
        let Topology::Redlock { instances, .. } = &self.topology else {
            return Ok(());
        };
        let mut seen = std::collections::HashSet::new();
        for endpoint in instances {
            let host = endpoint
                .host
                .parse::<std::net::IpAddr>()
                .map_or_else(|_| endpoint.host.to_ascii_lowercase(), |ip| ip.to_string());
            if !seen.insert((host, endpoint.port)) {
                return Err(Error::InvalidConfig(format!(
                    "redis: Redlock instance {endpoint} is given twice (it would count twice \
                     toward the majority)"
                )));
            }
        }
        Ok(())
    }

    /// Checks the TLS settings against the topology: none without TLS (`rediss://`,
    /// `rediss+sentinel://`, `rediss+cluster://`, `redlocks://`), and `cert` and `key`
    /// both or neither. Does not touch the files.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the offending setting.
    pub fn check_tls(&self) -> Result<(), Error> {
        let setting = [
            ("ca", &self.tls.ca),
            ("cert", &self.tls.cert),
            ("key", &self.tls.key),
        ]
        .into_iter()
        .find_map(|(name, value)| value.is_some().then_some(name));
        let Some(setting) = setting else {
            return Ok(());
        };
        if !self.topology.uses_tls() {
            return Err(Error::InvalidConfig(format!(
                "redis: `{setting}` is a TLS setting: use {}:// (not {}://)",
                self.topology.tls_scheme(),
                self.topology.scheme()
            )));
        }
        if self.tls.cert.is_some() != self.tls.key.is_some() {
            return Err(Error::InvalidConfig(
                "redis: TLS `cert` and `key` go together".into(),
            ));
        }
        Ok(())
    }

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

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("topology", &self.topology)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("layout", &self.layout)
            .field("wait_replicas", &self.wait_replicas)
            .field("wait_timeout", &self.wait_timeout)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("token_ttl", &self.token_ttl)
            .field("poll_min", &self.poll_min)
            .field("poll_max", &self.poll_max)
            .field("tls", &self.tls)
            .field("sentinel_username", &self.sentinel_username)
            .field(
                "sentinel_password",
                &self.sentinel_password.as_ref().map(|_| "***"),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(host: &str, port: u16) -> Endpoint {
        Endpoint {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn url_table() {
        let cases: Vec<(&str, Topology)> = vec![
            (
                "redis://127.0.0.1:6390",
                Topology::Single {
                    endpoint: ep("127.0.0.1", 6390),
                    tls: false,
                    db: 0,
                },
            ),
            (
                "redis://h/3",
                Topology::Single {
                    endpoint: ep("h", 6379),
                    tls: false,
                    db: 3,
                },
            ),
            (
                "rediss://u:p@h:1",
                Topology::Single {
                    endpoint: ep("h", 1),
                    tls: true,
                    db: 0,
                },
            ),
            (
                "redis+sentinel://a:1,b:2/mymaster?db=2",
                Topology::Sentinel {
                    sentinels: vec![ep("a", 1), ep("b", 2)],
                    service: "mymaster".into(),
                    db: 2,
                    tls: false,
                },
            ),
            (
                "rediss+sentinel://u:p@a:1,b:2/mymaster",
                Topology::Sentinel {
                    sentinels: vec![ep("a", 1), ep("b", 2)],
                    service: "mymaster".into(),
                    db: 0,
                    tls: true,
                },
            ),
            (
                "redis+cluster://a:1,b:2,c:3",
                Topology::Cluster {
                    seeds: vec![ep("a", 1), ep("b", 2), ep("c", 3)],
                    tls: false,
                },
            ),
            (
                "REDISS+CLUSTER://a:1,b:2,c:3",
                Topology::Cluster {
                    seeds: vec![ep("a", 1), ep("b", 2), ep("c", 3)],
                    tls: true,
                },
            ),
            (
                "redlock://a:1,b:2,c:3",
                Topology::Redlock {
                    instances: vec![ep("a", 1), ep("b", 2), ep("c", 3)],
                    tls: false,
                },
            ),
            (
                "redlocks://a:1,b:2,c:3",
                Topology::Redlock {
                    instances: vec![ep("a", 1), ep("b", 2), ep("c", 3)],
                    tls: true,
                },
            ),
            (
                "redis://[::1]:7000",
                Topology::Single {
                    endpoint: ep("::1", 7000),
                    tls: false,
                    db: 0,
                },
            ),
            (
                "redis://h?db=4",
                Topology::Single {
                    endpoint: ep("h", 6379),
                    tls: false,
                    db: 4,
                },
            ),
            // The service name is percent-decoded (the facade's config file encodes it).
            (
                "redis+sentinel://s:26379/cache%3Aeu",
                Topology::Sentinel {
                    sentinels: vec![ep("s", 26379)],
                    service: "cache:eu".into(),
                    db: 0,
                    tls: false,
                },
            ),
            (
                "redis+sentinel://s:26379/a%2Fb%20c",
                Topology::Sentinel {
                    sentinels: vec![ep("s", 26379)],
                    service: "a/b c".into(),
                    db: 0,
                    tls: false,
                },
            ),
        ];
        for (url, topology) in cases {
            let config = RedisConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(config.topology, topology, "{url}");
            assert!(
                url.to_ascii_lowercase()
                    .starts_with(&format!("{}://", topology.scheme())),
                "{url}"
            );
        }
    }

    #[test]
    fn options_are_parsed() {
        let c = RedisConfig::from_url(
            "redis://h:1?prefix=lock:&layout=raw&wait_replicas=1&wait_timeout=250ms&timeout=3s",
        )
        .unwrap();
        assert_eq!(c.layout, KeyLayout::raw("lock:"));
        assert_eq!(c.wait_replicas, 1);
        assert_eq!(c.wait_timeout, Duration::from_millis(250));
        assert_eq!(c.timeout, Duration::from_secs(3));
        let c = RedisConfig::from_url("redis://h:1").unwrap();
        assert_eq!(c.layout, KeyLayout::default());
    }

    #[test]
    fn bad_urls_are_typed_errors() {
        for url in [
            "redis://h:notaport",
            "redis://a:1,b:2",
            "redis://h:1?nope=1",
            "redis://h:1?layout=odd",
            "redis://h:1?prefix=a{b",
            "redis+sentinel://a:1",
            "rediss+sentinel://a:1",
            "redis+cluster://a:1/x",
            "rediss+cluster://a:1?db=1",
            "redlock://a:1,b:2",
            "redlocks://a:1,b:2",
            "rediss+redlock://a:1",
            // One server twice would count twice toward the quorum.
            "redlock://a:1,a:1,b:2",
            "redlocks://a:1,b:2,A:1",
            "redlock://[::1]:1,[0::1]:1,b:2",
            "redlock://h,h:6379,b:2",
            "redis://h:1?timeout=5x",
            "redis://h:1/abc",
            "redis://:1",
            // A database is a number from 0, given once (path or `db=`, not both).
            "redis://h/-1",
            "redis://h?db=-1",
            "redis://h?db=x",
            "redis://h/1?db=2",
            "redis://h/1?db=1",
            "rediss://h/1?db=2",
            "redis+sentinel://a:1/m?db=-1",
            "redis+sentinel://a:1/m?db=1.5",
            // Not UTF-8 once decoded.
            "redis+sentinel://a:1/%FF",
        ] {
            let err = RedisConfig::from_url(url).unwrap_err();
            assert!(matches!(err, Error::InvalidUrl { .. }), "{url}: {err:?}");
        }
    }

    /// A Redlock instance given twice in a configuration built in code is refused too,
    /// by `connect` before any connection.
    #[tokio::test]
    async fn a_redlock_instance_given_twice_is_refused() {
        let endpoint = |host: &str, port| Endpoint {
            host: host.into(),
            port,
        };
        let config = RedisConfig::new(Topology::Redlock {
            instances: vec![
                endpoint("no-such-host.invalid", 1),
                endpoint("other.invalid", 1),
                endpoint("No-Such-Host.invalid", 1),
            ],
            tls: false,
        });
        assert!(matches!(
            config.check_instances(),
            Err(Error::InvalidConfig(_))
        ));
        let err = crate::RedisLock::connect(config).await.err().unwrap();
        assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
        let distinct = RedisConfig::from_url("redlock://a:1,a:2,b:1").unwrap();
        assert!(distinct.check_instances().is_ok());
    }

    #[test]
    fn tls_options_are_parsed() {
        let cases: Vec<(&str, RedisTls)> = vec![
            ("rediss://h:1", RedisTls::default()),
            (
                "rediss://h:1?ca=/etc/redis/ca.pem",
                RedisTls {
                    ca: Some("/etc/redis/ca.pem".into()),
                    ..RedisTls::default()
                },
            ),
            (
                "rediss://u:p@h:1/2?ca=ca.pem&cert=%2Ftmp%2Fc%20d.pem&key=k.pem&timeout=1s",
                RedisTls {
                    ca: Some("ca.pem".into()),
                    cert: Some("/tmp/c d.pem".into()),
                    key: Some("k.pem".into()),
                },
            ),
            (
                "rediss://h:1?cert=c.pem&key=k.pem",
                RedisTls {
                    ca: None,
                    cert: Some("c.pem".into()),
                    key: Some("k.pem".into()),
                },
            ),
            (
                "rediss+sentinel://:p@a:1,b:2/m?ca=ca.pem&sentinel_password=s",
                RedisTls {
                    ca: Some("ca.pem".into()),
                    ..RedisTls::default()
                },
            ),
            (
                "rediss+cluster://:p@a:1,b:2?ca=ca.pem&cert=c.pem&key=k.pem",
                RedisTls {
                    ca: Some("ca.pem".into()),
                    cert: Some("c.pem".into()),
                    key: Some("k.pem".into()),
                },
            ),
            ("rediss+cluster://a:1", RedisTls::default()),
            (
                "redlocks://a:1,b:2,c:3?ca=ca.pem",
                RedisTls {
                    ca: Some("ca.pem".into()),
                    ..RedisTls::default()
                },
            ),
        ];
        for (url, tls) in cases {
            let config = RedisConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(config.tls, tls, "{url}");
            assert!(config.topology.uses_tls(), "{url}");
        }
        assert!(RedisConfig::from_url("redis://h:1").unwrap().tls.is_empty());
    }

    #[test]
    fn misplaced_tls_options_are_typed_errors() {
        // `Some(text)`: an InvalidConfig whose message contains `text`; `None`: InvalidUrl.
        for (url, expected) in [
            (
                "redis://h:1?ca=/ca.pem",
                Some("`ca` is a TLS setting: use rediss://"),
            ),
            (
                "redis://h:1?cert=c&key=k",
                Some("`cert` is a TLS setting: use rediss://"),
            ),
            (
                "redis+sentinel://a:1/m?ca=x",
                Some("`ca` is a TLS setting: use rediss+sentinel:// (not redis+sentinel://)"),
            ),
            (
                "redis+cluster://a:1?key=k&cert=c",
                Some("`cert` is a TLS setting: use rediss+cluster:// (not redis+cluster://)"),
            ),
            (
                "redlock://a:1,b:2,c:3?ca=x",
                Some("use redlocks:// (not redlock://)"),
            ),
            (
                "rediss+sentinel://a:1/m?key=k.pem",
                Some("`cert` and `key` go together"),
            ),
            (
                "rediss+cluster://a:1?cert=c.pem",
                Some("`cert` and `key` go together"),
            ),
            ("rediss+cluster://a:1?domain=redis.local", None),
            (
                "rediss://h:1?cert=c.pem",
                Some("`cert` and `key` go together"),
            ),
            (
                "rediss://h:1?ca=x&key=k.pem",
                Some("`cert` and `key` go together"),
            ),
            ("rediss://h:1?domain=redis.local", None),
        ] {
            match (RedisConfig::from_url(url), expected) {
                (Err(Error::InvalidConfig(message)), Some(text)) => {
                    assert!(message.contains(text), "{url}: {message}")
                }
                (Err(Error::InvalidUrl { .. }), None) => {}
                (other, _) => panic!("{url}: {other:?}"),
            }
        }
    }

    #[test]
    fn hand_built_tls_settings_are_checked() {
        let mut config = RedisConfig::new(Topology::Single {
            endpoint: ep("h", 1),
            tls: false,
            db: 0,
        });
        assert!(config.check_tls().is_ok());
        config.tls.ca = Some("ca.pem".into());
        assert!(matches!(config.check_tls(), Err(Error::InvalidConfig(_))));
        config.topology = Topology::Single {
            endpoint: ep("h", 1),
            tls: true,
            db: 0,
        };
        assert!(config.check_tls().is_ok());
        config.tls.key = Some("k.pem".into());
        assert!(matches!(config.check_tls(), Err(Error::InvalidConfig(_))));
        config.tls.cert = Some("c.pem".into());
        assert!(config.check_tls().is_ok());
        for (plain, tls) in [
            (
                Topology::Cluster {
                    seeds: vec![ep("a", 1)],
                    tls: false,
                },
                Topology::Cluster {
                    seeds: vec![ep("a", 1)],
                    tls: true,
                },
            ),
            (
                Topology::Sentinel {
                    sentinels: vec![ep("s", 1)],
                    service: "m".into(),
                    db: 0,
                    tls: false,
                },
                Topology::Sentinel {
                    sentinels: vec![ep("s", 1)],
                    service: "m".into(),
                    db: 0,
                    tls: true,
                },
            ),
            (
                Topology::Redlock {
                    instances: vec![ep("a", 1)],
                    tls: false,
                },
                Topology::Redlock {
                    instances: vec![ep("a", 1)],
                    tls: true,
                },
            ),
        ] {
            config.topology = plain;
            assert!(matches!(config.check_tls(), Err(Error::InvalidConfig(_))));
            config.topology = tls;
            assert!(config.check_tls().is_ok());
        }
    }

    #[test]
    fn passwords_never_show() {
        let c = RedisConfig::from_url("redis://alice:s3cr%40t@h:1").unwrap();
        assert_eq!(c.password.as_deref(), Some("s3cr@t"));
        assert_eq!(c.username.as_deref(), Some("alice"));
        assert!(!format!("{c:?}").contains("s3cr"));
        let err = RedisConfig::from_url("redis://alice:hunter2@h:1?bad=1").unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(!format!("{err:?}").contains("hunter2"));
        let err = RedisConfig::from_url("redis://alice:hunter2@h:1?ca=/ca.pem").unwrap_err();
        assert!(!format!("{err} {err:?}").contains("hunter2"), "{err}");
        let c = RedisConfig::from_url("rediss://alice:hunter2@h:1?ca=/ca.pem").unwrap();
        assert!(!format!("{c:?}").contains("hunter2"));
        assert!(format!("{c:?}").contains("/ca.pem"));
        let c = RedisConfig::from_url(
            "rediss+sentinel://:hunter2@s:1/m?ca=/ca.pem&sentinel_password=s3nt",
        )
        .unwrap();
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("s3nt"),
            "{shown}"
        );
        assert!(shown.contains("/ca.pem"), "{shown}");
        let err = RedisConfig::from_url("rediss+cluster://:hunter2@a:1?cert=c.pem").unwrap_err();
        assert!(!format!("{err} {err:?}").contains("hunter2"), "{err}");
        let c = RedisConfig::from_url("redis://:only@h:1").unwrap();
        assert_eq!(c.password.as_deref(), Some("only"));
        assert_eq!(c.username, None);
        // Sub-delimiters are allowed raw in user info: `&` does not end the password,
        // `+` is not a space (both were mangled by a form decoder).
        let c = RedisConfig::from_url("redis://u+1:p&a+s=1!@h:1?prefix=a+b").unwrap();
        assert_eq!(c.username.as_deref(), Some("u+1"));
        assert_eq!(c.password.as_deref(), Some("p&a+s=1!"));
        assert_eq!(c.layout, KeyLayout::tagged("a+b").unwrap());
    }

    #[test]
    fn sentinel_credentials_are_for_sentinel_only_and_never_show() {
        let c = RedisConfig::from_url(
            "redis+sentinel://s:1/m?sentinel_username=watch&sentinel_password=s3nt%26x",
        )
        .unwrap();
        assert_eq!(c.sentinel_username.as_deref(), Some("watch"));
        assert_eq!(c.sentinel_password.as_deref(), Some("s3nt&x"));
        assert!(!format!("{c:?}").contains("s3nt"));
        let err = RedisConfig::from_url("redis+sentinel://s:1/m?sentinel_password=s3nt&bad=1")
            .unwrap_err();
        assert!(!format!("{err} {err:?}").contains("s3nt"), "{err}");
        for url in [
            "redis://h:1?sentinel_password=x",
            "redis+cluster://h:1?sentinel_username=u",
            "rediss+cluster://h:1?sentinel_password=x",
            "redlock://a:1?sentinel_password=x",
        ] {
            let err = RedisConfig::from_url(url).unwrap_err();
            assert!(matches!(err, Error::InvalidUrl { .. }), "{url}: {err:?}");
            assert!(err.to_string().contains("redis+sentinel"), "{err}");
        }
    }

    /// A replica check whose `WAIT` could hold the connection for ever (`wait_timeout=0`)
    /// or past the response timeout, and durations that overflow the arithmetic on them,
    /// are refused: from a URL as `InvalidUrl`, built by hand as `InvalidConfig`.
    #[test]
    fn durations_out_of_range_are_refused() {
        for url in [
            "redis://a:1?wait_replicas=1&wait_timeout=0",
            "redis://a:1?wait_replicas=1&wait_timeout=2s",
            "redis://a:1?wait_replicas=1&wait_timeout=3s&timeout=2s",
            "redis+sentinel://a:1/m?timeout=10000000000000000000s",
            "redis://a:1?layout=raw&poll_min=1s&poll_max=10000000000000000000s",
            "redis://a:1?poll_min=2s&poll_max=1s",
        ] {
            let err = RedisConfig::from_url(url).unwrap_err();
            assert!(matches!(err, Error::InvalidUrl { .. }), "{url}: {err:?}");
        }
        // No replica check: the wait timeout does not matter.
        assert!(RedisConfig::from_url("redis://a:1?wait_timeout=0").is_ok());
        assert!(RedisConfig::from_url("redis://a:1?wait_replicas=1&wait_timeout=500ms").is_ok());
        let by_hand = |change: fn(&mut RedisConfig)| {
            let mut config = RedisConfig::from_url("redis://a:1").unwrap();
            change(&mut config);
            config.check_durations()
        };
        assert!(by_hand(|_| {}).is_ok());
        for change in [
            (|c: &mut RedisConfig| c.timeout = Duration::MAX) as fn(&mut RedisConfig),
            |c| c.connect_timeout = Duration::ZERO,
            |c| c.poll_max = Duration::MAX,
            |c| {
                c.wait_replicas = 1;
                c.wait_timeout = Duration::ZERO;
            },
        ] {
            assert!(matches!(by_hand(change), Err(Error::InvalidConfig(_))));
        }
    }
}
