//! Read-write lock: readers of a price catalog share it, a writer holds it alone, and a
//! writer is never starved by a stream of readers.
//!
//! Four readers keep reading the catalog, one read lock after the other, each with its
//! own client. A writer asks for the write lock while they are at it: it waits for the
//! readers inside to finish, readers that come after it wait behind it (FIFO), and it
//! gets the lock within a few read periods. Its token is larger than every earlier
//! grant's, so a store that checks tokens refuses a deposed writer.
//!
//! ```text
//! cargo run --example rwlock                                  # in-memory (mem://)
//! FENCELOCK_URL=zk://127.0.0.1:2181/locks cargo run --example rwlock --features zookeeper
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, FencedRegister};

const NAME: &str = "examples/catalog";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // FENCELOCK_URL names the backend; with nothing set this demo uses mem://, which
    // locks inside this one process only. A service calls `connect_from_env`, which
    // refuses to guess.
    let locks = fencelock::connect_from_env_or_memory().await?;
    if !locks.capabilities().rw_lock {
        return Err(format!("backend {} has no read-write locks", locks.backend()).into());
    }
    println!("backend: {}", locks.backend());

    let catalog = Arc::new(FencedRegister::new("prices v1".to_owned()));
    let readers_inside = Arc::new(AtomicUsize::new(0));
    let writer_inside = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut readers = tokio::task::JoinSet::new();
    for reader in 0..4 {
        let (catalog, inside, writer_inside, stop) = (
            catalog.clone(),
            readers_inside.clone(),
            writer_inside.clone(),
            stop.clone(),
        );
        readers.spawn(async move {
            let locks = fencelock::connect_from_env_or_memory().await?;
            let mut reads = 0;
            while !stop.load(Ordering::SeqCst) {
                let read = locks.acquire_read(NAME, AcquireOptions::new()).await?;
                inside.fetch_add(1, Ordering::SeqCst);
                if writer_inside.load(Ordering::SeqCst) {
                    return Err("a reader got in while the writer held the lock".into());
                }
                let _ = catalog.read();
                tokio::time::sleep(Duration::from_millis(30)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                read.release().await?;
                reads += 1;
            }
            println!("reader {reader}: {reads} reads");
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        });
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    println!(
        "readers inside now: {}",
        readers_inside.load(Ordering::SeqCst)
    );

    let writer = fencelock::connect_from_env_or_memory().await?;
    let asked = tokio::time::Instant::now();
    let write = writer.acquire_write(NAME, AcquireOptions::new()).await?;
    writer_inside.store(true, Ordering::SeqCst);
    let readers_now = readers_inside.load(Ordering::SeqCst);
    println!(
        "the writer got the lock after {:?} (token {}), with {readers_now} readers inside",
        asked.elapsed(),
        write.token()
    );
    if readers_now != 0 {
        return Err("the writer got in while readers held the lock".into());
    }
    catalog.write(write.token(), "prices v2".to_owned())?;
    writer_inside.store(false, Ordering::SeqCst);
    write.release().await?;

    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    while let Some(done) = readers.join_next().await {
        done?.map_err(|e| e.to_string())?;
    }
    println!("the catalog now says: {:?}", catalog.read());
    Ok(())
}
