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
/// Equal tokens pass: every grant's token is new, so an equal token is the same holder
/// writing again.
///
/// # Read, then write
///
/// A write check alone protects blind writes. A holder that reads, computes and writes
/// back must read with its token too ([`read_fenced`](Self::read_fenced), or
/// [`update`](Self::update) in one step): a fenced read records the token, so a paused
/// holder with an older token can no longer write a value computed from what it read
/// before. With a plain [`read`](Self::read), a zombie that read 50, paused, and wrote 49
/// after the new holder read 50 but before it wrote, would have its write accepted, and
/// the new holder's 49 would then lose one update. In SQL, make the read and write one
/// statement (`UPDATE stock SET n = n - 1, fence = $token WHERE ... AND fence <= $token`)
/// or record the token in the row when reading it (`SELECT ... FOR UPDATE`, then the
/// fenced `UPDATE` in the same transaction).
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

    /// The current value, without a token check: for observers, not for a holder that
    /// writes back what it read (see [`read_fenced`](Self::read_fenced)).
    pub fn read(&self) -> T {
        self.register().value.clone()
    }

    /// The current value, read as the holder of `token`: refused if a larger token has
    /// been seen; otherwise `token` is recorded, so a holder with an older token can no
    /// longer write.
    ///
    /// # Errors
    ///
    /// [`StaleToken`] if a larger token has been seen; nothing is recorded.
    pub fn read_fenced(&self, token: FencingToken) -> Result<T, StaleToken> {
        let mut reg = self.register();
        reg.admit(token)?;
        Ok(reg.value.clone())
    }

    /// Replaces the value with `f(current)` as the holder of `token`, in one step, and
    /// returns the new value.
    ///
    /// # Errors
    ///
    /// [`StaleToken`] if a larger token has been seen; the value is unchanged and `f` is
    /// not called.
    pub fn update(&self, token: FencingToken, f: impl FnOnce(&T) -> T) -> Result<T, StaleToken> {
        let mut reg = self.register();
        reg.admit(token)?;
        reg.value = f(&reg.value);
        reg.writes += 1;
        Ok(reg.value.clone())
    }

    /// Stores `value` if `token` is at least the highest token seen.
    ///
    /// # Errors
    ///
    /// [`StaleToken`] if a larger token has been accepted; the value is unchanged.
    pub fn write(&self, token: FencingToken, value: T) -> Result<(), StaleToken> {
        let mut reg = self.register();
        reg.admit(token)?;
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

    /// How many writes, fenced reads and updates were refused.
    pub fn rejections(&self) -> u64 {
        self.register().rejections
    }
}

impl<T> Register<T> {
    /// Records `token` if it is at least the highest seen, else counts a rejection.
    fn admit(&mut self, token: FencingToken) -> Result<(), StaleToken> {
        if let Some(highest) = self.highest {
            if token < highest {
                self.rejections += 1;
                return Err(StaleToken { token, highest });
            }
        }
        self.highest = Some(token);
        Ok(())
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

    /// The zombie's read-modify-write: A (token 7) reads 50 and pauses; B (token 8)
    /// reads 50; A wakes and writes 49. With fenced reads A's write is refused and B's
    /// lands, so no update is lost.
    #[test]
    fn a_fenced_read_refuses_an_older_holders_later_write() {
        let stock = FencedRegister::new(50u32);
        let (a, b) = (FencingToken::new(7), FencingToken::new(8));
        let seen_by_a = stock.read_fenced(a).unwrap();
        let seen_by_b = stock.read_fenced(b).unwrap();
        assert_eq!((seen_by_a, seen_by_b), (50, 50));
        let err = stock.write(a, seen_by_a - 1).unwrap_err();
        assert_eq!((err.token, err.highest), (a, b));
        stock.write(b, seen_by_b - 1).unwrap();
        assert_eq!(stock.read(), 49);
        // A refused fenced read records nothing; update applies in one step.
        assert!(stock.read_fenced(a).is_err());
        assert_eq!(stock.highest_token(), Some(b));
        assert_eq!(stock.update(b, |n| n - 1), Ok(48));
        assert!(
            stock
                .update(a, |_| unreachable!("a stale update is not applied"))
                .is_err()
        );
        assert_eq!(
            (stock.read(), stock.writes(), stock.rejections()),
            (48, 2, 3)
        );
    }
}
