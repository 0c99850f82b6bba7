//! The conformance suite on the in-memory backend, reached the way applications reach it:
//! through `fencelock::connect("mem://")`.

mod mem {
    fencelock_core::conformance_suite!(
        fencelock::connect("mem://conformance")
            .await
            .expect("connect mem://")
    );
}

/// The retry layer over the memory backend keeps the same contract.
mod mem_retry {
    fencelock_core::conformance_suite!(
        fencelock::connect("mem://conformance-retry?retry=2")
            .await
            .expect("connect mem://?retry=2")
    );
}

/// The metrics layer over the memory backend keeps the same contract.
#[cfg(feature = "metrics")]
mod mem_metrics {
    fencelock_core::conformance_suite!(
        fencelock::connect("mem://conformance-metrics?metrics=true")
            .await
            .expect("connect mem://?metrics=true")
    );
}

/// The memory backend's own bookkeeping is empty after the cancellation case: no name,
/// waiter or holder is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mem_cancellation_leaves_no_state() {
    let locks = fencelock::MemoryLock::new();
    fencelock_core::conformance::cancelled_acquires_leave_nothing(&locks).await;
    fencelock_core::conformance::dropped_guard_frees_promptly(&locks).await;
    assert_eq!(locks.active_names(), 0);
}
