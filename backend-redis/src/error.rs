//! The backend's name and the one place Redis client errors become fencelock errors.

use fencelock_core::Error;
use redis::{ErrorKind, RedisError, ServerErrorKind};

/// The backend's name in errors, spans and metrics.
pub(crate) const BACKEND: &str = "redis";

/// [`Error::InvalidName`] for `name` (shortened, as `validate_name` does) and `reason`.
pub(crate) fn invalid_name(name: &str, reason: &'static str) -> Error {
    Error::InvalidName {
        name: name.chars().take(64).collect(),
        reason,
    }
}

/// The one place Redis client errors become fencelock errors.
pub(crate) fn map_err(err: RedisError) -> Error {
    let retryable = matches!(
        err.kind(),
        ErrorKind::Server(
            ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ReadOnly
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
        ) | ErrorKind::ClusterConnectionNotFound
            | ErrorKind::MasterNameNotFoundBySentinel
    );
    // redis-rs' cluster client wraps a failed AUTH of its first connections in an I/O
    // error ("Failed to create initial connections - Io: Password authentication
    // failed"): a wrong password is never an outage to retry.
    let auth = matches!(err.kind(), ErrorKind::AuthenticationFailed)
        || matches!(err.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM"))
        || err.to_string().contains("authentication failed");
    if auth || is_certificate_rejection(&err) {
        Error::backend(BACKEND, false, err)
    } else if needs_reconnect(&err) || retryable {
        Error::unavailable(BACKEND, err)
    } else {
        Error::backend(BACKEND, false, err)
    }
}

/// Whether `err` calls for a new connection: the connection failed, or the server it
/// leads to is no longer a writable master.
pub(crate) fn needs_reconnect(err: &RedisError) -> bool {
    err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_timeout()
        || matches!(
            err.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        )
}

/// Whether `err` is a server certificate this client rejected (unknown issuer, wrong
/// name, expired, ...): like a wrong password, a configuration problem that retrying
/// does not fix.
#[cfg(feature = "tls")]
fn is_certificate_rejection(err: &RedisError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if matches!(as_rustls(e), Some(rustls::Error::InvalidCertificate(_))) {
            return true;
        }
        source = e.source();
    }
    // redis-rs' cluster client keeps only the text of its first connections' failures
    // ("Failed to create initial connections - Io: invalid peer certificate: ..."):
    // rustls' wording of `InvalidCertificate`.
    err.to_string().contains("invalid peer certificate")
}

/// `e` as a rustls error, also when wrapped in an `io::Error` (whose `source` skips the
/// error it wraps) or in the `Arc` the `redis` crate keeps it in.
#[cfg(feature = "tls")]
fn as_rustls<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    if let Some(tls) = e.downcast_ref::<rustls::Error>() {
        Some(tls)
    } else if let Some(io) = e.downcast_ref::<std::io::Error>() {
        io.get_ref().and_then(|inner| as_rustls(inner))
    } else if let Some(shared) = e.downcast_ref::<Shared>() {
        as_rustls(&**shared)
    } else {
        None
    }
}

/// Without TLS there are no certificates to reject.
#[cfg(not(feature = "tls"))]
fn is_certificate_rejection(_err: &RedisError) -> bool {
    false
}
