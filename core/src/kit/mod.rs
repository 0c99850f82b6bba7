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
//! - [`undo`]: the one undo-on-drop of an unfinished acquire ([`Undo`]): what the
//!   backend's [`Abandon`] says is left is undone in the background on the client's
//!   runtime, or inline for a short grace by a waiter that gives up.
//! - [`grants`]: the one grant registry ([`Grants`]): the grants a client's `close()`
//!   gives up, refusing grants once closed.
//! - [`turn`]: the one claim/wait loop ([`until_turn`]): refusing, waiting, looking
//!   again and giving up around the backend's [`Claim`].
//!
//! For backend implementations; applications never need it.

pub mod delayed;
pub mod drift;
pub mod grants;
pub mod held;
pub mod renewal;
pub mod turn;
pub mod undo;

pub use delayed::Delayed;
pub use drift::{CLOCK_DRIFT, DriftMargin};
pub use grants::Grants;
pub use held::{Deleted, Extension, Grant, Held};
pub use renewal::{Due, Renew, Renewals};
pub use turn::{Claim, GiveUp, Turn, until_turn};
pub use undo::{Abandon, Undo};
