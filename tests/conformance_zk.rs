//! The conformance suite on the ZooKeeper backend, reached through
//! `fencelock::connect("zk://...")`, against one real ZooKeeper server per test process
//! (`tickTime=500`, so sessions down to 1 s are allowed). Every run uses its own chroot.
#![cfg(feature = "zookeeper")]

use std::sync::OnceLock;

/// `zk://127.0.0.1:PORT/fencelock-conformance-<random>?min_lease=2s`: the shared server,
/// a chroot unique to this run, and leases down to 2 s (the shortest the suite uses).
fn url() -> String {
    static RUN: OnceLock<u64> = OnceLock::new();
    let run = RUN.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id())
    });
    let server = fencelock_testkit::ZkServer::shared();
    format!(
        "zk://{}/fencelock-conformance-{run:016x}?min_lease=2s",
        server.connect_string()
    )
}

mod zk {
    fencelock_core::conformance_suite!(fencelock::connect(&super::url()).await.unwrap());
}
