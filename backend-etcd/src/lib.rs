//! etcd backend of [fencelock](https://docs.rs/fencelock): session lease, revision-ordered
//! FIFO waiting, create-revision fencing tokens, compatible with etcd's own Go lock.
//!
//! Use it through `fencelock::connect("etcd://host:2379/prefix")`, or directly with
//! [`EtcdLock::connect`]. See [`EtcdConfig`] for the URL form and [`EtcdLock`] for the
//! algorithm.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod acquire;
mod batch;
mod cleanup;
mod client;
mod config;
mod create;
mod election;
mod error;
mod fence;
mod grant;
mod held;
mod keys;
mod leases;
mod lock;
mod queue;
mod session;
mod sessions;
mod tls;
mod txn;
mod wait;
mod watches;

use std::sync::Arc;

use fencelock_core::{DistributedLock, Error};

pub use config::{EtcdConfig, EtcdTls, MIN_LEASE};
/// The `etcd-client` crate this backend is built on, for your own transactions with
/// [`owner_compare`] (the same version, so its types fit).
pub use etcd_client;
pub use fence::owner_compare;
pub use lock::EtcdLock;

/// Connects to the etcd cluster named by an `etcd://` or `etcds://` URL.
///
/// # Cancel safety
///
/// As [`EtcdLock::connect`].
///
/// # Errors
///
/// [`Error::InvalidUrl`] / [`Error::InvalidConfig`] for a bad URL, otherwise as
/// [`EtcdLock::connect`].
pub async fn connect(url: &str) -> Result<Arc<dyn DistributedLock>, Error> {
    Ok(Arc::new(
        EtcdLock::connect(EtcdConfig::from_url(url)?).await?,
    ))
}

/// The README's code blocks, compiled as doctests so they keep matching the code.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeSnippets;
