//! Layers: locks that wrap another lock and implement the same trait, so they compose.
//!
//! Composition order (outermost first): metrics → waiter limit → retry → migration →
//! backend. Metrics
//! then sees what the application sees (including retried acquisitions as one), and
//! retry never re-sends half of a migration's two-leg acquisition.

pub mod limit;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
pub mod migration;
pub mod retry;
