//! fencelock backend for Redis: a single server, Sentinel, Cluster and Redlock.
//!
//! Connect with [`connect`] (what `fencelock::connect` calls for `redis://`,
//! `redis+sentinel://`, `redis+cluster://` and `redlock://` URLs, and their TLS forms
//! `rediss://`, `rediss+sentinel://`, `rediss+cluster://` and `redlocks://`) or build a
//! [`RedisConfig`] and call [`RedisLock::connect`].
//!
//! TLS (cargo feature `tls`, through rustls) trusts the system's root certificates, or
//! only the CA file of `ca=PATH`, and presents a client certificate with
//! `cert=PATH&key=PATH` (see [`RedisTls`]), on every server of the deployment: for
//! Sentinel the Sentinels and the master alike, for Cluster every node it announces.
//!
//! # What it guarantees, and what it does not
//!
//! - Acquire and release are one script call each (`EVALSHA`, loaded on `NOSCRIPT`). The
//!   lock key holds a per-grant owner value (random client id + grant number) with a
//!   millisecond TTL; release compares the owner before deleting, so it never deletes
//!   another grant's key.
//! - **Fencing tokens** come from the acquire script: `max(counter + 1, server TIME in
//!   µs)`, written back to a counter key in the lock's slot. They never go backwards,
//!   also after a restart without persistence, as long as the server's wall clock does
//!   not step back (the assumption is spelled out in the README). Redlock issues
//!   `max(counter + 1, the client's clock in µs)` on each instance and makes sure the
//!   highest answer is recorded on a majority before returning (in the same round trip
//!   when the instances agree), so tokens grow while a majority keeps its data. Reported as [`FencingStrength::BestEffort`](fencelock_core::FencingStrength).
//! - **Not linearizable**: asynchronous replication can lose a lock on failover (a second
//!   holder may then appear; the fenced resource must reject the first). The optional
//!   replica check (`wait_replicas`) narrows, but does not close, that window.
//! - **Not FIFO**: waiters wake on an unlock message and race.
//! - **Redlock counts servers, not names**: an instance named twice is refused by
//!   [`RedisConfig::check_instances`], and two instances that reach one server (two names
//!   or addresses of it) by their server's `run_id` (`INFO server`), at
//!   [`RedisLock::connect`] and again whenever an instance's connection is re-made; a
//!   reply is counted only from a connection so checked. The user needs `+info`.
//! - **Leader election** (`campaign`, `leader`, `observe`) on every topology: a term is
//!   the lock of the same name whose key holds `owner \n token \n value`, so the value is
//!   set with the grant and renewed, expired and deleted with the key. Grants and releases
//!   publish on an election channel in the lock's slot; observers read the key again on
//!   each message and at its expiry (`PTTL`), since Redis publishes nothing when a lease
//!   runs out. Not linearizable: a failover can elect a second leader while the first has
//!   not noticed (its token is smaller), a term shorter than an observer's read may go
//!   unreported, and a plain lock on an observed name (which publishes nothing) is seen
//!   only at the observer's next read. The README's Elections section has the details.
//! - **Semaphores and read-write locks** on a single server, Sentinel and Cluster: each
//!   holder has a key of its own (renewed, released and expired like a lock key), listed
//!   in an index hash in the name's slot; grants take tokens by the lock's rule. Not FIFO,
//!   but the first refused waiting writer or semaphore request records an intent that
//!   holds back barging requests (writer-preferring). Not on Redlock (`Unsupported`): a
//!   majority of independent instances cannot bound a semaphore's holders. The README's
//!   key layout has the details.
//! - Renewal: one task per client renews all its renewing locks every third of the lease,
//!   batched per node (per slot on Cluster). A key found gone or re-owned reports loss at
//!   once; renewal errors lead to loss at the local deadline (renewal sent + lease −
//!   1 % − 2 ms).
//! - **Fenced data**: [`FencedValue`] is the resource-side check for data kept in Redis:
//!   a value that refuses reads and writes with a token lower than the highest it has
//!   seen, checked and written by one script. It takes the tokens of any backend.

#![cfg_attr(docsrs, feature(doc_cfg))]
// The futures of `acquire` and `campaign` nest deeper than the default limit lets rustc
// compute their layout.
#![recursion_limit = "256"]

mod acquire;
mod attempt;
mod call;
mod config;
mod connect;
mod election;
mod engine;
mod error;
mod fence;
mod held;
mod instance;
mod keys;
mod lock;
mod node;
mod observe;
mod primitives;
mod quorum;
mod renewal;
mod replicas;
mod scripts;
mod sentinel;
mod subscriber;
mod tls;
mod topology;
mod url;
mod waiting;

use std::sync::Arc;

pub use config::{MIN_LEASE, RedisConfig};
pub use fence::{FenceError, FencedValue};
use fencelock_core::{DistributedLock, Error};
pub use keys::KeyLayout;
pub use lock::RedisLock;
/// The `redis` client crate this backend is built on, for connections to use with
/// [`FencedValue`] (the same version, so its connection types fit).
pub use redis;
pub use topology::{Endpoint, RedisTls, Topology};

/// Connects to the Redis deployment named by `url` (see [`RedisConfig`] for the forms).
///
/// # Cancel safety
///
/// Cancel safe: a dropped connect leaves no connection or task behind.
///
/// # Errors
///
/// [`Error::InvalidUrl`] for a malformed URL (password redacted); otherwise as
/// [`RedisLock::connect`].
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
/// let locks = fencelock_redis::connect("redis://127.0.0.1:6379").await?;
/// let guard = locks.acquire("orders/SKU-8842", Default::default()).await?;
/// println!("token {}", guard.token());
/// guard.release().await?;
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<Arc<dyn DistributedLock>, Error> {
    let config = RedisConfig::from_url(url)?;
    Ok(Arc::new(RedisLock::connect(config).await?))
}

/// The README's code blocks, compiled as doctests so they keep matching the code.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeSnippets;
