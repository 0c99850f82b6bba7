//! The raw-client floor of each backend: the least a lock can cost on this deployment.
//!
//! Each floor takes the lock with the backend's cheapest correct primitive, straight
//! through the client library, and spins with 1 ms sleeps under contention (as hand-written
//! locks do), with no fencing token, no lease renewal and no loss detection:
//!
//! | backend | acquire | release |
//! |---|---|---|
//! | mem | `tokio::sync::Mutex` per name | drop |
//! | etcd | txn: if create_revision(key) == 0 then put | txn: if value == ours then delete |
//! | ZooKeeper | create an ephemeral node | delete it |
//! | Redis (single) | `SET key value NX PX 30000` | compare-and-delete script |

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Compare, CompareOp, ConnectOptions, Txn, TxnOp};
use fencelock_etcd::EtcdConfig;
use fencelock_redis::{RedisConfig, Topology};
use fencelock_zk::ZkConfig;
use fencelock_zk::zookeeper_client as zk;
use tokio::time::Instant;

use super::driver::{Cycle, Granted};
use crate::exit::{Failure, code, one_line};

/// The sleep between two tries of a contended floor.
const SPIN: Duration = Duration::from_millis(1);

/// Connects one client of the floor for `url`; returns it and its description.
///
/// # Errors
///
/// [`code::USAGE`] when the URL's backend has no floor here; backend errors as
/// unavailable.
///
/// # Cancel safety
///
/// Cancel safe: a dropped connect leaves no client behind.
pub async fn connect(url: &str) -> Result<(Arc<dyn Cycle>, &'static str), Failure> {
    let url = &backend_url(url);
    let scheme = url
        .split_once("://")
        .map_or("", |(s, _)| s)
        .to_ascii_lowercase();
    match scheme.as_str() {
        "mem" => Ok((Arc::new(MemFloor), "tokio::sync::Mutex per name")),
        "etcd" => Ok((
            Arc::new(EtcdFloor::connect(url).await?),
            "etcd-client txn create-if-absent + compare-and-delete",
        )),
        "zk" | "zookeeper" => Ok((
            Arc::new(ZkFloor::connect(url).await?),
            "zookeeper-client create ephemeral + delete",
        )),
        "redis" => Ok((
            Arc::new(RedisFloor::connect(url).await?),
            "redis SET NX PX + compare-and-delete script",
        )),
        other => Err(Failure::usage(format!(
            "--baseline has no raw-client floor for {other}:// (it has for mem, etcd, zk and single-server redis)"
        ))),
    }
}

/// `url` without the query options the facade takes out for itself (`retry=`,
/// `require=`, `metrics=`, `max_waiters=`, ...): the URL the backend's own parser sees.
///
/// [`fencelock::Config`] keeps that URL but does not hand it out, so the facade is asked
/// pair by pair: `mem://` takes no query option at all, so a pair it accepts after
/// `mem://?` is one the facade consumes. The list of the facade's options thus stays the
/// library's, not a copy here. The URL itself was checked whole by `Config::from_url`.
pub(super) fn backend_url(url: &str) -> String {
    let Some((head, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let own: Vec<&str> = query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .filter(|pair| fencelock::Config::from_url(&format!("mem://?{pair}")).is_err())
        .collect();
    if own.is_empty() {
        head.to_owned()
    } else {
        format!("{head}?{}", own.join("&"))
    }
}

fn unavailable(backend: &'static str) -> impl Fn(String) -> Failure {
    move |reason| Failure::new(code::UNAVAILABLE, format!("baseline {backend}: {reason}"))
}

/// `tokio::sync::Mutex` per name, shared by every client of this process.
struct MemFloor;

fn mem_locks(name: &str) -> Arc<tokio::sync::Mutex<()>> {
    static LOCKS: OnceLock<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>> = OnceLock::new();
    let mut locks = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    locks.entry(name.to_owned()).or_default().clone()
}

#[async_trait]
impl Cycle for MemFloor {
    async fn cycle(
        &self,
        name: &str,
        deadline: Instant,
        hold: Duration,
        granted: Granted<'_>,
    ) -> Result<bool, Failure> {
        let lock = mem_locks(name);
        let Ok(guard) = tokio::time::timeout_at(deadline, lock.lock_owned()).await else {
            return Ok(false);
        };
        granted();
        hold_for(hold).await;
        drop(guard);
        Ok(true)
    }
}

/// etcd: a key created only if absent, deleted only if still ours.
struct EtcdFloor {
    client: etcd_client::Client,
    prefix: String,
}

impl EtcdFloor {
    async fn connect(url: &str) -> Result<Self, Failure> {
        let config = EtcdConfig::from_url(url)?;
        let mut options = ConnectOptions::new().with_connect_timeout(config.connect_timeout);
        if let Some(user) = &config.user {
            options = options.with_user(user, config.password.clone().unwrap_or_default());
        }
        let client = etcd_client::Client::connect(&config.endpoints, Some(options))
            .await
            .map_err(|e| unavailable("etcd")(one_line(&e)))?;
        Ok(EtcdFloor {
            client,
            prefix: format!("{}/fencelock-bench-raw", config.prefix),
        })
    }
}

#[async_trait]
impl Cycle for EtcdFloor {
    async fn cycle(
        &self,
        name: &str,
        deadline: Instant,
        hold: Duration,
        granted: Granted<'_>,
    ) -> Result<bool, Failure> {
        let key = format!("{}/{name}", self.prefix);
        let value = format!("{:x}", random_u64());
        let mut kv = self.client.kv_client();
        let fail = |e: etcd_client::Error| unavailable("etcd")(one_line(&e));
        loop {
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key.as_str(), value.as_str(), None)]);
            if kv.txn(txn).await.map_err(fail)?.succeeded() {
                break;
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(SPIN).await;
        }
        granted();
        hold_for(hold).await;
        let release = Txn::new()
            .when([Compare::value(
                key.as_str(),
                CompareOp::Equal,
                value.as_str(),
            )])
            .and_then([TxnOp::delete(key.as_str(), None)]);
        kv.txn(release).await.map_err(fail)?;
        Ok(true)
    }
}

/// ZooKeeper: an ephemeral node per name.
struct ZkFloor {
    client: zk::Client,
    root: String,
}

impl ZkFloor {
    async fn connect(url: &str) -> Result<Self, Failure> {
        let config = ZkConfig::from_url(url)?;
        let fail = |e: zk::Error| unavailable("zookeeper")(one_line(&e));
        let mut connector = zk::Client::connector();
        connector = connector.with_session_timeout(config.session_timeout());
        if let Some(auth) = config.auth() {
            connector = connector.with_auth(
                "digest",
                format!("{}:{}", auth.user, auth.password).as_bytes(),
            );
        }
        let client = connector.connect(config.hosts()).await.map_err(fail)?;
        let root = format!("{}/fencelock-bench-raw", config.chroot());
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        let mut path = String::new();
        for part in root.split('/').filter(|p| !p.is_empty()) {
            path.push('/');
            path.push_str(part);
            match client.create(&path, &[], &persistent).await {
                Ok(_) | Err(zk::Error::NodeExists) => {}
                Err(e) => return Err(fail(e)),
            }
        }
        Ok(ZkFloor { client, root })
    }
}

#[async_trait]
impl Cycle for ZkFloor {
    async fn cycle(
        &self,
        name: &str,
        deadline: Instant,
        hold: Duration,
        granted: Granted<'_>,
    ) -> Result<bool, Failure> {
        let path = format!("{}/{}", self.root, name.replace('/', "_"));
        let ephemeral = zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all());
        let fail = |e: zk::Error| unavailable("zookeeper")(one_line(&e));
        loop {
            match self.client.create(&path, &[], &ephemeral).await {
                Ok(_) => break,
                Err(zk::Error::NodeExists) => {}
                Err(e) => return Err(fail(e)),
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(SPIN).await;
        }
        granted();
        hold_for(hold).await;
        self.client.delete(&path, None).await.map_err(fail)?;
        Ok(true)
    }
}

/// Redis: `SET NX PX` and a compare-and-delete script, on one server.
struct RedisFloor {
    connection: redis::aio::MultiplexedConnection,
    release: redis::Script,
}

const RELEASE: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

impl RedisFloor {
    async fn connect(url: &str) -> Result<Self, Failure> {
        let config = RedisConfig::from_url(url)?;
        if !matches!(config.topology, Topology::Single { tls: false, .. }) {
            return Err(Failure::usage(
                "--baseline supports single-server redis:// only",
            ));
        }
        // The fencelock options in the query mean nothing to the raw client.
        let plain = url.split_once('?').map_or(url, |(plain, _)| plain);
        let fail = |e: redis::RedisError| unavailable("redis")(one_line(&e));
        let connection = redis::Client::open(plain)
            .map_err(fail)?
            .get_multiplexed_async_connection()
            .await
            .map_err(fail)?;
        Ok(RedisFloor {
            connection,
            release: redis::Script::new(RELEASE),
        })
    }
}

#[async_trait]
impl Cycle for RedisFloor {
    async fn cycle(
        &self,
        name: &str,
        deadline: Instant,
        hold: Duration,
        granted: Granted<'_>,
    ) -> Result<bool, Failure> {
        let key = format!("fencelock-bench-raw:{name}");
        let value = format!("{:x}", random_u64());
        let mut connection = self.connection.clone();
        let fail = |e: redis::RedisError| unavailable("redis")(one_line(&e));
        loop {
            let set: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(&value)
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async(&mut connection)
                .await
                .map_err(fail)?;
            if set.is_some() {
                break;
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(SPIN).await;
        }
        granted();
        hold_for(hold).await;
        let _: i64 = self
            .release
            .key(&key)
            .arg(&value)
            .invoke_async(&mut connection)
            .await
            .map_err(fail)?;
        Ok(true)
    }
}

/// Keeps the lock for `hold` (the workload's time inside the critical section).
async fn hold_for(hold: Duration) {
    if !hold.is_zero() {
        tokio::time::sleep(hold).await;
    }
}

/// A random owner value (std's per-instance random hasher keys).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn mem_floor_excludes_and_times_out() {
        let (floor, _) = connect("mem://").await.unwrap();
        let far = Instant::now() + Duration::from_secs(5);
        assert!(
            floor
                .cycle("floor-a", far, Duration::ZERO, &|| {})
                .await
                .unwrap()
        );
        let held = mem_locks("floor-b").lock_owned().await;
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(
            !floor
                .cycle("floor-b", soon, Duration::ZERO, &|| {})
                .await
                .unwrap()
        );
        drop(held);
        assert!(connect("redlock://a:1,b:2,c:3").await.is_err());
    }

    #[test]
    fn the_backend_gets_its_own_options_only() {
        assert_eq!(backend_url("mem://"), "mem://");
        assert_eq!(backend_url("mem://?retry=2"), "mem://");
        assert_eq!(
            backend_url("etcd://h:2379/p?retry=2&lease=2s&require=linearizable&max_waiters=3"),
            "etcd://h:2379/p?lease=2s"
        );
        assert_eq!(
            backend_url("zk://h/p?metrics=false&session_timeout=2s&retry_min_delay=10ms"),
            "zk://h/p?session_timeout=2s"
        );
        assert_eq!(backend_url("redis://h:1?prefix=x"), "redis://h:1?prefix=x");
    }
}
