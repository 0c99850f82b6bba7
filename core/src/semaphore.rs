//! Semaphores: at most `limit` permits of one name held at once, each grant with a
//! fencing token, with the lock's lease, wait, loss and cancellation rules.

use crate::Error;

/// A request for permits: `count` of the semaphore's `limit`.
///
/// Every client of one semaphore must ask with the same `limit`: the semaphore keeps the
/// limit it was created with while anyone holds or waits, and a request with another
/// limit fails with [`Error::InvalidConfig`] instead of silently making a second
/// semaphore.
///
/// ```
/// use fencelock_core::Permits;
///
/// let one_of_three = Permits::one_of(3)?;
/// assert_eq!((one_of_three.count(), one_of_three.limit()), (1, 3));
/// assert!(Permits::new(4, 3).is_err());
/// # Ok::<(), fencelock_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Permits {
    count: u32,
    limit: u32,
}

impl Permits {
    /// `count` permits of a semaphore of `limit`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when `count` is 0 or larger than `limit`.
    pub fn new(count: u32, limit: u32) -> Result<Self, Error> {
        if count == 0 || count > limit {
            return Err(Error::InvalidConfig(format!(
                "a semaphore request takes 1 to `limit` permits, not {count} of {limit}"
            )));
        }
        Ok(Permits { count, limit })
    }

    /// One permit of a semaphore of `limit`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when `limit` is 0.
    pub fn one_of(limit: u32) -> Result<Self, Error> {
        Permits::new(1, limit)
    }

    /// How many permits are asked for.
    pub fn count(self) -> u32 {
        self.count
    }

    /// How many permits the semaphore has.
    pub fn limit(self) -> u32 {
        self.limit
    }
}
