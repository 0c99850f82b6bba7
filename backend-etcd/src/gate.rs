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
    gates: Mutex<HashMap<String, Arc<Gate>>>,
}

#[derive(Debug, Default)]
struct Gate {
    name_prefix: String,
    turn: Arc<FifoMutex<()>>,
    queued: AtomicUsize,
}

/// The right to contend in etcd with one key. Dropping it passes the turn on.
#[derive(Debug)]
pub(crate) struct GatePermit {
    gates: Arc<Gates>,
    key: String,
    turn: Option<OwnedMutexGuard<()>>,
}

impl Gates {
    fn gate(self: &Arc<Self>, key: &str, name_prefix: &str) -> Arc<Gate> {
        self.gates
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key.to_owned())
            .or_insert_with(|| {
                Arc::new(Gate {
                    name_prefix: name_prefix.to_owned(),
                    ..Gate::default()
                })
            })
            .clone()
    }

    /// Waits for the turn to contend with `key`.
    ///
    /// Cancel safe: a dropped wait leaves the queue.
    pub(crate) async fn enter(self: &Arc<Self>, key: &str, name_prefix: &str) -> GatePermit {
        let gate = self.gate(key, name_prefix);
        gate.queued.fetch_add(1, Ordering::SeqCst);
        let mut permit = GatePermit {
            gates: self.clone(),
            key: key.to_owned(),
            turn: None,
        };
        let queued = Queued(&gate);
        permit.turn = Some(gate.turn.clone().lock_owned().await);
        drop(queued);
        permit
    }

    /// Takes the turn if nobody in this client has it.
    pub(crate) fn try_enter(self: &Arc<Self>, key: &str, name_prefix: &str) -> Option<GatePermit> {
        let gate = self.gate(key, name_prefix);
        let mut permit = GatePermit {
            gates: self.clone(),
            key: key.to_owned(),
            turn: None,
        };
        permit.turn = Some(gate.turn.clone().try_lock_owned().ok()?);
        Some(permit)
    }

    /// Tasks of this client queued for `name_prefix` behind the one contending in etcd.
    pub(crate) fn queued(&self, name_prefix: &str) -> usize {
        self.gates
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter(|g| g.name_prefix == name_prefix)
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
        let first = gates.enter("k", "p/").await;
        assert!(gates.try_enter("k", "p/").is_none());
        let second = tokio::spawn({
            let gates = gates.clone();
            async move { gates.enter("k", "p/").await }
        });
        tokio::task::yield_now().await;
        assert_eq!(gates.queued("p/"), 1);
        drop(first);
        let second = second.await.unwrap();
        assert_eq!(gates.queued("p/"), 0);
        drop(second);
        assert!(gates.gates.lock().unwrap().is_empty());
    }
}
