//! A lock held in memory: the [`Grant`] of the kit's [`Held`](crate::kit::Held).

use std::sync::Arc;
use std::time::Duration;

use super::kind::Kind;
use super::renewal::Renewer;
use super::table::Renewal;
use super::{BACKEND, Client, Shared};
use crate::kit::{Deleted, Extension, Grant};
use crate::{Error, Lease, Liveness};

/// One grant of a memory table.
#[derive(Debug)]
pub(super) struct MemoryGrant {
    shared: Arc<Shared>,
    kind: Kind,
    name: Arc<str>,
    id: u64,
    /// Whether the lease is fixed (and so may be extended).
    fixed: bool,
    /// A renewing lease's renewer and key.
    renewal: Option<(Arc<Renewer>, u64)>,
}

impl MemoryGrant {
    /// Has a renewing lease renewed every third of its duration by the client's renewal
    /// task on the current runtime; a fixed lease is never renewed.
    pub(super) fn start(
        shared: Arc<Shared>,
        kind: Kind,
        client: Arc<Client>,
        (name, id): (Arc<str>, u64),
        lease: Lease,
        liveness: Liveness,
    ) -> Self {
        let renewal = match lease {
            Lease::Fixed(_) => None,
            Lease::Renewing(duration) => Some(client.renewals.insert(
                &shared,
                &client.closed,
                (kind, name.clone(), id),
                duration,
                liveness,
            )),
        };
        MemoryGrant {
            shared,
            kind,
            name,
            id,
            fixed: matches!(lease, Lease::Fixed(_)),
            renewal,
        }
    }
}

impl Grant for MemoryGrant {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn extension(&self) -> Extension {
        if self.fixed {
            Extension::Fixed {
                min_lease: crate::SHORTEST_LEASE,
            }
        } else {
            Extension::Renewing
        }
    }

    fn stop(&self) {
        if let Some((renewer, key)) = &self.renewal {
            renewer.remove(*key);
        }
    }

    async fn delete(&self) -> Result<Deleted, Error> {
        Ok(if self.kind.release(&self.shared, &self.name, self.id) {
            Deleted::Now
        } else {
            Deleted::AlreadyGone
        })
    }

    /// Memory releases at once, also on drop.
    fn delete_in_background(&self) {
        self.kind.release(&self.shared, &self.name, self.id);
    }

    async fn extend(&self, lease: Duration) -> Result<tokio::time::Instant, Error> {
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
