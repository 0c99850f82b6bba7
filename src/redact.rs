//! Keeping passwords out of errors and logs: one implementation, in core, shared by the
//! facade and every backend.

pub use fencelock_core::redact::{COMPONENT, redact_url};
