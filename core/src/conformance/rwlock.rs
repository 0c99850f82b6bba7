//! Read-write locks: readers overlap, writers exclude everyone, a waiting writer is not
//! starved by readers, writers' tokens increase. Backends without read-write locks must
//! refuse them with a typed error, which these cases check instead.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::join_all;

use super::support::unique_name;
use crate::{AcquireOptions, DistributedLock, Error, FencedRegister};

/// Whether `lock` has read-write locks; if not, checks that it says so with
/// [`Error::Unsupported`].
async fn has_rw_locks(lock: &dyn DistributedLock) -> bool {
    if lock.capabilities().rw_lock {
        return true;
    }
    let name = unique_name("no-rw-lock");
    assert!(matches!(
        lock.acquire_read(&name, AcquireOptions::new()).await,
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(
        lock.acquire_write(&name, AcquireOptions::new()).await,
        Err(Error::Unsupported { .. })
    ));
    false
}

fn wait() -> AcquireOptions {
    AcquireOptions::new().wait_timeout(Duration::from_secs(60))
}

/// Readers on both clients hold the lock together (a second reader is granted at once,
/// without waiting, while the first holds); then four readers and four writers on two
/// clients, 15 rounds each: a writer never holds with anyone, a reader never with a
/// writer, every writer's write to a fenced register is accepted, and writers' tokens
/// increase.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending requests, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn readers_share_and_writers_exclude(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    if !has_rw_locks(a).await {
        return;
    }
    let name = unique_name("rw-exclusion");
    let first = a.acquire_read(&name, wait()).await.expect("read lock");
    let second = b
        .acquire_read(&name, AcquireOptions::new().no_wait())
        .await
        .expect("a second reader shares the lock at once");
    assert!(matches!(
        a.acquire_write(&name, AcquireOptions::new().no_wait())
            .await,
        Err(Error::Contended { .. })
    ));
    first.release().await.expect("release");
    second.release().await.expect("release");

    // Readers add 1, a writer subtracts 1000: a writer alone is -1000 exactly.
    let state = AtomicI64::new(0);
    let register = FencedRegister::new(0u32);
    let writer_tokens = Mutex::new(Vec::new());
    let readers = (0..4).map(|i| {
        let client = if i % 2 == 0 { a } else { b };
        let (name, state) = (&name, &state);
        async move {
            for _ in 0..15 {
                let guard = client.acquire_read(name, wait()).await.expect("read lock");
                let now = state.fetch_add(1, Ordering::SeqCst) + 1;
                assert!(now > 0, "a reader holds with a writer");
                tokio::time::sleep(Duration::from_millis(3)).await;
                state.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.expect("release");
            }
        }
    });
    let writers = (0..4).map(|i| {
        let client = if i % 2 == 0 { b } else { a };
        let (name, state, register, writer_tokens) = (&name, &state, &register, &writer_tokens);
        async move {
            for _ in 0..15 {
                let guard = client
                    .acquire_write(name, wait())
                    .await
                    .expect("write lock");
                let now = state.fetch_sub(1000, Ordering::SeqCst) - 1000;
                assert_eq!(now, -1000, "a writer holds with someone else");
                let count = register.read();
                register
                    .write(guard.token(), count + 1)
                    .expect("a writer's write is accepted");
                writer_tokens.lock().unwrap().push(guard.token());
                tokio::task::yield_now().await;
                state.fetch_add(1000, Ordering::SeqCst);
                guard.release().await.expect("release");
            }
        }
    });
    let (_, _) = tokio::join!(join_all(readers), join_all(writers));
    assert_eq!(register.read(), 60);
    let tokens = writer_tokens.into_inner().unwrap();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "writers' tokens increase"
    );
}

/// While readers keep taking and releasing overlapping read locks on one client, a
/// writer on the other client is granted the write lock within seconds: readers that
/// come after it wait behind it.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending requests, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn a_waiting_writer_is_not_starved(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    if !has_rw_locks(a).await {
        return;
    }
    let name = unique_name("rw-starvation");
    let stop = AtomicBool::new(false);
    let reads = AtomicUsize::new(0);
    // Three readers whose holds overlap, so the lock is never free of readers.
    let readers = (0..3).map(|_| {
        let (name, stop, reads) = (&name, &stop, &reads);
        async move {
            while !stop.load(Ordering::SeqCst) {
                let guard = a.acquire_read(name, wait()).await.expect("read lock");
                reads.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(30)).await;
                guard.release().await.expect("release");
            }
        }
    });
    let writer = async {
        // Let the readers get going first.
        while reads.load(Ordering::SeqCst) < 6 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let granted = b
            .acquire_write(
                &name,
                AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
            )
            .await;
        stop.store(true, Ordering::SeqCst);
        let guard = granted.expect("the writer is granted despite the stream of readers");
        guard.release().await.expect("release");
    };
    let (_, ()) = tokio::join!(join_all(readers), writer);
}

/// A writer request dropped while it waits leaves nothing behind (later readers are
/// not queued behind a ghost), a request that cannot wait is `Contended` while the other
/// kind holds, and bad names are refused before any I/O.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending requests, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn rw_requests_are_checked_and_cancellable(a: &dyn DistributedLock) {
    if !has_rw_locks(a).await {
        return;
    }
    assert!(matches!(
        a.acquire_read("", AcquireOptions::new()).await,
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        a.acquire_write("bad\0name", AcquireOptions::new()).await,
        Err(Error::InvalidName { .. })
    ));
    // A free read-write lock is granted with a zero wait (the wait bounds the time spent
    // behind holders, not the round trips).
    let free = AcquireOptions::new().wait_timeout(Duration::ZERO);
    let read = a.acquire_read(&unique_name("rw-free"), free).await;
    read.unwrap_or_else(|e| panic!("a free read lock with a zero wait: {e:?}"))
        .release()
        .await
        .expect("release");
    let write = a.acquire_write(&unique_name("rw-free"), free).await;
    write
        .unwrap_or_else(|e| panic!("a free write lock with a zero wait: {e:?}"))
        .release()
        .await
        .expect("release");
    let name = unique_name("rw-cancel");
    let reader = a.acquire_read(&name, wait()).await.expect("read lock");
    assert!(matches!(
        a.acquire_write(&name, AcquireOptions::new().no_wait())
            .await,
        Err(Error::Contended { .. })
    ));
    // A writer dropped while it waits behind the reader.
    let writer = a.acquire_write(&name, AcquireOptions::new());
    let granted = tokio::time::timeout(Duration::from_millis(200), writer).await;
    assert!(
        granted.is_err(),
        "a writer was granted while a reader held: {granted:?}"
    );
    let second_reader = a
        .acquire_read(
            &name,
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("no ghost writer queued ahead");
    second_reader.release().await.expect("release");
    reader.release().await.expect("release");
    let writer = a
        .acquire_write(&name, AcquireOptions::new().no_wait())
        .await
        .expect("free once the readers left");
    assert!(matches!(
        a.acquire_read(&name, AcquireOptions::new().no_wait()).await,
        Err(Error::Contended { .. })
    ));
    writer.release().await.expect("release");
}
