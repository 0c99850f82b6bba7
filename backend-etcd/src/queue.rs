//! Read-write locks and semaphores in etcd: every request puts one key on the client's
//! session lease in the primitive's key range, and requests are served in the order of
//! their create revisions (FIFO, no barging); the create revision is the grant's token.
//!
//! - Read-write lock `N`: keys `{prefix}/%rw/{N}/read/{lease}-{nonce}` and `.../write/...`,
//!   the layout of etcd's Go `recipes.RWMutex` on `{prefix}/%rw/{N}`: a reader waits for
//!   the last writer created before it, a writer for the last key of either kind. A
//!   writer waiting ahead of later readers keeps them out, so writers are not starved.
//! - Semaphore `N` of `limit`: keys `{prefix}/%sem/{N}/{lease}-{nonce}` whose value is
//!   `count/limit`; a request is granted when the permits of every earlier key and its
//!   own fit in the limit. A request with another limit than the earlier keys' is
//!   refused.
//!
//! `%rw` and `%sem` cannot be the encoding of a lock name (an encoded `%` is `%25`), so
//! these ranges never meet a lock's.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    WatchFilterType, WatchOptions,
};
use fencelock_core::kit::{Claim, GiveUp, Turn, until_turn};
use fencelock_core::{AcquireOptions, Error, Lease, LockGuard, Wait, WaitDeadline};

use crate::cleanup::{Armed, Cleanup, KeyState, give_up_now};
use crate::error::map;
use crate::keys::encode;
use crate::lock::EtcdLock;
use crate::session::Session;
use crate::wait::until_lost;

/// What a request asks for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ask {
    Read,
    Write,
    Permits { count: u32, limit: u32 },
}

impl Ask {
    /// The primitive's key range, its own key's range, and the key's value.
    fn layout(self, prefix: &str, name: &str) -> (String, String, String) {
        match self {
            Ask::Read => {
                let dir = format!("{prefix}/%rw/{}/", encode(name));
                (dir.clone(), format!("{dir}read/"), String::new())
            }
            Ask::Write => {
                let dir = format!("{prefix}/%rw/{}/", encode(name));
                (dir.clone(), format!("{dir}write/"), String::new())
            }
            Ask::Permits { count, limit } => {
                let dir = format!("{prefix}/%sem/{}/", encode(name));
                (dir.clone(), dir, format!("{count}/{limit}"))
            }
        }
    }
}

impl EtcdLock {
    /// Takes what `ask` asks for on `name`, waiting as `options` allow until the end of
    /// `wait` (if any), which a retry on a new session shares with the first try.
    pub(crate) async fn queue(
        &self,
        name: &str,
        ask: Ask,
        options: AcquireOptions,
        wait: WaitDeadline,
    ) -> Result<LockGuard, Error> {
        let inner = self.inner();
        let lease = options.lease_or(inner.config.lease);
        // Queue on the renewing session; a fixed lease starts at the grant (the key moves
        // onto it then), never while waiting.
        let session_ttl = match lease {
            Lease::Renewing(ttl) => ttl,
            Lease::Fixed(_) => inner.config.lease,
        };
        // The steps before any waiting (session, create, first read) are bounded by at
        // least the grace of `WaitDeadline::bound_from_now`: a free name is granted with a zero wait.
        let steps = wait.bound_from_now();
        let session = wait
            .run_until(steps, name, inner.sessions.get(&inner.client, session_ttl))
            .await??;
        let (dir, own, value) = ask.layout(&inner.config.prefix, name);
        // The lease is this client's, and the sequence is this process's: unique.
        static SEQUENCE: AtomicU64 = AtomicU64::new(0);
        let sequence = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let key: std::sync::Arc<str> = format!("{own}{:x}-{sequence:x}", session.lease_id()).into();
        let mut pending = Armed::new(Cleanup {
            client: inner.client.clone(),
            batcher: inner.batcher.clone(),
            runtime: inner.runtime.clone(),
            timeout: inner.config.cleanup_timeout,
            key: key.clone(),
            state: KeyState::Absent,
            session: Some(session.clone()),
            fixed_lease: None,
            moved_maybe: Vec::new(),
            permit: None,
            create: None,
        });
        let txn = Txn::new()
            .when([Compare::create_revision(&*key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                &*key,
                value.as_str(),
                Some(PutOptions::new().with_lease(session.lease_id())),
            )]);
        // Until it is queued, as while it waits, the session's loss ends the request.
        let creating = async {
            wait.run_until(steps, name, self.send_create(txn, &mut pending))
                .await?
        };
        let created = until_lost(&session, name, creating).await?;
        if !created.succeeded() {
            // The key is this process's and sequence-numbered: it cannot exist already.
            return Err(Error::backend(
                crate::error::BACKEND,
                false,
                "unexpected etcd answer: a new queue key existed already",
            ));
        }
        let mine = created.header().map_or(0, |h| h.revision());
        pending.state = KeyState::Created(mine);

        // The keys a read or write request waits behind (none for permits, which count).
        let blockers = match ask {
            Ask::Read => format!("{dir}write/"),
            Ask::Write => dir.clone(),
            Ask::Permits { .. } => String::new(),
        };
        // The first look: granted at once (no waiting, so within the steps' grace), or
        // refused (a request that cannot wait ends here).
        let first_look = async {
            match ask {
                Ask::Read | Ask::Write => Ok::<_, Error>(!self.earlier_key(&blockers, mine).await?),
                Ask::Permits { count, limit } => {
                    self.permits_fit(&dir, mine, (count, limit), name).await
                }
            }
        };
        let first_look = until_lost(&session, name, async {
            wait.run_until(steps, name, first_look).await?
        });
        let granted_at_once = match first_look.await {
            Ok(granted) => granted,
            Err(error) => {
                give_up_now(pending).await;
                return Err(error);
            }
        };
        let queued = Queued {
            lock: self,
            name,
            ask,
            dir: &dir,
            blockers: &blockers,
            key: &key,
            mine,
            session: &session,
            pending,
            cleared: granted_at_once,
        };
        let no_wait = options.wait_kind() == Wait::NoWait;
        let (queued, ()) = until_turn(queued, name, &wait, no_wait).await?;
        let mut pending = queued.pending;

        let (session, fixed) = match lease {
            Lease::Fixed(ttl) => (
                self.move_to_fixed_lease(&key, mine, ttl, name, &value, &mut pending)
                    .await?,
                true,
            ),
            Lease::Renewing(_) => (session, false),
        };
        self.grant(name, session, fixed, mine, pending)
    }

    /// Whether a key under `range` was created before revision `mine`.
    async fn earlier_key(&self, range: &str, mine: i64) -> Result<bool, Error> {
        let options = GetOptions::new()
            .with_prefix()
            .with_max_create_revision(mine - 1)
            .with_limit(1)
            .with_keys_only();
        let read = self
            .inner()
            .client
            .kv_client()
            .get(range, Some(options))
            .await
            .map_err(map)?;
        Ok(!read.kvs().is_empty())
    }

    /// Whether the permits of every key of semaphore `dir` created before `mine`, plus
    /// ours, fit in the limit.
    async fn permits_fit(
        &self,
        dir: &str,
        mine: i64,
        (count, limit): (u32, u32),
        name: &str,
    ) -> Result<bool, Error> {
        let earlier = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_max_create_revision(mine - 1);
        let read = self
            .inner()
            .client
            .kv_client()
            .get(dir, Some(earlier))
            .await
            .map_err(map)?;
        let mut taken: u64 = 0;
        for kv in read.kvs() {
            let (their_count, their_limit) = parse_permits(kv.value());
            if their_limit != limit {
                return Err(Error::InvalidConfig(format!(
                    "semaphore {name:?} has {their_limit} permits, not {limit}: every \
                     client must ask with the same limit"
                )));
            }
            taken += u64::from(their_count);
        }
        Ok(taken + u64::from(count) <= u64::from(limit))
    }

    /// Waits until the permits of every key of semaphore `dir` created before `mine`,
    /// plus ours, fit in the limit, after a first read found they did not. Re-reads after
    /// each deletion in the range.
    async fn wait_for_permits(
        &self,
        dir: &str,
        mine: i64,
        (count, limit): (u32, u32),
        session: &Session,
        name: &str,
    ) -> Result<(), Error> {
        let client = &self.inner().client;
        let permits = (count, limit);
        let waiting = async {
            let mut watch = client.watch_client();
            loop {
                // Watch first (from now), then read: a deletion in between is in the
                // read, one after it in the watch.
                let watching = WatchOptions::new()
                    .with_prefix()
                    .with_filters([WatchFilterType::NoPut]);
                let mut events = watch.watch(dir, Some(watching)).await.map_err(map)?;
                if self.permits_fit(dir, mine, permits, name).await? {
                    return Ok(());
                }
                loop {
                    let Some(response) = events.message().await.map_err(map)? else {
                        break;
                    };
                    if response.canceled()
                        || response
                            .events()
                            .iter()
                            .any(|e| e.event_type() == EventType::Delete)
                    {
                        break;
                    }
                }
            }
        };
        until_lost(session, name, waiting).await
    }

    /// After waiting: our key must still be the one we queued with. If the session expired
    /// while we waited, the key is gone and the lock must not be taken (etcd #11456).
    async fn check_still_queued(&self, key: &str, mine: i64, name: &str) -> Result<(), Error> {
        let response = self
            .inner()
            .client
            .kv_client()
            .get(key, None)
            .await
            .map_err(map)?;
        match response.kvs().first() {
            Some(kv) if kv.create_revision() == mine => Ok(()),
            _ => Err(Error::lost(
                name,
                "our key disappeared while waiting (session expired or key deleted)",
            )),
        }
    }
}

/// `count/limit` from a semaphore key's value; (0, 0) for anything else.
fn parse_permits(value: &[u8]) -> (u32, u32) {
    std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.split_once('/'))
        .and_then(|(c, l)| Some((c.parse().ok()?, l.parse().ok()?)))
        .unwrap_or((0, 0))
}

/// Our key in a read-write lock's or semaphore's queue, after the first look found it
/// behind: the wait until its turn ([`Claim::wait`]) in the kit's loop
/// ([`until_turn`]); its turn has come once a wait ended ([`Claim::turn`]).
struct Queued<'a> {
    lock: &'a EtcdLock,
    name: &'a str,
    ask: Ask,
    dir: &'a str,
    /// The keys a read or write request waits behind (none for permits, which count).
    blockers: &'a str,
    key: &'a str,
    mine: i64,
    session: &'a Arc<Session>,
    /// Our key's clean-up, until the guard owns it.
    pending: Armed,
    /// Whether our turn has come: at the first look, or after a wait.
    cleared: bool,
}

impl Claim for Queued<'_> {
    type Grant = ();
    type Blocker = ();

    async fn turn(&mut self) -> Result<Turn<(), ()>, Error> {
        Ok(if self.cleared {
            Turn::Granted(())
        } else {
            Turn::Behind(())
        })
    }

    async fn wait(&mut self, (): ()) -> Result<(), Error> {
        let (name, mine, session) = (self.name, self.mine, self.session);
        match self.ask {
            Ask::Read | Ask::Write => {
                // Confirms our key too: no separate check after it.
                let client = &self.lock.inner().client;
                crate::wait::for_turn(client, (self.blockers, self.key), mine, session, name)
                    .await?;
            }
            Ask::Permits { count, limit } => {
                self.lock
                    .wait_for_permits(self.dir, mine, (count, limit), session, name)
                    .await?;
                // Our key must have survived the wait (a request granted at its first
                // read needs no such check, as a lock's first try).
                self.lock.check_still_queued(self.key, mine, name).await?;
            }
        }
        self.cleared = true;
        Ok(())
    }

    /// Refused, timed out or failed while waiting: the key goes now.
    async fn give_up(self, _why: GiveUp, error: Error) -> Error {
        give_up_now(self.pending).await;
        error
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_never_meet_a_locks() {
        let (dir, own, value) = Ask::Read.layout("p", "a/b");
        assert_eq!(
            (dir.as_str(), own.as_str(), value.as_str()),
            ("p/%rw/a%2Fb/", "p/%rw/a%2Fb/read/", "")
        );
        let (dir, _, value) = Ask::Permits { count: 2, limit: 5 }.layout("p", "%rw");
        assert_eq!((dir.as_str(), value.as_str()), ("p/%sem/%25rw/", "2/5"));
        // A lock named "%rw" lives under p/%25rw/, never p/%rw/.
        assert_eq!(crate::keys::name_prefix("p", "%rw"), "p/%25rw/");
        assert_eq!(parse_permits(b"2/5"), (2, 5));
        assert_eq!(parse_permits(b"junk"), (0, 0));
    }
}
