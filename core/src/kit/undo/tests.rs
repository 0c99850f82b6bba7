//! The undo's hand-off to the background against a record that counts what ran.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

/// What the scripted records did.
#[derive(Default)]
struct Counts {
    abandoned: AtomicUsize,
    inline: AtomicUsize,
}

/// A record whose inline undo answers `answer` after `delay`.
struct Scripted {
    runtime: Handle,
    counts: Arc<Counts>,
    left: bool,
    delay: Duration,
    answer: bool,
}

impl Scripted {
    fn new(counts: &Arc<Counts>) -> Self {
        Scripted {
            runtime: Handle::current(),
            counts: counts.clone(),
            left: true,
            delay: Duration::ZERO,
            answer: true,
        }
    }
}

impl Abandon for Scripted {
    fn runtime(&self) -> &Handle {
        &self.runtime
    }

    fn abandon(self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let counts = self.counts;
        self.left.then_some(async move {
            counts.abandoned.fetch_add(1, Ordering::SeqCst);
        })
    }

    async fn undo_now(&mut self) -> bool {
        self.counts.inline.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.delay).await;
        if self.answer {
            self.left = false;
        }
        self.answer
    }
}

/// Lets spawned tasks run.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn dropped_armed_it_abandons_in_the_background() {
    let counts = Arc::new(Counts::default());
    drop(Undo::new(Scripted::new(&counts)));
    settle().await;
    assert_eq!(counts.abandoned.load(Ordering::SeqCst), 1);
    assert_eq!(counts.inline.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn disarmed_it_leaves_the_work_alone() {
    let counts = Arc::new(Counts::default());
    let mut undo = Undo::new(Scripted::new(&counts));
    // Recorded through the undo.
    undo.delay = Duration::from_millis(1);
    let record = undo.disarm();
    assert_eq!(record.delay, Duration::from_millis(1));
    drop(record);
    settle().await;
    assert_eq!(counts.abandoned.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn nothing_left_is_not_spawned() {
    let counts = Arc::new(Counts::default());
    let mut record = Scripted::new(&counts);
    record.left = false;
    drop(Undo::new(record));
    settle().await;
    assert_eq!(counts.abandoned.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn finished_now_it_leaves_nothing_for_the_background() {
    let counts = Arc::new(Counts::default());
    let undo = Undo::new(Scripted::new(&counts));
    assert!(undo.finish_now(Duration::from_millis(200)).await);
    settle().await;
    assert_eq!(counts.inline.load(Ordering::SeqCst), 1);
    assert_eq!(counts.abandoned.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_failed_inline_undo_goes_to_the_background() {
    let counts = Arc::new(Counts::default());
    let mut record = Scripted::new(&counts);
    record.answer = false;
    assert!(
        !Undo::new(record)
            .finish_now(Duration::from_millis(200))
            .await
    );
    settle().await;
    assert_eq!(counts.inline.load(Ordering::SeqCst), 1);
    assert_eq!(counts.abandoned.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn finish_now_waits_no_longer_than_its_grace() {
    let counts = Arc::new(Counts::default());
    let mut record = Scripted::new(&counts);
    record.delay = Duration::from_secs(60);
    let started = tokio::time::Instant::now();
    assert!(
        !Undo::new(record)
            .finish_now(Duration::from_millis(200))
            .await
    );
    assert_eq!(started.elapsed(), Duration::from_millis(200));
    settle().await;
    assert_eq!(counts.abandoned.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_dropped_finish_now_goes_to_the_background() {
    let counts = Arc::new(Counts::default());
    let mut record = Scripted::new(&counts);
    record.delay = Duration::from_secs(60);
    let finishing = Undo::new(record).finish_now(Duration::from_secs(60));
    let _ = tokio::time::timeout(Duration::from_millis(10), finishing).await;
    settle().await;
    assert_eq!(counts.inline.load(Ordering::SeqCst), 1);
    assert_eq!(counts.abandoned.load(Ordering::SeqCst), 1);
}

/// The runtime the record names runs the background undo, not the dropping caller's.
#[test]
fn the_background_undo_runs_on_the_records_runtime() {
    let client = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let counts = Arc::new(Counts::default());
    let record = client.block_on(async { Scripted::new(&counts) });
    // Dropped outside any runtime.
    drop(Undo::new(record));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while counts.abandoned.load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(counts.abandoned.load(Ordering::SeqCst), 1);
}
