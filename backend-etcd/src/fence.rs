//! Fenced writes: make your own transaction conditional on still holding the lock.

use etcd_client::{Compare, CompareOp};
use fencelock_core::{Error, LockGuard};

use crate::error::BACKEND;

/// The compare "the holder's key still has the create revision of this grant", for the
/// `when` clause of your own etcd transaction.
///
/// The transaction then takes effect only if this guard's key exists as created at grant
/// time: a holder whose lease expired, or whose key was deleted, cannot write, however
/// late its request arrives. This is the etcd counterpart of a fencing-token check, done
/// by etcd itself (Go's `Mutex.IsOwner()`).
///
/// # Errors
///
/// [`Error::InvalidConfig`] if the guard does not come from the etcd backend.
///
/// # Examples
///
/// ```no_run
/// use etcd_client::{Txn, TxnOp};
/// use fencelock_core::DistributedLockExt;
/// use fencelock_etcd::{EtcdConfig, EtcdLock, owner_compare};
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let locks = EtcdLock::connect(EtcdConfig::from_url("etcd://127.0.0.1:2379/locks")?).await?;
/// let guard = locks.lock("ledger").await?;
/// let txn = Txn::new()
///     .when([owner_compare(&guard)?])
///     .and_then([TxnOp::put("ledger/balance", "42", None)]);
/// let applied = locks.client().kv_client().txn(txn).await?.succeeded();
/// assert!(applied, "only the current holder's write applies");
/// guard.release().await?;
/// # Ok(()) }
/// ```
pub fn owner_compare(guard: &LockGuard) -> Result<Compare, Error> {
    match (guard.backend(), guard.backend_key()) {
        (BACKEND, Some(key)) => {
            let revision = i64::try_from(guard.token().get()).map_err(|_| {
                Error::InvalidConfig("etcd: the token is not an etcd revision".into())
            })?;
            Ok(Compare::create_revision(key, CompareOp::Equal, revision))
        }
        (other, _) => Err(Error::InvalidConfig(format!(
            "owner_compare needs a guard from the etcd backend, not from {other}"
        ))),
    }
}
