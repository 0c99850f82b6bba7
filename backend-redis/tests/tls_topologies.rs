//! TLS beyond a single server: `rediss+cluster://`, `rediss+sentinel://` and `redlocks://`
//! against real TLS-only servers (`--port 0`, a private CA from the testkit) that also
//! require passwords: locking, contention, pub/sub waiting, names spread over every
//! cluster master, a Sentinel failover, wrong passwords, a plain client against TLS-only
//! nodes, bad TLS files, mutual TLS, and the conformance suite on Cluster and Sentinel.
#![cfg(feature = "tls")]

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use fencelock_core::{AcquireOptions, DistributedLock, DistributedLockExt, Error};
use fencelock_testkit::{RedisCluster, RedisSentinelSet, RedisServer, TestCertificates};

/// The password of the cluster nodes, and of the Sentinel set's master and replica.
const PASSWORD: &str = "tls-pw-8d1c";
/// The Sentinels' own password.
const SENTINEL_PASSWORD: &str = "sentinel-pw-77af";

/// The CA and certificates every shared deployment of this process uses.
fn certs() -> &'static TestCertificates {
    static CERTS: OnceLock<TestCertificates> = OnceLock::new();
    CERTS.get_or_init(TestCertificates::generate)
}

/// A TLS-only cluster of 3 masters that requires [`PASSWORD`], shared by the tests of
/// this process.
fn cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| RedisCluster::start_tls(certs(), 3, 0, Some(PASSWORD), false))
}

/// A TLS-only master + replica ([`PASSWORD`]) behind three TLS-only Sentinels
/// ([`SENTINEL_PASSWORD`]), shared by the tests of this process (none kills anything in
/// it).
fn sentinel_set() -> &'static RedisSentinelSet {
    static SET: OnceLock<RedisSentinelSet> = OnceLock::new();
    SET.get_or_init(|| {
        RedisSentinelSet::start_tls(certs(), Some(PASSWORD), Some(SENTINEL_PASSWORD), false)
    })
}

/// `url` (a `SCHEME://HOSTS[/PATH]` without user info or query) with `password` and the
/// query `options` (which may be empty).
fn with_auth(url: &str, password: &str, options: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let separator = if options.is_empty() { "" } else { "&" };
    format!(
        "{scheme}://:{password}@{rest}?ca={}{separator}{options}",
        certs().ca().display()
    )
}

fn cluster_url() -> String {
    with_auth(&cluster().url(), PASSWORD, "")
}

fn sentinel_url() -> String {
    with_auth(
        &sentinel_set().url(),
        PASSWORD,
        &format!("sentinel_password={SENTINEL_PASSWORD}"),
    )
}

/// Connects to `url`, which must fail, within `bound`; returns the error and how long
/// it took.
async fn connect_fails(url: &str, bound: Duration) -> (Error, Duration) {
    let started = Instant::now();
    let result = tokio::time::timeout(bound, fencelock_redis::connect(url))
        .await
        .unwrap_or_else(|_| panic!("connect still running after {bound:?}"));
    let err = match result {
        Ok(_) => panic!("connected"),
        Err(err) => err,
    };
    let took = started.elapsed();
    eprintln!("{:?} after {took:?}", err);
    (err, took)
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

/// Lock, contention and hand-over between two clients of `url`: the waiter is woken by
/// the unlock message (pub/sub over TLS), not by the lease running out, and tokens grow.
async fn locks_contends_and_wakes(url: &str, name: &str) {
    let first = fencelock_redis::connect(url).await.expect("connect");
    let second = fencelock_redis::connect(url).await.expect("connect");
    let guard = first
        .acquire(name, AcquireOptions::new().lease(Duration::from_secs(30)))
        .await
        .unwrap();
    let first_token = guard.token();
    assert!(first_token.get() > 0);
    assert!(second.try_lock(name).await.unwrap().is_none());

    let waiter = second.acquire(
        name,
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
    assert!(next_token > first_token, "{next_token} after {first_token}");
    next.release().await.unwrap();

    let again = first.lock(name).await.unwrap();
    assert!(again.token() > next_token);
    again.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_over_tls_with_a_password_locks_contends_and_wakes_waiters() {
    locks_contends_and_wakes(&cluster_url(), "tls-cluster-handover").await;
}

/// Names land in slots of every master, and each lock is on the master of its slot
/// while held and gone after the release: the client follows the cluster's TLS slot map.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_over_tls_spreads_names_over_every_master() {
    let cluster = cluster();
    let locks = fencelock_redis::connect(&cluster_url()).await.unwrap();
    let names: Vec<String> = (0..24).map(|i| format!("tls-spread-{i}")).collect();
    let mut guards = Vec::new();
    for name in &names {
        guards.push(locks.lock(name).await.unwrap());
    }
    let tokens: BTreeSet<u64> = guards.iter().map(|g| g.token().get()).collect();
    assert_eq!(tokens.len(), names.len(), "tokens are per grant");
    let any = &cluster.nodes()[0];
    let mut masters = BTreeSet::new();
    for name in &names {
        let key = format!("fencelock:{{{name}}}");
        let slot: u16 = cluster
            .cli(any, &["cluster", "keyslot", &key])
            .and_then(|s| s.trim().parse().ok())
            .expect("CLUSTER KEYSLOT over TLS");
        let master = cluster.master_of_slot(slot).expect("a master of the slot");
        masters.insert(master.port());
        assert_eq!(
            cluster
                .cli(master, &["exists", &key])
                .map(|s| s.trim().to_owned()),
            Some("1".to_owned()),
            "{key} on its master (port {})",
            master.port()
        );
    }
    assert_eq!(masters.len(), 3, "the names use every master: {masters:?}");
    for guard in guards {
        guard.release().await.unwrap();
    }
    for name in &names {
        assert!(locks.try_lock(name).await.unwrap().is_some(), "{name} free");
    }
}

/// A wrong password is a non-retryable error on every topology over TLS, and neither
/// it nor the right one shows in the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_passwords_over_tls_are_typed_and_hidden() {
    let wrong = "wrong-pw-5e0b";
    let cases = [
        (
            "cluster",
            with_auth(&cluster().url(), wrong, "timeout=1s&connect_timeout=3s"),
        ),
        (
            "sentinel master",
            with_auth(
                &sentinel_set().url(),
                wrong,
                &format!("timeout=1s&connect_timeout=3s&sentinel_password={SENTINEL_PASSWORD}"),
            ),
        ),
        (
            "sentinels",
            with_auth(
                &sentinel_set().url(),
                PASSWORD,
                &format!("timeout=1s&connect_timeout=3s&sentinel_password={wrong}"),
            ),
        ),
    ];
    for (what, url) in cases {
        let (err, _) = connect_fails(&url, Duration::from_secs(10)).await;
        assert!(matches!(err, Error::Backend { .. }), "{what}: {err:?}");
        assert!(!err.is_retryable(), "{what}: {err:?}");
        let shown = format!("{err} {err:?} {}", chain(&err));
        assert!(
            !shown.contains(wrong) && !shown.contains(PASSWORD),
            "{what}: {shown}"
        );
    }
}

/// Servers whose certificates do not verify (the system roots, or a CA that did not sign
/// them) are refused with a non-retryable error naming the certificate, on Cluster and
/// on Sentinel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_servers_are_refused() {
    let other = TestCertificates::generate();
    let other_ca = format!("ca={}&", other.ca().display());
    for (what, url) in [
        (cluster().url(), ""),
        (cluster().url(), other_ca.as_str()),
        (sentinel_set().url(), ""),
        (sentinel_set().url(), other_ca.as_str()),
    ]
    .iter()
    .map(|(url, ca)| {
        let (scheme, rest) = url.split_once("://").unwrap();
        let options =
            format!("{ca}timeout=1s&connect_timeout=3s&sentinel_password={SENTINEL_PASSWORD}");
        let options = if scheme.contains("sentinel") {
            options
        } else {
            options.replace(&format!("&sentinel_password={SENTINEL_PASSWORD}"), "")
        };
        (
            format!(
                "{scheme} {}",
                if ca.is_empty() {
                    "system roots"
                } else {
                    "other CA"
                }
            ),
            format!("{scheme}://:{PASSWORD}@{rest}?{options}"),
        )
    }) {
        let (err, _) = connect_fails(&url, Duration::from_secs(10)).await;
        assert!(!err.is_retryable(), "{what}: {err:?}");
        assert!(
            chain(&err).contains("certificate"),
            "{what}: {}",
            chain(&err)
        );
    }
}

/// A plain `redis+cluster://` client against TLS-only nodes fails within its
/// connect_timeout, with an error that is not mistaken for a configuration problem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_client_to_a_tls_cluster_fails_within_connect_timeout() {
    let plain = cluster()
        .url()
        .replacen("rediss+cluster://", "redis+cluster://", 1);
    let url = format!(
        "{}?connect_timeout=2s&timeout=1s",
        plain.replacen("://", &format!("://:{PASSWORD}@"), 1)
    );
    let (err, took) = connect_fails(&url, Duration::from_secs(10)).await;
    assert!(
        took < Duration::from_millis(2500),
        "took {took:?} with connect_timeout=2s"
    );
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(
        chain(&err).contains("use rediss+cluster:// instead of redis+cluster://"),
        "{}",
        chain(&err)
    );
    assert!(!format!("{err} {err:?}").contains(PASSWORD), "{err:?}");
}

/// The same for a plain `redis+sentinel://` client against TLS-only Sentinels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_client_to_tls_sentinels_fails_within_connect_timeout() {
    let plain = sentinel_set()
        .url()
        .replacen("rediss+sentinel://", "redis+sentinel://", 1);
    let url = format!(
        "{}?connect_timeout=2s&timeout=1s&sentinel_password={SENTINEL_PASSWORD}",
        plain.replacen("://", &format!("://:{PASSWORD}@"), 1)
    );
    let (err, took) = connect_fails(&url, Duration::from_secs(10)).await;
    assert!(
        took < Duration::from_millis(2500),
        "took {took:?} with connect_timeout=2s"
    );
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(
        chain(&err).contains("use rediss+sentinel://"),
        "{}",
        chain(&err)
    );
    assert!(
        !format!("{err} {err:?} {}", chain(&err)).contains(PASSWORD),
        "{err:?}"
    );
}

/// The same for a plain `redlock://` client against TLS-only instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_client_to_tls_redlock_instances_fails_within_connect_timeout() {
    let servers: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::start_tls(certs(), false))
        .collect();
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    let url = format!(
        "redlock://{}?connect_timeout=2s&timeout=1s",
        hosts.join(",")
    );
    let (err, took) = connect_fails(&url, Duration::from_secs(10)).await;
    assert!(
        took < Duration::from_millis(2500),
        "took {took:?} with connect_timeout=2s"
    );
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(chain(&err).contains("use redlocks://"), "{}", chain(&err));
}

/// Bad TLS files are configuration errors found before any connection is made, on
/// every TLS scheme (the hosts here do not exist).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tls_files_are_config_errors_before_any_io() {
    let certs = certs();
    let missing = certs.dir().join("no-such.pem");
    for scheme in ["rediss+cluster://", "rediss+sentinel://", "redlocks://"] {
        let path = if scheme.contains("sentinel") {
            "/fencelock"
        } else {
            ""
        };
        let hosts = "no-such-host.invalid:1,no-such-host.invalid:2,no-such-host.invalid:3";
        for (query, text) in [
            (format!("ca={}", missing.display()), "cannot read TLS file"),
            (
                format!("ca={}", certs.server_key().display()),
                "holds no PEM certificate",
            ),
            (
                format!(
                    "cert={}&key={}",
                    certs.client_cert().display(),
                    certs.client_cert().display()
                ),
                "no PEM private key",
            ),
        ] {
            let url = format!("{scheme}:{PASSWORD}@{hosts}{path}?{query}");
            let started = Instant::now();
            let Err(err) = fencelock_redis::connect(&url).await else {
                panic!("{url}: connected");
            };
            assert!(
                matches!(&err, Error::InvalidConfig(m) if m.contains(text)),
                "{url}: {err:?}"
            );
            assert!(started.elapsed() < Duration::from_millis(500), "{url}");
            assert!(!format!("{err} {err:?}").contains(PASSWORD));
        }
    }
}

/// A cluster that requires client certificates: with `cert` + `key` it locks, without
/// them the connection is refused (not taken for a configuration problem).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_cluster_needs_the_client_certificate() {
    let certs = TestCertificates::generate();
    let cluster = RedisCluster::start_tls(&certs, 3, 0, None, true);
    let with_cert = format!(
        "{}?ca={}&cert={}&key={}",
        cluster.url(),
        certs.ca().display(),
        certs.client_cert().display(),
        certs.client_key().display()
    );
    let locks = fencelock_redis::connect(&with_cert).await.expect("connect");
    let guard = locks.lock("tls-mtls-cluster").await.unwrap();
    assert!(locks.try_lock("tls-mtls-cluster").await.unwrap().is_none());
    guard.release().await.unwrap();

    let without_cert = format!(
        "{}?ca={}&timeout=1s&connect_timeout=3s",
        cluster.url(),
        certs.ca().display()
    );
    let (err, _) = connect_fails(&without_cert, Duration::from_secs(10)).await;
    assert!(!matches!(err, Error::InvalidConfig(_)), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_over_tls_with_passwords_locks_contends_and_wakes_waiters() {
    locks_contends_and_wakes(&sentinel_url(), "tls-sentinel-handover").await;
}

/// Redlock over three TLS-only instances with a password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_over_tls_locks_contends_and_wakes_waiters() {
    let certs = certs();
    let servers: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::start_tls_with(certs, false, &["--requirepass", PASSWORD]))
        .collect();
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    let url = with_auth(&format!("redlocks://{}", hosts.join(",")), PASSWORD, "");
    locks_contends_and_wakes(&url, "tls-redlock-handover").await;
}

/// Kills the master of `set` and waits until every Sentinel names the replica.
async fn fail_over(set: &Arc<RedisSentinelSet>) -> Duration {
    let started = Instant::now();
    let s = set.clone();
    tokio::task::spawn_blocking(move || s.master().kill())
        .await
        .unwrap();
    let want = set.replica().addr();
    loop {
        let s = set.clone();
        let want = want.clone();
        let switched = tokio::task::spawn_blocking(move || {
            s.sentinels()
                .iter()
                .all(|sentinel| sentinel.master_addr().as_deref() == Some(want.as_str()))
        })
        .await
        .unwrap();
        if switched {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the Sentinels did not switch to the replica"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// After a failover the same client locks on the new master, over TLS with the same
/// certificates and password, and a client connected afterwards sees that lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_over_tls_keeps_working_after_a_failover() {
    let set = Arc::new(
        tokio::task::spawn_blocking(|| {
            RedisSentinelSet::start_tls(certs(), Some(PASSWORD), Some(SENTINEL_PASSWORD), false)
        })
        .await
        .unwrap(),
    );
    let url = with_auth(
        &set.url(),
        PASSWORD,
        &format!("sentinel_password={SENTINEL_PASSWORD}&timeout=1s"),
    );
    let locks = fencelock_redis::connect(&url).await.unwrap();
    let before = locks.lock("tls-failover").await.unwrap();
    let before_token = before.token();
    before.release().await.unwrap();

    let took = fail_over(&set).await;
    eprintln!("failover took {took:?}");

    let started = Instant::now();
    let after = loop {
        match locks.try_lock("tls-failover").await {
            Ok(Some(guard)) => break guard,
            Ok(None) => panic!("nobody else holds tls-failover"),
            Err(e) => {
                assert!(e.is_retryable(), "{e:?}");
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "no lock on the new master: {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    eprintln!(
        "locked on the new master {:?} after the switch",
        started.elapsed()
    );
    assert!(after.token() > before_token);
    let later = fencelock_redis::connect(&url).await.unwrap();
    assert!(later.try_lock("tls-failover").await.unwrap().is_none());
    after.release().await.unwrap();
    assert!(later.try_lock("tls-failover").await.unwrap().is_some());
}

async fn cluster_client() -> Arc<dyn DistributedLock> {
    fencelock_redis::connect(&cluster_url())
        .await
        .expect("connect rediss+cluster://")
}

async fn sentinel_client() -> Arc<dyn DistributedLock> {
    fencelock_redis::connect(&sentinel_url())
        .await
        .expect("connect rediss+sentinel://")
}

mod cluster_conformance {
    fencelock_core::conformance_suite!(super::cluster_client().await);
}

mod sentinel_conformance {
    fencelock_core::conformance_suite!(super::sentinel_client().await);
}
