//! Leader election: one leader per election at a time, each term with a fencing token,
//! and observers told of every change.
//!
//! An election is a lock whose holder publishes a value (its address, say): campaigning
//! is acquiring, the term is the [`LockGuard`](crate::LockGuard) (its token, its loss,
//! its release as resignation), and observers watch the holder. So everything the lock
//! promises holds for leadership too: one leader at a time within the backend's
//! [capabilities](crate::Capabilities), a token larger than every earlier term's, loss
//! reported to the leader, nothing left behind by a cancelled campaign.

use std::fmt;

use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::{Error, FencingToken};

/// The longest value a candidate may campaign with, in bytes, on every backend: a leader's
/// value is an address or an identity, and the same limit everywhere keeps an
/// application portable. (Each backend's own request limit lies above it: ZooKeeper's
/// `jute.maxbuffer` and etcd's `--max-request-bytes` default to about 1 MiB and 1.5 MiB,
/// and a request above them fails only after it was sent, on etcd retryably, so a retry
/// layer would send it for ever.)
pub const MAX_LEADER_VALUE: usize = 256 * 1024;

/// Refuses a campaign value longer than [`MAX_LEADER_VALUE`], before any I/O. Backends
/// call it first thing in [`campaign`](crate::DistributedLock::campaign).
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the limit and the value's length.
pub fn validate_leader_value(value: &str) -> Result<(), Error> {
    if value.len() > MAX_LEADER_VALUE {
        return Err(Error::InvalidConfig(format!(
            "a leader's value is at most {MAX_LEADER_VALUE} bytes, not {}",
            value.len()
        )));
    }
    Ok(())
}

/// The leader of an election.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The value it campaigned with.
    pub value: String,
    /// The fencing token of its term, larger than every earlier term's.
    pub token: FencingToken,
}

impl Leader {
    /// Describes a leader.
    pub fn new(value: impl Into<String>, token: FencingToken) -> Self {
        Leader {
            value: value.into(),
            token,
        }
    }
}

/// What [`LeaderChanges::next`] yields: the leader now (`None`: nobody leads), or why
/// observing stopped.
pub type LeaderChange = Result<Option<Leader>, Error>;

/// The leadership changes of one election, in the order they happened, from
/// [`DistributedLock::observe`](crate::DistributedLock::observe). The first item is the
/// state when observing started. Dropping it stops the observation.
pub struct LeaderChanges {
    changes: mpsc::UnboundedReceiver<LeaderChange>,
    _stop: DropGuard,
}

impl LeaderChanges {
    /// For backends: a stream fed by `changes`; `stop` is cancelled when it is dropped,
    /// so the backend can end its watch.
    pub fn new(changes: mpsc::UnboundedReceiver<LeaderChange>, stop: CancellationToken) -> Self {
        LeaderChanges {
            changes,
            _stop: stop.drop_guard(),
        }
    }

    /// The next change: `Some(Ok(Some(leader)))` when a leader was elected,
    /// `Some(Ok(None))` when nobody leads any more, `Some(Err(_))` when the observation
    /// failed (the stream ends after it), `None` once it has ended.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a change not yet returned stays queued.
    ///
    /// # Errors
    ///
    /// None itself; a failed observation is an item.
    pub async fn next(&mut self) -> Option<LeaderChange> {
        self.changes.recv().await
    }
}

impl fmt::Debug for LeaderChanges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderChanges").finish_non_exhaustive()
    }
}
