//! Typed configuration of the ZooKeeper backend. The `zk://` / `zks://` URL parser is
//! [`url`].

mod url;

use std::fmt;
use std::time::Duration;

use fencelock_core::Error;

/// The ZooKeeper client port used when a host names none.
pub const DEFAULT_PORT: u16 = 2181;

/// The session timeout when none is given: 30 s, the default lease of fencelock.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(30);

/// How long connecting a new session may take when none is given: 5 s, as on every
/// backend.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The shortest lease accepted when none is configured: 4 s, ZooKeeper's default
/// `minSessionTimeout` (2 × the default `tickTime` of 2 s).
pub const DEFAULT_MIN_LEASE: Duration = Duration::from_secs(4);

/// Which ACL the znodes fencelock creates (lock nodes, their parents, the chroot) get.
///
/// The default follows the credentials: [`CreatorOnly`](AclPolicy::CreatorOnly) when
/// the configuration has some (a client that authenticates means its locks to be its
/// own: ZooKeeper's own advice for authenticated deployments), [`Open`](AclPolicy::Open)
/// without. `acl=open` keeps authenticated clients' nodes open to all, for a mixed
/// deployment whose other clients do not authenticate (Curator's default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AclPolicy {
    /// `world:anyone:cdrwa` (ZooKeeper's `OPEN_ACL_UNSAFE`): anyone who can reach the
    /// ensemble can read, take and delete the locks. The default without credentials,
    /// as in Curator.
    #[default]
    Open,
    /// `auth::cdrwa` (`CREATOR_ALL_ACL`): only sessions authenticated as the creator
    /// (the same user) can touch the nodes. Needs credentials; the default with them.
    CreatorOnly,
}

/// How the credentials ([`DigestAuth`]) are presented to ZooKeeper.
///
/// | | [`Digest`](AuthMethod::Digest) (default) | [`SaslDigestMd5`](AuthMethod::SaslDigestMd5) |
/// |---|---|---|
/// | URL | `zk://user:password@...` | `zk://user:password@...?sasl=digest-md5` |
/// | wire | `addauth digest user:password` after connecting | SASL DIGEST-MD5 handshake while connecting (the password itself is never sent) |
/// | checked by the server | never: any password is accepted, it only decides which `digest:user:hash` ACLs match | at connect, against the server's JAAS `DigestLoginModule` users: a wrong password fails the connect |
/// | identity in ACLs | `digest:user:base64(sha1(user:password))` | `sasl:user` |
/// | server setting | none | `authProvider.1=org.apache.zookeeper.server.auth.SASLAuthenticationProvider` and a JAAS `Server` section; `enforce.auth.enabled=true`, `enforce.auth.schemes=sasl` to refuse clients without it |
/// | cargo feature | always | `sasl` of fencelock-zk (`zookeeper-sasl` of fencelock) |
///
/// With either method, [`AclPolicy::CreatorOnly`] gives the nodes to the authenticated
/// identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AuthMethod {
    /// ZooKeeper's `digest` scheme (`addauth digest user:password`).
    #[default]
    Digest,
    /// SASL with the DIGEST-MD5 mechanism (`sasl=digest-md5`).
    SaslDigestMd5,
}

/// TLS settings of a `zks://` connection: which certificate authorities to trust and, for
/// mutual TLS, the client certificate.
///
/// The URL options `ca=PATH`, `cert=PATH` and `key=PATH` (the names and meaning of
/// `etcds://`'s and `rediss://`'s). The files are read and checked by
/// [`ZkLock::connect`](crate::ZkLock::connect) before any connection is made: a missing or
/// unreadable file, a file without the expected PEM item, a key that does not belong to
/// the certificate, or `cert` without `key` (or the reverse) is an
/// [`Error::InvalidConfig`]. All empty (the default): the system's root certificates, no
/// client certificate. The server's certificate must name the host as written in the URL
/// (a DNS name or IP address subject alternative name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZkTls {
    /// PEM file with the CA certificate(s) to trust *instead of* the system's root
    /// certificates (`ca=PATH`).
    pub ca: Option<String>,
    /// PEM file with the client certificate (chain) for mutual TLS (`cert=PATH`); needs
    /// [`ZkTls::key`].
    pub cert: Option<String>,
    /// PEM file with the private key of [`ZkTls::cert`] (`key=PATH`).
    pub key: Option<String>,
}

impl ZkTls {
    /// TLS with the system's root certificates and no client certificate.
    pub fn new() -> Self {
        ZkTls::default()
    }

    /// Trusts only the CA certificate(s) in the PEM file `path`.
    pub fn with_ca(mut self, path: impl Into<String>) -> Self {
        self.ca = Some(path.into());
        self
    }

    /// Presents the client certificate in the PEM file `cert`, whose private key is in
    /// the PEM file `key` (mutual TLS).
    pub fn with_identity(mut self, cert: impl Into<String>, key: impl Into<String>) -> Self {
        self.cert = Some(cert.into());
        self.key = Some(key.into());
        self
    }
}

/// Credentials (`user:password` of the URL): for `addauth digest` or SASL DIGEST-MD5,
/// as [`AuthMethod`] says.
///
/// With [`AuthMethod::Digest`] the user name must not contain `:` (ZooKeeper splits
/// `user:password` at the first `:`): such a user is [`Error::InvalidUrl`] in a URL and
/// [`Error::InvalidConfig`] from [`ZkConfig::validate`]. The password may contain `:`.
#[derive(Clone, PartialEq, Eq)]
pub struct DigestAuth {
    /// The user name.
    pub user: String,
    /// The password. Never printed by `Debug`.
    pub password: String,
}

impl fmt::Debug for DigestAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DigestAuth")
            .field("user", &self.user)
            .field("password", &"***")
            .finish()
    }
}

/// How to reach ZooKeeper and how to lay out and time the locks.
///
/// Built from a URL with [`ZkConfig::from_url`] and adjusted with the `with_*` methods,
/// which win over the URL's query pairs.
///
/// ```text
/// zk://[user:password@]host[:port][,host[:port]...][/chroot][?key=value&...]
/// zks://[user:password@]host[:port][,host[:port]...][/chroot][?ca=PATH&cert=PATH&key=PATH&...]
/// ```
///
/// | query key | meaning | default |
/// |---|---|---|
/// | `session_timeout` | session timeout = lease of `Lease::Renewing` locks with the default duration; `30s`, `1500ms`, `2m` | `30s` |
/// | `min_lease` | the shortest lease accepted; set it to the server's `minSessionTimeout` | `4s` |
/// | `acl` | `open` or `creator` (see [`AclPolicy`]) | `creator` with credentials, else `open` |
/// | `connect_timeout` | how long opening a session may take (a server that accepts the connection but never answers fails after this long) | `5s` |
/// | `sasl` | `digest-md5`: the user info is SASL DIGEST-MD5 credentials (see [`AuthMethod`]) | unset: `addauth digest` |
/// | `ca`, `cert`, `key` | `zks://` only: TLS files (see [`ZkTls`]) | system roots, no client certificate |
///
/// `zookeeper://` is accepted as a synonym of `zk://`. The user info, when present, is
/// credentials: `addauth digest` ones, or SASL DIGEST-MD5 ones with `sasl=digest-md5`.
/// `zks://` is ZooKeeper over TLS (the servers' `secureClientPort`); it needs the cargo
/// feature `tls` of fencelock-zk (`zookeeper-tls` of fencelock) to connect, and SASL
/// needs the feature `sasl` (`zookeeper-sasl`).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_zk::{AclPolicy, ZkConfig};
///
/// let config = ZkConfig::from_url("zk://app:s3cret@zk1,zk2:2182/locks?session_timeout=10s&acl=creator")?;
/// assert_eq!(config.hosts(), "zk1:2181,zk2:2182");
/// assert_eq!(config.chroot(), "/locks");
/// assert_eq!(config.session_timeout(), Duration::from_secs(10));
/// assert_eq!(config.acl(), AclPolicy::CreatorOnly);
/// assert!(!format!("{config:?}").contains("s3cret"));
///
/// let secure = ZkConfig::from_url("zks://app:s3cret@zk1:2281/locks?ca=/etc/zk/ca.pem&sasl=digest-md5")?;
/// assert_eq!(secure.tls().and_then(|tls| tls.ca.as_deref()), Some("/etc/zk/ca.pem"));
/// assert_eq!(secure.auth_method(), fencelock_zk::AuthMethod::SaslDigestMd5);
/// assert!(!format!("{secure:?}").contains("s3cret"));
/// # Ok::<(), fencelock_core::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct ZkConfig {
    hosts: String,
    chroot: String,
    session_timeout: Duration,
    min_lease: Duration,
    connect_timeout: Duration,
    auth: Option<DigestAuth>,
    auth_method: AuthMethod,
    /// As set; `None` follows the credentials (see [`AclPolicy`]).
    acl: Option<AclPolicy>,
    tls: Option<ZkTls>,
}

impl ZkConfig {
    /// A configuration for the comma-separated `hosts` (`host[:port],...`), with every
    /// other setting at its default and the locks directly under `/`.
    pub fn new(hosts: impl Into<String>) -> Self {
        ZkConfig {
            hosts: hosts.into(),
            chroot: String::new(),
            session_timeout: DEFAULT_SESSION_TIMEOUT,
            min_lease: DEFAULT_MIN_LEASE,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            auth: None,
            auth_method: AuthMethod::Digest,
            acl: None,
            tls: None,
        }
    }

    /// Why the credentials cannot be sent with ZooKeeper's `digest` scheme, if they
    /// cannot: the server splits `user:password` at the first `:`, so a user name with a
    /// `:` would authenticate as another user, with another password.
    fn digest_user_problem(&self) -> Option<&'static str> {
        let auth = self.auth.as_ref()?;
        (self.auth_method == AuthMethod::Digest && auth.user.contains(':')).then_some(
            "the digest user name must not contain ':' (ZooKeeper splits user:password at \
             the first ':', so it would authenticate as another user)",
        )
    }

    /// Puts the locks under `chroot` (an absolute path such as `/app/locks`; `/` or `""`
    /// for the root). Missing nodes are created (persistent) on first use.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a path ZooKeeper would reject.
    pub fn with_chroot(mut self, chroot: &str) -> Result<Self, Error> {
        self.chroot = normalize_chroot(chroot).map_err(Error::InvalidConfig)?;
        Ok(self)
    }

    /// Sets the session timeout (the lease of default `Lease::Renewing` locks).
    pub fn with_session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// Sets the shortest lease accepted.
    pub fn with_min_lease(mut self, min_lease: Duration) -> Self {
        self.min_lease = min_lease;
        self
    }

    /// Sets how long opening a session may take.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Authenticates every session with ZooKeeper's `digest` scheme (`addauth digest`).
    /// A `user` containing `:` fails [`ZkConfig::validate`] (see [`DigestAuth`]).
    pub fn with_digest(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.auth = Some(DigestAuth {
            user: user.into(),
            password: password.into(),
        });
        self.auth_method = AuthMethod::Digest;
        self
    }

    /// Authenticates every session with SASL DIGEST-MD5 while connecting (see
    /// [`AuthMethod`]; needs the cargo feature `sasl`).
    pub fn with_sasl_digest_md5(
        mut self,
        user: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self = self.with_digest(user, password);
        self.auth_method = AuthMethod::SaslDigestMd5;
        self
    }

    /// Uses ZooKeeper over TLS with `tls`'s files (see [`ZkTls`]; needs the cargo feature
    /// `tls`); `None` for plain TCP.
    pub fn with_tls(mut self, tls: Option<ZkTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Sets the ACL of the znodes fencelock creates (by default it follows the
    /// credentials, see [`AclPolicy`]).
    pub fn with_acl(mut self, acl: AclPolicy) -> Self {
        self.acl = Some(acl);
        self
    }

    /// The connect string, `host:port,...`.
    pub fn hosts(&self) -> &str {
        &self.hosts
    }

    /// The lock root: `""` for `/`, otherwise an absolute path without a trailing `/`.
    pub fn chroot(&self) -> &str {
        &self.chroot
    }

    /// The session timeout.
    pub fn session_timeout(&self) -> Duration {
        self.session_timeout
    }

    /// The shortest lease accepted.
    pub fn min_lease(&self) -> Duration {
        self.min_lease
    }

    /// How long opening a session may take.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The credentials, if any (presented as [`ZkConfig::auth_method`] says).
    pub fn auth(&self) -> Option<&DigestAuth> {
        self.auth.as_ref()
    }

    /// How the credentials are presented: `addauth digest` or SASL DIGEST-MD5.
    pub fn auth_method(&self) -> AuthMethod {
        self.auth_method
    }

    /// The TLS settings: `Some` for ZooKeeper over TLS (`zks://`).
    pub fn tls(&self) -> Option<&ZkTls> {
        self.tls.as_ref()
    }

    /// The ACL policy: as set, or [`AclPolicy::CreatorOnly`] with credentials and
    /// [`AclPolicy::Open`] without.
    pub fn acl(&self) -> AclPolicy {
        self.acl.unwrap_or(if self.auth.is_some() {
            AclPolicy::CreatorOnly
        } else {
            AclPolicy::Open
        })
    }

    /// Checks that the settings fit together.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the setting.
    pub fn validate(&self) -> Result<(), Error> {
        let invalid = |msg: &str| Err(Error::InvalidConfig(msg.to_owned()));
        if self.hosts.is_empty() {
            return invalid("no ZooKeeper host given");
        }
        if self.connect_timeout.is_zero() {
            return invalid("connect_timeout must be positive");
        }
        if self.session_timeout.is_zero() || self.session_timeout.subsec_nanos() % 1_000_000 != 0 {
            return invalid("session_timeout must be a positive whole number of milliseconds");
        }
        if self.session_timeout.as_millis() > i32::MAX as u128 {
            return invalid("session_timeout is too long");
        }
        if self.min_lease.is_zero() {
            return invalid("min_lease must be positive");
        }
        if self.session_timeout < self.min_lease {
            return invalid("session_timeout is shorter than min_lease");
        }
        if self.acl() == AclPolicy::CreatorOnly && self.auth.is_none() {
            return invalid("acl=creator needs digest credentials (zk://user:password@...)");
        }
        if let Some(reason) = self.digest_user_problem() {
            return invalid(reason);
        }
        if self.auth_method == AuthMethod::SaslDigestMd5 && self.auth.is_none() {
            return invalid("sasl=digest-md5 needs credentials (zk://user:password@...)");
        }
        if let Some(tls) = &self.tls {
            if tls.cert.is_some() != tls.key.is_some() {
                return invalid("zookeeper: TLS `cert` and `key` go together");
            }
        }
        Ok(())
    }
}

impl fmt::Debug for ZkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkConfig")
            .field("hosts", &self.hosts)
            .field("chroot", &self.chroot)
            .field("session_timeout", &self.session_timeout)
            .field("min_lease", &self.min_lease)
            .field("connect_timeout", &self.connect_timeout)
            .field("auth", &self.auth)
            .field("auth_method", &self.auth_method)
            .field("acl", &self.acl())
            .field("tls", &self.tls)
            .finish()
    }
}

fn normalize_chroot(path: &str) -> Result<String, String> {
    if path.is_empty() || path == "/" {
        return Ok(String::new());
    }
    if !path.starts_with('/') {
        return Err(format!("the chroot {path:?} must start with /"));
    }
    let trimmed = path.strip_suffix('/').unwrap_or(path);
    for segment in trimmed[1..].split('/') {
        if segment.is_empty() || segment == "." || segment == ".." {
            return Err(format!("the chroot {path:?} has an empty, . or .. segment"));
        }
        if segment.chars().any(crate::names::needs_escape) {
            return Err(format!(
                "the chroot {path:?} has characters ZooKeeper rejects"
            ));
        }
    }
    if trimmed == "/zookeeper" || trimmed.starts_with("/zookeeper/") {
        return Err("the chroot must not be under /zookeeper (reserved)".into());
    }
    Ok(trimmed.to_owned())
}

#[cfg(test)]
mod tests;
