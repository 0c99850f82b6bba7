//! One waiter per (client, lock key) on the server: the other tasks of the client that
//! wait for the same key queue here, in FIFO order.
//!
//! Without it, every task waiting for a key would be woken by each unlock message and
//! send its own try: a hand-off on a key that 10,000 tasks of one client wait for would
//! cost 10,000 scripts and wake-ups. With it, only the task at the front of the client's
//! line subscribes and tries; the others wait for their turn locally, so the server's
//! work per hand-off is bounded by the number of waiting clients, not tasks, and a
//! client's own waiters are served in the order they started to wait.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Mutex as FifoMutex, OwnedMutexGuard};

/// The lines of one client, by lock key.
#[derive(Debug, Default)]
pub(crate) struct Lines {
    lines: Mutex<HashMap<String, Arc<FifoMutex<()>>>>,
}

/// The front of a line: the right to wait for the key on the server. Dropping it (on a
/// grant, an error or a cancellation) passes the turn to the next task of the line.
#[derive(Debug)]
pub(crate) struct Front {
    lines: Arc<Lines>,
    key: String,
    turn: Option<OwnedMutexGuard<()>>,
}

impl Lines {
    fn line(&self, key: &str) -> Arc<FifoMutex<()>> {
        self.lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key.to_owned())
            .or_default()
            .clone()
    }

    /// Waits for the front of `key`'s line.
    ///
    /// Cancel safe: a dropped wait leaves the line.
    pub(crate) async fn front(self: &Arc<Self>, key: &str) -> Front {
        let line = self.line(key);
        let mut front = Front {
            lines: self.clone(),
            key: key.to_owned(),
            turn: None,
        };
        front.turn = Some(line.lock_owned().await);
        front
    }

    /// Lines with nobody in them are forgotten, so the map is as large as what waits.
    fn forget_if_idle(&self, key: &str) {
        let mut lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        if lines
            .get(key)
            .is_some_and(|l| Arc::strong_count(l) == 1 && l.try_lock().is_ok())
        {
            lines.remove(key);
        }
    }

    /// The number of keys with a line (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        drop(self.turn.take());
        self.lines.forget_if_idle(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn one_front_per_key_in_fifo_order_and_nothing_left() {
        let lines = Arc::new(Lines::default());
        let first = lines.front("k").await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..5 {
            let (lines, order) = (lines.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _front = lines.front("k").await;
                order.lock().unwrap().push(i);
            }));
            // Queue them one after the other.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Another key is not held up.
        drop(lines.front("other").await);
        drop(first);
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
        assert_eq!(lines.len(), 0);
    }
}
