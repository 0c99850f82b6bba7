//! fencelock and the real `etcdctl lock` (etcd's own Go `concurrency.Mutex`) exclude each
//! other on the same name.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use fencelock_core::DistributedLockExt;
use fencelock_etcd::{EtcdConfig, EtcdLock};
use fencelock_testkit::EtcdServer;

/// The critical section both sides run: fail if the marker exists, create it, hold it a
/// while, remove it. Any overlap leaves a line in the violations file.
fn critical_section_script(marker: &Path, violations: &Path, log: &Path, who: &str) -> String {
    format!(
        "if [ -e {m} ]; then echo overlap >> {v}; fi; touch {m}; echo {who} >> {l}; sleep 0.05; rm -f {m}",
        m = marker.display(),
        v = violations.display(),
        l = log.display(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcdctl_lock_and_fencelock_exclude_each_other() {
    let server = EtcdServer::shared();
    let dir = tempfile::tempdir().unwrap();
    let (marker, violations, log) = (
        dir.path().join("marker"),
        dir.path().join("violations"),
        dir.path().join("log"),
    );
    let config = EtcdConfig {
        endpoints: vec![server.endpoint()],
        prefix: "interop".into(),
        lease: Duration::from_secs(10),
        ..EtcdConfig::default()
    };
    let locks = EtcdLock::connect(config).await.unwrap();

    // etcdctl locks the prefix `{prefix}/{name}`; its key is `{prefix}/{name}/{lease hex}`.
    let etcdctl = {
        let script = critical_section_script(&marker, &violations, &log, "etcdctl");
        let endpoint = server.endpoint();
        std::thread::spawn(move || {
            for _ in 0..8 {
                let status = Command::new("etcdctl")
                    .env("ETCDCTL_API", "3")
                    .args([
                        "--endpoints",
                        &endpoint,
                        "lock",
                        "interop/shared-job",
                        "--",
                        "sh",
                        "-c",
                        &script,
                    ])
                    .status()
                    .expect("etcdctl runs");
                assert!(status.success(), "etcdctl lock failed: {status}");
            }
        })
    };
    let ours = critical_section_script(&marker, &violations, &log, "fencelock");
    for _ in 0..20 {
        let guard = locks.lock("shared-job").await.unwrap();
        let status = tokio::process::Command::new("sh")
            .args(["-c", &ours])
            .status()
            .await
            .unwrap();
        assert!(status.success());
        guard.release().await.unwrap();
    }
    etcdctl.join().unwrap();

    assert!(
        !violations.exists(),
        "overlapping critical sections: {}",
        std::fs::read_to_string(&violations).unwrap()
    );
    let log = std::fs::read_to_string(&log).unwrap();
    assert_eq!(log.lines().filter(|l| *l == "etcdctl").count(), 8);
    assert_eq!(log.lines().filter(|l| *l == "fencelock").count(), 20);
    let lines: Vec<&str> = log.lines().collect();
    let handovers = lines.windows(2).filter(|w| w[0] != w[1]).count();
    assert!(handovers >= 2, "the two sides never contended: {lines:?}");
}

/// `etcdctl elect` in the background: its stdout lines, as they come.
struct Elect {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Elect {
    /// `etcdctl elect [-l] NAME [VALUE]`.
    fn start(endpoint: &str, args: &[&str]) -> Self {
        use std::io::BufRead;
        let mut child = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", endpoint, "elect"])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("etcdctl runs");
        let stdout = child.stdout.take().unwrap();
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        Elect { child, lines }
    }

    /// Waits up to `within` for a line equal to `expected`.
    fn saw(&self, expected: &str, within: Duration) -> bool {
        let deadline = std::time::Instant::now() + within;
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) if line == expected => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        false
    }

    /// SIGINT: `etcdctl elect` resigns and exits.
    fn interrupt(mut self) {
        let status = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
        let _ = self.child.wait();
    }
}

impl Drop for Elect {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// fencelock's elections use the layout of etcd's Go `concurrency.Election`: a real
/// `etcdctl elect` and a fencelock campaign on the same election exclude each other, each
/// side's observer sees the other's leader and value, and leadership passes both ways on
/// resignation, with a larger token for every term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcdctl_elect_and_fencelock_elections_are_one_election() {
    use fencelock_core::{AcquireOptions, DistributedLock, Error};

    let server = EtcdServer::shared();
    let endpoint = server.endpoint();
    let config = EtcdConfig {
        endpoints: vec![endpoint.clone()],
        prefix: "interop-elect".into(),
        lease: Duration::from_secs(10),
        ..EtcdConfig::default()
    };
    let locks = EtcdLock::connect(config).await.unwrap();
    let election = "primary";
    let theirs = format!("interop-elect/{election}");
    let within = Duration::from_secs(10);

    // etcdctl leads; fencelock sees it, and cannot be elected meanwhile.
    let etcdctl = Elect::start(&endpoint, &[&theirs, "etcdctl-leader"]);
    assert!(etcdctl.saw("etcdctl-leader", within), "etcdctl was elected");
    let seen = locks.leader(election).await.unwrap().expect("a leader");
    assert_eq!(seen.value, "etcdctl-leader");
    let mut changes = locks.observe(election).await.unwrap();
    let first = changes.next().await.unwrap().unwrap().expect("a leader");
    assert_eq!(first, seen);
    let refused = locks
        .campaign(
            election,
            "fencelock-leader",
            AcquireOptions::new().wait_timeout(Duration::from_millis(500)),
        )
        .await;
    assert!(matches!(refused, Err(Error::Timeout { .. })), "{refused:?}");

    // etcdctl resigns; a waiting fencelock campaign is elected, with a larger token.
    let waiting = locks.campaign(
        election,
        "fencelock-leader",
        AcquireOptions::new().wait_timeout(within),
    );
    let resign = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        tokio::task::spawn_blocking(move || etcdctl.interrupt())
            .await
            .unwrap();
    };
    let (term, ()) = tokio::join!(waiting, resign);
    let term = term.expect("elected after etcdctl resigned");
    assert!(term.token() > seen.token);
    let next = tokio::time::timeout(within, async {
        loop {
            if let Some(leader) = changes.next().await.unwrap().unwrap() {
                return leader;
            }
        }
    })
    .await
    .expect("the observer sees the new leader");
    assert_eq!(next.value, "fencelock-leader");
    assert_eq!(next.token, term.token());

    // etcdctl's own observer sees fencelock's leader; a second etcdctl candidate waits
    // until fencelock resigns.
    let listener = Elect::start(&endpoint, &["-l", &theirs]);
    assert!(
        listener.saw("fencelock-leader", within),
        "etcdctl elect -l shows fencelock's leader"
    );
    let candidate = Elect::start(&endpoint, &[&theirs, "etcdctl-again"]);
    assert!(
        !candidate.saw("etcdctl-again", Duration::from_secs(1)),
        "etcdctl is not elected while fencelock leads"
    );
    term.release().await.unwrap();
    assert!(
        candidate.saw("etcdctl-again", within),
        "etcdctl is elected once fencelock resigned"
    );
    assert!(listener.saw("etcdctl-again", within));
    let last = locks.leader(election).await.unwrap().expect("a leader");
    assert_eq!(last.value, "etcdctl-again");
    assert!(last.token > next.token);
    candidate.interrupt();
}
