//! Config file → URL.

use super::to_url;
use crate::Config;
use fencelock_core::Error;

fn url(text: &str) -> String {
    to_url(text).unwrap_or_else(|e| panic!("{text}\n{e}"))
}

fn error(text: &str) -> String {
    match to_url(text).and_then(|url| Config::from_url(&url)) {
        Err(Error::InvalidConfig(message)) => message,
        other => panic!("{text}\nexpected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn every_backend_becomes_its_url() {
    let cases = [
        (
            r#"
            backend = "etcd"
            endpoints = ["10.0.0.1:2379", "10.0.0.2:2379"]
            prefix = "app/locks"
            lease = "10s"
            require = ["linearizable", "fencing=strong"]
            [auth]
            user = "app"
            password = "p@ss word"
            [options]
            cleanup_timeout = "5s"
            "#,
            "etcd://app:p%40ss%20word@10.0.0.1:2379,10.0.0.2:2379/app/locks?lease=10s\
             &cleanup_timeout=5s&require=linearizable%2Cfencing%3Dstrong",
        ),
        (
            r#"
            backend = "etcd"
            endpoints = ["h:2379"]
            prefix = "locks"
            lease = "30s"
            [tls]
            ca = "/etc/ca.pem"
            domain = "etcd.internal"
            "#,
            "etcds://h:2379/locks?lease=30s&ca=%2Fetc%2Fca.pem&domain=etcd.internal",
        ),
        (
            r#"
            backend = "zookeeper"
            endpoints = ["zk1:2181", "zk2:2181"]
            prefix = "/locks"
            lease = "10s"
            [auth]
            user = "app"
            password = "s3cret"
            "#,
            "zk://app:s3cret@zk1:2181,zk2:2181/locks?session_timeout=10s",
        ),
        (
            r#"
            backend = "redis"
            endpoints = ["cache:6379"]
            prefix = "lock:"
            db = 2
            options = { layout = "raw", wait_replicas = 1 }
            [auth]
            password = "s3cret"
            "#,
            "redis://:s3cret@cache:6379/2?prefix=lock%3A&layout=raw&wait_replicas=1",
        ),
        (
            r#"
            backend = "redis"
            endpoints = ["cache:6379"]
            tls = { enabled = true }
            "#,
            "rediss://cache:6379",
        ),
        (
            r#"
            backend = "redis"
            endpoints = ["cache:6379"]
            [tls]
            ca = "/etc/ca.pem"
            cert = "/etc/c.pem"
            key = "/etc/c.key"
            "#,
            "rediss://cache:6379?ca=%2Fetc%2Fca.pem&cert=%2Fetc%2Fc.pem&key=%2Fetc%2Fc.key",
        ),
        (
            r#"
            backend = "redis+sentinel"
            endpoints = ["s1:26379", "s2:26379"]
            service = "mymaster"
            db = 1
            "#,
            "redis+sentinel://s1:26379,s2:26379/mymaster?db=1",
        ),
        (
            r#"
            backend = "redis+sentinel"
            endpoints = ["s1:26380", "s2:26380"]
            service = "mymaster"
            tls = { ca = "/etc/ca.pem" }
            "#,
            "rediss+sentinel://s1:26380,s2:26380/mymaster?ca=%2Fetc%2Fca.pem",
        ),
        (
            r#"
            backend = "rediss+sentinel"
            endpoints = ["s1:26380"]
            service = "mymaster"
            db = 4
            "#,
            "rediss+sentinel://s1:26380/mymaster?db=4",
        ),
        (
            r#"
            backend = "rediss"
            endpoints = ["cache:6380"]
            db = 3
            "#,
            "rediss://cache:6380/3",
        ),
        (
            r#"
            backend = "zk"
            endpoints = ["z1:2281", "z2:2281"]
            prefix = "/locks"
            tls = { ca = "/etc/ca.pem" }
            "#,
            "zks://z1:2281,z2:2281/locks?ca=%2Fetc%2Fca.pem",
        ),
        (
            r#"
            backend = "redis+cluster"
            endpoints = ["n1:6380", "n2:6380"]
            tls = { enabled = true }
            "#,
            "rediss+cluster://n1:6380,n2:6380",
        ),
        (
            r#"
            backend = "redlock"
            endpoints = ["a:6380", "b:6380", "c:6380"]
            tls = { ca = "/etc/ca.pem" }
            "#,
            "redlocks://a:6380,b:6380,c:6380?ca=%2Fetc%2Fca.pem",
        ),
        (
            r#"
            backend = "redlock"
            endpoints = ["a:6379", "b:6379", "c:6379"]
            "#,
            "redlock://a:6379,b:6379,c:6379",
        ),
        (r#"backend = "mem""#, "mem://"),
        (
            r#"
            backend = "mem"
            retry = 5
            metrics = false
            "#,
            "mem://?retry=5&metrics=false",
        ),
        (
            r#"
            backend = "mem"
            [retry]
            max_delay = "2s"
            "#,
            "mem://?retry=3&retry_max_delay=2s",
        ),
        (
            r#"
            backend = "mem"
            prefix = "team-a"
            "#,
            "mem://team-a",
        ),
        (
            r#"
            url = "redis://cache:6379?layout=raw"
            require = ["fencing"]
            [auth]
            user = "app"
            password = "s3cret"
            "#,
            "redis://app:s3cret@cache:6379?layout=raw&require=fencing",
        ),
    ];
    for (text, expected) in cases {
        assert_eq!(url(text), expected, "{text}");
        Config::from_toml_str(text).unwrap_or_else(|e| panic!("{text}\n{e}"));
    }
}

#[test]
fn a_migration_table_is_a_migrate_url() {
    let text = r#"
        require = ["fencing"]
        [migration]
        phase = "legacy-first"
        epoch = 1
        second_leg_wait = "500ms"
        [migration.legacy]
        backend = "redis"
        endpoints = ["cache:6379"]
        prefix = "lock:"
        options = { layout = "raw" }
        [migration.legacy.auth]
        password = "s3cret"
        [migration.target]
        backend = "etcd"
        endpoints = ["10.0.0.1:2379"]
        prefix = "locks"
    "#;
    let from_file = Config::from_toml_str(text).unwrap();
    let legacy = "redis://:s3cret@cache:6379?prefix=lock%3A&layout=raw";
    let target = "etcd://10.0.0.1:2379/locks";
    let enc = |s: &str| super::enc(s);
    let from_url = Config::from_url(&format!(
        "migrate://?phase=legacy-first&legacy={}&target={}&epoch=1&second_leg_wait=500ms\
         &require=fencing",
        enc(legacy),
        enc(target)
    ))
    .unwrap();
    assert_eq!(from_file, from_url);
    let shown = format!("{from_file} {from_file:?}");
    assert!(!shown.contains("s3cret"), "{shown}");
}

#[test]
fn passwords_can_come_from_the_environment() {
    // SAFETY-free: a variable name no other test uses.
    let var = "FENCELOCK_TEST_FILE_PASSWORD_7F3A";
    let text =
        format!("backend = \"redis\"\nendpoints = [\"h:1\"]\n[auth]\npassword_env = \"{var}\"\n");
    let message = error(&text);
    assert!(
        message.contains(var) && message.contains("not set"),
        "{message}"
    );
}

#[test]
fn mistakes_name_the_line_and_hide_secrets() {
    let message = error("backend = \"etcd\"\nendpoint = [\"h:1\"]\n");
    assert!(message.contains("line 2"), "{message}");
    assert!(message.contains("endpoint"), "{message}");

    let message = error("backend = \"redis\"\nendpoints = [\"h:1\"]\n[auth]\npassword = 8842731\n");
    assert!(message.contains("line 4"), "{message}");
    assert!(!message.contains("8842731"), "{message}");

    let message = error("url = \"redis://:hunter2@h:1\"\nbackend = \"redis\"\n");
    assert!(!message.contains("hunter2"), "{message}");

    // Non-ASCII where TOML wants ASCII (a bare key, smart quotes pasted from a document):
    // an error naming the line, not a panic whose message prints the file.
    for (text, line) in [
        ("\u{e9} = 1\n", "line 1"),
        (
            "backend = \"redis\"\n[auth]\npassword = \"hunter2\"\n\u{fc} = 1\n",
            "line 4",
        ),
        (
            "backend = \"redis\"\nlease = \u{201c}30s\u{201d}\n",
            "line 2",
        ),
    ] {
        let message = error(text);
        assert!(message.contains(line), "{text:?}: {message}");
        assert!(!message.contains("hunter2"), "{message}");
    }

    for (text, expect) in [
        ("prefix = \"x\"\n", "say which lock service"),
        ("backend = \"etcd\"\n", "needs `endpoints`"),
        (
            "backend = \"redis\"\nendpoints = [\"h:1\"]\nlease = \"5s\"\n",
            "per acquire",
        ),
        (
            "backend = \"zk\"\nendpoints = [\"h:1\"]\ntls = { domain = \"x\" }\n",
            "server's own name",
        ),
        (
            "backend = \"redis\"\nendpoints = [\"h:1\"]\ntls = { domain = \"x\" }\n",
            "endpoint's own name",
        ),
        (
            "backend = \"redis\"\nendpoints = [\"h:1\"]\nservice = \"m\"\n",
            "service",
        ),
        (
            "backend = \"redis+sentinel\"\nendpoints = [\"h:1\"]\n",
            "needs `service`",
        ),
        (
            "backend = \"redis\"\nendpoints = [\"h:1\"]\n[auth]\npassword = \"a\"\npassword_env = \"B\"\n",
            "not both",
        ),
        (
            "url = \"mem://\"\nendpoints = [\"h:1\"]\n",
            "put it in the URL",
        ),
        (
            "[migration]\nphase = \"legacy\"\nprefix = \"x\"\n",
            "unknown field",
        ),
        (
            "require = [\"fast\"]\nbackend = \"mem\"\n",
            "unknown requirement",
        ),
        (
            "backend = \"etcd\"\nendpoints = [\"h:1\"]\nprefix = \"p\"\nlease = 30\n",
            "has no unit",
        ),
        (
            "[migration]\nphase = \"sideways\"\n[migration.legacy]\nbackend = \"mem\"\n",
            "unknown phase",
        ),
    ] {
        let message = error(text);
        assert!(message.contains(expect), "{text}\n{message}");
    }
}

/// A setting given twice (a typed key and the same key in `[options]`) is refused
/// naming it, not resolved silently by whichever the parser reads last.
#[test]
fn a_setting_given_twice_is_refused() {
    for (text, key) in [
        (
            "backend = \"etcd\"\nendpoints = [\"h:1\"]\nlease = \"30s\"\n[options]\nlease = \"2s\"\n",
            "lease",
        ),
        (
            "backend = \"redis\"\nendpoints = [\"h:1\"]\nprefix = \"orders:\"\noptions = { prefix = \"x:\" }\n",
            "prefix",
        ),
        (
            "backend = \"zk\"\nendpoints = [\"h:1\"]\nretry = 2\n[options]\nretry = 3\n",
            "retry",
        ),
    ] {
        let message = error(text);
        assert!(message.contains(&format!("`{key}`")), "{text}: {message}");
        assert!(message.contains("twice"), "{text}: {message}");
    }
}
