//! The one renewal scheduler: one task per client (per runtime, for `mem://`) renews
//! every renewing lease it holds, batching whatever the backend can batch.
//!
//! A task and a timer per held lock cost memory and, with 100,000 locks held on a 5 s
//! lease, 60,000 wake-ups a second. Here one task sleeps until the earliest renewal is
//! due, takes every lease due within a quarter of its interval (so that leases due close
//! together are renewed together), and hands them to the backend's [`Renew::renew`] in
//! one call: the backend pipelines them (Redis: one script per node and slot per
//! hundred keys), or renews them one by one (memory: a few hundred per call, see
//! [`Renew::TAKEN_AT_ONCE`]). The backend reports each lease's
//! outcome as soon as it knows it ([`Renewals::renewed`], [`Renewals::failed`],
//! [`Renewals::gone`]).
//!
//! A lease is due a third of its duration after the request that granted (or last
//! renewed) it was *sent*, the instant its deadline counts from. A failed renewal is
//! tried again soon (a tenth of the lease, at least 10 ms), well before the deadline.
//! A lease whose guard is lost at its deadline (renewals were not confirmed in time) is
//! never renewed again: it is handed to [`Renew::abandon`] instead, which frees it on the
//! server.
//!
//! A backend whose renewal of one lease is a long exchange of its own (etcd's keepalive
//! round, awaited until the lease's deadline) [times itself](Renew::TIMES_ITSELF): its
//! `renew` starts each round and returns, and each round says when its lease is due
//! next ([`Renewals::renew_at`]); until then the lease is not handed over again.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::{Liveness, LossCause};

/// How long the task sleeps when nothing is held before it looks again (or ends, see
/// [`Renew::ENDS_WHEN_IDLE`]).
const IDLE: Duration = Duration::from_secs(1);

/// What renewing leases means for one backend. Implemented by the backend's client,
/// which owns its [`Renewals`].
pub trait Renew: Send + Sync + Sized + 'static {
    /// What the backend keeps of one renewing lease (its key and owner, ...).
    type Lease: Send + 'static;
    /// What one renewal of a lease needs (often a cheap copy of [`Self::Lease`]).
    type Due: Send + 'static;

    /// Whether the task ends once nothing is left to renew (a new lease starts another),
    /// or goes on looking every second while the client lives.
    const ENDS_WHEN_IDLE: bool;

    /// Whether the backend times each lease's renewals itself. A lease handed to
    /// [`renew`](Self::renew) is then not due again until the backend says when
    /// ([`Renewals::renew_at`]), however long its renewal takes: etcd's keepalive round
    /// lasts until it is answered or the lease's deadline, and must not be begun a
    /// second time meanwhile. It is handed over at the instant said, not a quarter
    /// interval early as leases are batched otherwise. Otherwise (the default) a lease is
    /// due again an interval after it was handed over, whatever came of it.
    const TIMES_ITSELF: bool = false;

    /// The most leases handed to one [`renew`](Self::renew) call. The scheduler's lock is
    /// held while it takes them, and an acquire that inserts its lease waits behind it:
    /// a backend that renews lease by lease (memory) takes a few hundred at a time, and
    /// the task yields between calls. A backend that plans a whole round (Redis, which
    /// widens its calls in flight to fit the round in a quarter interval) takes every
    /// lease due, the default.
    const TAKEN_AT_ONCE: usize = usize::MAX;

    /// The client's scheduler.
    fn renewals(&self) -> &Renewals<Self>;

    /// Whether the client was closed: the task then ends (closing marked every lock
    /// lost already).
    fn is_closed(&self) -> bool;

    /// What the renewal of `lease`, due now, needs; may update the lease's own state.
    fn due(&self, lease: &mut Self::Lease, now: Instant) -> Self::Due;

    /// Renews every lease of `due`, reporting each one's outcome through
    /// [`Renewals::renewed`], [`Renewals::failed`] or [`Renewals::gone`] as soon as it
    /// is known. A lease not reported is tried again at its next interval.
    fn renew(self: &Arc<Self>, due: Vec<Due<Self::Due>>) -> impl Future<Output = ()> + Send;

    /// A lease whose guard was lost at its deadline before its renewal
    /// ([`LossCause::LeaseExpired`]): it is no longer renewed, and
    /// the backend may free it on the server (a renewal applied but answered late may
    /// have moved its expiry a lease past the loss). The default does nothing.
    fn abandon(self: &Arc<Self>, key: u64, lease: Self::Lease) {
        let _ = (key, lease);
    }
}

/// One lease due for renewal, handed to [`Renew::renew`].
#[derive(Debug)]
pub struct Due<D> {
    /// The key [`Renewals::insert`] returned.
    pub key: u64,
    /// The lease's duration.
    pub lease: Duration,
    /// The guard's record.
    pub liveness: Liveness,
    /// What the backend needs to renew it ([`Renew::due`]).
    pub data: D,
}

struct Entry<L> {
    lease: Duration,
    liveness: Liveness,
    next_due: Instant,
    data: L,
}

struct State<L> {
    last_key: u64,
    entries: HashMap<u64, Entry<L>>,
    /// The keys by the instant each is next due.
    by_due: BTreeMap<(Instant, u64), ()>,
    running: bool,
    /// When the task, asleep, wakes up next: a lease due earlier must wake it.
    wake_at: Option<Instant>,
}

impl<L> Default for State<L> {
    fn default() -> Self {
        State {
            last_key: 0,
            entries: HashMap::new(),
            by_due: BTreeMap::new(),
            running: false,
            wake_at: None,
        }
    }
}

impl<L> State<L> {
    fn schedule(&mut self, key: u64, at: Instant) {
        if let Some(entry) = self.entries.get_mut(&key) {
            self.by_due.remove(&(entry.next_due, key));
            entry.next_due = at;
            self.by_due.insert((at, key), ());
        }
    }
}

/// The renewing leases of one client and its renewal task. See the [module](self) docs.
pub struct Renewals<P: Renew> {
    state: Mutex<State<P::Lease>>,
    wake: Arc<Notify>,
    /// Where the task runs.
    runtime: Handle,
}

impl<P: Renew> std::fmt::Debug for Renewals<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Renewals")
            .field("leases", &self.len())
            .finish_non_exhaustive()
    }
}

impl<P: Renew> Renewals<P> {
    /// A scheduler whose task runs on `runtime`.
    pub fn new(runtime: Handle) -> Self {
        Renewals {
            state: Mutex::default(),
            wake: Arc::default(),
            runtime,
        }
    }

    fn state(&self) -> MutexGuard<'_, State<P::Lease>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Renews `data`, a lease of `lease` granted by a request sent at `sent`, every third
    /// of `lease` until [`remove`](Self::remove)d, found gone (then `liveness` is marked
    /// lost) or lost; starts the task if it is not running. Returns the key to remove it
    /// with.
    pub fn insert(
        client: &Arc<P>,
        data: P::Lease,
        lease: Duration,
        liveness: Liveness,
        sent: Instant,
    ) -> u64 {
        let this = client.renewals();
        let next_due = sent + crate::Lease::Renewing(lease).renew_interval();
        let mut state = this.state();
        state.last_key += 1;
        let key = state.last_key;
        state.entries.insert(
            key,
            Entry {
                lease,
                liveness,
                next_due,
                data,
            },
        );
        state.by_due.insert((next_due, key), ());
        if !std::mem::replace(&mut state.running, true) {
            drop(state);
            // However the task ends (the client closed, a panic, its runtime shutting
            // down, even before it first ran), the next lease starts a new one:
            // `running` never stays set without a task.
            let weak = Arc::downgrade(client);
            let mut running = NotRunning {
                client: weak.clone(),
                armed: true,
            };
            this.runtime.spawn(async move {
                if run(weak).await == Ended::Cleared {
                    running.disarm();
                }
            });
            return key;
        }
        // Woken only if it would sleep past this lease's first renewal.
        let earlier = state.wake_at.is_none_or(|at| next_due < at);
        drop(state);
        if earlier {
            this.wake.notify_one();
        }
        key
    }

    /// Stops renewing `key`. Idempotent; returns whether it was still renewed.
    pub fn remove(&self, key: u64) -> bool {
        let mut state = self.state();
        match state.entries.remove(&key) {
            Some(entry) => {
                state.by_due.remove(&(entry.next_due, key));
                true
            }
            None => false,
        }
    }

    /// Whether `key` is being renewed.
    pub fn contains(&self, key: u64) -> bool {
        self.state().entries.contains_key(&key)
    }

    /// The number of leases being renewed.
    pub fn len(&self) -> usize {
        self.state().entries.len()
    }

    /// Whether no lease is being renewed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether no lease is being renewed and no task runs: nothing refers to this
    /// scheduler's runtime any more.
    pub fn is_idle(&self) -> bool {
        let state = self.state();
        state.entries.is_empty() && !state.running
    }

    /// Wakes the task, so that it sees the client closed and ends.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Reports `due` renewed: its guard is valid until `valid_until` (never moved back).
    pub fn renewed<D>(&self, due: &Due<D>, valid_until: Instant) {
        due.liveness.extend(valid_until);
    }

    /// Schedules `key`'s next renewal at `at`, waking the task if it would sleep past
    /// it; nothing if `key` was removed. A backend that
    /// [times itself](Renew::TIMES_ITSELF) calls it after each renewal, from wherever
    /// the renewal ran.
    pub fn renew_at(&self, key: u64, at: Instant) {
        let mut state = self.state();
        if !state.entries.contains_key(&key) {
            return;
        }
        state.schedule(key, at);
        let earlier = state.wake_at.is_none_or(|wake_at| at < wake_at);
        drop(state);
        if earlier {
            self.wake.notify_one();
        }
    }

    /// Reports the renewal of `due` failed without an answer: it is tried again soon.
    pub fn failed<D>(&self, due: &Due<D>) {
        let at = Instant::now() + (due.lease / 10).max(Duration::from_millis(10));
        self.state().schedule(due.key, at);
    }

    /// Reports `due` gone on the server: its guard is lost, unless it was removed
    /// meanwhile (released: the key is gone because of its own release).
    pub fn gone<D>(&self, due: &Due<D>, reason: &str) {
        if self.remove(due.key) {
            due.liveness.mark_lost(LossCause::KeyGone, reason);
        }
    }

    /// Takes the leases due within a quarter interval (rescheduled an interval from now),
    /// at most [`Renew::TAKEN_AT_ONCE`], and the lost ones, and records when the task
    /// must wake next.
    #[allow(clippy::type_complexity)]
    fn take_due(&self, client: &P) -> (Vec<Due<P::Due>>, Vec<(u64, P::Lease)>, Option<Instant>) {
        let now = Instant::now();
        let mut state = self.state();
        let state = &mut *state;
        let mut due = Vec::new();
        let mut lost = Vec::new();
        let mut later = Vec::new();
        while due.len() < P::TAKEN_AT_ONCE {
            let Some((&(at, key), ())) = state.by_due.first_key_value() else {
                break;
            };
            let Some(entry) = state.entries.get_mut(&key) else {
                state.by_due.remove(&(at, key));
                continue;
            };
            let interval = crate::Lease::Renewing(entry.lease).renew_interval();
            // Taken a quarter interval early, so that leases due close together are
            // renewed together; a backend that times itself is taken when it said (its
            // pause after a failed round is kept).
            let early = if P::TIMES_ITSELF {
                Duration::ZERO
            } else {
                interval / 4
            };
            if at > now + early {
                break;
            }
            state.by_due.remove(&(at, key));
            // Lost at its deadline: renewals stopped being confirmed in time, and one
            // now could extend a lease the guard no longer counts on. (A lease lost for
            // another reason is gone on the server: its renewal says so.)
            if entry.liveness.is_lost()
                && entry.liveness.lost_cause() == Some(LossCause::LeaseExpired)
            {
                if let Some(entry) = state.entries.remove(&key) {
                    lost.push((key, entry.data));
                }
                continue;
            }
            let data = client.due(&mut entry.data, now);
            // A backend that times itself says when it is due next (`renew_at`).
            if !P::TIMES_ITSELF {
                entry.next_due = now + interval;
                later.push((entry.next_due, key));
            }
            due.push(Due {
                key,
                lease: entry.lease,
                liveness: entry.liveness.clone(),
                data,
            });
        }
        for at in later {
            state.by_due.insert(at, ());
        }
        let next = state.by_due.first_key_value().map(|(&(at, _), ())| at);
        state.wake_at = Some(next.unwrap_or(now + IDLE));
        (due, lost, next)
    }

    /// Whether the task may end: nothing to renew, and the backend's tasks end when idle.
    /// Clears `running` under the same lock that saw it empty, so that a lease added after
    /// this starts a new task.
    fn end_if_idle(&self) -> bool {
        let mut state = self.state();
        if P::ENDS_WHEN_IDLE && state.entries.is_empty() {
            state.running = false;
            true
        } else {
            false
        }
    }
}

/// How the renewal task ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// Idle: it cleared `running` itself, and a new task may run already.
    Cleared,
    /// The client is gone or closed.
    Stopped,
}

/// The renewal task of `client`: ends when the client is gone or closed, or (see
/// [`Renew::ENDS_WHEN_IDLE`]) when it has had nothing to renew for [`IDLE`].
async fn run<P: Renew>(client: Weak<P>) -> Ended {
    loop {
        let Some(strong) = client.upgrade() else {
            return Ended::Stopped;
        };
        if strong.is_closed() {
            return Ended::Stopped;
        }
        let renewals = strong.renewals();
        let (due, lost, next) = renewals.take_due(&strong);
        for (key, lease) in lost {
            strong.abandon(key, lease);
        }
        if !due.is_empty() {
            strong.renew(due).await;
            tokio::task::yield_now().await;
            continue;
        }
        let wake = renewals.wake.clone();
        drop(strong);
        tokio::select! {
            () = tokio::time::sleep_until(next.unwrap_or_else(|| Instant::now() + IDLE)) => {
                if next.is_none()
                    && client
                        .upgrade()
                        .is_some_and(|strong| strong.renewals().end_if_idle())
                {
                    return Ended::Cleared;
                }
            }
            () = wake.notified() => {}
        }
    }
}

/// Clears `running` when the renewal task ends, however it ends (unless it cleared it
/// itself).
struct NotRunning<P: Renew> {
    client: Weak<P>,
    armed: bool,
}

impl<P: Renew> NotRunning<P> {
    /// The task cleared `running` itself: a new task may own it already.
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl<P: Renew> Drop for NotRunning<P> {
    fn drop(&mut self) {
        if self.armed {
            if let Some(client) = self.client.upgrade() {
                client.renewals().state().running = false;
            }
        }
    }
}

#[cfg(test)]
mod tests;
