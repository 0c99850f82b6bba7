//! The lock contract of [fencelock](https://docs.rs/fencelock): the [`DistributedLock`]
//! trait every backend implements, the [`LockGuard`] with its [`FencingToken`], options,
//! errors, capabilities, name rules, and the in-memory backend [`MemoryLock`].
//!
//! Applications normally depend on the `fencelock` facade crate, which re-exports all of
//! this and adds `connect(url)`. Backend crates depend on this crate alone.
//!
//! With the `conformance` feature, the `conformance` module holds the suite every backend must
//! pass.
//!
//! # Safety model in one paragraph
//!
//! A lease is not exclusion: a holder that pauses (GC, swap, a stopped VM) past its lease
//! still believes it holds the lock while the backend has given it to someone else. Every
//! guard therefore carries a [`FencingToken`] larger than all before it, and the
//! resource must refuse writes with a token lower than one it has already seen (see
//! [`FencedRegister`]). The guard also reports loss as soon as this client can no longer
//! guarantee ownership ([`LockGuard::lost`]), at the latest at its conservative local
//! deadline ([`LockGuard::valid_until`]).

#![cfg_attr(docsrs, feature(doc_cfg))]

mod capabilities;
#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
mod duration;
mod election;
mod error;
mod ext;
mod fence;
mod guard;
mod kept;
pub mod kit;
pub mod layer;
pub mod line;
mod liveness;
mod lock;
mod memory;
mod name;
mod options;
pub mod redact;
mod renewal;
mod semaphore;
mod token;
pub mod urlparts;

pub use capabilities::{Capabilities, FencingStrength, LossDetection};
pub use duration::parse_duration;
pub use election::{Leader, LeaderChange, LeaderChanges, MAX_LEADER_VALUE, validate_leader_value};
pub use error::{BoxError, Error};
pub use ext::DistributedLockExt;
pub use fence::{FencedRegister, StaleToken};
pub use guard::{HeldLock, LockGuard};
pub use layer::limit::WaiterLimit;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub use layer::metrics::{Metrics, MetricsOptions};
pub use layer::migration::{MigrationLock, MigrationPhase};
pub use layer::retry::{Retry, RetryPolicy};
pub use liveness::{Liveness, LossCause, SharedDeadline};
pub use lock::{DistributedLock, HolderInfo, ListedLock, LockInfo, downcast_lock};
pub use memory::MemoryLock;
pub use name::{MAX_NAME_LEN, validate_name, validate_prefix};
pub use options::{
    AcquireOptions, DEFAULT_LEASE, FOREVER, Lease, MAX_LEASE, ROUND_TRIP_GRACE, SHORTEST_LEASE,
    Wait, WaitDeadline, validate_lease,
};
pub use redact::redact_url;
pub use renewal::{RENEWAL_SECONDS, RENEWALS_TOTAL, RenewalOutcome, record_renewal};
pub use semaphore::Permits;
pub use token::FencingToken;

/// Re-exports for the macros of this crate. Not public API.
#[doc(hidden)]
pub mod __private {
    pub use tokio;
}
