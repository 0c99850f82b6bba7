//! etcd-specific behaviour on a real server: several clients, loss by deletion and by
//! session revocation, clean-up after cancellation, fenced transactions, configuration.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{GetOptions, Txn, TxnOp};
use fencelock_core::{AcquireOptions, DistributedLock, DistributedLockExt, Error, FencedRegister};
use fencelock_etcd::{EtcdConfig, EtcdLock, owner_compare};
use fencelock_testkit::EtcdServer;

fn config(prefix: &str) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![EtcdServer::shared().endpoint()],
        prefix: format!("behaviour-{prefix}-{:x}", std::process::id()),
        lease: Duration::from_secs(2),
        ..EtcdConfig::default()
    }
}

async fn client(prefix: &str) -> EtcdLock {
    EtcdLock::connect(config(prefix)).await.expect("connect")
}

async fn keys_under(lock: &EtcdLock) -> Vec<String> {
    let prefix = format!("{}/", lock.config().prefix);
    let response = lock
        .client()
        .kv_client()
        .get(
            prefix,
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await
        .unwrap();
    response
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_clients_exclude_each_other_with_increasing_tokens() {
    let clients = futures_join(4, "exclusion").await;
    let register = FencedRegister::new(0u32);
    let inside = AtomicUsize::new(0);
    let tokens = Mutex::new(Vec::new());
    let work = clients.iter().map(|lock| async {
        for _ in 0..25 {
            let guard = lock.lock("counter").await.unwrap();
            assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "overlap");
            let n = register.read();
            tokio::time::sleep(Duration::from_millis(1)).await;
            register.write(guard.token(), n + 1).unwrap();
            tokens.lock().unwrap().push(guard.token());
            inside.fetch_sub(1, Ordering::SeqCst);
            guard.release().await.unwrap();
        }
    });
    futures_util::future::join_all(work).await;
    assert_eq!(register.read(), 100);
    assert!(tokens.into_inner().unwrap().windows(2).all(|w| w[0] < w[1]));
    assert!(keys_under(&clients[0]).await.is_empty());
}

async fn futures_join(n: usize, prefix: &str) -> Vec<EtcdLock> {
    let mut clients = Vec::new();
    for _ in 0..n {
        clients.push(client(prefix).await);
    }
    clients
}

/// Waiters of another client than the holder's that stop waiting leave no key behind:
/// neither those whose wait times out nor those whose acquire is dropped mid-flight (at
/// any point of their I/O); only the holder's key remains, and the lock is free once it
/// is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waiters_of_other_clients_leave_no_key() {
    let clients = futures_join(2, "cancel").await;
    let holder = clients[0].lock("job").await.unwrap();
    for i in 0..60u64 {
        let wait = Duration::from_millis(i % 20);
        let opts = AcquireOptions::new().wait_timeout(wait);
        let timed_out = clients[1].acquire("job", opts).await;
        assert!(
            matches!(timed_out, Err(Error::Timeout { .. })),
            "waiting {wait:?} for a held lock: {timed_out:?}"
        );
        if i % 3 == 0 {
            // Polled for a few milliseconds (its key is being created, or is there), then
            // dropped.
            let cut = Duration::from_millis(1 + i % 7);
            let dropped = tokio::time::timeout(cut, clients[1].lock("job")).await;
            assert!(dropped.is_err(), "a held lock's acquire ended: {dropped:?}");
        }
    }
    // Clean-ups run in the background; they are prompt.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while keys_under(&clients[0]).await.len() > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            keys_under(&clients[0]).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    holder.release().await.unwrap();
    assert!(clients[1].try_lock("job").await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_key_is_reported_as_loss_at_once() {
    let lock = client("deleted").await;
    let guard = lock.lock("report").await.unwrap();
    let key = guard.backend_key().unwrap().to_owned();
    lock.client().kv_client().delete(key, None).await.unwrap();
    tokio::time::timeout(Duration::from_secs(1), guard.lost())
        .await
        .expect("loss within 1 s");
    assert!(guard.lost_reason().unwrap().contains("deleted"));
    assert!(matches!(guard.release().await, Err(Error::Lost { .. })));
}

/// A held lock's key watch starts from the grant's revision. If etcd compacted that
/// history before the watch started, the key is read instead: still ours, the lock stays
/// held and its later deletion is reported; the watch never just stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_before_the_key_watch_starts_loses_no_deletion() {
    use etcd_client::CompactionOptions;
    // Its own server: a compaction would disturb other tests.
    let server = fencelock_testkit::EtcdServer::start();
    let lock = EtcdLock::connect(EtcdConfig {
        endpoints: vec![server.endpoint()],
        prefix: "compaction".into(),
        lease: Duration::from_secs(2),
        ..EtcdConfig::default()
    })
    .await
    .unwrap();
    let guard = lock.lock("held").await.unwrap();
    let kv = || lock.client().kv_client();
    kv().put("other", "", None).await.unwrap();
    let now = kv()
        .put("other", "", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    kv().compact(now, Some(CompactionOptions::new().with_physical()))
        .await
        .unwrap();
    // The watch starts 50 ms after the grant, finds the history compacted and reads the
    // key: still ours, so the lock is not lost.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
    let key = guard.backend_key().unwrap().to_owned();
    kv().delete(key, None).await.unwrap();
    tokio::time::timeout(Duration::from_secs(1), guard.lost())
        .await
        .expect("loss within 1 s");
    assert!(guard.lost_reason().unwrap().contains("deleted"));
}

/// A waiter whose own key was deleted while it waited (by an operator, or its lease
/// expiring) must not be handed the lock when its turn comes: it fails with `Lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_key_was_deleted_is_not_granted() {
    let clients = futures_join(2, "waiter-deleted").await;
    let holder = clients[0].lock("job").await.unwrap();
    let holder_key = holder.backend_key().unwrap().to_owned();
    let waiter = {
        let lock = clients[1].clone();
        tokio::spawn(async move { lock.lock("job").await })
    };
    // Wait until the waiter's key exists, then delete it behind its back.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let waiter_key = loop {
        let keys = keys_under(&clients[1]).await;
        if let Some(key) = keys.into_iter().find(|k| *k != holder_key) {
            break key;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the waiter never queued"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    clients[1]
        .client()
        .kv_client()
        .delete(waiter_key, None)
        .await
        .unwrap();
    holder.release().await.unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter ended")
        .unwrap();
    assert!(
        matches!(outcome, Err(Error::Lost { .. })),
        "not granted: {outcome:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_session_fails_its_guards_and_a_new_session_serves_later_locks() {
    let lock = client("revoked").await;
    let a = lock.lock("a").await.unwrap();
    let b = lock.lock("b").await.unwrap();
    let key = a.backend_key().unwrap().to_owned();
    let lease = i64::from_str_radix(key.rsplit('/').next().unwrap(), 16).unwrap();
    lock.client().lease_client().revoke(lease).await.unwrap();
    for guard in [&a, &b] {
        tokio::time::timeout(Duration::from_secs(3), guard.lost())
            .await
            .expect("loss reported");
    }
    let c = lock
        .lock("a")
        .await
        .expect("a new session after the old one was lost");
    assert!(c.token() > a.token());
    assert_ne!(c.backend_key(), a.backend_key());
    c.release().await.unwrap();
}

/// A read lock, a write lock and permits asked for right after the session's lease was
/// revoked behind the client's back (before its keepalive noticed) are served on a new
/// session, as a lock is: not a non-retryable "lease not found".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_after_a_revoked_session_are_served_on_a_new_one() {
    let lock = client("revoked-queued").await;
    let probe = lock.lock("probe").await.unwrap();
    let key = probe.backend_key().unwrap().to_owned();
    let lease = i64::from_str_radix(key.rsplit('/').next().unwrap(), 16).unwrap();
    lock.client().lease_client().revoke(lease).await.unwrap();
    let options = || AcquireOptions::new().no_wait();
    let read = lock.acquire_read("r", options()).await;
    let read = read.unwrap_or_else(|e| panic!("a read lock after the revoke: {e:?}"));
    let write = lock.acquire_write("w", options()).await;
    let write = write.unwrap_or_else(|e| panic!("a write lock after the revoke: {e:?}"));
    let permits = lock
        .acquire_permits("s", fencelock_core::Permits::one_of(2).unwrap(), options())
        .await;
    let permits = permits.unwrap_or_else(|e| panic!("permits after the revoke: {e:?}"));
    for guard in [read, write, permits] {
        guard.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_compare_lets_only_the_current_holder_write() {
    let lock = client("fenced").await;
    let old = lock
        .acquire(
            "ledger",
            AcquireOptions::new().fixed_lease(Duration::from_secs(2)),
        )
        .await
        .unwrap();
    let write = |guard: &fencelock_core::LockGuard, value: &'static str| {
        let txn = Txn::new()
            .when([owner_compare(guard).unwrap()])
            .and_then([TxnOp::put(
                format!("{}-ledger", lock.config().prefix),
                value,
                None,
            )]);
        let mut kv = lock.client().kv_client();
        async move { kv.txn(txn).await.unwrap().succeeded() }
    };
    assert!(write(&old, "old holder").await);
    let new = lock.lock("ledger").await.unwrap(); // waits for the fixed lease to run out
    assert!(write(&new, "new holder").await);
    assert!(
        !write(&old, "zombie").await,
        "the zombie's write must be refused by etcd"
    );
    new.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_lock_on_a_taken_name_creates_nothing() {
    let clients = futures_join(2, "try").await;
    let holder = clients[0].lock("x").await.unwrap();
    for _ in 0..10 {
        assert!(clients[1].try_lock("x").await.unwrap().is_none());
    }
    assert_eq!(keys_under(&clients[0]).await.len(), 1);
    let info = clients[1].inspect("x").await.unwrap();
    assert_eq!(info.holder.unwrap().token, holder.token());
    assert_eq!(info.waiters, Some(0));
    holder.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_etcd_would_change_are_refused() {
    let lock = client("leases").await;
    for lease in [Duration::from_secs(1), Duration::from_millis(2500)] {
        let err = lock
            .acquire("x", AcquireOptions::new().lease(lease))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{lease:?}: {err:?}");
    }
    let err = EtcdLock::connect(EtcdConfig {
        lease: Duration::from_secs(1),
        ..config("leases")
    })
    .await
    .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_cluster_is_unavailable_and_retryable() {
    let port = fencelock_testkit::free_port();
    let err = EtcdLock::connect(EtcdConfig {
        endpoints: vec![format!("127.0.0.1:{port}")],
        connect_timeout: Duration::from_millis(500),
        ..config("down")
    })
    .await
    .unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_waiter_has_deleted_its_key_when_it_returns() {
    let clients = futures_join(2, "timeout-cleanup").await;
    let holder = clients[0].lock("job").await.unwrap();
    for _ in 0..5 {
        let opts = AcquireOptions::new().wait_timeout(Duration::from_millis(150));
        let err = clients[1].acquire("job", opts).await.unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        // No background clean-up to wait for: a process may exit right here.
        assert_eq!(keys_under(&clients[0]).await.len(), 1);
    }
    holder.release().await.unwrap();
}

/// A key of ours left over from an earlier grant (its deletion never got through) is
/// never adopted: its create revision is an old token. The next acquire deletes it and
/// queues a fresh key, alone and behind another client's holder alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leftover_key_of_ours_is_replaced_never_adopted() {
    let clients = futures_join(2, "leftover").await;
    let ours = &clients[0];
    let first = ours.lock("x").await.unwrap();
    let key = first.backend_key().unwrap().to_owned();
    first.release().await.unwrap();
    let lease = i64::from_str_radix(key.rsplit('/').next().unwrap(), 16).unwrap();
    let leave_behind = || async {
        ours.client()
            .kv_client()
            .put(
                key.as_str(),
                "",
                Some(etcd_client::PutOptions::new().with_lease(lease)),
            )
            .await
            .unwrap()
            .header()
            .unwrap()
            .revision()
    };

    let stale = leave_behind().await;
    let guard = ours.lock("x").await.unwrap();
    assert!(guard.token().get() > u64::try_from(stale).unwrap());
    assert_eq!(keys_under(ours).await, vec![key.clone()]);
    guard.release().await.unwrap();
    assert!(keys_under(ours).await.is_empty());

    let other = clients[1].lock("x").await.unwrap();
    let stale = leave_behind().await;
    let waiting = tokio::spawn({
        let ours = ours.clone();
        async move { ours.lock("x").await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "the leftover key was taken for a turn"
    );
    other.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .unwrap()
        .unwrap();
    assert!(guard.token().get() > u64::try_from(stale).unwrap());
    guard.release().await.unwrap();
    assert!(keys_under(ours).await.is_empty());
}

/// A campaign that finds a leftover candidate key of its own (a release whose delete
/// never happened) never puts its new value into that key: observers would see the new
/// value with the old incarnation's token, a term that never existed. The key is deleted
/// and the campaign's own key made afresh, with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leftover_candidate_of_ours_never_shows_the_new_value_with_its_old_token() {
    let clients = futures_join(2, "leftover-candidate").await;
    let (ours, observer) = (&clients[0], &clients[1]);
    let first = ours
        .campaign("e", "old", AcquireOptions::new())
        .await
        .unwrap();
    let key = first.backend_key().unwrap().to_owned();
    first.release().await.unwrap();
    let lease = i64::from_str_radix(key.rsplit('/').next().unwrap(), 16).unwrap();
    let stale = ours
        .client()
        .kv_client()
        .put(
            key.as_str(),
            "old",
            Some(etcd_client::PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    let stale = u64::try_from(stale).unwrap();

    let mut changes = observer.observe("e").await.unwrap();
    let seen = std::sync::Arc::new(Mutex::new(Vec::new()));
    let collecting = tokio::spawn({
        let seen = seen.clone();
        async move {
            while let Some(change) = changes.next().await {
                seen.lock().unwrap().push(change.unwrap());
            }
        }
    });
    let guard = ours
        .campaign("e", "new", AcquireOptions::new())
        .await
        .unwrap();
    assert!(guard.token().get() > stale, "{} <= {stale}", guard.token());
    let leader = observer.leader("e").await.unwrap().unwrap();
    assert_eq!(
        (leader.value.as_str(), leader.token),
        ("new", guard.token())
    );
    let newest = Some(fencelock_core::Leader::new("new", guard.token()));
    let caught_up = async {
        while seen.lock().unwrap().last() != Some(&newest) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), caught_up).await;
    collecting.abort();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen.first(),
        Some(&Some(fencelock_core::Leader::new(
            "old",
            fencelock_core::FencingToken::new(stale)
        ))),
        "{seen:?}"
    );
    assert_eq!(
        seen.last(),
        Some(&Some(fencelock_core::Leader::new("new", guard.token()))),
        "{seen:?}"
    );
    let mixed: Vec<_> = seen
        .iter()
        .flatten()
        .filter(|l| l.value == "new" && l.token != guard.token())
        .collect();
    assert!(mixed.is_empty(), "a term that never existed: {mixed:?}");
    guard.release().await.unwrap();
    assert!(keys_under(ours).await.is_empty());
}

/// Group commit: tasks of one client locking and releasing distinct names at the same
/// time share transactions (guards granted together carry the same create revision), and
/// every request still gets the answer a transaction of its own would give: a taken name
/// in the batch is refused, the others granted; a guard whose key was deleted is told it
/// was lost at release while the others release normally; nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_answers_each_request_as_if_alone() {
    let clients = futures_join(2, "group").await;
    let ours = clients[0].clone();
    let taken = clients[1].lock("taken").await.unwrap();
    let mut shared_a_transaction = false;
    for round in 0..6 {
        let tries = (0..17).map(|i| {
            let ours = ours.clone();
            // Odd rounds have a taken name among them, which fails their batches.
            let name = if i == 8 && round % 2 == 1 {
                "taken".to_owned()
            } else {
                format!("g-{round}-{i}")
            };
            tokio::spawn(async move { (name.clone(), ours.try_lock(&name).await.unwrap()) })
        });
        let mut guards = Vec::new();
        for task in tries.collect::<Vec<_>>() {
            let (name, guard) = task.await.unwrap();
            if name == "taken" {
                assert!(guard.is_none(), "a taken name was granted in a batch");
            } else {
                guards.push(guard.expect("a free name was refused"));
            }
        }
        let mut tokens: Vec<u64> = guards.iter().map(|g| g.token().get()).collect();
        tokens.sort_unstable();
        tokens.dedup();
        if round % 2 == 0 {
            shared_a_transaction |= tokens.len() < guards.len();
        }

        // Delete one key behind its guard's back: its release must say Lost.
        let victim = guards[3].backend_key().unwrap().to_owned();
        ours.client()
            .kv_client()
            .delete(victim.as_str(), None)
            .await
            .unwrap();
        let releases = guards.into_iter().map(|g| {
            tokio::spawn(async move {
                let key = g.backend_key().unwrap().to_owned();
                (key, g.release().await)
            })
        });
        for task in releases.collect::<Vec<_>>() {
            let (key, outcome) = task.await.unwrap();
            if key == victim {
                assert!(matches!(outcome, Err(Error::Lost { .. })), "{outcome:?}");
            } else {
                outcome.unwrap();
            }
        }
    }
    assert!(
        shared_a_transaction,
        "17 simultaneous acquires never shared a transaction"
    );
    taken.release().await.unwrap();
    assert!(
        keys_under(&ours).await.is_empty(),
        "{:?}",
        keys_under(&ours).await
    );
}

/// A create of ours that etcd applied but whose answer never came (a combined create of
/// the group commit that erred after it was applied, then sent again on its own) finds
/// our own key on a taken name. That key is deleted, not left on the session lease where
/// it would block the name after the holder's release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_own_key_found_on_a_taken_name_is_deleted() {
    let (a, b) = (client("own-key").await, client("own-key").await);
    let probe = b.try_lock("probe").await.unwrap().unwrap();
    let lease_hex = probe
        .backend_key()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .to_owned();
    probe.release().await.unwrap();
    let holder = a.lock("x").await.unwrap();
    // What the lost first send of b's create left behind.
    let key = format!("{}/x/{lease_hex}", b.config().prefix);
    let lease = i64::from_str_radix(&lease_hex, 16).unwrap();
    b.client()
        .kv_client()
        .put(
            key.as_str(),
            "",
            Some(etcd_client::PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();
    assert!(b.try_lock("x").await.unwrap().is_none());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while keys_under(&a).await.contains(&key) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "b's own key was left on its session lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    holder.release().await.unwrap();
    let next = a
        .try_lock("x")
        .await
        .unwrap()
        .expect("free after the release");
    next.release().await.unwrap();
}

/// Session leases per lease duration are bounded: many durations over time reuse a
/// bounded set (idle ones are revoked), and more held at once is a typed error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_durations_are_bounded_sessions() {
    let lock = client("durations").await;
    let lease = |secs: u64| {
        AcquireOptions::new()
            .lease(Duration::from_secs(secs))
            .no_wait()
    };
    for secs in 2..30 {
        let guard = lock
            .acquire(&format!("n{secs}"), lease(secs))
            .await
            .unwrap_or_else(|e| panic!("lease {secs}s: {e:?}"));
        guard.release().await.unwrap();
    }
    let mut held = Vec::new();
    let mut refused = None;
    for secs in 40..52 {
        match lock.acquire(&format!("held{secs}"), lease(secs)).await {
            Ok(guard) => held.push(guard),
            Err(error) => {
                refused = Some(error);
                break;
            }
        }
    }
    let error = refused.expect("12 distinct durations held at once were all accepted");
    assert!(matches!(error, Error::InvalidConfig(_)), "{error:?}");
    for guard in held {
        guard.release().await.unwrap();
    }
    let guard = lock.acquire("again", lease(60)).await.unwrap();
    guard.release().await.unwrap();
}

/// Held guards' loss watches are futures of the client's one task for them, not a task
/// each: 300 guards held past the watch delay cost a handful of tasks (that one, the watch
/// stream's, the batcher's; the old design spawned 300 more), a key deleted then is still
/// reported, and those tasks end once nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_guards_are_watched_by_one_task_per_client() {
    let alive = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    let settle = |target: usize| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while alive() > target && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let lock = client("one-task").await;
    // The session (and its keepalive task) exists once a first lock was taken.
    lock.lock("warm-up").await.unwrap().release().await.unwrap();
    // The watch stream and the batcher's tasks linger about 1 s after their last use.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = alive();
    let mut guards = Vec::new();
    for i in 0..300 {
        guards.push(lock.lock(&format!("held-{i}")).await.unwrap());
    }
    // Past the 50 ms watch delay: every watch is running.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        alive() <= before + 5,
        "{} tasks for 300 held locks (before: {before})",
        alive()
    );
    let key = guards[150].backend_key().unwrap().to_owned();
    lock.client().kv_client().delete(key, None).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), guards[150].lost())
        .await
        .expect("the deletion is reported");
    assert!(guards[150].lost_reason().unwrap().contains("deleted"));
    for (i, guard) in guards.into_iter().enumerate() {
        if i != 150 {
            assert!(!guard.is_lost(), "lock {i} was not touched");
            guard.release().await.unwrap();
        }
    }
    // The watch stream lingers 1 s after its last watch.
    settle(before).await;
    assert!(
        alive() <= before,
        "the watch tasks end when nothing is held: {} tasks, {before} before",
        alive()
    );
}

/// A session's keepalive runs on the client's runtime, not on that of the acquire that
/// granted the session: when that runtime ended (a `block_on`, another test's), the
/// keepalive ended with it and every later lock on the session was lost at its TTL.
#[test]
fn a_session_outlives_the_runtime_of_the_acquire_that_granted_it() {
    let runtime = |threads| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
            .unwrap()
    };
    let main = runtime(2);
    let locks = main.block_on(client("session-runtime"));
    // Not the configured lease: this acquire grants a session of its own.
    let options = AcquireOptions::new()
        .no_wait()
        .lease(Duration::from_secs(3));
    let short = runtime(1);
    let first = short.block_on(locks.acquire("first", options)).unwrap();
    short.block_on(first.release()).unwrap();
    drop(short);
    main.block_on(async {
        let guard = locks.acquire("second", options).await.unwrap();
        // Past the session's TTL: kept alive all along.
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
        guard.release().await.unwrap();
    });
}

/// Acquires dropped at every point of their first steps, a lease grant in flight
/// included, leave no lease behind (a fixed lease is granted for a no-wait try, and at
/// the grant of a waiting one; a session's lease at a client's first acquire). On a
/// server of its own, so that every lease on it is this test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_dropped_during_a_lease_grant_leave_no_lease() {
    let server = EtcdServer::start();
    let config = EtcdConfig {
        endpoints: vec![server.endpoint()],
        prefix: "dropped-grants".into(),
        lease: Duration::from_secs(30),
        ..EtcdConfig::default()
    };
    let fixed = AcquireOptions::new().fixed_lease(Duration::from_secs(60));
    for step in 0..60u64 {
        let lock = EtcdLock::connect(config.clone()).await.expect("connect");
        let name = format!("n{}", step % 3);
        let dropped_after = Duration::from_micros(step * 150);
        let options = match step % 3 {
            0 => fixed.no_wait(),
            1 => fixed.wait_timeout(Duration::from_secs(5)),
            _ => AcquireOptions::new().no_wait(),
        };
        if let Ok(Ok(guard)) =
            tokio::time::timeout(dropped_after, lock.acquire(&name, options)).await
        {
            guard.release().await.expect("release");
        }
        lock.close().await.expect("close");
    }
    let mut leases = lease_count(&server).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while leases > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        leases = lease_count(&server).await;
    }
    assert_eq!(leases, 0, "leases left by dropped acquires");
}

async fn lease_count(server: &EtcdServer) -> usize {
    let mut client = etcd_client::Client::connect([server.endpoint()], None)
        .await
        .unwrap();
    client.leases().await.unwrap().leases().len()
}

/// A release whose future is dropped mid-way leaves its delete to the background; a
/// release retried after it is not told "lost" (the lock was held to the release), as
/// the trait promises that calling release again is safe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_retried_after_a_dropped_one_is_not_a_loss() {
    let locks = client("dropped-release").await;
    let guard = locks.lock("x").await.unwrap();
    // Polled once: the delete is sent, then the future is dropped (unless a batch of
    // deletes answered it within that poll: then the retry is a repeat of a release).
    let _ = tokio::time::timeout(Duration::ZERO, guard.held().release()).await;
    let retried = guard.held().release().await;
    assert!(
        !matches!(retried, Err(Error::Lost { .. })),
        "a retried release called the lock lost: {retried:?}"
    );
    drop(guard);
    let other = client("dropped-release").await;
    other
        .acquire(
            "x",
            AcquireOptions::new().wait_timeout(Duration::from_secs(3)),
        )
        .await
        .expect("the dropped release's delete went on")
        .release()
        .await
        .unwrap();
}

/// A guard outlives the client it was acquired through: dropped without `close`, the
/// client's session is still kept alive for the guards on it, which stay held past
/// several leases and release normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_outlives_its_dropped_client() {
    let lock = client("outlives-client").await;
    let other = client("outlives-client").await;
    let guard = lock.lock("kept").await.unwrap();
    let first_deadline = guard.valid_until();
    drop(lock);
    // The lease is 2 s: three leases without a renewal would lose it.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(!guard.is_lost(), "lost: {:?}", guard.lost_reason());
    assert!(guard.valid_until() > first_deadline, "never renewed");
    assert!(other.try_lock("kept").await.unwrap().is_none());
    guard.release().await.unwrap();
    let next = other
        .try_lock("kept")
        .await
        .unwrap()
        .expect("free once released");
    next.release().await.unwrap();
}
