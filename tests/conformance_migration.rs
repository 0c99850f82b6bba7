//! The conformance suite on the migration layer from Redis to etcd, in each of its four
//! phases, reached through `fencelock::connect("migrate://...")` against real servers.
//! The legacy leg uses the raw key layout (`lock:` + name), the one that excludes
//! hand-written `SET key value NX PX` locks.
#![cfg(all(feature = "redis", feature = "etcd"))]

use fencelock_testkit::{EtcdServer, RedisServer};

fn url(phase: fencelock::MigrationPhase) -> String {
    let legacy = format!("{}?layout=raw&prefix=lock:", RedisServer::shared().url());
    let target = format!(
        "etcd://{}/fencelock-migration",
        EtcdServer::shared().endpoint()
    );
    fencelock::migration_url(phase, &legacy, &target)
}

mod legacy {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::url(fencelock::MigrationPhase::Legacy))
            .await
            .expect("connect migrate://?phase=legacy")
    );
}

mod legacy_first {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::url(fencelock::MigrationPhase::LegacyFirst))
            .await
            .expect("connect migrate://?phase=legacy-first")
    );
}

mod target_first {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::url(fencelock::MigrationPhase::TargetFirst))
            .await
            .expect("connect migrate://?phase=target-first")
    );
}

mod target {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::url(fencelock::MigrationPhase::Target))
            .await
            .expect("connect migrate://?phase=target")
    );
}
