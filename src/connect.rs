//! URL → backend: the one place that knows every backend.

use std::sync::Arc;

use fencelock_core::{DistributedLock, Error, MemoryLock};
use url::Url;

use crate::redact::redact_url;

/// The environment variable [`connect_from_env`] reads.
const URL_VAR: &str = "FENCELOCK_URL";

/// The URL schemes this build can connect to.
pub const SUPPORTED_SCHEMES: &[&str] = &[
    "mem",
    #[cfg(feature = "etcd")]
    "etcd",
    #[cfg(feature = "etcd")]
    "etcds",
    #[cfg(feature = "zookeeper")]
    "zk",
    #[cfg(feature = "zookeeper")]
    "zookeeper",
    #[cfg(feature = "redis")]
    "redis",
    #[cfg(feature = "redis")]
    "rediss",
    #[cfg(feature = "redis")]
    "redis+sentinel",
    #[cfg(feature = "redis")]
    "redis+cluster",
    #[cfg(feature = "redis")]
    "redlock",
];

/// Connects to the lock backend named by `url`.
///
/// | scheme | backend |
/// |---|---|
/// | `mem://` / `mem://NAMESPACE` | in-process memory; one shared set of locks per namespace |
///
/// The etcd, ZooKeeper and Redis schemes (`etcd`, `etcds`, `zk`, `zookeeper`, `redis`,
/// `rediss`, `redis+sentinel`, `redis+cluster`, `redlock`) are recognised and answered with
/// [`Error::BackendNotCompiled`] naming the cargo feature until their backends are built
/// in.
///
/// # Cancel safety
///
/// Cancel safe: a dropped connect leaves no connection or task behind.
///
/// # Errors
///
/// - [`Error::UnknownScheme`]: no backend has this scheme; the error lists the supported
///   ones.
/// - [`Error::BackendNotCompiled`]: a known scheme whose cargo feature is off.
/// - [`Error::InvalidUrl`]: the URL is malformed or has parts the backend does not accept.
///   Passwords are redacted from the message.
/// - Backend errors when the backend cannot be reached.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock::Error> {
/// let locks = fencelock::connect("mem://").await?;
/// assert_eq!(locks.backend(), "mem");
///
/// let err = fencelock::connect("consul://localhost").await.unwrap_err();
/// assert!(matches!(err, fencelock::Error::UnknownScheme { .. }));
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<Arc<dyn DistributedLock>, Error> {
    let Some((scheme, _)) = url.split_once("://") else {
        return Err(invalid(
            url,
            "expected SCHEME://..., for example mem:// or etcd://host:2379",
        ));
    };
    match scheme.to_ascii_lowercase().as_str() {
        "mem" => Ok(Arc::new(memory(url)?)),
        #[cfg(feature = "etcd")]
        "etcd" | "etcds" => fencelock_etcd::connect(url).await,
        #[cfg(not(feature = "etcd"))]
        "etcd" | "etcds" => Err(not_compiled(scheme, "etcd")),
        #[cfg(feature = "zookeeper")]
        "zk" | "zookeeper" => fencelock_zk::connect(url).await,
        #[cfg(not(feature = "zookeeper"))]
        "zk" | "zookeeper" => Err(not_compiled(scheme, "zookeeper")),
        #[cfg(feature = "redis")]
        "redis" | "rediss" | "redis+sentinel" | "redis+cluster" | "redlock" => {
            fencelock_redis::connect(url).await
        }
        #[cfg(not(feature = "redis"))]
        "redis" | "rediss" | "redis+sentinel" | "redis+cluster" | "redlock" => {
            Err(not_compiled(scheme, "redis"))
        }
        _ => Err(Error::UnknownScheme {
            scheme: scheme.to_owned(),
            supported: SUPPORTED_SCHEMES.to_vec(),
        }),
    }
}

/// Connects to the backend named by the `FENCELOCK_URL` environment variable, or to
/// `mem://` when it is unset or empty.
///
/// # Cancel safety
///
/// As [`connect`].
///
/// # Errors
///
/// As [`connect`]; a value that is not valid Unicode is [`Error::InvalidUrl`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock::Error> {
/// let locks = fencelock::connect_from_env().await?;
/// println!("locking with {}", locks.backend());
/// # Ok(()) }
/// ```
pub async fn connect_from_env() -> Result<Arc<dyn DistributedLock>, Error> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.trim().is_empty() => connect(url.trim()).await,
        Ok(_) | Err(std::env::VarError::NotPresent) => connect("mem://").await,
        Err(std::env::VarError::NotUnicode(_)) => Err(Error::InvalidUrl {
            url: format!("${URL_VAR}"),
            reason: "the value is not valid Unicode".into(),
        }),
    }
}

fn memory(url: &str) -> Result<MemoryLock, Error> {
    let parsed = Url::parse(url).map_err(|e| invalid(url, &e.to_string()))?;
    if !parsed.username().is_empty() || parsed.password().is_some() || parsed.port().is_some() {
        return Err(invalid(url, "mem:// takes no user, password or port"));
    }
    if !matches!(parsed.path(), "" | "/") || parsed.query().is_some() || parsed.fragment().is_some()
    {
        return Err(invalid(
            url,
            "mem:// takes only an optional namespace: mem://NAMESPACE",
        ));
    }
    Ok(MemoryLock::named(parsed.host_str().unwrap_or("")))
}

fn invalid(url: &str, reason: &str) -> Error {
    Error::InvalidUrl {
        url: redact_url(url),
        reason: reason.to_owned(),
    }
}

#[cfg_attr(
    all(feature = "etcd", feature = "zookeeper", feature = "redis"),
    allow(dead_code)
)]
fn not_compiled(scheme: &str, feature: &'static str) -> Error {
    Error::BackendNotCompiled {
        scheme: scheme.to_owned(),
        feature,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(result: Result<Arc<dyn DistributedLock>, Error>) -> String {
        match result {
            Ok(lock) => format!("ok:{}", lock.backend()),
            Err(Error::UnknownScheme { .. }) => "unknown-scheme".into(),
            Err(Error::BackendNotCompiled { feature, .. }) => format!("needs-feature:{feature}"),
            Err(Error::InvalidUrl { .. }) => "invalid-url".into(),
            Err(e) => format!("other:{e}"),
        }
    }

    #[tokio::test]
    async fn url_table() {
        let cases = [
            ("mem://", "ok:mem"),
            ("mem://team-a", "ok:mem"),
            ("MEM://", "ok:mem"),
            ("mem://team-a/extra", "invalid-url"),
            ("mem://?lease=3s", "invalid-url"),
            ("mem://user:pw@x", "invalid-url"),
            ("etcd://127.0.0.1:2379/locks", "needs-feature:etcd"),
            ("etcds://127.0.0.1:2379/locks", "needs-feature:etcd"),
            ("zk://127.0.0.1:2181/locks", "needs-feature:zookeeper"),
            ("zookeeper://127.0.0.1:2181", "needs-feature:zookeeper"),
            ("redis://127.0.0.1", "needs-feature:redis"),
            ("redis+cluster://a:1,b:2", "needs-feature:redis"),
            ("redlock://a:1,b:2,c:3", "needs-feature:redis"),
            ("consul://127.0.0.1:8500", "unknown-scheme"),
            ("127.0.0.1:2379", "invalid-url"),
            ("", "invalid-url"),
        ];
        let compiled = |feature: &str| {
            (feature == "etcd" && cfg!(feature = "etcd"))
                || (feature == "zookeeper" && cfg!(feature = "zookeeper"))
                || (feature == "redis" && cfg!(feature = "redis"))
        };
        for (url, expected) in cases {
            // Backends that are compiled in are tested against real servers in their own
            // URL tables; here only the "feature is off" answer is checked.
            if expected
                .strip_prefix("needs-feature:")
                .is_some_and(compiled)
            {
                continue;
            }
            assert_eq!(kind(connect(url).await), expected, "{url}");
        }
    }

    #[tokio::test]
    async fn invalid_url_errors_hide_passwords() {
        let err = connect("mem://admin:hunter2@x").await.unwrap_err();
        let (shown, debug) = (err.to_string(), format!("{err:?}"));
        assert!(
            !shown.contains("hunter2") && !debug.contains("hunter2"),
            "{shown} / {debug}"
        );
    }

    #[tokio::test]
    async fn unknown_scheme_lists_what_this_build_supports() {
        let err = connect("consul://x").await.unwrap_err();
        assert!(err.to_string().contains("supports: mem"), "{err}");
    }

    #[tokio::test]
    async fn mem_urls_share_locks_per_namespace() {
        use fencelock_core::DistributedLockExt;
        let a = connect("mem://connect-tests").await.unwrap();
        let b = connect("mem://connect-tests").await.unwrap();
        let other = connect("mem://connect-tests-other").await.unwrap();
        let guard = a.lock("x").await.unwrap();
        assert!(b.try_lock("x").await.unwrap().is_none());
        assert!(other.try_lock("x").await.unwrap().is_some());
        guard.release().await.unwrap();
    }
}
