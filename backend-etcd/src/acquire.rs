//! A lock's acquire path: the session, this client's waiting line, our key, the wait
//! for our turn, the grant. Read top to bottom; the create and the wait are
//! [`Queued`], the protocol's part of the kit's claim/wait loop ([`until_turn`]), and
//! the steps they call follow in [`crate::create`], [`crate::wait`] and
//! [`crate::grant`].

use std::sync::Arc;

use fencelock_core::kit::{Claim, GiveUp, Turn, until_turn};
use fencelock_core::{AcquireOptions, Error, Lease, LockGuard, Wait, WaitDeadline};
use tracing::Instrument;

use crate::cleanup::{Armed, Cleanup, KeyState, give_up_now};
use crate::keys::{name_prefix, own_key};
use crate::lock::EtcdLock;
use crate::session::Session;
use crate::wait;

impl EtcdLock {
    /// [`take`](Self::take), once more on a new session if the session turned out to be
    /// gone (revoked or expired before its keepalive noticed).
    pub(crate) async fn take_fresh(
        &self,
        name: &str,
        options: AcquireOptions,
        value: &str,
    ) -> Result<LockGuard, Error> {
        // A wait too long to represent is a wait forever.
        let wait = WaitDeadline::new(options.wait_kind());
        match self.take(name, options, wait, value).await {
            Err(error) if crate::error::is_stale_session(&error) => {
                self.take(name, options, wait, value).await
            }
            other => other,
        }
    }

    /// Takes the lock, giving up at the end of `wait` (if any) with [`Error::Timeout`].
    ///
    /// A waiter that gives up (a timeout, or an error while waiting) deletes its key
    /// before returning (bounded by the clean-up timeout), so a process that exits right
    /// after leaves nothing that would block the name until its lease expires. Only a
    /// dropped future leaves the clean-up to the background.
    pub(crate) async fn take(
        &self,
        name: &str,
        options: AcquireOptions,
        wait: WaitDeadline,
        value: &str,
    ) -> Result<LockGuard, Error> {
        // The steps before any waiting (the session, the create) get at least
        // `ROUND_TRIP_GRACE`: a free lock is granted with a zero wait.
        let steps = wait.bound_from_now();
        let inner = self.inner();
        let names = name_prefix(&inner.config.prefix, name);
        let lease = options.lease_or(inner.config.lease);
        let no_wait = options.wait_kind() == Wait::NoWait;
        // A fixed lease starts when the lock is granted, never while waiting. A try that
        // does not wait is granted or refused by its create, so its key goes straight onto
        // a lease granted just before. One that may wait queues on the client's renewing
        // session and moves its key onto a fresh fixed lease when its turn comes.
        // Every step is bounded by the caller's wait (the steps before any waiting by
        // at least `ROUND_TRIP_GRACE`), also when etcd hangs (a request caught in an election
        // waits for etcd's own request timeout).
        let (session, fixed_now) = match lease {
            Lease::Fixed(ttl) if no_wait => (
                Box::pin(Session::grant(&inner.client, ttl, &inner.runtime, None)).await?,
                true,
            ),
            Lease::Fixed(_) => (
                wait.run_until(
                    steps,
                    name,
                    inner.sessions.get(&inner.client, inner.config.lease),
                )
                .await??,
                false,
            ),
            Lease::Renewing(ttl) => (
                wait.run_until(steps, name, inner.sessions.get(&inner.client, ttl))
                    .await??,
                false,
            ),
        };
        let key: Arc<str> = own_key(&names, session.lease_id()).into();
        let cleanup = Cleanup {
            client: inner.client.clone(),
            batcher: inner.batcher.clone(),
            runtime: inner.runtime.clone(),
            timeout: inner.config.cleanup_timeout,
            key: key.clone(),
            state: KeyState::Absent,
            session: (!fixed_now).then(|| session.clone()),
            fixed_lease: fixed_now.then(|| session.lease_id()),
            moved_maybe: Vec::new(),
            permit: None,
            create: None,
        };
        // Until the guard exists, dropping this (error, timeout, cancellation) undoes it all.
        let mut pending = Armed::new(cleanup);
        let permit = if no_wait {
            inner
                .lines
                .try_front(&key)
                .ok_or_else(|| Error::Contended {
                    name: name.to_owned(),
                })?
        } else {
            // Waiting behind this client's other waiters: the caller's deadline (a free
            // line's front is taken at its first poll).
            wait.run_until(wait.at(), name, inner.lines.front(&key))
                .await?
        };
        pending.permit = Some(permit);

        let queued = Queued {
            lock: self,
            name,
            names: &names,
            key: &key,
            session: &session,
            value,
            no_wait,
            wait: &wait,
            pending,
            cleared: None,
        };
        let (queued, revision) = until_turn(queued, name, &wait, no_wait).await?;
        let mut pending = queued.pending;

        // The holder's session: the renewing one, or the fixed lease the key is on.
        let (session, fixed) = match lease {
            Lease::Fixed(ttl) if !fixed_now => (
                Box::pin(self.move_to_fixed_lease(&key, revision, ttl, name, value, &mut pending))
                    .await?,
                true,
            ),
            _ => (session, fixed_now),
        };
        self.grant(name, session, fixed, revision, pending)
    }
}

/// Our key in the name's queue, from its create to its grant: whose turn it is
/// ([`Claim::turn`]: the create, which reads the first key; then the wait's own
/// finding) and the wait for it ([`Claim::wait`]: [`wait::for_turn`]), in the kit's
/// loop ([`until_turn`]).
struct Queued<'a> {
    lock: &'a EtcdLock,
    name: &'a str,
    names: &'a str,
    key: &'a str,
    session: &'a Arc<Session>,
    value: &'a str,
    no_wait: bool,
    wait: &'a WaitDeadline,
    /// Our key's clean-up, until the guard owns it.
    pending: Armed,
    /// Our key's create revision, once the wait found no key created before it.
    cleared: Option<i64>,
}

impl Claim for Queued<'_> {
    /// Our key's create revision.
    type Grant = i64;
    /// Our key's create revision, behind the first key's.
    type Blocker = i64;

    async fn turn(&mut self) -> Result<Turn<i64, i64>, Error> {
        if let Some(mine) = self.cleared {
            return Ok(Turn::Granted(mine));
        }
        let lease_id = self.session.lease_id();
        let (key, names, value) = (self.key, self.names, self.value);
        if self.no_wait {
            // Granted or refused by its create: a refused one made no key.
            let created = self
                .lock
                .create_if_free(key, names, lease_id, value, &mut self.pending)
                .await?;
            return Ok(created.map_or(Turn::Behind(0), Turn::Granted));
        }
        // The create's own bound starts now, after the wait in this client's line: a
        // waiter let through the line at its deadline would otherwise have its create
        // cut in flight and return while the key is still being made (the background
        // clean-up deletes it a moment later). Created, it is granted if the lock is
        // free (the wait bounds only time behind holders), and otherwise finds its
        // deadline passed in the kit's loop and deletes its key before returning.
        // The session's loss ends it too (`wait::until_lost`).
        let (session, name) = (self.session, self.name);
        let creating =
            self.lock
                .create_and_read_first(key, names, lease_id, value, &mut self.pending);
        let bounded = async {
            self.wait
                .run_until(self.wait.bound_from_now(), name, creating)
                .await?
        };
        let (mine, first) = wait::until_lost(session, name, bounded).await?;
        Ok(if first == mine {
            Turn::Granted(mine)
        } else {
            Turn::Behind(mine)
        })
    }

    async fn wait(&mut self, mine: i64) -> Result<(), Error> {
        // Boxed, as are the other steps off the uncontended path: their futures (watch
        // streams, lease grants) are several KiB each, which every acquire's future
        // would otherwise carry and copy.
        let client = &self.lock.inner().client;
        let waiting = Box::pin(
            wait::for_turn(
                client,
                (self.names, self.key),
                mine,
                self.session,
                self.name,
            )
            .instrument(tracing::debug_span!(
                "fencelock.etcd.wait",
                lock = self.name
            )),
        );
        waiting.await?;
        self.cleared = Some(mine);
        Ok(())
    }

    async fn give_up(self, why: GiveUp, error: Error) -> Error {
        // A waiter that gives up or fails while waiting deletes its key now, as in the
        // read-write and semaphore queues; a refused try made none.
        if why != GiveUp::Refused {
            Box::pin(give_up_now(self.pending)).await;
        }
        error
    }
}
