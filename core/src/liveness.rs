//! The shared record of whether a held lock is still safe to use.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use tokio::runtime::Handle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

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
    lost: CancellationToken,
    ended: CancellationToken,
    valid_until: Mutex<Instant>,
    reason: OnceLock<String>,
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
        Liveness {
            inner: Arc::new(Inner {
                lost: CancellationToken::new(),
                ended: CancellationToken::new(),
                valid_until: Mutex::new(valid_until),
                reason: OnceLock::new(),
                at_risk: AtomicBool::new(false),
                driver_started: AtomicBool::new(false),
                runtime: Handle::try_current().ok(),
            }),
        }
    }

    /// The instant until which the lock is guaranteed, on the monotonic clock.
    pub fn valid_until(&self) -> Instant {
        *self
            .inner
            .valid_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the deadline forward after a successful renewal. Ignored when the lock is
    /// already lost (the deadline passed or [`mark_lost`](Self::mark_lost) was called),
    /// and never moves the deadline backwards. Returns whether the deadline was moved.
    pub fn extend(&self, valid_until: Instant) -> bool {
        if self.is_lost() {
            return false;
        }
        let mut current = self
            .inner
            .valid_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if valid_until > *current {
            *current = valid_until;
            true
        } else {
            false
        }
    }

    /// Declares the lock lost. The first reason given is kept. Idempotent.
    pub fn mark_lost(&self, reason: impl Into<String>) {
        let _ = self.inner.reason.set(reason.into());
        self.inner.lost.cancel();
    }

    /// Whether the lock is lost: marked lost, or the deadline has passed.
    pub fn is_lost(&self) -> bool {
        if self.inner.lost.is_cancelled() {
            return true;
        }
        if Instant::now() >= self.valid_until() {
            self.mark_lost("the lease deadline passed without a successful renewal");
            return true;
        }
        false
    }

    /// Why the lock was lost, once it is.
    pub fn lost_reason(&self) -> Option<&str> {
        self.inner.reason.get().map(String::as_str)
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
            if self.is_lost() {
                return;
            }
            let deadline = self.valid_until();
            tokio::select! {
                _ = self.inner.lost.cancelled() => return,
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    /// A token cancelled when the lock is lost, including by deadline.
    ///
    /// The first call starts one small task that watches the deadline until the lock is
    /// lost or the guard ends; outside a Tokio runtime the token fires only when the
    /// backend marks the lock lost.
    pub fn lost_token(&self) -> CancellationToken {
        let token = self.inner.lost.child_token();
        if !self.inner.driver_started.swap(true, Ordering::AcqRel) {
            let runtime = Handle::try_current()
                .ok()
                .or_else(|| self.inner.runtime.clone());
            if let Some(runtime) = runtime {
                let this = self.clone();
                runtime.spawn(async move {
                    tokio::select! {
                        _ = this.lost() => {}
                        _ = this.inner.ended.cancelled() => {}
                    }
                });
            }
        }
        token
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
        self.inner.ended.cancel();
    }

    /// Whether the guard was released or dropped.
    pub fn is_ended(&self) -> bool {
        self.inner.ended.is_cancelled()
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
        self.inner.ended.cancelled().await
    }
}

impl std::fmt::Debug for Liveness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Liveness")
            .field("valid_until", &self.valid_until())
            .field("lost", &self.inner.lost.is_cancelled())
            .field("ended", &self.is_ended())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn deadline_alone_declares_loss() {
        let live = Liveness::new(Instant::now() + Duration::from_secs(10));
        let token = live.lost_token();
        assert!(!live.is_lost());
        let start = Instant::now();
        live.lost().await;
        assert_eq!(start.elapsed(), Duration::from_secs(10));
        tokio::task::yield_now().await;
        assert!(token.is_cancelled());
        assert!(live.lost_reason().unwrap().contains("deadline"));
    }

    #[tokio::test(start_paused = true)]
    async fn extension_postpones_loss_but_not_after_it() {
        let live = Liveness::new(Instant::now() + Duration::from_secs(10));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(live.extend(Instant::now() + Duration::from_secs(10)));
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(!live.is_lost());
        live.mark_lost("key deleted");
        assert!(!live.extend(Instant::now() + Duration::from_secs(100)));
        assert!(live.is_lost());
        assert_eq!(live.lost_reason(), Some("key deleted"));
    }
}
