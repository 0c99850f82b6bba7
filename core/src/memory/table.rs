//! The in-memory lock table: holders, FIFO queues and token counter.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::Client;
use crate::{
    FencingToken, HolderInfo, Leader, LeaderChange, ListedLock, Liveness, LockInfo, LossCause,
};

/// All locks of one [`MemoryLock`](super::MemoryLock) instance.
///
/// Holders are expired lazily, so the table keeps one invariant that makes expiry
/// observable without polling: the waiter at the front of a queue always has a
/// wake-up armed for the current holder's expiry (its [`Attempt::Queued`] `wake_at`).
/// Whenever the front changes (a grant takes it off the queue, or it leaves) or the
/// holder goes away (release, revoke, expiry), the front waiter is woken, tries again and
/// re-arms for whoever holds the lock now.
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
    /// Observers of the name as an election, told of every change of holder.
    observers: Vec<mpsc::UnboundedSender<LeaderChange>>,
}

#[derive(Debug)]
struct Holder {
    id: u64,
    /// The client (`MemoryLock` handle) it was granted through.
    client: u64,
    /// The value it campaigned with (`None`: a plain lock).
    value: Option<Arc<str>>,
    token: FencingToken,
    expires_at: Instant,
    liveness: Liveness,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    client: u64,
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
    /// The waiter's client was closed; nothing was queued.
    Closed,
}

/// Result of a renewal.
pub(super) enum Renewal {
    Renewed,
    Gone,
}

impl Table {
    /// A fresh id for one acquire: its place in a queue and, once granted, its holder id.
    pub(super) fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Tries to take `name` for waiter `id` at `now` with a lease of `lease`.
    pub(super) fn attempt(
        &mut self,
        name: &Arc<str>,
        (id, client): (u64, &Client),
        value: Option<&Arc<str>>,
        wake: &Arc<Notify>,
        lease: std::time::Duration,
        queue: bool,
    ) -> Attempt {
        // Read under the table's lock, as `close_client` sets it: a waiter queued before
        // the close is swept by it, and none is queued after.
        if client.closed.is_cancelled() {
            return Attempt::Closed;
        }
        let now = Instant::now();
        let entry = self.names.entry(name.clone()).or_default();
        entry.expire(now);
        let at_front = entry.waiters.front().is_some_and(|w| w.id == id);
        if entry.holder.is_none() && (entry.waiters.is_empty() || at_front) {
            if at_front {
                entry.waiters.pop_front();
                // The next waiter is now at the front, but it queued behind us with no
                // wake-up for a holder's expiry: wake it, so it re-arms for ours.
                entry.wake_front();
            }
            self.last_token += 1;
            let token = FencingToken::new(self.last_token);
            let expires_at = now + lease;
            let liveness = Liveness::new(expires_at);
            entry.holder = Some(Holder {
                id,
                client: client.id,
                value: value.cloned(),
                token,
                expires_at,
                liveness: liveness.clone(),
            });
            entry.announce();
            return Attempt::Granted(token, liveness);
        }
        if !queue {
            return Attempt::Contended;
        }
        if !entry.waiters.iter().any(|w| w.id == id) {
            entry.waiters.push_back(Waiter {
                id,
                client: client.id,
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
    ///
    /// The new front waiter is woken whether or not the lock is held: if it is free, to
    /// take it; if it is held, to arm a wake-up for the holder's expiry, which only the
    /// front waiter has.
    pub(super) fn leave(&mut self, name: &str, id: u64) {
        let Some(entry) = self.names.get_mut(name) else {
            return;
        };
        let was_front = entry.waiters.front().is_some_and(|w| w.id == id);
        entry.waiters.retain(|w| w.id != id);
        if was_front {
            entry.expire(Instant::now());
            entry.wake_front();
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
                holder.expires_at = holder.expires_at.max(now + lease);
                holder.liveness.extend(holder.expires_at);
                if holder.liveness.is_lost() {
                    // Its deadline passed between our look at the clock and the guard's
                    // (a starved renewal), or it was marked lost: the guard counts the
                    // lock lost, so the table must not keep it held.
                    entry.holder = None;
                    entry.announce();
                    entry.wake_front();
                    self.forget_if_idle(name);
                    return Renewal::Gone;
                }
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
            entry.announce();
            entry.wake_front();
        }
        self.forget_if_idle(name);
        held
    }

    /// Takes the lock away from its holder, whoever it is, and says who that was; a
    /// holder whose lease already ran out no longer holds it and is not revoked.
    pub(super) fn revoke(&mut self, name: &str, instance: u64) -> Option<HolderInfo> {
        let entry = self.names.get_mut(name)?;
        let now = Instant::now();
        entry.expire(now);
        let revoked = entry.holder.take().map(|holder| {
            holder
                .liveness
                .mark_lost(LossCause::KeyGone, "the lock was revoked");
            entry.announce();
            entry.wake_front();
            holder.info(instance, now)
        });
        self.forget_if_idle(name);
        revoked
    }

    /// Closes `client`: every lock granted through it is lost and passed on, every
    /// waiter of it is taken off its queue and woken (to find [`Attempt::Closed`]), and
    /// it is granted nothing more.
    pub(super) fn close_client(&mut self, client: &Client) {
        let now = Instant::now();
        self.names.retain(|_, entry| {
            entry.expire(now);
            if entry.holder.as_ref().is_some_and(|h| h.client == client.id) {
                if let Some(holder) = entry.holder.take() {
                    holder
                        .liveness
                        .mark_lost(LossCause::ClientClosed, "the lock client was closed");
                    entry.announce();
                }
            }
            let front = entry.waiters.front().map(|w| w.id);
            entry.waiters.retain(|w| {
                let ours = w.client == client.id;
                if ours {
                    w.wake.notify_one();
                }
                !ours
            });
            if entry.holder.is_none() || entry.waiters.front().map(|w| w.id) != front {
                entry.wake_front();
            }
            !entry.is_idle()
        });
        // Last, still under the table's lock (so nothing is granted to it after): an
        // observation of this client ends on this cancel, and must find the ends of
        // this client's own terms, told above, already queued before its `Closed`.
        client.closed.cancel();
    }

    /// The names starting with `prefix` that are held or waited for, sorted, with what
    /// [`Table::inspect`] would say of each.
    pub(super) fn list(&mut self, prefix: &str, instance: u64) -> Vec<ListedLock> {
        let now = Instant::now();
        let mut found: Vec<ListedLock> = Vec::new();
        self.names.retain(|name, entry| {
            if !name.starts_with(prefix) {
                return true;
            }
            entry.expire(now);
            if entry.is_idle() {
                return false;
            }
            if entry.holder.is_none() && entry.waiters.is_empty() {
                // Only observed.
                return true;
            }
            found.push(ListedLock::new(name.as_ref(), entry.info(instance, now)));
            true
        });
        found.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        found
    }

    /// What `name` looks like now: its live holder, if any, and how many wait.
    pub(super) fn inspect(&mut self, name: &str, instance: u64) -> LockInfo {
        let now = Instant::now();
        let Some(entry) = self.names.get_mut(name) else {
            return LockInfo::free(Some(0));
        };
        entry.expire(now);
        let info = entry.info(instance, now);
        self.forget_if_idle(name);
        info
    }

    /// The leader of election `name` now.
    pub(super) fn leader(&mut self, name: &str) -> Option<Leader> {
        let entry = self.names.get_mut(name)?;
        entry.expire(Instant::now());
        let leader = entry.leader();
        self.forget_if_idle(name);
        leader
    }

    /// When the lease of `name`'s holder ends as things stand (a renewal moves it).
    pub(super) fn expiry_of(&self, name: &str) -> Option<Instant> {
        self.names.get(name)?.holder.as_ref().map(|h| h.expires_at)
    }

    /// Starts telling `observer` of every change of `name`'s holder, the current one
    /// first.
    pub(super) fn observe(
        &mut self,
        name: &Arc<str>,
        observer: mpsc::UnboundedSender<LeaderChange>,
    ) {
        let entry = self.names.entry(name.clone()).or_default();
        entry.expire(Instant::now());
        if observer.send(Ok(entry.leader())).is_ok() {
            entry.observers.push(observer);
        }
        self.forget_if_idle(name);
    }

    /// Names with a live holder or a waiter. Expires the holders whose lease ran out
    /// (serving their waiters) and forgets the names left idle, so a leaked guard's
    /// expired grant is not counted.
    pub(super) fn active_names(&mut self) -> usize {
        let now = Instant::now();
        self.names.retain(|_, entry| {
            entry.expire(now);
            !entry.is_idle()
        });
        // A name only observed is kept for its observers, but nobody holds or awaits it.
        self.names
            .values()
            .filter(|entry| entry.holder.is_some() || !entry.waiters.is_empty())
            .count()
    }

    /// An observation of `name` ended: its entry goes if nothing else keeps it.
    pub(super) fn unobserve(&mut self, name: &str) {
        if let Some(entry) = self.names.get_mut(name) {
            entry.observers.retain(|observer| !observer.is_closed());
        }
        self.forget_if_idle(name);
    }

    /// How many names have an entry (held, awaited, observed, or not yet forgotten).
    #[cfg(test)]
    pub(super) fn entries(&self) -> usize {
        self.names.len()
    }

    /// Removes `name`'s entry if nobody holds it and nobody waits.
    fn forget_if_idle(&mut self, name: &str) {
        if self.names.get(name).is_some_and(Entry::is_idle) {
            self.names.remove(name);
        }
    }
}

impl Holder {
    /// How [`Table::inspect`] describes this holder at `now`.
    fn info(&self, instance: u64, now: Instant) -> HolderInfo {
        HolderInfo::new(
            format!("mem-{instance}/{}", self.id),
            self.token,
            Some(self.expires_at.saturating_duration_since(now)),
        )
    }
}

impl Entry {
    /// Its live holder (call [`Entry::expire`] first) and how many wait.
    fn info(&self, instance: u64, now: Instant) -> LockInfo {
        let waiters = Some(self.waiters.len());
        match &self.holder {
            Some(h) => LockInfo::held(h.info(instance, now), waiters),
            None => LockInfo::free(waiters),
        }
    }

    /// Drops a holder whose lease has run out, reporting the loss to it, and wakes the
    /// front waiter to take the lock. Whatever path notices the expiry first (an attempt,
    /// a renewal, a release, a revoke, an inspection), the turn is passed on.
    fn expire(&mut self, now: Instant) {
        if self.holder.as_ref().is_some_and(|h| h.expires_at <= now) {
            if let Some(holder) = self.holder.take() {
                holder
                    .liveness
                    .mark_lost(LossCause::LeaseExpired, "the lease expired");
                self.announce();
                self.wake_front();
            }
        }
    }

    /// Whether nobody holds the lock, waits for it or observes it.
    fn is_idle(&self) -> bool {
        self.holder.is_none()
            && self.waiters.is_empty()
            && self.observers.iter().all(mpsc::UnboundedSender::is_closed)
    }

    /// The leader, if the name is held: the holder's value (empty for a plain lock).
    fn leader(&self) -> Option<Leader> {
        self.holder
            .as_ref()
            .map(|h| Leader::new(h.value.as_deref().unwrap_or_default(), h.token))
    }

    /// Tells every observer the holder now, dropping those that stopped observing.
    fn announce(&mut self) {
        let leader = self.leader();
        self.observers
            .retain(|observer| observer.send(Ok(leader.clone())).is_ok());
    }

    /// Wakes the waiter at the front of the queue, if any. A waiter that is not waiting
    /// at this moment keeps the wake-up (a stored permit) and tries again at once.
    fn wake_front(&self) {
        if let Some(front) = self.waiters.front() {
            front.wake.notify_one();
        }
    }
}
