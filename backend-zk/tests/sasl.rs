//! SASL DIGEST-MD5 (`sasl=digest-md5`) against a real ZooKeeper server that requires SASL
//! authentication of every session (`enforce.auth.schemes=sasl`): the right password
//! locks, a wrong one, none, or `addauth digest` credentials are refused quickly with a
//! typed, non-retryable error that never shows the password; and SASL over TLS.
#![cfg(feature = "sasl")]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use fencelock_core::{DistributedLockExt, Error};
use fencelock_testkit::ZkServer;

const USER: &str = "app";
const PASSWORD: &str = "s3cret-Pa55";

/// One server requiring SASL, with the user `app`, shared by the tests of this process.
fn shared() -> &'static ZkServer {
    static SHARED: OnceLock<ZkServer> = OnceLock::new();
    SHARED.get_or_init(|| ZkServer::start_sasl(&[(USER, PASSWORD), ("other", "x")]))
}

/// The error and its sources.
fn chain(err: &Error) -> String {
    let mut text = format!("{err} / {err:?}");
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Connects to `url`, which must fail, within 30 s (the connect timeouts below are 3 s
/// or 20 s; how quickly a refusal comes is asserted where it matters).
async fn refused(url: &str) -> (Error, Duration) {
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(30), fencelock_zk::connect(url))
        .await
        .unwrap_or_else(|_| panic!("connect still running after 30 s"));
    let err = match result {
        Ok(_) => panic!("connected without the right credentials"),
        Err(err) => err,
    };
    let elapsed = started.elapsed();
    eprintln!("{err:?} after {elapsed:?}");
    (err, elapsed)
}

/// The right user and password lock, contend and, with `acl=creator`, own the nodes as
/// `sasl:app`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_right_password_locks() {
    let url = format!(
        "zk://{USER}:{PASSWORD}@{}/sasl-{:x}?sasl=digest-md5&acl=creator&session_timeout=4s",
        shared().connect_string(),
        fastrand::u64(..)
    );
    let a = fencelock_zk::connect(&url)
        .await
        .expect("connect with SASL");
    let b = fencelock_zk::connect(&url)
        .await
        .expect("connect with SASL");
    let guard = a.lock("job").await.unwrap();
    assert!(guard.token().get() > 0);
    assert!(b.try_lock("job").await.unwrap().is_none());
    guard.release().await.unwrap();
    b.lock("job").await.unwrap().release().await.unwrap();
}

/// A wrong password, an unknown user, no credentials at all, and `addauth digest`
/// credentials (without SASL) are refused by the server: a non-retryable backend error,
/// well within the connect timeout, that never shows the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_credentials_are_refused_quickly() {
    let hosts = shared().connect_string();
    let wrong = "hunter2-wrong";
    for (url, text) in [
        (
            format!("zk://{USER}:{wrong}@{hosts}?sasl=digest-md5&connect_timeout=3s"),
            "wrong user or password",
        ),
        (
            format!("zk://nobody:{wrong}@{hosts}?sasl=digest-md5&connect_timeout=3s"),
            "wrong user or password",
        ),
        (format!("zk://{hosts}?connect_timeout=3s"), "no credentials"),
        (
            format!("zk://{USER}:{wrong}@{hosts}?connect_timeout=3s"),
            "authentication failed",
        ),
    ] {
        let (err, elapsed) = refused(&url).await;
        assert!(matches!(err, Error::Backend { .. }), "{url}: {err:?}");
        assert!(!err.is_retryable(), "{url}: {err:?}");
        let shown = chain(&err);
        assert!(shown.contains(text), "{url}: {shown}");
        assert!(!shown.contains(wrong), "{url}: {shown}");
        assert!(elapsed < Duration::from_secs(3), "{url}: took {elapsed:?}");
    }
}

/// SASL over TLS, with a client certificate.
///
/// What this asserts is that the two work together, not how fast: a fresh server's first
/// TLS handshakes (a cold JVM, client certificates checked) took over the 3 s connect
/// timeout this test had on a loaded CI run, so connects here may take 20 s.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_over_mutual_tls() {
    use fencelock_testkit::{TestCertificates, ZkSecurity};

    let certs = TestCertificates::generate();
    let server = ZkServer::start_secure(&ZkSecurity {
        tls: Some(&certs),
        client_auth: true,
        sasl_users: vec![(USER.into(), PASSWORD.into())],
    });
    let base = format!(
        "zks://{USER}:{{password}}@127.0.0.1:{}/sasl-tls?sasl=digest-md5&connect_timeout=20s&ca={}&cert={}&key={}",
        server.tls_port().unwrap(),
        certs.ca().display(),
        certs.client_cert().display(),
        certs.client_key().display()
    );
    let locks = fencelock_zk::connect(&base.replace("{password}", PASSWORD))
        .await
        .expect("SASL over mutual TLS");
    locks.lock("job").await.unwrap().release().await.unwrap();
    let (err, _) = refused(&base.replace("{password}", "hunter2-wrong")).await;
    assert!(!err.is_retryable(), "{err:?}");
    assert!(chain(&err).contains("wrong user or password"), "{err:?}");
    assert!(!chain(&err).contains("hunter2"), "{err:?}");
}
