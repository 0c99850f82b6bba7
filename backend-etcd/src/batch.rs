//! Group commit: the uncontended creates and the releases that tasks of one client issue
//! at the same time, on distinct names, share one transaction.
//!
//! Every transaction is a raft proposal, a WAL entry and an apply in etcd; with many
//! tasks locking distinct names, that per-request work, not the keys, is what the server
//! spends its time on. Each lane sends at most one transaction at a time; requests that
//! arrive meanwhile go out together in the next one. A lone request goes out at once as
//! the same single-lock transaction it would be without batching, so sequential use pays
//! only the hand-off to the lane's task.
//!
//! A combined transaction is all or nothing: its compares are joined by AND. If it fails
//! (one name was taken, one key was gone) or etcd refused it before applying anything
//! (say, more operations than its `--max-txn-ops`), every request in it is sent again on
//! its own, so each caller gets exactly the answer a transaction of its own would have
//! given. If its answer is lost (etcd may still apply it), every caller is told the
//! outcome is unknown instead: requests sent again could be answered, and their keys
//! released, before etcd applies the combined one, which would then make keys again.
//! The callers' clean-ups delete their keys, and look for late ones for
//! [`LATE_CREATE_WINDOW`](crate::cleanup::LATE_CREATE_WINDOW). Creates are grouped by lease,
//! so that one lease etcd no longer knows cannot fail the creates on another.

use std::sync::{Arc, Mutex, PoisonError};

use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use fencelock_core::Error;
use futures_util::future::join_all;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The most requests one combined transaction carries (etcd's default `--max-txn-ops` is
/// 128 operations per branch).
const MAX_BATCH: usize = 32;

/// The answer to a create of our key if the name has no key at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Created {
    /// Our key was created at this revision: we hold the lock.
    Granted(i64),
    /// The name was taken. `ours` is the create revision of our own key when it exists
    /// all the same: made by an earlier create of ours that etcd applied after answering
    /// it with an error, or left by an earlier grant. It is never taken as a grant (its
    /// token may not be new); the caller must delete it.
    Taken { ours: Option<i64> },
    /// The name was taken, and the request asked to queue then: the same transaction put
    /// our key unless a stale key of ours was there (`stale`: left as it was, never given
    /// our value, which would pair it with the stale incarnation's token) and read the
    /// first-created key under the name. One proposal for a queued acquire, not a failed
    /// create and a queueing put.
    Queued {
        /// Our key's incarnation: created by this transaction, or the stale one found.
        revision: i64,
        /// Whether our key existed before (a stale key: never a grant, to be deleted).
        stale: bool,
        /// The create revision of the first key under the name.
        first: Option<i64>,
    },
}

/// A create of our key if the name has no key at all.
struct Create {
    names: String,
    key: String,
    lease: i64,
    /// The key's value: empty for a lock, the candidate's for an election.
    value: String,
    /// Whether to queue (put our key anyway) when the name is taken.
    queue: bool,
    reply: oneshot::Sender<Result<Created, etcd_client::Error>>,
}

/// A delete of our key if it is still the incarnation created at `revision`.
struct Delete {
    key: String,
    revision: i64,
    reply: oneshot::Sender<Result<bool, Error>>,
}

/// Requests waiting for a lane, and whether its task is running.
struct Lane<T> {
    pending: Vec<T>,
    running: bool,
}

impl<T> Default for Lane<T> {
    fn default() -> Self {
        Lane {
            pending: Vec::new(),
            running: false,
        }
    }
}

/// The two lanes of one client.
pub(crate) struct Batcher {
    client: Arc<Client>,
    runtime: Handle,
    creates: Mutex<Lane<Create>>,
    deletes: Mutex<Lane<Delete>>,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").finish_non_exhaustive()
    }
}

fn lock<T>(lane: &Mutex<Lane<T>>) -> std::sync::MutexGuard<'_, Lane<T>> {
    lane.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Queues `request`; returns whether the caller must start the lane's task.
fn enqueue<T>(lane: &Mutex<Lane<T>>, request: T) -> bool {
    let mut lane = lock(lane);
    lane.pending.push(request);
    !std::mem::replace(&mut lane.running, true)
}

/// Claims an idle lane for a request the caller sends itself; `false` if the lane is
/// busy (the request must queue).
fn claim<T>(lane: &Mutex<Lane<T>>) -> bool {
    let mut lane = lock(lane);
    !lane.running && !std::mem::replace(&mut lane.running, true)
}

/// Which lane a [`Claimed`] lane is.
#[derive(Clone, Copy)]
enum Which {
    Creates,
    Deletes,
}

/// A lane claimed by a caller sending its own request. When the caller is done (or
/// dropped mid-flight), requests that queued meanwhile go to the lane's task; otherwise
/// the lane is idle again.
struct Claimed<'a> {
    batcher: &'a Arc<Batcher>,
    which: Which,
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        let queued = match self.which {
            Which::Creates => release_claim(&self.batcher.creates),
            Which::Deletes => release_claim(&self.batcher.deletes),
        };
        if queued {
            let this = self.batcher.clone();
            let which = self.which;
            self.batcher.runtime.spawn(async move {
                match which {
                    Which::Creates => this.run_creates().await,
                    Which::Deletes => this.run_deletes().await,
                }
            });
        }
    }
}

/// Ends a caller's claim: whether requests queued meanwhile (the lane stays running and
/// its task must be started).
fn release_claim<T>(lane: &Mutex<Lane<T>>) -> bool {
    let mut lane = lock(lane);
    if lane.pending.is_empty() {
        lane.running = false;
        false
    } else {
        true
    }
}

fn gone() -> Error {
    Error::backend(
        crate::error::BACKEND,
        true,
        "the request was dropped before etcd answered",
    )
}

impl Batcher {
    pub(crate) fn new(client: Arc<Client>, runtime: Handle) -> Self {
        Batcher {
            client,
            runtime,
            creates: Mutex::default(),
            deletes: Mutex::default(),
        }
    }

    /// Creates `key` on `lease` if no key exists under `names`; see [`Created`]. With
    /// `queue`, a taken name gets our key all the same, in the same transaction
    /// ([`Created::Queued`]).
    ///
    /// Cancel safety: once queued, the request is sent unless it is still waiting when
    /// the caller goes away; either way the caller must treat the key as possibly
    /// created.
    pub(crate) async fn create_if_free(
        self: &Arc<Self>,
        names: &str,
        key: &str,
        lease: i64,
        value: &str,
        queue: bool,
    ) -> Result<Created, etcd_client::Error> {
        if claim(&self.creates) {
            let _claimed = Claimed {
                batcher: self,
                which: Which::Creates,
            };
            return self.create_one(names, key, lease, value, queue).await;
        }
        let (reply, answer) = oneshot::channel();
        let request = Create {
            names: names.to_owned(),
            key: key.to_owned(),
            lease,
            value: value.to_owned(),
            queue,
            reply,
        };
        if enqueue(&self.creates, request) {
            let this = self.clone();
            self.runtime.spawn(async move { this.run_creates().await });
        }
        answer.await.unwrap_or_else(|_| {
            Err(etcd_client::Error::InvalidArgs(
                "the create was dropped before etcd answered".into(),
            ))
        })
    }

    /// Deletes `key` if it is still the incarnation created at `revision` (etcd #22082: a
    /// late delete must never remove a newer key). Returns whether it deleted it.
    ///
    /// Cancel safety: a delete that queued behind others is sent even if the caller goes
    /// away, but one the caller sends itself (the lane was idle) may or may not reach
    /// etcd if the caller is dropped. Either way the caller must treat the key as
    /// possibly still there until it has the answer (a release keeps its clean-up armed).
    pub(crate) async fn delete_incarnation(
        self: &Arc<Self>,
        key: &str,
        revision: i64,
    ) -> Result<bool, Error> {
        if claim(&self.deletes) {
            let _claimed = Claimed {
                batcher: self,
                which: Which::Deletes,
            };
            return crate::txn::delete_incarnation(&self.client, key, revision).await;
        }
        let (reply, answer) = oneshot::channel();
        let request = Delete {
            key: key.to_owned(),
            revision,
            reply,
        };
        if enqueue(&self.deletes, request) {
            let this = self.clone();
            self.runtime.spawn(async move { this.run_deletes().await });
        }
        answer.await.unwrap_or_else(|_| Err(gone()))
    }

    async fn run_creates(&self) {
        loop {
            let batch = {
                let mut lane = lock(&self.creates);
                // Callers that went away before their turn need nothing sent.
                lane.pending.retain(|c| !c.reply.is_closed());
                let Some(lease) = lane.pending.first().map(|c| c.lease) else {
                    lane.running = false;
                    return;
                };
                let mut batch = Vec::new();
                let mut rest = Vec::new();
                for create in lane.pending.drain(..) {
                    if create.lease == lease && batch.len() < MAX_BATCH {
                        batch.push(create);
                    } else {
                        rest.push(create);
                    }
                }
                lane.pending = rest;
                batch
            };
            if batch.len() > 1 {
                let txn = Txn::new()
                    .when(
                        batch
                            .iter()
                            .map(|c| {
                                Compare::create_revision(c.names.as_str(), CompareOp::Equal, 0)
                                    .with_prefix()
                            })
                            .collect::<Vec<_>>(),
                    )
                    .and_then(
                        batch
                            .iter()
                            .map(|c| put(c.key.as_str(), c.lease, &c.value))
                            .collect::<Vec<_>>(),
                    );
                match self.client.kv_client().txn(txn).await {
                    Ok(response) if response.succeeded() => {
                        let revision = response.header().map_or(0, |h| h.revision());
                        for create in batch {
                            let _ = create.reply.send(Ok(Created::Granted(revision)));
                        }
                        continue;
                    }
                    // A compare failed, or etcd refused the whole before applying
                    // anything: each on its own below gets its exact answer.
                    Ok(_) => {}
                    Err(error) if !crate::error::outcome_unknown(&error) => {}
                    // No answer: etcd may still apply it, after any create sent again
                    // now was answered and its key perhaps released, and so make keys
                    // nobody holds. Each caller learns the outcome is unknown; its
                    // clean-up deletes its key and then looks for a late one.
                    Err(error) => {
                        for create in batch {
                            let _ = create.reply.send(Err(unknown_outcome(&error)));
                        }
                        continue;
                    }
                }
            }
            join_all(batch.into_iter().map(|create| async move {
                let answer = self
                    .create_one(
                        &create.names,
                        &create.key,
                        create.lease,
                        &create.value,
                        create.queue,
                    )
                    .await;
                let _ = create.reply.send(answer);
            }))
            .await;
        }
    }

    async fn create_one(
        &self,
        names: &str,
        key: &str,
        lease: i64,
        value: &str,
        queue: bool,
    ) -> Result<Created, etcd_client::Error> {
        let otherwise = if queue {
            vec![
                crate::txn::put_if_absent(key, put(key, lease, value)),
                TxnOp::get(names, Some(crate::txn::first_created())),
            ]
        } else {
            vec![TxnOp::get(key, None)]
        };
        let txn = Txn::new()
            .when([Compare::create_revision(names, CompareOp::Equal, 0).with_prefix()])
            .and_then([put(key, lease, value)])
            .or_else(otherwise);
        let response = self.client.kv_client().txn(txn).await?;
        let now = response.header().map_or(0, |h| h.revision());
        if response.succeeded() {
            return Ok(Created::Granted(now));
        }
        if queue {
            let ops = response.op_responses();
            let stale = match ops.first() {
                Some(TxnOpResponse::Txn(created)) => crate::txn::stale_of(created),
                _ => None,
            };
            return Ok(Created::Queued {
                revision: stale.unwrap_or(now),
                stale: stale.is_some(),
                first: crate::txn::get_first(&ops, 1),
            });
        }
        let ours = match response.op_responses().first() {
            Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| kv.create_revision()),
            _ => None,
        };
        Ok(Created::Taken { ours })
    }

    async fn run_deletes(&self) {
        loop {
            let batch: Vec<Delete> = {
                let mut lane = lock(&self.deletes);
                if lane.pending.is_empty() {
                    lane.running = false;
                    return;
                }
                let take = lane.pending.len().min(MAX_BATCH);
                lane.pending.drain(..take).collect()
            };
            if batch.len() > 1 {
                let txn = Txn::new()
                    .when(
                        batch
                            .iter()
                            .map(|d| {
                                Compare::create_revision(
                                    d.key.as_str(),
                                    CompareOp::Equal,
                                    d.revision,
                                )
                            })
                            .collect::<Vec<_>>(),
                    )
                    .and_then(
                        batch
                            .iter()
                            .map(|d| TxnOp::delete(d.key.as_str(), None))
                            .collect::<Vec<_>>(),
                    );
                match self.client.kv_client().txn(txn).await {
                    Ok(response) if response.succeeded() => {
                        for delete in batch {
                            let _ = delete.reply.send(Ok(true));
                        }
                        continue;
                    }
                    // A compare failed: nothing was applied, so each answer of its own
                    // is exact.
                    Ok(_) => {}
                    // No answer: etcd may have applied it, and a delete sent again would
                    // find its key gone and report a released lock as lost. Each caller
                    // learns the outcome is unknown; its clean-up goes on in the
                    // background, where a key found gone is simply done.
                    Err(error) => {
                        for delete in batch {
                            let _ = delete.reply.send(Err(Error::unavailable(
                                crate::error::BACKEND,
                                format!(
                                    "the release's answer was lost ({error}); etcd may have \
                                     applied it, and the key is deleted in the background if not"
                                ),
                            )));
                        }
                        continue;
                    }
                }
            }
            join_all(batch.into_iter().map(|delete| async move {
                let answer =
                    crate::txn::delete_incarnation(&self.client, &delete.key, delete.revision)
                        .await;
                let _ = delete.reply.send(answer);
            }))
            .await;
        }
    }
}

/// What each caller of a combined create whose answer was lost is told: an error whose
/// outcome is unknown ([`crate::error::outcome_unknown`]), retryable.
fn unknown_outcome(error: &etcd_client::Error) -> etcd_client::Error {
    etcd_client::Error::IoError(std::io::Error::other(format!(
        "the answer to a combined create was lost ({error}); etcd may still apply it"
    )))
}

fn put(key: &str, lease: i64, value: &str) -> TxnOp {
    TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease)))
}
