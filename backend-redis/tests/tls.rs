//! `rediss://` against real TLS-only Redis servers with a private CA: locking, contention
//! and pub/sub waiting over TLS, an untrusted server, mutual TLS, plain and TLS clients on
//! the wrong kind of port, bad TLS files, and the whole conformance suite over TLS.
#![cfg(feature = "tls")]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use fencelock_core::{AcquireOptions, DistributedLock, DistributedLockExt, Error};
use fencelock_testkit::{RedisServer, TestCertificates};

/// One TLS-only server (no client certificates asked for) and its CA, shared by the
/// tests of this process.
fn shared() -> &'static (TestCertificates, RedisServer) {
    static SHARED: OnceLock<(TestCertificates, RedisServer)> = OnceLock::new();
    SHARED.get_or_init(|| {
        let certs = TestCertificates::generate();
        let server = RedisServer::start_tls(&certs, false);
        (certs, server)
    })
}

/// `rediss://127.0.0.1:PORT?ca=CA` for the shared server.
fn tls_url() -> String {
    let (certs, server) = shared();
    format!("{}?ca={}", server.url(), certs.ca().display())
}

/// Connects to `url`, which must fail, within `bound`.
async fn connect_fails(url: &str, bound: Duration) -> Error {
    let started = Instant::now();
    let result = tokio::time::timeout(bound, fencelock_redis::connect(url))
        .await
        .unwrap_or_else(|_| panic!("{url}: connect still running after {bound:?}"));
    let err = match result {
        Ok(_) => panic!("{url}: connected"),
        Err(err) => err,
    };
    eprintln!("{url}: {:?} after {:?}", err, started.elapsed());
    err
}

/// The error and its sources, for matching on the cause.
fn chain(err: &Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Lock, contention and hand-over over TLS: tokens grow, and a waiter on another client
/// is woken by the unlock message (pub/sub over TLS), not by the lease running out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_private_ca_locks_contends_and_wakes_waiters() {
    let url = tls_url();
    let first = fencelock_redis::connect(&url)
        .await
        .expect("connect rediss://");
    let second = fencelock_redis::connect(&url)
        .await
        .expect("connect rediss://");
    let lease = Duration::from_secs(30);

    let guard = first
        .acquire("tls-handover", AcquireOptions::new().lease(lease))
        .await
        .unwrap();
    let first_token = guard.token();
    assert!(first_token.get() > 0);
    assert!(second.try_lock("tls-handover").await.unwrap().is_none());

    let waiter = second.acquire(
        "tls-handover",
        AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
    );
    let release = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let released = Instant::now();
        guard.release().await.unwrap();
        released
    };
    let (next, released) = tokio::join!(waiter, release);
    let next = next.expect("the waiter gets the lock after the release");
    let woken_after = released.elapsed();
    assert!(
        woken_after < Duration::from_secs(2),
        "the waiter took {woken_after:?} after the release: no unlock message over TLS?"
    );
    let next_token = next.token();
    assert!(next_token > first_token);
    next.release().await.unwrap();

    let again = first.lock("tls-handover").await.unwrap();
    assert!(again.token() > next_token);
    again.release().await.unwrap();
}

/// Without `ca=` the system's roots are used, which do not include the private CA; a CA
/// that did not sign the server certificate is not trusted either. A clear, typed error,
/// not a panic and not a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_server_is_refused() {
    let (_, server) = shared();
    let system_roots = format!("{}?timeout=1s", server.url());
    let err = connect_fails(&system_roots, Duration::from_secs(15)).await;
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    assert!(
        !err.is_retryable(),
        "retrying does not make it trusted: {err:?}"
    );
    assert!(chain(&err).contains("certificate"), "{}", chain(&err));

    let other = TestCertificates::generate();
    let wrong_ca = format!("{}?timeout=1s&ca={}", server.url(), other.ca().display());
    let err = connect_fails(&wrong_ca, Duration::from_secs(15)).await;
    assert!(!err.is_retryable(), "{err:?}");
    assert!(chain(&err).contains("certificate"), "{}", chain(&err));
}

/// Missing, unreadable or wrong TLS files and a half certificate/key pair are
/// configuration errors naming the problem, found before any connection is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tls_files_are_config_errors() {
    let (certs, server) = shared();
    let base = server.url();
    let missing = certs.dir().join("no-such.pem");
    let cases = [
        (
            format!("{base}?ca={}", missing.display()),
            "cannot read TLS file",
        ),
        (
            // A key file holds no certificate.
            format!("{base}?ca={}", certs.server_key().display()),
            "holds no PEM certificate",
        ),
        (
            format!(
                "{base}?ca={}&cert={}&key={}",
                certs.ca().display(),
                certs.client_cert().display(),
                missing.display()
            ),
            "cannot read TLS file",
        ),
        (
            // A certificate file holds no private key.
            format!(
                "{base}?ca={}&cert={}&key={}",
                certs.ca().display(),
                certs.client_cert().display(),
                certs.client_cert().display()
            ),
            "no PEM private key",
        ),
    ];
    for (url, text) in cases {
        let err = connect_fails(&url, Duration::from_secs(5)).await;
        assert!(
            matches!(&err, Error::InvalidConfig(m) if m.contains(text)),
            "{url}: {err:?}"
        );
    }
    let half = format!("{base}?cert={}", certs.client_cert().display());
    assert!(matches!(
        fencelock_redis::connect(&half).await,
        Err(Error::InvalidConfig(m)) if m.contains("`cert` and `key` go together")
    ));
}

/// A server that requires client certificates: `ca` + `cert` + `key` locks; without the
/// client certificate the connection is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_the_client_certificate() {
    let certs = TestCertificates::generate();
    let server = RedisServer::start_tls(&certs, true);
    let with_cert = format!(
        "{}?ca={}&cert={}&key={}",
        server.url(),
        certs.ca().display(),
        certs.client_cert().display(),
        certs.client_key().display()
    );
    let locks = fencelock_redis::connect(&with_cert)
        .await
        .expect("connect with a client certificate");
    let guard = locks.lock("mtls").await.unwrap();
    assert!(guard.token().get() > 0);
    assert!(
        fencelock_redis::connect(&with_cert)
            .await
            .unwrap()
            .try_lock("mtls")
            .await
            .unwrap()
            .is_none()
    );
    guard.release().await.unwrap();

    let without_cert = format!("{}?timeout=1s&ca={}", server.url(), certs.ca().display());
    let err = connect_fails(&without_cert, Duration::from_secs(15)).await;
    assert!(!matches!(err, Error::InvalidConfig(_)), "{err:?}");
}

/// A plain client on the TLS port and a TLS client on a plain port fail cleanly, within
/// a few timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wrong_protocol_fails_in_bounded_time() {
    let (certs, server) = shared();
    let plain_to_tls = format!("redis://127.0.0.1:{}?timeout=1s", server.port());
    let err = connect_fails(&plain_to_tls, Duration::from_secs(15)).await;
    assert!(!matches!(err, Error::InvalidConfig(_)), "{err:?}");

    let plain = RedisServer::start();
    let tls_to_plain = format!(
        "rediss://127.0.0.1:{}?timeout=1s&ca={}",
        plain.port(),
        certs.ca().display()
    );
    let err = connect_fails(&tls_to_plain, Duration::from_secs(15)).await;
    assert!(!matches!(err, Error::InvalidConfig(_)), "{err:?}");
}

/// The configuration keeps the TLS paths visible and the password hidden.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_stay_hidden_over_tls() {
    let (certs, server) = shared();
    let url = format!(
        "rediss://:hunter2@127.0.0.1:{}?timeout=1s&ca={}",
        server.port(),
        certs.ca().display()
    );
    // The server has no password: AUTH fails, and neither error nor config shows it.
    let err = connect_fails(&url, Duration::from_secs(15)).await;
    assert!(!format!("{err} {err:?}").contains("hunter2"), "{err:?}");
    let config = fencelock_redis::RedisConfig::from_url(&url).unwrap();
    let shown = format!("{config:?}");
    assert!(
        !shown.contains("hunter2") && shown.contains("ca.pem"),
        "{shown}"
    );
}

/// A lock client over TLS for the conformance suite.
async fn tls_client() -> std::sync::Arc<dyn DistributedLock> {
    fencelock_redis::connect(&tls_url())
        .await
        .expect("connect rediss://")
}

mod conformance {
    fencelock_core::conformance_suite!(super::tls_client().await);
}
