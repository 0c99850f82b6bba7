//! fencelock backend for ZooKeeper. Not implemented yet: [`connect`] reports that.

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
        "the zookeeper backend is not implemented yet".into(),
    ))
}
