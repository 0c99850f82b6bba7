//! The one error type of fencelock.

use std::time::Duration;

/// A boxed error from a backend's client library.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong when taking, holding or releasing a lock.
///
/// The variants are stable *kinds* that callers can match on; new kinds may be added, so
/// the enum is `#[non_exhaustive]`. Whether an error is worth retrying is decided once,
/// by the backend that produced it, and read with [`Error::is_retryable`]: layers such as
/// retry never inspect backend-specific types.
///
/// Neither `Display` nor `Debug` ever contains a password: configuration errors name the
/// offending setting, not its value, and URLs are redacted before they are stored here.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock is held by someone else and the caller asked not to wait.
    #[error("lock {name:?} is held by another owner")]
    Contended {
        /// The lock name.
        name: String,
    },

    /// The lock was not acquired within the wait the caller allowed.
    #[error("lock {name:?} was not acquired within {waited:?}")]
    Timeout {
        /// The lock name.
        name: String,
        /// How long the caller was willing to wait.
        waited: Duration,
    },

    /// Ownership can no longer be guaranteed: the lease or session expired, renewal failed
    /// past the local deadline, or the lock was deleted by someone else. Anything done
    /// under the lock after this point may overlap with another holder; only a resource
    /// that checks the fencing token is protected.
    #[error("lock {name:?} was lost: {reason}")]
    Lost {
        /// The lock name.
        name: String,
        /// Why ownership ended, for humans.
        reason: String,
    },

    /// An operation needs the lock, but this guard does not hold it. The contract's
    /// error list has it; no operation of this version returns it: `release` consumes
    /// the guard, and an operation on a guard that lost its lock answers
    /// [`Error::Lost`].
    #[error("lock {name:?} is not held by this guard")]
    NotHeld {
        /// The lock name.
        name: String,
    },

    /// The lock name is not acceptable (empty, control characters, too long). Reported
    /// before any I/O.
    #[error("invalid lock name {name:?}: {reason}")]
    InvalidName {
        /// The offending name, shortened to at most 64 characters.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// A setting is out of range or inconsistent (for example a zero lease, or a lease
    /// shorter than the backend's minimum). Never silently corrected.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    /// A URL could not be parsed, or a part of it is malformed.
    #[error("invalid URL {url}: {reason}")]
    InvalidUrl {
        /// The URL with any password replaced by `***`.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The URL's scheme names no backend fencelock knows.
    #[error("unknown lock backend scheme {scheme:?}; this build supports: {}", .supported.join(", "))]
    UnknownScheme {
        /// The scheme found in the URL.
        scheme: String,
        /// The schemes this build can connect to.
        supported: Vec<&'static str>,
    },

    /// The scheme is known, but its backend was not compiled into this build.
    #[error(
        "lock backend scheme {scheme:?} needs fencelock's cargo feature `{feature}`, which this build does not enable: build with it (`features = [\"{feature}\"]` on the fencelock dependency, or `cargo build --features {feature}`)"
    )]
    BackendNotCompiled {
        /// The scheme found in the URL.
        scheme: String,
        /// The cargo feature that enables it.
        feature: &'static str,
    },

    /// The deployment requires a property the backend does not guarantee.
    #[error("backend {backend} does not satisfy the requirement {requirement}: {reason}")]
    RequirementNotMet {
        /// The backend's short name.
        backend: &'static str,
        /// The requirement, as written in the configuration.
        requirement: String,
        /// What the backend offers instead.
        reason: String,
    },

    /// The backend does not offer this operation (for example leader election on a
    /// backend that has no election); see its capabilities. Not retryable.
    #[error("lock backend {backend} does not support {operation}")]
    Unsupported {
        /// The backend's short name.
        backend: &'static str,
        /// What was asked for.
        operation: &'static str,
    },

    /// The client already has as many acquires waiting as its waiter limit allows
    /// ([`WaiterLimit`](crate::layer::limit::WaiterLimit), URL option `max_waiters=N`):
    /// refused at once, before anything was sent, so an overload cannot pile up queue
    /// entries, watches and memory without bound. Not retryable by the retry layer;
    /// shed the work or try again later.
    #[error("too many waiting acquires on this client ({limit}); {name:?} was refused")]
    TooManyWaiters {
        /// The lock name.
        name: String,
        /// The client's limit.
        limit: usize,
    },

    /// The client was closed with [`DistributedLock::close`](crate::DistributedLock::close):
    /// it takes no locks any more. Not retryable; connect a new client.
    #[error("lock backend {backend} client was closed")]
    Closed {
        /// The backend's short name.
        backend: &'static str,
    },

    /// The backend could not be reached (connection refused or reset, no quorum, timed out
    /// talking to the server). Retryable.
    #[error("lock backend {backend} is unavailable")]
    Unavailable {
        /// The backend's short name.
        backend: &'static str,
        /// The underlying failure.
        #[source]
        source: BoxError,
    },

    /// Any other failure reported by the backend or its client library.
    #[error("lock backend {backend} failed")]
    Backend {
        /// The backend's short name.
        backend: &'static str,
        /// Whether repeating the operation may succeed, as decided by the backend.
        retryable: bool,
        /// The underlying failure.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Whether repeating the failed operation may succeed.
    ///
    /// True for [`Error::Unavailable`] and for [`Error::Backend`] errors the backend
    /// marked retryable. Never true for contention, timeouts, loss or bad input: retrying
    /// those either cannot help or would hide a safety problem.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Unavailable { .. } => true,
            Error::Backend { retryable, .. } => *retryable,
            _ => false,
        }
    }

    /// The [`Error::InvalidConfig`] of [`LockGuard::extend`](crate::LockGuard::extend) on
    /// a renewing lease, the same from every backend.
    pub fn not_a_fixed_lease() -> Self {
        Error::InvalidConfig(
            "only a fixed lease is extended; a renewing lease renews itself while the guard \
             lives"
                .into(),
        )
    }

    /// Shorthand for [`Error::Lost`].
    pub fn lost(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Lost {
            name: name.into(),
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::Unavailable`].
    pub fn unavailable(backend: &'static str, source: impl Into<BoxError>) -> Self {
        Error::Unavailable {
            backend,
            source: source.into(),
        }
    }

    /// Shorthand for [`Error::Backend`].
    pub fn backend(backend: &'static str, retryable: bool, source: impl Into<BoxError>) -> Self {
        Error::Backend {
            backend,
            retryable,
            source: source.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryability_is_decided_by_kind() {
        let io = || std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(Error::unavailable("mem", io()).is_retryable());
        assert!(Error::backend("mem", true, io()).is_retryable());
        assert!(!Error::backend("mem", false, io()).is_retryable());
        assert!(!Error::Contended { name: "a".into() }.is_retryable());
        assert!(!Error::lost("a", "expired").is_retryable());
        assert!(!Error::Closed { backend: "mem" }.is_retryable());
        assert!(
            !Error::Timeout {
                name: "a".into(),
                waited: Duration::from_secs(1)
            }
            .is_retryable()
        );
    }

    #[test]
    fn messages_name_the_fix() {
        let e = Error::BackendNotCompiled {
            scheme: "etcd".into(),
            feature: "etcd",
        };
        assert!(e.to_string().contains("feature `etcd`"));
        // How to get it, not only what is missing.
        assert!(
            e.to_string().contains("`cargo build --features etcd`"),
            "{e}"
        );
        let e = Error::UnknownScheme {
            scheme: "consul".into(),
            supported: vec!["mem"],
        };
        assert!(e.to_string().contains("supports: mem"));
    }
}
