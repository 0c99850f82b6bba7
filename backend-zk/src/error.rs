//! The one place where `zookeeper-client` errors become fencelock errors.

use fencelock_core::Error;
use zookeeper_client as zk;

/// The backend's short name.
pub(crate) const BACKEND: &str = "zookeeper";

/// Maps a ZooKeeper error: connection problems are [`Error::Unavailable`] (retryable);
/// throttling is a retryable backend error; everything else (no auth, bad ACL, bad
/// arguments, an unexpected reply) is a backend error that retrying will not fix.
pub(crate) fn map(err: zk::Error) -> Error {
    match err {
        zk::Error::ConnectionLoss
        | zk::Error::NoHosts
        | zk::Error::Timeout
        | zk::Error::SessionExpired
        | zk::Error::SessionMoved
        | zk::Error::ClientClosed => Error::unavailable(BACKEND, err),
        zk::Error::Throttled => Error::backend(BACKEND, true, err),
        other => Error::backend(BACKEND, false, other),
    }
}

/// Whether the session behind a request is over for good.
pub(crate) fn session_ended(err: &zk::Error) -> bool {
    matches!(
        err,
        zk::Error::SessionExpired | zk::Error::ClientClosed | zk::Error::AuthFailed
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_problems_are_retryable_and_permission_problems_are_not() {
        assert!(map(zk::Error::ConnectionLoss).is_retryable());
        assert!(map(zk::Error::SessionExpired).is_retryable());
        assert!(map(zk::Error::Throttled).is_retryable());
        assert!(!map(zk::Error::NoAuth).is_retryable());
        assert!(!map(zk::Error::InvalidAcl).is_retryable());
        assert!(session_ended(&zk::Error::SessionExpired));
        assert!(!session_ended(&zk::Error::ConnectionLoss));
    }
}
