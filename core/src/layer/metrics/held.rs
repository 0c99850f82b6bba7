//! One grant of the [`Metrics`](super::Metrics) layer: the record of its hold time and
//! loss, and the outer guard's handle that ends it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use metrics::{Label, counter, gauge, histogram};
use tokio::time::Instant;
use tracing::Instrument;

use super::{LOCK_HOLD_SECONDS, LOCK_LOST_TOTAL, LOCKS_HELD};
use crate::{Error, FencingToken, HeldLock, Liveness, LockGuard, LossCause};

/// Wraps a granted guard so its hold time, loss and release are recorded, the loss
/// watched as [`HoldRecord::watch`] says.
pub(super) fn metered(
    name: &str,
    guard: LockGuard,
    backend: &'static str,
    labels: Vec<Label>,
    runtime: Option<&tokio::runtime::Handle>,
) -> LockGuard {
    gauge!(LOCKS_HELD, labels.clone()).increment(1.0);

    let liveness = guard.liveness().clone();
    let record = Arc::new(HoldRecord {
        labels,
        backend,
        name: name.to_owned(),
        token: guard.token().get(),
        acquired_at: Instant::now(),
        releasing: AtomicBool::new(false),
        unheld: AtomicBool::new(false),
        ended: AtomicBool::new(false),
    });
    record.watch(runtime, liveness.clone());
    let held = Arc::new(MeteredHeld {
        held: guard.held().clone(),
        liveness: liveness.clone(),
        guard: Mutex::new(Some(guard)),
        record: record.clone(),
    });
    LockGuard::new(
        name,
        FencingToken::new(held.record.token),
        backend,
        liveness,
        held,
    )
}

/// What is recorded about one grant until it ends.
#[derive(Debug)]
struct HoldRecord {
    labels: Vec<Label>,
    backend: &'static str,
    name: String,
    token: u64,
    acquired_at: Instant,
    /// An explicit release is under way: a loss seen now is judged by its result.
    releasing: AtomicBool,
    /// The gauge was decremented (at loss or end).
    unheld: AtomicBool,
    /// Hold time was recorded (at release or drop).
    ended: AtomicBool,
}

impl HoldRecord {
    /// Watches the grant until it is lost (counted) or ends: on `runtime` (the
    /// layer's), else on the runtime `liveness` was made on (the backend's), else this
    /// acquire's (which may be one the caller enters only now and then); when the one it
    /// runs on ends while the guard is held, on the next of these. With none of them
    /// running nothing watches: the loss is counted when the guard is released or
    /// dropped.
    fn watch(self: &Arc<Self>, runtime: Option<&tokio::runtime::Handle>, liveness: Liveness) {
        let record = self.clone();
        let runtimes = runtime
            .cloned()
            .into_iter()
            .chain(liveness.runtime().cloned())
            .chain(tokio::runtime::Handle::try_current().ok());
        crate::kept::spawn_kept(
            runtimes,
            move || {
                let (record, liveness) = (record.clone(), liveness.clone());
                async move {
                    tokio::select! {
                        biased;
                        _ = liveness.ended() => {}
                        _ = liveness.lost() => {
                            if !record.releasing.load(Ordering::SeqCst) {
                                record.lost_by(&liveness);
                            }
                        }
                    }
                }
            },
            || {},
        );
    }

    /// Counts the loss `liveness` reports.
    fn lost_by(&self, liveness: &Liveness) {
        let cause = liveness.lost_cause().unwrap_or(LossCause::Other);
        self.lost(cause.as_str());
    }

    /// Counts a loss (once) and takes the lock out of the held gauge. (The loss itself
    /// is logged by [`Liveness::mark_lost`], with or without this layer.)
    fn lost(&self, cause: &'static str) {
        if self.unheld.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut labels = self.labels.clone();
        labels.push(Label::new("cause", cause));
        counter!(LOCK_LOST_TOTAL, labels).increment(1);
        gauge!(LOCKS_HELD, self.labels.clone()).decrement(1.0);
    }

    /// Records the hold time and leaves the gauge (once).
    fn end(&self) {
        if self.ended.swap(true, Ordering::SeqCst) {
            return;
        }
        histogram!(LOCK_HOLD_SECONDS, self.labels.clone())
            .record(self.acquired_at.elapsed().as_secs_f64());
        if !self.unheld.swap(true, Ordering::SeqCst) {
            gauge!(LOCKS_HELD, self.labels.clone()).decrement(1.0);
        }
    }
}

/// The outer guard's handle: the inner guard, kept alive (so it does not release on its
/// own), and the record.
#[derive(Debug)]
struct MeteredHeld {
    held: Arc<dyn HeldLock>,
    liveness: Liveness,
    guard: Mutex<Option<LockGuard>>,
    record: Arc<HoldRecord>,
}

impl MeteredHeld {
    /// Counts the loss the guard already reports (once: see [`HoldRecord::lost`]), at
    /// the release or drop that ends the record.
    fn count_loss_seen(&self) {
        if self.liveness.is_lost() {
            self.record.lost_by(&self.liveness);
        }
    }
}

#[async_trait]
impl HeldLock for MeteredHeld {
    async fn release(&self) -> Result<(), Error> {
        let record = &self.record;
        self.count_loss_seen();
        record.releasing.store(true, Ordering::SeqCst);
        let span = tracing::info_span!(
            "fencelock.release",
            backend = record.backend,
            lock = %record.name,
            token = record.token
        );
        // The inner handle's release is idempotent; the inner guard stays in place so a
        // failed release is still retried in the background when this handle is dropped.
        let result = self.held.release().instrument(span).await;
        if let Err(Error::Lost { .. }) = &result {
            record.lost("found_at_release");
        }
        record.end();
        result
    }

    fn release_in_background(&self) {
        // Dropped right after learning of a loss (as `with_lock` does), before this
        // layer's watch ran: the loss is counted here, before `end` takes the lock out
        // of the held gauge (after which a loss is not counted).
        self.count_loss_seen();
        let guard = self
            .guard
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(guard);
        self.record.end();
    }

    fn backend_key(&self) -> Option<&str> {
        self.held.backend_key()
    }

    fn can_extend(&self) -> Result<(), Error> {
        self.held.can_extend()
    }

    fn check_extension(&self, lease: Duration) -> Result<(), Error> {
        self.held.check_extension(lease)
    }

    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        // The inner guard shares this liveness: the outer guard moves it.
        self.held.extend(lease).await
    }
}
