use super::*;

fn ok(url: &str) -> ZkConfig {
    ZkConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"))
}

/// URL, hosts, chroot, session timeout, min lease, digest credentials, ACL.
type Row = (
    &'static str,
    &'static str,
    &'static str,
    Duration,
    Duration,
    Option<(&'static str, &'static str)>,
    AclPolicy,
);

#[test]
fn url_to_config_table() {
    let s = Duration::from_secs;
    #[rustfmt::skip]
    let table: &[Row] = &[
        ("zk://localhost", "localhost:2181", "", s(30), s(4), None, AclPolicy::Open),
        ("zookeeper://h:2182/", "h:2182", "", s(30), s(4), None, AclPolicy::Open),
        ("zk://a,b:1,c/x/y/", "a:2181,b:1,c:2181", "/x/y", s(30), s(4), None, AclPolicy::Open),
        ("zk://[::1]:2181,[::2]/r", "[::1]:2181,[::2]:2181", "/r", s(30), s(4), None, AclPolicy::Open),
        ("zk://h/r?session_timeout=10s&min_lease=1500ms", "h:2181", "/r", s(10), Duration::from_millis(1500), None, AclPolicy::Open),
        ("zk://h?session_timeout=2m", "h:2181", "", s(120), s(4), None, AclPolicy::Open),
        ("zk://h?session_timeout=5000ms", "h:2181", "", s(5), s(4), None, AclPolicy::Open),
        ("zk://u:p%40ss@h/l%20x?acl=creator", "h:2181", "/l x", s(30), s(4), Some(("u", "p@ss")), AclPolicy::CreatorOnly),
        ("ZK://u:@h?acl=open", "h:2181", "", s(30), s(4), Some(("u", "")), AclPolicy::Open),
        // Credentials without `acl=`: the nodes are the creator's.
        ("zk://u:p@h", "h:2181", "", s(30), s(4), Some(("u", "p")), AclPolicy::CreatorOnly),
    ];
    for (url, hosts, chroot, timeout, min, auth, acl) in table {
        let c = ok(url);
        assert_eq!(c.hosts(), *hosts, "{url}");
        assert_eq!(c.chroot(), *chroot, "{url}");
        assert_eq!(c.session_timeout(), *timeout, "{url}");
        assert_eq!(c.min_lease(), *min, "{url}");
        assert_eq!(
            c.auth().map(|a| (a.user.as_str(), a.password.as_str())),
            *auth,
            "{url}"
        );
        assert_eq!(c.acl(), *acl, "{url}");
    }
}

#[test]
fn bad_urls_are_typed_errors_without_the_password() {
    for url in [
        "zk://",
        "zk:///chroot",
        "etcd://h",
        "zk://h:0",
        "zk://h:99999",
        "zk://h,,g",
        "zk://h/a//b",
        "zk://h/a/../b",
        "zk://h/zookeeper/x",
        "zk://h?session_timeout=10x",
        "zk://h?session_timeout=0s",
        "zk://h?ttl=3",
        "zk://h?acl=all",
        "zk://h?acl=creator",
        "zk://h?session_timeout=1s",
        "zk://user:hunter2@h?nope=1",
        "zk://user:hunter2@h/%zz",
        "zk://h/a#frag",
        "no-scheme",
    ] {
        let err = ZkConfig::from_url(url).expect_err(url);
        assert!(
            matches!(err, Error::InvalidUrl { .. } | Error::InvalidConfig(_)),
            "{url}: {err:?}"
        );
        assert!(!err.to_string().contains("hunter2"), "{url}: {err}");
        assert!(!format!("{err:?}").contains("hunter2"), "{url}: {err:?}");
    }
}

/// ZooKeeper's `digest` scheme splits `user:password` at the first `:`: a user with a
/// `:` (percent-encoded in the URL, or given to `with_digest`) would authenticate as
/// another user with another password, so it is refused.
#[test]
fn a_digest_user_with_a_colon_is_refused() {
    for url in ["zk://a%3Ab:hunter2@h", "zk://a%3ab:hunter2@h/r?acl=open"] {
        match ZkConfig::from_url(url) {
            Err(Error::InvalidUrl { reason, .. }) => {
                assert!(reason.contains("':'"), "{url}: {reason}");
                assert!(!reason.contains("hunter2"), "{url}: {reason}");
            }
            other => panic!("{url}: {other:?}"),
        }
    }
    let built = ZkConfig::new("h:1").with_digest("a:b", "pw");
    assert!(
        matches!(built.validate(), Err(Error::InvalidConfig(ref m)) if m.contains("':'")),
        "{:?}",
        built.validate()
    );
    // A `:` in the password is fine: the server splits at the first one.
    let c = ok("zk://ab:p%3Aw@h");
    assert_eq!(c.auth().map(|a| a.password.as_str()), Some("p:w"));
}

#[test]
fn explicit_settings_win_and_debug_hides_the_password() {
    let c = ok("zk://me:hunter2@h?session_timeout=10s")
        .with_session_timeout(Duration::from_secs(20))
        .with_acl(AclPolicy::CreatorOnly)
        .with_chroot("/other/")
        .unwrap();
    assert_eq!(c.session_timeout(), Duration::from_secs(20));
    assert_eq!(c.chroot(), "/other");
    let debug = format!("{c:?}");
    assert!(!debug.contains("hunter2"), "{debug}");
    assert!(debug.contains("me"), "{debug}");
    assert!(c.validate().is_ok());
}

#[test]
fn zks_urls_carry_the_tls_files() {
    let plain = ok("zk://h:1");
    assert!(plain.tls().is_none());
    let system_roots = ok("zks://h:2281/locks");
    assert_eq!(system_roots.tls(), Some(&ZkTls::default()));
    assert_eq!(system_roots.hosts(), "h:2281");
    let full = ok("ZKS://h?ca=/c/ca.pem&cert=/c/me.pem&key=/c/me-key.pem");
    assert_eq!(
        full.tls(),
        Some(
            &ZkTls::new()
                .with_ca("/c/ca.pem")
                .with_identity("/c/me.pem", "/c/me-key.pem")
        )
    );
    let debug = format!("{full:?}");
    assert!(debug.contains("/c/ca.pem"), "{debug}");
}

#[test]
fn misplaced_or_half_tls_settings_are_typed_errors() {
    for (url, text) in [
        ("zk://h?ca=/ca.pem", "`ca` is a TLS setting: use zks://"),
        (
            "zookeeper://h?key=/k.pem",
            "`key` is a TLS setting: use zks://",
        ),
        ("zks://h?ca=", "`ca` needs a file path"),
    ] {
        match ZkConfig::from_url(url) {
            Err(Error::InvalidUrl { reason, .. }) => {
                assert!(reason.contains(text), "{url}: {reason}")
            }
            other => panic!("{url}: {other:?}"),
        }
    }
    for url in ["zks://h?cert=/c.pem", "zks://h?key=/k.pem&ca=/ca.pem"] {
        assert!(
            matches!(ZkConfig::from_url(url), Err(Error::InvalidConfig(m)) if m.contains("`cert` and `key` go together")),
            "{url}"
        );
    }
    let hand_built = ZkConfig::new("h:1").with_tls(Some(ZkTls {
        cert: Some("c.pem".into()),
        ..ZkTls::default()
    }));
    assert!(matches!(
        hand_built.validate(),
        Err(Error::InvalidConfig(_))
    ));
}

#[test]
fn sasl_digest_md5_uses_the_user_info_and_hides_the_password() {
    let c = ok("zks://app:hunter2@h?sasl=digest-md5&acl=creator");
    assert_eq!(c.auth_method(), AuthMethod::SaslDigestMd5);
    assert_eq!(c.auth().map(|a| a.user.as_str()), Some("app"));
    assert_eq!(c.acl(), AclPolicy::CreatorOnly);
    assert!(!format!("{c:?}").contains("hunter2"));
    assert_eq!(ok("zk://app:pw@h").auth_method(), AuthMethod::Digest);
    assert_eq!(
        ZkConfig::new("h:1")
            .with_sasl_digest_md5("u", "p")
            .auth_method(),
        AuthMethod::SaslDigestMd5
    );
    assert_eq!(
        ZkConfig::new("h:1")
            .with_sasl_digest_md5("u", "p")
            .with_digest("u", "p")
            .auth_method(),
        AuthMethod::Digest
    );
    for url in [
        "zk://h?sasl=digest-md5",
        "zk://app:hunter2@h?sasl=gssapi",
        "zk://app:hunter2@h?sasl=plain",
    ] {
        let err = ZkConfig::from_url(url).expect_err(url);
        assert!(
            matches!(err, Error::InvalidUrl { .. } | Error::InvalidConfig(_)),
            "{url}: {err:?}"
        );
        assert!(
            !format!("{err} {err:?}").contains("hunter2"),
            "{url}: {err:?}"
        );
    }
}
