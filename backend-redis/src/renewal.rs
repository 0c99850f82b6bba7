//! Lease renewal: one task per client renews all its held locks, batched into one script
//! call per node (per slot on Redis Cluster).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fencelock_core::kit::{CLOCK_DRIFT, Due, Renew, Renewals};
use fencelock_core::{Error, Liveness, RenewalOutcome, record_renewal};
use futures_util::StreamExt;
use tokio::time::Instant;

use crate::call::millis;
use crate::engine::Engine;
use crate::keys::LockKeys;
use crate::quorum::pending;
use crate::scripts;

/// Keys per renewal script call, at most.
const BATCH: usize = 100;

/// Renewal calls in flight at once, at most. The calls of a round share the client's
/// connection with its acquires: sent all at once (1,000 calls a round with 100,000 locks
/// held on a 5 s lease), an acquire queued behind all of them: a median of 49-392 ms
/// instead of 0.2 ms. So a round starts with one call in flight, and a round that took
/// more than half of its renew interval makes the next one wider (doubling, up to this),
/// one that took less than an eighth narrower: an acquire waits behind few calls, and
/// renewals still keep up with a distant server. Within a round, each finished call also
/// widens the round at once to what the calls left need to end within a quarter interval
/// at its pace (see [`needed_in_flight`]), so the first round of many locks over a slow
/// link does not run past their deadlines before the width adapts. (A lease is three renew intervals, so
/// a round that takes half of one leaves plenty before any deadline. On a nearby
/// server the rounds are bound by the server's script time, which more calls in flight
/// do not shorten: 100,000 locks took 200-480 ms a round with one in flight or 32.)
pub(crate) const MAX_IN_FLIGHT: usize = 32;

/// A renewing lease of a Redis lock, as the kit's scheduler keeps it.
pub(crate) struct Lease {
    /// The grant's id in [`Engine::held`]: a lease lost at its deadline is released only
    /// while its guard lives.
    id: u64,
    /// Shared with the guard: the lock key and its slot, not a copy of the key.
    keys: LockKeys,
    owner: String,
    /// The TTL of the name's counter, in ms ([`Engine::counter_ttl`]), and when the
    /// renewal next raises the counter's TTL back to it: every quarter of it, so that a
    /// lock held longer than `token_ttl` keeps its counter even if a renewal or two in
    /// between fail.
    counter_ttl: u64,
    counter_due: Instant,
}

/// One lock of a round.
pub(crate) struct Renewing {
    keys: LockKeys,
    owner: String,
    /// The counter's TTL in ms when this renewal refreshes it.
    counter_ttl: Option<u64>,
}

/// Starts renewing lock `id` of `engine`, granted by a request sent at `sent`, every
/// third of `lease` on the kit's scheduler, which runs on the client's own runtime (a
/// lock taken inside a short-lived runtime, a `block_on` or a test's, must not end the
/// renewal of every lock of the client when that runtime shuts down). Returns the
/// scheduler's key. The counter's TTL is refreshed every quarter of it, from `sent`.
pub(crate) fn start(
    engine: &Arc<Engine>,
    id: u64,
    keys: LockKeys,
    owner: String,
    lease: Duration,
    liveness: Liveness,
    sent: Instant,
) -> u64 {
    let counter_ttl = engine.counter_ttl(lease);
    let data = Lease {
        id,
        keys,
        owner,
        counter_ttl,
        counter_due: sent + Duration::from_millis(counter_ttl / 4),
    };
    Renewals::insert(engine, data, lease, liveness, sent)
}

impl Renew for Engine {
    type Lease = Lease;
    type Due = Renewing;
    /// The task keeps looking every second while the client lives: locking one name
    /// after another costs no task start and no wake-up per lock.
    const ENDS_WHEN_IDLE: bool = false;

    fn renewals(&self) -> &Renewals<Self> {
        &self.renewals
    }

    fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    fn due(&self, lease: &mut Lease, now: Instant) -> Renewing {
        let counter_ttl = (lease.counter_due <= now).then(|| {
            lease.counter_due = now + Duration::from_millis(lease.counter_ttl / 4);
            lease.counter_ttl
        });
        Renewing {
            keys: lease.keys.clone(),
            owner: lease.owner.clone(),
            counter_ttl,
        }
    }

    fn renew(self: &Arc<Self>, due: Vec<Due<Renewing>>) -> impl Future<Output = ()> + Send {
        renew(self, due)
    }

    /// Releases a lock counted lost at its deadline, as a dropped guard's is (compare the
    /// owner, delete, wake the waiters): a renewal the server applied but whose answer
    /// came late, or never within the timeout, may have moved the key's expiry up to a
    /// lease past the loss, and others must not wait that out for a key nobody holds. A
    /// key that expired meanwhile (or another owner's) is left as it is.
    fn abandon(self: &Arc<Self>, _key: u64, lease: Lease) {
        // Only while the guard lives: a released or dropped guard released the key itself.
        let granted = self.held.with(lease.id, |g| (g.token, g.election));
        if let Some((token, election)) = granted {
            tracing::debug!(key = %lease.keys.lock, "a renewed lock passed its deadline; releasing its key");
            self.release_in_background(lease.keys, lease.owner, Some(token), election);
        }
    }
}

/// Renews `due` on every node, one call per node and slot group of up to [`BATCH`] keys.
async fn renew(engine: &Arc<Engine>, due: Vec<Due<Renewing>>) {
    let mut groups: BTreeMap<u16, Vec<Due<Renewing>>> = BTreeMap::new();
    let cluster = engine.nodes.iter().any(|n| n.is_cluster());
    for d in due {
        // The lock's own slot, carried with it: an entry released meanwhile is no
        // longer in the registry, and slot 0 would put its key in a CROSSSLOT call
        // that fails the whole chunk.
        let slot = if cluster { d.data.keys.slot } else { 0 };
        groups.entry(slot).or_default().push(d);
    }
    let mut chunks: Vec<Vec<Due<Renewing>>> = groups
        .into_values()
        .flat_map(|mut group| {
            // The earliest deadlines first, within a slot and across chunks.
            group.sort_by_cached_key(|d| d.liveness.valid_until());
            chunked(group)
        })
        .collect();
    chunks.sort_by_cached_key(|chunk| chunk.first().map(|d| d.liveness.valid_until()));
    let Some(interval) = chunks.iter().flatten().map(|d| d.lease / 3).min() else {
        return;
    };
    let widen = &engine.widen;
    let mut in_flight = widen.load(Ordering::Relaxed) + 1;
    let begun = Instant::now();
    let mut left = chunks.into_iter();
    let mut running = futures_util::stream::FuturesUnordered::new();
    loop {
        while running.len() < in_flight {
            let Some(chunk) = left.next() else { break };
            running.push(renew_chunk(engine, chunk));
        }
        let Some(call) = running.next().await else {
            break;
        };
        // Widened at once if the calls left would not fit in what is left of a quarter
        // interval at the pace of this one: the first round of 100,000 locks is 1,000
        // calls, which at one in flight and a 3.3 ms round trip would take past a 5 s
        // lease's deadline before the width could adapt between rounds.
        let budget = (interval / 4).saturating_sub(begun.elapsed());
        in_flight = in_flight.max(needed_in_flight(left.len(), call, budget));
    }
    let took = begun.elapsed();
    let next = next_in_flight(in_flight, took, interval);
    tracing::debug!(?took, in_flight, next, "renewal round");
    widen.store(next - 1, Ordering::Relaxed);
}

/// The calls in flight that finish `left` calls of `call` each within `budget` (at least
/// one, at most [`MAX_IN_FLIGHT`]).
fn needed_in_flight(left: usize, call: Duration, budget: Duration) -> usize {
    if left == 0 {
        return 1;
    }
    let budget = budget.max(Duration::from_millis(1)).as_secs_f64();
    let needed = (left as f64 * call.as_secs_f64() / budget).ceil();
    if needed >= MAX_IN_FLIGHT as f64 {
        MAX_IN_FLIGHT
    } else {
        (needed as usize).max(1)
    }
}

/// The renewal calls in flight in the next round, after a round with `in_flight` took
/// `took` for locks renewed every `interval` (see [`MAX_IN_FLIGHT`]).
fn next_in_flight(in_flight: usize, took: Duration, interval: Duration) -> usize {
    if took > interval / 2 {
        (in_flight * 2).min(MAX_IN_FLIGHT)
    } else if took < interval / 8 {
        (in_flight / 2).max(1)
    } else {
        in_flight
    }
}

/// `items` in chunks of at most [`BATCH`], each allocated for what it holds.
///
/// (Splitting with `split_off` left every chunk with the capacity of everything after
/// it: memory and copying quadratic in the number of held locks, measured at 8 GB of
/// resident memory for 100,000 locks.)
fn chunked<T>(items: Vec<T>) -> Vec<Vec<T>> {
    let mut items = items.into_iter();
    let mut chunks = Vec::new();
    loop {
        let chunk: Vec<T> = items.by_ref().take(BATCH).collect();
        if chunk.is_empty() {
            return chunks;
        }
        chunks.push(chunk);
    }
}

/// Renews one chunk; returns how long its call took.
///
/// Redlock: each lock is credited as soon as a quorum has renewed it, and the chunk is
/// done once every lock is either renewed on a quorum or can no longer be (see
/// [`Engine::on_nodes_until`]): an instance that is silent (partitioned, stopped) does
/// not hold the renewal of a majority up until its timeout, possibly past the deadline.
#[tracing::instrument(name = "fencelock.redis.renew", level = "debug", skip_all, fields(locks = chunk.len()))]
async fn renew_chunk(engine: &Arc<Engine>, chunk: Vec<Due<Renewing>>) -> Duration {
    let mut invocation = scripts::RENEW.prepare_invoke();
    for d in &chunk {
        invocation.key(&d.data.keys.lock);
        invocation.arg(&d.data.owner).arg(millis(d.lease));
        // Now and then the counter's TTL too (see `Lease::counter_due`).
        match d.data.counter_ttl {
            Some(ms) => {
                invocation.key(&d.data.keys.token).arg(ms);
            }
            None => {
                invocation.arg("");
            }
        }
    }
    // Redlock: a dead or slow instance must not hold the answer past the leases'
    // deadlines, so it gets at most half of the shortest lease (as on acquire).
    let timeout = chunk
        .iter()
        .map(|d| engine.lease_timeout(d.lease))
        .min()
        .unwrap_or(engine.config.timeout);
    let locks = chunk.len();
    let quorum = engine.quorum;
    // How many nodes renewed lock `i`, of the answers in so far.
    let renewed_on = |replies: &[Option<Option<Vec<i64>>>], i: usize| {
        replies
            .iter()
            .flatten()
            .flatten()
            .filter(|reply| reply.get(i) == Some(&1))
            .count()
    };
    let sent = Instant::now();
    let replies = engine
        .on_nodes_until(
            invocation,
            timeout,
            // Recorded as each node answers, also one answering after the chunk is done.
            move |reply: Result<Vec<i64>, Error>| {
                let reply = reply.ok();
                let outcome = match &reply {
                    None => RenewalOutcome::Failed,
                    Some(renewed) if renewed.iter().all(|r| *r == 1) => RenewalOutcome::Renewed,
                    Some(_) => RenewalOutcome::Gone,
                };
                record_renewal(crate::error::BACKEND, outcome, sent.elapsed(), locks);
                reply
            },
            |replies| {
                let pending = pending(replies);
                (0..locks).all(|i| {
                    let renewed = renewed_on(replies, i);
                    renewed >= quorum || renewed + pending < quorum
                })
            },
        )
        .await;
    let latency = sent.elapsed();
    let nodes = engine.nodes.len();
    for (i, d) in chunk.iter().enumerate() {
        let renewed = renewed_on(&replies, i);
        let gone = replies
            .iter()
            .flatten()
            .flatten()
            .filter(|reply| reply.get(i).is_some_and(|r| *r != 1))
            .count();
        if renewed >= engine.quorum {
            engine
                .renewals
                .renewed(d, sent + d.lease - CLOCK_DRIFT.of(d.lease));
        } else if gone > nodes - engine.quorum {
            // Lost only if still renewed: a lock released while this call was in flight
            // is gone because of its release (which removed it first).
            engine.renewals.gone(
                d,
                "the lock key was gone or held by another owner at renewal",
            );
        } else {
            tracing::debug!(key = %d.data.keys.lock, "lock renewal failed; retrying");
            engine.renewals.failed(d);
        }
    }
    latency
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every chunk holds at most `BATCH` items and is allocated for no more: the
    /// chunks of n items take memory linear in n.
    #[test]
    fn chunks_are_small_and_allocated_for_what_they_hold() {
        let chunks = chunked((0..10_050).collect::<Vec<u32>>());
        assert_eq!(chunks.len(), 101);
        assert_eq!(chunks.iter().map(Vec::len).sum::<usize>(), 10_050);
        assert!(chunks.iter().all(|c| c.len() <= BATCH && !c.is_empty()));
        let capacity: usize = chunks.iter().map(Vec::capacity).sum();
        assert!(
            capacity <= 10_050 + 101 * 8,
            "the chunks of 10,050 items hold room for {capacity}"
        );
        assert_eq!(chunks.concat(), (0..10_050).collect::<Vec<u32>>());
        assert!(chunked(Vec::<u32>::new()).is_empty());
    }

    /// A round that takes more than half its interval widens the next, up to the cap; a
    /// quick one narrows it, down to one call in flight.
    #[test]
    fn rounds_widen_when_slow_and_narrow_when_quick() {
        let interval = Duration::from_millis(1_000);
        let ms = Duration::from_millis;
        assert_eq!(next_in_flight(1, ms(400), interval), 1);
        assert_eq!(next_in_flight(1, ms(600), interval), 2);
        assert_eq!(next_in_flight(16, ms(900), interval), 32);
        assert_eq!(next_in_flight(32, ms(2_000), interval), MAX_IN_FLIGHT);
        assert_eq!(next_in_flight(8, ms(100), interval), 4);
        assert_eq!(next_in_flight(1, ms(1), interval), 1);
        assert_eq!(next_in_flight(4, ms(200), interval), 4);
    }

    /// Within a round, the calls in flight follow what the calls left need to end within
    /// the time left: 1,000 calls of 3.3 ms in 416 ms need 8 at once.
    #[test]
    fn a_round_widens_to_what_its_calls_left_need() {
        let ms = Duration::from_millis;
        let us = Duration::from_micros;
        assert_eq!(needed_in_flight(999, us(3_300), ms(416)), 8);
        assert_eq!(needed_in_flight(999, us(300), ms(416)), 1);
        assert_eq!(needed_in_flight(999, ms(80), ms(416)), MAX_IN_FLIGHT);
        assert_eq!(needed_in_flight(0, ms(80), ms(416)), 1);
        // No time left: as wide as allowed.
        assert_eq!(needed_in_flight(10, ms(5), Duration::ZERO), MAX_IN_FLIGHT);
    }
}
