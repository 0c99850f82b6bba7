//! Unit tests of the liveness record.

use super::*;

/// A lock whose shared deadline passed must read as lost however its loss is being
/// marked meanwhile: a reader between the freeze of the deadline and the LOST bit
/// used to return the unfrozen cap, a century away, so `is_lost()` said no.
#[test]
fn a_passed_shared_deadline_reads_as_lost_while_another_thread_marks_it() {
    let past = Instant::now();
    let shared = SharedDeadline::new(past);
    for _ in 0..20_000 {
        let live = Liveness::with_shared_deadline(shared.clone());
        let marker = live.clone();
        let start = std::sync::Arc::new(std::sync::Barrier::new(2));
        let go = start.clone();
        let t = std::thread::spawn(move || {
            go.wait();
            marker.mark_lost(LossCause::SessionEnded, "test");
        });
        start.wait();
        let until = live.valid_until();
        let lost = live.is_lost();
        t.join().unwrap();
        assert!(
            until <= past,
            "valid_until {until:?} after the deadline {past:?}"
        );
        assert!(lost);
    }
}

/// A first `lost_token()` made outside any runtime starts no watcher; a later one
/// made inside a runtime must, or the token would never fire at the deadline.
#[test]
fn the_lost_token_fires_at_the_deadline_after_a_first_call_outside_a_runtime() {
    let live = Liveness::new(Instant::now() + Duration::from_millis(50));
    let outside = live.lost_token();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
        let inside = live.lost_token();
        tokio::time::timeout(Duration::from_secs(2), inside.cancelled())
            .await
            .expect("the token fires at the deadline");
    });
    assert!(outside.is_cancelled());
}

/// A watcher started on a runtime that then ends is dropped with it, unfired: the
/// next `lost_token()`, made inside another runtime, must start one again, or a
/// fixed lease that nothing else watches would never report its deadline.
#[test]
fn the_lost_token_fires_at_the_deadline_after_the_first_watchers_runtime_ended() {
    let live = Liveness::new(Instant::now() + Duration::from_millis(50));
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let early = first.block_on(async { live.lost_token() });
    drop(first);
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    second.block_on(async {
        tokio::time::timeout(Duration::from_secs(2), live.lost_token().cancelled())
            .await
            .expect("the token fires at the deadline");
    });
    assert!(early.is_cancelled());
}

/// A deadline that passed, or a lock marked lost, is never moved by a renewal that
/// answers late.
#[test]
fn extend_never_moves_a_lost_or_passed_deadline() {
    let now = Instant::now();
    let passed = Liveness::new(now);
    assert!(!passed.extend(now + std::time::Duration::from_secs(60)));
    assert!(passed.is_lost());
    assert_eq!(passed.valid_until(), now);
    for _ in 0..20_000 {
        let live = Liveness::new(Instant::now() + std::time::Duration::from_secs(60));
        let marker = live.clone();
        let start = std::sync::Arc::new(std::sync::Barrier::new(2));
        let go = start.clone();
        let t = std::thread::spawn(move || {
            go.wait();
            marker.mark_lost(LossCause::KeyGone, "test");
        });
        start.wait();
        let before = live.valid_until();
        let moved = live.extend(before + std::time::Duration::from_secs(60));
        t.join().unwrap();
        if moved {
            // The extension came first; the loss after it froze nothing further.
            assert!(live.is_lost());
        } else {
            assert_eq!(live.valid_until(), before);
        }
    }
}

use std::time::Duration;

/// Waiting for the loss or the end wakes on a mark made by another task, and a token
/// taken after the loss is cancelled already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_and_tokens_see_marks_made_elsewhere() {
    for _ in 0..200 {
        let live = Liveness::new(Instant::now() + std::time::Duration::from_secs(60));
        let before = live.lost_token();
        let (lost, marked, ended) = (live.clone(), live.clone(), live.clone());
        let waiters = tokio::spawn(async move {
            tokio::join!(lost.lost(), marked.marked_lost(), ended.ended());
        });
        let other = live.clone();
        tokio::spawn(async move {
            tokio::task::yield_now().await;
            other.mark_lost(LossCause::KeyGone, "deleted");
            other.end();
        });
        tokio::time::timeout(std::time::Duration::from_secs(5), waiters)
            .await
            .expect("every waiter woke")
            .unwrap();
        assert!(before.is_cancelled());
        assert!(
            live.lost_token().is_cancelled(),
            "a token taken after the loss"
        );
        assert!(live.is_ended());
    }
}

#[tokio::test(start_paused = true)]
async fn deadline_alone_declares_loss() {
    let live = Liveness::new(Instant::now() + Duration::from_secs(10));
    let token = live.lost_token();
    assert!(!live.is_lost());
    let start = Instant::now();
    live.lost().await;
    assert_eq!(start.elapsed(), Duration::from_secs(10));
    tokio::task::yield_now().await;
    assert!(token.is_cancelled());
    assert!(live.lost_reason().unwrap().contains("deadline"));
    assert_eq!(live.lost_cause(), Some(LossCause::LeaseExpired));
}

/// Records the fields of every event.
#[derive(Default)]
struct Capture(Mutex<Vec<(tracing::Level, String)>>);

impl tracing::Subscriber for Capture {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Fields(String);
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!("{}={value:?} ", field.name()));
            }
        }
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        self.0
            .lock()
            .unwrap()
            .push((*event.metadata().level(), fields.0));
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn a_loss_is_logged_once_with_lock_token_backend_and_cause() {
    let capture = std::sync::Arc::new(Capture::default());
    let live = Liveness::new(Instant::now() + Duration::from_secs(10));
    live.set_identity("orders/42", 7, "etcd");
    tracing::subscriber::with_default(capture.clone(), || {
        live.mark_lost(LossCause::SessionEnded, "the session expired");
        live.mark_lost(LossCause::KeyGone, "again");
    });
    let events = capture.0.lock().unwrap().clone();
    assert_eq!(events.len(), 1, "{events:?}");
    let (level, fields) = &events[0];
    assert_eq!(*level, tracing::Level::WARN);
    for part in [
        "lock=orders/42",
        "token=7",
        "backend=\"etcd\"",
        "cause=session_ended",
    ] {
        assert!(fields.contains(part), "{part} in {fields}");
    }
    // A guard that already ended is not reported lost.
    let ended = Liveness::new(Instant::now() + Duration::from_secs(10));
    ended.end();
    let quiet = std::sync::Arc::new(Capture::default());
    tracing::subscriber::with_default(quiet.clone(), || {
        ended.mark_lost(LossCause::SessionEnded, "after release");
    });
    assert!(quiet.0.lock().unwrap().is_empty());
}

#[tokio::test(start_paused = true)]
async fn extension_postpones_loss_but_not_after_it() {
    let live = Liveness::new(Instant::now() + Duration::from_secs(10));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(live.extend(Instant::now() + Duration::from_secs(10)));
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert!(!live.is_lost());
    live.mark_lost(LossCause::KeyGone, "key deleted");
    live.mark_lost(LossCause::Other, "later");
    assert!(!live.extend(Instant::now() + Duration::from_secs(100)));
    assert!(live.is_lost());
    assert_eq!(live.lost_reason(), Some("key deleted"));
    assert_eq!(live.lost_cause(), Some(LossCause::KeyGone));
}

#[tokio::test(start_paused = true)]
async fn a_shared_deadline_moves_every_lock_until_one_is_lost() {
    let shared = SharedDeadline::new(Instant::now() + Duration::from_secs(10));
    let a = Liveness::with_shared_deadline(shared.clone());
    let b = Liveness::with_shared_deadline(shared.clone());
    assert_eq!(a.valid_until(), shared.get());
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(shared.extend(Instant::now() + Duration::from_secs(10)));
    assert!(!shared.extend(Instant::now()), "never backwards");
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert!(!a.is_lost() && !b.is_lost());
    a.mark_lost(LossCause::KeyGone, "deleted");
    let frozen = a.valid_until();
    assert!(shared.extend(Instant::now() + Duration::from_secs(60)));
    assert_eq!(a.valid_until(), frozen, "a lost lock's deadline is frozen");
    assert_eq!(b.valid_until(), shared.get());
    // The deadline alone declares loss, on the shared deadline's time.
    let start = Instant::now();
    b.lost().await;
    assert_eq!(start.elapsed(), Duration::from_secs(60));
    assert_eq!(b.lost_cause(), Some(LossCause::LeaseExpired));
    // A lost lock no longer follows the shared deadline.
    shared.extend(Instant::now() + Duration::from_secs(60));
    assert!(b.is_lost());
}
