//! The leases outside the sessions: a lease being granted ([`Unkept`], revoked unless
//! kept), the fixed leases of the locks a client holds ([`FixedLeases`], revoked at
//! close), and [`revoke`].

use std::time::Duration;

use etcd_client::Client;
use fencelock_core::{Error, Liveness, LossCause};
use tokio::runtime::Handle;

/// A lease being granted: revoked in the background, on the client's runtime, when
/// dropped before [`keep`](Unkept::keep) (the grant was cancelled or failed, maybe after
/// etcd applied it), also when it is dropped outside any runtime. Its ID is random and
/// positive; a collision with a live lease fails the grant (retryably), and the revoke
/// then does not run.
pub(crate) struct Unkept {
    client: Client,
    runtime: Handle,
    id: i64,
    armed: bool,
}

impl Unkept {
    /// A lease to grant with [`id`](Self::id); revoked on `runtime` unless kept.
    pub(crate) fn new(client: &Client, runtime: &Handle) -> Self {
        Unkept {
            client: client.clone(),
            runtime: runtime.clone(),
            id: fastrand::i64(1..i64::MAX),
            armed: true,
        }
    }

    /// The ID to grant the lease with.
    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// The lease is in use (or is someone else's): not revoked on drop.
    pub(crate) fn keep(&mut self) {
        self.armed = false;
    }
}

impl Drop for Unkept {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (mut leases, id) = (self.client.lease_client(), self.id);
        self.runtime.spawn(async move {
            // "Not found" may mean the cancelled grant has not reached etcd yet (the
            // revoke travels on another stream), so it is asked again a little later;
            // a grant that never arrives leaves nothing to undo.
            for _ in 0..3 {
                let revoked = tokio::time::timeout(Duration::from_secs(5), leases.revoke(id)).await;
                if matches!(revoked, Ok(Ok(_))) {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }
}

/// Revokes `lease`; one that is already gone counts as revoked.
pub(crate) async fn revoke(client: &Client, lease: i64) -> Result<(), Error> {
    match client.lease_client().revoke(lease).await {
        Ok(_) => Ok(()),
        Err(etcd_client::Error::GRpcStatus(status)) if status.message().contains("not found") => {
            Ok(())
        }
        Err(error) => Err(crate::error::map(error)),
    }
}

/// The fixed leases of the locks a client holds, each its own lease outside the
/// sessions, so that closing the client can revoke them too.
#[derive(Debug, Default)]
pub(crate) struct FixedLeases {
    state: std::sync::Mutex<FixedState>,
}

#[derive(Debug, Default)]
struct FixedState {
    /// Registers nothing more once set.
    closed: bool,
    /// The leases of the guards registered, some of which may have ended since.
    guards: Vec<(i64, Liveness)>,
    /// The length at which the ended guards are dropped from `guards` next: twice what
    /// was left the last time, so that dropping them costs O(1) per grant, amortized,
    /// however many are held (a pass at every grant cost O(held) each).
    prune_at: usize,
    /// Entries looked at by the passes, for the test of that bound.
    #[cfg(test)]
    scanned: usize,
}

/// The shortest list [`FixedLeases`] passes over for ended guards.
const FIXED_PRUNE_MIN: usize = 64;

impl FixedLeases {
    fn state(&self) -> std::sync::MutexGuard<'_, FixedState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a grant on fixed lease `lease`. Returns `false` when the client was
    /// closed meanwhile: the grant must not be handed out.
    pub(crate) fn register(&self, lease: i64, liveness: &Liveness) -> bool {
        let mut state = self.state();
        if state.closed {
            return false;
        }
        if state.guards.len() >= state.prune_at {
            // Forget the guards that ended, so the list stays within twice what is held.
            #[cfg(test)]
            {
                state.scanned += state.guards.len();
            }
            state.guards.retain(|(_, l)| !l.is_ended() && !l.is_lost());
            state.prune_at = (2 * state.guards.len()).max(FIXED_PRUNE_MIN);
        }
        state.guards.push((lease, liveness.clone()));
        true
    }

    /// Records that the guard on fixed lease `old` moved to lease `new` (an extension).
    /// Returns `false` when the client was closed meanwhile: `new` must be revoked.
    pub(crate) fn replace(&self, old: i64, new: i64) -> bool {
        let mut state = self.state();
        if state.closed {
            return false;
        }
        for entry in &mut state.guards {
            if entry.0 == old {
                entry.0 = new;
            }
        }
        true
    }

    /// Marks every registered guard lost, registers nothing more, and returns their
    /// leases to revoke.
    pub(crate) fn close(&self) -> Vec<i64> {
        let mut state = self.state();
        state.closed = true;
        state
            .guards
            .drain(..)
            .filter(|(_, l)| !l.is_ended())
            .map(|(lease, liveness)| {
                liveness.mark_lost(LossCause::ClientClosed, "the client was closed");
                lease
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use fencelock_core::Liveness;
    use tokio::time::Instant;

    use super::FixedLeases;

    fn live() -> Liveness {
        Liveness::new(Instant::now() + Duration::from_secs(60))
    }

    /// A grant on a fixed lease used to pass over every registered guard: O(held) per
    /// grant, 5 * 10^9 looks to fill 100,000.
    #[test]
    fn registering_costs_constant_time_per_grant_however_many_are_held() {
        let fixed = FixedLeases::default();
        let held: Vec<Liveness> = (0..20_000).map(|_| live()).collect();
        for (i, liveness) in held.iter().enumerate() {
            assert!(fixed.register(i as i64, liveness));
        }
        let scanned = fixed.state().scanned;
        assert!(scanned <= 2 * held.len(), "{scanned} entries looked at");
        assert_eq!(fixed.state().guards.len(), held.len());
    }

    #[test]
    fn ended_guards_are_forgotten_and_close_marks_the_rest_lost() {
        let fixed = FixedLeases::default();
        for i in 0..10_000 {
            let liveness = live();
            assert!(fixed.register(i, &liveness));
            liveness.end();
        }
        let kept = live();
        assert!(fixed.register(-1, &kept));
        assert!(fixed.state().guards.len() <= 2 * super::FIXED_PRUNE_MIN);
        assert!(fixed.replace(-1, -2));
        assert_eq!(fixed.close(), vec![-2]);
        assert!(kept.is_lost());
        assert!(!fixed.register(-3, &live()));
    }
}
