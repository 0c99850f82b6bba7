//! Waiting for the turn: watch only the immediate predecessor.

use etcd_client::{
    Client, EventType, GetOptions, SortOrder, SortTarget, WatchFilterType, WatchOptions,
};
use fencelock_core::Error;

use crate::error::map;
use crate::session::Session;

/// Waits until no key under `name_prefix` has a create revision below `my_rev`.
///
/// Each round reads the *last* key created before ours, watches it for deletion and, once
/// the watch exists, checks that the key is still that incarnation, so a deletion in
/// between is never missed and only one waiter wakes per release (no herd). Fails with [`Error::Lost`] as soon as `session` is
/// lost: a waiter whose lease expired must never be handed the lock (etcd #11456).
/// Returns whether it waited (`false`: nothing was before us at the first read).
///
/// Cancel safe: dropping it closes the watch.
pub(crate) async fn for_turn(
    client: &Client,
    name_prefix: &str,
    my_rev: i64,
    session: &Session,
    name: &str,
) -> Result<bool, Error> {
    let waiting = async {
        let mut kv = client.kv_client();
        let mut watch = client.watch_client();
        let mut waited = false;
        loop {
            let predecessor = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Descend)
                .with_max_create_revision(my_rev - 1)
                .with_limit(1)
                .with_keys_only();
            let read = kv.get(name_prefix, Some(predecessor)).await.map_err(map)?;
            let Some((key, created)) = read
                .kvs()
                .first()
                .map(|kv| (kv.key().to_vec(), kv.create_revision()))
            else {
                return Ok(waited);
            };
            waited = true;
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
            let now = kv
                .get(key, Some(GetOptions::new().with_keys_only()))
                .await
                .map_err(map)?;
            if now.kvs().first().map(|kv| kv.create_revision()) != Some(created) {
                continue;
            }
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
