//! The one place where `zookeeper-client` errors become fencelock errors.

use std::time::Duration;

use fencelock_core::Error;
use zookeeper_client as zk;

/// The backend's short name.
pub(crate) const BACKEND: &str = "zookeeper";

/// Pause before repeating a request whose connection broke.
pub(crate) const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// Whether `err` says the connection carrying the request broke, so the request may or
/// may not have been applied, while the session may well live on.
///
/// `zookeeper-client` fails the requests in flight with the error that broke the
/// connection: [`zk::Error::ConnectionLoss`] when the server closed it, but a
/// [`zk::Error::Custom`] for an I/O error (connection reset, broken pipe) or when the
/// server stopped answering ("no response from connection"). Servers that lose their
/// leader reset their client connections, so all of these happen on every failover and
/// must be handled like `ConnectionLoss`. `SessionMoved` (a request that reached a
/// server after the session had moved to another one) was not applied.
pub(crate) fn connection_broke(err: &zk::Error) -> bool {
    matches!(
        err,
        zk::Error::ConnectionLoss | zk::Error::Custom(_) | zk::Error::SessionMoved
    )
}

/// Repeats `request` while its connection breaks (see [`connection_broke`]). Only for
/// requests that can be repeated safely: reads, and deletes of nodes this client owns.
///
/// Bounded by the session: while the client reconnects, requests wait in its queue, and
/// once the session has expired or was closed they fail for good.
pub(crate) async fn retry<T, F, Fut>(request: F) -> Result<T, zk::Error>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, zk::Error>>,
{
    loop {
        match request().await {
            Err(err) if connection_broke(&err) => tokio::time::sleep(RETRY_PAUSE).await,
            other => return other,
        }
    }
}

/// Maps a ZooKeeper error: connection problems are [`Error::Unavailable`] (retryable);
/// throttling is a retryable backend error; everything else (no auth, bad ACL, bad
/// arguments, an unexpected reply) is a backend error that retrying will not fix.
pub(crate) fn map(err: zk::Error) -> Error {
    match err {
        zk::Error::ConnectionLoss
        | zk::Error::Custom(_)
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

    #[test]
    fn only_connection_failures_are_repeated() {
        assert!(connection_broke(&zk::Error::ConnectionLoss));
        assert!(connection_broke(&zk::Error::SessionMoved));
        for final_answer in [
            zk::Error::NoNode,
            zk::Error::BadVersion,
            zk::Error::NoAuth,
            zk::Error::SessionExpired,
            zk::Error::ClientClosed,
        ] {
            assert!(!connection_broke(&final_answer), "{final_answer:?}");
        }
    }
}
