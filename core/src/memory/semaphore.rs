//! The in-memory semaphores: per name a limit, the holders of permits, and a FIFO queue.
//! Read-write locks are semaphores too, in a table of their own: a reader takes one of
//! [`RW_PERMITS`], a writer all of them, and FIFO order keeps a waiting writer ahead of
//! the readers that come after it.
//!
//! As in the lock table, holders expire lazily and the waiter at the front of a queue
//! keeps a wake-up armed for the earliest expiry among the holders, so a permit whose
//! lease ran out comes back without polling. Waiting is FIFO without barging: a request
//! that fits is still queued behind an earlier one that does not.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::Client;
use super::table::Renewal;
use crate::{FencingToken, Liveness, LossCause};

/// The permits of a read-write lock: as many readers as that, or one writer.
pub(super) const RW_PERMITS: u32 = u32::MAX;

/// All semaphores (or all read-write locks) of one memory lock set.
#[derive(Debug, Default)]
pub(super) struct Semaphores {
    names: HashMap<Arc<str>, Semaphore>,
    /// One counter for every name of the table: a name's state is forgotten when idle,
    /// and its tokens must still grow (as the lock table's do).
    last_token: u64,
}

#[derive(Debug)]
struct Semaphore {
    /// Fixed while anyone holds or waits; forgotten with the last of them.
    limit: u32,
    holders: Vec<Holder>,
    waiters: VecDeque<Waiter>,
}

#[derive(Debug)]
struct Holder {
    id: u64,
    client: u64,
    permits: u32,
    expires_at: Instant,
    liveness: Liveness,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    client: u64,
    wake: Arc<Notify>,
}

/// What a request for permits should do next.
pub(super) enum Attempt {
    /// Granted, with this token.
    Granted(FencingToken, Liveness),
    /// Queued; the front waiter also wakes at the earliest holder's expiry.
    Queued { wake_at: Option<Instant> },
    /// Not enough permits free, and the caller did not want to wait.
    Contended,
    /// The caller's client was closed.
    Closed,
    /// The semaphore exists with another limit.
    OtherLimit(u32),
}

/// One request for permits.
pub(super) struct Request<'a> {
    pub(super) id: u64,
    pub(super) client: &'a Client,
    pub(super) permits: u32,
    pub(super) limit: u32,
    pub(super) lease: Duration,
    pub(super) queue: bool,
}

impl Semaphores {
    /// Tries to take the permits of `request` on `name`.
    pub(super) fn attempt(
        &mut self,
        name: &Arc<str>,
        request: &Request<'_>,
        wake: &Arc<Notify>,
    ) -> Attempt {
        if request.client.closed.is_cancelled() {
            return Attempt::Closed;
        }
        let now = Instant::now();
        let semaphore = self.names.entry(name.clone()).or_insert_with(|| Semaphore {
            limit: request.limit,
            holders: Vec::new(),
            waiters: VecDeque::new(),
        });
        semaphore.expire(now);
        // The limit is kept only while anyone holds or waits: once the last holder's
        // lease ran out, a request with another limit sets the new one.
        if semaphore.holders.is_empty() && semaphore.waiters.is_empty() {
            semaphore.limit = request.limit;
        }
        if semaphore.limit != request.limit {
            let limit = semaphore.limit;
            self.forget_if_idle(name);
            return Attempt::OtherLimit(limit);
        }
        let at_front = semaphore
            .waiters
            .front()
            .is_some_and(|w| w.id == request.id);
        let fits = request.permits <= semaphore.free();
        if fits && (semaphore.waiters.is_empty() || at_front) {
            if at_front {
                semaphore.waiters.pop_front();
                // The next one may fit in what is left, or must arm the expiry wake-up.
                semaphore.wake_front();
            }
            self.last_token += 1;
            let token = FencingToken::new(self.last_token);
            let expires_at = now + request.lease;
            let liveness = Liveness::new(expires_at);
            semaphore.holders.push(Holder {
                id: request.id,
                client: request.client.id,
                permits: request.permits,
                expires_at,
                liveness: liveness.clone(),
            });
            return Attempt::Granted(token, liveness);
        }
        if !request.queue {
            self.forget_if_idle(name);
            return Attempt::Contended;
        }
        if !semaphore.waiters.iter().any(|w| w.id == request.id) {
            semaphore.waiters.push_back(Waiter {
                id: request.id,
                client: request.client.id,
                wake: wake.clone(),
            });
        }
        let at_front = semaphore
            .waiters
            .front()
            .is_some_and(|w| w.id == request.id);
        Attempt::Queued {
            wake_at: at_front
                .then(|| semaphore.holders.iter().map(|h| h.expires_at).min())
                .flatten(),
        }
    }

    /// Removes waiter `id` (cancelled or timed out), passing the turn on if it had it.
    pub(super) fn leave(&mut self, name: &str, id: u64) {
        let Some(semaphore) = self.names.get_mut(name) else {
            return;
        };
        let was_front = semaphore.waiters.front().is_some_and(|w| w.id == id);
        semaphore.waiters.retain(|w| w.id != id);
        if was_front {
            semaphore.expire(Instant::now());
            semaphore.wake_front();
        }
        self.forget_if_idle(name);
    }

    /// Extends holder `id`'s lease, if it still holds.
    pub(super) fn renew(&mut self, name: &str, id: u64, lease: Duration) -> Renewal {
        let now = Instant::now();
        let Some(semaphore) = self.names.get_mut(name) else {
            return Renewal::Gone;
        };
        semaphore.expire(now);
        match semaphore.holders.iter_mut().find(|h| h.id == id) {
            Some(holder) => {
                holder.expires_at = holder.expires_at.max(now + lease);
                holder.liveness.extend(holder.expires_at);
                if holder.liveness.is_lost() {
                    // Its deadline passed between our look at the clock and the guard's
                    // (a starved renewal): the guard counts it lost, so it goes.
                    semaphore.holders.retain(|h| h.id != id);
                    semaphore.wake_front();
                    self.forget_if_idle(name);
                    return Renewal::Gone;
                }
                Renewal::Renewed
            }
            None => {
                self.forget_if_idle(name);
                Renewal::Gone
            }
        }
    }

    /// Gives holder `id`'s permits back. Returns whether it still held them.
    pub(super) fn release(&mut self, name: &str, id: u64) -> bool {
        let Some(semaphore) = self.names.get_mut(name) else {
            return false;
        };
        semaphore.expire(Instant::now());
        let before = semaphore.holders.len();
        semaphore.holders.retain(|h| h.id != id);
        let held = semaphore.holders.len() != before;
        if held {
            semaphore.wake_front();
        }
        self.forget_if_idle(name);
        held
    }

    /// Closes `client`: its permits come back (its guards report the loss), its waiters
    /// leave and are woken to find [`Attempt::Closed`].
    pub(super) fn close_client(&mut self, client: &Client) {
        let now = Instant::now();
        self.names.retain(|_, semaphore| {
            semaphore.expire(now);
            semaphore.holders.retain(|h| {
                let ours = h.client == client.id;
                if ours {
                    h.liveness
                        .mark_lost(LossCause::ClientClosed, "the lock client was closed");
                }
                !ours
            });
            semaphore.waiters.retain(|w| {
                let ours = w.client == client.id;
                if ours {
                    w.wake.notify_one();
                }
                !ours
            });
            semaphore.wake_front();
            !semaphore.is_idle()
        });
    }

    /// How many semaphores have a holder or a waiter.
    pub(super) fn active(&mut self) -> usize {
        let now = Instant::now();
        self.names.retain(|_, semaphore| {
            semaphore.expire(now);
            !semaphore.is_idle()
        });
        self.names.len()
    }

    fn forget_if_idle(&mut self, name: &str) {
        if self.names.get(name).is_some_and(Semaphore::is_idle) {
            self.names.remove(name);
        }
    }
}

impl Semaphore {
    /// Permits nobody holds.
    fn free(&self) -> u32 {
        let held: u64 = self.holders.iter().map(|h| u64::from(h.permits)).sum();
        u32::try_from(u64::from(self.limit).saturating_sub(held)).unwrap_or(0)
    }

    /// Drops the holders whose lease ran out, reporting the loss to them, and wakes the
    /// front waiter if permits came back.
    fn expire(&mut self, now: Instant) {
        let before = self.holders.len();
        self.holders.retain(|h| {
            let live = h.expires_at > now;
            if !live {
                h.liveness
                    .mark_lost(LossCause::LeaseExpired, "the lease expired");
            }
            live
        });
        if self.holders.len() != before {
            self.wake_front();
        }
    }

    fn is_idle(&self) -> bool {
        self.holders.is_empty() && self.waiters.is_empty()
    }

    fn wake_front(&self) {
        if let Some(front) = self.waiters.front() {
            front.wake.notify_one();
        }
    }
}
