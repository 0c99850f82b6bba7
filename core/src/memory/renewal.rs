//! Renewal of a client's renewing leases, on the kit's scheduler
//! ([`Renewals`](crate::kit::Renewals)): one task per client and runtime, not one per
//! lock.
//!
//! The task runs on the runtime the locks were acquired on, one per runtime: when that
//! runtime shuts down, its locks stop being renewed and expire, as a remote server would
//! let them (a guard leaked there must not hold its name forever).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::kind::Kind;
use super::table::Renewal;
use super::{BACKEND, Shared};
use crate::kit::{Due, Renew, Renewals};
use crate::{Liveness, RenewalOutcome};

/// A renewing lease of the memory backend: its table, name and grant.
pub(super) type Lease = (Kind, Arc<str>, u64);

/// The renewing leases of one client on one runtime.
#[derive(Debug)]
pub(super) struct Renewer {
    shared: Arc<Shared>,
    /// The client's: cancelled by `close`.
    closed: CancellationToken,
    renewals: Renewals<Renewer>,
}

impl Renew for Renewer {
    type Lease = Lease;
    type Due = Lease;
    const ENDS_WHEN_IDLE: bool = true;
    /// Each renewal takes the table's lock on its own: a few hundred at a time, so that
    /// an acquire (which inserts its lease) never waits behind a whole round.
    const TAKEN_AT_ONCE: usize = 256;

    fn renewals(&self) -> &Renewals<Self> {
        &self.renewals
    }

    fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    fn due(&self, lease: &mut Lease, _now: Instant) -> Lease {
        lease.clone()
    }

    async fn renew(self: &Arc<Self>, due: Vec<Due<Lease>>) {
        for d in due {
            let (kind, name, id) = &d.data;
            let outcome = match kind.renew(&self.shared, name, *id, d.lease) {
                Renewal::Renewed => {
                    self.renewals.renewed(&d, Instant::now() + d.lease);
                    RenewalOutcome::Renewed
                }
                Renewal::Gone => {
                    self.renewals
                        .gone(&d, "the lock was no longer held at renewal");
                    RenewalOutcome::Gone
                }
            };
            crate::record_renewal(BACKEND, outcome, Duration::ZERO, 1);
        }
    }
}

/// The renewers of one client, by runtime.
#[derive(Debug, Default)]
pub(super) struct ClientRenewals {
    by_runtime: Mutex<HashMap<tokio::runtime::Id, Arc<Renewer>>>,
}

impl ClientRenewals {
    /// Renews `lease` of `duration` every third of it on the current runtime (which must
    /// be running), from now, until removed; returns its renewer and key.
    pub(super) fn insert(
        &self,
        shared: &Arc<Shared>,
        closed: &CancellationToken,
        lease: Lease,
        duration: Duration,
        liveness: Liveness,
    ) -> (Arc<Renewer>, u64) {
        let handle = Handle::current();
        let mut by_runtime = self
            .by_runtime
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // This runtime's renewer, kept while it exists (an idle one starts a new task at
        // the insert below: it runs on this runtime, which is running).
        let renewer = match by_runtime.get(&handle.id()) {
            Some(renewer) => renewer.clone(),
            None => {
                // Renewers whose task ended with nothing left to renew (idle, or their
                // runtime shut down) are forgotten when another runtime's is made, so the
                // map is as large as the runtimes renewing something, plus this one. Not
                // at every acquire: that looked at every renewer each time.
                by_runtime.retain(|_, renewer| !renewer.renewals.is_idle());
                let renewer = Arc::new(Renewer {
                    shared: shared.clone(),
                    closed: closed.clone(),
                    renewals: Renewals::new(handle.clone()),
                });
                by_runtime.insert(handle.id(), renewer.clone());
                renewer
            }
        };
        // Under the map's lock: a renewer is never forgotten between its lookup and the
        // insert that keeps it.
        let key = Renewals::insert(&renewer, lease, duration, liveness, Instant::now());
        (renewer, key)
    }

    /// Wakes every renewal task, so that they see the client closed and end.
    pub(super) fn wake_all(&self) {
        for renewer in self
            .by_runtime
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
        {
            renewer.renewals.wake();
        }
    }
}

impl Renewer {
    /// Stops renewing `key`.
    pub(super) fn remove(&self, key: u64) {
        self.renewals.remove(key);
    }
}
