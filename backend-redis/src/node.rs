//! One Redis deployment to send commands to: a server, a Sentinel-managed master, or a
//! cluster; plus how to open a pub/sub connection to it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use fencelock_core::Error;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, PubSub};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, ErrorKind, FromRedisValue, IntoConnectionInfo,
    RedisConnectionInfo, RedisError, ServerErrorKind, Value,
};

use crate::config::{Endpoint, RedisConfig, RedisTls, Topology};
use crate::error::{BACKEND, map_err};
use crate::instance::Instance;
use crate::scripts::Call;
use crate::sentinel::SentinelNode;

/// Commands to one deployment. Cheap to clone.
#[derive(Clone)]
pub(crate) enum Node {
    /// A server, reconnected automatically. The client (for pub/sub) is boxed: with TLS
    /// settings it is large.
    Single {
        conn: ConnectionManager,
        client: Box<Client>,
        /// A Redlock instance's identity check (see [`crate::instance`]); `None` for a
        /// single server.
        instance: Option<Instance>,
    },
    /// A Redis Cluster; pub/sub goes through the first seed node that answers (see
    /// [`Node::for_shard`]).
    Cluster {
        conn: ClusterConnection,
        seeds: Arc<[Client]>,
        /// The masters and their slots as `CLUSTER SLOTS` named them at connect (empty
        /// if it could not be read).
        shards: Arc<[Shard]>,
    },
    /// The master named by Sentinels, re-resolved after connection errors and whenever
    /// the Sentinels switch masters (see [`crate::sentinel`]).
    Sentinel(Arc<SentinelNode>),
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Node::Single { .. } => "Single",
            Node::Cluster { .. } => "Cluster",
            Node::Sentinel(_) => "Sentinel",
        })
    }
}

fn redis_info(config: &RedisConfig, db: i64) -> RedisConnectionInfo {
    let mut info = RedisConnectionInfo::default()
        .set_db(db)
        .set_skip_set_lib_name();
    if let Some(user) = &config.username {
        info = info.set_username(user);
    }
    if let Some(password) = &config.password {
        info = info.set_password(password);
    }
    info
}

/// Opens the nodes of `config`: one, or one per Redlock instance, within
/// `connect_timeout` (connections, handshakes, a Redlock instance's identity check and
/// the first `PING`: a server that accepts the connection and never answers fails
/// here, retryably).
///
/// A failed AUTH (or any other failure of the first connection) is returned here, and
/// nothing else is sent on a connection whose AUTH failed.
pub(crate) async fn open(config: &RedisConfig) -> Result<Vec<Node>, Error> {
    tokio::time::timeout(config.connect_timeout, open_nodes(config))
        .await
        .map_err(|_| {
            Error::unavailable(
                BACKEND,
                format!(
                    "no answer within connect_timeout ({:?})",
                    config.connect_timeout
                ),
            )
        })?
        .map_err(|e| hint_tls(config, e))
}

/// A server that speaks only TLS resets a plain connection at its first bytes, which
/// alone does not point at the URL's scheme: a reset first connection of a plain
/// topology says which scheme speaks TLS (still [`Error::Unavailable`]: a server that
/// restarts resets connections too).
fn hint_tls(config: &RedisConfig, err: Error) -> Error {
    let Error::Unavailable { source, .. } = &err else {
        return err;
    };
    if config.topology.uses_tls() {
        return err;
    }
    let mut reset = false;
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&**source);
    while let Some(e) = cause {
        reset |= e
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionReset)
            || e.to_string().contains("Connection reset by peer");
        cause = e.source();
    }
    if !reset {
        return err;
    }
    let plain = config.topology.scheme();
    let tls = config.topology.tls_scheme();
    Error::unavailable(
        BACKEND,
        format!(
            "{source} (the server reset a plain connection: if it speaks only TLS, use \
             {tls}:// instead of {plain}://)"
        ),
    )
}

async fn open_nodes(config: &RedisConfig) -> Result<Vec<Node>, Error> {
    config.check_tls()?;
    #[cfg(feature = "tls")]
    if config.topology.uses_tls() {
        // The redis crate builds its rustls configuration with the process-wide default
        // provider, which rustls cannot pick by itself when another crate of the
        // application compiled in a second one (zookeeper-client's TLS brings aws-lc-rs):
        // then `rediss://` would panic. Ours is `ring`; an application's choice stays.
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            // Err: another thread installed one just now, which is as good.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
    }
    if config.topology.uses_tls() && !cfg!(feature = "tls") {
        return Err(Error::InvalidConfig(format!(
            "{}:// needs TLS support: cargo feature `redis-tls` of fencelock (`tls` of \
             fencelock-redis)",
            config.topology.scheme()
        )));
    }
    // Every file is read and checked here, before any connection is made.
    let tls = if config.topology.uses_tls() {
        Some(Tls::load(&config.tls)?)
    } else {
        None
    };
    let manager_config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        .set_response_timeout(Some(config.timeout))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500));
    let single = |endpoint: &Endpoint, tls: Option<&Tls>, db: i64| {
        let info = redis_info(config, db);
        let manager_config = manager_config.clone();
        let client = client_with(endpoint, tls, info);
        async move {
            let client = client?;
            let conn = ConnectionManager::new_with_config(client.clone(), manager_config)
                .await
                .map_err(map_err)?;
            Ok::<_, Error>(Node::Single {
                conn,
                client: Box::new(client),
                instance: None,
            })
        }
    };
    match &config.topology {
        Topology::Single { endpoint, db, .. } => {
            if *db != 0 && config.password.is_some() {
                // redis-rs pipelines SELECT behind AUTH, so after a failed AUTH the
                // server would run SELECT (as `default`, if that user needs no password).
                // A first connection without SELECT checks the credentials alone.
                let probe = client_with(endpoint, tls.as_ref(), redis_info(config, 0))?;
                let probe_config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(config.connect_timeout))
                    .set_response_timeout(Some(config.timeout));
                drop(
                    probe
                        .get_multiplexed_async_connection_with_config(&probe_config)
                        .await
                        .map_err(map_err)?,
                );
            }
            let node = single(endpoint, tls.as_ref(), *db).await?;
            node.ping().await?;
            Ok(vec![node])
        }
        Topology::Redlock { instances, .. } => {
            // Instances connect lazily, so a minority may be down at start; a majority
            // must answer PING now, and any authentication failure is fatal. Each
            // instance's first request checks the server behind it (`INFO server`), so
            // two instances that are one server fail here if both answer, or at the
            // first answer of one that was down (see `crate::instance`).
            let mut nodes = Vec::with_capacity(instances.len());
            for (endpoint, instance) in instances.iter().zip(Instance::all(instances)) {
                let client = client_with(endpoint, tls.as_ref(), redis_info(config, 0))?;
                let conn =
                    ConnectionManager::new_lazy_with_config(client.clone(), manager_config.clone())
                        .map_err(map_err)?;
                nodes.push(Node::Single {
                    conn,
                    client: Box::new(client),
                    instance: Some(instance),
                });
            }
            let pings = futures_util::future::join_all(nodes.iter().map(|n| n.ping())).await;
            let mut up = 0;
            let mut last = None;
            for ping in pings {
                match ping {
                    Ok(()) => up += 1,
                    Err(e) if !e.is_retryable() => return Err(e),
                    Err(e) => last = Some(e),
                }
            }
            if up < nodes.len() / 2 + 1 {
                // The last failure says why (and, for a reset, `hint_tls` which scheme
                // speaks TLS).
                let why = last
                    .as_ref()
                    .and_then(std::error::Error::source)
                    .map_or_else(String::new, |e| format!(" (last error: {e})"));
                return Err(Error::unavailable(
                    BACKEND,
                    format!(
                        "only {up} of {} Redlock instances answered{why}",
                        nodes.len()
                    ),
                ));
            }
            Ok(nodes)
        }
        Topology::Cluster { seeds, .. } => {
            let mut builder = redis::cluster::ClusterClientBuilder::new(
                seeds
                    .iter()
                    .map(|e| address(e, tls.as_ref()))
                    .collect::<Vec<_>>(),
            )
            .connection_timeout(config.connect_timeout)
            .response_timeout(config.timeout)
            .retries(2);
            // Every node the cluster names (`CLUSTER SLOTS`, redirections) is reached over
            // TLS with the same certificates.
            #[cfg(feature = "tls")]
            if let Some(tls) = &tls {
                builder = builder.certs(tls.certificates.clone());
            }
            if let Some(user) = &config.username {
                builder = builder.username(user);
            }
            if let Some(password) = &config.password {
                builder = builder.password(password);
            }
            let cluster = builder.build().map_err(map_err)?;
            let conn = cluster.get_async_connection().await.map_err(map_err)?;
            let seeds = seeds
                .iter()
                .map(|e| client_with(e, tls.as_ref(), redis_info(config, 0)))
                .collect::<Result<Vec<_>, _>>()?;
            let shards = shards(&conn, tls.as_ref(), config).await;
            Ok(vec![Node::Cluster {
                conn,
                seeds: seeds.into(),
                shards: shards.into(),
            }])
        }
        Topology::Sentinel {
            sentinels,
            service,
            db,
            ..
        } => {
            // The Sentinels' own credentials, if they require them.
            let mut sentinel_info = RedisConnectionInfo::default().set_skip_set_lib_name();
            if let Some(user) = &config.sentinel_username {
                sentinel_info = sentinel_info.set_username(user);
            }
            if let Some(password) = &config.sentinel_password {
                sentinel_info = sentinel_info.set_password(password);
            }
            let sentinel_addrs = sentinels
                .iter()
                .map(|e| {
                    ConnectionAddr::Tcp(e.host.clone(), e.port)
                        .into_connection_info()
                        .map(|info| info.set_redis_settings(sentinel_info.clone()))
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(map_err)?;
            let sentinel_client = |db: i64| match &tls {
                Some(tls) => tls_sentinel_client(config, sentinels, service, db, tls),
                None => SentinelClient::build(
                    sentinel_addrs.clone(),
                    service.clone(),
                    Some(
                        SentinelNodeConnectionInfo::default()
                            .set_redis_connection_info(redis_info(config, db)),
                    ),
                    SentinelServerType::Master,
                )
                .map_err(map_err),
            };
            if *db != 0 && config.password.is_some() {
                // As for a single server: the credentials alone first, without SELECT.
                tokio::time::timeout(config.timeout * 2, sentinel_client(0)?.async_get_client())
                    .await
                    .map_err(|_| Error::unavailable(BACKEND, "no Sentinel named a master in time"))?
                    .map_err(map_err)?;
            }
            let sentinel = sentinel_client(*db)?;
            let watched = sentinels
                .iter()
                .map(|e| client_with(e, tls.as_ref(), sentinel_info.clone()))
                .collect::<Result<Vec<_>, _>>()?;
            let node = Arc::new(SentinelNode::new(
                sentinel,
                watched,
                service.clone(),
                config.connect_timeout,
                config.timeout,
            ));
            let node = Node::Sentinel(node);
            node.ping().await?;
            Ok(vec![node])
        }
    }
}

/// The TLS material of a deployment reached over TLS, read from [`RedisTls`]'s files at
/// connect time.
struct Tls {
    /// Trusted roots (`None`: the system's) and the client certificate, as PEM.
    #[cfg(feature = "tls")]
    certificates: redis::TlsCertificates,
}

impl Tls {
    /// Reads and checks the files of `settings` (see [`RedisTls`]).
    ///
    /// Every problem is an [`Error::InvalidConfig`] naming the file: the `redis` crate
    /// would report an unparsable file as a (retryable) I/O error, or an empty CA file
    /// as an unknown issuer on every connection.
    #[cfg(feature = "tls")]
    fn load(settings: &RedisTls) -> Result<Tls, Error> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};

        let read = |path: &str| {
            std::fs::read(path).map_err(|e| {
                Error::InvalidConfig(format!("redis: cannot read TLS file {path}: {e}"))
            })
        };
        let invalid = |path: &str, what: &str, e: &dyn fmt::Display| {
            Error::InvalidConfig(format!("redis: TLS file {path}: {what}: {e}"))
        };
        let certificates = |path: &str| {
            let pem = read(path)?;
            let count = CertificateDer::pem_slice_iter(&pem)
                .try_fold(0_usize, |n, cert| cert.map(|_| n + 1))
                .map_err(|e| invalid(path, "not a PEM certificate file", &e))?;
            if count == 0 {
                return Err(Error::InvalidConfig(format!(
                    "redis: TLS file {path} holds no PEM certificate"
                )));
            }
            Ok(pem)
        };
        let root_cert = settings.ca.as_deref().map(certificates).transpose()?;
        let client_tls = match (&settings.cert, &settings.key) {
            (Some(cert), Some(key)) => {
                let client_cert = certificates(cert)?;
                let client_key = read(key)?;
                PrivateKeyDer::from_pem_slice(&client_key)
                    .map_err(|e| invalid(key, "no PEM private key", &e))?;
                Some(redis::ClientTlsConfig {
                    client_cert,
                    client_key,
                })
            }
            (None, None) => None,
            _ => {
                return Err(Error::InvalidConfig(
                    "redis: TLS `cert` and `key` go together".into(),
                ));
            }
        };
        Ok(Tls {
            certificates: redis::TlsCertificates {
                client_tls,
                root_cert,
            },
        })
    }

    /// Without the `tls` feature no TLS file can be used ([`open`] refuses every TLS
    /// scheme before this).
    #[cfg(not(feature = "tls"))]
    fn load(settings: &RedisTls) -> Result<Tls, Error> {
        if settings.is_empty() {
            Ok(Tls {})
        } else {
            Err(Error::InvalidConfig(
                "rediss:// needs the `tls` cargo feature of fencelock-redis".into(),
            ))
        }
    }
}

/// The address of `endpoint`, verified TLS when `tls` is given (the certificates are
/// added by the client or builder that uses it).
fn address(endpoint: &Endpoint, tls: Option<&Tls>) -> ConnectionAddr {
    match tls {
        Some(_) => ConnectionAddr::TcpTls {
            host: endpoint.host.clone(),
            port: endpoint.port,
            insecure: false,
            tls_params: None,
        },
        None => ConnectionAddr::Tcp(endpoint.host.clone(), endpoint.port),
    }
}

/// A Sentinel client that speaks TLS with `tls`' certificates both to the Sentinels and
/// to the master they name (with the Sentinels' and the master's own credentials).
#[cfg(feature = "tls")]
fn tls_sentinel_client(
    config: &RedisConfig,
    sentinels: &[Endpoint],
    service: &str,
    db: i64,
    tls: &Tls,
) -> Result<SentinelClient, Error> {
    use redis::TlsMode;
    use redis::sentinel::SentinelClientBuilder;

    let mut builder = SentinelClientBuilder::new(
        sentinels.iter().map(|e| address(e, Some(tls))),
        service,
        SentinelServerType::Master,
    )
    .map_err(map_err)?
    .set_client_to_sentinel_certificates(tls.certificates.clone())
    .set_client_to_redis_tls_mode(TlsMode::Secure)
    .set_client_to_redis_certificates(tls.certificates.clone())
    .set_client_to_redis_db(db);
    if let Some(user) = &config.sentinel_username {
        builder = builder.set_client_to_sentinel_username(user);
    }
    if let Some(password) = &config.sentinel_password {
        builder = builder.set_client_to_sentinel_password(password);
    }
    if let Some(user) = &config.username {
        builder = builder.set_client_to_redis_username(user);
    }
    if let Some(password) = &config.password {
        builder = builder.set_client_to_redis_password(password);
    }
    builder.build().map_err(map_err)
}

/// Without the `tls` feature there is no TLS ([`open`] refuses it before this).
#[cfg(not(feature = "tls"))]
fn tls_sentinel_client(
    _config: &RedisConfig,
    _sentinels: &[Endpoint],
    _service: &str,
    _db: i64,
    _tls: &Tls,
) -> Result<SentinelClient, Error> {
    Err(Error::InvalidConfig(
        "rediss+sentinel:// needs the `tls` cargo feature of fencelock-redis".into(),
    ))
}

/// A client for one server, over TLS when `tls` is given.
fn client_with(
    endpoint: &Endpoint,
    tls: Option<&Tls>,
    info: RedisConnectionInfo,
) -> Result<Client, Error> {
    let conn_info = address(endpoint, tls)
        .into_connection_info()
        .map_err(map_err)?
        .set_redis_settings(info);
    #[cfg(feature = "tls")]
    if let Some(tls) = tls {
        return Client::build_with_tls(conn_info, tls.certificates.clone()).map_err(map_err);
    }
    Client::open(conn_info).map_err(map_err)
}

/// The error for a reply that came over a Sentinel's connection after it was dropped or
/// replaced (see [`SentinelNode::unchanged`]): whether the request was applied, and by
/// a master, is unknown, so it counts as failed. Retryable: the next request goes to the
/// master the Sentinels name now. A grant's in-flight guard releases it; a renewal is
/// not credited.
fn switched() -> Error {
    Error::unavailable(
        BACKEND,
        "the connection to the master was dropped while the request was in flight (the \
         Sentinels switched masters, or it failed): its reply is not trusted",
    )
}

/// A pipeline's reply, with a server error turned into an error.
fn checked(value: Value) -> Result<Value, Error> {
    match value {
        Value::ServerError(e) => Err(map_err(e.into())),
        value => Ok(value),
    }
}

impl Node {
    /// Runs a script: `EVALSHA`, and on `NOSCRIPT` the same call as `EVAL` (see
    /// [`scripts`](crate::scripts)). `NOSCRIPT` means the script did not run, so the
    /// call is applied at most once.
    pub(crate) async fn invoke<T: FromRedisValue>(&self, call: &Call) -> Result<T, Error> {
        match self.send(&call.evalsha()).await? {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.query(&call.eval()).await
            }
            reply => reply.map_err(map_err),
        }
    }

    /// Runs a script and then `then`, in one pipeline: one write on one connection, so
    /// `then` runs on the server right after the script, on the connection that ran it,
    /// whatever happens to the client's connections in between (a reconnection, a
    /// Sentinel's cached connection replaced). The replica check's `WAIT` needs this: it
    /// waits for the writes of its own connection, and on another one it has nothing to
    /// wait for and returns at once. On `NOSCRIPT` both are sent again with the script
    /// as `EVAL` (the first `then` ran after a script that did not run: harmless for
    /// `WAIT`, which then waits for nothing new).
    ///
    /// Returns both replies; an error of either is this call's error (for a grant, one
    /// whose outcome is unknown: the caller's in-flight guard releases it).
    pub(crate) async fn invoke_then(
        &self,
        call: &Call,
        then: &redis::Cmd,
    ) -> Result<(Value, Value), Error> {
        let (script, after) = self.send_pair(&call.evalsha(), then).await?;
        match script {
            Value::ServerError(e) if e.kind() == Some(ServerErrorKind::NoScript) => {
                let (script, after) = self.send_pair(&call.eval(), then).await?;
                Ok((checked(script)?, checked(after)?))
            }
            script => Ok((checked(script)?, checked(after)?)),
        }
    }

    /// Runs the plain commands `first` and `second` as one pipeline on one connection;
    /// their replies (a server error in either is the error).
    pub(crate) async fn query_pair(
        &self,
        first: &redis::Cmd,
        second: &redis::Cmd,
    ) -> Result<(Value, Value), Error> {
        let (first, second) = self.send_pair(first, second).await?;
        Ok((checked(first)?, checked(second)?))
    }

    /// Sends `first` and `second` as one pipeline on one connection; their replies
    /// (server errors among them as [`Value::ServerError`]).
    async fn send_pair(
        &self,
        first: &redis::Cmd,
        second: &redis::Cmd,
    ) -> Result<(Value, Value), Error> {
        let mut pipe = redis::pipe();
        pipe.ignore_errors()
            .add_command(first.clone())
            .add_command(second.clone());
        let replies: Result<Vec<Value>, RedisError> = match self {
            Node::Single {
                conn,
                instance: Some(instance),
                ..
            } => {
                let generation = instance.checked(conn).await?;
                let replies = pipe.query_async(&mut conn.clone()).await;
                instance.after(replies.as_ref().err(), generation)?;
                replies
            }
            Node::Single { conn, .. } => pipe.query_async(&mut conn.clone()).await,
            Node::Cluster { conn, .. } => pipe.query_async(&mut conn.clone()).await,
            Node::Sentinel(node) => {
                let (mut conn, epoch) = node.connection().await?;
                let replies: Result<Vec<Value>, RedisError> = pipe.query_async(&mut conn).await;
                match &replies {
                    Err(e) => node.forget_on(e, epoch),
                    // `READONLY`, `MASTERDOWN`: as for a single command.
                    Ok(values) => {
                        for value in values {
                            if let Value::ServerError(e) = value {
                                node.forget_on(&e.clone().into(), epoch);
                            }
                        }
                        if !node.unchanged(epoch) {
                            return Err(switched());
                        }
                    }
                }
                replies
            }
        };
        let mut replies = replies.map_err(map_err)?.into_iter();
        match (replies.next(), replies.next()) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => Err(Error::backend(
                BACKEND,
                false,
                "a pipeline of two commands did not answer twice",
            )),
        }
    }

    /// Runs a plain command.
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, Error> {
        self.send(cmd).await?.map_err(map_err)
    }

    /// Sends `cmd`: the outer error is a failure to reach the deployment (a Sentinel
    /// that names no master), the inner one the command's own.
    async fn send<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> Result<Result<T, RedisError>, Error> {
        Ok(match self {
            Node::Single {
                conn,
                instance: Some(instance),
                ..
            } => {
                let generation = instance.checked(conn).await?;
                let reply = cmd.query_async(&mut conn.clone()).await;
                instance.after(reply.as_ref().err(), generation)?;
                reply
            }
            Node::Single { conn, .. } => cmd.query_async(&mut conn.clone()).await,
            Node::Cluster { conn, .. } => cmd.query_async(&mut conn.clone()).await,
            Node::Sentinel(node) => {
                let (mut conn, epoch) = node.connection().await?;
                let reply = cmd.query_async(&mut conn).await.inspect_err(|e| {
                    node.forget_on(e, epoch);
                });
                if reply.is_ok() && !node.unchanged(epoch) {
                    return Err(switched());
                }
                reply
            }
        })
    }

    /// Every key matching the glob `pattern`, by `SCAN` (never `KEYS`, which blocks the
    /// server): on each master of a cluster, on the one server otherwise. A key may be
    /// reported twice; none that existed throughout is missed.
    pub(crate) async fn scan(&self, pattern: &str) -> Result<Vec<String>, Error> {
        let Node::Cluster { conn, .. } = self else {
            return self.scan_one(pattern, None).await;
        };
        let nodes: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut conn.clone())
            .await
            .map_err(map_err)?;
        let mut keys = Vec::new();
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let (Some(address), Some(flags)) = (fields.get(1), fields.get(2)) else {
                continue;
            };
            if !flags.split(',').any(|f| f == "master")
                || flags
                    .split(',')
                    .any(|f| matches!(f, "fail" | "noaddr" | "handshake"))
            {
                continue;
            }
            // `ip:port@cport[,hostname]`
            let address = address.split(['@', ',']).next().unwrap_or_default();
            let Some((host, port)) = address.rsplit_once(':') else {
                continue;
            };
            let Ok(port) = port.parse::<u16>() else {
                continue;
            };
            keys.extend(self.scan_one(pattern, Some((host, port))).await?);
        }
        Ok(keys)
    }

    /// `SCAN` to completion on one server (`at`: a cluster node's address). Keys that
    /// are not UTF-8 are skipped: no lock name is, and the raw layout's pattern (`*`
    /// with an empty prefix) matches whatever else the database holds.
    async fn scan_one(&self, pattern: &str, at: Option<(&str, u16)>) -> Result<Vec<String>, Error> {
        let mut keys = Vec::new();
        let mut cursor = 0u64;
        loop {
            let mut cmd = redis::cmd("SCAN");
            cmd.arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000);
            let (next, batch): (u64, Vec<Vec<u8>>) = match (self, at) {
                (Node::Cluster { conn, .. }, Some((host, port))) => {
                    use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
                    let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.to_owned(),
                        port,
                    });
                    let value = conn
                        .clone()
                        .route_command(cmd, routing)
                        .await
                        .map_err(map_err)?;
                    redis::from_redis_value(value).map_err(|e| {
                        Error::backend(BACKEND, false, format!("unexpected SCAN reply: {e}"))
                    })?
                }
                _ => self.query(&cmd).await?,
            };
            keys.extend(
                batch
                    .into_iter()
                    .filter_map(|key| String::from_utf8(key).ok()),
            );
            if next == 0 {
                return Ok(keys);
            }
            cursor = next;
        }
    }

    /// `PING`: fails (not retryable) when the server wants a password it did not get.
    pub(crate) async fn ping(&self) -> Result<(), Error> {
        self.query::<String>(&redis::cmd("PING")).await.map(drop)
    }

    /// Whether this is one server behind a connection that bounds every command by the
    /// configured timeout itself (a single server or a Redlock instance).
    pub(crate) fn is_single(&self) -> bool {
        matches!(self, Node::Single { .. })
    }

    /// Whether renewals must be grouped by cluster slot.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Node::Cluster { .. })
    }

    /// The cluster's masters as read at connect (none for other topologies).
    pub(crate) fn shards(&self) -> &[Shard] {
        match self {
            Node::Cluster { shards, .. } => shards,
            _ => &[],
        }
    }

    /// This cluster node with `shard`'s master first among the seeds, for the pub/sub
    /// connection of the waiters on its slots: a message published there reaches them
    /// without a hop over the cluster bus, which let the releasing client take the lock
    /// again first (measured: hand-overs on a name served by another master than the
    /// first seed fell from about 5,000/s to 300-700/s, and the fewest grants of four
    /// clients to half the most). Other topologies are returned as they are.
    pub(crate) fn for_shard(&self, shard: &Shard) -> Node {
        match self {
            Node::Cluster { conn, seeds, .. } => Node::Cluster {
                conn: conn.clone(),
                seeds: std::iter::once(shard.client.clone())
                    .chain(seeds.iter().cloned())
                    .collect(),
                shards: Arc::new([]),
            },
            other => other.clone(),
        }
    }

    /// Opens a new pub/sub connection that receives this deployment's unlock messages,
    /// each attempt bounded by `timeout`.
    ///
    /// On a cluster every seed is tried in turn, each within `timeout`: the address of a
    /// shard's master comes first (see [`Node::for_shard`]), and after a failover it may
    /// be a host that no longer answers at all, where connecting would hang for minutes.
    pub(crate) async fn pubsub(&self, timeout: Duration) -> Result<PubSub, Error> {
        let timed_out = || Error::unavailable(BACKEND, "the pub/sub connection timed out");
        match self {
            Node::Single { client, .. } => tokio::time::timeout(timeout, client.get_async_pubsub())
                .await
                .map_err(|_| timed_out())?
                .map_err(map_err),
            Node::Cluster { seeds, .. } => {
                // Classic PUBLISH reaches every node of a cluster, so any seed will do.
                let mut last = None;
                for seed in seeds.iter() {
                    match tokio::time::timeout(timeout, seed.get_async_pubsub()).await {
                        Ok(Ok(pubsub)) => return Ok(pubsub),
                        Ok(Err(e)) => last = Some(map_err(e)),
                        Err(_) => last = Some(timed_out()),
                    }
                }
                Err(last.unwrap_or_else(|| Error::unavailable(BACKEND, "no cluster seed node")))
            }
            Node::Sentinel(node) => tokio::time::timeout(timeout, async {
                node.client()
                    .await?
                    .get_async_pubsub()
                    .await
                    .map_err(map_err)
            })
            .await
            .map_err(|_| timed_out())?,
        }
    }
}

/// A master of a Redis Cluster and the slots it serves.
pub(crate) struct Shard {
    /// Inclusive ranges of slots.
    pub(crate) slots: Vec<(u16, u16)>,
    /// A client for the master (pub/sub only).
    pub(crate) client: Client,
}

/// The cluster's masters and their slots, from `CLUSTER SLOTS`; empty when it cannot be
/// read or names a master without an address. Only where waiters subscribe depends on
/// it: classic `PUBLISH` reaches every node, so an outdated map (after a failover or a
/// resharding) costs a hop over the cluster bus, never a message.
async fn shards(conn: &ClusterConnection, tls: Option<&Tls>, config: &RedisConfig) -> Vec<Shard> {
    let Ok(Ok(ranges)) = tokio::time::timeout(
        config.timeout,
        redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async::<Vec<redis::Value>>(&mut conn.clone()),
    )
    .await
    else {
        return Vec::new();
    };
    let mut shards: Vec<(Endpoint, Vec<(u16, u16)>)> = Vec::new();
    for range in ranges {
        // [first, last, [host, port, id, ...], replicas...]
        let redis::Value::Array(fields) = range else {
            return Vec::new();
        };
        let (Some(first), Some(last), Some(redis::Value::Array(master))) =
            (fields.first(), fields.get(1), fields.get(2))
        else {
            return Vec::new();
        };
        let (Ok(first), Ok(last)) = (
            redis::from_redis_value_ref::<u16>(first),
            redis::from_redis_value_ref::<u16>(last),
        ) else {
            return Vec::new();
        };
        let (Some(host), Some(port)) = (master.first(), master.get(1)) else {
            return Vec::new();
        };
        let (Ok(host), Ok(port)) = (
            redis::from_redis_value_ref::<String>(host),
            redis::from_redis_value_ref::<u16>(port),
        ) else {
            return Vec::new();
        };
        if host.is_empty() || host == "?" {
            return Vec::new();
        }
        let endpoint = Endpoint { host, port };
        match shards.iter_mut().find(|(e, _)| *e == endpoint) {
            Some((_, slots)) => slots.push((first, last)),
            None => shards.push((endpoint, vec![(first, last)])),
        }
    }
    let mut out = Vec::with_capacity(shards.len());
    for (endpoint, slots) in shards {
        let Ok(client) = client_with(&endpoint, tls, redis_info(config, 0)) else {
            return Vec::new();
        };
        out.push(Shard { slots, client });
    }
    out
}

/// Without the `tls` feature (with it, `tests/tls_topologies.rs` connects for real).
#[cfg(all(test, not(feature = "tls")))]
mod tests {
    use super::*;

    /// Without the `tls` feature every TLS scheme is refused before any I/O, naming the
    /// feature (the hosts do not exist).
    #[tokio::test]
    async fn tls_schemes_need_the_tls_feature() {
        for url in [
            "rediss+sentinel://no-such-host.invalid:1/m",
            "rediss+cluster://no-such-host.invalid:1",
            "redlocks://no-such-host.invalid:1",
        ] {
            let config = RedisConfig::from_url(url).unwrap();
            match open(&config).await {
                Err(Error::InvalidConfig(m)) => assert!(m.contains("`redis-tls`"), "{m}"),
                Err(other) => panic!("{url}: {other:?}"),
                Ok(_) => panic!("{url}: connected"),
            }
        }
    }
}

#[cfg(test)]
mod sentinel_epoch_tests {
    use std::time::Duration;

    use super::*;
    use crate::RedisConfig;

    /// A request that failed on a connection already dropped (here: a `BLPOP` on the
    /// first connection, dropped as on a master switch, times out later) must not drop
    /// the connection in use now: that would have every reply in flight on the healthy
    /// one distrusted as "switched". The second `BLPOP`, on the new connection, is
    /// answered after the first one's timeout and must be trusted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failure_on_a_replaced_connection_keeps_the_one_in_use() {
        let set = tokio::task::spawn_blocking(fencelock_testkit::RedisSentinelSet::start)
            .await
            .unwrap();
        let config = RedisConfig::from_url(&format!("{}?timeout=3s", set.url())).unwrap();
        let nodes = open(&config).await.unwrap();
        let Node::Sentinel(node) = &nodes[0] else {
            panic!("a Sentinel node");
        };
        let (_, first) = node.connection().await.unwrap();
        let mut old = redis::cmd("BLPOP");
        old.arg("epoch-old").arg(0);
        let mut new = redis::cmd("BLPOP");
        new.arg("epoch-new").arg(0);
        let started = tokio::time::Instant::now();
        let on_old = async {
            // Times out after `timeout`, on the connection dropped below.
            let reply = nodes[0].query::<Value>(&old).await;
            (reply, started.elapsed())
        };
        let on_new = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            // As a master switch does: the cached connection is dropped.
            node.forget(first);
            tokio::time::sleep(Duration::from_millis(1400)).await;
            // A new connection; answered after the old one's request failed.
            nodes[0].query::<Value>(&new).await
        };
        let push = async {
            tokio::time::sleep(Duration::from_millis(3800)).await;
            let mut conn = redis::Client::open(set.master().url())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let _: i64 = redis::cmd("LPUSH")
                .arg("epoch-new")
                .arg("x")
                .query_async(&mut conn)
                .await
                .unwrap();
        };
        let ((old_reply, failed_at), new_reply, ()) = tokio::join!(on_old, on_new, push);
        assert!(old_reply.is_err(), "{old_reply:?}");
        assert!(
            failed_at < Duration::from_millis(3700),
            "the old connection's request failed at {failed_at:?}, after the push"
        );
        assert!(
            new_reply.is_ok(),
            "a reply on the connection in use was distrusted: {new_reply:?}"
        );
    }
}
