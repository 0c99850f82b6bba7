//! The conformance suite on etcd, through `fencelock::connect("etcd://...")`, against a real
//! etcd server started by the test harness.
#![cfg(feature = "etcd")]

use fencelock_testkit::EtcdServer;

fn url() -> String {
    format!(
        "etcd://{}/fencelock-conformance",
        EtcdServer::shared().endpoint()
    )
}

mod etcd {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::url())
            .await
            .expect("connect etcd")
    );
}
