//! # fencelock
//!
//! Distributed locks that are honest about safety: one async [`DistributedLock`] trait,
//! backends for etcd and ZooKeeper (consensus-backed), Redis (single, Sentinel, Cluster,
//! Redlock) and memory, chosen by a URL at run time and by cargo features at compile time.
//! Every [`LockGuard`] carries a [`FencingToken`] and reports loss of the lock.
//!
//! ```
//! use fencelock::DistributedLockExt;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock::Error> {
//! // `mem://` by default; FENCELOCK_URL=etcd://... switches backend without code changes.
//! let locks = fencelock::connect_from_env().await?;
//! let guard = locks.lock("orders/SKU-8842").await?;
//! // Pass the token to every write; the resource rejects tokens lower than one it saw.
//! println!("token {}", guard.token());
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Backends
//!
//! | URL | backend | cargo feature | status |
//! |---|---|---|---|
//! | `mem://`, `mem://NAMESPACE` | in-process memory | always | built |
//! | `etcd://`, `etcds://` | etcd v3 | `etcd` | built |
//! | `zk://`, `zookeeper://` | ZooKeeper | `zookeeper` | built |
//! | `redis://`, `rediss://`, `redis+sentinel://`, `redis+cluster://`, `redlock://` | Redis | `redis` | built |
//! | `migrate://?legacy=URL&target=URL&phase=...` | [migration](fencelock_core::layer::migration) from one to another | always | built |
//!
//! `full` enables every backend. See [`connect`] for the URL forms.
//!
//! # Configuration
//!
//! A URL or a TOML config file loads into a [`Config`] ([`Config::from_url`],
//! [`Config::from_file`]), connected with [`connect_config`]. Either can require
//! capabilities ([`Requirement`]: `?require=linearizable,fencing=strong`), so a deployment
//! refuses to start on a backend that lacks them, and add the retry and metrics layers.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock::Error> {
//! let config = fencelock::Config::from_toml_str(r#"
//!     backend = "mem"
//!     prefix = "docs"
//!     require = ["linearizable", "fencing=strong"]
//! "#)?;
//! let locks = fencelock::connect_config(&config).await?;
//! assert_eq!(locks.backend(), "mem");
//! # Ok(()) }
//! ```
//!
//! # Safety model
//!
//! A lease is not exclusion: a holder that pauses past its lease still believes it holds
//! the lock while someone else has it. Only a resource that checks the fencing token is
//! safe against that. See the `fencelock-core` documentation for the full contract.

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
    Error, FencedRegister, FencingStrength, FencingToken, HeldLock, HolderInfo, Lease, Liveness,
    FOREVER, LockGuard, LockInfo, LossDetection, MAX_LEASE, MAX_NAME_LEN, MemoryLock, SHORTEST_LEASE,
    StaleToken, Wait, validate_name,
};
#[cfg(feature = "metrics")]
pub use fencelock_core::{Metrics, MetricsOptions};
pub use fencelock_core::{MigrationLock, MigrationPhase, Retry, RetryPolicy};
pub use migrate::migration_url;
pub use redact::redact_url;
pub use requirement::Requirement;
