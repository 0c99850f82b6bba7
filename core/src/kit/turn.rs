//! The one claim/wait loop: whether a claim's turn has come, and what happens while it
//! has not.
//!
//! Every backend's acquire is the same loop around its own protocol, as Curator's
//! `LockInternals` runs one algorithm around a small per-recipe driver: look whether
//! the claim holds the lock ([`Claim::turn`]: etcd, whether a key was created before
//! ours; ZooKeeper, a node before ours; Redis, the try itself); if not, refuse at once
//! a request that does not wait, give up when the wait is over, and otherwise wait for
//! what can change the answer ([`Claim::wait`]: the predecessor's deletion, an unlock
//! message or the holder's expiry) and look again. [`until_turn`] is that loop, so the
//! rules of refusing, timing out and giving up are written once; a backend writes only
//! how to look, how to wait and what giving up undoes ([`Claim::give_up`]).

use std::future::Future;

use crate::{Error, WaitDeadline};

/// Whether a claim's turn has come.
#[derive(Debug)]
pub enum Turn<G, B> {
    /// It has: the lock is the claim's, proven by what `G` holds.
    Granted(G),
    /// Not yet: `B` is what the claim waits behind (the predecessor, the holder).
    Behind(B),
}

/// Why [`until_turn`] ends a claim without its grant, handed to [`Claim::give_up`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveUp {
    /// The lock is held and the request does not wait ([`Error::Contended`]).
    Refused,
    /// The wait ended first ([`Error::Timeout`]).
    TimedOut,
    /// Waiting failed (the session was lost, the server refused the wait): the
    /// [`Claim::wait`]'s error.
    Failed,
}

/// A backend's claim on a lock, between the request that made it and its grant. See
/// the [module](self) docs.
///
/// Dropped anywhere (an error of [`turn`](Self::turn), the acquire cancelled), the
/// claim undoes itself ([`Undo`](super::Undo)).
pub trait Claim: Send {
    /// What a granted claim hands to the guard (a key's revision, a node's path).
    type Grant: Send;
    /// What a claim not yet granted waits behind.
    type Blocker: Send;

    /// Looks whether the claim's turn has come (for a backend that claims by trying,
    /// tries again).
    ///
    /// # Cancel safety
    ///
    /// Dropped, it leaves the claim to undo whatever the look may have made.
    ///
    /// # Errors
    ///
    /// The backend's: the acquire fails with it, and the dropped claim undoes itself.
    fn turn(
        &mut self,
    ) -> impl Future<Output = Result<Turn<Self::Grant, Self::Blocker>, Error>> + Send;

    /// Waits until `blocker` may have moved on; [`turn`](Self::turn) then looks again.
    ///
    /// # Cancel safety
    ///
    /// Must be: it is dropped when the caller's wait ends first, and the claim is then
    /// given up.
    ///
    /// # Errors
    ///
    /// The backend's (the session was lost while waiting, the server refused a watch):
    /// handed to [`give_up`](Self::give_up) with [`GiveUp::Failed`].
    fn wait(&mut self, blocker: Self::Blocker) -> impl Future<Output = Result<(), Error>> + Send;

    /// Ends the claim without a grant, for `why`: undoes what it left on the server (at
    /// once, or in the background, as the backend's clean-up bounds allow) and returns
    /// the error the acquire reports, `error` unless the backend knows better.
    ///
    /// # Cancel safety
    ///
    /// Dropped, the claim's undo goes on in the background.
    ///
    /// # Errors
    ///
    /// None: it returns the error to report.
    fn give_up(self, why: GiveUp, error: Error) -> impl Future<Output = Error> + Send;
}

/// Runs `claim` until its turn comes, for lock `name`: refused at once if `no_wait`,
/// given up at the end of `wait`, otherwise waiting and looking again. Granted, the
/// claim comes back with its grant, for the backend to make its guard of.
///
/// # Cancel safety
///
/// Cancel safe: dropped, the claim undoes itself.
///
/// # Errors
///
/// [`Error::Contended`] when the lock is held and `no_wait`; [`Error::Timeout`] when
/// `wait` ends first; the claim's own errors (see [`Claim`]); each as
/// [`Claim::give_up`] returns it.
pub async fn until_turn<C: Claim>(
    mut claim: C,
    name: &str,
    wait: &WaitDeadline,
    no_wait: bool,
) -> Result<(C, C::Grant), Error> {
    loop {
        let blocker = match claim.turn().await? {
            Turn::Granted(grant) => return Ok((claim, grant)),
            Turn::Behind(blocker) => blocker,
        };
        let (why, error) = if no_wait {
            let refused = Error::Contended {
                name: name.to_owned(),
            };
            (GiveUp::Refused, refused)
        } else if wait.is_over() {
            (GiveUp::TimedOut, wait.timed_out(name))
        } else {
            // The wait first: one that ends at the deadline's instant is not lost.
            let waited = tokio::select! {
                biased;
                waited = claim.wait(blocker) => Some(waited),
                () = wait.over() => None,
            };
            match waited {
                Some(Ok(())) => continue,
                Some(Err(error)) => (GiveUp::Failed, error),
                None => (GiveUp::TimedOut, wait.timed_out(name)),
            }
        };
        return Err(claim.give_up(why, error).await);
    }
}

#[cfg(test)]
mod tests;
