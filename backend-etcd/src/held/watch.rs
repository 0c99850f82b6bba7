//! The key watch of a held lock: a deletion by anyone else marks the guard lost, and a
//! lost guard's key is given up in the background.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use fencelock_core::LossCause;

use super::Shared;
use crate::watches::{Ended, KeyWatch, KeyWatches};

/// Watches a held guard's key until the guard ends, and gives the key up if the guard
/// is lost first.
///
/// - A deletion by anyone but our own release (an operator, lease expiry) marks the
///   guard lost. The watch runs on the client's shared stream from the grant's revision,
///   so nothing since the grant is missed; if etcd compacted that history, the key is
///   read instead and watched again from the read's revision.
/// - Once the guard is lost (key deleted, session lost, deadline passed), its key is
///   deleted in the background right away, so the lock does not stay blocked by a key
///   nobody uses, and the client's turn for the name is passed on.
///
/// A guard with a fixed lease is watched with a timer. A guard on the session lease is
/// marked lost by the session at their shared deadline, so it needs no timer: with
/// 100,000 held locks, that saves as many timers.
///
/// One flat future (every held lock keeps one): the futures it waits on are made in
/// place each round, not nested and moved, which kept several copies of their state.
pub(super) async fn watch_held(shared: Arc<Shared>, watches: Arc<KeyWatches>, client: Arc<Client>) {
    let mut watch = Some(watches.watch(shared.key.clone(), shared.revision + 1));
    loop {
        let ended = tokio::select! {
            biased;
            () = shared.liveness.ended() => return,
            () = lost(&shared) => break,
            ended = ended_of(&mut watch) => ended,
        };
        watch = None;
        let reason = "the lock's key was deleted (lease expired or removed by someone else)";
        match ended {
            Ended::Deleted => {
                if !shared.releasing.load(Ordering::SeqCst) {
                    shared.liveness.mark_lost(LossCause::KeyGone, reason);
                }
            }
            Ended::Refused(refusal) => {
                tracing::warn!(key = %shared.key, reason = %refusal, "etcd refused to watch a held lock's key; its loss is found by its deadline only");
            }
            Ended::Compacted(_) => {
                // Boxed: the read's future is large, and every held lock's watch would
                // carry its room otherwise.
                let read = tokio::select! {
                    biased;
                    () = shared.liveness.ended() => return,
                    () = lost(&shared) => break,
                    read = Box::pin(read_incarnation(&client, &shared.key, shared.revision)) => read,
                };
                match read {
                    Some(now) => watch = Some(watches.watch(shared.key.clone(), now + 1)),
                    None if !shared.releasing.load(Ordering::SeqCst) => {
                        shared.liveness.mark_lost(LossCause::KeyGone, reason);
                    }
                    None => {}
                }
            }
        }
    }
    if shared.liveness.is_ended() {
        return;
    }
    if let Some(cleanup) = shared.take_cleanup() {
        cleanup.spawn();
    }
}

/// Completes when the guard is lost: at its own deadline for a fixed lease, when marked
/// lost otherwise.
async fn lost(shared: &Shared) {
    if shared.timed {
        // Boxed: a timer is large, and only fixed-lease guards carry one.
        Box::pin(shared.liveness.lost()).await;
    } else {
        shared.liveness.marked_lost().await;
    }
}

/// How the key watch ended; pending once there is none (the loss or the end of the
/// guard is awaited then).
async fn ended_of(watch: &mut Option<KeyWatch>) -> Ended {
    match watch {
        Some(watch) => watch.ended().await,
        None => std::future::pending().await,
    }
}

/// Reads `key` until etcd answers: the revision of the answer if the key is still the
/// incarnation created at `revision`, `None` if it is gone or replaced.
async fn read_incarnation(client: &Client, key: &str, revision: i64) -> Option<i64> {
    loop {
        let read = client
            .kv_client()
            .get(key, Some(GetOptions::new().with_keys_only()))
            .await;
        match read {
            Ok(read) if read.kvs().first().map(|kv| kv.create_revision()) == Some(revision) => {
                return read.header().map(|h| h.revision());
            }
            Ok(_) => return None,
            Err(error) => {
                tracing::debug!(%key, %error, "etcd: reading a held lock's key after a compaction failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
