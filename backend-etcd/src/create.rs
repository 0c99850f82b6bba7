//! Creating our key: one transaction that takes a free name or queues us on a taken one
//! (through the client's group commit), sent in a task of its own so that a dropped
//! acquire still learns exactly which incarnation of our key it made.

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnResponse};
use fencelock_core::{Error, LossCause};

use crate::batch::Created;
use crate::cleanup::{Armed, KeyState};
use crate::error::{BACKEND, map};
use crate::lock::EtcdLock;
use crate::txn::{delete_incarnation, first_created, get_first, stale_of};

impl EtcdLock {
    /// Creates our key and learns the first key under the name. Returns (our create
    /// revision, the holder's create revision).
    ///
    /// Uncontended (the name has no key at all) this is one round trip whose transaction
    /// is just that compare and the put: the same work, and the same bytes in etcd's log,
    /// as the raw floor, and we are the holder. Otherwise the same transaction queues us:
    /// it puts our key, if it does not exist, and reads the first-created key under the
    /// name. A key of ours that exists already can only be left from an earlier grant
    /// whose deletion never got through: it is never reused (its token would not be new)
    /// nor given our value (an observer would pair that value with its old token), but
    /// deleted, and we queue again with a put under the same condition.
    pub(crate) async fn create_and_read_first(
        &self,
        key: &str,
        names: &str,
        lease_id: i64,
        value: &str,
        pending: &mut Armed,
    ) -> Result<(i64, i64), Error> {
        // One transaction creates our key if the name is free and queues it otherwise:
        // a queued acquire costs one proposal, not a failed create and then a put.
        match self
            .create_or_queue(key, names, lease_id, value, true, pending)
            .await?
        {
            Created::Granted(revision) => return Ok((revision, revision)),
            Created::Queued {
                revision,
                stale: false,
                first: Some(first),
            } => return Ok((revision, first)),
            // A stale key of ours (never a grant: its token may not be new): delete it
            // and queue afresh below.
            Created::Queued {
                revision,
                stale: true,
                ..
            } => {
                // Boxed, off the usual path (see `take`).
                Box::pin(delete_incarnation(&self.inner().client, key, revision)).await?;
                pending.state = KeyState::Absent;
            }
            // Cannot happen (our own key is under the name); queue again below.
            Created::Queued { .. } | Created::Taken { .. } => {}
        }
        let put = TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease_id)));
        loop {
            // Never a put over a stale key of ours: it would keep the stale incarnation's
            // create revision, and an observer would see our value with its token.
            let txn = Txn::new()
                .when([Compare::create_revision(key, CompareOp::Equal, 0)])
                .and_then([put.clone(), TxnOp::get(names, Some(first_created()))])
                .or_else([TxnOp::get(key, None)]);
            let response = self.send_create(txn, pending).await?;
            let ops = response.op_responses();
            if !response.succeeded() {
                if let Some(stale) = stale_of(&response) {
                    pending.state = KeyState::Created(stale);
                    Box::pin(delete_incarnation(&self.inner().client, key, stale)).await?;
                }
                pending.state = KeyState::Absent;
                continue;
            }
            let revision = response.header().map_or(0, |h| h.revision());
            pending.state = KeyState::Created(revision);
            let first = get_first(&ops, 1)
                .ok_or_else(|| internal("no key under the name after creating one"))?;
            return Ok((revision, first));
        }
    }

    /// Sends a transaction that may create our key: until its answer arrives, whether the
    /// key exists is unknown (and a clean-up must delete by key).
    ///
    /// The transaction must put our key only when its compares succeed, and read our
    /// key in its `or_else` if it reads anything there. It runs in its own task,
    /// recorded in the clean-up: if this future is dropped before the answer, the
    /// clean-up waits for it and deletes exactly the incarnation it made (created at the
    /// transaction's revision) or found (a stale key of ours the failed compare read).
    pub(crate) async fn send_create(
        &self,
        txn: Txn,
        pending: &mut Armed,
    ) -> Result<TxnResponse, Error> {
        let client = self.inner().client.clone();
        self.create_in_task(
            pending,
            move || async move { client.kv_client().txn(txn).await },
            // Our put creates the key now; a compare that failed on a key of ours read it
            // (to be deleted all the same).
            |response| {
                if response.succeeded() {
                    response.header().map(|h| h.revision())
                } else {
                    stale_of(response)
                }
            },
        )
        .await
    }

    /// Sends `request`, which may create our key, in a task of its own recorded in the
    /// clean-up, and returns its answer. Until the answer arrives our key's state is
    /// unknown; if this future is dropped first, the clean-up waits for the task and
    /// deletes exactly the incarnation `ours` reads from the answer (`None`: none).
    ///
    /// `request` makes the request's future inside the task, so the caller's future
    /// never holds it (a gRPC call's future is several KiB, which every acquire would
    /// otherwise carry and copy).
    pub(crate) async fn create_in_task<T: Send + 'static, F>(
        &self,
        pending: &mut Armed,
        request: impl FnOnce() -> F + Send + 'static,
        ours: fn(&T) -> Option<i64>,
    ) -> Result<T, Error>
    where
        F: std::future::Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    {
        pending.state = KeyState::Unknown;
        let (answer, answered) = tokio::sync::oneshot::channel();
        let create = self.inner().runtime.spawn(async move {
            let response = request().await;
            let made = match &response {
                Ok(value) => Ok(ours(value)),
                // Refused before anything was applied (RBAC, a lease etcd no longer
                // knows, ...): nothing was created.
                Err(e) if !crate::error::outcome_unknown(e) => Ok(None),
                // etcd may still apply it.
                Err(_) => Err(()),
            };
            let _ = answer.send(response);
            made
        });
        pending.create = Some(create);
        let response = answered.await.unwrap_or_else(|_| {
            Err(etcd_client::Error::InvalidArgs(
                "the create task ended without an answer".into(),
            ))
        });
        pending.create = None;
        response.map_err(|e| stale(e, pending))
    }

    /// One round trip: create our key only if no key exists under the name (through the
    /// client's group commit), so a try on a taken name leaves nothing behind. Returns our
    /// create revision, or `None` if the name is taken. A key of ours found on a taken
    /// name (an earlier send of this create whose answer was lost) is recorded in the
    /// clean-up, which deletes it.
    pub(crate) async fn create_if_free(
        &self,
        key: &str,
        names: &str,
        lease_id: i64,
        value: &str,
        pending: &mut Armed,
    ) -> Result<Option<i64>, Error> {
        match self
            .create_or_queue(key, names, lease_id, value, false, pending)
            .await?
        {
            Created::Granted(revision) => Ok(Some(revision)),
            _ => Ok(None),
        }
    }

    /// The create of [`create_if_free`](Self::create_if_free); with `queue`, a taken name
    /// gets our key in the same transaction ([`Created::Queued`]). The clean-up records
    /// exactly which incarnation of our key exists afterwards.
    pub(crate) async fn create_or_queue(
        &self,
        key: &str,
        names: &str,
        lease_id: i64,
        value: &str,
        queue: bool,
        pending: &mut Armed,
    ) -> Result<Created, Error> {
        let (batcher, names, key) = (
            self.inner().batcher.clone(),
            names.to_owned(),
            key.to_owned(),
        );
        let value = value.to_owned();
        let created = self
            .create_in_task(
                pending,
                move || async move {
                    batcher
                        .create_if_free(&names, &key, lease_id, &value, queue)
                        .await
                },
                |created| match created {
                    Created::Granted(revision) | Created::Queued { revision, .. } => {
                        Some(*revision)
                    }
                    Created::Taken { ours } => *ours,
                },
            )
            .await?;
        pending.state = match created {
            Created::Granted(revision) | Created::Queued { revision, .. } => {
                KeyState::Created(revision)
            }
            Created::Taken { ours: Some(stale) } => KeyState::Created(stale),
            Created::Taken { ours: None } => KeyState::Absent,
        };
        Ok(created)
    }
}

/// Maps a create's error; a lease etcd no longer knows means the session is gone. A
/// refusal leaves nothing to clean up; any other error leaves the key's state unknown
/// (etcd may still apply the create), for the clean-up to deal with.
fn stale(error: etcd_client::Error, pending: &mut Armed) -> Error {
    if !crate::error::outcome_unknown(&error) {
        // Refused before anything was applied (RBAC, a lease etcd no longer knows, ...):
        // there is nothing to clean up (a delete RBAC refused would be refused the same
        // way).
        pending.state = KeyState::Absent;
    }
    if crate::error::is_lease_not_found(&error) {
        if let Some(session) = &pending.session {
            session.mark_lost(
                LossCause::SessionEnded,
                "etcd no longer knows the session lease",
            );
        }
    }
    map(error)
}

fn internal(what: &str) -> Error {
    Error::backend(BACKEND, false, format!("unexpected etcd answer: {what}"))
}
