//! Capability requirements against real servers: a deployment that requires a property
//! refuses to start on a backend that lacks it, and starts on one that has it, whether
//! configured by URL or by config file.

use fencelock::Error;

/// The requirement that was not met, or `"ok"`.
async fn outcome(url: &str) -> String {
    match fencelock::connect(url).await {
        Ok(_) => "ok".into(),
        Err(Error::RequirementNotMet {
            backend,
            requirement,
            reason,
        }) => {
            assert!(reason.contains(backend), "{reason}");
            format!("refused:{backend}:{requirement}")
        }
        Err(other) => panic!("{url}: {other:?}"),
    }
}

#[tokio::test]
async fn memory_meets_the_consensus_requirements() {
    assert_eq!(
        outcome("mem://req?require=linearizable,fencing=strong").await,
        "ok"
    );
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_redis_is_refused_when_linearizability_is_required() {
    let redis = fencelock_testkit::RedisServer::shared().url();
    assert_eq!(
        outcome(&format!("{redis}?require=linearizable")).await,
        "refused:redis:linearizable"
    );
    assert_eq!(
        outcome(&format!("{redis}?require=fencing=strong")).await,
        "refused:redis:fencing=strong"
    );
    assert_eq!(outcome(&format!("{redis}?require=fencing")).await, "ok");
    let err = fencelock::connect(&format!("{redis}?require=linearizable"))
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(message.contains("failover"), "{message}");
    assert!(message.contains("etcd or ZooKeeper"), "{message}");
    // The same from a config file.
    let config = fencelock::Config::from_toml_str(&format!(
        "url = \"{redis}\"\nrequire = [\"linearizable\"]\n"
    ))
    .unwrap();
    assert!(matches!(
        fencelock::connect_config(&config).await,
        Err(Error::RequirementNotMet { .. })
    ));
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_is_accepted_with_every_consensus_requirement() {
    let endpoint = fencelock_testkit::EtcdServer::shared().endpoint();
    let url = format!("etcd://{endpoint}/req?require=linearizable,fencing=strong,fifo");
    assert_eq!(outcome(&url).await, "ok");
    let config = fencelock::Config::from_toml_str(&format!(
        "backend = \"etcd\"\nendpoints = [\"{endpoint}\"]\nprefix = \"req\"\n\
         lease = \"10s\"\nrequire = [\"linearizable\", \"fencing=strong\", \"fifo\"]\n"
    ))
    .unwrap();
    let locks = fencelock::connect_config(&config).await.unwrap();
    assert_eq!(locks.backend(), "etcd");
}

#[cfg(feature = "zookeeper")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_is_accepted_with_the_consensus_requirements() {
    let zk = fencelock_testkit::ZkServer::shared();
    let url = format!(
        "zk://{}/fencelock-req?require=linearizable,fencing=strong",
        zk.connect_string()
    );
    assert_eq!(outcome(&url).await, "ok");
}

/// During the two-leg phases the migration is only as strong as Redis; once only etcd is
/// taken, etcd's guarantees are back.
#[cfg(all(feature = "redis", feature = "etcd"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_meets_linearizability_only_in_the_target_phase() {
    let enc = |s: String| -> String {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    let legacy = enc(fencelock_testkit::RedisServer::shared().url());
    let target = enc(format!(
        "etcd://{}/req",
        fencelock_testkit::EtcdServer::shared().endpoint()
    ));
    for (phase, expected) in [
        ("legacy", "refused:migration:linearizable"),
        ("legacy-first", "refused:migration:linearizable"),
        ("target-first", "refused:migration:linearizable"),
        ("target", "ok"),
    ] {
        let url = format!(
            "migrate://?phase={phase}&legacy={legacy}&target={target}&require=linearizable"
        );
        assert_eq!(outcome(&url).await, expected, "{phase}");
    }
}

/// Elections, semaphores and read-write locks can be required: memory has all three; a
/// migration in a two-leg phase has none of them (refused at connect, not at the first
/// `campaign`), and in a single-leg phase has those of its leg.
#[tokio::test]
async fn elections_semaphores_and_rw_locks_can_be_required() {
    assert_eq!(
        outcome("mem://req?require=election,semaphore,rw-lock").await,
        "ok"
    );
    let legs = "legacy=mem%3A%2F%2Freq-legacy&target=mem%3A%2F%2Freq-target";
    for requirement in ["election", "semaphore", "rw-lock"] {
        for (phase, expected) in [
            ("legacy", "ok".to_owned()),
            ("legacy-first", format!("refused:migration:{requirement}")),
            ("target-first", format!("refused:migration:{requirement}")),
            ("target", "ok".to_owned()),
        ] {
            let url = format!("migrate://?phase={phase}&{legs}&require={requirement}");
            assert_eq!(outcome(&url).await, expected, "{url}");
        }
    }
    // The same from a config file, with `_` for `-`.
    let config = fencelock::Config::from_toml_str(
        "url = \"migrate://?phase=legacy-first&legacy=mem%3A%2F%2Fa&target=mem%3A%2F%2Fb\"\n\
         require = [\"rw_lock\"]\n",
    )
    .unwrap();
    let err = fencelock::connect_config(&config).await.unwrap_err();
    assert!(
        matches!(&err, Error::RequirementNotMet { requirement, .. } if requirement == "rw-lock"),
        "{err:?}"
    );
    assert!(err.to_string().contains("two-leg"), "{err}");
}

/// Redlock has elections but neither semaphores nor read-write locks; a single Redis has
/// all three.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_is_refused_when_semaphores_or_rw_locks_are_required() {
    let servers: Vec<_> = (0..3)
        .map(|_| fencelock_testkit::RedisServer::start())
        .collect();
    let hosts: Vec<String> = servers
        .iter()
        .map(fencelock_testkit::RedisServer::addr)
        .collect();
    let redlock = format!("redlock://{}", hosts.join(","));
    assert_eq!(outcome(&format!("{redlock}?require=election")).await, "ok");
    for requirement in ["semaphore", "rw-lock"] {
        let url = format!("{redlock}?require={requirement}");
        assert_eq!(
            outcome(&url).await,
            format!("refused:redis:{requirement}"),
            "{url}"
        );
        let message = fencelock::connect(&url).await.unwrap_err().to_string();
        assert!(message.contains("Redlock"), "{message}");
    }
    let redis = fencelock_testkit::RedisServer::shared().url();
    assert_eq!(
        outcome(&format!("{redis}?require=election,semaphore,rw-lock")).await,
        "ok"
    );
}
