//! Waiting between a refused try and the next, for a lock and for a semaphore or
//! read-write lock alike: on the name's unlock channel (pub/sub), with the caller's
//! pause (the holder's remaining lease, or less) as the longest sleep, so a missed
//! message costs at most that pause.

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::{Error, WaitDeadline};
use futures_util::future::join_all;
use tokio::sync::Notify;

use crate::engine::Engine;
use crate::subscriber::Subscription;

/// What [`Waiting::before_next_try`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Waited {
    /// Subscribed to the channel, without waiting: try again at once.
    Subscribed,
    /// Slept until a message came or the pause ended.
    Slept,
}

/// One request's subscriptions to its name's unlock channel, kept while it waits.
pub(crate) struct Waiting {
    wake: Arc<Notify>,
    subscriptions: Vec<Subscription>,
}

impl Waiting {
    pub(crate) fn new() -> Self {
        Waiting {
            wake: Arc::new(Notify::new()),
            subscriptions: Vec::new(),
        }
    }

    /// Called after a refused try, before the next one. The first time, subscribes to
    /// `channel` on every subscriber serving `slot` and returns at once: a release
    /// between the refused try and the subscription is seen by the try that follows.
    /// After that, sleeps until a message on the channel or for `pause`.
    ///
    /// # Cancel safety
    ///
    /// Dropped while subscribing, the subscriptions made so far end with it; dropped
    /// while sleeping, nothing is lost (the subscriptions stay with `self`).
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] for `name` once `wait` is over.
    pub(crate) async fn before_next_try(
        &mut self,
        engine: &Engine,
        (slot, channel): (u16, &str),
        pause: Duration,
        wait: &WaitDeadline,
        name: &str,
    ) -> Result<Waited, Error> {
        if self.subscriptions.is_empty() {
            let subscribing = join_all(
                engine
                    .subscribers_for(slot)
                    .iter()
                    .map(|s| s.subscribe(channel, self.wake.clone())),
            );
            tokio::select! {
                subscribed = subscribing => self.subscriptions = subscribed,
                () = wait.over() => return Err(wait.timed_out(name)),
            }
            return Ok(Waited::Subscribed);
        }
        tokio::select! {
            () = self.wake.notified() => {}
            () = tokio::time::sleep(pause) => {}
            () = wait.over() => return Err(wait.timed_out(name)),
        }
        Ok(Waited::Slept)
    }
}
