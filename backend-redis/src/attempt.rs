//! One acquisition attempt over one or more nodes (one for single, Sentinel and Cluster;
//! N for Redlock, which needs a majority): the acquire script on every node, the token
//! the answers decide (recorded on a majority when they disagree), the replica check,
//! and the undo of a try that did not become a guard.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fencelock_core::kit::{Abandon, CLOCK_DRIFT, Undo};
use fencelock_core::{Error, FencingToken};
use redis::Value;
use tokio::runtime::Handle;
use tokio::time::Instant;

use crate::call::millis;
use crate::engine::Engine;
use crate::error::BACKEND;
use crate::keys::LockKeys;
use crate::quorum::{on_every_node, pending};
use crate::replicas::{invoke_grant, replicas_acknowledged};
use crate::scripts;

/// What one attempt found.
pub(crate) enum Attempt {
    /// Granted with this token; the attempt's owner value and id.
    Granted {
        token: FencingToken,
        owner: String,
        id: u64,
        sent: Instant,
    },
    /// Held by someone else; try again after at most this long (or on a message).
    Held(Duration),
}

/// One node's answer to the acquire script.
enum Reply {
    Granted(u64),
    /// The holder's PTTL, and (Redlock) the instance's token counter.
    Held(i64, Option<u64>),
}

/// What a try may have taken and not turned into a guard: its key, released (owner
/// compared) by the kit's [`Undo`] in the background if the try is dropped or fails
/// before it is known whether the lock was taken.
pub(crate) struct InFlight<'a> {
    pub(crate) engine: &'a Arc<Engine>,
    pub(crate) keys: &'a LockKeys,
    pub(crate) owner: String,
    pub(crate) election: bool,
}

impl Abandon for InFlight<'_> {
    fn runtime(&self) -> &Handle {
        &self.engine.runtime
    }

    fn abandon(self) -> Option<impl Future<Output = ()> + Send + 'static> {
        Some(
            self.engine
                .release_later(self.keys.clone(), self.owner, None, self.election),
        )
    }

    /// The release on every node (a compare-and-delete: sent again in the background,
    /// it deletes nothing of anyone else's). Done once answered: the key deleted, or
    /// found not ours. A release that failed (a connection reset, a reconnect that did
    /// not get through) is not done: the key it left would otherwise stay, owned by
    /// nobody, for its lease.
    async fn undo_now(&mut self) -> bool {
        self.engine
            .release(self.keys, &self.owner, None, self.election)
            .await
            .is_ok()
    }
}

/// One try to take `keys` for `lease`; with a `value`, a campaign whose grant
/// stores the value with the lock and is published on the election channel. A
/// refused try marks the lock as awaited when `will_wait` (the release then publishes
/// an unlock message).
pub(crate) async fn try_once(
    engine: &Arc<Engine>,
    keys: &LockKeys,
    lease: Duration,
    will_wait: bool,
    value: Option<&str>,
) -> Result<Attempt, Error> {
    // Before anything is sent: a clock Redlock cannot propose from is refused.
    let proposal = if engine.nodes.len() > 1 {
        Some(proposal(std::time::SystemTime::now())?)
    } else {
        None
    };
    let id = engine.next_id.fetch_add(1, Ordering::Relaxed);
    // Sized up front: `format!` would start empty and grow the string twice.
    let mut owner = String::with_capacity(engine.client_id.len() + 21);
    // Writing into a `String` cannot fail.
    let _ = write!(owner, "{}:{id}", engine.client_id);
    let election = value.is_some();
    let in_flight = Undo::new(InFlight {
        engine,
        keys,
        owner: owner.clone(),
        election,
    });
    let redlock = engine.nodes.len() > 1;
    let script = match (redlock, election) {
        (false, false) => &scripts::ACQUIRE,
        (true, false) => &scripts::ACQUIRE_PROPOSED,
        (false, true) => &scripts::CAMPAIGN,
        (true, true) => &scripts::CAMPAIGN_PROPOSED,
    };
    let mut invocation = script.prepare_invoke();
    invocation
        .key(&keys.lock)
        .key(&keys.token)
        .key(&keys.waiters)
        .arg(&owner)
        .arg(millis(lease))
        .arg(engine.counter_ttl(lease))
        .arg(u8::from(will_wait));
    if let Some(proposal) = proposal {
        invocation.arg(proposal);
    }
    if let Some(value) = value {
        if !redlock {
            // ARGV[5], the proposal, is Redlock's only.
            invocation.arg(0);
        }
        invocation.arg(&keys.election).arg(value);
    }
    let per_node = engine.lease_timeout(lease);
    let sent = Instant::now();
    // Every instance's answer (each bounded by `per_node`), unlike a renewal's: the
    // token is the highest of them all, not only of the first majority to grant. An
    // instance ahead of the others may be the only one left remembering an issued
    // token (its majority partner restarted without persistence), and a refused try
    // not waited for to the end might still grant and need undoing. A silent
    // instance costs the grant `per_node` (at most half the lease); its deadline
    // still counts from `sent`, and its first renewal, due a third of the lease
    // after `sent`, goes out at once and needs a majority only.
    let replies = on_every_node(&engine.nodes, |node| {
        let invocation = &invocation;
        async move {
            // With the replica check, its `WAIT` goes with the script (one node).
            let (reply, acks) = engine
                .bounded(node, per_node, invoke_grant(engine, node, invocation))
                .await?;
            Ok::<_, Error>((parse_acquire(reply)?, acks))
        }
    })
    .await;
    let mut acks = None;
    let mut granted = Vec::new();
    let mut held = Vec::new();
    // The highest counter a refusing instance answered (Redlock).
    let mut refused_counter = 0;
    let mut errors = Vec::new();
    for reply in replies {
        match reply {
            Ok((Reply::Granted(token), wait)) => {
                granted.push(token);
                acks = wait;
            }
            Ok((Reply::Held(pttl, counter), _)) => {
                held.push(pttl);
                refused_counter = refused_counter.max(counter.unwrap_or(0));
            }
            Err(e) => errors.push(e),
        }
    }
    let validity = lease
        .checked_sub(sent.elapsed() + CLOCK_DRIFT.of(lease))
        .unwrap_or_default();
    if granted.len() >= engine.quorum && !validity.is_zero() {
        // A refusing instance may be the only one of an earlier granting majority
        // that still remembers its token (see the scripts' module docs).
        let token = granted
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(refused_counter.saturating_add(1));
        let recorded = granted.iter().filter(|t| **t == token).count();
        let checked = async {
            // A Redlock campaign's term lines are provisional (each instance's own
            // answer, see `scripts::provisional_grant`): it always confirms them
            // with the guard's token, so observers never report another token.
            if recorded < engine.quorum || (redlock && election) {
                // The granting majority disagreed, or a refusing instance was ahead
                // of it: make a majority remember the token before anyone relies on
                // it.
                let term = value.map(|value| (owner.as_str(), value));
                raise_token(engine, keys, token, term, lease, per_node).await?;
                if sent.elapsed() + CLOCK_DRIFT.of(lease) >= lease {
                    return Err(Error::unavailable(
                        BACKEND,
                        "the lease ran out while the token was being recorded",
                    ));
                }
            }
            replicas_acknowledged(engine, &engine.nodes[0], acks.as_ref(), sent, lease).await?;
            Ok::<_, Error>(())
        };
        if let Err(e) = checked.await {
            // Waited for no longer than an instance's answer to the acquire: the slow
            // ones are why it failed, and the caller must not wait on them again.
            in_flight.finish_now(per_node).await;
            return Err(e);
        }
        in_flight.disarm();
        return Ok(Attempt::Granted {
            token: FencingToken::new(token),
            owner,
            id,
            sent,
        });
    }
    if !granted.is_empty() {
        // Redlock without a majority (or too slow): undo the partial grant now.
        in_flight.finish_now(per_node).await;
        if granted.len() >= engine.quorum {
            // Granted, but the answer came after the lease had run out: the lock was
            // free, so this is the servers' slowness, not contention.
            return Err(Error::unavailable(
                BACKEND,
                "the lease ran out before the grant was confirmed (Redis answered too slowly)",
            ));
        }
    } else if errors.is_empty() {
        in_flight.disarm();
    }
    if errors.len() > engine.nodes.len() - engine.quorum {
        return Err(errors.swap_remove(0));
    }
    Ok(Attempt::Held(retry_after(
        &held,
        granted.len(),
        engine.quorum,
    )))
}

/// Redlock: makes a majority remember `token` (granted for `lease`) before the guard
/// is handed out, and for a campaign's `term` (owner, value) writes it into the term
/// line observers read.
async fn raise_token(
    engine: &Arc<Engine>,
    keys: &LockKeys,
    token: u64,
    term: Option<(&str, &str)>,
    lease: Duration,
    per_node: Duration,
) -> Result<(), Error> {
    let mut invocation = scripts::RAISE_TOKEN.prepare_invoke();
    invocation.key(&keys.token);
    if term.is_some() {
        invocation.key(&keys.lock);
    }
    invocation.arg(token).arg(engine.counter_ttl(lease));
    if let Some((owner, value)) = term {
        invocation.arg(owner).arg(value).arg(&keys.election);
    }
    let quorum = engine.quorum;
    let acked = |acks: &[Option<bool>]| acks.iter().filter(|a| **a == Some(true)).count();
    let acks = engine
        .on_nodes_until(
            invocation,
            per_node,
            |reply: Result<i64, Error>| matches!(reply, Ok(1)),
            |acks| acked(acks) >= quorum || acked(acks) + pending(acks) < quorum,
        )
        .await;
    if acked(&acks) >= quorum {
        Ok(())
    } else {
        Err(Error::unavailable(
            BACKEND,
            "the token could not be recorded on a majority of the instances",
        ))
    }
}

fn parse_acquire(value: Value) -> Result<Reply, Error> {
    let bad = || Error::backend(BACKEND, false, "unexpected reply from the acquire script");
    let Value::Array(items) = value else {
        return Err(bad());
    };
    match items.as_slice() {
        [Value::Int(1), Value::Int(token)] => {
            u64::try_from(*token).map(Reply::Granted).map_err(|_| bad())
        }
        [Value::Int(1), Value::BulkString(token)] => std::str::from_utf8(token)
            .ok()
            .and_then(|t| t.parse().ok())
            .map(Reply::Granted)
            .ok_or_else(bad),
        [Value::Int(0), Value::Int(pttl)] | [Value::Int(0), Value::Int(pttl), Value::Nil] => {
            Ok(Reply::Held(*pttl, None))
        }
        [Value::Int(0), Value::Int(pttl), Value::BulkString(counter)] => {
            std::str::from_utf8(counter)
                .ok()
                .and_then(|c| c.parse().ok())
                .map(|c| Reply::Held(*pttl, Some(c)))
                .ok_or_else(bad)
        }
        _ => Err(bad()),
    }
}

/// Redlock's token proposal: this client's wall clock `now` in µs since the Unix epoch.
///
/// # Errors
///
/// A clock before the epoch, or so far ahead that tokens would pass 2^52 (after 2112),
/// is refused: the acquire scripts take the larger of the proposal and the counter, so
/// a proposal of 0 would let tokens restart at 1 once the counters are gone (expired,
/// or lost by a majority restarted without persistence).
fn proposal(now: std::time::SystemTime) -> Result<u64, Error> {
    now.duration_since(std::time::UNIX_EPOCH)
        .ok()
        .and_then(|d| u64::try_from(d.as_micros()).ok())
        .filter(|us| (1..1 << 52).contains(us))
        .ok_or_else(|| {
            Error::backend(
                BACKEND,
                false,
                "Redlock tokens start from this client's clock, which reads before 1970 or \
                 after 2112: set the clock",
            )
        })
}

/// How long to sleep (at most, unless woken by an unlock message) before trying again,
/// after a try that `granted` instances granted (and that was undone) and that others
/// refused with the holders' remaining leases `held`, of `quorum` needed.
///
/// When the refusals reach a quorum, someone holds the lock on a majority: the lock
/// can be had once enough of those keys are gone for the free instances to make a
/// majority, that is after the `quorum - granted`-th shortest PTTL (one server: its
/// PTTL), unless an unlock message comes first. Only a split vote (neither the grants
/// nor the refusals reach a quorum: two waiters raced, or an instance did not answer)
/// backs off a random short while. A waiter that backed off briefly whenever some
/// instance granted would poll the free minority instance for the whole hold of a
/// holder on a bare majority.
fn retry_after(held: &[i64], granted: usize, quorum: usize) -> Duration {
    if held.len() < quorum {
        return Duration::from_millis(fastrand::u64(5..50));
    }
    let mut held = held.to_vec();
    held.sort_unstable_by_key(|pttl| match *pttl {
        // A key without expiry (a foreign lock) frees last.
        pttl if pttl < 0 => i64::MAX,
        pttl => pttl,
    });
    let needed = quorum.saturating_sub(granted).max(1);
    match held[needed - 1] {
        pttl if pttl >= 0 => Duration::from_millis(u64::try_from(pttl).unwrap_or(0) + 1),
        // A key without expiry: re-check every second.
        _ => Duration::from_secs(1),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use super::{proposal, retry_after};

    /// A majority of refusals waits for the lock to be freed on enough instances; only
    /// a split vote backs off briefly.
    #[test]
    fn only_a_split_vote_backs_off_briefly() {
        let ms = Duration::from_millis;
        // One server.
        assert_eq!(retry_after(&[700], 0, 1), ms(701));
        assert_eq!(retry_after(&[-1], 0, 1), ms(1000));
        // A holder on a bare majority of 3, the third instance free (and granted).
        assert_eq!(retry_after(&[9000, 8000], 1, 2), ms(8001));
        // All 3 held: two must be freed.
        assert_eq!(retry_after(&[9000, 300, 8000], 0, 2), ms(8001));
        // 5 instances, 3 held, 2 granted: one more must be freed.
        assert_eq!(retry_after(&[9000, 300, 8000], 2, 3), ms(301));
        // A key without expiry counts as freed last.
        assert_eq!(retry_after(&[-1, 8000], 1, 2), ms(8001));
        // Split votes.
        for (held, granted, quorum) in [(&[9000][..], 1, 2), (&[][..], 0, 1), (&[5][..], 2, 3)] {
            assert!(retry_after(held, granted, quorum) < ms(50));
        }
    }

    /// A clock Redlock cannot propose a token from is refused, not turned into a 0 that
    /// lets tokens restart at 1 once the counters are gone.
    #[test]
    fn a_clock_before_1970_or_after_2112_is_refused() {
        let now = SystemTime::now();
        let micros = now.duration_since(UNIX_EPOCH).unwrap().as_micros();
        assert_eq!(proposal(now).ok().map(u128::from), Some(micros));
        for bad in [
            UNIX_EPOCH - Duration::from_secs(1),
            UNIX_EPOCH,
            UNIX_EPOCH + Duration::from_micros(1 << 52),
        ] {
            assert!(proposal(bad).is_err(), "{bad:?}");
        }
    }
}
