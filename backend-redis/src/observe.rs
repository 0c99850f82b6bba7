//! Observing an election: the task that follows the election channel and reads the
//! name again on each message and at its holder's expiry (see the [`election`](crate::election)
//! module's documentation).

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::{Error, LeaderChange, LeaderChanges};
use futures_util::future::join_all;
use tokio::sync::Notify;
use tokio::sync::mpsc::UnboundedSender;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::election::{Holder, Reading, reading};
use crate::engine::Engine;
use crate::error::BACKEND;
use crate::keys::LockKeys;
use crate::subscriber::Subscription;

/// Subscribes to the election channel of `keys` on every node, then reads the leader
/// once and follows the channel in a task (see [`follow`]).
///
/// # Errors
///
/// As the first read's (an unanswered quorum, a refused script).
pub(crate) async fn start(engine: &Arc<Engine>, keys: LockKeys) -> Result<LeaderChanges, Error> {
    let wake = Arc::new(Notify::new());
    // Subscribed before the first read: a change after the read is a message.
    let subscriptions = join_all(
        engine
            .subscribers_for(keys.slot)
            .iter()
            .map(|s| s.subscribe(&keys.election, wake.clone())),
    )
    .await;
    let first = reading(engine, &keys).await?;
    let (changes, receiver) = tokio::sync::mpsc::unbounded_channel();
    let _ = changes.send(Ok(first.leader()));
    let stop = engine.closed.child_token();
    engine.runtime.spawn(follow(
        engine.clone(),
        keys,
        subscriptions,
        wake,
        first,
        changes,
        stop.clone(),
        engine.closed.clone(),
    ));
    Ok(LeaderChanges::new(receiver, stop))
}

/// The first delay after a failed read, doubled up to [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(100);

/// The longest delay between reads while they fail.
const RETRY_MAX: Duration = Duration::from_secs(2);

/// When an observer must read again unless a message comes first: just after the
/// holder's key expires.
pub(crate) fn expiry(holder: Option<&Holder>) -> Option<Instant> {
    holder
        .and_then(|h| h.remaining)
        .map(|r| Instant::now() + r + Duration::from_millis(1))
}

/// Follows `keys`' election, sending each change of leader to `changes`, until `stop`
/// is cancelled (the [`LeaderChanges`](fencelock_core::LeaderChanges) was dropped, or the
/// client closed: then the last item is [`Error::Closed`]) or nobody listens. `wake` is
/// notified by `subscriptions` (the election channel on every node); `first` is what the
/// first read found (and reported). A read that fails retryably, or that decides nothing
/// (Redlock: too few instances answered to tell), is tried again after a bounded
/// backoff; one that fails otherwise (an ACL refusal) ends the observation with its
/// error.
///
/// Only confirmed leaders are reported (see [`decide`]): a term found unconfirmed (a
/// Redlock grant being made) is not reported, and the observer reads again when the
/// confirmation is published (or at that key's expiry, if its candidate gave up). A
/// leader is reported only with a token larger than every leader reported before, so
/// no term is reported twice: a term seen again after a read that found nobody is not
/// reported again.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn follow(
    engine: Arc<Engine>,
    keys: LockKeys,
    subscriptions: Vec<Subscription>,
    wake: Arc<Notify>,
    first: Reading,
    changes: UnboundedSender<LeaderChange>,
    stop: CancellationToken,
    closed: CancellationToken,
) {
    let _subscriptions = subscriptions;
    let mut backoff = RETRY_MIN;
    let mut deadline = next_read(&first, &mut backoff);
    let mut last = first.leader();
    let mut highest = last.as_ref().map(|l| l.token);
    loop {
        tokio::select! {
            biased;
            () = stop.cancelled() => {
                if closed.is_cancelled() {
                    let _ = changes.send(Err(Error::Closed { backend: BACKEND }));
                }
                return;
            }
            () = changes.closed() => return,
            () = wake.notified() => {}
            () = sleep_until(deadline) => {}
        }
        match reading(&engine, &keys).await {
            Ok(reading) => {
                deadline = next_read(&reading, &mut backoff);
                let now = match &reading {
                    Reading::Held(holder) if holder.confirmed => holder.leader(),
                    // A grant being made, or a read that could not tell: nothing to
                    // report yet.
                    Reading::Held(_) | Reading::Undecided => continue,
                    Reading::Free => None,
                };
                if now == last {
                    continue;
                }
                if let Some(leader) = &now {
                    if highest.is_some_and(|h| leader.token <= h) {
                        // Reported already (or older than what was): never twice.
                        continue;
                    }
                    highest = Some(leader.token);
                }
                last.clone_from(&now);
                if changes.send(Ok(now)).is_err() {
                    return;
                }
            }
            Err(error) if error.is_retryable() => {
                tracing::debug!(%error, "redis election read failed; retrying");
                deadline = Some(Instant::now() + backoff);
                backoff = backoff.saturating_mul(2).min(RETRY_MAX);
            }
            Err(error) => {
                let _ = changes.send(Err(error));
                return;
            }
        }
    }
}

/// When to read again after `reading` unless a message comes first: at the holder's
/// expiry; after `backoff` (then doubled) when the read decided nothing.
fn next_read(reading: &Reading, backoff: &mut Duration) -> Option<Instant> {
    match reading {
        Reading::Held(holder) => {
            *backoff = RETRY_MIN;
            expiry(Some(holder))
        }
        Reading::Free => {
            *backoff = RETRY_MIN;
            None
        }
        Reading::Undecided => {
            let at = Instant::now() + *backoff;
            *backoff = backoff.saturating_mul(2).min(RETRY_MAX);
            Some(at)
        }
    }
}

/// Sleeps until `at`; forever when there is no deadline.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
