//! One Redis deployment to send commands to: a server, a Sentinel-managed master, or a
//! cluster; plus how to open a pub/sub connection to it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use fencelock_core::Error;
use redis::aio::{ConnectionManager, PubSub};
use redis::cluster_async::ClusterConnection;
use redis::{Client, ErrorKind, FromRedisValue, RedisError, ServerErrorKind, Value};

use crate::call::Call;
use crate::error::{BACKEND, map_err};
use crate::instance::Instance;
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::RedisConfig;
    use crate::connect::open;

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
