//! The in-memory lock table: holders, FIFO queues and token counter.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::{FencingToken, HolderInfo, Liveness, LockInfo};

/// All locks of one [`MemoryLock`](super::MemoryLock) instance.
#[derive(Debug, Default)]
pub(super) struct Table {
    last_token: u64,
    next_id: u64,
    names: HashMap<Arc<str>, Entry>,
}

#[derive(Debug, Default)]
struct Entry {
    holder: Option<Holder>,
    waiters: VecDeque<Waiter>,
}

#[derive(Debug)]
struct Holder {
    id: u64,
    token: FencingToken,
    expires_at: Instant,
    liveness: Liveness,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    wake: Arc<Notify>,
}

/// What a waiter should do next.
pub(super) enum Attempt {
    /// The lock was granted.
    Granted(FencingToken, Liveness),
    /// Someone else holds it or is ahead in the queue. The waiter is queued; if it is at
    /// the front, it should also wake when the holder's lease runs out.
    Queued { wake_at: Option<Instant> },
    /// Held, and the caller did not want to wait; nothing was queued.
    Contended,
}

/// Result of a renewal.
pub(super) enum Renewal {
    Renewed,
    Gone,
}

impl Table {
    pub(super) fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Tries to take `name` for waiter `id` at `now` with a lease of `lease`.
    pub(super) fn attempt(
        &mut self,
        name: &Arc<str>,
        id: u64,
        wake: &Arc<Notify>,
        lease: std::time::Duration,
        queue: bool,
    ) -> Attempt {
        let now = Instant::now();
        let entry = self.names.entry(name.clone()).or_default();
        entry.expire(now);
        let at_front = entry.waiters.front().is_some_and(|w| w.id == id);
        if entry.holder.is_none() && (entry.waiters.is_empty() || at_front) {
            if at_front {
                entry.waiters.pop_front();
            }
            self.last_token += 1;
            let token = FencingToken::new(self.last_token);
            let expires_at = now + lease;
            let liveness = Liveness::new(expires_at);
            entry.holder = Some(Holder {
                id,
                token,
                expires_at,
                liveness: liveness.clone(),
            });
            return Attempt::Granted(token, liveness);
        }
        if !queue {
            return Attempt::Contended;
        }
        if !entry.waiters.iter().any(|w| w.id == id) {
            entry.waiters.push_back(Waiter {
                id,
                wake: wake.clone(),
            });
        }
        let at_front = entry.waiters.front().is_some_and(|w| w.id == id);
        Attempt::Queued {
            wake_at: at_front
                .then(|| entry.holder.as_ref().map(|h| h.expires_at))
                .flatten(),
        }
    }

    /// Removes waiter `id` (cancelled or timed out) and passes the turn on if it had it.
    pub(super) fn leave(&mut self, name: &str, id: u64) {
        let Some(entry) = self.names.get_mut(name) else {
            return;
        };
        let was_front = entry.waiters.front().is_some_and(|w| w.id == id);
        entry.waiters.retain(|w| w.id != id);
        if was_front {
            entry.expire(Instant::now());
            if entry.holder.is_none() {
                entry.wake_front();
            }
        }
        self.forget_if_idle(name);
    }

    /// Extends holder `id`'s lease, if it still holds and has not expired.
    pub(super) fn renew(&mut self, name: &str, id: u64, lease: std::time::Duration) -> Renewal {
        let now = Instant::now();
        let Some(entry) = self.names.get_mut(name) else {
            return Renewal::Gone;
        };
        entry.expire(now);
        match &mut entry.holder {
            Some(holder) if holder.id == id => {
                holder.expires_at = now + lease;
                holder.liveness.extend(holder.expires_at);
                Renewal::Renewed
            }
            _ => {
                self.forget_if_idle(name);
                Renewal::Gone
            }
        }
    }

    /// Releases holder `id`. Returns whether it still held the lock.
    pub(super) fn release(&mut self, name: &str, id: u64) -> bool {
        let Some(entry) = self.names.get_mut(name) else {
            return false;
        };
        entry.expire(Instant::now());
        let held = entry.holder.as_ref().is_some_and(|h| h.id == id);
        if held {
            entry.holder = None;
            entry.wake_front();
        }
        self.forget_if_idle(name);
        held
    }

    /// Takes the lock away from its holder, whoever it is.
    pub(super) fn revoke(&mut self, name: &str) -> bool {
        let Some(entry) = self.names.get_mut(name) else {
            return false;
        };
        let Some(holder) = entry.holder.take() else {
            return false;
        };
        holder.liveness.mark_lost("the lock was revoked");
        entry.wake_front();
        self.forget_if_idle(name);
        true
    }

    pub(super) fn inspect(&mut self, name: &str, instance: u64) -> LockInfo {
        let now = Instant::now();
        let Some(entry) = self.names.get_mut(name) else {
            return LockInfo::free(Some(0));
        };
        entry.expire(now);
        let waiters = Some(entry.waiters.len());
        match &entry.holder {
            Some(h) => LockInfo::held(
                HolderInfo::new(
                    format!("mem-{instance}/{}", h.id),
                    h.token,
                    Some(h.expires_at - now),
                ),
                waiters,
            ),
            None => LockInfo::free(waiters),
        }
    }

    /// Names with a holder or a waiter.
    pub(super) fn active_names(&self) -> usize {
        self.names.len()
    }

    fn forget_if_idle(&mut self, name: &str) {
        if self
            .names
            .get(name)
            .is_some_and(|e| e.holder.is_none() && e.waiters.is_empty())
        {
            self.names.remove(name);
        }
    }
}

impl Entry {
    /// Drops a holder whose lease has run out, reporting the loss to it.
    fn expire(&mut self, now: Instant) {
        if self.holder.as_ref().is_some_and(|h| h.expires_at <= now) {
            if let Some(holder) = self.holder.take() {
                holder.liveness.mark_lost("the lease expired");
            }
        }
    }

    fn wake_front(&self) {
        if let Some(front) = self.waiters.front() {
            front.wake.notify_one();
        }
    }
}
