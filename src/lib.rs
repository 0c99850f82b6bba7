// The front page is the README. Its "API at a glance" links to docs.rs, for readers on
// GitHub and crates.io; these definitions come first, so they win here: rustdoc
// resolves and checks them, and they point into this version's own pages.
//! [`connect`]: connect
//! [`connect_from_env`]: connect_from_env
//! [`connect_from_env_or_memory`]: connect_from_env_or_memory
//! [`connect_config`]: connect_config
//! [`Config`]: Config
//! [`Config::from_url`]: Config::from_url
//! [`Config::from_file`]: Config::from_file
//! [`Config::from_toml_str`]: Config::from_toml_str
//! [`SUPPORTED_SCHEMES`]: SUPPORTED_SCHEMES
//! [`DistributedLock::acquire`]: DistributedLock::acquire
//! [`AcquireOptions`]: AcquireOptions
//! [`Lease`]: Lease
//! [`Wait`]: Wait
//! [`DistributedLockExt`]: DistributedLockExt
//! [`LockGuard`]: LockGuard
//! [`FencingToken`]: FencingToken
//! [`FencedRegister`]: FencedRegister
//! [`DEFAULT_LEASE`]: DEFAULT_LEASE
//! [`SHORTEST_LEASE`]: SHORTEST_LEASE
//! [`MAX_LEASE`]: MAX_LEASE
//! [`FOREVER`]: FOREVER
//! [`MAX_NAME_LEN`]: MAX_NAME_LEN
//! [`Capabilities`]: Capabilities
//! [`Requirement`]: Requirement
//! [`Error`]: Error
//! [`Error::is_retryable`]: Error::is_retryable
//! [`Retry`]: Retry
//! [`RetryPolicy`]: RetryPolicy
//! [`MigrationLock`]: MigrationLock
//! [`MigrationPhase`]: MigrationPhase
//! [`migration_url`]: migration_url
//! [`layer`]: layer
//! [`MemoryLock`]: MemoryLock
//! [revoke]: MemoryLock::revoke
//! [`DistributedLock`]: DistributedLock
#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod connect;
mod file;
mod migrate;
mod redact;
mod requirement;

pub use config::Config;
pub use connect::{
    SUPPORTED_SCHEMES, connect, connect_config, connect_from_env, connect_from_env_or_memory,
};
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
