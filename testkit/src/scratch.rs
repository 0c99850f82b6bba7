//! Temporary directories that are removed even when their owner never drops: servers
//! and certificates kept in a `static` (shared by every test of a binary) are never
//! dropped, so their `TempDir`s alone would leave a directory behind on every run.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};

use tempfile::TempDir;

use crate::process::at_exit;

/// The directories of every [`Scratch`] not yet dropped.
static LIVE: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());

/// A temporary directory named `<prefix><random>` under the system's temporary
/// directory, removed when dropped or, if it is still alive then, when the process exits
/// normally (libc `exit`, how a test binary ends whether its tests pass or fail).
pub(crate) struct Scratch {
    dir: TempDir,
}

impl Scratch {
    /// Makes the directory.
    pub(crate) fn new(prefix: &str) -> Result<Self, String> {
        static HOOK: Once = Once::new();
        HOOK.call_once(|| at_exit(remove_live));
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
        live().insert(dir.path().to_path_buf());
        Ok(Scratch { dir })
    }

    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        live().remove(self.dir.path());
        // The `TempDir` removes the directory itself.
    }
}

fn live() -> std::sync::MutexGuard<'static, BTreeSet<PathBuf>> {
    LIVE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The exit hook: removes what is left. Never blocks (a thread that held the lock when
/// `exit` was called is gone for good).
fn remove_live() {
    let dirs = match LIVE.try_lock() {
        Ok(mut dirs) => std::mem::take(&mut *dirs),
        Err(std::sync::TryLockError::Poisoned(p)) => std::mem::take(&mut *p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    for dir in dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: `remove_live` takes every live directory, so two tests would race.
    #[test]
    fn a_dropped_scratch_is_forgotten_and_one_left_alive_is_removed_at_exit() {
        let scratch = Scratch::new("fencelock-scratch-test-").unwrap();
        let path = scratch.path().to_path_buf();
        assert!(path.is_dir());
        assert!(live().contains(&path));
        drop(scratch);
        assert!(!path.exists());
        assert!(!live().contains(&path));

        let scratch = Scratch::new("fencelock-scratch-test-").unwrap();
        let path = scratch.path().to_path_buf();
        std::mem::forget(scratch);
        remove_live();
        assert!(!path.exists());
    }
}
