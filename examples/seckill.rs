//! The flash sale from the incident reports: 100 items, 8 buyers, one lock.
//!
//! Each buyer connects on its own (as separate service instances would), takes the lock
//! for the item, reads the stock, and writes it back decremented, passing its fencing
//! token to the store with both. The store refuses reads and writes with a token lower than one it has seen,
//! which is what protects it from the second half of the story: a holder that pauses past
//! its lease ("zombie") and wakes up to write stale data.
//!
//! ```text
//! cargo run --example seckill                                  # in-memory (mem://)
//! FENCELOCK_URL=etcd://127.0.0.1:2379/locks cargo run --example seckill --features etcd
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use fencelock::{AcquireOptions, Error, FencedRegister};

const STOCK: u32 = 100;
const BUYERS: usize = 8;
const ITEM: &str = "seckill/SKU-8842";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // FENCELOCK_URL names the backend; with nothing set this demo uses mem://, which
    // locks inside this one process only. A service calls `connect_from_env`, which
    // refuses to guess.
    let locks = fencelock::connect_from_env_or_memory().await?;
    println!(
        "backend: {}  ({} buyers, {STOCK} items in stock)",
        locks.backend(),
        BUYERS
    );

    let stock = Arc::new(FencedRegister::new(STOCK));
    let sold = Arc::new(AtomicU32::new(0));
    let mut buyers = tokio::task::JoinSet::new();
    for buyer in 0..BUYERS {
        let (stock, sold) = (stock.clone(), sold.clone());
        buyers.spawn(async move {
            let locks = fencelock::connect_from_env_or_memory().await?;
            let mut mine = 0u32;
            loop {
                let guard = locks
                    .acquire(
                        ITEM,
                        AcquireOptions::new().wait_timeout(Duration::from_secs(30)),
                    )
                    .await?;
                // A fenced read: it records the token, so an older holder that wakes up
                // can no longer write back what it read before.
                let Ok(left) = stock.read_fenced(guard.token()) else {
                    guard.release().await?;
                    continue;
                };
                if left == 0 {
                    guard.release().await?;
                    break;
                }
                // Payment, inventory service, ...: the window where an unlocked sale oversells.
                tokio::time::sleep(Duration::from_micros(200)).await;
                if stock.write(guard.token(), left - 1).is_ok() {
                    sold.fetch_add(1, Ordering::SeqCst);
                    mine += 1;
                }
                guard.release().await?;
            }
            Ok::<_, Error>((buyer, mine))
        });
    }
    let mut per_buyer = Vec::new();
    while let Some(result) = buyers.join_next().await {
        per_buyer.push(result??);
    }
    per_buyer.sort();
    for (buyer, mine) in &per_buyer {
        println!("buyer {buyer}: bought {mine}");
    }
    let sold = sold.load(Ordering::SeqCst);
    let oversold = sold.saturating_sub(STOCK);
    println!(
        "stock left: {}, refused reads and writes: {}",
        stock.read(),
        stock.rejections()
    );
    println!("sold: {sold}");
    println!("oversold: {oversold}");

    let rejected = zombie_demo(&stock).await?;
    println!(
        "zombie write rejected: {}",
        if rejected { "yes" } else { "no" }
    );
    if oversold != 0 || sold != STOCK || !rejected {
        std::process::exit(1);
    }
    Ok(())
}

/// A holder takes the lock with a short fixed lease and pauses past it; meanwhile another
/// holder takes over and restocks. The paused holder wakes up and writes with its old
/// token: the store refuses it.
async fn zombie_demo(stock: &FencedRegister<u32>) -> Result<bool, Error> {
    println!();
    let locks = fencelock::connect_from_env_or_memory().await?;
    let lease = locks
        .capabilities()
        .min_lease
        .max(Duration::from_millis(500));
    let zombie = locks
        .acquire(ITEM, AcquireOptions::new().fixed_lease(lease))
        .await?;
    let seen = stock
        .read_fenced(zombie.token())
        .expect("no newer holder has read yet");
    println!(
        "zombie: holds token {} with a {lease:?} lease, reads stock {seen}, plans to restock to {}, then pauses",
        zombie.token(),
        seen + 100
    );

    // Stands in for an 8 s GC pause: the zombie does nothing while its lease runs out.
    let other = fencelock::connect_from_env_or_memory().await?;
    let restock = other
        .acquire(ITEM, AcquireOptions::new().wait_timeout(lease * 10))
        .await?;
    stock
        .write(restock.token(), 50)
        .expect("the new holder's token is the newest");
    println!(
        "new holder: took token {} after the lease ran out, restocked to 50",
        restock.token()
    );
    restock.release().await?;

    println!(
        "zombie: wakes up, guard reports lost: {}",
        if zombie.is_lost() { "yes" } else { "no" }
    );
    let write = stock.write(zombie.token(), seen + 100);
    if let Err(stale) = &write {
        println!("zombie: write refused: {stale}");
    }
    let _ = zombie.release().await;
    println!("stock after the zombie's attempt: {}", stock.read());
    Ok(write.is_err())
}
