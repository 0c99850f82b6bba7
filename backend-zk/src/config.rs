//! Typed configuration of the ZooKeeper backend, and the `zk://` / `zks://` URL parser.

use std::fmt;
use std::time::Duration;

use fencelock_core::parse_duration;
use fencelock_core::{Error, urlparts};

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

fn normalize_hosts(hosts: &str) -> Result<String, String> {
    let hosts = urlparts::parse_hosts(hosts, DEFAULT_PORT)?;
    Ok(hosts
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(","))
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
mod tests {
    use super::*;

    fn ok(url: &str) -> ZkConfig {
        ZkConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    /// URL, hosts, chroot, session timeout, min lease, digest credentials, ACL.
    type Row = (
        &'static str,
        &'static str,
        &'static str,
        Duration,
        Duration,
        Option<(&'static str, &'static str)>,
        AclPolicy,
    );

    #[test]
    fn url_to_config_table() {
        let s = Duration::from_secs;
        #[rustfmt::skip]
        let table: &[Row] = &[
            ("zk://localhost", "localhost:2181", "", s(30), s(4), None, AclPolicy::Open),
            ("zookeeper://h:2182/", "h:2182", "", s(30), s(4), None, AclPolicy::Open),
            ("zk://a,b:1,c/x/y/", "a:2181,b:1,c:2181", "/x/y", s(30), s(4), None, AclPolicy::Open),
            ("zk://[::1]:2181,[::2]/r", "[::1]:2181,[::2]:2181", "/r", s(30), s(4), None, AclPolicy::Open),
            ("zk://h/r?session_timeout=10s&min_lease=1500ms", "h:2181", "/r", s(10), Duration::from_millis(1500), None, AclPolicy::Open),
            ("zk://h?session_timeout=2m", "h:2181", "", s(120), s(4), None, AclPolicy::Open),
            ("zk://h?session_timeout=5000ms", "h:2181", "", s(5), s(4), None, AclPolicy::Open),
            ("zk://u:p%40ss@h/l%20x?acl=creator", "h:2181", "/l x", s(30), s(4), Some(("u", "p@ss")), AclPolicy::CreatorOnly),
            ("ZK://u:@h?acl=open", "h:2181", "", s(30), s(4), Some(("u", "")), AclPolicy::Open),
            // Credentials without `acl=`: the nodes are the creator's.
            ("zk://u:p@h", "h:2181", "", s(30), s(4), Some(("u", "p")), AclPolicy::CreatorOnly),
        ];
        for (url, hosts, chroot, timeout, min, auth, acl) in table {
            let c = ok(url);
            assert_eq!(c.hosts(), *hosts, "{url}");
            assert_eq!(c.chroot(), *chroot, "{url}");
            assert_eq!(c.session_timeout(), *timeout, "{url}");
            assert_eq!(c.min_lease(), *min, "{url}");
            assert_eq!(
                c.auth().map(|a| (a.user.as_str(), a.password.as_str())),
                *auth,
                "{url}"
            );
            assert_eq!(c.acl(), *acl, "{url}");
        }
    }

    #[test]
    fn bad_urls_are_typed_errors_without_the_password() {
        for url in [
            "zk://",
            "zk:///chroot",
            "etcd://h",
            "zk://h:0",
            "zk://h:99999",
            "zk://h,,g",
            "zk://h/a//b",
            "zk://h/a/../b",
            "zk://h/zookeeper/x",
            "zk://h?session_timeout=10x",
            "zk://h?session_timeout=0s",
            "zk://h?ttl=3",
            "zk://h?acl=all",
            "zk://h?acl=creator",
            "zk://h?session_timeout=1s",
            "zk://user:hunter2@h?nope=1",
            "zk://user:hunter2@h/%zz",
            "zk://h/a#frag",
            "no-scheme",
        ] {
            let err = ZkConfig::from_url(url).expect_err(url);
            assert!(
                matches!(err, Error::InvalidUrl { .. } | Error::InvalidConfig(_)),
                "{url}: {err:?}"
            );
            assert!(!err.to_string().contains("hunter2"), "{url}: {err}");
            assert!(!format!("{err:?}").contains("hunter2"), "{url}: {err:?}");
        }
    }

    /// ZooKeeper's `digest` scheme splits `user:password` at the first `:`: a user with a
    /// `:` (percent-encoded in the URL, or given to `with_digest`) would authenticate as
    /// another user with another password, so it is refused.
    #[test]
    fn a_digest_user_with_a_colon_is_refused() {
        for url in ["zk://a%3Ab:hunter2@h", "zk://a%3ab:hunter2@h/r?acl=open"] {
            match ZkConfig::from_url(url) {
                Err(Error::InvalidUrl { reason, .. }) => {
                    assert!(reason.contains("':'"), "{url}: {reason}");
                    assert!(!reason.contains("hunter2"), "{url}: {reason}");
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        let built = ZkConfig::new("h:1").with_digest("a:b", "pw");
        assert!(
            matches!(built.validate(), Err(Error::InvalidConfig(ref m)) if m.contains("':'")),
            "{:?}",
            built.validate()
        );
        // A `:` in the password is fine: the server splits at the first one.
        let c = ok("zk://ab:p%3Aw@h");
        assert_eq!(c.auth().map(|a| a.password.as_str()), Some("p:w"));
    }

    #[test]
    fn explicit_settings_win_and_debug_hides_the_password() {
        let c = ok("zk://me:hunter2@h?session_timeout=10s")
            .with_session_timeout(Duration::from_secs(20))
            .with_acl(AclPolicy::CreatorOnly)
            .with_chroot("/other/")
            .unwrap();
        assert_eq!(c.session_timeout(), Duration::from_secs(20));
        assert_eq!(c.chroot(), "/other");
        let debug = format!("{c:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("me"), "{debug}");
        assert!(c.validate().is_ok());
    }

    #[test]
    fn zks_urls_carry_the_tls_files() {
        let plain = ok("zk://h:1");
        assert!(plain.tls().is_none());
        let system_roots = ok("zks://h:2281/locks");
        assert_eq!(system_roots.tls(), Some(&ZkTls::default()));
        assert_eq!(system_roots.hosts(), "h:2281");
        let full = ok("ZKS://h?ca=/c/ca.pem&cert=/c/me.pem&key=/c/me-key.pem");
        assert_eq!(
            full.tls(),
            Some(
                &ZkTls::new()
                    .with_ca("/c/ca.pem")
                    .with_identity("/c/me.pem", "/c/me-key.pem")
            )
        );
        let debug = format!("{full:?}");
        assert!(debug.contains("/c/ca.pem"), "{debug}");
    }

    #[test]
    fn misplaced_or_half_tls_settings_are_typed_errors() {
        for (url, text) in [
            ("zk://h?ca=/ca.pem", "`ca` is a TLS setting: use zks://"),
            (
                "zookeeper://h?key=/k.pem",
                "`key` is a TLS setting: use zks://",
            ),
            ("zks://h?ca=", "`ca` needs a file path"),
        ] {
            match ZkConfig::from_url(url) {
                Err(Error::InvalidUrl { reason, .. }) => {
                    assert!(reason.contains(text), "{url}: {reason}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        for url in ["zks://h?cert=/c.pem", "zks://h?key=/k.pem&ca=/ca.pem"] {
            assert!(
                matches!(ZkConfig::from_url(url), Err(Error::InvalidConfig(m)) if m.contains("`cert` and `key` go together")),
                "{url}"
            );
        }
        let hand_built = ZkConfig::new("h:1").with_tls(Some(ZkTls {
            cert: Some("c.pem".into()),
            ..ZkTls::default()
        }));
        assert!(matches!(
            hand_built.validate(),
            Err(Error::InvalidConfig(_))
        ));
    }

    #[test]
    fn sasl_digest_md5_uses_the_user_info_and_hides_the_password() {
        let c = ok("zks://app:hunter2@h?sasl=digest-md5&acl=creator");
        assert_eq!(c.auth_method(), AuthMethod::SaslDigestMd5);
        assert_eq!(c.auth().map(|a| a.user.as_str()), Some("app"));
        assert_eq!(c.acl(), AclPolicy::CreatorOnly);
        assert!(!format!("{c:?}").contains("hunter2"));
        assert_eq!(ok("zk://app:pw@h").auth_method(), AuthMethod::Digest);
        assert_eq!(
            ZkConfig::new("h:1")
                .with_sasl_digest_md5("u", "p")
                .auth_method(),
            AuthMethod::SaslDigestMd5
        );
        assert_eq!(
            ZkConfig::new("h:1")
                .with_sasl_digest_md5("u", "p")
                .with_digest("u", "p")
                .auth_method(),
            AuthMethod::Digest
        );
        for url in [
            "zk://h?sasl=digest-md5",
            "zk://app:hunter2@h?sasl=gssapi",
            "zk://app:hunter2@h?sasl=plain",
        ] {
            let err = ZkConfig::from_url(url).expect_err(url);
            assert!(
                matches!(err, Error::InvalidUrl { .. } | Error::InvalidConfig(_)),
                "{url}: {err:?}"
            );
            assert!(
                !format!("{err} {err:?}").contains("hunter2"),
                "{url}: {err:?}"
            );
        }
    }
}
