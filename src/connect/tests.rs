use super::*;

fn kind(result: Result<Arc<dyn DistributedLock>, Error>) -> String {
    match result {
        Ok(lock) => format!("ok:{}", lock.backend()),
        Err(Error::UnknownScheme { .. }) => "unknown-scheme".into(),
        Err(Error::BackendNotCompiled { feature, .. }) => format!("needs-feature:{feature}"),
        Err(Error::InvalidUrl { .. }) => "invalid-url".into(),
        Err(Error::InvalidConfig(_)) => "invalid-config".into(),
        Err(Error::RequirementNotMet { requirement, .. }) => format!("not-met:{requirement}"),
        Err(e) => format!("other:{e}"),
    }
}

#[tokio::test]
async fn url_table() {
    let cases = [
        ("mem://", "ok:mem"),
        ("mem://team-a", "ok:mem"),
        ("MEM://", "ok:mem"),
        ("mem://team-a/extra", "invalid-url"),
        ("mem://?lease=3s", "invalid-url"),
        ("mem://user:pw@x", "invalid-url"),
        ("etcd://127.0.0.1:2379/locks", "needs-feature:etcd"),
        ("etcds://127.0.0.1:2379/locks", "needs-feature:etcd-tls"),
        ("zk://127.0.0.1:2181/locks", "needs-feature:zookeeper"),
        ("zookeeper://127.0.0.1:2181", "needs-feature:zookeeper"),
        ("zks://127.0.0.1:2281/locks", "needs-feature:zookeeper-tls"),
        ("redis://127.0.0.1", "needs-feature:redis"),
        ("redis+cluster://a:1,b:2", "needs-feature:redis"),
        ("redlock://a:1,b:2,c:3", "needs-feature:redis"),
        ("rediss://h:1", "needs-feature:redis-tls"),
        ("rediss+cluster://a:1,b:2", "needs-feature:redis-tls"),
        ("rediss+sentinel://a:1/m", "needs-feature:redis-tls"),
        ("redlocks://a:1,b:2,c:3", "needs-feature:redis-tls"),
        ("consul://127.0.0.1:8500", "unknown-scheme"),
        ("mem://?require=linearizable,fencing=strong,fifo", "ok:mem"),
        ("mem://?require=fast", "invalid-config"),
        ("mem://?retry=2", "ok:mem"),
        ("migrate://?phase=target&target=mem://t", "ok:migration"),
        (
            "migrate://?phase=legacy-first&legacy=mem://a&target=mem://b&require=linearizable",
            "ok:migration",
        ),
        ("migrate://?phase=legacy&target=mem://", "invalid-url"),
        (
            "migrate://?phase=target&target=etcd%3A%2F%2Fh%3A1%2Fp",
            "needs-feature:etcd",
        ),
        (
            "migrate://?phase=legacy&legacy=redis%3A%2F%2Fh%3A1",
            "needs-feature:redis",
        ),
        ("127.0.0.1:2379", "invalid-url"),
        ("", "invalid-url"),
    ];
    let compiled = |feature: &str| {
        (feature == "etcd" && cfg!(feature = "etcd"))
            || (feature == "etcd-tls" && cfg!(feature = "etcd-tls"))
            || (feature == "zookeeper" && cfg!(feature = "zookeeper"))
            || (feature == "zookeeper-tls" && cfg!(feature = "zookeeper-tls"))
            || (feature == "redis" && cfg!(feature = "redis"))
            || (feature == "redis-tls" && cfg!(feature = "redis-tls"))
    };
    for (url, expected) in cases {
        // Backends that are compiled in are tested against real servers in their own
        // URL tables; here only the "feature is off" answer is checked.
        if expected
            .strip_prefix("needs-feature:")
            .is_some_and(compiled)
        {
            continue;
        }
        assert_eq!(kind(connect(url).await), expected, "{url}");
    }
}

/// The Redis TLS schemes reach the Redis backend: a missing CA file is its
/// configuration error, found before any I/O.
#[cfg(feature = "redis-tls")]
#[tokio::test]
async fn redis_tls_schemes_reach_the_redis_backend() {
    for url in [
        "rediss://127.0.0.1:1?ca=/no/such/ca.pem",
        "rediss+sentinel://127.0.0.1:1/m?ca=/no/such/ca.pem",
        "rediss+cluster://127.0.0.1:1,127.0.0.1:2?ca=/no/such/ca.pem",
        "redlocks://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?ca=/no/such/ca.pem",
    ] {
        let err = connect(url).await.unwrap_err();
        let expected = "cannot read TLS file /no/such/ca.pem";
        assert!(
            matches!(&err, Error::InvalidConfig(m) if m.contains(expected)),
            "{url}: {err:?}"
        );
    }
}

/// Every scheme [`SUPPORTED_SCHEMES`] lists reaches its backend in this build: none
/// is refused as unknown or as needing a feature (a TLS scheme is listed only with
/// its TLS feature).
#[tokio::test]
async fn every_supported_scheme_is_compiled_in() {
    for scheme in SUPPORTED_SCHEMES {
        // Port 1 on loopback refuses at once: what matters is who answers.
        let url = match *scheme {
            "mem" => "mem://".to_owned(),
            "migrate" => "migrate://?phase=target&target=mem://".to_owned(),
            "redlock" | "redlocks" => {
                format!("{scheme}://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?connect_timeout=100ms")
            }
            "redis+sentinel" | "rediss+sentinel" => {
                format!("{scheme}://127.0.0.1:1/m?connect_timeout=100ms")
            }
            "zk" | "zookeeper" | "zks" => {
                format!("{scheme}://127.0.0.1:1?connect_timeout=100ms")
            }
            _ => format!("{scheme}://127.0.0.1:1?connect_timeout=100ms"),
        };
        let answer = kind(connect(&url).await);
        assert!(
            !answer.starts_with("needs-feature") && answer != "unknown-scheme",
            "{url}: {answer}"
        );
    }
}

#[tokio::test]
async fn facade_options_add_layers() {
    let plain = connect("mem://layers").await.unwrap();
    assert!(!format!("{plain:?}").starts_with("Retry"));
    let retried = connect("mem://layers?retry=2").await.unwrap();
    assert!(format!("{retried:?}").starts_with("Retry"), "{retried:?}");
    let metrics = connect("mem://layers?metrics=true").await;
    assert_eq!(metrics.is_ok(), cfg!(feature = "metrics"), "{metrics:?}");

    // max_waiters: the second waiting acquire of one client is refused at once.
    let limited = connect("mem://layers?max_waiters=1&retry=1").await.unwrap();
    assert!(
        format!("{limited:?}").starts_with("WaiterLimit"),
        "{limited:?}"
    );
    let held = limited
        .acquire("hot", fencelock_core::AcquireOptions::new())
        .await
        .unwrap();
    let waiting = limited.acquire("hot", fencelock_core::AcquireOptions::new());
    tokio::pin!(waiting);
    let still = tokio::time::timeout(std::time::Duration::from_millis(20), &mut waiting).await;
    assert!(still.is_err());
    let refused = limited
        .acquire("hot", fencelock_core::AcquireOptions::new())
        .await;
    assert!(
        matches!(refused, Err(Error::TooManyWaiters { limit: 1, .. })),
        "{refused:?}"
    );
    held.release().await.unwrap();
    waiting.await.unwrap().release().await.unwrap();
    for bad in ["mem://?max_waiters=0", "mem://?max_waiters=many"] {
        assert!(
            matches!(Config::from_url(bad), Err(Error::InvalidUrl { .. })),
            "{bad}"
        );
    }
    let config = Config::from_url("mem://x?max_waiters=7").unwrap();
    assert_eq!(config.waiter_limit(), Some(7));
    assert_eq!(config.to_string(), "mem://x?max_waiters=7");
    let file = Config::from_toml_str("backend = \"mem\"\nmax_waiters = 7").unwrap();
    assert_eq!(file.waiter_limit(), Some(7));
}

#[tokio::test]
async fn invalid_url_errors_hide_passwords() {
    for url in [
        "mem://admin:hunter2@x",
        // No scheme before the first `://`: not quoted back as one.
        "admin:hunter2@h/x?legacy=redis://y",
        "redis+sentinel://s1:26379/m?sentinel%5Fpassword=hunter2&bogus=1",
    ] {
        let err = connect(url).await.unwrap_err();
        let (shown, debug) = (err.to_string(), format!("{err:?}"));
        assert!(
            !shown.contains("hunter2") && !debug.contains("hunter2"),
            "{shown} / {debug}"
        );
    }
}

#[tokio::test]
async fn unknown_scheme_lists_what_this_build_supports() {
    let err = connect("consul://x").await.unwrap_err();
    assert!(err.to_string().contains("supports: mem"), "{err}");
}

fn env(vars: &[(&str, &str)]) -> Env {
    vars.iter()
        .map(|(n, v)| ((*n).into(), (*v).into()))
        .collect()
}

fn message(result: Result<EnvBackend, Error>) -> String {
    match result {
        Err(Error::InvalidConfig(message)) => message,
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

/// Nothing set is an error naming what was read, never a silent `mem://`; memory
/// only when written out, or asked for by name.
#[test]
fn from_env_refuses_to_guess() {
    let refused = message(from_env(&env(&[("HOME", "/root")]), Unset::Refuse));
    assert!(
        refused.contains("FENCELOCK_URL") && refused.contains("FENCELOCK_CONFIG"),
        "{refused}"
    );
    assert!(!refused.contains("misspelled"), "{refused}");
    // Empty counts as unset.
    let empty = env(&[("FENCELOCK_URL", ""), ("FENCELOCK_CONFIG", "")]);
    message(from_env(&empty, Unset::Refuse));
    assert_eq!(
        from_env(&empty, Unset::Memory).unwrap(),
        EnvBackend::Url("mem://".into())
    );
    let written = env(&[("FENCELOCK_URL", " mem:// ")]);
    for unset in [Unset::Refuse, Unset::Memory] {
        assert_eq!(
            from_env(&written, unset).unwrap(),
            EnvBackend::Url("mem://".into())
        );
    }
    // The URL first, then the file.
    let both = env(&[
        ("FENCELOCK_CONFIG", "f.toml"),
        ("FENCELOCK_URL", "etcd://h/p"),
    ]);
    assert_eq!(
        from_env(&both, Unset::Refuse).unwrap(),
        EnvBackend::Url("etcd://h/p".into())
    );
    let file = env(&[("FENCELOCK_CONFIG", "f.toml")]);
    assert_eq!(
        from_env(&file, Unset::Refuse).unwrap(),
        EnvBackend::File("f.toml".into())
    );
}

/// A misspelled variable is named in the error, and the variables `fencelock run`
/// sets for its command are not.
#[test]
fn from_env_names_misspelled_variables() {
    let vars = env(&[
        ("FENCELOCK_ULR", "etcd://h/p"),
        ("fencelock_config", "f.toml"),
        ("FENCE_LOCK_URL", "x"),
        ("FENCELOCK_URLS", "x"),
        ("FENCELOCK_TOKEN", "17"),
        ("FENCELOCK_KEY", "k"),
        ("FENCELOCK_NAME", "n"),
        ("PATH", "/bin"),
    ]);
    let refused = message(from_env(&vars, Unset::Refuse));
    for near in [
        "FENCELOCK_ULR",
        "fencelock_config",
        "FENCE_LOCK_URL",
        "FENCELOCK_URLS",
    ] {
        assert!(refused.contains(near), "{near}: {refused}");
    }
    for far in ["FENCELOCK_TOKEN", "FENCELOCK_KEY", "FENCELOCK_NAME", "PATH"] {
        assert!(!refused.contains(far), "{far}: {refused}");
    }
    // The memory default still ignores them: it is the caller's explicit choice.
    assert_eq!(
        from_env(&vars, Unset::Memory).unwrap(),
        EnvBackend::Url("mem://".into())
    );
}

#[test]
fn edit_distances() {
    assert_eq!(edit_distance("FENCELOCK_ULR", "FENCELOCK_URL"), 2);
    assert_eq!(edit_distance("", "abc"), 3);
    assert_eq!(edit_distance("abc", "abc"), 0);
    assert!(!looks_like_ours(&"X".repeat(10_000)));
}

#[tokio::test]
async fn env_backends_connect() {
    let memory = connect_to(from_env(&env(&[]), Unset::Memory).unwrap()).await;
    assert_eq!(kind(memory), "ok:mem");
    let missing = connect_to(EnvBackend::File("/no/such/fencelock.toml".into())).await;
    assert_eq!(kind(missing), "invalid-config");
}

#[tokio::test]
async fn mem_urls_share_locks_per_namespace() {
    use fencelock_core::DistributedLockExt;
    let a = connect("mem://connect-tests").await.unwrap();
    let b = connect("mem://connect-tests").await.unwrap();
    let other = connect("mem://connect-tests-other").await.unwrap();
    let guard = a.lock("x").await.unwrap();
    assert!(b.try_lock("x").await.unwrap().is_none());
    assert!(other.try_lock("x").await.unwrap().is_some());
    guard.release().await.unwrap();
}
