//! Waiting for permits of a semaphore or read-write lock of the memory backend.

use std::sync::Arc;

use tokio::sync::Notify;

use super::kind::Kind;
use super::{BACKEND, MemoryLock, Shared, semaphore, within_wait};
use crate::{AcquireOptions, Error, LockGuard, Wait};

/// A request's place in a semaphore's queue; leaving it (by drop) removes the place.
struct PermitTicket<'a> {
    shared: &'a Shared,
    kind: Kind,
    name: &'a Arc<str>,
    id: u64,
    queued: bool,
}

impl Drop for PermitTicket<'_> {
    fn drop(&mut self) {
        if self.queued {
            self.shared.permits_of(self.kind).leave(self.name, self.id);
        }
    }
}

impl MemoryLock {
    /// Takes `count` of `limit` permits of `name` in the table of `kind`, waiting as
    /// `options` allow.
    pub(super) async fn permits(
        &self,
        kind: Kind,
        name: &str,
        (count, limit): (u32, u32),
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        let key: Arc<str> = Arc::from(name);
        let waiting = self.wait_for_permits(kind, &key, (count, limit), options);
        within_wait(name, options, waiting).await
    }

    async fn wait_for_permits(
        &self,
        kind: Kind,
        name: &Arc<str>,
        (permits, limit): (u32, u32),
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        let lease = options.lease_kind();
        let wake = Arc::new(Notify::new());
        let request = semaphore::Request {
            id: self.shared.table().next_id(),
            client: &self.client,
            permits,
            limit,
            lease: lease.duration(),
            queue: options.wait_kind() != Wait::NoWait,
        };
        let mut ticket = PermitTicket {
            shared: &self.shared,
            kind,
            name,
            id: request.id,
            queued: false,
        };
        loop {
            let attempt = self.shared.permits_of(kind).attempt(name, &request, &wake);
            match attempt {
                semaphore::Attempt::Granted(token, liveness) => {
                    ticket.queued = false;
                    return Ok(self.guard(kind, name, request.id, lease, (token, liveness)));
                }
                semaphore::Attempt::Contended => {
                    return Err(Error::Contended {
                        name: name.to_string(),
                    });
                }
                semaphore::Attempt::Closed => {
                    ticket.queued = false;
                    return Err(Error::Closed { backend: BACKEND });
                }
                semaphore::Attempt::OtherLimit(existing) => {
                    return Err(Error::InvalidConfig(format!(
                        "semaphore {name:?} has {existing} permits, not {limit}: every client \
                         must ask with the same limit"
                    )));
                }
                semaphore::Attempt::Queued { wake_at } => {
                    ticket.queued = true;
                    match wake_at {
                        Some(at) => {
                            tokio::select! {
                                _ = wake.notified() => {}
                                _ = tokio::time::sleep_until(at) => {}
                            }
                        }
                        None => wake.notified().await,
                    }
                }
            }
        }
    }
}
