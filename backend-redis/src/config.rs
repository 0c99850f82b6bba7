//! The typed configuration of the Redis backend, its defaults and its checks (its URL
//! forms are parsed in [`crate::url`]).

use std::fmt;
use std::time::Duration;

use fencelock_core::Error;

use crate::keys::KeyLayout;
use crate::topology::{RedisTls, Topology};

/// The shortest lease accepted.
pub const MIN_LEASE: Duration = Duration::from_millis(100);

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
mod tests;
