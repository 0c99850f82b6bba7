//! A lock's acquire path: the session, this client's waiting line, our key, the wait
//! for our turn, the grant. Read top to bottom; the steps it calls follow in
//! [`crate::create`], [`crate::wait`] and [`crate::grant`].

use std::sync::Arc;

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

        let revision = if no_wait {
            self.create_if_free(&key, &names, session.lease_id(), value, &mut pending)
                .await?
                .ok_or_else(|| Error::Contended {
                    name: name.to_owned(),
                })?
        } else {
            // The create's own bound starts now, after the wait in this client's line: a
            // waiter let through the line at its deadline would otherwise have its
            // create cut in flight and return while the key is still being made (the
            // background clean-up deletes it a moment later). Created, it is granted if
            // the lock is free (the wait bounds only time behind holders), and otherwise
            // finds its deadline passed below and deletes its key before returning.
            let (mine, first) = wait
                .run_until(
                    wait.bound_from_now(),
                    name,
                    self.create_and_read_first(
                        &key,
                        &names,
                        session.lease_id(),
                        value,
                        &mut pending,
                    ),
                )
                .await??;
            if first != mine {
                // Boxed, as are the other steps off the uncontended path below: their
                // futures (watch streams, lease grants) are several KiB each, which
                // every acquire's future would otherwise carry and copy.
                let waiting = Box::pin(
                    wait::for_turn(&inner.client, (&names, &key), mine, &session, name)
                        .instrument(tracing::debug_span!("fencelock.etcd.wait", lock = name)),
                );
                match wait.run_until(wait.at(), name, waiting).await {
                    Ok(Ok(())) => {}
                    // Lost or failed while waiting: the key goes now too, as in the
                    // read-write and semaphore queues.
                    Ok(Err(error)) | Err(error) => {
                        Box::pin(give_up_now(pending)).await;
                        return Err(error);
                    }
                }
            }
            mine
        };

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
