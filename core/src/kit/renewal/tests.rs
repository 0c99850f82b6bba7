//! The scheduler against a backend that answers from a script, on a paused clock (the
//! backends' own tests run it against real servers).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::*;

/// How the scripted backend answers the renewals of one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Renew,
    Fail,
    Gone,
}

/// `AT_ONCE`: its [`Renew::TAKEN_AT_ONCE`].
struct Scripted<const AT_ONCE: usize = { usize::MAX }> {
    renewals: Renewals<Scripted<AT_ONCE>>,
    answers: Mutex<HashMap<u64, Answer>>,
    /// (lease id, instant) of every renewal asked for.
    asked: Mutex<Vec<(u64, Instant)>>,
    abandoned: Mutex<Vec<u64>>,
    closed: AtomicBool,
    calls: AtomicUsize,
}

impl<const AT_ONCE: usize> Scripted<AT_ONCE> {
    fn new() -> Arc<Self> {
        Arc::new(Scripted {
            renewals: Renewals::new(Handle::current()),
            answers: Mutex::default(),
            asked: Mutex::default(),
            abandoned: Mutex::default(),
            closed: AtomicBool::new(false),
            calls: AtomicUsize::new(0),
        })
    }

    /// Holds lease `id` of `lease`, sent now; returns its record and key.
    fn hold(self: &Arc<Self>, id: u64, lease: Duration, answer: Answer) -> (Liveness, u64) {
        self.answers.lock().unwrap().insert(id, answer);
        let now = Instant::now();
        let liveness = Liveness::new(now + lease);
        let key = Renewals::insert(self, id, lease, liveness.clone(), now);
        (liveness, key)
    }

    fn asked(&self, id: u64) -> Vec<Instant> {
        let asked = self.asked.lock().unwrap();
        asked
            .iter()
            .filter(|(i, _)| *i == id)
            .map(|(_, at)| *at)
            .collect()
    }
}

impl<const AT_ONCE: usize> Renew for Scripted<AT_ONCE> {
    type Lease = u64;
    type Due = u64;
    const ENDS_WHEN_IDLE: bool = true;
    const TAKEN_AT_ONCE: usize = AT_ONCE;

    fn renewals(&self) -> &Renewals<Self> {
        &self.renewals
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    fn due(&self, lease: &mut u64, _now: Instant) -> u64 {
        *lease
    }

    async fn renew(self: &Arc<Self>, due: Vec<Due<u64>>) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let now = Instant::now();
        for d in due {
            self.asked.lock().unwrap().push((d.data, now));
            let answer = self.answers.lock().unwrap()[&d.data];
            match answer {
                Answer::Renew => self.renewals.renewed(&d, now + d.lease),
                Answer::Fail => self.renewals.failed(&d),
                Answer::Gone => self.renewals.gone(&d, "gone at renewal"),
            }
        }
    }

    fn abandon(self: &Arc<Self>, _key: u64, lease: u64) {
        self.abandoned.lock().unwrap().push(lease);
    }
}

/// Renewed every third of the lease, from the send; leases due close together are
/// renewed in one call.
#[tokio::test(start_paused = true)]
async fn leases_are_renewed_every_third_in_batches() {
    let backend = <Scripted>::new();
    let lease = Duration::from_secs(3);
    let start = Instant::now();
    let (a, _) = backend.hold(1, lease, Answer::Renew);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (b, _) = backend.hold(2, lease, Answer::Renew);
    tokio::time::sleep(Duration::from_millis(10_050)).await;
    assert!(!a.is_lost() && !b.is_lost());
    let asked = backend.asked(1);
    assert!(asked.len() >= 9, "{} renewals in 10 s", asked.len());
    assert_eq!(asked[0] - start, Duration::from_secs(1));
    assert_eq!(backend.asked(2).len(), asked.len(), "renewed together");
    assert_eq!(backend.calls.load(Ordering::SeqCst), asked.len());
}

/// A backend that takes few leases at once gets a round in several calls, all at the
/// instant the round is due.
#[tokio::test(start_paused = true)]
async fn a_round_is_handed_over_at_most_so_many_at_once() {
    let backend = Scripted::<2>::new();
    let lease = Duration::from_secs(3);
    let start = Instant::now();
    let held: Vec<_> = (1..=5)
        .map(|id| backend.hold(id, lease, Answer::Renew))
        .collect();
    tokio::time::sleep(Duration::from_millis(1_050)).await;
    for id in 1..=5 {
        assert_eq!(
            backend.asked(id),
            [start + Duration::from_secs(1)],
            "lease {id}"
        );
    }
    assert_eq!(backend.calls.load(Ordering::SeqCst), 3, "2 + 2 + 1");
    assert!(held.iter().all(|(liveness, _)| !liveness.is_lost()));
}

/// A failed renewal is tried again after a tenth of the lease; a lease the server says
/// is gone marks its guard lost and is renewed no more.
#[tokio::test(start_paused = true)]
async fn failures_are_retried_soon_and_gone_leases_are_lost() {
    let backend = <Scripted>::new();
    let lease = Duration::from_secs(10);
    let (failing, failing_key) = backend.hold(1, lease, Answer::Fail);
    let (gone, gone_key) = backend.hold(2, lease, Answer::Gone);
    tokio::time::sleep(Duration::from_millis(6_000)).await;
    let asked = backend.asked(1);
    assert!(asked.len() >= 3, "{asked:?}");
    assert_eq!(asked[1] - asked[0], Duration::from_secs(1));
    assert!(!failing.is_lost());
    assert!(backend.renewals.contains(failing_key));
    assert_eq!(gone.lost_cause(), Some(LossCause::KeyGone));
    assert_eq!(backend.asked(2).len(), 1);
    assert!(!backend.renewals.contains(gone_key));
}

/// A lease whose guard was lost before its renewal is handed to `abandon`, never renewed;
/// a removed one is neither.
#[tokio::test(start_paused = true)]
async fn lost_leases_are_abandoned_and_removed_ones_forgotten() {
    let backend = <Scripted>::new();
    let lease = Duration::from_secs(3);
    let (lost, _) = backend.hold(1, lease, Answer::Renew);
    let (_, removed) = backend.hold(2, lease, Answer::Renew);
    lost.mark_lost(LossCause::LeaseExpired, "test");
    assert!(backend.renewals.remove(removed));
    assert!(!backend.renewals.remove(removed));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(backend.asked(1).is_empty() && backend.asked(2).is_empty());
    assert_eq!(*backend.abandoned.lock().unwrap(), [1]);
    assert!(backend.renewals.is_empty());
}

/// The task ends once nothing is held, and a later lease starts a new one; a closed
/// client's task ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_task_ends_when_idle_or_closed_and_starts_again() {
    let alive = || Handle::current().metrics().num_alive_tasks();
    let before = alive();
    let backend = <Scripted>::new();
    let (_, key) = backend.hold(1, Duration::from_millis(300), Answer::Renew);
    assert_eq!(alive(), before + 1);
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(!backend.asked(1).is_empty());
    backend.renewals.remove(key);
    let ended = Instant::now() + Duration::from_secs(5);
    while alive() > before && Instant::now() < ended {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(alive(), before, "the task ends when nothing is held");
    let (again, _) = backend.hold(2, Duration::from_millis(300), Answer::Renew);
    assert_eq!(alive(), before + 1, "a new lease starts a new task");
    backend.closed.store(true, Ordering::SeqCst);
    backend.renewals.wake();
    let ended = Instant::now() + Duration::from_secs(5);
    while alive() > before && Instant::now() < ended {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(alive(), before, "a closed client's task ends");
    drop(again);
}

/// A backend that times its own renewals: each round runs on its own and says when the
/// lease is due next.
struct SelfTimed {
    renewals: Renewals<SelfTimed>,
    /// The instant of every renewal begun.
    begun: Mutex<Vec<Instant>>,
    /// How long each round takes, and the pause it asks for before the next.
    takes: Duration,
    next: Duration,
}

impl SelfTimed {
    /// When each renewal was begun, from `start`.
    fn begun_since(&self, start: Instant) -> Vec<Duration> {
        let begun = self.begun.lock().unwrap();
        begun.iter().map(|at| *at - start).collect()
    }
}

impl Renew for SelfTimed {
    type Lease = ();
    type Due = ();
    const ENDS_WHEN_IDLE: bool = true;
    const TIMES_ITSELF: bool = true;

    fn renewals(&self) -> &Renewals<Self> {
        &self.renewals
    }

    fn is_closed(&self) -> bool {
        false
    }

    fn due(&self, (): &mut (), _now: Instant) {}

    fn renew(self: &Arc<Self>, due: Vec<Due<()>>) -> impl Future<Output = ()> + Send {
        for due in due {
            self.begun.lock().unwrap().push(Instant::now());
            let this = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(this.takes).await;
                this.renewals.renewed(&due, Instant::now() + due.lease);
                this.renewals.renew_at(due.key, Instant::now() + this.next);
            });
        }
        std::future::ready(())
    }
}

/// A lease of a backend that times itself is not handed over again while its round
/// runs, however long past its interval, and is due when the round said.
#[tokio::test(start_paused = true)]
async fn a_self_timed_lease_is_due_when_its_round_says() {
    let backend = Arc::new(SelfTimed {
        renewals: Renewals::new(Handle::current()),
        begun: Mutex::default(),
        // A round longer than the 3 s lease's interval.
        takes: Duration::from_millis(1_500),
        next: Duration::from_millis(500),
    });
    let start = Instant::now();
    let lease = Duration::from_secs(3);
    let key = Renewals::insert(&backend, (), lease, Liveness::new(start + lease), start);
    tokio::time::sleep(Duration::from_millis(5_100)).await;
    let begun = backend.begun_since(start);
    // Due a third of the lease after the send, then each 1.5 s round plus 0.5 s.
    let secs = |ms| Duration::from_millis(ms);
    assert_eq!(begun, [secs(1_000), secs(3_000), secs(5_000)]);
    assert!(backend.renewals.remove(key));
    backend.renewals.renew_at(key, Instant::now());
    assert!(
        !backend.renewals.contains(key),
        "a removed lease stays removed"
    );
}

/// A self-timed lease is begun when its round said, not earlier: the quarter interval
/// by which other leases are taken early (to batch them) does not apply, so a short
/// pause asked for after a failed round is kept.
#[tokio::test(start_paused = true)]
async fn a_self_timed_lease_is_not_begun_early() {
    let backend = Arc::new(SelfTimed {
        renewals: Renewals::new(Handle::current()),
        begun: Mutex::default(),
        takes: Duration::from_millis(1_500),
        // Shorter than a quarter of the 3 s lease's interval.
        next: Duration::from_millis(100),
    });
    let start = Instant::now();
    let lease = Duration::from_secs(3);
    Renewals::insert(&backend, (), lease, Liveness::new(start + lease), start);
    tokio::time::sleep(Duration::from_millis(4_300)).await;
    let begun = backend.begun_since(start);
    let secs = |ms| Duration::from_millis(ms);
    assert_eq!(begun, [secs(1_000), secs(2_600), secs(4_200)]);
}
