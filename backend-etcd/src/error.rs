//! etcd client errors → fencelock error kinds, decided once here.

use fencelock_core::Error;

/// The backend name used in errors and metrics.
pub(crate) const BACKEND: &str = "etcd";

/// Maps an `etcd-client` error. Transport failures and gRPC codes that mean "try again"
/// are [`Error::Unavailable`]; everything else is a non-retryable [`Error::Backend`].
pub(crate) fn map(error: etcd_client::Error) -> Error {
    use etcd_client::Error as E;
    use tonic_code::*;
    let retryable = match &error {
        E::TransportError(_) | E::IoError(_) | E::WatchError(_) | E::LeaseKeepAliveError(_) => true,
        E::GRpcStatus(status) => matches!(
            status.code() as i32,
            UNAVAILABLE | DEADLINE_EXCEEDED | ABORTED | RESOURCE_EXHAUSTED | CANCELLED
        ),
        _ => false,
    };
    // A certificate the client refuses (wrong name, unknown issuer) reaches us as an
    // "unavailable" transport status: it is a misconfiguration, never an outage.
    if retryable && !is_certificate_rejection(&error) {
        Error::unavailable(BACKEND, error)
    } else {
        Error::backend(BACKEND, false, error)
    }
}

/// Whether `error` (or anything in its source chain) is rustls refusing the server's
/// certificate.
fn is_certificate_rejection(error: &etcd_client::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        let text = e.to_string();
        if text.contains("invalid peer certificate") || text.contains("NotValidForName") {
            return true;
        }
        source = e.source();
    }
    false
}

/// Whether a mapped error came from [`is_permission_denied`].
pub(crate) fn is_refused(error: &Error) -> bool {
    use std::error::Error as _;
    error
        .source()
        .and_then(|source| source.downcast_ref::<etcd_client::Error>())
        .is_some_and(is_permission_denied)
}

/// Whether etcd refused a request for lack of permission (RBAC): it did nothing.
pub(crate) fn is_permission_denied(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::GRpcStatus(status) if status.code() as i32 == tonic_code::PERMISSION_DENIED)
}

/// Whether etcd refused a request because the lease it names no longer exists (revoked
/// or expired): the session is gone even if its keepalive has not noticed yet.
pub(crate) fn is_lease_not_found(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::GRpcStatus(status) if status.message().contains("lease not found"))
}

/// Whether etcd refused a lease grant because a lease with the requested ID exists.
pub(crate) fn is_lease_exists(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::GRpcStatus(status) if status.message().contains("lease already exists"))
}

/// Whether etcd may still apply a request it answered with `error`: anything but a
/// refusal it makes before applying anything (bad arguments or too many operations, a
/// lease it does not know, permissions, authentication, rate limits, a full database).
/// A broken connection, a timeout, a leader change, or an error of the client's own
/// leave the outcome unknown.
pub(crate) fn outcome_unknown(error: &etcd_client::Error) -> bool {
    use tonic_code::*;
    match error {
        etcd_client::Error::GRpcStatus(status) => !matches!(
            status.code() as i32,
            INVALID_ARGUMENT
                | NOT_FOUND
                | ALREADY_EXISTS
                | PERMISSION_DENIED
                | RESOURCE_EXHAUSTED
                | FAILED_PRECONDITION
                | OUT_OF_RANGE
                | UNIMPLEMENTED
                | UNAUTHENTICATED
        ),
        _ => true,
    }
}

/// Whether a mapped error came from [`is_lease_not_found`].
pub(crate) fn is_stale_session(error: &Error) -> bool {
    use std::error::Error as _;
    error
        .source()
        .and_then(|source| source.downcast_ref::<etcd_client::Error>())
        .is_some_and(is_lease_not_found)
}

/// A timeout talking to etcd.
pub(crate) fn timed_out(what: &str) -> Error {
    Error::unavailable(BACKEND, format!("etcd did not answer {what} in time"))
}

/// gRPC status codes (stable numbers from the gRPC spec), so this crate need not depend on
/// tonic directly.
mod tonic_code {
    pub const CANCELLED: i32 = 1;
    pub const INVALID_ARGUMENT: i32 = 3;
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const NOT_FOUND: i32 = 5;
    pub const ALREADY_EXISTS: i32 = 6;
    pub const PERMISSION_DENIED: i32 = 7;
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    pub const FAILED_PRECONDITION: i32 = 9;
    pub const ABORTED: i32 = 10;
    pub const OUT_OF_RANGE: i32 = 11;
    pub const UNIMPLEMENTED: i32 = 12;
    pub const UNAVAILABLE: i32 = 14;
    pub const UNAUTHENTICATED: i32 = 16;
}
