use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

use super::*;
use crate::{DistributedLockExt, MemoryLock};

/// Everything recorded so far, per (metric, labels as `k=v` pairs). The debugging
/// recorder's snapshots drain it, so they are added up here; tests use distinct lock
/// names and may run in parallel.
#[derive(Default)]
struct Totals {
    values: HashMap<(String, Vec<String>), (f64, Vec<f64>)>,
}

fn snapshotter() -> &'static (Snapshotter, Mutex<Totals>) {
    static RECORDER: OnceLock<(Snapshotter, Mutex<Totals>)> = OnceLock::new();
    RECORDER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("no other recorder in this test binary");
        (snapshotter, Mutex::new(Totals::default()))
    })
}

/// The counter / gauge value (or histogram sample count) of `metric` with `labels`,
/// and the histogram samples.
fn read(metric: &str, labels: &[&str]) -> (f64, Vec<f64>) {
    let (snapshotter, totals) = snapshotter();
    let mut totals = totals.lock().unwrap();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let mut key_labels: Vec<String> = key
            .key()
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        key_labels.sort();
        let entry = totals
            .values
            .entry((key.key().name().to_owned(), key_labels))
            .or_default();
        match value {
            DebugValue::Counter(n) => entry.0 += n as f64,
            DebugValue::Gauge(g) => entry.0 += g.into_inner(),
            DebugValue::Histogram(samples) => {
                entry.0 += samples.len() as f64;
                entry.1.extend(samples.into_iter().map(|s| s.into_inner()));
            }
        }
    }
    let mut labels: Vec<String> = labels.iter().map(|l| l.to_string()).collect();
    labels.sort();
    totals
        .values
        .get(&(metric.to_owned(), labels))
        .cloned()
        .unwrap_or_default()
}

fn count(metric: &str, labels: &[&str]) -> f64 {
    read(metric, labels).0
}

fn metered(options: MetricsOptions) -> (Arc<MemoryLock>, Metrics) {
    let _ = snapshotter();
    let memory = Arc::new(MemoryLock::new());
    (memory.clone(), Metrics::new(memory, options))
}

#[tokio::test(start_paused = true)]
async fn acquisitions_wait_hold_and_the_held_gauge_move() {
    let (memory, locks) = metered(MetricsOptions::new().with_name_label());
    let labels = ["backend=mem", "name=m-basic"];
    let acquired = ["backend=mem", "name=m-basic", "result=acquired"];
    let first = locks.lock("m-basic").await.unwrap();
    assert_eq!(count(LOCKS_HELD, &labels), 1.0);
    let second = {
        let locks = locks.clone();
        tokio::spawn(async move { locks.lock("m-basic").await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(250)).await;
    first.release().await.unwrap();
    let second = second.await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(second);
    assert_eq!(count(LOCK_ACQUIRES_TOTAL, &acquired), 2.0);
    assert_eq!(count(LOCKS_HELD, &labels), 0.0);
    let (waits, wait_samples) = read(LOCK_WAIT_SECONDS, &acquired);
    assert_eq!(waits, 2.0);
    assert!(
        wait_samples.iter().any(|w| (*w - 0.25).abs() < 0.01),
        "{wait_samples:?}"
    );
    let (holds, hold_samples) = read(LOCK_HOLD_SECONDS, &labels);
    assert_eq!(holds, 2.0);
    assert!(
        hold_samples.iter().any(|h| (*h - 0.1).abs() < 0.01),
        "{hold_samples:?}"
    );
    assert!(!memory.inspect("m-basic").await.unwrap().is_held());
}

#[tokio::test(start_paused = true)]
async fn timeouts_contention_and_errors_are_counted() {
    let (_memory, locks) = metered(MetricsOptions::new().with_name_label());
    let with = |result: &'static str| ["backend=mem", "name=m-fail", result];
    let held = locks.lock("m-fail").await.unwrap();
    let wait = AcquireOptions::new().wait_timeout(Duration::from_millis(50));
    assert!(locks.acquire("m-fail", wait).await.is_err());
    assert!(locks.try_lock("m-fail").await.unwrap().is_none());
    let zero = AcquireOptions::new().lease(Duration::ZERO);
    assert!(locks.acquire("m-fail", zero).await.is_err());
    assert_eq!(count(LOCK_ACQUIRES_TOTAL, &with("result=timeout")), 1.0);
    assert_eq!(count(LOCK_ACQUIRES_TOTAL, &with("result=contended")), 1.0);
    assert_eq!(count(LOCK_ACQUIRES_TOTAL, &with("result=error")), 1.0);
    assert_eq!(count(LOCK_ACQUIRES_TOTAL, &with("result=acquired")), 1.0);
    // The wait histogram has the timeout too, with its 50 ms.
    let (_, timeouts) = read(LOCK_WAIT_SECONDS, &with("result=timeout"));
    assert!(
        timeouts.iter().any(|w| (*w - 0.05).abs() < 0.01),
        "{timeouts:?}"
    );
    held.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_loss_is_counted_once_when_it_happens() {
    let (_memory, locks) = metered(MetricsOptions::new().with_name_label());
    let labels = ["backend=mem", "name=m-lost"];
    let opts = AcquireOptions::new().fixed_lease(Duration::from_secs(1));
    let guard = locks.acquire("m-lost", opts).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    tokio::task::yield_now().await;
    let lost = [labels[0], labels[1], "cause=lease_expired"];
    assert_eq!(count(LOCK_LOST_TOTAL, &lost), 1.0, "counted before release");
    assert_eq!(count(LOCKS_HELD, &labels), 0.0);
    assert!(matches!(guard.release().await, Err(Error::Lost { .. })));
    assert_eq!(count(LOCK_LOST_TOTAL, &lost), 1.0);
    assert_eq!(count(LOCKS_HELD, &labels), 0.0);
    assert_eq!(count(LOCK_HOLD_SECONDS, &labels), 1.0);
}

/// A loss is counted when it happens also for a guard acquired on a runtime that
/// has ended since (a `block_on` on a helper thread), while the guard lives on.
#[test]
fn a_loss_is_counted_for_a_guard_acquired_on_a_runtime_that_ended() {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (_memory, locks) =
        main.block_on(async { metered(MetricsOptions::new().with_name_label()) });
    let labels = ["backend=mem", "name=m-short-runtime"];
    let guard = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let short = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let opts = AcquireOptions::new().fixed_lease(Duration::from_millis(200));
                short.block_on(locks.acquire("m-short-runtime", opts))
            })
            .join()
            .unwrap()
    })
    .unwrap();
    main.block_on(async {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let lost = [labels[0], labels[1], "cause=lease_expired"];
        assert_eq!(
            count(LOCK_LOST_TOTAL, &lost),
            1.0,
            "not counted while the guard lives"
        );
        drop(guard);
    });
}

/// A metrics layer made on a runtime that has ended since still counts a loss when
/// it happens: the watch falls back to the acquire's runtime.
#[test]
fn a_loss_is_counted_by_a_layer_made_on_a_runtime_that_ended() {
    let (_memory, locks) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async { metered(MetricsOptions::new().with_name_label()) });
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    main.block_on(async {
        let opts = AcquireOptions::new().fixed_lease(Duration::from_millis(200));
        let guard = locks.acquire("m-made-elsewhere", opts).await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
        let lost = [
            "backend=mem",
            "name=m-made-elsewhere",
            "cause=lease_expired",
        ];
        assert_eq!(
            count(LOCK_LOST_TOTAL, &lost),
            1.0,
            "not counted while the guard lives"
        );
        drop(guard);
    });
}

/// A loss is counted when it happens also when the runtime the layer was made on
/// ends while the guard is held: the watch, dropped with that runtime, must go on
/// on another (the acquire's), or the loss is not counted and the gauge not moved.
#[test]
fn a_loss_is_counted_after_the_layers_runtime_ended_while_the_guard_was_held() {
    let made_on = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_memory, locks) =
        made_on.block_on(async { metered(MetricsOptions::new().with_name_label()) });
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let labels = ["backend=mem", "name=m-layer-runtime-ended"];
    let opts = AcquireOptions::new().fixed_lease(Duration::from_millis(200));
    let guard = main
        .block_on(locks.acquire("m-layer-runtime-ended", opts))
        .unwrap();
    drop(made_on);
    main.block_on(async {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let lost = [labels[0], labels[1], "cause=lease_expired"];
        assert_eq!(
            count(LOCK_LOST_TOTAL, &lost),
            1.0,
            "not counted while the guard lives"
        );
        assert_eq!(count(LOCKS_HELD, &labels), 0.0);
        drop(guard);
    });
}

/// A loss is counted when the guard is dropped as soon as it learns of it (what
/// `with_lock` does), before the layer's own watch ran: a revoked lock here.
#[tokio::test(start_paused = true)]
async fn a_loss_is_counted_when_the_guard_is_dropped_at_once() {
    let (memory, locks) = metered(MetricsOptions::new().with_name_label());
    let labels = ["backend=mem", "name=m-dropped"];
    let guard = locks
        .acquire("m-dropped", AcquireOptions::new())
        .await
        .unwrap();
    memory.revoke("m-dropped").await.unwrap();
    assert!(guard.is_lost());
    drop(guard);
    tokio::task::yield_now().await;
    let lost = [labels[0], labels[1], "cause=key_gone"];
    assert_eq!(count(LOCK_LOST_TOTAL, &lost), 1.0, "not counted");
    assert_eq!(count(LOCKS_HELD, &labels), 0.0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(count(LOCK_LOST_TOTAL, &lost), 1.0, "counted twice");
}

#[tokio::test(start_paused = true)]
async fn renewals_are_counted_by_the_backend_with_or_without_the_layer() {
    let _ = snapshotter();
    let renewed = ["backend=mem", "result=renewed"];
    let gone = ["backend=mem", "result=gone"];
    let (renewed_before, gone_before) = (
        count(crate::RENEWALS_TOTAL, &renewed),
        count(crate::RENEWALS_TOTAL, &gone),
    );
    // No Metrics layer: the backend counts its renewals itself.
    let memory = MemoryLock::new();
    let opts = AcquireOptions::new().lease(Duration::from_secs(3));
    let guard = memory.acquire("m-renewals", opts).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert!(count(crate::RENEWALS_TOTAL, &renewed) - renewed_before >= 3.0);
    assert!(read(crate::RENEWAL_SECONDS, &["backend=mem"]).0 >= 3.0);
    memory.revoke("m-renewals").await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(count(crate::RENEWALS_TOTAL, &gone) - gone_before >= 1.0);
    assert!(guard.is_lost());
}

#[tokio::test(start_paused = true)]
async fn the_name_label_is_off_by_default() {
    let memory: Arc<dyn DistributedLock> = Arc::new(MemoryLock::named("m-noname"));
    let _ = snapshotter();
    let locks = Metrics::new(memory, MetricsOptions::default());
    assert!(!MetricsOptions::default().has_name_label());
    assert!(MetricsOptions::new().with_name_label().has_name_label());
    let acquired = ["backend=mem", "result=acquired"];
    let before = count(LOCK_ACQUIRES_TOTAL, &acquired);
    let guard = locks.lock("m-noname-a").await.unwrap();
    assert_eq!(guard.backend(), "mem");
    assert!(guard.backend_key().is_none());
    guard.release().await.unwrap();
    assert!(count(LOCK_ACQUIRES_TOTAL, &acquired) > before);
    assert_eq!(
        count(
            LOCK_ACQUIRES_TOTAL,
            &["backend=mem", "name=m-noname-a", "result=acquired"]
        ),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passes_the_conformance_release_case() {
    let (_memory, locks) = metered(MetricsOptions::new().without_name_label());
    let guard = locks.lock("m-idem").await.unwrap();
    let handle = guard.held().clone();
    handle.release().await.unwrap();
    handle.release().await.unwrap();
    let again = locks.try_lock("m-idem").await.unwrap().expect("free");
    assert!(matches!(
        guard.release().await,
        Ok(()) | Err(Error::Lost { .. })
    ));
    handle.release().await.unwrap();
    assert!(locks.try_lock("m-idem").await.unwrap().is_none());
    again.release().await.unwrap();
}
