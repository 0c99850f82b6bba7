//! Lock name validation shared by every backend.

use crate::Error;

/// The longest lock name accepted, in bytes of UTF-8.
///
/// Every backend accepts every valid name up to this length; each maps names to its own
/// key space injectively, so two different names never share a lock.
pub const MAX_NAME_LEN: usize = 2048;

/// Checks a lock name before any I/O.
///
/// A valid name is non-empty UTF-8 of at most [`MAX_NAME_LEN`] bytes without control
/// characters (`U+0000`–`U+001F`, `U+007F`–`U+009F`). Anything else may appear: `/`,
/// `..`, `{}`, spaces, any script. Backends encode names so none of these can escape the
/// lock root or collide with another name.
///
/// # Errors
///
/// [`Error::InvalidName`] saying what is wrong.
///
/// # Examples
///
/// ```
/// use fencelock_core::{validate_name, Error};
///
/// assert!(validate_name("orders/SKU-8842").is_ok());
/// assert!(matches!(validate_name(""), Err(Error::InvalidName { .. })));
/// assert!(matches!(validate_name("a\0b"), Err(Error::InvalidName { .. })));
/// ```
pub fn validate_name(name: &str) -> Result<(), Error> {
    let reason = if name.is_empty() {
        "the name is empty"
    } else if name.len() > MAX_NAME_LEN {
        "the name is longer than fencelock_core::MAX_NAME_LEN bytes"
    } else if name.chars().any(char::is_control) {
        "the name contains a control character"
    } else {
        return Ok(());
    };
    Err(Error::InvalidName {
        name: name.chars().take(64).collect(),
        reason,
    })
}

/// Checks a name prefix (for [`DistributedLock::list`](crate::DistributedLock::list))
/// before any I/O: empty (every name), or what [`validate_name`] accepts.
///
/// # Errors
///
/// [`Error::InvalidName`] saying what is wrong.
pub fn validate_prefix(prefix: &str) -> Result<(), Error> {
    if prefix.is_empty() {
        Ok(())
    } else {
        validate_name(prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_odd_but_valid_names() {
        for name in [
            "a",
            "a/b",
            "..",
            "/",
            "{tag}",
            "with space",
            "锁/订单",
            &"x".repeat(MAX_NAME_LEN),
        ] {
            assert!(validate_name(name).is_ok(), "{name:?}");
        }
    }

    #[test]
    fn rejects_bad_names() {
        let long = "x".repeat(MAX_NAME_LEN + 1);
        for name in ["", "a\0", "line\nbreak", "tab\t", "\u{7f}", "\u{85}", &long] {
            assert!(
                matches!(validate_name(name), Err(Error::InvalidName { .. })),
                "{name:?}"
            );
        }
    }

    #[test]
    fn long_names_are_shortened_in_the_error() {
        let Err(Error::InvalidName { name, .. }) = validate_name(&"y".repeat(10_000)) else {
            panic!("expected InvalidName");
        };
        assert_eq!(name.len(), 64);
    }
}
