//! A lock held in memory: renewal task and release.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use super::renewal::Renewals;
use super::table::Renewal;
use super::{Client, Shared};
use crate::{Error, HeldLock, Lease, Liveness};

/// What a memory guard holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A lock (or an election's term).
    Lock,
    /// Permits of a semaphore.
    Permits,
    /// A read or write lock of a read-write lock.
    ReadWrite,
}

impl Kind {
    pub(super) fn renew(self, shared: &Shared, name: &str, id: u64, lease: Duration) -> Renewal {
        match self {
            Kind::Lock => shared.table().renew(name, id, lease),
            Kind::Permits => shared.semaphores().renew(name, id, lease),
            Kind::ReadWrite => shared.rwlocks().renew(name, id, lease),
        }
    }

    fn release(self, shared: &Shared, name: &str, id: u64) -> bool {
        match self {
            Kind::Lock => shared.table().release(name, id),
            Kind::Permits => shared.semaphores().release(name, id),
            Kind::ReadWrite => shared.rwlocks().release(name, id),
        }
    }
}

/// The backend side of a memory guard.
#[derive(Debug)]
pub(super) struct MemoryHeld {
    shared: Arc<Shared>,
    kind: Kind,
    name: Arc<str>,
    id: u64,
    /// Whether the lease is fixed (and so may be extended).
    fixed: bool,
    client: Arc<Client>,
    /// The key of a renewing lease in the client's [`Renewals`].
    renewal: Option<u64>,
    released: AtomicBool,
}

impl MemoryHeld {
    /// Has a renewing lease renewed every third of its duration by the client's renewal
    /// task on the current runtime; a fixed lease is never renewed.
    pub(super) fn start(
        shared: Arc<Shared>,
        kind: Kind,
        client: Arc<Client>,
        name: Arc<str>,
        id: u64,
        lease: Lease,
        liveness: Liveness,
    ) -> Self {
        let renewal = match lease {
            Lease::Fixed(_) => None,
            Lease::Renewing(duration) => Some(Renewals::insert(
                &shared,
                &client,
                (kind, name.clone(), id),
                duration,
                liveness,
            )),
        };
        MemoryHeld {
            shared,
            kind,
            name,
            id,
            fixed: matches!(lease, Lease::Fixed(_)),
            client,
            renewal,
            released: AtomicBool::new(false),
        }
    }

    fn stop_renewal(&self) {
        if let Some(key) = self.renewal {
            self.client.renewals.remove(key);
        }
    }

    fn release_now(&self) -> Result<(), Error> {
        self.stop_renewal();
        let held = self.kind.release(&self.shared, &self.name, self.id);
        if held {
            self.released.store(true, Ordering::Release);
        }
        if held || self.released.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(Error::lost(
                self.name.as_ref(),
                "the lock was no longer held at release",
            ))
        }
    }
}

#[async_trait]
impl HeldLock for MemoryHeld {
    #[tracing::instrument(name = "fencelock.mem.release", level = "debug", skip_all, fields(lock = %self.name))]
    async fn release(&self) -> Result<(), Error> {
        self.release_now()
    }

    fn release_in_background(&self) {
        let _ = self.release_now();
    }

    fn can_extend(&self) -> Result<(), Error> {
        if self.fixed {
            Ok(())
        } else {
            Err(Error::not_a_fixed_lease())
        }
    }

    async fn extend(&self, lease: Duration) -> Result<tokio::time::Instant, Error> {
        self.can_extend()?;
        crate::validate_lease(lease, crate::SHORTEST_LEASE)?;
        let sent = tokio::time::Instant::now();
        match self.kind.renew(&self.shared, &self.name, self.id, lease) {
            Renewal::Renewed => Ok(sent + lease),
            Renewal::Gone => Err(Error::lost(
                self.name.as_ref(),
                "the lock was no longer held when extending its lease",
            )),
        }
    }
}

impl Drop for MemoryHeld {
    fn drop(&mut self) {
        self.stop_renewal();
    }
}
