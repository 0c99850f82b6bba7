//! What a backend guarantees.

use std::fmt;
use std::time::Duration;

/// How far a backend's [fencing tokens](crate::FencingToken) can be trusted to grow.
///
/// Ordered from weakest to strongest, so a requirement can be checked with `>=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FencingStrength {
    /// Tokens may repeat or go backwards; do not rely on them.
    None,
    /// Tokens grow across every failure the documented assumptions cover (for example a
    /// Redis restart without persistence, under bounded clock skew), but a failure outside
    /// them (a failover that loses acknowledged writes *and* a clock step back) could
    /// issue a token that is not larger. Sufficient against zombie holders in practice,
    /// not a proof.
    BestEffort,
    /// Tokens come from a linearizable, replicated log (etcd revisions, ZooKeeper zxids)
    /// or a single process's memory: strictly increasing whatever fails, as long as the
    /// system itself keeps its guarantees.
    Strong,
}

impl fmt::Display for FencingStrength {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FencingStrength::None => "none",
            FencingStrength::BestEffort => "best-effort",
            FencingStrength::Strong => "strong",
        })
    }
}

/// How a holder learns that its lock is gone.
///
/// Ordered from weakest to strongest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LossDetection {
    /// Only from the local deadline (last renewal sent + lease − drift margin).
    Deadline,
    /// From the local deadline, and also as soon as the backend reports the lock gone
    /// (watch, session event, failed renewal that found another owner).
    Notified,
}

impl fmt::Display for LossDetection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossDetection::Deadline => "deadline",
            LossDetection::Notified => "notified",
        })
    }
}

/// The properties a backend guarantees, reported by
/// [`DistributedLock::capabilities`](crate::DistributedLock::capabilities).
///
/// A deployment can require properties and refuse to start on a backend lacking them.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::{Capabilities, FencingStrength, LossDetection};
///
/// let caps = Capabilities::new(true, FencingStrength::Strong, true, LossDetection::Notified)
///     .with_min_lease(Duration::from_secs(2));
/// assert!(caps.fencing >= FencingStrength::BestEffort);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Capabilities {
    /// Lock grants are ordered by a linearizable log: two holders can never both be
    /// granted the lock by the backend itself, whatever fails (etcd, ZooKeeper, memory).
    /// False for Redis, whose asynchronous replication can lose a lock on failover.
    pub linearizable: bool,
    /// How far fencing tokens can be trusted.
    pub fencing: FencingStrength,
    /// Waiters are granted the lock in the order they joined the server's queue, with
    /// no barging. A client has at most one waiter per name in that queue: its other
    /// tasks waiting for the name line up behind it inside the client (see
    /// [`crate::line`]), so the server's work per hand-off is bounded by the waiting
    /// clients, not tasks. Hence one client's waiters are granted in the order they
    /// started waiting, and waiting clients take turns in queue order: a task of one
    /// client may be granted before an earlier task of another client that has more
    /// tasks waiting. With one waiting task per client it is the order they started
    /// waiting.
    pub fifo: bool,
    /// How holders learn of loss.
    pub loss_detection: LossDetection,
    /// The shortest lease the backend accepts.
    pub min_lease: Duration,
    /// `inspect` can count waiters.
    pub counts_waiters: bool,
    /// Leader election: [`campaign`](crate::DistributedLock::campaign),
    /// [`leader`](crate::DistributedLock::leader) and
    /// [`observe`](crate::DistributedLock::observe).
    pub election: bool,
    /// Semaphores: [`acquire_permits`](crate::DistributedLock::acquire_permits).
    pub semaphore: bool,
    /// Read-write locks: [`acquire_read`](crate::DistributedLock::acquire_read) and
    /// [`acquire_write`](crate::DistributedLock::acquire_write).
    pub rw_lock: bool,
}

impl Capabilities {
    /// Capabilities with no minimum lease and no waiter count.
    pub const fn new(
        linearizable: bool,
        fencing: FencingStrength,
        fifo: bool,
        loss_detection: LossDetection,
    ) -> Self {
        Capabilities {
            linearizable,
            fencing,
            fifo,
            loss_detection,
            min_lease: Duration::ZERO,
            counts_waiters: false,
            election: false,
            semaphore: false,
            rw_lock: false,
        }
    }

    /// Sets the minimum lease.
    pub const fn with_min_lease(mut self, min_lease: Duration) -> Self {
        self.min_lease = min_lease;
        self
    }

    /// Sets whether the backend has leader election.
    pub const fn with_election(mut self, election: bool) -> Self {
        self.election = election;
        self
    }

    /// Sets whether the backend has semaphores.
    pub const fn with_semaphore(mut self, semaphore: bool) -> Self {
        self.semaphore = semaphore;
        self
    }

    /// Sets whether the backend has read-write locks.
    pub const fn with_rw_lock(mut self, rw_lock: bool) -> Self {
        self.rw_lock = rw_lock;
        self
    }

    /// Sets whether `inspect` counts waiters.
    pub const fn with_counts_waiters(mut self, counts_waiters: bool) -> Self {
        self.counts_waiters = counts_waiters;
        self
    }
}
