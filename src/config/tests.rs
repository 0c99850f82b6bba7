use super::*;
use fencelock_core::FencingStrength;

/// A facade option given twice is refused, not resolved by the last one; `require`
/// may repeat (its lists add up).
#[test]
fn a_facade_option_given_twice_is_refused() {
    for url in [
        "mem://?retry=1&retry=5",
        "mem://?max_waiters=10&max_waiters=1",
        "mem://?metrics=false&metrics=true",
        "migrate://?phase=target&target=mem://&phase=legacy",
        "migrate://?phase=target&target=mem://a&target=mem://b",
    ] {
        let err = Config::from_url(url).unwrap_err();
        assert!(err.to_string().contains("twice"), "{url}: {err}");
    }
    Config::from_url("mem://?require=fifo&require=fencing").unwrap();
}

/// A zero minimum retry delay makes every backoff delay zero, so a backend that
/// fails fast is retried in a busy loop: refused, by URL and by config file.
#[test]
fn a_zero_minimum_retry_delay_is_refused() {
    for url in [
        "mem://?retry=5&retry_min_delay=0",
        "mem://?retry_min_delay=0ms",
        "mem://?retry=3&retry_min_delay=0s&retry_max_delay=1s",
    ] {
        let err = Config::from_url(url).unwrap_err();
        assert!(err.to_string().contains("retry_min_delay"), "{url}: {err}");
    }
    let err =
        Config::from_toml_str("url = \"mem://\"\nretry = { retries = 5, min_delay = \"0s\" }\n")
            .unwrap_err();
    assert!(err.to_string().contains("retry_min_delay"), "{err}");
    Config::from_url("mem://?retry=5&retry_min_delay=1ms").unwrap();
}

/// A URL nesting URLs in its query values without end, as an error's URL or as a
/// valid URL's value, is parsed and shown on a small stack (no abort).
#[test]
fn deeply_nested_urls_are_refused_or_shown_without_overflowing() {
    let nested = "l=mem://?".repeat(100_000);
    std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(move || {
            let err = Config::from_url(&format!("mem://?{nested}x")).unwrap_err();
            assert!(matches!(err, Error::InvalidUrl { .. }), "{err:?}");
            let _ = format!("{err} {err:?}");
            if let Ok(config) = Config::from_url(&format!("redis://h?prefix=mem://?{nested}")) {
                let _ = format!("{config} {config:?}");
            }
        })
        .unwrap()
        .join()
        .expect("a deeply nested URL overflowed the stack");
}

#[test]
fn display_round_trips() {
    for url in [
        "mem://",
        "mem://ns?require=fifo&retry=2",
        "mem://?retry=3&retry_min_delay=50ms&retry_max_delay=1m%2030s&metrics=false",
        "etcd://h:1,h2:2/p/q?lease=10s&cleanup_timeout=2s&require=linearizable&retry=1",
        "zk://h:1/chroot?session_timeout=4s&acl=open&retry_max_delay=3s",
        "redis+sentinel://s1:1,s2:2/master?db=2&prefix=x:&retry=0",
        "redlock://a:1,b:2,c:3?prefix=a+b&timeout=250ms",
    ] {
        let config: Config = url.parse().unwrap_or_else(|e| panic!("{url}: {e}"));
        let shown = config.to_string();
        let again = Config::from_url(&shown).unwrap_or_else(|e| panic!("{shown}: {e}"));
        assert_eq!(again, config, "{url} -> {shown}");
    }
    let c = Config::from_url("mem://?retry_min_delay=50ms").unwrap();
    assert!(c.to_string().contains("retry_min_delay=50ms"), "{c}");
}

#[test]
fn deserializes_from_a_url_or_a_table() {
    #[derive(serde::Deserialize)]
    struct App {
        locks: Config,
    }
    let from_url: App = toml::from_str("locks = \"zk://h:1/x?session_timeout=5s\"").unwrap();
    let from_table: App = toml::from_str(
        "[locks]\nbackend = \"zookeeper\"\nendpoints = [\"h:1\"]\nprefix = \"/x\"\nlease = \"5s\"\n",
    )
    .unwrap();
    assert_eq!(from_url.locks, from_table.locks);
    let bad = toml::from_str::<App>("[locks]\nbackend = \"etcd\"\nendpoint = \"h\"\n");
    assert!(bad.is_err());
    // fencelock's own message never shows the password (toml's rendering of the
    // error quotes the application's document, which is the application's). The
    // Redis URL is checked only in a build with the Redis backend.
    #[cfg(feature = "redis")]
    {
        let err = toml::from_str::<App>("locks = \"redis://:hunter2@h:1:2\"")
            .err()
            .unwrap();
        assert!(!err.message().contains("hunter2"), "{}", err.message());
        assert!(err.message().contains("redis://:***@"), "{}", err.message());
    }
}

#[test]
fn require_is_taken_out_of_the_query_for_any_scheme() {
    let c = Config::from_url("redis://h:1?prefix=x&require=linearizable,fencing%3Dstrong").unwrap();
    assert_eq!(c.backend_url(), "redis://h:1?prefix=x");
    assert_eq!(
        c.requirements(),
        [
            Requirement::Linearizable,
            Requirement::Fencing(FencingStrength::Strong)
        ]
    );
    assert_eq!(
        c.to_string(),
        "redis://h:1?prefix=x&require=linearizable,fencing=strong"
    );
    let c = Config::from_url("mem://?require=fifo&require=fencing=strong").unwrap();
    assert_eq!(c.backend_url(), "mem://");
    assert_eq!(c.requirements().len(), 2);
    assert_eq!(c.scheme(), "mem");
    let c = Config::from_url("etcd://h/p?retry=5&retry_min_delay=50ms&metrics=true").unwrap();
    assert_eq!(c.backend_url(), "etcd://h/p");
    assert_eq!(c.retry_policy().map(RetryPolicy::retries), Some(5));
    assert!(c.has_metrics());
    assert_eq!(
        c.to_string(),
        "etcd://h/p?retry=5&retry_min_delay=50ms&metrics=true"
    );
}

#[test]
fn bad_input_is_a_typed_error() {
    for (url, invalid_url) in [
        ("localhost:2379", true),
        ("://x", true),
        ("mem://?require=fast", false),
        ("mem://?require=%FF", true),
        ("mem://?retry=many", true),
        ("mem://?retry=2&retry_max_delay=soon", true),
        ("mem://?metrics=maybe", true),
    ] {
        match Config::from_url(url) {
            Err(Error::InvalidUrl { .. }) => assert!(invalid_url, "{url}"),
            Err(Error::InvalidConfig(_)) => assert!(!invalid_url, "{url}"),
            other => panic!("{url}: {other:?}"),
        }
    }
}

#[test]
fn secrets_never_show() {
    let c = Config::from_url("redis://:hunter2@h:1?require=fifo").unwrap();
    for shown in [c.to_string(), format!("{c:?}")] {
        assert!(!shown.contains("hunter2"), "{shown}");
    }
    let err = Config::from_url("redis://:hunter2@h:1?require=nope").unwrap_err();
    assert!(!format!("{err} {err:?}").contains("hunter2"));
    // A secret option's name percent-encoded, as the backends read it.
    let c = Config::from_url("redis+sentinel://s1:26379/m?sentinel%5Fpassword=hunter2").unwrap();
    for shown in [c.to_string(), format!("{c:?}")] {
        assert!(!shown.contains("hunter2"), "{shown}");
    }
    // A password of digits with a raw `?name=` in it.
    let c = Config::from_url("redis://u:123?a=b@h").map(|c| c.to_string());
    assert!(!format!("{c:?}").contains("123?a=b"), "{c:?}");
    // No scheme before the first `://`.
    let err = Config::from_url("admin:hunter2@h/x?legacy=redis://y").unwrap_err();
    assert!(!format!("{err} {err:?}").contains("hunter2"), "{err}");
}
