//! Which table of the memory backend a grant is in.

use std::time::Duration;

use super::Shared;
use super::table::Renewal;

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
    /// Renews grant `id` of `name` for `lease` from now, in this kind's table.
    pub(super) fn renew(self, shared: &Shared, name: &str, id: u64, lease: Duration) -> Renewal {
        match self {
            Kind::Lock => shared.table().renew(name, id, lease),
            Kind::Permits => shared.semaphores().renew(name, id, lease),
            Kind::ReadWrite => shared.rwlocks().renew(name, id, lease),
        }
    }

    /// Removes grant `id` of `name` from this kind's table; returns whether it held.
    pub(super) fn release(self, shared: &Shared, name: &str, id: u64) -> bool {
        match self {
            Kind::Lock => shared.table().release(name, id),
            Kind::Permits => shared.semaphores().release(name, id),
            Kind::ReadWrite => shared.rwlocks().release(name, id),
        }
    }
}
