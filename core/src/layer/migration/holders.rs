//! Who holds a migration lock, as `inspect`, `list` and `revoke` report it: each leg's
//! holder merged into one, with a token in the lock's own order (the rule is in the
//! [migration module's documentation](super#who-holds-it)).

use std::collections::BTreeMap;

use super::MigrationLock;
use super::acquire::Leg;
use super::token::era_token;
use crate::{Error, FencingToken, HolderInfo, ListedLock, LockInfo};

/// The holder the lock reports from its legs' holders: the first leg's when it has one,
/// else the second's, with the token its rule gives.
fn merged(
    first: (&Leg, Option<HolderInfo>),
    second: Option<(&Leg, Option<HolderInfo>)>,
) -> Result<Option<HolderInfo>, Error> {
    let (first_leg, first_holder) = first;
    if let Some(mut holder) = first_holder {
        holder.token = era_token(first_leg.epoch, holder.token)?;
        return Ok(Some(holder));
    }
    let Some((second_leg, Some(mut holder))) = second else {
        return Ok(None);
    };
    let floor = era_token(first_leg.epoch, FencingToken::new(0))?;
    holder.token = era_token(second_leg.epoch, holder.token)?.min(floor);
    Ok(Some(holder))
}

/// [`DistributedLock::inspect`](crate::DistributedLock::inspect) of both legs: the
/// waiters are the first leg's.
pub(super) async fn inspect(lock: &MigrationLock, name: &str) -> Result<LockInfo, Error> {
    let mut info = lock.first.lock.inspect(name).await?;
    let second = match &lock.second {
        Some(leg) => Some((leg, leg.lock.inspect(name).await?.holder)),
        None => None,
    };
    info.holder = merged((&lock.first, info.holder.take()), second)?;
    Ok(info)
}

/// [`DistributedLock::list`](crate::DistributedLock::list) of both legs: every name
/// either leg lists, each as [`inspect`] reports it (the waiters are those of the first
/// leg when it lists the name, else the second's).
pub(super) async fn list(lock: &MigrationLock, prefix: &str) -> Result<Vec<ListedLock>, Error> {
    // By name: the info its waiters come from, and each leg's holder.
    let mut found: BTreeMap<String, (LockInfo, Option<HolderInfo>, Option<HolderInfo>)> =
        BTreeMap::new();
    for mut listed in lock.first.lock.list(prefix).await? {
        let holder = listed.info.holder.take();
        found.insert(listed.name, (listed.info, holder, None));
    }
    if let Some(second) = &lock.second {
        for mut listed in second.lock.list(prefix).await? {
            let holder = listed.info.holder.take();
            found
                .entry(listed.name)
                .or_insert((listed.info, None, None))
                .2 = holder;
        }
    }
    found
        .into_iter()
        .map(|(name, (mut info, first, second))| {
            let second = lock.second.as_ref().map(|leg| (leg, second));
            info.holder = merged((&lock.first, first), second)?;
            Ok(ListedLock::new(name, info))
        })
        .collect()
}

/// [`DistributedLock::revoke`](crate::DistributedLock::revoke) on both legs: the holder
/// the first leg had, else the second's, as [`inspect`] reports it.
pub(super) async fn revoke(lock: &MigrationLock, name: &str) -> Result<Option<HolderInfo>, Error> {
    let first = lock.first.lock.revoke(name).await?;
    let second = match &lock.second {
        Some(leg) => Some((leg, leg.lock.revoke(name).await?)),
        None => None,
    };
    merged((&lock.first, first), second)
}
