use std::pin::pin;
use std::task::{Context, Poll, Waker};

use super::*;

/// Drives a future that never waits (the tests' ops are all ready at once).
fn ready<T>(f: impl Future<Output = T>) -> T {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

#[test]
fn median_and_ratios() {
    assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 3.0);
    assert!(median(Vec::new()).is_nan());
    assert_eq!(ratios(&[1.0, 1.25, 0.5]), "median 1.00 (1.00 1.25 0.50)");
    assert_eq!(over(&[2.0, 3.0], &[1.0, 2.0, 5.0]), vec![2.0, 1.5]);
}

#[test]
fn latencies_are_clamped_and_summarised() {
    let mut h = histogram();
    record(&mut h, Duration::ZERO);
    record(&mut h, Duration::from_micros(1500));
    record(&mut h, Duration::from_secs(100 * 3600));
    assert_eq!(h.len(), 3);
    assert_eq!(h.min(), 1);
    let s = Summary::new(&h, Duration::from_secs(1));
    assert_eq!(s.ops, 3);
    assert!((1499..=1501).contains(&s.p50), "{s:?}");
    assert!(s.max >= MAX_MICROS * 999 / 1000, "{s:?}");
    assert_eq!(s.ops_per_sec(), 3.0);
    assert_eq!(
        Summary::new(&histogram(), Duration::ZERO).ops_per_sec(),
        0.0
    );
    assert!(s.to_string().starts_with("ops=3 "), "{s}");
}

#[test]
fn interleave_alternates_kinds_per_round() {
    let mut order = Vec::new();
    let plan = Rounds {
        repeats: 2,
        rounds: 3,
        ops: 2,
        warmup: 1,
    };
    let measured = ready(interleave(&['a', 'b'], plan, |kind| {
        order.push(kind);
        std::future::ready(())
    }));
    let expected: String = "ab".to_owned() + &"aabb".repeat(6);
    assert_eq!(order.iter().collect::<String>(), expected);
    assert_eq!(measured.len(), 2);
    for m in &measured {
        assert_eq!(m.histogram.len() as usize, plan.ops_per_kind());
        assert_eq!(m.repeat_p50.len(), 2);
    }
    assert_eq!(measured[1].p50_over(&measured[0]).len(), 2);
}

#[test]
fn timed_ops_times_each_op() {
    let mut n = 0;
    let h = ready(timed_ops(5, || {
        n += 1;
        std::future::ready(())
    }));
    assert_eq!((n, h.len()), (5, 5));
}

#[test]
fn interleave_runs_alternates_kinds_per_repeat() {
    let runs = ready(interleave_runs(&[1u32, 2], 3, |kind, repeat| {
        std::future::ready(kind * 10 + repeat as u32)
    }));
    assert_eq!(runs, vec![vec![10, 11, 12], vec![20, 21, 22]]);
}

#[test]
fn timed_join_returns_outputs_or_the_first_error() {
    let ok = ready(timed_join(
        (0..3).map(|i| std::future::ready(Ok::<_, ()>(i))),
    ));
    assert_eq!(ok.map(|(_, v)| v), Ok(vec![0, 1, 2]));
    let err = ready(timed_join(
        [Ok(1), Err("first"), Err("second")].map(std::future::ready),
    ));
    assert_eq!(err, Err("first"));
}

#[test]
fn lines_name_the_floor() {
    let plan = Rounds {
        repeats: 3,
        rounds: 1,
        ops: 4,
        warmup: 0,
    };
    let measured = ready(interleave(
        &["raw", "lib"],
        plan,
        |_| std::future::ready(()),
    ));
    assert_eq!(measured[1].repeat_cpu_per_op.len(), 3);
    assert_eq!(plan.to_string(), "3 repeats x 1 interleaved rounds x 4 ops");
    assert_eq!(Rounds::new(3, 1, 4, 0), plan);
    let lines: Vec<String> = latency_lines(&measured, Some(0), |k| k)
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(lines.len(), 2);
    assert!(lines[1].starts_with("  lib "), "{lines:?}");
    assert!(
        lines[1].contains("p50/raw median 1.00 (1.00 1.00 1.00)"),
        "{lines:?}"
    );
    assert!(!latency_lines(&measured, None, |k| k).contains("p50/"));

    let run = |ms: u64| {
        let mut h = histogram();
        for _ in 0..100 {
            record(&mut h, Duration::from_millis(1));
        }
        ready(run_workers([std::future::ready(Ok::<_, ()>(h))])).map(|mut run| {
            run.elapsed = Duration::from_millis(ms);
            run.cpu = Duration::from_millis(ms / 10);
            run
        })
    };
    let runs = [
        vec![run(100).unwrap(), run(200).unwrap()],
        vec![run(50).unwrap(), run(50).unwrap()],
    ];
    assert_eq!(runs[0][0].ops(), 100);
    assert_eq!(runs[0][0].rate(), 1000.0);
    assert_eq!(runs[0][0].cpu_per_op(), 100.0);
    let lines: Vec<String> = rate_lines(&["raw", "lib"], &runs, Some(0), "locks/s", |k| k)
        .lines()
        .map(String::from)
        .collect();
    assert!(
        lines[1].starts_with("  lib            2000 locks/s (median of 2)  p50 "),
        "{lines:?}"
    );
    assert!(
        lines[1].ends_with("  /raw median 4.00 (2.00 4.00)"),
        "{lines:?}"
    );
}
