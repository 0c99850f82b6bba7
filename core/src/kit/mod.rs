//! The held-lock kit: what every backend shares, so that a backend is only its protocol,
//! its wire layout and its config.
//!
//! - [`held`]: the one [`HeldLock`](crate::HeldLock) implementation ([`Held`]) around a
//!   backend's [`Grant`] (delete exactly one incarnation, stop renewal and watches,
//!   extend), with the release state machine every backend used to write itself.
//! - [`renewal`]: the one renewal scheduler ([`Renewals`]), one task per client renewing
//!   every lease due together through the backend's [`Renew`].
//! - [`delayed`]: the one delayed-watch mechanism ([`Delayed`]): a guard's loss watch
//!   starts only once it has lived for a while, polled in one task per client.
//! - [`drift`]: the one rule for the margin a local deadline keeps.
//!
//! For backend implementations; applications never need it.

pub mod delayed;
pub mod drift;
pub mod held;
pub mod renewal;

pub use delayed::Delayed;
pub use drift::{CLOCK_DRIFT, DriftMargin};
pub use held::{Deleted, Extension, Grant, Held};
pub use renewal::{Due, Renew, Renewals};
