#![doc = include_str!("../README.md")]
//!
//! ## API at a glance
//!
//! - Connecting: [`connect`] (a URL), [`connect_from_env`] (`FENCELOCK_URL`, then
//!   `FENCELOCK_CONFIG`, then `mem://`), [`connect_config`] with a [`Config`]
//!   ([`Config::from_url`], [`Config::from_file`], [`Config::from_toml_str`]);
//!   [`SUPPORTED_SCHEMES`] lists what this build can connect to.
//! - Locking: [`DistributedLock::acquire`] with [`AcquireOptions`] ([`Lease`], [`Wait`]),
//!   and [`DistributedLockExt`] (`lock`, `try_lock`, `with_lock`); the [`LockGuard`] and
//!   its [`FencingToken`]; [`FencedRegister`], a resource that checks tokens, in memory.
//! - Limits: [`DEFAULT_LEASE`], [`SHORTEST_LEASE`], [`MAX_LEASE`], [`FOREVER`],
//!   [`MAX_NAME_LEN`]; what a backend guarantees: [`Capabilities`], checked at start with
//!   [`Requirement`]s.
//! - Errors: one [`Error`] enum of stable kinds, with [`Error::is_retryable`].
//! - Layers: [`Retry`] ([`RetryPolicy`]), `Metrics` (cargo feature `metrics`), and the
//!   [`MigrationLock`] behind `migrate://` ([`MigrationPhase`], [`migration_url`]); see
//!   [`layer`].
//! - Testing: [`MemoryLock`] runs on `tokio::time` and can
//!   [`revoke`](MemoryLock::revoke) a lock.
//!
//! The trait's full contract (what a guard promises, when loss is reported, cancel
//! safety) is documented on [`DistributedLock`] and in `fencelock-core`.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod connect;
mod file;
mod migrate;
mod redact;
mod requirement;

pub use config::Config;
pub use connect::{SUPPORTED_SCHEMES, connect, connect_config, connect_from_env};
/// Layers over any lock: retry with backoff, metrics and tracing. See [`Retry`] and
/// `Metrics` (cargo feature `metrics`).
pub use fencelock_core::layer;
pub use fencelock_core::{
    AcquireOptions, BoxError, Capabilities, DEFAULT_LEASE, DistributedLock, DistributedLockExt,
    Error, FOREVER, FencedRegister, FencingStrength, FencingToken, HeldLock, HolderInfo, Leader,
    LeaderChange, LeaderChanges, Lease, ListedLock, Liveness, LockGuard, LockInfo, LossCause,
    LossDetection, MAX_LEADER_VALUE, MAX_LEASE, MAX_NAME_LEN, MemoryLock, Permits, SHORTEST_LEASE,
    StaleToken, Wait, downcast_lock, parse_duration, validate_name, validate_prefix,
};
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub use fencelock_core::{Metrics, MetricsOptions};
pub use fencelock_core::{MigrationLock, MigrationPhase, Retry, RetryPolicy};
pub use migrate::migration_url;
pub use redact::redact_url;
pub use requirement::Requirement;

/// The etcd backend (cargo feature `etcd`): [`etcd::EtcdLock`] and its configuration,
/// and helpers beyond the trait such as [`etcd::owner_compare`]. Reach the lock behind a
/// URL with [`downcast_lock`].
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use fencelock_etcd as etcd;
/// The Redis backend (cargo feature `redis`): [`redis::RedisLock`] and its
/// configuration.
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use fencelock_redis as redis;
/// The ZooKeeper backend (cargo feature `zookeeper`): [`zookeeper::ZkLock`], its
/// configuration and [`zookeeper::ZkFence`].
#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub use fencelock_zk as zookeeper;
