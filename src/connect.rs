//! URL → backend: the one place that knows every backend.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use fencelock_core::{DistributedLock, Error, MemoryLock, Retry, WaiterLimit};
use url::Url;

use crate::redact::redact_url;
use crate::{Config, migrate, requirement};

/// The environment variable [`connect_from_env`] reads first: a URL.
const URL_VAR: &str = "FENCELOCK_URL";

/// The environment variable [`connect_from_env`] reads when there is no URL: the path of
/// a TOML config file.
const CONFIG_VAR: &str = "FENCELOCK_CONFIG";

/// The URL schemes this build can connect to.
pub const SUPPORTED_SCHEMES: &[&str] = &[
    "mem",
    "migrate",
    #[cfg(feature = "etcd")]
    "etcd",
    #[cfg(feature = "etcd-tls")]
    "etcds",
    #[cfg(feature = "zookeeper")]
    "zk",
    #[cfg(feature = "zookeeper")]
    "zookeeper",
    #[cfg(feature = "zookeeper-tls")]
    "zks",
    #[cfg(feature = "redis")]
    "redis",
    #[cfg(feature = "redis")]
    "redis+sentinel",
    #[cfg(feature = "redis")]
    "redis+cluster",
    #[cfg(feature = "redis")]
    "redlock",
    #[cfg(feature = "redis-tls")]
    "rediss",
    #[cfg(feature = "redis-tls")]
    "rediss+sentinel",
    #[cfg(feature = "redis-tls")]
    "rediss+cluster",
    #[cfg(feature = "redis-tls")]
    "redlocks",
];

/// Connects to the lock backend named by `url`.
///
/// | scheme | backend | cargo feature |
/// |---|---|---|
/// | `mem://` / `mem://NAMESPACE` | in-process memory; one shared set of locks per namespace | always |
/// | `etcd://host:port[,host:port...]/prefix[?lease=30s]`, `etcds://` | etcd v3 (see `fencelock_etcd::EtcdConfig`) | `etcd` (`etcds://`: `etcd-tls`) |
/// | `zk://host:port[,...][/chroot][?session_timeout=30s]`, `zookeeper://`, `zks://` | ZooKeeper (see `fencelock_zk::ZkConfig`) | `zookeeper` (`zks://`: `zookeeper-tls`; `sasl=digest-md5`: `zookeeper-sasl`) |
/// | `redis://`, `redis+sentinel://`, `redis+cluster://`, `redlock://`; over TLS `rediss://`, `rediss+sentinel://`, `rediss+cluster://`, `redlocks://` | Redis (see `fencelock_redis::RedisConfig`) | `redis` (the TLS schemes: `redis-tls`) |
/// | `migrate://?legacy=URL&target=URL&phase=...` | the migration layer over two of the above | always (plus the legs' features) |
///
/// On every scheme the query may also carry the facade's options: `require=...`
/// (capabilities the backend must have, see [`Requirement`](crate::Requirement)),
/// `retry=N` and `metrics=true` (see [`Config`]). This is `connect_config(&Config::from_url(url)?)`.
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
/// - [`Error::InvalidUrl`]: the URL is malformed or has parts the backend does not accept
///   (or one given twice). Passwords are redacted from the message.
/// - [`Error::InvalidConfig`]: a value out of range (a lease below the backend's minimum,
///   an empty etcd prefix), an unknown requirement, or `metrics=true` without the
///   `metrics` feature.
/// - [`Error::RequirementNotMet`]: the backend lacks a required capability.
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
    connect_config(&Config::from_url(url)?).await
}

/// Connects as `config` says, then checks its requirements and adds its layers.
///
/// # Cancel safety
///
/// Cancel safe: a dropped connect leaves no connection or task behind.
///
/// # Errors
///
/// As [`connect`]. A backend that lacks a required capability is refused with
/// [`Error::RequirementNotMet`] naming the requirement and what the backend offers.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock::Error> {
/// let config = fencelock::Config::from_toml_str(r#"
///     backend = "mem"
///     require = ["linearizable", "fencing=strong"]
/// "#)?;
/// let locks = fencelock::connect_config(&config).await?;
/// assert_eq!(locks.backend(), "mem");
/// # Ok(()) }
/// ```
pub async fn connect_config(config: &Config) -> Result<Arc<dyn DistributedLock>, Error> {
    let lock = open(config.backend_url()).await?;
    requirement::check_all(&*lock, config.requirements())?;
    let lock: Arc<dyn DistributedLock> = match config.retry_policy() {
        Some(policy) if policy.retries() > 0 => Arc::new(Retry::new(lock, *policy)),
        _ => lock,
    };
    let lock: Arc<dyn DistributedLock> = match config.waiter_limit() {
        Some(limit) => Arc::new(WaiterLimit::new(lock, limit)?),
        None => lock,
    };
    with_metrics(lock, config.has_metrics(), config.has_metrics_names())
}

#[cfg(feature = "metrics")]
fn with_metrics(
    lock: Arc<dyn DistributedLock>,
    on: bool,
    names: bool,
) -> Result<Arc<dyn DistributedLock>, Error> {
    if names && !on {
        return Err(Error::InvalidConfig(
            "metrics_names=true labels the metrics layer's metrics: it needs metrics=true".into(),
        ));
    }
    let options = if names {
        crate::MetricsOptions::new().with_name_label()
    } else {
        crate::MetricsOptions::new()
    };
    Ok(if on {
        Arc::new(crate::Metrics::new(lock, options))
    } else {
        lock
    })
}

#[cfg(not(feature = "metrics"))]
fn with_metrics(
    lock: Arc<dyn DistributedLock>,
    on: bool,
    names: bool,
) -> Result<Arc<dyn DistributedLock>, Error> {
    if on || names {
        return Err(Error::InvalidConfig(
            "metrics=true needs fencelock's cargo feature `metrics`, which this build does not \
             enable: build with it (`features = [\"metrics\"]` on the fencelock dependency, or \
             `cargo build --features metrics`)"
                .into(),
        ));
    }
    Ok(lock)
}

/// A boxed future of a connected lock. Boxing cuts the future's type short: `migrate://`
/// connects its legs through [`connect_config`] again, and callers' futures stay small.
type LockFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Arc<dyn DistributedLock>, Error>> + Send + 'a>>;

/// The one place that maps a URL scheme to a backend.
fn open(url: &str) -> LockFuture<'_> {
    Box::pin(open_scheme(url))
}

async fn open_scheme(url: &str) -> Result<Arc<dyn DistributedLock>, Error> {
    let Some((scheme, _)) = url.split_once("://") else {
        return Err(invalid(
            url,
            "expected SCHEME://..., for example mem:// or etcd://host:2379",
        ));
    };
    match scheme.to_ascii_lowercase().as_str() {
        "mem" => Ok(Arc::new(memory(url)?)),
        "migrate" => migrate::connect(url).await,
        #[cfg(feature = "etcd")]
        "etcd" => fencelock_etcd::connect(url).await,
        #[cfg(not(feature = "etcd"))]
        "etcd" => Err(not_compiled(scheme, "etcd")),
        #[cfg(feature = "etcd-tls")]
        "etcds" => fencelock_etcd::connect(url).await,
        #[cfg(not(feature = "etcd-tls"))]
        "etcds" => Err(not_compiled(scheme, "etcd-tls")),
        #[cfg(feature = "zookeeper")]
        "zk" | "zookeeper" => fencelock_zk::connect(url).await,
        #[cfg(not(feature = "zookeeper"))]
        "zk" | "zookeeper" => Err(not_compiled(scheme, "zookeeper")),
        #[cfg(feature = "zookeeper-tls")]
        "zks" => fencelock_zk::connect(url).await,
        #[cfg(not(feature = "zookeeper-tls"))]
        "zks" => Err(not_compiled(scheme, "zookeeper-tls")),
        #[cfg(feature = "redis")]
        "redis" | "redis+sentinel" | "redis+cluster" | "redlock" => {
            fencelock_redis::connect(url).await
        }
        #[cfg(not(feature = "redis"))]
        "redis" | "redis+sentinel" | "redis+cluster" | "redlock" => {
            Err(not_compiled(scheme, "redis"))
        }
        #[cfg(feature = "redis-tls")]
        "rediss" | "rediss+sentinel" | "rediss+cluster" | "redlocks" => {
            fencelock_redis::connect(url).await
        }
        #[cfg(not(feature = "redis-tls"))]
        "rediss" | "rediss+sentinel" | "rediss+cluster" | "redlocks" => {
            Err(not_compiled(scheme, "redis-tls"))
        }
        // Text before the first `://` that is no scheme (`admin:pw@h/x?legacy=redis`) is
        // not quoted back: it may hold a password.
        _ if !fencelock_core::urlparts::is_scheme(scheme) => Err(invalid(
            url,
            "expected SCHEME://..., for example mem:// or etcd://host:2379",
        )),
        _ => Err(Error::UnknownScheme {
            scheme: scheme.to_owned(),
            supported: SUPPORTED_SCHEMES.to_vec(),
        }),
    }
}

/// Connects to the backend named by the environment: the URL in `FENCELOCK_URL`, else
/// the TOML config file whose path is in `FENCELOCK_CONFIG`. With neither set it is an
/// error, never a silent in-memory lock: `mem://` excludes the tasks of one process
/// only, so a service deployed on two hosts would run its critical section on both.
/// `FENCELOCK_URL=mem://` asks for memory in so many words; tests and examples that want
/// memory by default call [`connect_from_env_or_memory`].
///
/// An empty variable counts as unset.
///
/// # Cancel safety
///
/// As [`connect`].
///
/// # Errors
///
/// - [`Error::InvalidConfig`] when neither `FENCELOCK_URL` nor `FENCELOCK_CONFIG` is set:
///   the message names both, and any set variable whose name looks like a misspelling of
///   one of them (`FENCELOCK_ULR`, `fencelock_url`).
/// - As [`connect`] and [`Config::from_file`]; a value that is not valid Unicode is
///   [`Error::InvalidUrl`] / [`Error::InvalidConfig`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// match fencelock::connect_from_env().await {
///     Ok(locks) => println!("locking with {}", locks.backend()),
///     // Neither FENCELOCK_URL nor FENCELOCK_CONFIG is set (or the backend is down).
///     Err(e) => eprintln!("no lock backend: {e}"),
/// }
/// # }
/// ```
pub async fn connect_from_env() -> Result<Arc<dyn DistributedLock>, Error> {
    connect_to(from_env(&process_env(), Unset::Refuse)?).await
}

/// [`connect_from_env`], but with neither `FENCELOCK_URL` nor `FENCELOCK_CONFIG` set it
/// connects to `mem://`: for tests, examples and demos that run anywhere.
///
/// **Not for services.** The memory backend's locks exclude the tasks of this one
/// process only: a service that is deployed on two hosts, or runs as two processes, and
/// whose variable is missing or misspelled (`FENCELOCK_ULR`) runs its critical section
/// in both at once, with no error. Production code calls [`connect_from_env`] (which
/// refuses to guess) or [`connect`] with a URL.
///
/// # Cancel safety
///
/// As [`connect`].
///
/// # Errors
///
/// As [`connect_from_env`], except that nothing set is not one.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock::Error> {
/// let locks = fencelock::connect_from_env_or_memory().await?;
/// println!("locking with {}", locks.backend()); // "mem" when nothing is set
/// # Ok(()) }
/// ```
pub async fn connect_from_env_or_memory() -> Result<Arc<dyn DistributedLock>, Error> {
    connect_to(from_env(&process_env(), Unset::Memory)?).await
}

/// What [`from_env`] does when neither variable is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unset {
    /// An [`Error::InvalidConfig`] naming the variables read.
    Refuse,
    /// `mem://`.
    Memory,
}

/// The backend the environment names.
#[derive(Debug, PartialEq, Eq)]
enum EnvBackend {
    /// A URL (`FENCELOCK_URL`, or `mem://` by default).
    Url(String),
    /// The path of a TOML config file (`FENCELOCK_CONFIG`).
    File(std::ffi::OsString),
}

/// The variables of an environment: each one's name and value.
type Env = Vec<(std::ffi::OsString, std::ffi::OsString)>;

fn process_env() -> Env {
    std::env::vars_os().collect()
}

/// The backend `env` names, read before connecting (so the connect future holds no
/// view of the environment).
fn from_env(env: &Env, unset: Unset) -> Result<EnvBackend, Error> {
    let set = |wanted: &str| {
        env.iter()
            .find(|(name, value)| name == wanted && !value.is_empty())
            .map(|(_, value)| value.clone())
    };
    if let Some(url) = set(URL_VAR) {
        let Some(url) = url.to_str() else {
            return Err(Error::InvalidUrl {
                url: format!("${URL_VAR}"),
                reason: "the value is not valid Unicode".into(),
            });
        };
        if !url.trim().is_empty() {
            return Ok(EnvBackend::Url(url.trim().to_owned()));
        }
    }
    if let Some(path) = set(CONFIG_VAR) {
        return Ok(EnvBackend::File(path));
    }
    match unset {
        Unset::Memory => Ok(EnvBackend::Url("mem://".into())),
        Unset::Refuse => Err(no_backend(env.iter().filter_map(|(name, _)| name.to_str()))),
    }
}

async fn connect_to(backend: EnvBackend) -> Result<Arc<dyn DistributedLock>, Error> {
    match backend {
        EnvBackend::Url(url) => connect(&url).await,
        EnvBackend::File(path) => connect_config(&Config::from_file(path)?).await,
    }
}

/// The error of [`connect_from_env`] with neither variable set: it names both, and the
/// set variables among `names` that look like a misspelling of one.
fn no_backend<'a>(names: impl Iterator<Item = &'a str>) -> Error {
    let mut message = format!(
        "no lock backend given: {URL_VAR} (a URL) and {CONFIG_VAR} (a TOML file's path) \
         are both unset or empty; set one (FENCELOCK_URL=mem:// locks inside this one \
         process only)"
    );
    let mut near: Vec<&str> = names.filter(|name| looks_like_ours(name)).collect();
    near.sort_unstable();
    near.dedup();
    if !near.is_empty() {
        message.push_str("; set but not read: ");
        message.push_str(&near.join(", "));
        message.push_str(" (misspelled?)");
    }
    Error::InvalidConfig(message)
}

/// Whether `name` is not one of the variables read but within two edits (ignoring case)
/// of one: `FENCELOCK_ULR`, `FENCELOCK_CONFG`, `fencelock_url`, `FENCE_LOCK_URL`. The
/// variables `fencelock run` sets for its command (`FENCELOCK_TOKEN`, `FENCELOCK_KEY`,
/// ...) are farther off.
fn looks_like_ours(name: &str) -> bool {
    // Long names are no misspelling, and the distance below is quadratic in the length.
    if name == URL_VAR || name == CONFIG_VAR || name.len() > 40 {
        return false;
    }
    let name = name.to_ascii_uppercase();
    [URL_VAR, CONFIG_VAR]
        .iter()
        .any(|ours| edit_distance(&name, ours) <= 2)
}

/// The Levenshtein distance of two strings, by bytes.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, x) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, y) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(x != y);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

fn memory(url: &str) -> Result<MemoryLock, Error> {
    Ok(MemoryLock::named(&mem_namespace(url)?))
}

/// The namespace of a `mem://` URL.
fn mem_namespace(url: &str) -> Result<String, Error> {
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
    Ok(parsed.host_str().unwrap_or("").to_owned())
}

/// Parses `url` with its backend's own parser, without connecting: every malformed URL
/// is an [`Error::InvalidUrl`] (or, for a value out of range, an
/// [`Error::InvalidConfig`]) before any I/O. Schemes that are unknown or not compiled
/// in pass here; [`connect_config`] reports them.
pub(crate) fn check_backend_url(url: &str) -> Result<(), Error> {
    let Some((scheme, _)) = url.split_once("://") else {
        return Ok(());
    };
    match scheme.to_ascii_lowercase().as_str() {
        "mem" => mem_namespace(url).map(drop),
        #[cfg(feature = "etcd")]
        "etcd" => fencelock_etcd::EtcdConfig::from_url(url).map(drop),
        #[cfg(feature = "etcd-tls")]
        "etcds" => fencelock_etcd::EtcdConfig::from_url(url).map(drop),
        #[cfg(feature = "zookeeper")]
        "zk" | "zookeeper" => fencelock_zk::ZkConfig::from_url(url).map(drop),
        #[cfg(feature = "zookeeper-tls")]
        "zks" => fencelock_zk::ZkConfig::from_url(url).map(drop),
        #[cfg(feature = "redis")]
        "redis" | "redis+sentinel" | "redis+cluster" | "redlock" => {
            fencelock_redis::RedisConfig::from_url(url).map(drop)
        }
        #[cfg(feature = "redis-tls")]
        "rediss" | "rediss+sentinel" | "rediss+cluster" | "redlocks" => {
            fencelock_redis::RedisConfig::from_url(url).map(drop)
        }
        _ => Ok(()),
    }
}

fn invalid(url: &str, reason: &str) -> Error {
    Error::InvalidUrl {
        url: redact_url(url),
        reason: reason.to_owned(),
    }
}

#[cfg_attr(
    all(
        feature = "etcd",
        feature = "zookeeper",
        feature = "zookeeper-tls",
        feature = "redis"
    ),
    allow(dead_code)
)]
fn not_compiled(scheme: &str, feature: &'static str) -> Error {
    Error::BackendNotCompiled {
        scheme: scheme.to_owned(),
        feature,
    }
}

#[cfg(test)]
mod tests;
