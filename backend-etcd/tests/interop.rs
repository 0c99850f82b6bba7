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
