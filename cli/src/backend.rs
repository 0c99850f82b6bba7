//! Connecting to the backend the command line names.

use std::fmt::Display;
use std::sync::Arc;
use std::time::Duration;

use fencelock::{Config, DistributedLock, Requirement, RetryPolicy};

use crate::args::{Backend, UrlArg};
use crate::exit::{Failure, code};

/// The configuration `args` names (see [`UrlArg::resolve`]), with `--require` added.
///
/// # Errors
///
/// A usage [`Failure`] when no backend is given (and `default_mem` is false), or the
/// URL, file or a requirement is bad.
pub fn config(args: &UrlArg, default_mem: bool) -> Result<(Backend, Config), Failure> {
    let backend = args.resolve(default_mem).map_err(Failure::usage)?;
    let mut config = match &backend {
        Backend::Url(url) => Config::from_url(url)?,
        Backend::File(path) => Config::from_file(path)?,
    };
    for requirement in &args.require {
        config = config.require(requirement.parse::<Requirement>()?);
    }
    Ok((backend, config))
}

/// Connects with the retry layer: the URL's or file's own `retry` settings when it has
/// them (one layer, never two), else the default policy.
///
/// # Cancel safety
///
/// Cancel safe: a dropped connect leaves no connection or task behind.
///
/// # Errors
///
/// As [`config`], and the library's connect errors.
pub async fn connect(
    args: &UrlArg,
    default_mem: bool,
) -> Result<Arc<dyn DistributedLock>, Failure> {
    let (_, config) = config(args, default_mem)?;
    connect_with_retry(config).await
}

async fn connect_with_retry(config: Config) -> Result<Arc<dyn DistributedLock>, Failure> {
    let config = match config.retry_policy() {
        Some(_) => config,
        None => config.retry(RetryPolicy::default()),
    };
    Ok(fencelock::connect_config(&config).await?)
}

/// [`connect`], given up after `limit` (the user's `--wait`, shown as `shown`) when that
/// comes before the backend's own connect timeout: `--wait` bounds the whole command,
/// connecting included. `None`: no limit but the connect timeout.
///
/// A connect cut short by the wait is [`code::UNAVAILABLE`], as a connect timeout is:
/// the backend did not answer, and no lock was asked for, so it is not the conflict
/// `--wait` otherwise reports (75), which a script may take for "someone else is on
/// it" and skip quietly while the backend is down.
///
/// # Cancel safety
///
/// As [`connect`].
///
/// # Errors
///
/// As [`connect`], and [`code::UNAVAILABLE`] when `limit` passes first.
pub async fn connect_within(
    args: &UrlArg,
    default_mem: bool,
    limit: Option<(Duration, &(dyn Display + Sync))>,
) -> Result<Arc<dyn DistributedLock>, Failure> {
    let (_, config) = config(args, default_mem)?;
    let Some((limit, shown)) = limit else {
        return connect_with_retry(config).await;
    };
    // The scheme names the backend, as the library's own unavailability errors do.
    let url = config.to_string();
    let backend = url
        .split_once("://")
        .map_or("", |(scheme, _)| scheme)
        .to_owned();
    match tokio::time::timeout(limit, connect_with_retry(config)).await {
        Ok(connected) => connected,
        Err(_) => Err(Failure::new(
            code::UNAVAILABLE,
            format!(
                "lock backend {backend} is unavailable: it did not answer the connection \
                 within --wait {shown}; nothing was acquired"
            ),
        )),
    }
}
