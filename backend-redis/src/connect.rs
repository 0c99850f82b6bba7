//! Opening a deployment's nodes: the first connections, their handshakes and checks
//! within `connect_timeout`, and, on a cluster, where its masters serve their slots.

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::Error;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{AsyncConnectionConfig, ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo};

use crate::config::RedisConfig;
use crate::error::{BACKEND, map_err};
use crate::instance::Instance;
use crate::node::{Node, Shard};
use crate::sentinel::SentinelNode;
use crate::tls::{Tls, address, client_with, tls_sentinel_client};
use crate::topology::{Endpoint, Topology};

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
