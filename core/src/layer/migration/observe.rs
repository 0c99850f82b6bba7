//! An observation of a single-leg phase's election: the leg's terms, each with its token
//! in the leg's era.

use std::sync::Arc;

use super::BACKEND;
use super::token::era_token;
use crate::{Error, Leader, LeaderChange, LeaderChanges};

/// The leg's observation `inner`, each term's token mapped to `epoch`'s era, by a task on
/// `runtime` (the lock's, see `MigrationLock::runtime`) or, without one or once it has
/// ended, on the runtime of this call.
///
/// # Errors
///
/// [`Error::InvalidConfig`] when there is no runtime to run the mapping on.
pub(super) fn mapped(
    inner: LeaderChanges,
    epoch: u8,
    runtime: Option<tokio::runtime::Handle>,
) -> Result<LeaderChanges, Error> {
    let (changes, receiver) = tokio::sync::mpsc::unbounded_channel();
    let stop = tokio_util::sync::CancellationToken::new();
    let stopped = stop.clone();
    // Taken by the mapping task when it starts, and put back when it is dropped
    // unfinished (its runtime shut down): `spawn_kept` then builds it again on the
    // next runtime, which takes the leg's stream and the caller's sender over.
    let slot = Arc::new(std::sync::Mutex::new(Some((inner, changes))));
    // Maps each term's token to the era's; ends with the caller's stream. On the
    // lock's own runtime (see `MigrationLock::runtime`), else, or when that one has
    // ended (also while the observation runs), this call's.
    let runtimes = runtime
        .into_iter()
        .chain(tokio::runtime::Handle::try_current().ok());
    let left = slot.clone();
    let started = crate::kept::spawn_kept(
        runtimes,
        move || {
            let (slot, stopped) = (slot.clone(), stopped.clone());
            async move {
                let Some(mut lent) = Lent::take(&slot) else {
                    return;
                };
                let Some((inner, changes)) = lent.mapping.as_mut() else {
                    return;
                };
                loop {
                    let change = tokio::select! {
                        () = stopped.cancelled() => break,
                        change = inner.next() => change,
                    };
                    let Some(change) = change else { break };
                    let mapped = change.and_then(|leader| {
                        leader
                            .map(|l| Ok(Leader::new(l.value, era_token(epoch, l.token)?)))
                            .transpose()
                    });
                    // The stream ends after an error, as the trait says: also after
                    // one of ours (a token too large for the era bits) while the
                    // inner one goes on.
                    let failed = mapped.is_err();
                    if changes.send(mapped).is_err() || failed {
                        break;
                    }
                }
                // Done: dropped here, not put back.
                lent.finish();
            }
        },
        // Every runtime it could run on has ended: the caller's stream is told so,
        // rather than just ending (which would read as an observation nobody ends).
        move || {
            let mapping = left
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let Some((_, changes)) = mapping {
                let _ = changes.send(Err(Error::unavailable(
                    BACKEND,
                    "every Tokio runtime this election could be observed on shut down; \
                     observe it again on a running one",
                )));
            }
        },
    );
    if !started {
        return Err(Error::InvalidConfig(
            "the migration layer needs a Tokio runtime".into(),
        ));
    }
    Ok(LeaderChanges::new(receiver, stop))
}

/// What an observation's mapping task works with: the leg's stream and the caller's
/// sender.
type Mapping = (
    LeaderChanges,
    tokio::sync::mpsc::UnboundedSender<LeaderChange>,
);

/// A mapping task's [`Mapping`], taken from its slot: put back when the task is
/// dropped unfinished, so the task built again on another runtime goes on with it.
struct Lent {
    slot: Arc<std::sync::Mutex<Option<Mapping>>>,
    mapping: Option<Mapping>,
}

impl Lent {
    fn take(slot: &Arc<std::sync::Mutex<Option<Mapping>>>) -> Option<Lent> {
        let mapping = slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()?;
        Some(Lent {
            slot: slot.clone(),
            mapping: Some(mapping),
        })
    }

    /// The observation ended: nothing is put back.
    fn finish(mut self) {
        self.mapping = None;
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(mapping) = self.mapping.take() {
            *self
                .slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(mapping);
        }
    }
}
