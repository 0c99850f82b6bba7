//! Lock metrics in Prometheus text format, served on a local port.
//!
//! ```text
//! cargo run --example metrics --features metrics            # port 9898
//! cargo run --example metrics --features metrics -- 0       # any free port
//! curl -s http://127.0.0.1:9898/metrics | grep fencelock_
//! ```
//!
//! The backend comes from `FENCELOCK_URL` (`mem://` when unset, through
//! `connect_from_env_or_memory`). A small workload runs forever: workers take
//! `reports/nightly` in turn, some give up after a short wait, and now and then a fixed
//! lease runs out under a holder, so every metric moves. The
//! recorder is `metrics-exporter-prometheus` without its HTTP features; this file serves
//! the rendered text itself from a plain thread.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, Error, Metrics, MetricsOptions};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The lock name the workload contends on.
const NAME: &str = "reports/nightly";

/// Answers every HTTP request on `listener` with the current metrics.
fn serve(listener: TcpListener, handle: PrometheusHandle) {
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let _ = answer(stream, &handle);
        }
    });
}

fn answer(mut stream: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let body = handle.render();
    write!(
        stream,
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// One round of the workload on `locks`.
async fn round(locks: &Arc<dyn DistributedLock>, i: u64) -> Result<(), Error> {
    let wait = AcquireOptions::new().wait_timeout(Duration::from_millis(30));
    match locks.acquire(NAME, wait).await {
        Ok(guard) => {
            tokio::time::sleep(Duration::from_millis(5 + i % 20)).await;
            guard.release().await?;
        }
        Err(Error::Timeout { .. }) => {}
        Err(e) => return Err(e),
    }
    if i % 25 == 0 {
        // A holder that outlives its fixed lease: counted in fencelock_lock_lost_total.
        let fixed = AcquireOptions::new().fixed_lease(Duration::from_secs(2));
        let guard = locks.acquire("reports/slow", fixed).await?;
        guard.lost().await;
        let _ = guard.release().await;
    }
    Ok(())
}

/// Starts `workers` tasks running rounds until the process ends.
fn spawn_workload(locks: &Arc<dyn DistributedLock>, workers: u64) {
    for w in 0..workers {
        let locks = locks.clone();
        tokio::spawn(async move {
            let mut i = w;
            loop {
                if let Err(e) = round(&locks, i).await {
                    eprintln!("workload: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                i += workers;
            }
        });
    }
}

/// Binds the metrics port and starts serving; returns the bound address.
fn start_exporter(port: u16, handle: PrometheusHandle) -> std::io::Result<std::net::SocketAddr> {
    let listener = TcpListener::bind(("127.0.0.1", port))?;
    let addr = listener.local_addr()?;
    serve(listener, handle);
    Ok(addr)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port = match std::env::args().nth(1) {
        Some(port) => port.parse()?,
        None => 9898,
    };
    let handle = PrometheusBuilder::new().install_recorder()?;
    let addr = start_exporter(port, handle)?;
    println!("serving metrics on http://{addr}/metrics");
    // The example's two lock names are fixed, so the name label is safe here.
    // FENCELOCK_URL names the backend; with nothing set this demo uses mem://, which
    // locks inside this one process only. A service calls `connect_from_env`, which
    // refuses to guess.
    let locks: Arc<dyn DistributedLock> = Arc::new(Metrics::new(
        fencelock::connect_from_env_or_memory().await?,
        MetricsOptions::new().with_name_label(),
    ));
    spawn_workload(&locks, 3);
    // Runs until interrupted.
    std::future::pending::<()>().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(addr: std::net::SocketAddr) -> String {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: localhost\r\n\r\n")
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        response
    }

    /// The value of the first sample of `metric` whose labels contain `labels`.
    fn value(text: &str, metric: &str, labels: &str) -> f64 {
        text.lines()
            .filter(|l| l.starts_with(metric) && l.contains(labels))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse().ok())
            .next()
            .unwrap_or(0.0)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scraped_numbers_move() {
        let handle = PrometheusBuilder::new().install_recorder().unwrap();
        let addr = start_exporter(0, handle).unwrap();
        let locks: Arc<dyn DistributedLock> = Arc::new(Metrics::new(
            fencelock::connect("mem://metrics-example").await.unwrap(),
            MetricsOptions::new().with_name_label(),
        ));
        let labels = r#"backend="mem",name="reports/nightly""#;
        let acquired = r#"backend="mem",name="reports/nightly",result="acquired""#;
        let timed_out = r#"backend="mem",name="reports/nightly",result="timeout""#;
        for i in 1..10 {
            round(&locks, i).await.unwrap();
        }
        let first = tokio::task::spawn_blocking(move || scrape(addr))
            .await
            .unwrap();
        let acquired_before = value(&first, "fencelock_lock_acquires_total", acquired);
        assert_eq!(acquired_before, 9.0, "{first}");
        assert!(
            first.contains("# HELP fencelock_lock_acquires_total"),
            "described: {first}"
        );
        assert!(first.contains("fencelock_lock_wait_seconds"), "{first}");
        assert!(first.contains("fencelock_lock_hold_seconds"), "{first}");

        // A held lock makes a waiter time out; a fixed lease running out is a loss.
        let held = locks.acquire(NAME, AcquireOptions::new()).await.unwrap();
        assert_eq!(round(&locks, 25).await.ok(), Some(()));
        let during = tokio::task::spawn_blocking(move || scrape(addr))
            .await
            .unwrap();
        held.release().await.unwrap();
        assert_eq!(
            value(&during, "fencelock_locks_held", labels),
            1.0,
            "{during}"
        );
        assert_eq!(
            value(&during, "fencelock_lock_acquires_total", timed_out),
            1.0
        );
        let slow = r#"name="reports/slow""#;
        assert_eq!(
            value(&during, "fencelock_lock_lost_total", slow),
            1.0,
            "{during}"
        );

        round(&locks, 1).await.unwrap();
        let last = tokio::task::spawn_blocking(move || scrape(addr))
            .await
            .unwrap();
        assert!(value(&last, "fencelock_lock_acquires_total", acquired) > acquired_before);
        assert_eq!(value(&last, "fencelock_locks_held", labels), 0.0, "{last}");
    }
}
