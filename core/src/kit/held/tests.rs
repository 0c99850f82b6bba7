//! The release state machine against a grant that answers from a script (the backends'
//! own tests run it against real servers).

use std::collections::VecDeque;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use super::*;

#[derive(Debug, Default)]
struct Scripted {
    answers: Mutex<VecDeque<Result<Deleted, Error>>>,
    deletes: AtomicUsize,
    background: AtomicUsize,
    /// Shared, to be read after the grant is dropped.
    stops: Arc<AtomicUsize>,
    extension: Option<Extension>,
}

impl Scripted {
    fn answering(answers: impl IntoIterator<Item = Result<Deleted, Error>>) -> Self {
        Scripted {
            answers: Mutex::new(answers.into_iter().collect()),
            ..Scripted::default()
        }
    }
}

impl Grant for Scripted {
    fn backend(&self) -> &'static str {
        "test"
    }

    fn name(&self) -> &str {
        "scripted"
    }

    fn extension(&self) -> Extension {
        self.extension.unwrap_or(Extension::Renewing)
    }

    fn stop(&self) {
        self.stops.fetch_add(1, Ordering::SeqCst);
    }

    async fn delete(&self) -> Result<Deleted, Error> {
        self.deletes.fetch_add(1, Ordering::SeqCst);
        self.answers
            .lock()
            .unwrap()
            .pop_front()
            .expect("no delete expected")
    }

    fn delete_in_background(&self) {
        self.background.fetch_add(1, Ordering::SeqCst);
    }

    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        Ok(Instant::now() + lease)
    }
}

fn held(grant: Scripted) -> Held<Scripted> {
    Held::new(
        grant,
        Liveness::new(Instant::now() + Duration::from_secs(60)),
    )
}

fn unreachable() -> Error {
    Error::unavailable("test", "connection refused")
}

#[tokio::test]
async fn a_confirmed_release_answers_ok_again_without_asking() {
    let held = held(Scripted::answering([Ok(Deleted::Now)]));
    held.release().await.unwrap();
    held.release().await.unwrap();
    assert_eq!(held.grant().deletes.load(Ordering::SeqCst), 1);
    assert!(held.grant().stops.load(Ordering::SeqCst) >= 1);
    assert!(!held.liveness.is_lost());
}

/// A grant is stopped once: when its first release starts (not again by a later release,
/// nor at the drop), or at the drop of a grant never released. A second stop costs a
/// backend a lock and a lookup in its registries per lock (seen in the client's CPU per
/// lock on Redis).
#[tokio::test]
async fn a_grant_is_stopped_once_when_its_release_starts_or_at_its_drop() {
    let released = held(Scripted::answering([Ok(Deleted::Now)]));
    let stops = released.grant().stops.clone();
    released.release().await.unwrap();
    released.release().await.unwrap();
    drop(released);
    assert_eq!(stops.load(Ordering::SeqCst), 1, "released");

    let unanswered = held(Scripted::answering([Err(unreachable()), Ok(Deleted::Now)]));
    let stops = unanswered.grant().stops.clone();
    unanswered.release().await.unwrap_err();
    unanswered.release().await.unwrap();
    unanswered.release_in_background();
    drop(unanswered);
    assert_eq!(stops.load(Ordering::SeqCst), 1, "release retried");

    let dropped = held(Scripted::default());
    let stops = dropped.grant().stops.clone();
    dropped.release_in_background();
    drop(dropped);
    assert_eq!(
        stops.load(Ordering::SeqCst),
        1,
        "released in the background"
    );

    let never = held(Scripted::default());
    let stops = never.grant().stops.clone();
    drop(never);
    assert_eq!(stops.load(Ordering::SeqCst), 1, "never released");
}

#[tokio::test]
async fn a_grant_gone_at_the_first_release_is_a_loss_told_every_time() {
    let held = held(Scripted::answering([Ok(Deleted::AlreadyGone)]));
    for _ in 0..2 {
        let outcome = held.release().await;
        assert!(matches!(outcome, Err(Error::Lost { .. })), "{outcome:?}");
    }
    assert_eq!(held.grant().deletes.load(Ordering::SeqCst), 1);
    assert_eq!(held.liveness.lost_cause(), Some(LossCause::KeyGone));
}

/// A release whose delete got no answer leaves the grant `Sent`: the retry asks again,
/// and a grant it finds gone may be the first delete's doing: not confirmed, not a loss.
#[tokio::test]
async fn a_retried_release_that_finds_the_grant_gone_is_unconfirmed() {
    let held = held(Scripted::answering([
        Err(unreachable()),
        Ok(Deleted::AlreadyGone),
    ]));
    let first = held.release().await;
    assert!(matches!(first, Err(Error::Unavailable { .. })), "{first:?}");
    for _ in 0..2 {
        let again = held.release().await;
        assert!(
            matches!(&again, Err(Error::Unavailable { source, .. })
            if source.to_string().contains("could not be confirmed")),
            "{again:?}"
        );
    }
    assert_eq!(held.grant().deletes.load(Ordering::SeqCst), 2);
    assert!(!held.liveness.is_lost());
}

/// After a drop's background delete, a release that finds the grant gone is not told
/// "lost"; one that finds it deleted by itself is fine.
#[tokio::test]
async fn a_release_after_the_background_delete_is_unconfirmed_or_ok() {
    let gone = held(Scripted::answering([Ok(Deleted::AlreadyGone)]));
    gone.release_in_background();
    assert_eq!(gone.grant().background.load(Ordering::SeqCst), 1);
    let outcome = gone.release().await;
    assert!(
        matches!(outcome, Err(Error::Unavailable { .. })),
        "{outcome:?}"
    );

    let mine = held(Scripted::answering([Ok(Deleted::Now)]));
    mine.release_in_background();
    mine.release().await.unwrap();
    // Released: a drop after it sends nothing more.
    mine.release_in_background();
    assert_eq!(mine.grant().background.load(Ordering::SeqCst), 1);
}

/// A guard that had lost the lock before its release is told so, whatever the delete
/// found: its work may have overlapped another holder's.
#[tokio::test]
async fn a_release_after_a_loss_is_a_loss() {
    for found in [Deleted::Now, Deleted::Unconfirmed, Deleted::AlreadyGone] {
        let held = held(Scripted::answering([Ok(found)]));
        held.liveness
            .mark_lost(LossCause::SessionEnded, "the session ended");
        let outcome = held.release().await;
        assert!(
            matches!(&outcome, Err(Error::Lost { reason, .. }) if reason == "the session ended"),
            "{found:?}: {outcome:?}"
        );
    }
}

#[tokio::test]
async fn extensions_are_checked_before_anything_is_sent() {
    let renewing = held(Scripted::default());
    let refused = renewing.extend(Duration::from_secs(10)).await;
    assert!(
        matches!(refused, Err(Error::InvalidConfig(_))),
        "{refused:?}"
    );

    let unsupported = held(Scripted {
        extension: Some(Extension::Unsupported),
        ..Scripted::default()
    });
    assert!(matches!(
        unsupported.can_extend(),
        Err(Error::Unsupported {
            backend: "test",
            ..
        })
    ));

    let fixed = held(Scripted {
        extension: Some(Extension::Fixed {
            min_lease: Duration::from_secs(2),
        }),
        answers: Mutex::new([Ok(Deleted::Now)].into_iter().collect()),
        ..Scripted::default()
    });
    assert!(matches!(
        fixed.check_extension(Duration::from_secs(1)),
        Err(Error::InvalidConfig(_))
    ));
    fixed.extend(Duration::from_secs(5)).await.unwrap();
    fixed.release().await.unwrap();
    let late = fixed.extend(Duration::from_secs(5)).await;
    assert!(matches!(late, Err(Error::Lost { .. })), "{late:?}");
}
