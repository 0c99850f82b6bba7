//! One contender per (session, name) inside a client.
//!
//! A client's key for a name is `{name prefix}{lease id}`: two tasks of one client
//! contending for the same name would share it. Instead they queue here, in FIFO order,
//! and only the task at the front puts a key in etcd. The permit travels with the guard
//! and is returned only after the key is deleted, so a new incarnation of the key can never
//! be confused with one whose deletion is still in flight.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Mutex as FifoMutex, OwnedMutexGuard};

#[derive(Debug, Default)]
pub(crate) struct Gates {
    /// By key, which is shared with the permits and the guard: one copy per held lock.
    gates: Mutex<HashMap<Arc<str>, Arc<Gate>>>,
}

#[derive(Debug, Default)]
struct Gate {
    /// The key is `{name prefix}{lease id}`: the name prefix is its first this many bytes.
    prefix_len: usize,
    turn: Arc<FifoMutex<()>>,
    queued: AtomicUsize,
}

/// The right to contend in etcd with one key. Dropping it passes the turn on.
#[derive(Debug)]
pub(crate) struct GatePermit {
    gates: Arc<Gates>,
    key: Arc<str>,
    turn: Option<OwnedMutexGuard<()>>,
}

impl Gates {
    fn gate(self: &Arc<Self>, key: &Arc<str>, name_prefix: &str) -> Arc<Gate> {
        debug_assert!(key.starts_with(name_prefix));
        self.gates
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key.clone())
            .or_insert_with(|| {
                Arc::new(Gate {
                    prefix_len: name_prefix.len(),
                    ..Gate::default()
                })
            })
            .clone()
    }

    /// Waits for the turn to contend with `key`.
    ///
    /// Cancel safe: a dropped wait leaves the queue.
    pub(crate) async fn enter(self: &Arc<Self>, key: &Arc<str>, name_prefix: &str) -> GatePermit {
        // Made before `gate`, so dropped after it: a permit dropped unfilled (this future
        // cancelled) must find the map's reference the only one left to forget the key.
        let mut permit = GatePermit {
            gates: self.clone(),
            key: key.clone(),
            turn: None,
        };
        let gate = self.gate(key, name_prefix);
        gate.queued.fetch_add(1, Ordering::SeqCst);
        let queued = Queued(&gate);
        permit.turn = Some(gate.turn.clone().lock_owned().await);
        drop(queued);
        permit
    }

    /// Takes the turn if nobody in this client has it.
    pub(crate) fn try_enter(
        self: &Arc<Self>,
        key: &Arc<str>,
        name_prefix: &str,
    ) -> Option<GatePermit> {
        // Before `gate`, as in `enter`: a failed try forgets an idle key.
        let mut permit = GatePermit {
            gates: self.clone(),
            key: key.clone(),
            turn: None,
        };
        let gate = self.gate(key, name_prefix);
        permit.turn = Some(gate.turn.clone().try_lock_owned().ok()?);
        Some(permit)
    }

    /// Tasks of this client queued for `name_prefix` behind the one contending in etcd.
    pub(crate) fn queued(&self, name_prefix: &str) -> usize {
        self.gates
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(key, g)| key.get(..g.prefix_len) == Some(name_prefix))
            .map(|(_, g)| g)
            .map(|g| g.queued.load(Ordering::SeqCst))
            .sum()
    }

    fn forget_if_idle(&self, key: &str) {
        let mut gates = self.gates.lock().unwrap_or_else(PoisonError::into_inner);
        if gates
            .get(key)
            .is_some_and(|g| Arc::strong_count(g) == 1 && g.turn.try_lock().is_ok())
        {
            gates.remove(key);
        }
    }
}

impl GatePermit {
    /// What it takes to try this gate again later, without holding it now.
    pub(crate) fn reentry(&self) -> Reentry {
        Reentry {
            gates: self.gates.clone(),
            key: self.key.clone(),
        }
    }
}

/// A gate to try again later; see [`GatePermit::reentry`].
#[derive(Debug)]
pub(crate) struct Reentry {
    gates: Arc<Gates>,
    key: Arc<str>,
}

impl Reentry {
    /// Takes the turn if nobody in this client has it.
    pub(crate) fn try_enter(&self) -> Option<GatePermit> {
        // The key is `{name prefix}{lease id}`, and the name prefix ends with its `/`.
        let prefix = self.key.rfind('/').map_or(0, |at| at + 1);
        self.gates.try_enter(&self.key, &self.key[..prefix])
    }
}

/// Counts a task as queued while it waits.
struct Queued<'a>(&'a Gate);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for GatePermit {
    fn drop(&mut self) {
        drop(self.turn.take());
        self.gates.forget_if_idle(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fifo_and_forgets_idle_keys() {
        let gates = Arc::new(Gates::default());
        let key: Arc<str> = "p/k".into();
        let first = gates.enter(&key, "p/").await;
        assert!(gates.try_enter(&key, "p/").is_none());
        let second = tokio::spawn({
            let (gates, key) = (gates.clone(), key.clone());
            async move { gates.enter(&key, "p/").await }
        });
        tokio::task::yield_now().await;
        assert_eq!(gates.queued("p/"), 1);
        drop(first);
        let second = second.await.unwrap();
        assert_eq!(gates.queued("p/"), 0);
        drop(second);
        assert!(gates.gates.lock().unwrap().is_empty());
    }

    /// A waiter handed the turn and dropped before it ran, as the last one: the key is
    /// forgotten all the same.
    #[tokio::test]
    async fn a_dropped_waiter_leaves_no_gate_behind() {
        let gates = Arc::new(Gates::default());
        let key: Arc<str> = "p/k".into();
        let first = gates.enter(&key, "p/").await;
        let mut waiting = Box::pin(gates.enter(&key, "p/"));
        tokio::select! {
            biased;
            _ = &mut waiting => panic!("entered while the turn was taken"),
            () = std::future::ready(()) => {}
        }
        // The turn goes to the waiter, which is dropped before it takes it.
        drop(first);
        drop(waiting);
        assert!(gates.gates.lock().unwrap().is_empty());
        // And a failed try.
        let first = gates.enter(&key, "p/").await;
        assert!(gates.try_enter(&key, "p/").is_none());
        drop(first);
        assert!(gates.gates.lock().unwrap().is_empty());
    }
}
