//! Waiting for permits of a semaphore or read-write lock of the memory backend: a
//! request's place in the permits' queue, as the protocol's part of the kit's
//! claim/wait loop ([`until_turn`]).

use std::sync::Arc;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::kind::Kind;
use super::waiting::woken;
use super::{BACKEND, MemoryLock, semaphore};
use crate::kit::{Claim, GiveUp, Turn, until_turn};
use crate::{AcquireOptions, Error, FencingToken, Liveness, LockGuard, Wait, WaitDeadline};

/// A request's place in a semaphore's queue; leaving it (by drop) removes the place.
struct PermitTicket<'a> {
    lock: &'a MemoryLock,
    kind: Kind,
    name: &'a Arc<str>,
    request: semaphore::Request<'a>,
    wake: Arc<Notify>,
    /// Whether the table has the request in its queue.
    queued: bool,
}

impl Drop for PermitTicket<'_> {
    fn drop(&mut self) {
        if self.queued {
            self.lock
                .shared
                .permits_of(self.kind)
                .leave(self.name, self.request.id);
        }
    }
}

impl Claim for PermitTicket<'_> {
    type Grant = (FencingToken, Liveness);
    /// When the soonest holder's fixed lease ends, if one does.
    type Blocker = Option<Instant>;

    async fn turn(&mut self) -> Result<Turn<Self::Grant, Option<Instant>>, Error> {
        let attempt =
            self.lock
                .shared
                .permits_of(self.kind)
                .attempt(self.name, &self.request, &self.wake);
        match attempt {
            semaphore::Attempt::Granted(token, liveness) => {
                self.queued = false;
                Ok(Turn::Granted((token, liveness)))
            }
            // Refused without queueing (the request does not wait).
            semaphore::Attempt::Contended => Ok(Turn::Behind(None)),
            semaphore::Attempt::Closed => {
                self.queued = false;
                Err(Error::Closed { backend: BACKEND })
            }
            semaphore::Attempt::OtherLimit(existing) => Err(Error::InvalidConfig(format!(
                "semaphore {:?} has {existing} permits, not {}: every client must ask with \
                 the same limit",
                self.name, self.request.limit
            ))),
            semaphore::Attempt::Queued { wake_at } => {
                self.queued = true;
                Ok(Turn::Behind(wake_at))
            }
        }
    }

    async fn wait(&mut self, wake_at: Option<Instant>) -> Result<(), Error> {
        woken(&self.wake, wake_at).await;
        Ok(())
    }

    /// Leaving the queue (the drop) is all there is to undo.
    async fn give_up(self, _why: GiveUp, error: Error) -> Error {
        error
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
        let lease = options.lease_kind();
        let wait = WaitDeadline::new(options.wait_kind());
        let no_wait = options.wait_kind() == Wait::NoWait;
        let ticket = PermitTicket {
            lock: self,
            kind,
            name: &key,
            request: semaphore::Request {
                id: self.shared.table().next_id(),
                client: &self.client,
                permits: count,
                limit,
                lease: lease.duration(),
                queue: !no_wait,
            },
            wake: Arc::new(Notify::new()),
            queued: false,
        };
        let (ticket, granted) = until_turn(ticket, name, &wait, no_wait).await?;
        Ok(self.guard(kind, &key, ticket.request.id, lease, granted))
    }
}
