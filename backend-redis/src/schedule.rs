//! The renewal registry of a client: which held locks renew, and when each is due. The
//! renewal task ([`crate::renewal`]) takes the due ones from it.

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use fencelock_core::Liveness;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::keys::LockKeys;

/// The held locks of one client that need renewing.
#[derive(Default)]
pub(crate) struct Renewals {
    state: Mutex<State>,
    wake: Arc<Notify>,
    /// Renewal calls in flight at once in the next round, less one (see
    /// [`MAX_IN_FLIGHT`](crate::renewal::MAX_IN_FLIGHT)).
    pub(crate) widen: AtomicUsize,
}

#[derive(Default)]
struct State {
    entries: HashMap<u64, Entry>,
    running: bool,
    /// When the task, asleep, wakes up next: a new lock due earlier must wake it.
    wake_at: Option<Instant>,
}

/// How long the task sleeps when nothing is held before it looks again (and notices a
/// client that is gone). It does not stop in between, so that locking one name after
/// another costs no task start and no wake-up per lock.
const IDLE: Duration = Duration::from_secs(1);

struct Entry {
    /// Shared with the guard: the lock key and its slot, not a copy of the key.
    keys: LockKeys,
    owner: String,
    lease: Duration,
    liveness: Liveness,
    next_due: Instant,
    /// The TTL of the name's counter, in ms ([`Engine::counter_ttl`](crate::engine::Engine::counter_ttl)), and when the
    /// renewal next raises the counter's TTL back to it: every quarter of it, so that a
    /// lock held longer than `token_ttl` keeps its counter even if a renewal or two in
    /// between fail.
    counter_ttl: u64,
    counter_due: Instant,
}

/// One lock of a batch.
pub(crate) struct Due {
    pub(crate) id: u64,
    pub(crate) keys: LockKeys,
    pub(crate) owner: String,
    pub(crate) lease: Duration,
    pub(crate) liveness: Liveness,
    /// The counter's TTL in ms when this renewal refreshes it.
    pub(crate) counter_ttl: Option<u64>,
}

impl Renewals {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers lock `id`, granted by a request sent at `sent`, for renewal every third
    /// of `lease`, its counter's TTL (`counter_ttl` ms) refreshed every quarter of it.
    /// Returns whether no renewal task is running: the caller then starts one (see
    /// [`renewal::start`](crate::renewal::start)), and this registry counts it running
    /// until [`stopped`](Self::stopped).
    ///
    /// The first renewal is due a third of the lease after `sent`, the instant the
    /// lock's deadline counts from, not after the grant arrived: on a slow link (or
    /// with a Redlock instance that made the grant wait) counting from the arrival
    /// would leave less than the renewal's round trip before the deadline.
    #[allow(clippy::too_many_arguments)]
    #[must_use]
    pub(crate) fn insert(
        &self,
        id: u64,
        keys: LockKeys,
        owner: String,
        lease: Duration,
        liveness: Liveness,
        sent: Instant,
        counter_ttl: u64,
    ) -> bool {
        let next_due = sent + lease / 3;
        let counter_due = sent + Duration::from_millis(counter_ttl / 4);
        let mut state = self.state();
        state.entries.insert(
            id,
            Entry {
                keys,
                owner,
                lease,
                liveness,
                next_due,
                counter_ttl,
                counter_due,
            },
        );
        if !state.running {
            state.running = true;
            return true;
        }
        // Wake the task only if it would sleep past this lock's first renewal.
        let earlier = state.wake_at.is_none_or(|at| next_due < at);
        drop(state);
        if earlier {
            self.wake.notify_one();
        }
        false
    }

    /// Records that the renewal task ended: the next [`insert`](Self::insert) starts one.
    pub(crate) fn stopped(&self) {
        self.state().running = false;
    }

    /// What wakes the task before its next due renewal.
    pub(crate) fn wake(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// Stops renewing lock `id`. Idempotent; returns whether it was still renewed.
    pub(crate) fn remove(&self, id: u64) -> bool {
        self.state().entries.remove(&id).is_some()
    }

    /// Whether lock `id` is being renewed (a renewing lease not yet released or lost).
    pub(crate) fn contains(&self, id: u64) -> bool {
        self.state().entries.contains_key(&id)
    }

    /// Wakes the task so that it sees the client closed and ends.
    pub(crate) fn wake_to_stop(&self) {
        self.wake.notify_one();
    }

    /// The number of locks being renewed.
    pub(crate) fn len(&self) -> usize {
        self.state().entries.len()
    }

    /// Takes the locks due now (or within a quarter interval, to batch them) and the
    /// instant the task must wake next (in [`IDLE`] when nothing is held), which it
    /// records as the task's wake-up time.
    ///
    /// Also takes the locks counted lost (their deadline passed), which are never renewed
    /// again (no zombie renewals), into `lost`.
    pub(crate) fn take_due(&self, lost: &mut Vec<(u64, LockKeys, String)>) -> (Vec<Due>, Instant) {
        let mut state = self.state();
        state.entries.retain(|id, e| {
            let live = !e.liveness.is_lost();
            if !live {
                lost.push((*id, e.keys.clone(), std::mem::take(&mut e.owner)));
            }
            live
        });
        let now = Instant::now();
        let mut due = Vec::new();
        let mut next = now
            + if state.entries.is_empty() {
                IDLE
            } else {
                Duration::from_secs(3600)
            };
        for (id, entry) in &mut state.entries {
            let interval = entry.lease / 3;
            if entry.next_due <= now + interval / 4 {
                entry.next_due = now + interval;
                let counter_ttl = (entry.counter_due <= now).then(|| {
                    entry.counter_due = now + Duration::from_millis(entry.counter_ttl / 4);
                    entry.counter_ttl
                });
                due.push(Due {
                    id: *id,
                    keys: entry.keys.clone(),
                    owner: entry.owner.clone(),
                    lease: entry.lease,
                    liveness: entry.liveness.clone(),
                    counter_ttl,
                });
            }
            next = next.min(entry.next_due);
        }
        state.wake_at = Some(next);
        (due, next)
    }

    /// Retries a failed renewal soon, well before the deadline.
    pub(crate) fn retry_soon(&self, id: u64) {
        if let Some(entry) = self.state().entries.get_mut(&id) {
            entry.next_due = Instant::now() + (entry.lease / 10).max(Duration::from_millis(10));
        }
    }
}
