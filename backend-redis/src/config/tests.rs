//! The configuration from URLs (the URL table, options, typed errors) and by hand.

use super::*;
use crate::topology::Endpoint;

fn ep(host: &str, port: u16) -> Endpoint {
    Endpoint {
        host: host.into(),
        port,
    }
}

#[test]
fn url_table() {
    let cases: Vec<(&str, Topology)> = vec![
        (
            "redis://127.0.0.1:6390",
            Topology::Single {
                endpoint: ep("127.0.0.1", 6390),
                tls: false,
                db: 0,
            },
        ),
        (
            "redis://h/3",
            Topology::Single {
                endpoint: ep("h", 6379),
                tls: false,
                db: 3,
            },
        ),
        (
            "rediss://u:p@h:1",
            Topology::Single {
                endpoint: ep("h", 1),
                tls: true,
                db: 0,
            },
        ),
        (
            "redis+sentinel://a:1,b:2/mymaster?db=2",
            Topology::Sentinel {
                sentinels: vec![ep("a", 1), ep("b", 2)],
                service: "mymaster".into(),
                db: 2,
                tls: false,
            },
        ),
        (
            "rediss+sentinel://u:p@a:1,b:2/mymaster",
            Topology::Sentinel {
                sentinels: vec![ep("a", 1), ep("b", 2)],
                service: "mymaster".into(),
                db: 0,
                tls: true,
            },
        ),
        (
            "redis+cluster://a:1,b:2,c:3",
            Topology::Cluster {
                seeds: vec![ep("a", 1), ep("b", 2), ep("c", 3)],
                tls: false,
            },
        ),
        (
            "REDISS+CLUSTER://a:1,b:2,c:3",
            Topology::Cluster {
                seeds: vec![ep("a", 1), ep("b", 2), ep("c", 3)],
                tls: true,
            },
        ),
        (
            "redlock://a:1,b:2,c:3",
            Topology::Redlock {
                instances: vec![ep("a", 1), ep("b", 2), ep("c", 3)],
                tls: false,
            },
        ),
        (
            "redlocks://a:1,b:2,c:3",
            Topology::Redlock {
                instances: vec![ep("a", 1), ep("b", 2), ep("c", 3)],
                tls: true,
            },
        ),
        (
            "redis://[::1]:7000",
            Topology::Single {
                endpoint: ep("::1", 7000),
                tls: false,
                db: 0,
            },
        ),
        (
            "redis://h?db=4",
            Topology::Single {
                endpoint: ep("h", 6379),
                tls: false,
                db: 4,
            },
        ),
        // The service name is percent-decoded (the facade's config file encodes it).
        (
            "redis+sentinel://s:26379/cache%3Aeu",
            Topology::Sentinel {
                sentinels: vec![ep("s", 26379)],
                service: "cache:eu".into(),
                db: 0,
                tls: false,
            },
        ),
        (
            "redis+sentinel://s:26379/a%2Fb%20c",
            Topology::Sentinel {
                sentinels: vec![ep("s", 26379)],
                service: "a/b c".into(),
                db: 0,
                tls: false,
            },
        ),
    ];
    for (url, topology) in cases {
        let config = RedisConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(config.topology, topology, "{url}");
        assert!(
            url.to_ascii_lowercase()
                .starts_with(&format!("{}://", topology.scheme())),
            "{url}"
        );
    }
}

#[test]
fn options_are_parsed() {
    let c = RedisConfig::from_url(
        "redis://h:1?prefix=lock:&layout=raw&wait_replicas=1&wait_timeout=250ms&timeout=3s",
    )
    .unwrap();
    assert_eq!(c.layout, KeyLayout::raw("lock:"));
    assert_eq!(c.wait_replicas, 1);
    assert_eq!(c.wait_timeout, Duration::from_millis(250));
    assert_eq!(c.timeout, Duration::from_secs(3));
    let c = RedisConfig::from_url("redis://h:1").unwrap();
    assert_eq!(c.layout, KeyLayout::default());
}

#[test]
fn bad_urls_are_typed_errors() {
    for url in [
        "redis://h:notaport",
        "redis://a:1,b:2",
        "redis://h:1?nope=1",
        "redis://h:1?layout=odd",
        "redis://h:1?prefix=a{b",
        "redis+sentinel://a:1",
        "rediss+sentinel://a:1",
        "redis+cluster://a:1/x",
        "rediss+cluster://a:1?db=1",
        "redlock://a:1,b:2",
        "redlocks://a:1,b:2",
        "rediss+redlock://a:1",
        // One server twice would count twice toward the quorum.
        "redlock://a:1,a:1,b:2",
        "redlocks://a:1,b:2,A:1",
        "redlock://[::1]:1,[0::1]:1,b:2",
        "redlock://h,h:6379,b:2",
        "redis://h:1?timeout=5x",
        "redis://h:1/abc",
        "redis://:1",
        // A database is a number from 0, given once (path or `db=`, not both).
        "redis://h/-1",
        "redis://h?db=-1",
        "redis://h?db=x",
        "redis://h/1?db=2",
        "redis://h/1?db=1",
        "rediss://h/1?db=2",
        "redis+sentinel://a:1/m?db=-1",
        "redis+sentinel://a:1/m?db=1.5",
        // Not UTF-8 once decoded.
        "redis+sentinel://a:1/%FF",
    ] {
        let err = RedisConfig::from_url(url).unwrap_err();
        assert!(matches!(err, Error::InvalidUrl { .. }), "{url}: {err:?}");
    }
}

/// A Redlock instance given twice in a configuration built in code is refused too,
/// by `connect` before any connection.
#[tokio::test]
async fn a_redlock_instance_given_twice_is_refused() {
    let endpoint = |host: &str, port| Endpoint {
        host: host.into(),
        port,
    };
    let config = RedisConfig::new(Topology::Redlock {
        instances: vec![
            endpoint("no-such-host.invalid", 1),
            endpoint("other.invalid", 1),
            endpoint("No-Such-Host.invalid", 1),
        ],
        tls: false,
    });
    assert!(matches!(
        config.check_instances(),
        Err(Error::InvalidConfig(_))
    ));
    let err = crate::RedisLock::connect(config).await.err().unwrap();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
    let distinct = RedisConfig::from_url("redlock://a:1,a:2,b:1").unwrap();
    assert!(distinct.check_instances().is_ok());
}

#[test]
fn tls_options_are_parsed() {
    let cases: Vec<(&str, RedisTls)> = vec![
        ("rediss://h:1", RedisTls::default()),
        (
            "rediss://h:1?ca=/etc/redis/ca.pem",
            RedisTls {
                ca: Some("/etc/redis/ca.pem".into()),
                ..RedisTls::default()
            },
        ),
        (
            "rediss://u:p@h:1/2?ca=ca.pem&cert=%2Ftmp%2Fc%20d.pem&key=k.pem&timeout=1s",
            RedisTls {
                ca: Some("ca.pem".into()),
                cert: Some("/tmp/c d.pem".into()),
                key: Some("k.pem".into()),
            },
        ),
        (
            "rediss://h:1?cert=c.pem&key=k.pem",
            RedisTls {
                ca: None,
                cert: Some("c.pem".into()),
                key: Some("k.pem".into()),
            },
        ),
        (
            "rediss+sentinel://:p@a:1,b:2/m?ca=ca.pem&sentinel_password=s",
            RedisTls {
                ca: Some("ca.pem".into()),
                ..RedisTls::default()
            },
        ),
        (
            "rediss+cluster://:p@a:1,b:2?ca=ca.pem&cert=c.pem&key=k.pem",
            RedisTls {
                ca: Some("ca.pem".into()),
                cert: Some("c.pem".into()),
                key: Some("k.pem".into()),
            },
        ),
        ("rediss+cluster://a:1", RedisTls::default()),
        (
            "redlocks://a:1,b:2,c:3?ca=ca.pem",
            RedisTls {
                ca: Some("ca.pem".into()),
                ..RedisTls::default()
            },
        ),
    ];
    for (url, tls) in cases {
        let config = RedisConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(config.tls, tls, "{url}");
        assert!(config.topology.uses_tls(), "{url}");
    }
    assert!(RedisConfig::from_url("redis://h:1").unwrap().tls.is_empty());
}

#[test]
fn misplaced_tls_options_are_typed_errors() {
    // `Some(text)`: an InvalidConfig whose message contains `text`; `None`: InvalidUrl.
    for (url, expected) in [
        (
            "redis://h:1?ca=/ca.pem",
            Some("`ca` is a TLS setting: use rediss://"),
        ),
        (
            "redis://h:1?cert=c&key=k",
            Some("`cert` is a TLS setting: use rediss://"),
        ),
        (
            "redis+sentinel://a:1/m?ca=x",
            Some("`ca` is a TLS setting: use rediss+sentinel:// (not redis+sentinel://)"),
        ),
        (
            "redis+cluster://a:1?key=k&cert=c",
            Some("`cert` is a TLS setting: use rediss+cluster:// (not redis+cluster://)"),
        ),
        (
            "redlock://a:1,b:2,c:3?ca=x",
            Some("use redlocks:// (not redlock://)"),
        ),
        (
            "rediss+sentinel://a:1/m?key=k.pem",
            Some("`cert` and `key` go together"),
        ),
        (
            "rediss+cluster://a:1?cert=c.pem",
            Some("`cert` and `key` go together"),
        ),
        ("rediss+cluster://a:1?domain=redis.local", None),
        (
            "rediss://h:1?cert=c.pem",
            Some("`cert` and `key` go together"),
        ),
        (
            "rediss://h:1?ca=x&key=k.pem",
            Some("`cert` and `key` go together"),
        ),
        ("rediss://h:1?domain=redis.local", None),
    ] {
        match (RedisConfig::from_url(url), expected) {
            (Err(Error::InvalidConfig(message)), Some(text)) => {
                assert!(message.contains(text), "{url}: {message}")
            }
            (Err(Error::InvalidUrl { .. }), None) => {}
            (other, _) => panic!("{url}: {other:?}"),
        }
    }
}

#[test]
fn hand_built_tls_settings_are_checked() {
    let mut config = RedisConfig::new(Topology::Single {
        endpoint: ep("h", 1),
        tls: false,
        db: 0,
    });
    assert!(config.check_tls().is_ok());
    config.tls.ca = Some("ca.pem".into());
    assert!(matches!(config.check_tls(), Err(Error::InvalidConfig(_))));
    config.topology = Topology::Single {
        endpoint: ep("h", 1),
        tls: true,
        db: 0,
    };
    assert!(config.check_tls().is_ok());
    config.tls.key = Some("k.pem".into());
    assert!(matches!(config.check_tls(), Err(Error::InvalidConfig(_))));
    config.tls.cert = Some("c.pem".into());
    assert!(config.check_tls().is_ok());
    for (plain, tls) in [
        (
            Topology::Cluster {
                seeds: vec![ep("a", 1)],
                tls: false,
            },
            Topology::Cluster {
                seeds: vec![ep("a", 1)],
                tls: true,
            },
        ),
        (
            Topology::Sentinel {
                sentinels: vec![ep("s", 1)],
                service: "m".into(),
                db: 0,
                tls: false,
            },
            Topology::Sentinel {
                sentinels: vec![ep("s", 1)],
                service: "m".into(),
                db: 0,
                tls: true,
            },
        ),
        (
            Topology::Redlock {
                instances: vec![ep("a", 1)],
                tls: false,
            },
            Topology::Redlock {
                instances: vec![ep("a", 1)],
                tls: true,
            },
        ),
    ] {
        config.topology = plain;
        assert!(matches!(config.check_tls(), Err(Error::InvalidConfig(_))));
        config.topology = tls;
        assert!(config.check_tls().is_ok());
    }
}

#[test]
fn passwords_never_show() {
    let c = RedisConfig::from_url("redis://alice:s3cr%40t@h:1").unwrap();
    assert_eq!(c.password.as_deref(), Some("s3cr@t"));
    assert_eq!(c.username.as_deref(), Some("alice"));
    assert!(!format!("{c:?}").contains("s3cr"));
    let err = RedisConfig::from_url("redis://alice:hunter2@h:1?bad=1").unwrap_err();
    assert!(!err.to_string().contains("hunter2"), "{err}");
    assert!(!format!("{err:?}").contains("hunter2"));
    let err = RedisConfig::from_url("redis://alice:hunter2@h:1?ca=/ca.pem").unwrap_err();
    assert!(!format!("{err} {err:?}").contains("hunter2"), "{err}");
    let c = RedisConfig::from_url("rediss://alice:hunter2@h:1?ca=/ca.pem").unwrap();
    assert!(!format!("{c:?}").contains("hunter2"));
    assert!(format!("{c:?}").contains("/ca.pem"));
    let c =
        RedisConfig::from_url("rediss+sentinel://:hunter2@s:1/m?ca=/ca.pem&sentinel_password=s3nt")
            .unwrap();
    let shown = format!("{c:?}");
    assert!(
        !shown.contains("hunter2") && !shown.contains("s3nt"),
        "{shown}"
    );
    assert!(shown.contains("/ca.pem"), "{shown}");
    let err = RedisConfig::from_url("rediss+cluster://:hunter2@a:1?cert=c.pem").unwrap_err();
    assert!(!format!("{err} {err:?}").contains("hunter2"), "{err}");
    let c = RedisConfig::from_url("redis://:only@h:1").unwrap();
    assert_eq!(c.password.as_deref(), Some("only"));
    assert_eq!(c.username, None);
    // Sub-delimiters are allowed raw in user info: `&` does not end the password,
    // `+` is not a space (both were mangled by a form decoder).
    let c = RedisConfig::from_url("redis://u+1:p&a+s=1!@h:1?prefix=a+b").unwrap();
    assert_eq!(c.username.as_deref(), Some("u+1"));
    assert_eq!(c.password.as_deref(), Some("p&a+s=1!"));
    assert_eq!(c.layout, KeyLayout::tagged("a+b").unwrap());
}

#[test]
fn sentinel_credentials_are_for_sentinel_only_and_never_show() {
    let c = RedisConfig::from_url(
        "redis+sentinel://s:1/m?sentinel_username=watch&sentinel_password=s3nt%26x",
    )
    .unwrap();
    assert_eq!(c.sentinel_username.as_deref(), Some("watch"));
    assert_eq!(c.sentinel_password.as_deref(), Some("s3nt&x"));
    assert!(!format!("{c:?}").contains("s3nt"));
    let err =
        RedisConfig::from_url("redis+sentinel://s:1/m?sentinel_password=s3nt&bad=1").unwrap_err();
    assert!(!format!("{err} {err:?}").contains("s3nt"), "{err}");
    for url in [
        "redis://h:1?sentinel_password=x",
        "redis+cluster://h:1?sentinel_username=u",
        "rediss+cluster://h:1?sentinel_password=x",
        "redlock://a:1?sentinel_password=x",
    ] {
        let err = RedisConfig::from_url(url).unwrap_err();
        assert!(matches!(err, Error::InvalidUrl { .. }), "{url}: {err:?}");
        assert!(err.to_string().contains("redis+sentinel"), "{err}");
    }
}

/// A replica check whose `WAIT` could hold the connection for ever (`wait_timeout=0`)
/// or past the response timeout, and durations that overflow the arithmetic on them,
/// are refused: from a URL as `InvalidUrl`, built by hand as `InvalidConfig`.
#[test]
fn durations_out_of_range_are_refused() {
    for url in [
        "redis://a:1?wait_replicas=1&wait_timeout=0",
        "redis://a:1?wait_replicas=1&wait_timeout=2s",
        "redis://a:1?wait_replicas=1&wait_timeout=3s&timeout=2s",
        "redis+sentinel://a:1/m?timeout=10000000000000000000s",
        "redis://a:1?layout=raw&poll_min=1s&poll_max=10000000000000000000s",
        "redis://a:1?poll_min=2s&poll_max=1s",
    ] {
        let err = RedisConfig::from_url(url).unwrap_err();
        assert!(matches!(err, Error::InvalidUrl { .. }), "{url}: {err:?}");
    }
    // No replica check: the wait timeout does not matter.
    assert!(RedisConfig::from_url("redis://a:1?wait_timeout=0").is_ok());
    assert!(RedisConfig::from_url("redis://a:1?wait_replicas=1&wait_timeout=500ms").is_ok());
    let by_hand = |change: fn(&mut RedisConfig)| {
        let mut config = RedisConfig::from_url("redis://a:1").unwrap();
        change(&mut config);
        config.check_durations()
    };
    assert!(by_hand(|_| {}).is_ok());
    for change in [
        (|c: &mut RedisConfig| c.timeout = Duration::MAX) as fn(&mut RedisConfig),
        |c| c.connect_timeout = Duration::ZERO,
        |c| c.poll_max = Duration::MAX,
        |c| {
            c.wait_replicas = 1;
            c.wait_timeout = Duration::ZERO;
        },
    ] {
        assert!(matches!(by_hand(change), Err(Error::InvalidConfig(_))));
    }
}
