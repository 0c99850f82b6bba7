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
//! | `etcd://`, `etcds://` | etcd v3 | `etcd` | not built yet |
//! | `zk://`, `zookeeper://` | ZooKeeper | `zookeeper` | not built yet |
//! | `redis://`, `rediss://`, `redis+sentinel://`, `redis+cluster://`, `redlock://` | Redis | `redis` | not built yet |
//!
//! # Safety model
//!
//! A lease is not exclusion: a holder that pauses past its lease still believes it holds
//! the lock while someone else has it. Only a resource that checks the fencing token is
//! safe against that. See the `fencelock-core` documentation for the full contract.

mod connect;
mod redact;

pub use connect::{SUPPORTED_SCHEMES, connect, connect_from_env};
pub use fencelock_core::{
    AcquireOptions, BoxError, Capabilities, DEFAULT_LEASE, DistributedLock, DistributedLockExt,
    Error, FencedRegister, FencingStrength, FencingToken, HeldLock, HolderInfo, Lease, Liveness,
    LockGuard, LockInfo, LossDetection, MAX_NAME_LEN, MemoryLock, StaleToken, Wait, validate_name,
};
pub use redact::redact_url;
