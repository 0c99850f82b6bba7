//! The shared record of whether a held lock is still safe to use.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// [`Inner::state`] bit: the lock was marked lost.
const LOST: u8 = 1;
/// [`Inner::state`] bit: the guard was released or dropped.
const ENDED: u8 = 2;

/// Why a lock was lost: the kind, for code and metrics; the guard's
/// [`lost_reason`](crate::LockGuard::lost_reason) adds the backend's own words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LossCause {
    /// The client's own deadline (`valid_until`) passed without a confirmed renewal: a
    /// partition, a paused process, an unreachable or stalled server.
    LeaseExpired,
    /// The lock's key or node is gone from the server (deleted by someone, or expired
    /// there).
    KeyGone,
    /// Another owner holds the lock's key now.
    TakenOver,
    /// The session (ZooKeeper) or session lease (etcd) ended, expired or was revoked, as
    /// the server said.
    SessionEnded,
    /// The client gave the lock up itself: it was closed, or abandoned a session it could
    /// not clean up.
    ClientClosed,
    /// One leg of the migration layer was lost.
    MigrationLeg,
    /// Anything else (see the reason).
    Other,
}

impl LossCause {
    /// A stable `snake_case` name, for metrics labels and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            LossCause::LeaseExpired => "lease_expired",
            LossCause::KeyGone => "key_gone",
            LossCause::TakenOver => "taken_over",
            LossCause::SessionEnded => "session_ended",
            LossCause::ClientClosed => "client_closed",
            LossCause::MigrationLeg => "migration_leg",
            LossCause::Other => "other",
        }
    }
}

impl std::fmt::Display for LossCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How far past a shared deadline a lock's own cap starts: never in practice.
const NO_CAP: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 24 * 3600);

/// A deadline shared by many locks, for [`Liveness::with_shared_deadline`]: it only
/// moves forward.
#[derive(Clone)]
pub struct SharedDeadline {
    at: Arc<Mutex<Instant>>,
}

impl SharedDeadline {
    /// A deadline at `at`.
    pub fn new(at: Instant) -> Self {
        SharedDeadline {
            at: Arc::new(Mutex::new(at)),
        }
    }

    /// The deadline now.
    pub fn get(&self) -> Instant {
        *self.at.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the deadline to `to` if that is later; returns whether it moved.
    pub fn extend(&self, to: Instant) -> bool {
        let mut at = self.at.lock().unwrap_or_else(PoisonError::into_inner);
        if to > *at {
            *at = to;
            true
        } else {
            false
        }
    }
}

impl std::fmt::Debug for SharedDeadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SharedDeadline").field(&self.get()).finish()
    }
}

/// Whether a held lock is still valid, shared by a backend and the guard it handed out.
///
/// The backend moves the deadline forward after each successful renewal and marks the
/// lock lost when it learns ownership is gone. The guard reads it. Independently of the
/// backend, the lock counts as lost as soon as the monotonic clock reaches
/// [`valid_until`](Self::valid_until): loss is declared at the client's own conservative
/// deadline, never later than the server could have expired the lock, even if the
/// backend's renewal task is stuck or the server is unreachable.
///
/// Loss is final: once lost, the deadline never moves again.
#[derive(Clone)]
pub struct Liveness {
    inner: Arc<Inner>,
}

struct Inner {
    /// [`LOST`] and [`ENDED`]; each is set once and never cleared. Two flags and one
    /// [`Notify`] instead of two cancellation tokens: a token is an allocation of its
    /// own (about 100 bytes each), and a held lock has one `Liveness`.
    state: AtomicU8,
    /// Wakes everything waiting for a change of `state`.
    changed: Notify,
    /// The parent of the tokens [`Liveness::lost_token`] hands out, made on first use
    /// and cancelled when the lock is marked lost.
    lost_token: OnceLock<CancellationToken>,
    /// The deadline; with a shared deadline, this lock's own cap on it until the lock is
    /// lost, and the deadline frozen at the loss afterwards.
    valid_until: Mutex<Instant>,
    shared: Option<SharedDeadline>,
    reason: OnceLock<(LossCause, String)>,
    /// The guard's lock, token and backend, for the loss log line.
    identity: OnceLock<(Arc<str>, u64, &'static str)>,
    at_risk: AtomicBool,
    driver_started: AtomicBool,
    runtime: Option<Handle>,
}

impl Liveness {
    /// A live lock valid until `valid_until` unless renewed.
    ///
    /// Backends compute `valid_until` conservatively: the instant the acquire or renewal
    /// request was *sent*, plus the lease, minus a margin for clock drift.
    pub fn new(valid_until: Instant) -> Self {
        Self::build(valid_until, None)
    }

    fn build(valid_until: Instant, shared: Option<SharedDeadline>) -> Self {
        Liveness {
            inner: Arc::new(Inner {
                state: AtomicU8::new(0),
                changed: Notify::new(),
                lost_token: OnceLock::new(),
                valid_until: Mutex::new(valid_until),
                shared,
                reason: OnceLock::new(),
                identity: OnceLock::new(),
                at_risk: AtomicBool::new(false),
                driver_started: AtomicBool::new(false),
                runtime: Handle::try_current().ok(),
            }),
        }
    }

    /// A live lock whose deadline is `shared`, moved once for every lock that shares it
    /// (for example every lock on one session lease, renewed by one keepalive): renewing
    /// 100,000 locks then costs one update, not 100,000.
    ///
    /// [`extend`](Self::extend) on such a lock moves its own cap, which starts far in the
    /// future: the lock is valid until the earlier of the two. Once the lock is lost, its
    /// deadline is frozen and no longer follows `shared`.
    pub fn with_shared_deadline(shared: SharedDeadline) -> Self {
        Self::build(shared.get() + NO_CAP, Some(shared))
    }

    /// The instant until which the lock is guaranteed, on the monotonic clock.
    pub fn valid_until(&self) -> Instant {
        let own = self.own();
        self.effective(*own)
    }

    fn own(&self) -> std::sync::MutexGuard<'_, Instant> {
        self.inner
            .valid_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The deadline given this lock's own, read under its lock: the LOST bit is set
    /// under that lock too (after the freeze), so a reader sees either the live lock or
    /// the frozen deadline, never the unfrozen cap of a lost one.
    fn effective(&self, own: Instant) -> Instant {
        match &self.inner.shared {
            Some(shared) if !self.has(LOST) => shared.get().min(own),
            _ => own,
        }
    }

    /// Moves the deadline forward after a successful renewal. Ignored when the lock is
    /// already lost (the deadline passed or [`mark_lost`](Self::mark_lost) was called),
    /// and never moves the deadline backwards. Returns whether the deadline was moved.
    pub fn extend(&self, valid_until: Instant) -> bool {
        if self.is_lost() {
            return false;
        }
        let mut current = self.own();
        // Checked again under the lock that marking the loss takes: a loss marked, or a
        // deadline passed, since the check above is never undone.
        if self.has(LOST) || Instant::now() >= self.effective(*current) {
            return false;
        }
        if valid_until > *current {
            *current = valid_until;
            true
        } else {
            false
        }
    }

    /// Sets the deadline after an extension of a fixed lease replaced the server's lease
    /// ([`LockGuard::extend`](crate::LockGuard::extend)): to `valid_until`, the backend's
    /// conservative end of the new lease, **even when it is earlier** than the deadline
    /// it had (which then lay within the drift margin of the new lease's end; renewals
    /// use [`extend`](Self::extend), which never moves back). Wakes everything waiting
    /// for the deadline, so a loss at the earlier one is reported on time (and, when it
    /// moves later, a record following this one checks it again). Ignored when
    /// the lock is already lost (the deadline passed or it was marked lost). Returns
    /// whether the deadline was set.
    pub fn confirm_extension(&self, valid_until: Instant) -> bool {
        if self.is_lost() {
            return false;
        }
        let mut current = self.own();
        if self.has(LOST) || Instant::now() >= self.effective(*current) {
            return false;
        }
        let moved = valid_until != *current;
        *current = valid_until;
        drop(current);
        // Earlier: a loss at the new deadline is reported on time. Later too: a record
        // that follows others (a migration guard) checks it is still below them.
        if moved {
            self.inner.changed.notify_waiters();
        }
        true
    }

    /// Moves the deadline back to `at` if it is later, for a record that follows
    /// others (the migration layer's guard, which is valid until the earlier of its
    /// legs' deadlines, one of which an extension moved back). Wakes everything waiting
    /// for the deadline. Ignored when the lock is already lost. Returns whether the
    /// deadline moved.
    pub(crate) fn lower_to(&self, at: Instant) -> bool {
        if self.is_lost() {
            return false;
        }
        let mut current = self.own();
        if self.has(LOST) || at >= self.effective(*current) {
            return false;
        }
        *current = at;
        drop(current);
        self.inner.changed.notify_waiters();
        true
    }

    /// Completes at the next change a waiter must see: the deadline set by
    /// [`confirm_extension`](Self::confirm_extension) or moved back by
    /// [`lower_to`](Self::lower_to) (not the renewals' [`extend`](Self::extend)), or the
    /// lock marked lost or ended. For a record that
    /// follows this one (the migration layer's guard): pin it and call `enable` on it
    /// *before* reading the deadline, so a change after the read is not missed.
    pub(crate) fn changes(&self) -> tokio::sync::futures::Notified<'_> {
        self.inner.changed.notified()
    }

    /// Names the guard this record belongs to (its lock, token and backend), for the
    /// `warn!` that reports its loss. Set once, by [`LockGuard::new`](crate::LockGuard::new).
    pub fn set_identity(&self, name: &str, token: u64, backend: &'static str) {
        self.set_shared_identity(Arc::from(name), token, backend);
    }

    /// [`set_identity`](Self::set_identity) with the guard's own copy of the name.
    pub(crate) fn set_shared_identity(&self, name: Arc<str>, token: u64, backend: &'static str) {
        let _ = self.inner.identity.set((name, token, backend));
    }

    /// Declares the lock lost. The first cause and reason given are kept. Idempotent.
    ///
    /// The first time, unless the guard already ended, it logs a `tracing` `warn!` with
    /// the lock, token, backend and cause: a lost lock is always visible.
    pub fn mark_lost(&self, cause: LossCause, reason: impl Into<String>) {
        let reason = reason.into();
        if self.inner.reason.set((cause, reason.clone())).is_ok() && !self.is_ended() {
            match self.inner.identity.get() {
                Some((name, token, backend)) => tracing::warn!(
                    lock = %name,
                    token,
                    backend,
                    %cause,
                    reason = %reason,
                    "lock lost while held"
                ),
                None => tracing::warn!(%cause, reason = %reason, "lock lost while held"),
            }
        }
        {
            // Under the deadline's lock: a reader or an extension sees the lock live, or
            // lost with its deadline frozen (a lost lock no longer follows a shared one).
            let mut own = self.own();
            if !self.has(LOST) {
                *own = self.effective(*own);
            }
            self.set(LOST);
        }
        // Pairs with the fence in `lost_token`: either it sees LOST or this sees its parent.
        std::sync::atomic::fence(Ordering::SeqCst);
        if let Some(token) = self.inner.lost_token.get() {
            token.cancel();
        }
    }

    fn has(&self, bit: u8) -> bool {
        self.inner.state.load(Ordering::SeqCst) & bit != 0
    }

    fn set(&self, bit: u8) {
        if self.inner.state.fetch_or(bit, Ordering::SeqCst) & bit == 0 {
            self.inner.changed.notify_waiters();
        }
    }

    /// Completes once `bit` is set.
    async fn wait_for(&self, bit: u8) {
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            // Registered before the check: a `set` after it wakes this waiter.
            changed.as_mut().enable();
            if self.has(bit) {
                return;
            }
            changed.await;
        }
    }

    /// Whether the lock is lost: marked lost, or the deadline has passed.
    pub fn is_lost(&self) -> bool {
        if self.has(LOST) {
            return true;
        }
        if Instant::now() >= self.valid_until() {
            self.mark_lost(
                LossCause::LeaseExpired,
                "the lease deadline passed without a successful renewal",
            );
            return true;
        }
        false
    }

    /// Why the lock was lost, once it is: the backend's words.
    pub fn lost_reason(&self) -> Option<&str> {
        self.inner.reason.get().map(|(_, reason)| reason.as_str())
    }

    /// The kind of loss, once the lock is lost.
    pub fn lost_cause(&self) -> Option<LossCause> {
        self.inner.reason.get().map(|(cause, _)| *cause)
    }

    /// Completes when the lock is lost (marked, or the deadline passed).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping it has no effect.
    ///
    /// # Errors
    ///
    /// None: it only waits.
    pub async fn lost(&self) {
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            // Registered before the checks: a loss marked, or a deadline moved earlier
            // ([`confirm_extension`](Self::confirm_extension)), after them wakes it.
            changed.as_mut().enable();
            if self.is_lost() {
                return;
            }
            let deadline = self.valid_until();
            tokio::select! {
                () = changed => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    /// Completes when the lock is marked lost: by [`mark_lost`](Self::mark_lost), or by a
    /// check that found the deadline passed. Unlike [`lost`](Self::lost) it keeps no
    /// timer of its own, so it suits a backend whose renewal task marks its locks lost at
    /// their shared deadline and that waits on many locks at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping it has no effect.
    ///
    /// # Errors
    ///
    /// None: it only waits.
    pub async fn marked_lost(&self) {
        self.wait_for(LOST).await
    }

    /// A token cancelled when the lock is lost, including by deadline.
    ///
    /// The first call made inside a Tokio runtime (or on a lock whose backend gave one)
    /// starts one small task that watches the deadline until the lock is lost or the
    /// guard ends; until then the token fires only when the backend marks the lock lost.
    /// A watcher runs on the runtime this record was made on (the one the lock was
    /// acquired on) and, when it is another, one on the runtime of the call; when the
    /// runtime of one shuts down first, it goes on on the other. So a token fires at the
    /// deadline while either runtime runs: also when taken inside a temporary runtime (a
    /// `Runtime::new().block_on(...)` that ends), or when one of the two is a runtime
    /// its owner keeps but drives only now and then (a sync wrapper's current-thread
    /// `block_on`). Once neither runs, the next call made where a runtime runs starts
    /// the watchers again.
    pub fn lost_token(&self) -> CancellationToken {
        let parent = self.inner.lost_token.get_or_init(CancellationToken::new);
        std::sync::atomic::fence(Ordering::SeqCst);
        // Marked lost before the parent existed: `mark_lost` found none to cancel.
        if self.has(LOST) {
            parent.cancel();
        }
        let token = parent.child_token();
        self.start_watcher();
        token
    }

    /// Starts the deadline watchers behind [`lost_token`](Self::lost_token) unless they
    /// are running: on the runtime the record was made on and on the current one; a
    /// watcher dropped with its runtime before it fired or saw the end goes on on the
    /// other if that runs (see
    /// [`spawn_kept`](crate::kept::spawn_kept)). Once neither runs (or without any
    /// runtime to watch from), nothing watches and `driver_started` is cleared, so the
    /// next call made where a runtime runs starts another.
    fn start_watcher(&self) {
        if self.inner.driver_started.swap(true, Ordering::AcqRel) {
            return;
        }
        // One watcher on each of the record's runtime (the one the lock was acquired on)
        // and the caller's, when they differ: either may be one its owner keeps but
        // drives only now and then (a sync wrapper's `block_on` on a current-thread
        // runtime), where a parked watcher is not polled, so neither is trusted alone.
        // Each goes on on the other when its own shuts down.
        let mut runtimes: Vec<Handle> = Vec::with_capacity(2);
        for runtime in self
            .inner
            .runtime
            .iter()
            .cloned()
            .chain(Handle::try_current().ok())
        {
            if runtimes.iter().all(|r| r.id() != runtime.id()) {
                runtimes.push(runtime);
            }
        }
        if runtimes.is_empty() {
            self.inner.driver_started.store(false, Ordering::Release);
            return;
        }
        let left = Arc::new(std::sync::atomic::AtomicUsize::new(runtimes.len()));
        for first in 0..runtimes.len() {
            let order = runtimes[first..]
                .iter()
                .chain(&runtimes[..first])
                .cloned()
                .collect::<Vec<_>>();
            let (watched, rearm, left) = (self.clone(), self.clone(), left.clone());
            crate::kept::spawn_kept(
                order,
                move || {
                    let live = watched.clone();
                    async move {
                        tokio::select! {
                            () = live.lost() => {}
                            () = live.wait_for(ENDED) => {}
                        }
                    }
                },
                move || {
                    // The last watcher gone: the next call starts them again.
                    if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                        rearm.inner.driver_started.store(false, Ordering::Release);
                    }
                },
            );
        }
    }

    /// The runtime this record was made on (the backend's, for a record a backend made
    /// while acquiring), if it was made inside one: where the tasks a guard relies on
    /// can go on when the runtime they were started on ends.
    pub(crate) fn runtime(&self) -> Option<&Handle> {
        self.inner.runtime.as_ref()
    }

    /// Marks the connection behind the lock as unreliable (for example a ZooKeeper client
    /// that is disconnected but whose session may still be alive), or clears that mark.
    pub fn set_at_risk(&self, at_risk: bool) {
        self.inner.at_risk.store(at_risk, Ordering::Release);
    }

    /// Whether the backend currently cannot confirm ownership, although the lock is not
    /// (yet) lost.
    pub fn is_at_risk(&self) -> bool {
        self.inner.at_risk.load(Ordering::Acquire) && !self.is_lost()
    }

    /// Records that the guard was released or dropped; stops the deadline watcher.
    pub fn end(&self) {
        self.set(ENDED);
    }

    /// Whether the guard was released or dropped.
    pub fn is_ended(&self) -> bool {
        self.has(ENDED)
    }

    /// Completes when the guard was released or dropped. Backends use it to stop their
    /// per-lock work.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    ///
    /// # Errors
    ///
    /// None: it only waits.
    pub async fn ended(&self) {
        self.wait_for(ENDED).await
    }
}

impl std::fmt::Debug for Liveness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Liveness")
            .field("valid_until", &self.valid_until())
            .field("lost", &self.has(LOST))
            .field("ended", &self.is_ended())
            .finish()
    }
}

#[cfg(test)]
mod tests;
