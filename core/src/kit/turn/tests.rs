//! The loop against a scripted claim, on a paused clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use crate::Wait;

/// What the scripted claim did, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Did {
    Looked,
    Waited(u32),
    GaveUp(GiveUp),
}

/// Looks behind blocker 1, 2, ... until `behind` looks have been made, then is granted
/// (`None`: never); each wait takes `wait_takes` (`None`: forever) or fails.
#[derive(Debug)]
struct Scripted {
    behind: Option<u32>,
    wait_takes: Option<Duration>,
    wait_fails: bool,
    turn_fails: bool,
    looks: u32,
    did: Arc<Mutex<Vec<Did>>>,
}

impl Scripted {
    fn new(behind: Option<u32>) -> (Self, Arc<Mutex<Vec<Did>>>) {
        let did = Arc::new(Mutex::new(Vec::new()));
        let claim = Scripted {
            behind,
            wait_takes: Some(Duration::from_millis(10)),
            wait_fails: false,
            turn_fails: false,
            looks: 0,
            did: did.clone(),
        };
        (claim, did)
    }
}

impl Claim for Scripted {
    type Grant = u32;
    type Blocker = u32;

    async fn turn(&mut self) -> Result<Turn<u32, u32>, Error> {
        self.did.lock().unwrap().push(Did::Looked);
        if self.turn_fails {
            return Err(Error::unavailable("test", "the look failed"));
        }
        self.looks += 1;
        match self.behind {
            Some(behind) if self.looks > behind => Ok(Turn::Granted(self.looks)),
            _ => Ok(Turn::Behind(self.looks)),
        }
    }

    async fn wait(&mut self, blocker: u32) -> Result<(), Error> {
        self.did.lock().unwrap().push(Did::Waited(blocker));
        if self.wait_fails {
            return Err(Error::lost("n", "the session ended while waiting"));
        }
        match self.wait_takes {
            Some(takes) => tokio::time::sleep(takes).await,
            None => std::future::pending().await,
        }
        Ok(())
    }

    async fn give_up(self, why: GiveUp, error: Error) -> Error {
        self.did.lock().unwrap().push(Did::GaveUp(why));
        error
    }
}

fn forever() -> WaitDeadline {
    WaitDeadline::new(Wait::Forever)
}

/// A claim whose turn has come is granted at the first look, without waiting.
#[tokio::test(start_paused = true)]
async fn a_free_lock_is_granted_at_the_first_look() {
    let (claim, did) = Scripted::new(Some(0));
    assert_eq!(until_turn(claim, "n", &forever(), true).await.unwrap().1, 1);
    assert_eq!(*did.lock().unwrap(), [Did::Looked]);
}

/// A claim behind someone waits behind each blocker in turn, then is granted.
#[tokio::test(start_paused = true)]
async fn a_waiter_waits_behind_each_blocker_then_is_granted() {
    let (claim, did) = Scripted::new(Some(2));
    assert_eq!(
        until_turn(claim, "n", &forever(), false).await.unwrap().1,
        3
    );
    let expected = [
        Did::Looked,
        Did::Waited(1),
        Did::Looked,
        Did::Waited(2),
        Did::Looked,
    ];
    assert_eq!(*did.lock().unwrap(), expected);
}

/// A request that does not wait is refused at once and its claim given up.
#[tokio::test(start_paused = true)]
async fn a_try_that_does_not_wait_is_refused_and_given_up() {
    let (claim, did) = Scripted::new(None);
    let refused = until_turn(claim, "n", &forever(), true).await.unwrap_err();
    assert!(
        matches!(refused, Error::Contended { ref name } if name == "n"),
        "{refused:?}"
    );
    assert_eq!(
        *did.lock().unwrap(),
        [Did::Looked, Did::GaveUp(GiveUp::Refused)]
    );
}

/// A wait that outlasts the caller's is cut at its end, and the claim given up with
/// the caller's timeout; a wait already over when the claim is behind does not wait.
#[tokio::test(start_paused = true)]
async fn a_wait_that_outlasts_the_deadline_times_out_and_gives_up() {
    let (mut claim, did) = Scripted::new(None);
    claim.wait_takes = None;
    let start = tokio::time::Instant::now();
    let wait = WaitDeadline::new(Wait::Timeout(Duration::from_millis(300)));
    let timed_out = until_turn(claim, "n", &wait, false).await.unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_millis(300));
    assert!(
        matches!(timed_out, Error::Timeout { waited, .. } if waited == Duration::from_millis(300)),
        "{timed_out:?}"
    );
    let expected = [Did::Looked, Did::Waited(1), Did::GaveUp(GiveUp::TimedOut)];
    assert_eq!(*did.lock().unwrap(), expected);

    let (claim, did) = Scripted::new(None);
    let over = WaitDeadline::new(Wait::Timeout(Duration::ZERO));
    let timed_out = until_turn(claim, "n", &over, false).await.unwrap_err();
    assert!(matches!(timed_out, Error::Timeout { .. }), "{timed_out:?}");
    assert_eq!(
        *did.lock().unwrap(),
        [Did::Looked, Did::GaveUp(GiveUp::TimedOut)]
    );
}

/// A wait that fails gives the claim up with the wait's error; a look that fails ends
/// the acquire with its error, leaving the dropped claim to undo itself.
#[tokio::test(start_paused = true)]
async fn failures_of_a_wait_give_up_and_of_a_look_end_the_acquire() {
    let (mut claim, did) = Scripted::new(None);
    claim.wait_fails = true;
    let failed = until_turn(claim, "n", &forever(), false).await.unwrap_err();
    assert!(matches!(failed, Error::Lost { .. }), "{failed:?}");
    let expected = [Did::Looked, Did::Waited(1), Did::GaveUp(GiveUp::Failed)];
    assert_eq!(*did.lock().unwrap(), expected);

    let (mut claim, did) = Scripted::new(Some(0));
    claim.turn_fails = true;
    let failed = until_turn(claim, "n", &forever(), false).await.unwrap_err();
    assert!(matches!(failed, Error::Unavailable { .. }), "{failed:?}");
    assert_eq!(*did.lock().unwrap(), [Did::Looked]);
}
