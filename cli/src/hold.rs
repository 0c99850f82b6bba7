//! `fencelock hold`: take a lock, print it, hold it until a signal (`etcdctl lock NAME`).

use serde_json::json;

use crate::args::HoldArgs;
use crate::events::Events;
use crate::exit::{Failure, code, one_line};
use crate::run::{Acquired, CLEANUP_TIMEOUT, Grant, acquire};
use crate::signals::Signals;

/// Holds the lock until SIGINT, SIGTERM or SIGHUP, then releases it.
///
/// # Errors
///
/// A [`Failure`] when the lock cannot be taken or is lost while held (76).
///
/// # Cancel safety
///
/// Not meant to be cancelled: the lock is released on a signal instead.
pub async fn hold(args: HoldArgs) -> Result<u8, Failure> {
    let events = Events::new(&args.output);
    let mut signals = Signals::listen()?;
    let (_locks, guard) = match acquire(
        &args.url,
        &args.wait,
        &args.name,
        &Grant::Lock,
        &events,
        &mut signals,
    )
    .await?
    {
        Acquired::Held(locks, guard) => (locks, guard),
        Acquired::Interrupted(code) => return Ok(code),
    };
    let key = guard.backend_key().unwrap_or("-").to_owned();
    let line = if events.is_json() {
        json!({ "name": guard.name(), "key": key, "token": guard.token().get() }).to_string()
    } else {
        // Tabs, not spaces: a name may contain spaces (and so may the key, built from
        // it), never a tab (no control characters).
        format!("{}\t{key}\t{}", guard.name(), guard.token())
    };
    if let Err(failure) = crate::exit::println_out(&line) {
        // Nobody learns the token: give the lock back rather than hold it unseen.
        let _ = tokio::time::timeout(CLEANUP_TIMEOUT, guard.release()).await;
        return Err(failure);
    }
    loop {
        /// What woke the holder.
        enum Woken {
            Lost,
            Suspended,
            Signalled,
        }
        let woken = tokio::select! {
            _ = guard.lost() => Woken::Lost,
            received = signals.next() => match received {
                crate::signals::Received::Suspend => Woken::Suspended,
                crate::signals::Received::Forward(_) => Woken::Signalled,
            },
        };
        match woken {
            Woken::Lost => {
                let reason = guard.lost_reason().unwrap_or("lost").to_owned();
                events.lost(&guard);
                let name = guard.name().to_owned();
                let _ = tokio::time::timeout(CLEANUP_TIMEOUT, guard.release()).await;
                return Err(Failure::new(
                    code::LOST,
                    format!("lock {name:?} was lost: {reason}"),
                ));
            }
            // Ctrl-Z stops fencelock as usual (its renewals stop too: a long stop loses
            // the lock, which is reported when it resumes).
            Woken::Suspended => crate::signals::stop_self(),
            Woken::Signalled => return release(guard, &events).await,
        }
    }
}

/// Releases after a signal.
async fn release(guard: fencelock::LockGuard, events: &Events) -> Result<u8, Failure> {
    let name = guard.name().to_owned();
    let token = guard.token();
    match tokio::time::timeout(CLEANUP_TIMEOUT, guard.release()).await {
        Ok(Ok(())) => {
            events.released(&name);
            Ok(code::OK)
        }
        Ok(Err(fencelock::Error::Lost { reason, .. })) => {
            events.lost_at_release(&name, token, &reason);
            Err(Failure::new(
                code::LOST,
                format!("lock {name:?} was lost before it was released: {reason}"),
            ))
        }
        Ok(Err(e)) => {
            events.warn(&format!(
                "releasing lock {name:?} failed ({}); it expires with its lease",
                one_line(&e)
            ));
            Ok(code::OK)
        }
        Err(_) => {
            events.warn(&format!(
                "releasing lock {name:?} took longer than {CLEANUP_TIMEOUT:?}; it expires with its lease"
            ));
            Ok(code::OK)
        }
    }
}
