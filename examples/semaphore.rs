//! Semaphore: at most 3 exports at once, across every instance of a service.
//!
//! Eight workers (each its own client, as separate processes would be) take one of the
//! 3 permits of `exports` for each of their jobs. A shared counter shows that no more
//! than 3 ever run at once, and every grant's token is larger than every earlier one's.
//! Then one worker "crashes" while holding a permit (it stops renewing; its lease runs
//! out) and the permit comes back to the others without anyone releasing it.
//!
//! ```text
//! cargo run --example semaphore                                  # in-memory (mem://)
//! FENCELOCK_URL=etcd://127.0.0.1:2379/locks cargo run --example semaphore --features etcd
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, Permits};

const NAME: &str = "examples/exports";
const LIMIT: u32 = 3;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // FENCELOCK_URL names the backend; with nothing set this demo uses mem://, which
    // locks inside this one process only. A service calls `connect_from_env`, which
    // refuses to guess.
    let locks = fencelock::connect_from_env_or_memory().await?;
    if !locks.capabilities().semaphore {
        return Err(format!("backend {} has no semaphores", locks.backend()).into());
    }
    let lease = locks.capabilities().min_lease.max(Duration::from_secs(2));
    println!("backend: {}  (lease {lease:?})", locks.backend());

    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..8 {
        let (running, most) = (running.clone(), most.clone());
        workers.spawn(async move {
            let locks = fencelock::connect_from_env_or_memory().await?;
            let mut tokens = Vec::new();
            for _ in 0..3 {
                let permit = locks
                    .acquire_permits(NAME, Permits::one_of(LIMIT)?, AcquireOptions::new())
                    .await?;
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokens.push(permit.token().get());
                tokio::time::sleep(Duration::from_millis(20)).await; // the export
                running.fetch_sub(1, Ordering::SeqCst);
                permit.release().await?;
            }
            println!("worker {worker}: 3 exports, tokens {tokens:?}");
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        });
    }
    while let Some(done) = workers.join_next().await {
        done?.map_err(|e| e.to_string())?;
    }
    let most = most.load(Ordering::SeqCst);
    println!("24 exports by 8 workers; at most {most} at once (limit {LIMIT})");
    if most > LIMIT as usize {
        return Err("more exports ran at once than the semaphore allows".into());
    }

    // A worker takes all 3 permits on a lease it will not renew, then "crashes".
    let crashed = fencelock::connect_from_env_or_memory().await?;
    let all = crashed
        .acquire_permits(
            NAME,
            Permits::new(LIMIT, LIMIT)?,
            AcquireOptions::new().fixed_lease(lease),
        )
        .await?;
    println!(
        "a worker holds all {LIMIT} permits (token {}) and crashes",
        all.token()
    );
    std::mem::forget(all); // never released: only its lease ends it
    let started = tokio::time::Instant::now();
    let permit = locks
        .acquire_permits(NAME, Permits::one_of(LIMIT)?, AcquireOptions::new())
        .await?;
    println!(
        "its permits came back when its lease ended: a permit after {:?} (token {})",
        started.elapsed(),
        permit.token()
    );
    permit.release().await?;
    Ok(())
}
