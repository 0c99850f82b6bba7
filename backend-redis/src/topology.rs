//! Which deployment to talk to: its topology, endpoints and TLS settings.

use std::fmt;

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
