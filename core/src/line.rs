//! Waiting lines: one waiter per (client, name) on the server; the client's other tasks
//! that wait for the same name queue here, in FIFO order. For backends.
//!
//! Without it, every task of a client waiting for a name costs the server something
//! per hand-off: on Redis each is woken by the unlock message and sends its own try; on
//! ZooKeeper each has a node, and the one whose turn comes lists them all. With 10,000
//! tasks of one client on one name, a hand-off then costs 10,000 scripts or a listing of
//! 10,000 children. With a line, only the task at the front of the client's line waits
//! on the server; the others wait locally, so the server's work per hand-off is bounded
//! by the number of waiting clients, not tasks, and a client's own waiters are served in
//! the order they started to wait. The front is given up when its task is granted (or
//! gives up): the next task then queues on the server behind it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Mutex as FifoMutex, OwnedMutexGuard};

/// The waiting lines of one client, by name (or key).
#[derive(Debug, Default)]
pub struct Lines {
    /// By key, which the fronts share: one copy per line.
    lines: Mutex<HashMap<Arc<str>, Arc<FifoMutex<()>>>>,
}

/// The front of a line: the right to wait for the key on the server. Dropping it (on a
/// grant, an error or a cancellation) passes the turn to the next task of the line.
#[derive(Debug)]
pub struct Front {
    lines: Arc<Lines>,
    key: Arc<str>,
    turn: Option<OwnedMutexGuard<()>>,
}

impl Lines {
    /// `key`'s line, made if there is none, and the key as the map holds it (the
    /// caller's own if it made the line and gave an `Arc<str>`: one copy of the key).
    fn line(&self, key: impl LineKey) -> (Arc<str>, Arc<FifoMutex<()>>) {
        let mut lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((key, line)) = lines.get_key_value(key.as_str()) {
            return (key.clone(), line.clone());
        }
        let (key, line): (Arc<str>, Arc<FifoMutex<()>>) = (key.into_shared(), Arc::default());
        lines.insert(key.clone(), line.clone());
        (key, line)
    }

    /// Waits for the front of `key`'s line.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped wait leaves the line.
    ///
    /// # Errors
    ///
    /// None: it only waits.
    pub async fn front(self: &Arc<Self>, key: impl LineKey) -> Front {
        let (key, line) = self.line(key);
        let mut front = Front {
            lines: self.clone(),
            key,
            turn: None,
        };
        front.turn = Some(line.lock_owned().await);
        front
    }

    /// Takes the front of `key`'s line if nobody holds it, without waiting: for a try
    /// that must not queue, or to come back to a line later (see [`Front::lines`]).
    pub fn try_front(self: &Arc<Self>, key: impl LineKey) -> Option<Front> {
        let (key, line) = self.line(key);
        // Made before the try, so dropped after it: a failed try finds the map's
        // reference the only one left and forgets an idle line.
        let mut front = Front {
            lines: self.clone(),
            key,
            turn: None,
        };
        front.turn = Some(line.try_lock_owned().ok()?);
        Some(front)
    }

    /// How many tasks wait in `key`'s line behind its front (not yet on the server).
    pub fn waiting_behind(&self, key: &str) -> usize {
        let lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        lines.get(key).map_or(0, behind)
    }

    /// How many tasks wait behind the fronts of every line whose key starts with
    /// `prefix`: for a backend whose keys are a name's prefix plus something of the
    /// client's own (etcd: the name's key range plus the lease), the tasks of this client
    /// queued for the name.
    pub fn waiting_under(&self, prefix: &str) -> usize {
        let lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        lines
            .iter()
            .filter(|(key, _)| key.starts_with(prefix))
            .map(|(_, line)| behind(line))
            .sum()
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

/// A line's key: a string (copied if the line is new), or an `Arc<str>` the caller keeps
/// anyway (then shared as the line's key if the line is new: one copy of the key).
pub trait LineKey {
    /// The key.
    fn as_str(&self) -> &str;
    /// The key as the line keeps it.
    fn into_shared(self) -> Arc<str>;
}

impl LineKey for &str {
    fn as_str(&self) -> &str {
        self
    }
    fn into_shared(self) -> Arc<str> {
        self.into()
    }
}

impl LineKey for &String {
    fn as_str(&self) -> &str {
        self
    }
    fn into_shared(self) -> Arc<str> {
        self.as_str().into()
    }
}

impl LineKey for &Arc<str> {
    fn as_str(&self) -> &str {
        self
    }
    fn into_shared(self) -> Arc<str> {
        self.clone()
    }
}

/// How many tasks wait in `line` behind its front.
fn behind(line: &Arc<FifoMutex<()>>) -> usize {
    // The map's reference, every waiting task's, and the front's guard's.
    let holders = Arc::strong_count(line) - 1;
    holders.saturating_sub(usize::from(line.try_lock().is_err()))
}

impl Front {
    /// The lines this front belongs to: to try the same line again later (with
    /// [`Lines::try_front`]) after this front was given up.
    pub fn lines(&self) -> &Arc<Lines> {
        &self.lines
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
        assert_eq!(lines.waiting_behind("k"), 5);
        assert_eq!(lines.waiting_behind("other"), 0);
        drop(first);
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
        assert_eq!(lines.len(), 0);
    }

    /// A try takes a free front and never queues; a failed try, and a try of a line
    /// taken again later through `Front::lines`, leave nothing behind.
    #[tokio::test]
    async fn a_try_takes_a_free_front_and_never_queues() {
        let lines = Arc::new(Lines::default());
        let first = lines.try_front("p/a/1").expect("a free line");
        assert!(lines.try_front("p/a/1").is_none());
        assert_eq!(lines.waiting_behind("p/a/1"), 0);
        assert_eq!(lines.len(), 1);
        let again = first.lines().clone();
        drop(first);
        assert_eq!(lines.len(), 0);
        let second = again.try_front("p/a/1").expect("free again");
        drop(second);
        assert_eq!(lines.len(), 0);
        // A failed try on a line nobody else waits in forgets nothing it should keep.
        let held = lines.front("p/a/1").await;
        assert!(lines.try_front("p/a/1").is_none());
        assert_eq!(lines.len(), 1);
        drop(held);
        assert_eq!(lines.len(), 0);
    }

    /// The tasks queued behind the fronts of every key under a prefix, and only those.
    #[tokio::test]
    async fn waiting_under_counts_the_lines_of_a_prefix() {
        let lines = Arc::new(Lines::default());
        let fronts = [
            lines.front("p/a/1").await,
            lines.front("p/a/2").await,
            lines.front("p/ab/1").await,
        ];
        let mut tasks = Vec::new();
        for key in ["p/a/1", "p/a/1", "p/a/2", "p/ab/1"] {
            let lines = lines.clone();
            tasks.push(tokio::spawn(async move { drop(lines.front(key).await) }));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(lines.waiting_under("p/a/"), 3);
        assert_eq!(lines.waiting_under("p/ab/"), 1);
        assert_eq!(lines.waiting_under("p/"), 4);
        assert_eq!(lines.waiting_under("q/"), 0);
        drop(fronts);
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(lines.waiting_under("p/"), 0);
        assert_eq!(lines.len(), 0);
    }

    /// A wait dropped while queued, before or after the turn came to it (but before it
    /// was polled again), leaves no line behind.
    #[tokio::test]
    async fn a_wait_dropped_in_line_leaves_nothing() {
        let lines = Arc::new(Lines::default());
        for turn_came in [false, true] {
            let first = lines.front("k").await;
            let mut waiting = Box::pin(lines.front("k"));
            // Polled once: queued.
            tokio::select! {
                biased;
                _ = &mut waiting => panic!("the line was free"),
                () = std::future::ready(()) => {}
            }
            assert_eq!(lines.waiting_behind("k"), 1);
            if turn_came {
                drop(first);
                drop(waiting);
            } else {
                drop(waiting);
                drop(first);
            }
            assert_eq!(lines.len(), 0, "turn came: {turn_came}");
        }
    }

    /// A key the caller keeps as an `Arc<str>` is the line's key too, not a copy.
    #[test]
    fn a_shared_key_is_not_copied() {
        let lines = Arc::new(Lines::default());
        let key: Arc<str> = Arc::from("fencelock/a/1");
        let front = lines.try_front(&key).expect("a free line");
        assert_eq!(
            Arc::strong_count(&key),
            3,
            "the caller's, the map's, the front's"
        );
        drop(front);
        assert_eq!(lines.len(), 0);
        assert_eq!(Arc::strong_count(&key), 1);
    }
}
