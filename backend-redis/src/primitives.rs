//! Semaphores and read-write locks on one Redis server (single, Sentinel, Cluster).
//!
//! Each holder has a key of its own in the name's slot, renewed, released and expired
//! like a lock key; an index hash lists the holders (see [`scripts::MEMBER_ACQUIRE`] and
//! the README's key layout). Waiters wake on a release message (published when a
//! refused waiter marked the name) or at the soonest holder's expiry. Waiting is not
//! FIFO, but the first refused writer or semaphore request that waits is protected from
//! barging: a waiting writer holds back new readers and other writers, and a waiting
//! semaphore request keeps its permits from being handed to smaller requests.
//!
//! Redlock has neither: a semaphore over a majority of independent instances cannot
//! bound its holders (each instance bounds its own, so with three instances up to 1.5 ×
//! `limit` requests can each win two), and the read-write lock is not implemented there
//! yet; both are [`Error::Unsupported`] and the capabilities say so.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fencelock_core::kit::{Abandon, CLOCK_DRIFT, Claim, GiveUp, Turn, Undo, until_turn};
use fencelock_core::{
    AcquireOptions, Error, FencingToken, LockGuard, Permits, Wait, validate_name,
};
use redis::Value;
use tokio::runtime::Handle;
use tokio::time::Instant;
use tracing::Instrument;

use crate::acquire::Granted;
use crate::attempt::InFlight;
use crate::call::millis;
use crate::config::MIN_LEASE;
use crate::engine::Engine;
use crate::error::{BACKEND, invalid_name};
use crate::held;
use crate::keys::PrimitiveKeys;
use crate::replicas::{invoke_grant, replicas_acknowledged};
use crate::scripts;
use crate::waiting::Waiting;

/// What is asked for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ask {
    /// `count` of `limit` permits.
    Permits { count: u32, limit: u32 },
    /// A read lock.
    Read,
    /// A write lock.
    Write,
}

impl Ask {
    fn mode(self) -> &'static str {
        match self {
            Ask::Permits { .. } => "s",
            Ask::Read => "r",
            Ask::Write => "w",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Ask::Permits { .. } => "sem",
            Ask::Read | Ask::Write => "rw",
        }
    }
}

/// One try's outcome.
enum Reply {
    Granted {
        token: u64,
        owner: String,
        id: u64,
        sent: Instant,
    },
    Refused(Duration),
    OtherLimit(i64),
}

/// A waiting writer's or semaphore request's intent: deleted by the kit's [`Undo`] in the
/// background if the request ends without the grant having deleted it (the script
/// compares the id, so this is harmless then).
struct Intent<'a> {
    engine: &'a Arc<Engine>,
    keys: &'a PrimitiveKeys,
    id: String,
}

impl Abandon for Intent<'_> {
    fn runtime(&self) -> &Handle {
        &self.engine.runtime
    }

    fn abandon(self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let engine = self.engine.clone();
        let mut call = scripts::INTENT_CLEAR.prepare_invoke();
        call.key(&self.keys.intent)
            .key(&self.keys.waiters)
            .arg(&self.id)
            .arg(&self.keys.channel);
        let timeout = engine.config.timeout;
        Some(async move {
            let _ = tokio::time::timeout(timeout * 2, engine.nodes[0].invoke::<i64>(&call)).await;
        })
    }
}

/// Takes a semaphore's permits or a read-write lock's side, waiting as `options`
/// allow.
pub(crate) async fn take_member(
    engine: &Arc<Engine>,
    name: &str,
    ask: Ask,
    options: AcquireOptions,
) -> Result<LockGuard, Error> {
    validate_name(name)?;
    options.validate(MIN_LEASE)?;
    engine.check_open()?;
    if engine.is_redlock() {
        return Err(Error::Unsupported {
            backend: BACKEND,
            operation: match ask {
                Ask::Permits { .. } => {
                    "semaphores on Redlock (a majority of independent instances cannot bound the holders to the limit)"
                }
                Ask::Read | Ask::Write => "read-write locks on Redlock",
            },
        });
    }
    let layout = &engine.config.layout;
    if let Some(reason) = layout.refusal(name, true) {
        return Err(invalid_name(name, reason));
    }
    let keys = layout.primitive_keys(name, ask.kind());
    // As for a lock (`Engine::lock_keys`): a script over keys in several slots
    // would fail with CROSSSLOT on every try.
    if engine.is_cluster() && !keys.share_a_slot() {
        return Err(invalid_name(
            name,
            "in the raw layout on a Redis Cluster, a name with `}` and no \
             non-empty {tag} cannot keep its keys in one slot: put a {tag} in \
             the name",
        ));
    }
    let wait = fencelock_core::WaitDeadline::new(options.wait_kind());
    let waiting = wait_member(engine, name, &keys, ask, options, wait);
    let span = tracing::debug_span!("fencelock.redis.acquire_member", name = name);
    let closed = engine.closed.clone();
    tokio::select! {
        biased;
        () = closed.cancelled() => Err(Error::Closed { backend: BACKEND }),
        taken = waiting.instrument(span) => taken,
        // A server that stopped answering: the whole request ends with the wait.
        () = wait.bound_passed() => Err(wait.timed_out(name)),
    }
}

async fn wait_member(
    engine: &Arc<Engine>,
    name: &str,
    keys: &PrimitiveKeys,
    ask: Ask,
    options: AcquireOptions,
    wait: fencelock_core::WaitDeadline,
) -> Result<LockGuard, Error> {
    // As for a lock: the wait is looked at where this waits (the kit's loop around
    // `Members`); the caller bounds the whole request.
    let lease = options.lease_kind();
    let will_wait = options.wait_kind() != Wait::NoWait;
    let intent_id = format!(
        "{}:i{}",
        engine.client_id,
        engine.next_id.fetch_add(1, Ordering::Relaxed)
    );
    // Armed before the first try: the try may record the intent.
    let intent = (ask != Ask::Read && will_wait).then(|| {
        Undo::new(Intent {
            engine,
            keys,
            id: intent_id.clone(),
        })
    });
    let members = Members {
        engine,
        name,
        keys,
        ask,
        lease: lease.duration(),
        will_wait,
        intent_id,
        intent,
        first_try: true,
        waiting: Waiting::new(),
        wait: &wait,
    };
    let (_members, granted) = until_turn(members, name, &wait, !will_wait).await?;
    let Granted {
        token,
        owner,
        id,
        sent,
    } = granted;
    let holder = keys.holder(&owner);
    held::guard(engine, name, &holder, lease, token, owner, id, sent, false)
}

/// A request's tries ([`Claim::turn`]: one [`try_member`]) and the waits between them
/// ([`Claim::wait`]: on the name's unlock channel, or for the soonest holder's expiry).
struct Members<'a> {
    engine: &'a Arc<Engine>,
    name: &'a str,
    keys: &'a PrimitiveKeys,
    ask: Ask,
    lease: Duration,
    will_wait: bool,
    intent_id: String,
    /// A waiting writer's or semaphore request's intent, cleared unless the grant did.
    intent: Option<Undo<Intent<'a>>>,
    first_try: bool,
    waiting: Waiting,
    wait: &'a fencelock_core::WaitDeadline,
}

impl Claim for Members<'_> {
    type Grant = Granted;
    /// How long until the soonest holder's lease ends, at most.
    type Blocker = Duration;

    async fn turn(&mut self) -> Result<Turn<Granted, Duration>, Error> {
        let reply = try_member(
            self.engine,
            self.keys,
            self.ask,
            self.lease,
            self.will_wait,
            &self.intent_id,
        )
        .await?;
        let was_first = std::mem::take(&mut self.first_try);
        match reply {
            Reply::Granted {
                token,
                owner,
                id,
                sent,
            } => {
                if was_first {
                    // Granted at once: no try of this request recorded an intent.
                    if let Some(intent) = self.intent.take() {
                        intent.disarm();
                    }
                }
                Ok(Turn::Granted(Granted {
                    token: FencingToken::new(token),
                    owner,
                    id,
                    sent,
                }))
            }
            Reply::OtherLimit(limit) => Err(Error::InvalidConfig(format!(
                "semaphore {:?} is held or awaited with a limit of {limit}, not {}",
                self.name,
                match self.ask {
                    Ask::Permits { limit, .. } => limit,
                    _ => 0,
                }
            ))),
            Reply::Refused(after) => Ok(Turn::Behind(after)),
        }
    }

    async fn wait(&mut self, after: Duration) -> Result<(), Error> {
        // A writer refreshes its intent (3 s expiry) at least every second.
        let pause = after.min(Duration::from_secs(1));
        let channel = (self.keys.slot, self.keys.channel.as_str());
        self.waiting
            .before_next_try(self.engine, channel, pause, self.wait, self.name)
            .await?;
        Ok(())
    }

    /// The intent, if any, is cleared in the background as the request ends.
    async fn give_up(self, _why: GiveUp, error: Error) -> Error {
        error
    }
}

/// One try: the grant script on the (only) node.
async fn try_member(
    engine: &Arc<Engine>,
    keys: &PrimitiveKeys,
    ask: Ask,
    lease: Duration,
    will_wait: bool,
    intent_id: &str,
) -> Result<Reply, Error> {
    let id = engine.next_id.fetch_add(1, Ordering::Relaxed);
    let owner = format!("{}:{id}", engine.client_id);
    let holder = keys.holder(&owner);
    // Dropped mid-call: the holder key may have been set; released in the background.
    let in_flight = Undo::new(InFlight {
        engine,
        keys: &holder,
        owner: owner.clone(),
        election: false,
    });
    let (count, limit) = match ask {
        Ask::Permits { count, limit } => (count, limit),
        Ask::Read | Ask::Write => (1, 0),
    };
    let mut call = scripts::MEMBER_ACQUIRE.prepare_invoke();
    call.key(&keys.index)
        .key(&holder.lock)
        .key(&keys.token)
        .key(&keys.waiters)
        .key(&keys.intent)
        .arg(&owner)
        .arg(millis(lease))
        .arg(engine.counter_ttl(lease))
        .arg(u8::from(will_wait))
        .arg(ask.mode())
        .arg(count)
        .arg(limit)
        .arg(&keys.holders)
        .arg(intent_id);
    let sent = Instant::now();
    let node = &engine.nodes[0];
    // With the replica check, its `WAIT` goes with the script, on its connection.
    let reply = engine
        .bounded(
            node,
            engine.config.timeout,
            invoke_grant(engine, node, &call),
        )
        .await;
    let (reply, acks) = match reply {
        Ok(reply) => reply,
        // Unknown whether it was applied: the in-flight guard releases the holder key.
        Err(e) => return Err(e),
    };
    let bad = || Error::backend(BACKEND, false, "unexpected reply from the grant script");
    let Value::Array(items) = reply else {
        return Err(bad());
    };
    let number = |v: &Value| match v {
        Value::Int(n) => Some(*n),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    };
    match items.as_slice() {
        [Value::Int(1), token] => {
            let token = number(token)
                .and_then(|t| u64::try_from(t).ok())
                .ok_or_else(bad)?;
            if sent.elapsed() + CLOCK_DRIFT.of(lease) >= lease {
                // Armed until the release is answered: a drop during it, or a release
                // that failed, releases again in the background.
                in_flight.finish_now(engine.config.timeout).await;
                return Err(Error::unavailable(
                    BACKEND,
                    "the lease ran out before the grant was answered",
                ));
            }
            // The replica check (`wait_replicas`), as for a lock: a grant too few replicas
            // acknowledged is undone and refused.
            if let Err(error) =
                replicas_acknowledged(engine, node, acks.as_ref(), sent, lease).await
            {
                in_flight.finish_now(engine.config.timeout).await;
                return Err(error);
            }
            in_flight.disarm();
            Ok(Reply::Granted {
                token,
                owner,
                id,
                sent,
            })
        }
        [Value::Int(0), retry] => {
            in_flight.disarm();
            let ms = number(retry).unwrap_or(100).max(1);
            Ok(Reply::Refused(Duration::from_millis(
                u64::try_from(ms).unwrap_or(100) + 1,
            )))
        }
        [Value::Int(-1), limit] => {
            in_flight.disarm();
            Ok(Reply::OtherLimit(number(limit).unwrap_or(0)))
        }
        _ => Err(bad()),
    }
}

/// Keeps `Permits` in the signature of the trait's method next to this module.
pub(crate) fn ask_permits(permits: Permits) -> Ask {
    Ask::Permits {
        count: permits.count(),
        limit: permits.limit(),
    }
}
