//! Extending a fixed-lease guard: etcd cannot change a lease's TTL, so the key moves onto
//! a fresh lease of the new length and the old one is revoked (see
//! [`Grant::extend`](fencelock_core::kit::Grant::extend) for [`EtcdGrant`]).

use std::sync::PoisonError;
use std::sync::atomic::Ordering;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, LeaseGrantOptions, PutOptions, Txn, TxnOp};
use fencelock_core::{Error, LossCause};
use tokio::time::Instant;

use super::{EtcdGrant, Shared};
use crate::error::{map, timed_out};
use crate::leases::Unkept;
use crate::session::DRIFT_MARGIN;

impl EtcdGrant {
    /// The work of [`Grant::extend`](fencelock_core::kit::Grant::extend), documented
    /// there (the kit checked `lease` already): waits for this guard's turn to extend,
    /// then moves the key in a task of its own.
    pub(super) async fn move_to_new_lease(&self, lease: Duration) -> Result<Instant, Error> {
        let (Some(fixed), Some(turns)) = (self.fixed.clone(), self.extending.clone()) else {
            return Err(Error::not_a_fixed_lease());
        };
        let seconds = crate::config::lease_seconds(lease)?;
        // Waited for before anything is read or sent: a call dropped here did nothing.
        let turn = turns.lock_owned().await;
        let (client, runtime, timeout, old, maybe) = {
            let cleanup = self
                .shared
                .cleanup
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match cleanup.as_ref().and_then(|c| c.fixed_lease.map(|l| (c, l))) {
                Some((c, old)) => (
                    c.client.clone(),
                    c.runtime.clone(),
                    c.timeout,
                    old,
                    c.moved_maybe.clone(),
                ),
                None => return Err(Error::lost(&*self.name, "the lock was already given up")),
            }
        };
        let shared = self.shared.clone();
        let (key, revision) = (shared.key.clone(), shared.revision);
        let home = runtime.clone();
        let work = async move {
            // This guard's next extend starts when this one is done.
            let _turn = turn;
            let sent = Instant::now();
            // The conservative end of the new lease, anchored before its grant is sent.
            let end = DRIFT_MARGIN.conservative_end(sent, lease);
            // The new lease's ID is chosen before the request: a grant that times out
            // after etcd applied it, or any exit below that does not keep the lease, has
            // it revoked in the background (with retries), instead of a keyless lease
            // living out its TTL (up to a year) unseen.
            let mut unkept = Unkept::new(&client, &home);
            let options = LeaseGrantOptions::new().with_id(unkept.id());
            let granted = match tokio::time::timeout(
                timeout,
                client.lease_client().grant(seconds, Some(options)),
            )
            .await
            {
                Err(_) => return Err(timed_out("granting the extended lease")),
                Ok(Err(error)) => {
                    if crate::error::is_lease_exists(&error) {
                        // Someone else's lease has this ID: never revoke it.
                        unkept.keep();
                    }
                    return Err(map(error));
                }
                Ok(Ok(granted)) => granted,
            };
            let new = granted.id();
            let revoke = |lease: i64| {
                let client = client.clone();
                tokio::spawn(async move { client.lease_client().revoke(lease).await })
            };
            if granted.ttl() != seconds {
                return Err(Error::InvalidConfig(format!(
                    "etcd granted a {} s lease when {seconds} s was asked; the server's minimum TTL is higher",
                    granted.ttl()
                )));
            }
            // The key is on `old`, or on one of the leases earlier extends moved it onto
            // without confirmation (`maybe`): moved from `old` first, and from the lease a
            // read finds it on if that is one of those.
            let mut from = old;
            let mut tries = maybe.len() + 1;
            let moved = loop {
                let txn = Txn::new()
                    .when([
                        Compare::create_revision(&*key, CompareOp::Equal, revision),
                        Compare::lease(&*key, CompareOp::Equal, from),
                    ])
                    .and_then([TxnOp::put(
                        &*key,
                        "",
                        Some(PutOptions::new().with_lease(new).with_ignore_value()),
                    )]);
                let answer = tokio::time::timeout(timeout, client.kv_client().txn(txn)).await;
                // `None`: etcd refused the move (our incarnation is not on `from`).
                // `unknown`: etcd may still apply it (a timeout, a broken connection),
                // whatever a read finds now.
                let (error, unknown) = match answer {
                    Ok(Ok(response)) if response.succeeded() => break true,
                    Ok(Ok(_)) => (None, false),
                    Ok(Err(error)) => {
                        let unknown = crate::error::outcome_unknown(&error);
                        (Some(map(error)), unknown)
                    }
                    Err(_) => (
                        Some(timed_out("moving the key onto the extended lease")),
                        true,
                    ),
                };
                if let Some(error) = &error {
                    tracing::debug!(%key, %error, unknown, "etcd extend: the move was not confirmed");
                }
                // Which lease is our incarnation on now (`None`: gone or replaced)?
                let mut kv = client.kv_client();
                let read = tokio::time::timeout(
                    timeout,
                    kv.get(&*key, Some(GetOptions::new().with_keys_only())),
                )
                .await;
                let on = match (read, error) {
                    (Ok(Ok(read)), error) => (
                        read.kvs()
                            .first()
                            .filter(|kv| kv.create_revision() == revision)
                            .map(|kv| kv.lease()),
                        error,
                    ),
                    // Refused, and where the key is now is unknown: not a loss.
                    (_, None) => return Err(not_confirmed()),
                    (_, Some(error)) => {
                        // Still unknown: the key may live on `new`.
                        if unknown {
                            keep_unconfirmed(&shared, &mut unkept, new, end);
                        }
                        return Err(error);
                    }
                };
                tries -= 1;
                match on {
                    (Some(lease), _) if lease == new => break true,
                    // Not moved yet, but etcd may still apply the move (its request may
                    // be on its way, or in etcd's log): the key may come to live on
                    // `new`, which is kept, and the deadline comes down to its end.
                    (Some(lease), Some(error)) if lease == from && unknown => {
                        keep_unconfirmed(&shared, &mut unkept, new, end);
                        return Err(error);
                    }
                    // Not moved, and never will be: the guard keeps its lease and
                    // deadline; `new` is revoked.
                    (Some(lease), Some(error)) if lease == from => return Err(error),
                    (Some(lease), None) if lease == from => return Err(not_confirmed()),
                    // An earlier extend's unconfirmed move did land: move it from there.
                    (Some(lease), _) if maybe.contains(&lease) => {
                        if tries == 0 {
                            return Err(not_confirmed());
                        }
                        from = lease;
                    }
                    // Gone, replaced, or on a lease no extend of ours put it on (whose
                    // end we cannot know).
                    _ => break false,
                }
            };
            if !moved {
                // Marked here, not by the caller: a dropped extend reports it too. Unless
                // the holder released meanwhile (which deleted the key): no loss then.
                let reason = "the key was gone (or no longer ours) when extending its lease";
                if !shared.releasing.load(Ordering::SeqCst) {
                    shared.liveness.mark_lost(LossCause::KeyGone, reason);
                }
                return Err(Error::lost(&*key, reason));
            }
            // The key lives on `new` now. A release that took the clean-up meanwhile
            // revokes `old` only, and a closed client registers nothing: revoke `new` too.
            let kept = {
                let mut cleanup = shared
                    .cleanup
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                match cleanup.as_mut() {
                    Some(c) if c.fixed_lease == Some(old) && fixed.replace(old, new) => {
                        c.fixed_lease = Some(new);
                        // No earlier unconfirmed move holds the key any more.
                        c.moved_maybe.retain(|lease| !maybe.contains(lease));
                        true
                    }
                    _ => false,
                }
            };
            if !kept {
                // A release took the clean-up: the holder gave the lock up, nothing was
                // lost. A close did: the lock goes with the client, which is a loss.
                let reason = "the lock was released or closed while extending";
                if !shared.releasing.load(Ordering::SeqCst) {
                    shared.liveness.mark_lost(LossCause::KeyGone, reason);
                }
                return Err(Error::lost(&*key, reason));
            }
            unkept.keep();
            // Set here, not by the caller: an extend whose future was dropped still
            // moved the key, and the deadline follows the new lease even when it ends
            // earlier than the old one did (by up to one drift margin).
            shared.liveness.confirm_extension(end);
            for lease in std::iter::once(old).chain(maybe) {
                revoke(lease);
            }
            Ok(end)
        };
        match runtime.spawn(work).await {
            // The task marked the guard lost.
            Ok(Err(Error::Lost { reason, .. })) => Err(Error::lost(&*self.name, reason)),
            Ok(outcome) => outcome,
            Err(_) => Err(Error::unavailable(
                crate::error::BACKEND,
                "the extend task failed",
            )),
        }
    }
}

/// Keeps `new`, onto which a move of the key was sent whose outcome is unknown: the key
/// may live on it (now, or once etcd applies the move), and only this extend knows it.
/// The clean-up (release, drop, loss) then deletes the key itself, not only by revoking
/// the fixed lease, and revokes `new`; so does the next extend that moves the key. With
/// the clean-up already taken (a release or a loss meanwhile) `new` is revoked at once:
/// that deletes the key if the move lands first, and makes the move fail after it.
///
/// The key is on the lease it was on or on `new`, whichever etcd applied: the guard's
/// deadline comes down to `end`, the conservative end of `new`, when that is earlier
/// than the one it has (a shorter lease, or one whose conservative end lies within the
/// drift margin before the old deadline), and otherwise stays.
fn keep_unconfirmed(shared: &Shared, unkept: &mut Unkept, new: i64, end: Instant) {
    // Only extends move a fixed lease's deadline, and they take turns (this one has
    // it): nothing raises the deadline between the read and the write.
    if end < shared.liveness.valid_until() {
        shared.liveness.confirm_extension(end);
    }
    if let Some(c) = shared
        .cleanup
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_mut()
    {
        c.moved_maybe.push(new);
        unkept.keep();
    }
}

/// An extend that could not learn whether it moved the key, while the key is still ours:
/// not a loss; the guard keeps the deadline it had (lowered first if the key may be on a
/// lease that ends earlier, see [`keep_unconfirmed`]).
fn not_confirmed() -> Error {
    Error::unavailable(
        crate::error::BACKEND,
        "etcd did not confirm the extension; the lock is still held until its current deadline",
    )
}
