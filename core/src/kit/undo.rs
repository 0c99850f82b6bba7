//! The one undo-on-drop of an acquire: whatever an unfinished acquire may have left on
//! the server (a key, a node, a queue entry, an intent) is undone when the acquire is
//! dropped, fails or gives up, at any await point.
//!
//! An acquire wraps what it must undo in an [`Undo`] before the first request that may
//! leave something behind, records what it learns through it, and
//! [`disarm`](Undo::disarm)s it once a guard owns the work (or nothing is left).
//! Dropped armed, the [`Undo`] hands the backend's [`Abandon::abandon`] to a task on the
//! client's runtime: the caller's future is gone, and its runtime may be shutting down.
//! A waiter that gives up may first try the undo inline for a short grace
//! ([`Undo::finish_now`]), so a process that exits right after a timeout leaves nothing
//! behind on a healthy server, while a hung server does not stretch its wait.
//!
//! What differs between backends (etcd waits for a create still in flight, ZooKeeper
//! lists its uuid's nodes after a `sync` because a lost create reply may have made two,
//! Redis compares the owner) is each backend's [`Abandon`], not another mechanism.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::time::Duration;

use tokio::runtime::Handle;

/// What one backend undoes of an unfinished acquire. Implemented by the backend's record
/// of what the acquire did so far.
///
/// # Contract
///
/// - [`abandon`](Self::abandon) and [`undo_now`](Self::undo_now) undo exactly this
///   acquire's work (incarnation or owner checked), never a newer holder's, however late
///   they run and even after each other.
/// - [`abandon`](Self::abandon) does not block: its future does the I/O, bounded by the
///   backend's own rules (a timeout, the session's end).
pub trait Abandon: Send + Sized {
    /// The runtime of the client the acquire belongs to, where [`abandon`](Self::abandon)'s
    /// future runs.
    fn runtime(&self) -> &Handle;

    /// What is left to undo, as a future for the background; `None` when nothing is
    /// (what this holds is then dropped at once, not in a task).
    fn abandon(self) -> Option<impl Future<Output = ()> + Send + 'static>;

    /// One attempt to undo everything now. Returns whether everything is undone; when it
    /// is not (or this future is dropped, at [`Undo::finish_now`]'s grace), the work stays
    /// for [`abandon`](Self::abandon). The default does nothing inline.
    ///
    /// # Cancel safety
    ///
    /// Dropped at any await point, it leaves the record as it was or with part of the
    /// work done; [`abandon`](Self::abandon) then undoes the rest.
    ///
    /// # Errors
    ///
    /// None: a failure is `false`, and the background undo takes over.
    fn undo_now(&mut self) -> impl Future<Output = bool> + Send {
        std::future::ready(false)
    }
}

/// An armed undo: holds the backend's [`Abandon`] record of an unfinished acquire, and
/// hands it to the background when dropped armed. See the [module](self) docs.
///
/// It dereferences to the record, so the acquire records what it does through it.
pub struct Undo<A: Abandon>(Option<A>);

impl<A: Abandon> Undo<A> {
    /// Arms the undo of `work`.
    pub fn new(work: A) -> Self {
        Undo(Some(work))
    }

    /// Undoes everything now, for at most `grace`: a waiter that gives up cleans up
    /// before returning (a healthy server answers in milliseconds), but a server that
    /// hangs does not stretch its wait by more than `grace`. Whatever is not done by then
    /// goes on in the background, as when dropped. Returns whether it was done inline.
    ///
    /// # Cancel safety
    ///
    /// Dropping this future drops the undo armed: the rest goes to the background.
    ///
    /// # Errors
    ///
    /// None: an undo that fails or runs past `grace` is `false` and continues in the
    /// background.
    pub async fn finish_now(mut self, grace: Duration) -> bool {
        let Some(work) = self.0.as_mut() else {
            return true;
        };
        let done = tokio::time::timeout(grace, work.undo_now())
            .await
            .unwrap_or(false);
        if done {
            // Done: dropped here, nothing for the background.
            self.0 = None;
        }
        done
    }

    /// The record, no longer armed: its work is done, or owned elsewhere now (a guard).
    pub fn disarm(mut self) -> A {
        self.0
            .take()
            .expect("an undo is armed until disarmed or finished")
    }
}

impl<A: Abandon> Deref for Undo<A> {
    type Target = A;

    fn deref(&self) -> &A {
        self.0
            .as_ref()
            .expect("an undo is armed until disarmed or finished")
    }
}

impl<A: Abandon> DerefMut for Undo<A> {
    fn deref_mut(&mut self) -> &mut A {
        self.0
            .as_mut()
            .expect("an undo is armed until disarmed or finished")
    }
}

impl<A: Abandon> Drop for Undo<A> {
    fn drop(&mut self) {
        if let Some(work) = self.0.take() {
            let runtime = work.runtime().clone();
            if let Some(abandoned) = work.abandon() {
                runtime.spawn(abandoned);
            }
        }
    }
}

impl<A: Abandon + std::fmt::Debug> std::fmt::Debug for Undo<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Undo").field(&self.0).finish()
    }
}

#[cfg(test)]
mod tests;
