//! Leader election over Redis: a campaign is the lock of the same name, taken with the
//! leader's value, and observers follow the election channel.
//!
//! # Layout
//!
//! A campaign's grant stores its term in the lock key itself: the acquire script sets the
//! key to the owner (`SET NX PX`, as for a lock), issues the token, and rewrites the key
//! to `owner \n token \n value` keeping its expiry. The value therefore has no key of its
//! own to keep consistent: it is renewed, expires and is deleted with the lock key, and
//! one read of that key (with its `PTTL`) gives holder, value, token and remaining lease
//! together. Release and renewal compare the owner line (the value up to the first
//! newline), so a term is released and renewed exactly like a lock.
//!
//! # Observing
//!
//! The grant of a term, and its release or revocation, publish on the election channel
//! (in the lock key's slot). An observer subscribes to it through the client's shared
//! pub/sub connection before its first read, and reads the holder again on every message.
//! A lease that runs out publishes nothing in Redis, so the observer also reads again when
//! the holder's key expires: it sleeps until the remaining lease (`PTTL`) of the read,
//! which is a deadline, not polling (a renewed leader costs one read per lease). When the pub/sub connection was lost, its
//! reconnection wakes the observer too, since messages may have been missed.
//!
//! Plain locks publish nothing on the election channel (their scripts stay as cheap as a
//! hand-written lock's): an observer reports a plain lock's holder only when it reads for
//! another reason (first read, a campaign's message, its `PTTL` deadline, a
//! reconnection), and is not told when a plain lock takes a free name.
//!
//! Redis keeps no history of the key: a term that begins and ends between two reads of an
//! observer (shorter than one round trip) is not reported; every term an observer reports
//! is reported in the order of the terms, with its value and token, and "nobody leads" is
//! reported when a read finds the name free.

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::{Error, FencingToken, Leader, LeaderChange};
use tokio::sync::Notify;
use tokio::sync::mpsc::UnboundedSender;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::keys::LockKeys;
use crate::lock::RedisLock;
use crate::node::BACKEND;
use crate::subscriber::Subscription;

/// What a lock key holds, split: the owner (the whole value of a plain lock, the owner
/// line of a campaign's term) and, for a term, its token and value.
pub(crate) fn parse(stored: &str) -> (&str, Option<(u64, &str)>) {
    let term = stored.split_once('\n').and_then(|(owner, rest)| {
        if !is_owner(owner) {
            return None;
        }
        let (token, value) = rest.split_once('\n')?;
        let token = token.parse::<u64>().ok()?;
        Some((owner, (token, value)))
    });
    match term {
        Some((owner, term)) => (owner, Some(term)),
        None => (stored, None),
    }
}

/// Whether `line` is one of fencelock's owner values: 32 hex digits (the client id), a
/// colon and a decimal attempt number. A hand-written lock's value in the raw layout is
/// taken for a term only if it looks like one.
fn is_owner(line: &str) -> bool {
    let Some((client, attempt)) = line.split_once(':') else {
        return false;
    };
    client.len() == 32
        && client.bytes().all(|b| b.is_ascii_hexdigit())
        && !attempt.is_empty()
        && attempt.bytes().all(|b| b.is_ascii_digit())
}

/// The holder of a name as a quorum sees it.
#[derive(Debug, Clone)]
pub(crate) struct Holder {
    /// The owner value (a term's owner line).
    pub(crate) owner: String,
    /// The grant's token: a term's own, the counter for a plain lock.
    pub(crate) token: u64,
    /// The remaining lease (`None`: a key without expiry).
    pub(crate) remaining: Option<Duration>,
    /// A term's value; `None` for a plain lock.
    pub(crate) value: Option<String>,
}

impl Holder {
    /// The leader this holder is: a plain lock's holder leads with an empty value (as
    /// on every backend: campaigning and locking one name exclude each other).
    pub(crate) fn leader(&self) -> Leader {
        Leader::new(
            self.value.clone().unwrap_or_default(),
            FencingToken::new(self.token),
        )
    }
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
/// notified by `subscriptions` (the election channel on every node); `last` is what the
/// first read found. A read that fails retryably is tried again after a bounded backoff;
/// one that fails otherwise (an ACL refusal) ends the observation with its error.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn follow(
    lock: RedisLock,
    keys: LockKeys,
    subscriptions: Vec<Subscription>,
    wake: Arc<Notify>,
    last: Option<Holder>,
    changes: UnboundedSender<LeaderChange>,
    stop: CancellationToken,
    closed: CancellationToken,
) {
    let _subscriptions = subscriptions;
    let mut deadline = expiry(last.as_ref());
    let mut last = last.map(|h| h.leader());
    let mut backoff = RETRY_MIN;
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
        match lock.holder_of(&keys).await {
            Ok(holder) => {
                backoff = RETRY_MIN;
                deadline = expiry(holder.as_ref());
                let now = holder.map(|h| h.leader());
                if now != last {
                    last.clone_from(&now);
                    if changes.send(Ok(now)).is_err() {
                        return;
                    }
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

/// Sleeps until `at`; forever when there is no deadline.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_and_plain_owners_are_told_apart() {
        let owner = "0123456789abcdef0123456789ABCDEF:42";
        assert_eq!(parse(owner), (owner, None));
        let term = format!("{owner}\n1700000000000000\n10.0.0.1:8080");
        assert_eq!(
            parse(&term),
            (owner, Some((1_700_000_000_000_000, "10.0.0.1:8080")))
        );
        // A value may hold newlines, or be empty.
        let term = format!("{owner}\n7\na\nb");
        assert_eq!(parse(&term), (owner, Some((7, "a\nb"))));
        let term = format!("{owner}\n7\n");
        assert_eq!(parse(&term), (owner, Some((7, ""))));
        // Hand-written values are owners as a whole.
        for foreign in [
            "legacy-7f3a",
            "legacy\n7\nv",
            "0123456789abcdef0123456789abcdef:\n7\nv",
            "0123456789abcdef0123456789abcdeg:1\n7\nv",
            &format!("{owner}\nx7\nv"),
            &format!("{owner}\n7"),
            "",
        ] {
            assert_eq!(parse(foreign), (foreign, None), "{foreign:?}");
        }
    }
}
