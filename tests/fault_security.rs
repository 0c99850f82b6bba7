//! F23, authentication, authorisation and TLS failures are hard errors, on real servers.
//!
//! Redis (every server is dedicated to its test, so the server's own counters show what
//! the client did):
//!
//! - an ACL user with a wrong password, while the `default` user has no password (the
//!   S-R2 pitfall: a client that carried on after its failed `AUTH` would run as
//!   `default` with every right): `connect` fails with a non-retryable error, and the
//!   server shows no command but `AUTH` from it (`INFO commandstats`, `ACL LOG`,
//!   `CLIENT LIST`); on a single server, Redlock, Cluster and Sentinel;
//! - the same with a database number in the URL, whose `SELECT` must not run either;
//! - the whole conformance suite as a least-privilege ACL user (the line documented in
//!   backend-redis/README.md), and the Cluster and Sentinel additions to it;
//! - a user whose ACL does not cover the key prefix: a non-retryable `NOPERM` error,
//!   nothing created, and the holder's key out of its reach;
//! - `requirepass`/`masterauth` on Sentinel (with a failover) and Cluster deployments;
//!   Sentinels that require a password themselves;
//! - TLS with a server certificate for another name than the URL's host.
//!
//! etcd (RBAC): another user cannot take or delete a user's lock key; a prefix outside
//! the user's role is a prompt, non-retryable permission error that creates nothing; a
//! refused name costs the client none of its other locks; TLS with a certificate for
//! another name.
//!
//! Every refusal of credentials or of a certificate must be a non-retryable
//! `Error::Backend`; tests check that last, after what the servers saw.
#![cfg(all(feature = "etcd", feature = "redis"))]

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::{Duration, Instant};

use fencelock::{AcquireOptions, DistributedLock, DistributedLockExt, Error};
use fencelock_testkit::{EtcdServer, RedisCluster, RedisSentinelSet, RedisServer};

/// The ACL rules of the least-privilege user on a single server or Redlock instance, as
/// in backend-redis/README.md ("Least-privilege ACL").
const LEAST_PRIVILEGE: &str = "~fencelock:* &fencelock:* -@all +evalsha +eval +ping \
                               +get +set +del +pexpire +pttl +time +publish +subscribe \
                               +unsubscribe +hgetall +hset +hdel +hlen +hexists";
/// What Redis Cluster needs on top (redis-rs asks for the slot map and sends `READONLY`,
/// whose refusal it ignores, on every node connection).
const CLUSTER_EXTRA: &str = "+cluster|slots +readonly";
/// What `list` needs on top (an operator's command: a service taking locks does without).
const OPERATOR_EXTRA: &str = "+scan";
/// What a Sentinel-found master needs on top (redis-rs checks the master's `ROLE`).
const SENTINEL_EXTRA: &str = "+role";

/// The commands a client may send before and including its `AUTH`.
const HANDSHAKE: [&str; 2] = ["auth", "hello"];

/// Commands a lock client sends once connected, but the Sentinels and replicas of a
/// deployment never do (they send `PING`, `INFO`, `PUBLISH`, `REPLCONF`, ...).
const LOCK_CLIENT_COMMANDS: &[&str] = &[
    "evalsha",
    "eval",
    "script|load",
    "role",
    "select",
    "client|setinfo",
    "client|setname",
    "cluster|slots",
    "cluster|shards",
    "cluster|nodes",
    "readonly",
    "get",
    "set",
    "subscribe",
];

type Conn = redis::aio::MultiplexedConnection;

/// A raw connection to `url` (as `default` unless the URL names a user).
async fn raw(url: &str) -> Conn {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"))
}

/// `redis://[:password@]127.0.0.1:PORT` of `server`.
fn admin_url(server: &RedisServer, password: Option<&str>) -> String {
    match password {
        Some(password) => format!("redis://:{password}@127.0.0.1:{}", server.port()),
        None => server.url(),
    }
}

/// `ACL SETUSER user reset on >password rules...`.
async fn acl_setuser(conn: &mut Conn, user: &str, password: &str, rules: &str) {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER")
        .arg(user)
        .arg("reset")
        .arg("on")
        .arg(format!(">{password}"));
    for rule in rules.split_whitespace() {
        cmd.arg(rule);
    }
    let () = cmd.query_async(conn).await.unwrap();
}

/// Clears the command statistics and the ACL log.
async fn reset_stats(conn: &mut Conn) {
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(conn)
        .await
        .unwrap();
    let () = redis::cmd("ACL")
        .arg("LOG")
        .arg("RESET")
        .query_async(conn)
        .await
        .unwrap();
}

/// One command's counters in `INFO commandstats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counted {
    /// Executed.
    calls: u64,
    /// Refused before running (`NOAUTH`, `NOPERM`, ...).
    rejected: u64,
    /// Ran and failed (a failed `AUTH`).
    failed: u64,
}

impl Counted {
    /// Every time the command was sent.
    fn sent(self) -> u64 {
        self.calls + self.rejected + self.failed
    }
}

/// `INFO commandstats` by command, with the commands of the test's own admin connection
/// (`INFO`, `ACL ...`, `CONFIG RESETSTAT`, `CLIENT LIST`, `WAIT`) left out.
async fn commands_seen(conn: &mut Conn) -> BTreeMap<String, Counted> {
    let text: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    text.lines()
        .filter_map(|line| {
            let (name, fields) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let field = |key: &str| {
                fields
                    .split(',')
                    .filter_map(|f| f.split_once('='))
                    .find(|(k, _)| *k == key)
                    .and_then(|(_, v)| v.parse().ok())
                    .unwrap_or(0)
            };
            let counted = Counted {
                calls: field("calls"),
                rejected: field("rejected_calls"),
                failed: field("failed_calls"),
            };
            Some((name.to_owned(), counted))
        })
        .filter(|(name, _)| {
            !(name == "info"
                || name.starts_with("acl|")
                || name == "config|resetstat"
                || name == "client|list"
                || name == "wait")
        })
        .collect()
}

/// The value as text, for ACL LOG entries.
fn text(value: &redis::Value) -> String {
    match value {
        redis::Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        redis::Value::Int(n) => n.to_string(),
        other => format!("{other:?}"),
    }
}

/// `ACL LOG`: one map per entry (`reason`, `object`, `username`, ...).
async fn acl_log(conn: &mut Conn) -> Vec<BTreeMap<String, String>> {
    let log: redis::Value = redis::cmd("ACL")
        .arg("LOG")
        .query_async(conn)
        .await
        .unwrap();
    let redis::Value::Array(entries) = log else {
        panic!("ACL LOG: {log:?}");
    };
    entries
        .iter()
        .map(|entry| match entry {
            redis::Value::Array(fields) => fields
                .chunks(2)
                .map(|pair| (text(&pair[0]), text(&pair[1])))
                .collect(),
            redis::Value::Map(pairs) => pairs.iter().map(|(k, v)| (text(k), text(v))).collect(),
            other => panic!("ACL LOG entry: {other:?}"),
        })
        .collect()
}

/// Waits until `CLIENT LIST` shows no connection but the admin's own: the client whose
/// AUTH failed has closed its connections.
async fn only_admin_connected(conn: &mut Conn) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .arg("TYPE")
            .arg("normal")
            .query_async(conn)
            .await
            .unwrap();
        let others: Vec<&str> = list
            .lines()
            .filter(|l| !l.contains("cmd=client|list"))
            .collect();
        if others.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "connections left open after the failed AUTH: {others:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The error and its sources, for matching on the cause.
fn chain(err: &Error) -> String {
    let mut text = format!("{err}");
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// A `connect` that failed.
struct Refused {
    /// The URL, password redacted.
    url: String,
    err: Error,
}

/// Connects to `url`, which must fail within 15 s, with an error that never shows
/// `secret`.
async fn connect_fails(url: &str, secret: &str) -> Refused {
    let shown_url = fencelock::redact_url(url);
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(15), fencelock::connect(url))
        .await
        .unwrap_or_else(|_| panic!("{shown_url}: connect still running after 15 s"));
    let err = match result {
        Ok(_) => panic!("{shown_url}: connected"),
        Err(err) => err,
    };
    println!("{shown_url}: {} after {:?}", chain(&err), started.elapsed());
    let shown = format!("{err} {err:?} {}", chain(&err));
    assert!(!shown.contains(secret), "the secret is shown: {shown}");
    Refused {
        url: shown_url,
        err,
    }
}

/// Asserts that every refusal is a non-retryable [`Error::Backend`]: wrong credentials
/// and a rejected certificate are configuration problems that retrying cannot fix.
fn assert_hard(refused: &[&Refused]) {
    let soft: Vec<String> = refused
        .iter()
        .filter(|r| !matches!(r.err, Error::Backend { .. }) || r.err.is_retryable())
        .map(|r| format!("{}: {:?}", r.url, r.err))
        .collect();
    assert!(
        soft.is_empty(),
        "a credentials or certificate problem must be a non-retryable Error::Backend, not: \
         {soft:#?}"
    );
}

/// [`connect_fails`] and [`assert_hard`].
async fn connect_fails_hard(url: &str, secret: &str) -> Refused {
    let refused = connect_fails(url, secret).await;
    assert_hard(&[&refused]);
    refused
}

/// Asserts that `commands` (from [`commands_seen`]) hold nothing but the handshake (no
/// other command was even sent), and at least one failed `AUTH`.
fn only_handshake(where_: &str, commands: &BTreeMap<String, Counted>) {
    let others: Vec<_> = commands
        .iter()
        .filter(|(name, counted)| !HANDSHAKE.contains(&name.as_str()) && counted.sent() > 0)
        .collect();
    assert!(
        others.is_empty(),
        "{where_}: commands were sent after the failed AUTH: {others:?} (all: {commands:?})"
    );
    assert!(
        commands.get("auth").is_some_and(|c| c.failed >= 1),
        "{where_}: no failed AUTH reached the server: {commands:?}"
    );
}

/// Asserts that none of `forbidden` was sent (`executed_only`: executed) per `commands`.
fn none_of(
    where_: &str,
    commands: &BTreeMap<String, Counted>,
    forbidden: &[&str],
    executed_only: bool,
) {
    for command in forbidden {
        let counted = commands.get(*command).copied().unwrap_or_default();
        let n = if executed_only {
            counted.calls
        } else {
            counted.sent()
        };
        assert_eq!(
            n,
            0,
            "{where_}: {command} {} ({commands:?})",
            if executed_only { "ran" } else { "was sent" }
        );
    }
}

/// Asserts that the ACL log holds only failed authentications of `user`.
fn only_auth_failures(where_: &str, log: &[BTreeMap<String, String>], user: &str) {
    assert!(!log.is_empty(), "{where_}: the failed AUTH is not logged");
    for entry in log {
        assert_eq!(
            entry.get("reason").map(String::as_str),
            Some("auth"),
            "{where_}: {entry:?}"
        );
        assert_eq!(
            entry.get("username").map(String::as_str),
            Some(user),
            "{where_}: {entry:?}"
        );
    }
}

/// A lock and release through `locks`, and a waiter on another client woken by the
/// unlock message (pub/sub), all within a few seconds.
async fn lock_handover(first: &dyn DistributedLock, second: &dyn DistributedLock, name: &str) {
    let guard = first.lock(name).await.expect("lock");
    let token = guard.token();
    assert!(second.try_lock(name).await.unwrap().is_none());
    let waiter = second.acquire(
        name,
        AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
    );
    let release = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let released = Instant::now();
        guard.release().await.expect("release");
        released
    };
    let (next, released) = tokio::join!(waiter, release);
    let next = next.expect("the waiter gets the lock");
    assert!(
        released.elapsed() < Duration::from_secs(2),
        "the waiter took {:?} after the release: no unlock message?",
        released.elapsed()
    );
    assert!(next.token() > token);
    next.release().await.expect("release");
}

// ---------------------------------------------------------------------------------------
// Redis: a failed AUTH is fatal, also when `default` has no password.
// ---------------------------------------------------------------------------------------

/// `default` is `on nopass +@all` (a fresh server); `app` is a least-privilege user with
/// a password. Connecting as `app` with a wrong password fails at `connect` with a
/// non-retryable error, and the server saw nothing from the client but its `AUTH`
/// attempts: no `PING`, no script, no `SELECT`, no `CLIENT SETINFO` run as `default`.
/// The connection is closed. The right password then works, and the same counters show
/// the lock commands (so they would have shown them before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_redis_wrong_acl_password_runs_nothing_although_default_needs_none() {
    let server = RedisServer::start();
    let mut admin = raw(&server.url()).await;
    acl_setuser(&mut admin, "app", "right-pw", LEAST_PRIVILEGE).await;
    let port = server.port();
    for url in [
        format!("redis://app:wrong-pw@127.0.0.1:{port}"),
        // A database number: redis-rs pipelines SELECT behind AUTH on a connection.
        format!("redis://app:wrong-pw@127.0.0.1:{port}/3"),
        format!("redlock://app:wrong-pw@127.0.0.1:{port}"),
    ] {
        reset_stats(&mut admin).await;
        connect_fails_hard(&url, "wrong-pw").await;
        only_admin_connected(&mut admin).await;
        let commands = commands_seen(&mut admin).await;
        only_handshake(&fencelock::redact_url(&url), &commands);
        let log = acl_log(&mut admin).await;
        only_auth_failures(&fencelock::redact_url(&url), &log, "app");
    }

    // The control: the right password works, and the counters see the lock commands.
    reset_stats(&mut admin).await;
    let url = format!("redis://app:right-pw@127.0.0.1:{port}");
    let locks = fencelock::connect(&url).await.expect("the right password");
    let guard = locks.lock("auth-ok").await.unwrap();
    guard.release().await.unwrap();
    let commands = commands_seen(&mut admin).await;
    assert!(
        commands.contains_key("evalsha") && commands.contains_key("ping"),
        "{commands:?}"
    );
    assert!(acl_log(&mut admin).await.is_empty());
}

/// Cluster, `default` without a password and `app` on every node: a wrong password fails
/// `connect` with nothing but `AUTH` sent to any node (no `CLUSTER SLOTS`, no `READONLY`),
/// and its connections closed. The right password works with the least-privilege rules
/// plus [`CLUSTER_EXTRA`], and nothing is refused (the ACL log holds only the failed
/// logins). Last, the refusal must be a non-retryable error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_redis_cluster_wrong_acl_password_runs_nothing() {
    // Masters only, so no replication traffic in the counters.
    let cluster = RedisCluster::start(3);
    let mut admins = Vec::new();
    for node in cluster.nodes() {
        let mut admin = raw(&node.url()).await;
        let rules = format!("{LEAST_PRIVILEGE} {CLUSTER_EXTRA}");
        acl_setuser(&mut admin, "app", "right-pw", &rules).await;
        reset_stats(&mut admin).await;
        admins.push(admin);
    }
    let hosts: Vec<String> = cluster.nodes().iter().map(RedisServer::addr).collect();
    let url = |password: &str| format!("redis+cluster://app:{password}@{}", hosts.join(","));
    let refused = connect_fails(&url("wrong-pw"), "wrong-pw").await;
    let mut auths = 0;
    for (node, admin) in cluster.nodes().iter().zip(&mut admins) {
        only_admin_connected(admin).await;
        let commands = commands_seen(admin).await;
        let others: Vec<_> = commands
            .iter()
            .filter(|(name, counted)| !HANDSHAKE.contains(&name.as_str()) && counted.sent() > 0)
            .collect();
        assert!(
            others.is_empty(),
            "cluster node {}: commands were sent after the failed AUTH: {others:?}",
            node.addr()
        );
        auths += commands.get("auth").map_or(0, |c| c.failed);
        // A node the client gave up on before trying may have seen nothing at all.
        only_auth_failures_or_none(&acl_log(admin).await, "app");
    }
    assert!(auths >= 1, "no failed AUTH on any node");

    let first = fencelock::connect(&url("right-pw")).await.expect("cluster");
    let second = fencelock::connect(&url("right-pw")).await.expect("cluster");
    lock_handover(&*first, &*second, "acl-cluster").await;
    for admin in &mut admins {
        only_auth_failures_or_none(&acl_log(admin).await, "app");
    }
    assert_hard(&[&refused]);
}

/// Sentinel, `default` without a password and `app` on the master and the replica: a
/// wrong password fails `connect`, and no command of a lock client (`ROLE`, a script,
/// ...) reaches the master (the Sentinels and the replica talk to it too, so only those
/// are looked for). The right password works with the least-privilege rules plus
/// [`SENTINEL_EXTRA`], and nothing is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_redis_sentinel_wrong_acl_password_runs_nothing() {
    let set = RedisSentinelSet::start();
    let mut master = raw(&set.master().url()).await;
    for node in [set.master(), set.replica()] {
        let mut admin = raw(&node.url()).await;
        // `+select` for the database-number case.
        let rules = format!("{LEAST_PRIVILEGE} {SENTINEL_EXTRA} +select");
        acl_setuser(&mut admin, "app", "right-pw", &rules).await;
    }
    reset_stats(&mut master).await;
    let url = |password: &str| {
        set.url().replace(
            "redis+sentinel://",
            &format!("redis+sentinel://app:{password}@"),
        )
    };
    let refused = connect_fails(&url("wrong-pw"), "wrong-pw").await;
    // A database number: redis-rs pipelines SELECT behind AUTH on a connection.
    let refused_db = connect_fails(&format!("{}?db=3", url("wrong-pw")), "wrong-pw").await;
    let commands = commands_seen(&mut master).await;
    none_of("sentinel master", &commands, LOCK_CLIENT_COMMANDS, false);
    assert!(
        commands.get("auth").is_some_and(|c| c.failed >= 1),
        "{commands:?}"
    );
    only_auth_failures("sentinel master", &acl_log(&mut master).await, "app");

    let first = fencelock::connect(&url("right-pw"))
        .await
        .expect("sentinel");
    let second = fencelock::connect(&url("right-pw"))
        .await
        .expect("sentinel");
    lock_handover(&*first, &*second, "acl-sentinel").await;
    only_auth_failures("sentinel master", &acl_log(&mut master).await, "app");
    let db = fencelock::connect(&format!("{}?db=3", url("right-pw")))
        .await
        .expect("sentinel, database 3");
    db.lock("acl-sentinel-db")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    assert_hard(&[&refused, &refused_db]);
}

/// Like [`only_auth_failures`], but an empty log is fine.
fn only_auth_failures_or_none(log: &[BTreeMap<String, String>], user: &str) {
    if !log.is_empty() {
        only_auth_failures("cluster node", log, user);
    }
}

// ---------------------------------------------------------------------------------------
// Redis: least privilege.
// ---------------------------------------------------------------------------------------

/// The whole conformance suite as `app`, a user with [`LEAST_PRIVILEGE`] only, on a
/// server whose `default` user keeps its full rights (for the test's own checks).
mod redis_least_privilege {
    use std::sync::OnceLock;

    use fencelock_testkit::RedisServer;

    pub(crate) fn url() -> String {
        static SERVER: OnceLock<RedisServer> = OnceLock::new();
        let server = SERVER.get_or_init(|| {
            let server = RedisServer::start();
            let output = std::process::Command::new("redis-cli")
                .args(["-p", &server.port().to_string()])
                .args(["ACL", "SETUSER", "app", "reset", "on", ">app-pw"])
                .args(super::LEAST_PRIVILEGE.split_whitespace())
                .arg(super::OPERATOR_EXTRA)
                .output()
                .expect("redis-cli runs");
            assert!(
                String::from_utf8_lossy(&output.stdout).starts_with("OK"),
                "ACL SETUSER: {output:?}"
            );
            server
        });
        format!("redis://app:app-pw@127.0.0.1:{}", server.port())
    }

    fencelock_core::conformance_suite!(
        fencelock::connect(&url())
            .await
            .expect("connect as the least-privilege user")
    );
}

/// `narrow` has the least-privilege commands, but on `other:*` keys and channels only,
/// while the client uses the default prefix `fencelock:`. It connects (`PING` needs no
/// key), but every lock operation is a non-retryable error naming the missing
/// permission, promptly (a waiting acquire does not wait for its timeout), and creates
/// nothing. It cannot delete the key of `app`, who holds the lock; `app` keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_redis_user_outside_the_key_prefix_gets_noperm() {
    let server = RedisServer::start();
    let port = server.port();
    let mut admin = raw(&server.url()).await;
    acl_setuser(&mut admin, "app", "app-pw", LEAST_PRIVILEGE).await;
    let narrow_rules = LEAST_PRIVILEGE.replace("fencelock:", "other:");
    acl_setuser(&mut admin, "narrow", "narrow-pw", &narrow_rules).await;

    let app = fencelock::connect(&format!("redis://app:app-pw@127.0.0.1:{port}"))
        .await
        .unwrap();
    let held = app.lock("orders").await.unwrap();
    let narrow = fencelock::connect(&format!("redis://narrow:narrow-pw@127.0.0.1:{port}"))
        .await
        .expect("narrow connects: PING needs no key");
    reset_stats(&mut admin).await;

    let denied = |what: &str, err: Error| {
        println!("{what}: {}", chain(&err));
        assert!(
            matches!(err, Error::Backend { .. }) && !err.is_retryable(),
            "{what}: {err:?}"
        );
        assert!(
            chain(&err).contains("NOPERM") || chain(&err).contains("no permissions"),
            "{what}: {}",
            chain(&err)
        );
    };
    denied(
        "try_lock on a free name",
        narrow.try_lock("invoices").await.unwrap_err(),
    );
    denied(
        "try_lock on a held name",
        narrow.try_lock("orders").await.unwrap_err(),
    );
    let started = Instant::now();
    let waiting = narrow
        .acquire(
            "orders",
            AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
        )
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "a refused acquire waited {:?}",
        started.elapsed()
    );
    denied("waiting acquire", waiting);
    denied("inspect", narrow.inspect("orders").await.unwrap_err());

    // As `narrow`, by hand: the holder's key cannot be deleted or overwritten.
    let mut by_hand = raw(&format!("redis://narrow:narrow-pw@127.0.0.1:{port}")).await;
    for cmd in [
        redis::cmd("DEL").arg("fencelock:{orders}").clone(),
        redis::cmd("SET")
            .arg("fencelock:{orders}")
            .arg("mine")
            .clone(),
    ] {
        let err = cmd
            .query_async::<redis::Value>(&mut by_hand)
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some("NOPERM"), "{err:?}");
    }

    // Nothing was created, and the holder is untouched.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut admin)
        .await
        .unwrap();
    let keys: BTreeSet<String> = keys.into_iter().collect();
    let expected: BTreeSet<String> = ["fencelock:{orders}", "fencelock:{orders}:token"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(keys, expected, "keys besides the holder's");
    let log = acl_log(&mut admin).await;
    assert!(!log.is_empty());
    for entry in &log {
        assert_eq!(entry.get("username").map(String::as_str), Some("narrow"));
        assert!(
            matches!(
                entry.get("reason").map(String::as_str),
                Some("key" | "channel")
            ),
            "{entry:?}"
        );
    }
    assert!(!held.is_lost());
    let info = app.inspect("orders").await.unwrap();
    assert_eq!(
        info.holder.as_ref().map(|h| h.token),
        Some(held.token()),
        "{info:?}"
    );
    held.release().await.expect("the holder releases");
}

// ---------------------------------------------------------------------------------------
// Redis: Sentinel and Cluster with passwords.
// ---------------------------------------------------------------------------------------

/// Master and replica with `requirepass` and `masterauth`, Sentinels with `auth-pass`
/// (the Sentinels themselves open). The password in the URL is used for the master:
/// locks and pub/sub hand-over work; a wrong or missing password fails `connect`
/// (non-retryable) before any lock command. After a failover (the master SIGKILLed, the
/// replica promoted) the client finds the new master and authenticates to it: a lock
/// replicated before the failover is still held there, and new locks work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_redis_sentinel_with_passwords() {
    let set = RedisSentinelSet::start_with_password("s3cret-master", None);
    let url = |userinfo: &str| {
        set.url()
            .replace("redis+sentinel://", &format!("redis+sentinel://{userinfo}"))
    };
    let mut master = raw(&admin_url(set.master(), set.password())).await;
    reset_stats(&mut master).await;
    connect_fails_hard(&url(":wrong-one@"), "wrong-one").await;
    let commands = commands_seen(&mut master).await;
    none_of("wrong password", &commands, LOCK_CLIENT_COMMANDS, false);
    assert!(
        commands.get("auth").is_some_and(|c| c.failed >= 1),
        "{commands:?}"
    );
    // Without a password nothing can run (the client may be refused a command).
    reset_stats(&mut master).await;
    connect_fails_hard(&url(""), "s3cret-master").await;
    let commands = commands_seen(&mut master).await;
    none_of("no password", &commands, LOCK_CLIENT_COMMANDS, true);

    let first = fencelock::connect(&url(":s3cret-master@"))
        .await
        .expect("the right password");
    assert!(!format!("{first:?}").contains("s3cret"));
    let second = fencelock::connect(&url(":s3cret-master@")).await.unwrap();
    lock_handover(&*first, &*second, "sentinel-auth").await;

    // A grant that reached the replica survives the failover. Its lease (15 s, renewed
    // every 5 s) outlasts the failover, so the holder renews it on the new master.
    let lease = Duration::from_secs(15);
    let kept = first
        .acquire("kept", AcquireOptions::new().lease(lease))
        .await
        .unwrap();
    let granted_until = kept.valid_until();
    // `WAIT` counts acknowledgements of its own client's writes: a probe write first
    // (the replication stream is in order).
    let () = redis::cmd("SET")
        .arg("probe")
        .arg(1)
        .query_async(&mut master)
        .await
        .unwrap();
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(2000)
        .query_async(&mut master)
        .await
        .unwrap();
    assert_eq!(acked, 1, "the replica did not acknowledge the grant");
    set.master().kill();
    let want = set.replica().addr();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !set
        .sentinels()
        .iter()
        .all(|s| s.master_addr().as_deref() == Some(want.as_str()))
    {
        assert!(Instant::now() < deadline, "no failover within 20 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = fencelock::connect(&url(":s3cret-master@"))
        .await
        .expect("connect after the failover");
    let deadline = Instant::now() + Duration::from_secs(10);
    let next = loop {
        match after.try_lock("after-failover").await {
            Ok(guard) => break guard.expect("a fresh name is free"),
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("lock on the promoted master: {e:?}"),
        }
    };
    assert!(next.token() > kept.token());
    assert!(
        after.try_lock("kept").await.unwrap().is_none(),
        "the replicated grant was lost in the failover"
    );
    next.release().await.unwrap();
    // The first client, connected to the old master, also finds the new one.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match second.try_lock("second-after-failover").await {
            Ok(guard) => {
                guard.expect("free").release().await.unwrap();
                break;
            }
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the old client on the promoted master: {e:?}"),
        }
    }
    // The holder's client re-resolves the master and authenticates to it: renewals
    // go on there.
    let deadline = Instant::now() + lease;
    while kept.valid_until() <= granted_until + Duration::from_secs(1) {
        assert!(
            !kept.is_lost() && Instant::now() < deadline,
            "no renewal on the promoted master: {:?}",
            kept.lost_reason()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    kept.release()
        .await
        .expect("release on the promoted master");
}

/// Sentinels that require a password themselves (`requirepass` on the Sentinels), other
/// than the master's. `sentinel_password=` is sent to the Sentinels, the URL's password
/// to the master. Without it, or with a wrong one, `connect` fails with a non-retryable
/// error and nothing reaches the master; the secret never shows. With it, locks and a
/// pub/sub hand-over work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_redis_password_protected_sentinels() {
    let set = RedisSentinelSet::start_with_password("s3cret-master", Some("s3cret-sentinel"));
    let mut master = raw(&admin_url(set.master(), set.password())).await;
    reset_stats(&mut master).await;
    let url = set
        .url()
        .replace("redis+sentinel://", "redis+sentinel://:s3cret-master@");
    let missing = connect_fails(&url, "s3cret-master").await;
    assert!(
        chain(&missing.err).contains("NOAUTH"),
        "{}",
        chain(&missing.err)
    );
    let wrong = connect_fails(&format!("{url}?sentinel_password=not-it"), "not-it").await;
    let commands = commands_seen(&mut master).await;
    none_of("master", &commands, LOCK_CLIENT_COMMANDS, true);
    // A deployment the client cannot use is a hard error, not one to retry forever.
    assert_hard(&[&missing, &wrong]);

    let right = format!("{url}?sentinel_password=s3cret-sentinel");
    let first = fencelock::connect(&right)
        .await
        .expect("the Sentinels' password");
    let shown = format!("{first:?}");
    assert!(!shown.contains("s3cret"), "{shown}");
    let second = fencelock::connect(&right).await.unwrap();
    lock_handover(&*first, &*second, "sentinel-pass").await;
}

/// A Cluster of 3 masters with a replica each, every node with `requirepass` and
/// `masterauth` (the replicas synced with it). The URL's password reaches every node:
/// locks on names spread over the slots, and a pub/sub hand-over. A wrong or missing
/// password fails `connect` (non-retryable), and no node ran a cluster or lock command
/// for that client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_redis_cluster_with_passwords() {
    let cluster = RedisCluster::start_with_password(3, 1, "s3cret-cluster");
    let mut admins = Vec::new();
    for node in cluster.nodes().iter().chain(cluster.replicas()) {
        let mut admin = raw(&admin_url(node, cluster.password())).await;
        reset_stats(&mut admin).await;
        admins.push(admin);
    }
    let hosts: Vec<String> = cluster.nodes().iter().map(RedisServer::addr).collect();
    let url = |userinfo: &str| format!("redis+cluster://{userinfo}{}", hosts.join(","));
    let wrong = connect_fails(&url(":wrong-one@"), "wrong-one").await;
    for admin in &mut admins {
        let commands = commands_seen(admin).await;
        none_of("wrong password", &commands, LOCK_CLIENT_COMMANDS, false);
        reset_stats(admin).await;
    }
    let missing = connect_fails(&url(""), "s3cret-cluster").await;
    for admin in &mut admins {
        let commands = commands_seen(admin).await;
        none_of("no password", &commands, LOCK_CLIENT_COMMANDS, true);
    }

    let first = fencelock::connect(&url(":s3cret-cluster@"))
        .await
        .expect("the right password");
    assert!(!format!("{first:?}").contains("s3cret"));
    let second = fencelock::connect(&url(":s3cret-cluster@")).await.unwrap();
    let mut guards = Vec::new();
    for i in 0..12 {
        guards.push(first.lock(&format!("spread-{i}")).await.unwrap());
    }
    for guard in guards {
        guard.release().await.unwrap();
    }
    lock_handover(&*first, &*second, "cluster-auth").await;
    assert_hard(&[&wrong, &missing]);
}

// ---------------------------------------------------------------------------------------
// Redis: TLS with a certificate for another name.
// ---------------------------------------------------------------------------------------

/// The server's certificate is signed by the trusted CA but valid only for `localhost`;
/// the URL names `127.0.0.1`. `connect` fails with a non-retryable error naming the
/// certificate, without falling back to plaintext (the server, TLS-only, counted no
/// command). By `localhost`, the name in the certificate, the same client settings work.
#[cfg(feature = "redis-tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_redis_tls_certificate_for_another_name_is_refused() {
    use fencelock_testkit::TestCertificates;

    let certs = TestCertificates::generate_for("DNS:localhost");
    let server = RedisServer::start_tls(&certs, false);
    let ca = certs.ca().display().to_string();
    let url = format!(
        "rediss://:tls-pw@127.0.0.1:{}?ca={ca}&timeout=2s",
        server.port()
    );
    let refused = connect_fails_hard(&url, "tls-pw").await;
    let text = chain(&refused.err);
    assert!(text.contains("certificate not valid for name"), "{text}");
    let stats = redis_cli_tls(&certs, server.port(), &["INFO", "commandstats"]);
    let commands: Vec<&str> = stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_") && !l.starts_with("cmdstat_info:"))
        .collect();
    assert!(
        commands.is_empty(),
        "commands ran over the refused connection: {commands:?}"
    );

    let by_name = format!("rediss://localhost:{}?ca={ca}", server.port());
    let locks = fencelock::connect(&by_name)
        .await
        .expect("the name in the certificate works");
    let guard = locks.lock("tls-name").await.unwrap();
    guard.release().await.unwrap();
}

/// `redis-cli --tls` against `127.0.0.1:port`, trusting `certs`' CA but not checking
/// the server's name (`--insecure`: the certificate is for `localhost`).
#[cfg(feature = "redis-tls")]
fn redis_cli_tls(certs: &fencelock_testkit::TestCertificates, port: u16, args: &[&str]) -> String {
    let output = Command::new("redis-cli")
        .args(["--tls", "--insecure", "--cacert"])
        .arg(certs.ca())
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli runs");
    assert!(output.status.success(), "redis-cli --tls: {output:?}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

// ---------------------------------------------------------------------------------------
// etcd: RBAC.
// ---------------------------------------------------------------------------------------

/// `etcdctl --endpoints SERVER [--user USER] ARGS...`: its success and output.
fn etcdctl(server: &EtcdServer, user: Option<&str>, args: &[&str]) -> (bool, String) {
    let mut command = Command::new("etcdctl");
    command
        .env("ETCDCTL_API", "3")
        .arg("--endpoints")
        .arg(server.endpoint());
    if let Some(user) = user {
        command.arg("--user").arg(user);
    }
    let output = command.args(args).output().expect("etcdctl runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

fn etcdctl_ok(server: &EtcdServer, user: Option<&str>, args: &[&str]) -> String {
    let (ok, text) = etcdctl(server, user, args);
    assert!(ok, "etcdctl {args:?}: {text}");
    text
}

const ROOT: &str = "root:r00t-pw";

/// An etcd server with auth enabled: `root`, and `alice` and `bob` whose roles grant
/// readwrite on `tenant-a/` and `tenant-b/` only.
fn etcd_with_tenants() -> EtcdServer {
    let server = EtcdServer::start();
    etcdctl_ok(&server, None, &["user", "add", ROOT]);
    for (user, role, prefix) in [
        ("alice:alice-pw", "tenant-a", "tenant-a/"),
        ("bob:bob-pw", "tenant-b", "tenant-b/"),
    ] {
        etcdctl_ok(&server, None, &["user", "add", user]);
        etcdctl_ok(&server, None, &["role", "add", role]);
        etcdctl_ok(
            &server,
            None,
            &[
                "role",
                "grant-permission",
                role,
                "--prefix=true",
                "readwrite",
                prefix,
            ],
        );
        let name = user.split(':').next().unwrap();
        etcdctl_ok(&server, None, &["user", "grant-role", name, role]);
    }
    etcdctl_ok(&server, None, &["auth", "enable"]);
    server
}

/// The keys under `prefix`, as root.
fn etcd_keys(server: &EtcdServer, prefix: &str) -> Vec<String> {
    etcdctl_ok(
        server,
        Some(ROOT),
        &["get", "--prefix", "--keys-only", prefix],
    )
    .lines()
    .filter(|l| !l.is_empty())
    .map(str::to_owned)
    .collect()
}

/// Asserts that `err` is etcd's non-retryable permission error.
fn permission_denied(what: &str, err: &Error) {
    println!("{what}: {}", chain(err));
    assert!(
        matches!(err, Error::Backend { .. }) && !err.is_retryable(),
        "{what}: {err:?}"
    );
    assert!(
        chain(err).contains("permission denied"),
        "{what}: {}",
        chain(err)
    );
}

/// How soon a refused lock operation must return: a permission error is a definite
/// answer, and nothing was created that would need cleaning up first.
const REFUSED_PROMPTLY: Duration = Duration::from_secs(2);

/// Runs `operation`, which must fail with etcd's permission error; returns how long it
/// took, labelled, for [`assert_prompt`].
async fn refused<T: std::fmt::Debug>(
    what: &str,
    operation: impl Future<Output = Result<T, Error>>,
) -> (String, Duration) {
    let started = Instant::now();
    let result = operation.await;
    let took = started.elapsed();
    let err = match result {
        // `try_lock` reports contention as `Ok(None)`.
        Ok(value) => {
            panic!("{what}: a permission error expected, got Ok({value:?}) after {took:?}")
        }
        Err(err) => err,
    };
    permission_denied(what, &err);
    (what.to_owned(), took)
}

/// Asserts that every refusal came within [`REFUSED_PROMPTLY`].
fn assert_prompt(took: &[(String, Duration)]) {
    println!("refusals: {took:?}");
    let slow: Vec<_> = took.iter().filter(|(_, t)| *t > REFUSED_PROMPTLY).collect();
    assert!(
        slow.is_empty(),
        "permission errors that came late (more than {REFUSED_PROMPTLY:?}): {slow:?}"
    );
}

/// Alice holds `job` under `tenant-a`. Bob, whose role covers only `tenant-b/`, can
/// connect with the prefix `tenant-a` (a lease needs no key permission), but cannot
/// delete or overwrite Alice's key by hand (`etcdctl del`/`put` as bob: permission
/// denied), and cannot take the lock or read it: a non-retryable permission error each
/// time, promptly (a waiting acquire does not wait). Alice's key, token and guard are
/// untouched; nothing of Bob's is left under `tenant-a/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_etcd_another_users_lock_is_out_of_reach() {
    let server = etcd_with_tenants();
    let endpoint = server.endpoint();
    let alice = fencelock::connect(&format!(
        "etcd://alice:alice-pw@{endpoint}/tenant-a?lease=2s"
    ))
    .await
    .expect("alice connects");
    let held = alice.lock("job").await.expect("alice locks in her prefix");
    let keys = etcd_keys(&server, "tenant-a/");
    assert_eq!(keys.len(), 1, "{keys:?}");
    let alice_key = keys[0].clone();

    for args in [
        vec!["del", alice_key.as_str()],
        vec!["del", "--prefix", "tenant-a/"],
        vec!["put", alice_key.as_str(), "bob"],
    ] {
        let (ok, text) = etcdctl(&server, Some("bob:bob-pw"), &args);
        assert!(!ok, "bob's etcdctl {args:?} succeeded: {text}");
        assert!(text.contains("permission denied"), "{args:?}: {text}");
    }

    let bob = fencelock::connect(&format!("etcd://bob:bob-pw@{endpoint}/tenant-a?lease=2s"))
        .await
        .expect("bob connects: a session lease needs no key permission");
    let waiting = AcquireOptions::new().wait_timeout(Duration::from_secs(10));
    let took = vec![
        refused("bob inspect", bob.inspect("job")).await,
        refused("bob try_lock", bob.try_lock("job")).await,
        refused("bob waiting acquire", bob.acquire("job", waiting)).await,
    ];

    // Alice still holds, with the same key and token.
    assert_eq!(etcd_keys(&server, "tenant-a/"), vec![alice_key.clone()]);
    let fields = etcdctl_ok(&server, Some(ROOT), &["get", &alice_key, "-w", "fields"]);
    assert!(
        fields.contains(&format!("\"CreateRevision\" : {}\n", held.token().get())),
        "the key is not the holder's incarnation: {fields}"
    );
    assert!(!held.is_lost(), "{:?}", held.lost_reason());
    held.release().await.expect("alice releases");
    assert!(etcd_keys(&server, "tenant-a/").is_empty());
    assert_prompt(&took);
}

/// Bob on a prefix no role of his covers (`tenant-x`): every lock operation (a try, a
/// waiting acquire, a fixed-lease try) is a prompt, non-retryable permission error, and
/// nothing is created under `tenant-x/`. His own prefix works (the control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_etcd_prefix_outside_the_role_is_refused() {
    let server = etcd_with_tenants();
    let endpoint = server.endpoint();
    let bob = fencelock::connect(&format!("etcd://bob:bob-pw@{endpoint}/tenant-x?lease=2s"))
        .await
        .unwrap();
    let fixed = AcquireOptions::new()
        .fixed_lease(Duration::from_secs(5))
        .no_wait();
    let took = vec![
        refused("try_lock", bob.try_lock("job")).await,
        refused("fixed-lease try", bob.acquire("job", fixed)).await,
        refused("lock", bob.lock("job")).await,
        refused("lock on another name", bob.lock("other")).await,
    ];
    assert!(etcd_keys(&server, "tenant-x").is_empty());

    let own = fencelock::connect(&format!("etcd://bob:bob-pw@{endpoint}/tenant-b?lease=2s"))
        .await
        .unwrap();
    let guard = own.lock("job").await.expect("bob's own prefix");
    guard.release().await.unwrap();
    assert!(etcd_keys(&server, "tenant-").is_empty());
    assert_prompt(&took);
}

/// Carol's role covers one name only (`tenant-c/ok/`, the keys of lock `ok` under the
/// prefix `tenant-c`). She holds `ok` and is refused `denied` (a prompt, non-retryable
/// permission error). The refusal costs her nothing else: `ok` stays held on her session
/// for three lease periods and more (renewed, never reported lost), a second try on
/// `denied` is refused as promptly, and `ok` is then released normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_etcd_a_refused_name_costs_the_client_nothing_else() {
    let server = etcd_with_tenants();
    etcdctl_ok(&server, Some(ROOT), &["user", "add", "carol:carol-pw"]);
    etcdctl_ok(&server, Some(ROOT), &["role", "add", "one-name"]);
    etcdctl_ok(
        &server,
        Some(ROOT),
        &[
            "role",
            "grant-permission",
            "one-name",
            "--prefix=true",
            "readwrite",
            "tenant-c/ok/",
        ],
    );
    etcdctl_ok(
        &server,
        Some(ROOT),
        &["user", "grant-role", "carol", "one-name"],
    );
    let endpoint = server.endpoint();
    let carol = fencelock::connect(&format!(
        "etcd://carol:carol-pw@{endpoint}/tenant-c?lease=2s"
    ))
    .await
    .unwrap();
    let held = carol.lock("ok").await.expect("the granted name");
    let refused_at = Instant::now();
    let mut took = vec![refused("try_lock denied", carol.try_lock("denied")).await];
    // Five lease periods (2 s each).
    let watched = tokio::time::timeout(Duration::from_secs(10), held.lost()).await;
    assert!(
        watched.is_err(),
        "the held lock `ok` was reported lost {:?} after a refused try on another name: \
         {:?}",
        refused_at.elapsed(),
        held.lost_reason()
    );
    took.push(refused("try_lock denied again", carol.try_lock("denied")).await);
    let waiting = AcquireOptions::new().wait_timeout(Duration::from_secs(10));
    took.push(refused("waiting acquire denied", carol.acquire("denied", waiting)).await);
    assert!(!held.is_lost(), "{:?}", held.lost_reason());
    held.release().await.expect("release");
    assert!(etcd_keys(&server, "tenant-c/").is_empty());
    assert_prompt(&took);
}

/// The etcd server's TLS certificate is signed by the trusted CA but valid only for
/// `elsewhere.test`; the URL names `127.0.0.1`. `connect` fails (no plaintext retry: no
/// key and no lease appear on the server); with `domain=elsewhere.test` the same
/// settings work.
#[cfg(feature = "etcd-tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f23_etcd_tls_certificate_for_another_name_is_refused() {
    use fencelock_testkit::TestCertificates;

    let certs = TestCertificates::generate_for("DNS:elsewhere.test");
    let (server, tls_port) = EtcdServer::start_tls(&certs.server_cert(), &certs.server_key());
    let ca = certs.ca().display().to_string();
    let url = format!("etcds://127.0.0.1:{tls_port}/tls?ca={ca}&lease=2s&connect_timeout=3s");
    let refused = connect_fails(&url, "no-secret-here").await;
    let text = chain(&refused.err);
    assert!(text.contains("certificate not valid for name"), "{text}");
    let leases = etcdctl_ok(&server, None, &["lease", "list"]);
    assert!(leases.contains("found 0 leases"), "{leases}");

    let by_name = format!("{url}&domain=elsewhere.test");
    let locks = fencelock::connect(&by_name)
        .await
        .expect("the name in the certificate works");
    let guard = locks.lock("tls-name").await.unwrap();
    guard.release().await.unwrap();
    assert!(etcd_keys_plain(&server, "tls/").is_empty());
    assert_hard(&[&refused]);
}

/// The keys under `prefix`, without authentication.
#[cfg(feature = "etcd-tls")]
fn etcd_keys_plain(server: &EtcdServer, prefix: &str) -> Vec<String> {
    etcdctl_ok(server, None, &["get", "--prefix", "--keys-only", prefix])
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

// ---------------------------------------------------------------------------------------
// Passwords with every reserved character, on every backend.
// ---------------------------------------------------------------------------------------

/// A password with every character a URL reserves, and a space.
const RESERVED_PASSWORD: &str = "p&a+s=s:w/o?r#d@%x y![]$',;~";

fn encoded(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// The password reaches each server intact from a URL (percent-encoded) and from a
/// config file (as written): `&` does not end it, `+` stays a plus sign. A lock works
/// with it; nothing shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_with_every_reserved_character_work_on_every_backend() {
    let password = RESERVED_PASSWORD;
    // Redis: requirepass.
    let redis = RedisServer::start_with(&["--requirepass", password]);
    let url = format!("redis://:{}@{}", encoded(password), redis.addr());
    let locks = fencelock::connect(&url)
        .await
        .expect("Redis with the password");
    locks
        .lock("reserved")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let wrong = format!(
        "redis://:{}@{}",
        encoded(&password[..password.len() - 1]),
        redis.addr()
    );
    assert!(
        fencelock::connect(&wrong).await.is_err(),
        "a shorter password was accepted"
    );

    // etcd: a user with the password.
    let etcd = EtcdServer::start();
    etcdctl_ok(&etcd, None, &["user", "add", &format!("root:{password}")]);
    etcdctl_ok(&etcd, None, &["auth", "enable"]);
    let url = format!(
        "etcd://root:{}@{}/reserved",
        encoded(password),
        etcd.endpoint()
    );
    let locks = fencelock::connect(&url)
        .await
        .expect("etcd with the password");
    locks
        .lock("reserved")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let toml = format!(
        "backend = \"etcd\"\nendpoints = [\"{}\"]\nprefix = \"reserved\"\n[auth]\nuser = \"root\"\npassword = \"{password}\"\n",
        etcd.endpoint()
    );
    let config = fencelock::Config::from_toml_str(&toml).unwrap();
    assert!(!format!("{config} {config:?}").contains("p&a"), "{config}");
    let locks = fencelock::connect_config(&config)
        .await
        .expect("etcd with the password from a config file");
    locks
        .lock("reserved")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    // ZooKeeper: digest credentials, and nodes only their creator may touch.
    #[cfg(feature = "zookeeper")]
    {
        let zk = fencelock_testkit::ZkServer::shared();
        let url = format!(
            "zk://app:{}@{}/reserved-{}?acl=creator",
            encoded(password),
            zk.connect_string(),
            std::process::id()
        );
        let config = fencelock_zk::ZkConfig::from_url(&url).unwrap();
        assert_eq!(config.auth().unwrap().password, password);
        let locks = fencelock::connect(&url)
            .await
            .expect("ZooKeeper with the password");
        locks
            .lock("reserved")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
}
