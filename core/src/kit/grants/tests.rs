//! The registry's race with the close, and its bookkeeping.

use std::sync::Arc;

use super::*;
use crate::LossCause;

#[test]
fn close_drains_what_was_inserted() {
    let grants: Grants<&str> = Grants::new();
    grants.insert(1, "a").unwrap();
    grants.insert(2, "b").unwrap();
    assert_eq!(grants.len(), 2);
    let mut drained = grants.close(());
    drained.sort_unstable();
    assert_eq!(drained, ["a", "b"]);
    assert!(grants.is_empty());
}

#[test]
fn an_insert_after_the_close_is_refused_and_not_built() {
    let grants: Grants<u32> = Grants::new();
    assert!(grants.close(()).is_empty());
    let mut built = false;
    let inserted = grants.insert_with(1, || {
        built = true;
        7
    });
    assert_eq!(inserted, Err(()));
    assert!(!built, "nothing is started for a refused grant");
    assert!(grants.is_empty());
    assert_eq!(grants.insert(2, 8), Err(()));
}

#[test]
fn an_insert_after_the_close_reports_the_first_close_cause() {
    let grants: Grants<u32, (LossCause, &str)> = Grants::new();
    assert_eq!(grants.closed(), None);
    grants.close((LossCause::SessionEnded, "the session ended"));
    grants.close((LossCause::ClientClosed, "closed"));
    assert_eq!(
        grants.insert(1, 7),
        Err((LossCause::SessionEnded, "the session ended"))
    );
    assert_eq!(
        grants.closed(),
        Some((LossCause::SessionEnded, "the session ended"))
    );
}

#[test]
fn removed_and_looked_up_entries() {
    let grants: Grants<u32> = Grants::default();
    grants.insert(1, 7).unwrap();
    assert_eq!(grants.with(1, |e| std::mem::replace(e, 8)), Some(7));
    assert_eq!(grants.with(2, |e| *e), None);
    let mut seen = Vec::new();
    grants.for_each(|e| seen.push(*e));
    assert_eq!(seen, [8]);
    assert_eq!(grants.remove(1), Some(8));
    assert_eq!(grants.remove(1), None);
    assert!(grants.close(()).is_empty());
}

/// Inserts racing a close: each is either drained by the close or refused, never both
/// and never neither.
#[test]
fn each_racing_insert_is_drained_or_refused() {
    for _ in 0..50 {
        let grants: Arc<Grants<u64>> = Arc::new(Grants::new());
        let inserters: Vec<_> = (0..4u64)
            .map(|t| {
                let grants = grants.clone();
                std::thread::spawn(move || {
                    (0..100u64)
                        .filter(|i| grants.insert(t * 1000 + i, t * 1000 + i).is_ok())
                        .count()
                })
            })
            .collect();
        let drained = grants.close(()).len();
        let accepted: usize = inserters.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(drained, accepted);
        assert!(grants.is_empty());
    }
}
