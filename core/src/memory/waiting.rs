//! A lock request's place in the memory table's queue, as the protocol's part of the
//! kit's claim/wait loop ([`until_turn`]): a turn is one look at the table, which grants
//! or queues the request (refuses one that does not wait); a wait lasts until the
//! table wakes the request or the holder's fixed lease ends.

use std::sync::Arc;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::table::Attempt;
use super::{BACKEND, MemoryLock};
use crate::kit::{Claim, GiveUp, Turn};
use crate::{Error, FencingToken, Liveness};

/// A waiter's place in a lock's queue; leaving it (by drop) removes the place.
pub(super) struct Ticket<'a> {
    pub(super) lock: &'a MemoryLock,
    pub(super) name: &'a Arc<str>,
    pub(super) id: u64,
    pub(super) value: Option<&'a Arc<str>>,
    pub(super) lease: std::time::Duration,
    /// Whether the request may queue (it waits).
    pub(super) queue: bool,
    pub(super) wake: Arc<Notify>,
    /// Whether the table has the request in its queue.
    pub(super) queued: bool,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if self.queued {
            self.lock.shared.table().leave(self.name, self.id);
        }
    }
}

impl Claim for Ticket<'_> {
    type Grant = (FencingToken, Liveness);
    /// When the holder's fixed lease ends, if it does.
    type Blocker = Option<Instant>;

    async fn turn(&mut self) -> Result<Turn<Self::Grant, Option<Instant>>, Error> {
        let attempt = self.lock.shared.table().attempt(
            self.name,
            (self.id, &self.lock.client),
            self.value,
            &self.wake,
            self.lease,
            self.queue,
        );
        match attempt {
            Attempt::Granted(token, liveness) => {
                // The table took us off the queue when it granted the lock.
                self.queued = false;
                Ok(Turn::Granted((token, liveness)))
            }
            // Refused without queueing (the request does not wait).
            Attempt::Contended => Ok(Turn::Behind(None)),
            Attempt::Closed => {
                // Closing emptied the queue.
                self.queued = false;
                Err(Error::Closed { backend: BACKEND })
            }
            Attempt::Queued { wake_at } => {
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

/// Waits until the table wakes the request through `wake`, or `wake_at`.
pub(super) async fn woken(wake: &Notify, wake_at: Option<Instant>) {
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
