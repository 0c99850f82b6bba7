//! Connecting to the backend the command line names.

use std::sync::Arc;

use fencelock::{Config, DistributedLock, Requirement, RetryPolicy};

use crate::args::{Backend, UrlArg};
use crate::exit::Failure;

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
    let config = match config.retry_policy() {
        Some(_) => config,
        None => config.retry(RetryPolicy::default()),
    };
    Ok(fencelock::connect_config(&config).await?)
}
