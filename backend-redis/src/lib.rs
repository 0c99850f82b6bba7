//! fencelock backend for Redis (single, Sentinel, Cluster, Redlock). Not implemented yet: [`connect`] reports that.

use std::sync::Arc;

use fencelock_core::{DistributedLock, Error};

/// Connects to the backend named by `url`.
///
/// # Cancel safety
///
/// Cancel safe.
///
/// # Errors
///
/// Always [`Error::InvalidConfig`] until the backend is implemented.
pub async fn connect(url: &str) -> Result<Arc<dyn DistributedLock>, Error> {
    let _ = url;
    Err(Error::InvalidConfig(
        "the redis backend is not implemented yet".into(),
    ))
}
