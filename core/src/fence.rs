//! A resource that checks fencing tokens, in memory.

use std::sync::{Mutex, PoisonError};

use crate::FencingToken;

/// A write was refused because a newer holder has already written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stale fencing token {token}: the resource has already seen {highest}")]
pub struct StaleToken {
    /// The token the writer presented.
    pub token: FencingToken,
    /// The highest token the resource has accepted.
    pub highest: FencingToken,
}

/// A value that only accepts writes carrying a fencing token at least as large as every
/// token it has accepted before.
///
/// This is the check a real resource must make (a SQL `WHERE fence_token <= $token`, a
/// compare in a transaction) to be safe against a holder that paused past its lease. It
/// serves the examples and tests, and applications' own tests.
///
/// # Examples
///
/// ```
/// use fencelock_core::{FencedRegister, FencingToken};
///
/// let stock = FencedRegister::new(100u32);
/// stock.write(FencingToken::new(7), 99).unwrap();
/// // A zombie holder with an older token is refused.
/// assert!(stock.write(FencingToken::new(6), 42).is_err());
/// assert_eq!(stock.read(), 99);
/// ```
#[derive(Debug, Default)]
pub struct FencedRegister<T> {
    inner: Mutex<Register<T>>,
}

#[derive(Debug, Default)]
struct Register<T> {
    value: T,
    highest: Option<FencingToken>,
    writes: u64,
    rejections: u64,
}

impl<T: Clone> FencedRegister<T> {
    /// A register holding `value` that has seen no token yet.
    pub fn new(value: T) -> Self {
        FencedRegister {
            inner: Mutex::new(Register {
                value,
                highest: None,
                writes: 0,
                rejections: 0,
            }),
        }
    }

    fn register(&self) -> std::sync::MutexGuard<'_, Register<T>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The current value.
    pub fn read(&self) -> T {
        self.register().value.clone()
    }

    /// Stores `value` if `token` is at least the highest token seen.
    ///
    /// # Errors
    ///
    /// [`StaleToken`] if a larger token has been accepted; the value is unchanged.
    pub fn write(&self, token: FencingToken, value: T) -> Result<(), StaleToken> {
        let mut reg = self.register();
        if let Some(highest) = reg.highest {
            if token < highest {
                reg.rejections += 1;
                return Err(StaleToken { token, highest });
            }
        }
        reg.highest = Some(token);
        reg.value = value;
        reg.writes += 1;
        Ok(())
    }

    /// The highest token accepted so far.
    pub fn highest_token(&self) -> Option<FencingToken> {
        self.register().highest
    }

    /// How many writes were accepted.
    pub fn writes(&self) -> u64 {
        self.register().writes
    }

    /// How many writes were refused.
    pub fn rejections(&self) -> u64 {
        self.register().rejections
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_tokens_pass_and_lower_ones_are_counted_as_rejections() {
        let reg = FencedRegister::new(0);
        reg.write(FencingToken::new(5), 1).unwrap();
        reg.write(FencingToken::new(5), 2).unwrap();
        let err = reg.write(FencingToken::new(4), 3).unwrap_err();
        assert_eq!(err.highest, FencingToken::new(5));
        assert_eq!((reg.read(), reg.writes(), reg.rejections()), (2, 2, 1));
    }
}
