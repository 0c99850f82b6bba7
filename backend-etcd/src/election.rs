//! Leader election in etcd, in the layout of etcd's Go `concurrency.Election` (and
//! `etcdctl elect`): every candidate puts `{prefix}/{election}/{lease id}` with its value
//! on its session lease; the key with the lowest create revision is the leader, and its
//! create revision is the term's token. Campaigning is taking the lock of the same name
//! with the value in the key, so the lock's queueing, cancellation and loss reporting
//! apply unchanged.
//!
//! Observers read every candidate key once and then follow the watch of the election's
//! key range, applying each event in order, so every change of leader is reported, none
//! skipped, without polling.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, KeyValue, WatchOptions};
use fencelock_core::{Error, FencingToken, Leader, LeaderChange};
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;

use crate::error::{BACKEND, map};

/// The candidates of one election: key → (create revision, value).
#[derive(Debug, Default)]
pub(crate) struct Candidates {
    keys: BTreeMap<Vec<u8>, (i64, String)>,
}

impl Candidates {
    /// The candidates in `kvs` (a range read).
    pub(crate) fn from_kvs(kvs: &[KeyValue]) -> Self {
        let mut candidates = Candidates::default();
        for kv in kvs {
            candidates.put(kv);
        }
        candidates
    }

    fn put(&mut self, kv: &KeyValue) {
        let value = String::from_utf8_lossy(kv.value()).into_owned();
        self.keys
            .insert(kv.key().to_vec(), (kv.create_revision(), value));
    }

    /// The leader: the first-created candidate.
    pub(crate) fn leader(&self) -> Option<Leader> {
        self.keys
            .values()
            .min_by_key(|(revision, _)| *revision)
            .map(|(revision, value)| {
                Leader::new(
                    value.clone(),
                    FencingToken::new(u64::try_from(*revision).unwrap_or_default()),
                )
            })
    }
}

/// The whole key range of an election, in one read: the candidates and the revision
/// they were read at.
pub(crate) async fn read(client: &Client, names: &str) -> Result<(Candidates, i64), Error> {
    let response = client
        .kv_client()
        .get(names, Some(GetOptions::new().with_prefix()))
        .await
        .map_err(map)?;
    let revision = response.header().map_or(0, |h| h.revision());
    Ok((Candidates::from_kvs(response.kvs()), revision))
}

/// Follows the election whose key range is `names` from `revision` (the revision
/// `candidates` were read at), sending each change of leader to `changes`, until `stop`
/// is cancelled or nobody listens any more. A broken watch is reopened where it left off;
/// one whose history was compacted away starts again from a fresh read.
pub(crate) async fn follow(
    client: Arc<Client>,
    names: String,
    candidates: Candidates,
    revision: i64,
    changes: UnboundedSender<LeaderChange>,
    stop: CancellationToken,
) {
    let stopped = follow_until_stopped(
        client,
        names,
        candidates,
        revision,
        changes.clone(),
        stop.clone(),
    )
    .await;
    if stopped {
        // Stopped by the client's close: the stream ends with `Closed`, as on every
        // backend. (A dropped stream cancels `stop` too, but has no receiver left.) Not
        // after an error of its own: the stream ends with that one.
        let _ = changes.send(Err(Error::Closed { backend: BACKEND }));
    }
}

/// [`follow`] until `stop` is cancelled, the session or client is gone, or nobody
/// listens.
async fn follow_until_stopped(
    client: Arc<Client>,
    names: String,
    mut candidates: Candidates,
    mut revision: i64,
    changes: UnboundedSender<LeaderChange>,
    stop: CancellationToken,
) -> bool {
    let mut last = candidates.leader();
    let announce = |candidates: &Candidates, last: &mut Option<Leader>| {
        let now = candidates.leader();
        if now != *last {
            *last = now.clone();
            return changes.send(Ok(now)).is_ok();
        }
        !changes.is_closed()
    };
    loop {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1)
            .with_prev_key();
        let mut watcher = client.watch_client();
        let opened = tokio::select! {
            () = stop.cancelled() => return true,
            opened = watcher.watch(names.as_str(), Some(options)) => opened,
        };
        let mut stream = match opened {
            Ok(stream) => stream,
            Err(error) => {
                tracing::debug!(%error, "etcd election watch failed to open; retrying");
                tokio::select! {
                    () = stop.cancelled() => return true,
                    () = tokio::time::sleep(Duration::from_millis(200)) => continue,
                }
            }
        };
        loop {
            let message = tokio::select! {
                () = stop.cancelled() => return true,
                message = stream.message() => message,
            };
            let Ok(Some(response)) = message else {
                break;
            };
            if response.compact_revision() > 0 || response.canceled() {
                // History we have not seen is gone, or etcd ended the watch for another
                // reason (a permission revoked meanwhile): it sends nothing more on it.
                // Read the candidates anew and watch again from there; a read refused
                // for good ends the observation with that error.
                let compacted = response.compact_revision() > 0;
                if !compacted {
                    tracing::debug!(
                        reason = response.cancel_reason(),
                        "etcd cancelled the election watch; reading the candidates anew"
                    );
                }
                match read(&client, &names).await {
                    Ok((fresh, at)) => {
                        (candidates, revision) = (fresh, at);
                        if !announce(&candidates, &mut last) {
                            return false;
                        }
                    }
                    Err(error) if !error.is_retryable() => {
                        let _ = changes.send(Err(error));
                        return false;
                    }
                    Err(error) => {
                        tracing::debug!(%error, "etcd election re-read failed; retrying");
                    }
                }
                if !compacted {
                    // Not at once: a watch etcd keeps refusing must not spin.
                    tokio::select! {
                        () = stop.cancelled() => return true,
                        () = tokio::time::sleep(Duration::from_millis(200)) => {}
                    }
                }
                break;
            }
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                match event.event_type() {
                    EventType::Put => candidates.put(kv),
                    EventType::Delete => {
                        candidates.keys.remove(kv.key());
                    }
                }
                revision = revision.max(kv.mod_revision());
                if !announce(&candidates, &mut last) {
                    return false;
                }
            }
            // Not the header's revision: etcd stamps the current revision on the `created`
            // answer and on catch-up batches before every event up to it was delivered,
            // so a watch reopened after it could skip a leader's deletion. From the
            // events' own revisions, a reopened watch replays at worst a little (or, if
            // that history was compacted, reads the candidates anew).
        }
        if changes.is_closed() {
            return false;
        }
    }
}
