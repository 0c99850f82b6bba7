//! Waiting for the turn: watch only the immediate predecessor.

use etcd_client::{
    Client, EventType, GetOptions, KvClient, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
    WatchFilterType, WatchOptions,
};
use std::future::Future;
use std::pin::Pin;

use fencelock_core::Error;
use fencelock_core::kit::delayed::sleep_until;
use tokio::time::{Duration, Instant};

use crate::error::map;
use crate::session::Session;

/// Runs `step` of a request queued (or queueing) on `session` until the session is
/// lost: then the request fails with `Lost`, or `Closed` if `close` ended the session.
/// Every step from the queue key's create to the turn runs so: etcd may have applied the
/// create while a cut that outlives the lease holds its answer, and the waiter is told
/// at the session's deadline, not when the answer comes.
pub(crate) async fn until_lost<T>(
    session: &Session,
    name: &str,
    step: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::select! {
        result = step => result,
        () = session.lost() => Err(if session.closed() {
            Error::Closed { backend: crate::error::BACKEND }
        } else {
            Error::lost(name, "the etcd session was lost while waiting")
        }),
    }
}

/// When, after a watch was created, its key is read again to catch a deletion etcd may
/// deliver late.
///
/// etcd creates a watch "from now" at the revision it read just before registering it;
/// if a write lands in between (frequent on a contended name), the watch starts out
/// *unsynced*, and its events are delivered only by etcd's catch-up pass, every 100 ms.
/// A predecessor deleted in that window woke its waiter 60-100 ms late: measured with 4
/// clients on one name, about one hand-off in eight, and most of the run's time. A watch
/// is caught up (synced) after one pass, so the key is read again only during its first
/// 200 ms, ever less often: a waiter that waits longer costs six reads more, a short
/// wait fewer or none.
const LATE_EVENT_CHECKS: [Duration; 6] = [
    Duration::from_millis(5),
    Duration::from_millis(10),
    Duration::from_millis(20),
    Duration::from_millis(40),
    Duration::from_millis(80),
    Duration::from_millis(200),
];

/// Waits until no key under `name_prefix` has a create revision below `my_rev`, and
/// confirms that our own key (`own_key`) is still the one created at `my_rev`.
///
/// Each round reads the *last* key created before ours, watches it for deletion and, once
/// the watch exists, checks that the key is still that incarnation, so a deletion in
/// between is never missed and only one waiter wakes per release (no herd). Fails with [`Error::Lost`] as soon as `session` is
/// lost: a waiter whose lease expired must never be handed the lock (etcd #11456), and
/// with [`Error::Lost`] if our key is gone: each predecessor read also reads our key, in
/// one transaction, so the last one both finds the way clear and proves the key is still
/// ours at that revision (a separate read of our key afterwards cost a round trip per
/// hand-over).
///
/// Cancel safe: dropping it closes the watch.
pub(crate) async fn for_turn(
    client: &Client,
    (name_prefix, own_key): (&str, &str),
    my_rev: i64,
    session: &Session,
    name: &str,
) -> Result<(), Error> {
    let waiting = async {
        let mut kv = client.kv_client();
        let mut watch = client.watch_client();
        loop {
            let predecessor = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Descend)
                .with_max_create_revision(my_rev - 1)
                .with_limit(1)
                .with_keys_only();
            let reads = Txn::new().and_then([
                TxnOp::get(name_prefix, Some(predecessor)),
                TxnOp::get(own_key, Some(GetOptions::new().with_keys_only())),
            ]);
            let read = kv.txn(reads).await.map_err(map)?;
            let mut gets = read.op_responses().into_iter().filter_map(|op| match op {
                TxnOpResponse::Get(get) => Some(get),
                _ => None,
            });
            let (before, own) = (gets.next(), gets.next());
            if own
                .as_ref()
                .and_then(|own| own.kvs().first())
                .map(|kv| kv.create_revision())
                != Some(my_rev)
            {
                return Err(Error::lost(
                    name,
                    "our key disappeared while waiting (session expired or key deleted)",
                ));
            }
            let Some((key, created)) = before
                .as_ref()
                .and_then(|before| before.kvs().first())
                .map(|kv| (kv.key().to_vec(), kv.create_revision()))
            else {
                return Ok(());
            };
            // Watch from now, not from the read's revision: a watch starting in the past
            // is caught up by etcd's background sync, every 100 ms, which would add up to
            // that much to every hand-over. A deletion between the read and the watch is
            // caught by checking, once the watch exists, that the key is still there.
            let options = WatchOptions::new().with_filters([WatchFilterType::NoPut]);
            let mut events = watch.watch(key.clone(), Some(options)).await.map_err(map)?;
            match events.message().await.map_err(map)? {
                Some(refused) if refused.canceled() => {
                    return Err(Error::backend(
                        crate::error::BACKEND,
                        false,
                        format!(
                            "etcd refused to watch the waiting turn: {}",
                            refused.cancel_reason()
                        ),
                    ));
                }
                Some(created) if created.created() && created.events().is_empty() => {}
                _ => continue,
            }
            if !still_there(&mut kv, &key, created).await? {
                continue;
            }
            // Waits for the deletion. etcd may deliver it late if it happens soon after
            // the watch was created: see [`LATE_EVENT_CHECKS`].
            // These reads only hasten what the watch reports anyway: one runs beside the
            // watch (a slow read never holds up its event), and one that fails is no
            // news (an election's failed read must not fail the acquire and cost it its
            // place in the queue).
            let watched = Instant::now();
            let mut checks = LATE_EVENT_CHECKS.iter();
            let mut next_check = checks.next().map(|after| watched + *after);
            let mut reading: Option<Read> = None;
            loop {
                tokio::select! {
                    message = events.message() => {
                        let Some(response) = message.map_err(map)? else { break };
                        let deleted = response
                            .events()
                            .iter()
                            .any(|e| e.event_type() == EventType::Delete);
                        if deleted || response.canceled() {
                            break;
                        }
                    }
                    () = sleep_until(next_check), if reading.is_none() => {
                        next_check = checks.next().map(|after| watched + *after);
                        let (mut kv, key) = (kv.clone(), key.clone());
                        reading = Some(Box::pin(async move {
                            still_there(&mut kv, &key, created).await
                        }));
                    }
                    read = async {
                        match reading.as_mut() {
                            Some(read) => read.await,
                            None => std::future::pending().await,
                        }
                    }, if reading.is_some() => {
                        reading = None;
                        if let Ok(false) = read {
                            break;
                        }
                    }
                }
            }
        }
    };
    until_lost(session, name, waiting).await
}

/// A [`still_there`] read in flight beside the watch.
type Read = Pin<Box<dyn Future<Output = Result<bool, Error>> + Send>>;

/// Whether `key` is still the incarnation created at `created` (a linearizable read).
async fn still_there(kv: &mut KvClient, key: &[u8], created: i64) -> Result<bool, Error> {
    let now = kv
        .get(key, Some(GetOptions::new().with_keys_only()))
        .await
        .map_err(map)?;
    Ok(now.kvs().first().map(|kv| kv.create_revision()) == Some(created))
}
