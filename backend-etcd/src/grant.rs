//! The end of an acquire: our turn came, and our key becomes a guard (after moving onto
//! its fixed lease, for a fixed-lease grant).

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use fencelock_core::kit::Held;
use fencelock_core::{Error, FencingToken, Liveness, LockGuard};
use tokio::time::Instant;

use crate::cleanup::Armed;
use crate::error::{BACKEND, map};
use crate::held::EtcdGrant;
use crate::lock::EtcdLock;
use crate::session::Session;

impl EtcdLock {
    /// Turns our key, created at `revision` on `session`'s lease (a dedicated fixed
    /// lease when `fixed`), into a guard, once it is our turn.
    pub(crate) fn grant(
        &self,
        name: &str,
        session: Arc<Session>,
        fixed: bool,
        revision: i64,
        pending: Armed,
    ) -> Result<LockGuard, Error> {
        let inner = self.inner();
        // Anchored at the moment the request that started the lease was sent: the grant
        // of a fixed lease, the last keepalive of a renewing session.
        let valid_until = session.valid_until();
        if valid_until <= Instant::now() {
            // The lease ran out before the grant was confirmed (slow replies): the lock
            // may already be someone else's. Not a grant; the clean-up deletes our key.
            return Err(Error::unavailable(
                BACKEND,
                "the lease ran out before the grant was confirmed (etcd answered too slowly)",
            ));
        }
        let liveness = if fixed {
            Liveness::new(valid_until)
        } else {
            session.liveness()
        };
        if fixed && !inner.fixed.register(session.lease_id(), &liveness) {
            // Closed while granting: the clean-up revokes the lease.
            return Err(Error::Closed { backend: BACKEND });
        }
        let registration = (!fixed).then(|| session.register(liveness.clone()));
        let cleanup = pending.disarm();
        let name: Arc<str> = name.into();
        let grant = EtcdGrant::start(
            name.clone(),
            session,
            registration,
            fixed,
            liveness.clone(),
            cleanup,
            inner,
        );
        let held = Arc::new(Held::new(grant, liveness.clone()));
        let token = FencingToken::new(u64::try_from(revision).unwrap_or_default());
        Ok(LockGuard::with_name(name, token, BACKEND, liveness, held))
    }

    /// Our turn came for a fixed-lease lock queued on the renewing session: grants the
    /// fixed lease now (its TTL starts with this request) and moves our key onto it, if
    /// the key is still the incarnation we queued with (a put keeps the create revision,
    /// so the token is unchanged). Returns the fixed lease.
    pub(crate) async fn move_to_fixed_lease(
        &self,
        key: &str,
        revision: i64,
        ttl: Duration,
        name: &str,
        value: &str,
        pending: &mut Armed,
    ) -> Result<Arc<Session>, Error> {
        let fixed = Session::grant(&self.inner().client, ttl, &self.inner().runtime, None).await?;
        // From here the clean-up revokes the fixed lease as well as deleting our key.
        pending.fixed_lease = Some(fixed.lease_id());
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, revision)])
            .and_then([TxnOp::put(
                key,
                value,
                Some(PutOptions::new().with_lease(fixed.lease_id())),
            )]);
        let moved = self
            .inner()
            .client
            .kv_client()
            .txn(txn)
            .await
            .map_err(map)?
            .succeeded();
        if !moved {
            return Err(Error::lost(
                name,
                "our key disappeared before its fixed lease started (session expired or key deleted)",
            ));
        }
        // The key now lives and dies with the fixed lease alone.
        pending.session = None;
        Ok(fixed)
    }
}
