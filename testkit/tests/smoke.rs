//! Smoke tests: every server starts, answers a real command, and leaves nothing behind.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_testkit::{
    EtcdCluster, EtcdServer, RedisServer, ZkEnsemble, ZkServer, free_ports, port_open,
    process_alive,
};

/// Runs a client program and returns its trimmed stdout; panics unless it succeeds.
fn run(program: &str, args: &[&str]) -> String {
    let output = Command::new(program)
        .args(args)
        .env("ETCDCTL_API", "3")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} (run ./scripts/test to install it): {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?} failed: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// Asserts that the process is gone and nothing listens on the ports any more.
fn assert_gone(pid: u32, ports: &[u16]) {
    assert!(pid > 0);
    assert!(!process_alive(pid), "process {pid} still alive after drop");
    for &port in ports {
        assert!(!port_open(port), "port {port} still open after drop");
    }
}

fn redis_cli(server: &RedisServer, args: &[&str]) -> String {
    let port = server.port().to_string();
    let mut all = vec!["-h", "127.0.0.1", "-p", &port];
    all.extend_from_slice(args);
    run("redis-cli", &all)
}

fn etcdctl(server: &EtcdServer, args: &[&str]) -> String {
    let endpoints = format!("--endpoints={}", server.url());
    let mut all = vec![endpoints.as_str()];
    all.extend_from_slice(args);
    run("etcdctl", &all)
}

#[test]
fn redis_starts_serves_and_stops() {
    let redis = RedisServer::start();
    let (pid, port) = (redis.pid(), redis.port());
    assert!(process_alive(pid));
    assert_eq!(redis.addr(), format!("127.0.0.1:{port}"));
    assert_eq!(redis.url(), format!("redis://127.0.0.1:{port}"));
    assert_eq!(redis_cli(&redis, &["SET", "k", "v"]), "OK");
    assert_eq!(redis_cli(&redis, &["GET", "k"]), "v");
    let dir = redis.dir().to_path_buf();
    drop(redis);
    assert_gone(pid, &[port]);
    assert!(!dir.exists(), "temporary directory left behind");
}

#[test]
fn redis_pause_and_resume() {
    let redis = RedisServer::start();
    redis.pause();
    assert!(process_alive(redis.pid()), "a paused server is alive");
    assert!(
        !redis.ping(Duration::from_millis(300)),
        "paused server answered PING"
    );
    redis.resume();
    assert!(
        redis.ping(Duration::from_secs(2)),
        "resumed server did not answer PING"
    );
    // A server dropped while paused is still killed.
    let (pid, port) = (redis.pid(), redis.port());
    redis.pause();
    drop(redis);
    assert_gone(pid, &[port]);
}

#[test]
#[should_panic(expected = "redis.log")]
fn a_server_that_cannot_start_fails_with_its_log() {
    RedisServer::start_with(&["--no-such-option", "x"]);
}

#[test]
fn redis_restarts_on_the_same_port() {
    let redis = RedisServer::start_with(&["--maxmemory", "64mb"]);
    let (old_pid, port) = (redis.pid(), redis.port());
    assert_eq!(redis_cli(&redis, &["SET", "k", "v"]), "OK");
    redis.kill();
    assert!(!redis.is_running());
    assert_gone(old_pid, &[port]);
    redis.restart();
    assert_eq!(redis.port(), port);
    assert_ne!(redis.pid(), old_pid);
    assert!(redis.ping(Duration::from_secs(2)));
    assert_eq!(
        redis_cli(&redis, &["GET", "k"]),
        "",
        "no persistence across restart"
    );
    assert_eq!(
        redis_cli(&redis, &["CONFIG", "GET", "maxmemory"]),
        "maxmemory\n67108864"
    );
}

#[test]
fn etcd_starts_serves_and_stops() {
    let etcd = EtcdServer::start();
    let (pid, port, peer) = (etcd.pid(), etcd.client_port(), etcd.peer_port());
    assert!(process_alive(pid));
    assert_eq!(etcd.endpoint(), format!("127.0.0.1:{port}"));
    assert_eq!(etcd.url(), format!("http://127.0.0.1:{port}"));
    assert!(etcd.is_healthy());
    assert_eq!(etcdctl(&etcd, &["put", "k", "v"]), "OK");
    assert_eq!(etcdctl(&etcd, &["get", "k", "--print-value-only"]), "v");
    drop(etcd);
    assert_gone(pid, &[port, peer]);
}

#[test]
fn etcd_restarts_on_the_same_port_with_its_data() {
    let etcd = EtcdServer::start();
    let (old_pid, port) = (etcd.pid(), etcd.client_port());
    assert_eq!(etcdctl(&etcd, &["put", "k", "v"]), "OK");
    etcd.pause();
    assert!(process_alive(old_pid));
    etcd.resume();
    etcd.kill();
    assert_gone(old_pid, &[port, etcd.peer_port()]);
    etcd.restart();
    assert_eq!(etcd.client_port(), port);
    assert_ne!(etcd.pid(), old_pid);
    assert_eq!(etcdctl(&etcd, &["get", "k", "--print-value-only"]), "v");
}

#[test]
fn zookeeper_starts_serves_and_stops() {
    let zk = ZkServer::start();
    let (pid, port) = (zk.pid(), zk.port());
    assert!(process_alive(pid));
    assert_eq!(zk.connect_string(), format!("127.0.0.1:{port}"));
    assert_eq!(zk.four_letter_word("ruok").unwrap(), "imok");
    assert_eq!(zk.mode().as_deref(), Some("standalone"));
    let conf = zk.four_letter_word("conf").unwrap();
    assert!(conf.contains("tickTime=500"), "{conf}");
    assert!(conf.contains("maxSessionTimeout=60000"), "{conf}");
    drop(zk);
    assert_gone(pid, &[port]);
}

#[test]
fn zookeeper_restarts_on_the_same_port() {
    let zk = ZkServer::start();
    let (old_pid, port) = (zk.pid(), zk.port());
    zk.kill();
    assert_gone(old_pid, &[port]);
    zk.restart();
    assert_eq!(zk.port(), port);
    assert_eq!(zk.mode().as_deref(), Some("standalone"));
}

#[test]
fn shared_servers_are_started_once() {
    assert!(std::ptr::eq(RedisServer::shared(), RedisServer::shared()));
    assert!(RedisServer::shared().ping(Duration::from_secs(1)));
    assert!(std::ptr::eq(EtcdServer::shared(), EtcdServer::shared()));
    assert!(EtcdServer::shared().is_healthy());
    assert!(std::ptr::eq(ZkServer::shared(), ZkServer::shared()));
    assert_eq!(ZkServer::shared().mode().as_deref(), Some("standalone"));
}

#[test]
fn free_ports_are_distinct() {
    let ports = free_ports(20);
    let mut sorted = ports.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), ports.len());
}

#[test]
fn etcd_cluster_elects_a_new_leader() {
    let cluster = EtcdCluster::start(3);
    assert_eq!(cluster.endpoints().len(), 3);
    let leader = cluster.wait_for_leader(Duration::from_secs(10));
    cluster.kill_member(leader);
    let next = cluster.wait_for_leader(Duration::from_secs(10));
    assert_ne!(next, leader);
    cluster.restart_member(leader);
    cluster.wait_healthy();
}

#[test]
fn zookeeper_ensemble_elects_a_new_leader() {
    let ensemble = ZkEnsemble::start(3);
    assert_eq!(ensemble.connect_string().split(',').count(), 3);
    let leader = ensemble.wait_for_leader(Duration::from_secs(10));
    ensemble.kill_member(leader);
    let next = ensemble.wait_for_leader(Duration::from_secs(20));
    assert_ne!(next, leader);
    ensemble.restart_member(leader);
    let mode = ensemble.member(leader).mode();
    assert!(
        mode.is_none() || mode.as_deref() == Some("follower"),
        "{mode:?}"
    );
}

/// Environment variable that turns [`helper_process_holding_a_redis`] into the helper.
const HELPER_ENV: &str = "FENCELOCK_TESTKIT_HELPER";

/// Only does something when run by [`servers_die_with_the_test_process`]: starts a
/// Redis from a short-lived thread, prints its pid, and waits to be killed.
#[test]
fn helper_process_holding_a_redis() {
    if std::env::var_os(HELPER_ENV).is_none() {
        return;
    }
    let redis = std::thread::spawn(RedisServer::start).join().unwrap();
    println!("FENCELOCK_HELPER {} {}", redis.pid(), redis.dir().display());
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
fn servers_die_with_the_test_process() {
    let mut helper = Command::new(std::env::current_exe().unwrap())
        .args(["helper_process_holding_a_redis", "--exact", "--nocapture"])
        .env(HELPER_ENV, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(helper.stdout.take().unwrap());
    let line = stdout
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with("FENCELOCK_HELPER "))
        .expect("the helper printed no pid");
    let mut fields = line.split_whitespace().skip(1);
    let pid: u32 = fields.next().unwrap().parse().unwrap();
    let dir = fields.next().unwrap().to_string();
    // The thread that started it has exited: the server must still be up.
    std::thread::sleep(Duration::from_millis(200));
    assert!(process_alive(pid), "server died with its starting thread");
    helper.kill().unwrap();
    helper.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while process_alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        !process_alive(pid),
        "server {pid} outlived its SIGKILLed test process"
    );
}

/// One `PING` through `addr`, answered within `timeout`.
fn ping_through(addr: &str, timeout: std::time::Duration) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(timeout));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut answer = [0u8; 7];
    stream.read_exact(&mut answer).is_ok() && &answer == b"+PONG\r\n"
}

#[test]
fn the_fault_proxy_passes_blackholes_delays_and_drops_replies() {
    use fencelock_testkit::{Fault, FaultProxy, RedisServer};
    use std::time::{Duration, Instant};
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis.addr());
    assert!(ping_through(&proxy.addr(), Duration::from_secs(2)));

    proxy.set(Fault::Blackhole);
    assert!(!ping_through(&proxy.addr(), Duration::from_millis(300)));
    proxy.set(Fault::Pass);
    assert!(ping_through(&proxy.addr(), Duration::from_secs(2)));

    proxy.set(Fault::Delay {
        min: Duration::from_millis(200),
        max: Duration::from_millis(200),
    });
    let start = Instant::now();
    assert!(ping_through(&proxy.addr(), Duration::from_secs(2)));
    assert!(
        start.elapsed() >= Duration::from_millis(400),
        "{:?}",
        start.elapsed()
    );

    proxy.set(Fault::DropReplies);
    assert!(!ping_through(&proxy.addr(), Duration::from_millis(300)));
    assert!(proxy.dropped_replies() > 0);
    proxy.set(Fault::Pass);
    proxy.reset_connections();
    assert!(ping_through(&proxy.addr(), Duration::from_secs(2)));
    assert!(proxy.accepted() >= 4);
}
