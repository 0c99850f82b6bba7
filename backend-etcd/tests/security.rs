//! TLS (`etcds://`) and user/password authentication against real etcd servers.

use std::process::Command;
use std::time::Duration;

use fencelock_core::{DistributedLockExt, Error};
use fencelock_etcd::{EtcdConfig, EtcdLock};
use fencelock_testkit::EtcdServer;

#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcds_urls_lock_over_tls_and_verify_the_server() {
    let certs = fencelock_testkit::TestCertificates::generate();
    let (server, tls_port) = EtcdServer::start_tls(&certs.server_cert(), &certs.server_key());
    let ca = certs.ca();
    let url = format!(
        "etcds://127.0.0.1:{tls_port}/secure?ca={}&lease=2s",
        ca.display()
    );
    let locks = fencelock_etcd::connect(&url)
        .await
        .expect("connect over TLS");
    let guard = locks.lock("tls").await.unwrap();
    assert!(guard.token().get() > 0);
    guard.release().await.unwrap();

    // Without the CA the server's certificate is not trusted: a clear failure, no lock.
    let untrusted = format!("etcds://127.0.0.1:{tls_port}/secure?lease=2s&connect_timeout=2s");
    assert!(fencelock_etcd::connect(&untrusted).await.is_err());
    // A plain etcd:// URL to the TLS port fails too.
    let plain = format!("etcd://127.0.0.1:{tls_port}/secure?lease=2s&connect_timeout=2s");
    assert!(fencelock_etcd::connect(&plain).await.is_err());
    drop(server);
}

#[cfg(not(feature = "tls"))]
#[tokio::test]
async fn etcds_without_the_tls_feature_is_a_clear_config_error() {
    let err = fencelock_etcd::connect("etcds://127.0.0.1:1/p")
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidConfig(m) if m.contains("tls")),
        "{err:?}"
    );
}

fn etcdctl(server: &EtcdServer, args: &[&str]) {
    let status = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg("--endpoints")
        .arg(server.endpoint())
        .args(args)
        .status()
        .expect("etcdctl runs");
    assert!(status.success(), "etcdctl {args:?} failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_are_checked_at_connect_and_never_shown() {
    let server = EtcdServer::start();
    etcdctl(&server, &["user", "add", "root:s3cret-root"]);
    etcdctl(&server, &["user", "add", "app:s3cret-app"]);
    etcdctl(&server, &["role", "add", "locks"]);
    etcdctl(
        &server,
        &[
            "role",
            "grant-permission",
            "locks",
            "--prefix=true",
            "readwrite",
            "auth/",
        ],
    );
    etcdctl(&server, &["user", "grant-role", "app", "locks"]);
    etcdctl(&server, &["auth", "enable"]);

    let config = |user: &str, password: &str| EtcdConfig {
        endpoints: vec![server.endpoint()],
        prefix: "auth".into(),
        lease: Duration::from_secs(2),
        user: Some(user.into()),
        password: Some(password.into()),
        connect_timeout: Duration::from_secs(3),
        ..EtcdConfig::default()
    };
    let locks = EtcdLock::connect(config("app", "s3cret-app"))
        .await
        .expect("the right password works");
    let guard = locks.lock("job").await.unwrap();
    guard.release().await.unwrap();

    let err = EtcdLock::connect(config("app", "wrong-password"))
        .await
        .unwrap_err();
    assert!(
        !err.is_retryable(),
        "a wrong password is not worth retrying: {err:?}"
    );
    let shown = format!("{err} {err:?} {:?}", config("app", "wrong-password"));
    assert!(
        !shown.contains("wrong-password") && !shown.contains("s3cret"),
        "{shown}"
    );

    let url = format!(
        "etcd://app:wrong-password@{}/auth?lease=2s",
        server.endpoint()
    );
    let err = fencelock_etcd::connect(&url).await.unwrap_err();
    assert!(!format!("{err} {err:?}").contains("wrong-password"));
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
}
