//! The conformance suite on the migration layer from Redis to etcd, in each of its four
//! phases, reached through `fencelock::connect("migrate://...")` against real servers.
//! The legacy leg uses the raw key layout (`lock:` + name), the one that excludes
//! hand-written `SET key value NX PX` locks.
#![cfg(all(feature = "redis", feature = "etcd"))]

use fencelock_testkit::{EtcdServer, RedisServer};

fn enc(url: &str) -> String {
    url.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn url(phase: &str) -> String {
    let legacy = format!("{}?layout=raw&prefix=lock:", RedisServer::shared().url());
    let target = format!(
        "etcd://{}/fencelock-migration",
        EtcdServer::shared().endpoint()
    );
    format!(
        "migrate://?phase={phase}&legacy={}&target={}",
        enc(&legacy),
        enc(&target)
    )
}

mod legacy {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::url("legacy"))
            .await
            .expect("connect migrate://?phase=legacy")
    );
}

mod legacy_first {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::url("legacy-first"))
            .await
            .expect("connect migrate://?phase=legacy-first")
    );
}

mod target_first {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::url("target-first"))
            .await
            .expect("connect migrate://?phase=target-first")
    );
}

mod target {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::url("target"))
            .await
            .expect("connect migrate://?phase=target")
    );
}
