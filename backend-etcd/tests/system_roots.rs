//! `etcds://` without `ca=` trusts the system's root certificates. The system store is
//! stood in for by `SSL_CERT_FILE` (which `rustls-native-certs` reads), set to the test
//! CA: a test binary of its own, since the variable is process-wide.
#![cfg(feature = "tls")]
// `std::env::set_var` is unsafe in edition 2024 (other threads may read the
// environment); this binary's only test sets it before anything reads it.
#![allow(unsafe_code)]

use fencelock_core::DistributedLockExt;
use fencelock_testkit::EtcdServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcds_without_a_ca_trusts_the_system_roots() {
    let certs = fencelock_testkit::TestCertificates::generate();
    let (server, tls_port) = EtcdServer::start_tls(&certs.server_cert(), &certs.server_key());
    let url = format!("etcds://127.0.0.1:{tls_port}/roots?lease=2s&connect_timeout=3s");

    // Before the test CA is a system root, the server's certificate is not trusted.
    // SAFETY (of the test): this binary has one test; nothing else reads the environment.
    unsafe { std::env::set_var("SSL_CERT_FILE", "/nonexistent/fencelock-no-roots.pem") };
    let refused = fencelock_etcd::connect(&url)
        .await
        .expect_err("connected with no root to trust the server's certificate by");
    // Not just any failure (a refused connection, a timeout): the certificate's.
    let chain: Vec<String> =
        std::iter::successors(Some(&refused as &dyn std::error::Error), |e| e.source())
            .map(ToString::to_string)
            .collect();
    assert!(
        chain
            .iter()
            .any(|e| e.contains("invalid peer certificate") && e.contains("UnknownIssuer")),
        "not the server's certificate refused as of an unknown issuer: {chain:?}"
    );

    unsafe { std::env::set_var("SSL_CERT_FILE", certs.ca()) };
    let locks = fencelock_etcd::connect(&url)
        .await
        .expect("trusted through the system roots");
    let guard = locks.lock("roots").await.unwrap();
    guard.release().await.unwrap();
    drop(server);
}
