//! Leader election: three instances of a scheduler, one leads at a time.
//!
//! Each instance connects on its own (as separate processes would) and campaigns with its
//! address. The first leader is then "killed" the way a GC pause or a frozen VM kills
//! one: it stops renewing, its lease runs out, and another instance takes over with a
//! larger token. When the old leader wakes up and writes with its old token, the store
//! refuses the write. An observer prints every change of leader, pushed by the backend.
//!
//! ```text
//! cargo run --example leader                                  # in-memory (mem://)
//! FENCELOCK_URL=etcd://127.0.0.1:2379/locks cargo run --example leader --features etcd
//! ```

use std::sync::Arc;
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, FencedRegister};

const ELECTION: &str = "examples/scheduler-leader";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // FENCELOCK_URL names the backend; with nothing set this demo uses mem://, which
    // locks inside this one process only. A service calls `connect_from_env`, which
    // refuses to guess.
    let locks = fencelock::connect_from_env_or_memory().await?;
    if !locks.capabilities().election {
        return Err(format!("backend {} has no leader election", locks.backend()).into());
    }
    // The shortest lease the backend takes, but no less than 2 s: how long a dead
    // leader keeps the others waiting.
    let lease = locks.capabilities().min_lease.max(Duration::from_secs(2));
    println!("backend: {}  (lease {lease:?})", locks.backend());

    // The store the leader writes its schedule to; it refuses stale terms' tokens.
    let schedule = Arc::new(FencedRegister::new(String::new()));

    let mut changes = locks.observe(ELECTION).await?;
    let observer = tokio::spawn(async move {
        while let Some(change) = changes.next().await {
            match change {
                Ok(Some(leader)) => println!(
                    "observer: {} leads (term token {})",
                    leader.value, leader.token
                ),
                Ok(None) => println!("observer: nobody leads"),
                Err(error) => {
                    println!("observer: stopped: {error}");
                    return;
                }
            }
        }
    });

    // Instance 1 is elected on a lease it will not renew: it is about to "die".
    let first = fencelock::connect_from_env_or_memory().await?;
    let term = first
        .campaign(
            ELECTION,
            "10.0.0.1:8080",
            AcquireOptions::new().fixed_lease(lease),
        )
        .await?;
    schedule.write(term.token(), "plan from 10.0.0.1".to_owned())?;
    println!("10.0.0.1:8080 leads, token {}", term.token());

    // Instances 2 and 3 campaign and wait.
    let mut others = tokio::task::JoinSet::new();
    for address in ["10.0.0.2:8080", "10.0.0.3:8080"] {
        let schedule = schedule.clone();
        others.spawn(async move {
            let locks = fencelock::connect_from_env_or_memory().await?;
            let term = locks
                .campaign(ELECTION, address, AcquireOptions::new())
                .await?;
            println!("{address} leads, token {}", term.token());
            schedule.write(term.token(), format!("plan from {address}"))?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            term.release().await?; // resign: the last instance takes over
            println!("{address} resigned");
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        });
    }

    // Instance 1 freezes past its lease...
    tokio::time::sleep(lease + Duration::from_millis(500)).await;
    // ...and wakes up still believing it leads. Its term says otherwise, and the store
    // refuses what it writes with its old token.
    println!(
        "10.0.0.1:8080 wakes up; its term is {}",
        if term.is_lost() {
            "lost"
        } else {
            "still valid"
        }
    );
    match schedule.write(term.token(), "stale plan from 10.0.0.1".to_owned()) {
        Ok(()) => return Err("the deposed leader's write was accepted".into()),
        Err(stale) => println!("the deposed leader's write is refused: {stale}"),
    }

    while let Some(done) = others.join_next().await {
        done?.map_err(|e| e.to_string())?;
    }
    println!("the schedule now says: {:?}", schedule.read());
    // Let the observer print the last change, then stop it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    observer.abort();
    Ok(())
}
