//! The one grant registry: the locks granted through a client and not yet released, so
//! that closing the client can give every one of them up, and no grant slips past the
//! close.
//!
//! An acquire's grant and a `close()` can race: the grant passed the acquire's check of
//! the close just before it, the close ran through the registry just after. Both sides
//! take one lock here: a grant [`insert`](Grants::insert_with)ed before the
//! [`close`](Grants::close) is drained by it, and one after is refused with the close's
//! cause, so the backend gives it up as the close would have.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The entries a client keeps of its held grants, by key, until released or closed.
/// `C` is what a refused insert learns of the close (`()` when there is one cause only).
pub struct Grants<T, C = ()> {
    state: Mutex<State<T, C>>,
}

struct State<T, C> {
    entries: HashMap<u64, T>,
    /// Set by [`Grants::close`]: the cause every later insert is refused with.
    closed: Option<C>,
}

impl<T, C: Clone> Grants<T, C> {
    /// An open, empty registry.
    pub fn new() -> Self {
        Grants {
            state: Mutex::new(State {
                entries: HashMap::new(),
                closed: None,
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State<T, C>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers the entry `make` builds under `key`, unless the registry is closed.
    /// `make` runs under the registry's lock, so what it starts (a renewal, a check of a
    /// session's end) is either drained by a close with the entry or never started.
    ///
    /// # Errors
    ///
    /// The close's cause, once [`close`](Self::close)d; `make` did not run.
    pub fn insert_with(&self, key: u64, make: impl FnOnce() -> T) -> Result<(), C> {
        let mut state = self.state();
        if let Some(cause) = &state.closed {
            return Err(cause.clone());
        }
        state.entries.insert(key, make());
        Ok(())
    }

    /// Registers `entry` under `key`, unless the registry is closed.
    ///
    /// # Errors
    ///
    /// The close's cause, once [`close`](Self::close)d (`entry` is dropped).
    pub fn insert(&self, key: u64, entry: T) -> Result<(), C> {
        self.insert_with(key, || entry)
    }

    /// Forgets `key` (released); its entry, if it was still registered.
    pub fn remove(&self, key: u64) -> Option<T> {
        self.state().entries.remove(&key)
    }

    /// Runs `f` on the entry of `key` under the registry's lock; `None` when it is not
    /// registered (released, or drained by the close).
    pub fn with<R>(&self, key: u64, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        self.state().entries.get_mut(&key).map(f)
    }

    /// Runs `f` on every entry, under the registry's lock.
    pub fn for_each(&self, mut f: impl FnMut(&T)) {
        self.state().entries.values().for_each(&mut f);
    }

    /// How many grants are registered.
    pub fn len(&self) -> usize {
        self.state().entries.len()
    }

    /// Whether no grant is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The close's cause, once closed.
    pub fn closed(&self) -> Option<C> {
        self.state().closed.clone()
    }

    /// Closes the registry with `cause` (the first close's cause stays) and drains it:
    /// returns every entry registered, for the caller to give up. Every later insert is
    /// refused with the cause.
    pub fn close(&self, cause: C) -> Vec<T> {
        let mut state = self.state();
        state.closed.get_or_insert(cause);
        state.entries.drain().map(|(_, entry)| entry).collect()
    }
}

impl<T, C: Clone> Default for Grants<T, C> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T, C: std::fmt::Debug> std::fmt::Debug for Grants<T, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Grants")
            .field("len", &state.entries.len())
            .field("closed", &state.closed)
            .finish()
    }
}

#[cfg(test)]
mod tests;
