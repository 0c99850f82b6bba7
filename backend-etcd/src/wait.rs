//! Waiting for the turn: watch only the immediate predecessor.

use etcd_client::{
    Client, EventType, GetOptions, SortOrder, SortTarget, WatchFilterType, WatchOptions,
};
use fencelock_core::Error;

use crate::error::map;
use crate::session::Session;

/// Waits until no key under `name_prefix` has a create revision below `my_rev`.
///
/// Each round reads the *last* key created before ours and watches it for deletion from
/// the revision of that read, so a deletion in between is never missed and only one
/// waiter wakes per release (no herd). Fails with [`Error::Lost`] as soon as `session` is
/// lost: a waiter whose lease expired must never be handed the lock (etcd #11456).
///
/// Cancel safe: dropping it closes the watch.
pub(crate) async fn for_turn(
    client: &Client,
    name_prefix: &str,
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
            let read = kv.get(name_prefix, Some(predecessor)).await.map_err(map)?;
            let Some(key) = read.kvs().first().map(|kv| kv.key().to_vec()) else {
                return Ok(());
            };
            let from = read.header().map_or(0, |h| h.revision()) + 1;
            let options = WatchOptions::new()
                .with_start_revision(from)
                .with_filters([WatchFilterType::NoPut]);
            let mut events = watch.watch(key, Some(options)).await.map_err(map)?;
            while let Some(response) = events.message().await.map_err(map)? {
                let deleted = response
                    .events()
                    .iter()
                    .any(|e| e.event_type() == EventType::Delete);
                if deleted || response.canceled() {
                    break;
                }
            }
        }
    };
    tokio::select! {
        result = waiting => result,
        _ = session.lost() => Err(Error::lost(name, "the etcd session was lost while waiting")),
    }
}
