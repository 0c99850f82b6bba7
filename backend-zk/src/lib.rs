//! The ZooKeeper backend of [fencelock](https://docs.rs/fencelock): `zk://` and
//! `zookeeper://` URLs, and `zks://` for ZooKeeper over TLS.
//!
//! Locks follow Apache Curator's `InterProcessMutex` recipe, so a Java service using
//! Curator on the same path and a Rust service using fencelock exclude each other:
//!
//! - lock `name` under root `/r` lives in the container node `/r/{encoded name}`; each
//!   acquisition creates `/r/{encoded name}/_c_<uuid>-lock-<seq>`, EPHEMERAL_SEQUENTIAL;
//! - the lowest sequence holds the lock; a waiter watches only its predecessor;
//! - the fencing token is the holder node's **czxid** (never the sequence number, a
//!   per-parent 32-bit counter that wraps and restarts);
//! - the lease is the ZooKeeper session (see [`ZkLock`] for the details).
//!
//! Leader elections follow Curator's `LeaderLatch` the same way: election `name` lives in
//! `/r/{encoded name}`, each candidate creates `_c_<uuid>-latch-<seq>` there with its
//! value as data, the lowest sequence leads with its czxid as the term's token, and
//! observers follow the directory with a persistent recursive watch. A lock and an
//! election never share a name (see [`ZkLock`], "Leader election").
//!
//! Semaphores follow Curator's `InterProcessSemaphoreV2` on `/r/%sem/{encoded name}`
//! (`locks/` for its internal mutex, `leases/` with one `_c_<uuid>-lease-<seq>` node per
//! permit, the limit stored as `limit=<N>` in the data of `leases/`), and read-write
//! locks Curator's `InterProcessReadWriteLock` on `/r/%rw/{encoded name}`
//! (`_c_<uuid>-__READ__<seq>` / `_c_<uuid>-__WRIT__<seq>` nodes). See [`ZkLock`],
//! "Semaphores" and "Read-write locks".
//!
//! ```text
//! zk://[user:password@]host[:port][,host[:port]...][/chroot][?session_timeout=30s&min_lease=4s&acl=open|creator]
//! zks://[user:password@]host[:port][,...][/chroot][?ca=PATH&cert=PATH&key=PATH&sasl=digest-md5]
//! ```
//!
//! Cargo features: `tls` for `zks://` (through `zookeeper-client`'s rustls support, see
//! [`ZkTls`]), `sasl` for SASL DIGEST-MD5 authentication (`sasl=digest-md5`, see
//! [`AuthMethod`]). Without them such a URL is an [`Error::InvalidConfig`] saying which
//! feature to enable.
//!
//! See [`ZkConfig`] for the settings and [`ZkFence`] for writes that only succeed while
//! the lock is held.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod acquire;
mod config;
mod create;
mod election;
mod error;
mod fence;
mod held;
mod inspect;
mod lock;
mod names;
mod node;
mod pool;
mod semaphore;
mod session;
mod transport;
mod watcher;

use std::sync::Arc;

use fencelock_core::{DistributedLock, Error};

pub use config::{
    AclPolicy, AuthMethod, DEFAULT_MIN_LEASE, DEFAULT_PORT, DEFAULT_SESSION_TIMEOUT, DigestAuth,
    ZkConfig, ZkTls,
};
pub use fence::ZkFence;
pub use lock::ZkLock;
/// The `zookeeper-client` crate this backend is built on, for [`ZkFence::writer`] and
/// [`ZkLock::client`].
pub use zookeeper_client;

/// Connects to the ZooKeeper ensemble named by a `zk://`, `zookeeper://` or `zks://` URL.
///
/// # Cancel safety
///
/// Cancel safe: a dropped connect leaves no session behind.
///
/// # Errors
///
/// [`Error::InvalidUrl`] / [`Error::InvalidConfig`] for a bad URL (password redacted);
/// [`Error::Unavailable`] when no server answers; [`Error::InvalidConfig`] when the server
/// does not grant the configured session timeout.
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), fencelock_core::Error> {
/// let locks = fencelock_zk::connect("zk://127.0.0.1:2181/locks?session_timeout=10s").await?;
/// assert_eq!(locks.backend(), "zookeeper");
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<Arc<dyn DistributedLock>, Error> {
    let config = ZkConfig::from_url(url)?;
    Ok(Arc::new(ZkLock::connect(config).await?))
}
