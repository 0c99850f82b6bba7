//! `fencelock elect`: run a command while leader of an election, like `etcdctl elect`
//! with a command. The term is held and the command supervised exactly as `run` holds a
//! lock and supervises its command ([`run::run_holding`]): same environment (the term's
//! fencing token in `FENCELOCK_TOKEN`, plus `FENCELOCK_VALUE`), same process group, same
//! stop on loss and exit codes.

use crate::args::ElectArgs;
use crate::exit::Failure;
use crate::run::{self, Grant};

/// Campaigns, runs the command while leader, resigns when it exits; returns its exit
/// code.
///
/// # Errors
///
/// As [`run::run`]: not elected within `--wait` (75 or `-E`), leadership lost (76), a
/// value longer than the library's limit (64), and the rest.
///
/// # Cancel safety
///
/// Not meant to be cancelled, as [`run::run`].
pub async fn elect(args: ElectArgs) -> Result<u8, Failure> {
    let value = args.value();
    run::run_holding(args.into_run(), Grant::Leader(value)).await
}
