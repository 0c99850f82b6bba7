//! Fencing tokens.

use std::fmt;

/// A number that grows with every grant of a lock.
///
/// For one lock name on one deployment, each token handed out is strictly greater than
/// every token handed out before it (see the backend's [`FencingStrength`] for the
/// failures under which that holds). A resource protected by the lock remembers the
/// highest token it has seen and rejects writes carrying a lower one; that, not the
/// lease, is what stops a paused ("zombie") holder from overwriting a newer holder's work.
///
/// [`FencingStrength`]: crate::FencingStrength
///
/// # Examples
///
/// ```
/// use fencelock_core::FencingToken;
///
/// let old = FencingToken::new(41);
/// let new = FencingToken::new(42);
/// assert!(old < new);
/// assert_eq!(new.get(), 42);
/// assert_eq!(new.to_string(), "42");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value.
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// The raw value, for storing beside the protected data.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FencingToken({})", self.0)
    }
}

impl From<FencingToken> for u64 {
    fn from(token: FencingToken) -> u64 {
        token.0
    }
}
