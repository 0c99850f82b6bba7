//! Cases with two independent clients of the same deployment (two connections, two
//! sessions), as two service instances would have.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::join_all;

use super::support::unique_name;
use crate::{AcquireOptions, DistributedLock, DistributedLockExt, FencedRegister};

/// Four tasks on each of two clients, 25 rounds each, read-sleep-write on a fenced
/// register: no overlap, no rejected write, 200 strictly increasing tokens.
pub async fn mutual_exclusion_across_clients(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    const TASKS_PER_CLIENT: usize = 4;
    const ROUNDS: usize = 25;
    let name = unique_name("exclusion-across-clients");
    let register = FencedRegister::new(0u64);
    let inside = AtomicUsize::new(0);
    let tokens = Mutex::new(Vec::new());
    let clients = [a, b];
    join_all((0..2 * TASKS_PER_CLIENT).map(|i| {
        let (lock, name, register, inside, tokens) =
            (clients[i % 2], &name, &register, &inside, &tokens);
        async move {
            for _ in 0..ROUNDS {
                let guard = lock.lock(name).await.expect("acquire");
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                let count = register.read();
                tokio::time::sleep(Duration::from_millis(1)).await;
                register
                    .write(guard.token(), count + 1)
                    .expect("a valid holder's write was rejected");
                tokens.lock().unwrap().push(guard.token());
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.expect("release");
            }
        }
    }))
    .await;
    assert_eq!(register.read(), (2 * TASKS_PER_CLIENT * ROUNDS) as u64);
    assert_eq!(register.rejections(), 0);
    let tokens = tokens.into_inner().unwrap();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens are not strictly increasing in grant order"
    );
}

/// A lock held through one client is held for the other: `try_lock` is `Ok(None)`,
/// `inspect` shows the holder's token, and a waiter on the other client gets the lock
/// with a larger token once it is released.
pub async fn exclusion_is_visible_across_clients(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    let name = unique_name("visible-across-clients");
    let holder = a.lock(&name).await.expect("acquire");
    assert!(b.try_lock(&name).await.expect("try_lock").is_none());
    let info = b.inspect(&name).await.expect("inspect");
    assert_eq!(info.holder.map(|h| h.token), Some(holder.token()));
    let waiter = b.acquire(
        &name,
        AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
    );
    let release = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let token = holder.token();
        holder.release().await.expect("release");
        token
    };
    let (next, released) = tokio::join!(waiter, release);
    let next = next.expect("the other client's waiter gets the lock");
    assert!(next.token() > released);
    next.release().await.expect("release");
}
