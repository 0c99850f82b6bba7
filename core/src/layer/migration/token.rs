//! Fencing tokens that keep growing when the lock service changes: an epoch in the high
//! bits.

use crate::{Error, FencingToken};

/// How far the epoch is shifted: a migration token is `epoch << 56 | backend token`.
pub const ERA_SHIFT: u32 = 56;

/// The largest epoch accepted. With it, every migration token stays below 2^63, so it
/// also fits a signed 64-bit column (SQL `BIGINT`) without turning negative.
pub const MAX_EPOCH: u8 = 127;

/// The largest backend token an epoch can carry: 2^56 − 1.
const RAW_MAX: u64 = (1 << ERA_SHIFT) - 1;

/// The token of a grant made in `epoch`, from the backend's own token `raw`.
///
/// Tokens of a larger epoch are larger than every token of a smaller one, whatever the
/// backends' own numbers: that is what lets a resource that has seen Redis tokens
/// (microseconds since 1970, about 1.7 × 10^15) accept the first holder under etcd
/// (revisions, small numbers) and still refuse a zombie from the Redis era. Epoch 0
/// leaves the token unchanged, so the tokens of a lock that has not switched yet are
/// exactly those of its backend, comparable with services that use that backend
/// directly.
///
/// # Errors
///
/// - [`Error::InvalidConfig`] if `epoch` is larger than [`MAX_EPOCH`];
/// - [`Error::Backend`] (not retryable) if `raw` does not fit in 56 bits. No backend
///   issues such tokens today (Redis: microseconds, below 2^56 until the year 2284;
///   etcd: revisions; ZooKeeper: zxids, whose election epoch would have to pass 2^24);
///   the grant is refused rather than given a token that could be smaller than an
///   earlier one.
///
/// # Examples
///
/// ```
/// use fencelock_core::FencingToken;
/// use fencelock_core::layer::migration::era_token;
///
/// let redis_era = era_token(0, FencingToken::new(1_718_000_000_000_000))?;
/// let etcd_era = era_token(1, FencingToken::new(42))?;
/// assert_eq!(redis_era.get(), 1_718_000_000_000_000);
/// assert!(etcd_era > redis_era);
/// # Ok::<(), fencelock_core::Error>(())
/// ```
pub fn era_token(epoch: u8, raw: FencingToken) -> Result<FencingToken, Error> {
    if epoch > MAX_EPOCH {
        return Err(Error::InvalidConfig(format!(
            "migration: epoch {epoch} is larger than the maximum {MAX_EPOCH}"
        )));
    }
    if raw.get() > RAW_MAX {
        return Err(Error::backend(
            "migration",
            false,
            format!(
                "the backend's fencing token {raw} does not fit in {ERA_SHIFT} bits, so it \
                 cannot carry a migration epoch"
            ),
        ));
    }
    Ok(FencingToken::new(
        (u64::from(epoch) << ERA_SHIFT) | raw.get(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_epoch_beats_every_token_of_an_earlier_one() {
        let t = |epoch, raw| era_token(epoch, FencingToken::new(raw)).unwrap();
        assert_eq!(t(0, 5), FencingToken::new(5));
        assert!(t(1, 1) > t(0, RAW_MAX));
        assert!(t(2, 0) > t(1, RAW_MAX));
        assert!(t(1, 7) > t(1, 6));
        assert!(t(MAX_EPOCH, RAW_MAX).get() <= i64::MAX as u64);
    }

    #[test]
    fn out_of_range_inputs_are_errors_not_wrapped_tokens() {
        assert!(matches!(
            era_token(MAX_EPOCH + 1, FencingToken::new(1)),
            Err(Error::InvalidConfig(_))
        ));
        let err = era_token(1, FencingToken::new(RAW_MAX + 1)).unwrap_err();
        assert!(matches!(err, Error::Backend { .. }) && !err.is_retryable());
    }
}
