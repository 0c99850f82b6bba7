//! `--wait` bounds the whole command, connecting included: against a server that
//! accepts connections and never answers (SIGSTOPped), `fencelock run --wait 1s` gives
//! up after about a second, not after the backend's connect timeout (5 s). A connect
//! cut short by `--wait` is the backend's unavailability (69), not a conflict (75): no
//! lock was asked for. `hold` acquires the same way. Without a wait limit (`-n`, `--wait 0`, no `--wait`) connecting
//! still gets its connect timeout.

mod common;

use std::process::Output;
use std::time::{Duration, Instant};

use common::*;
use fencelock_testkit::{EtcdServer, RedisServer, ZkServer};

/// The lock backend is unreachable (cli/src/exit.rs).
const UNAVAILABLE: i32 = 69;

/// Beyond the wait, for process start and exit on two busy cores; far below the 5 s
/// connect timeout that bounded the command before.
const MARGIN: Duration = Duration::from_millis(1500);

/// Runs `fencelock run --url URL ARGS... NAME -- true`; the output and how long it took.
fn timed_run(url: &str, args: &[&str]) -> (Output, Duration) {
    let started = Instant::now();
    let out = output(fencelock().args(["run", "--url", url]).args(args).args([
        "connect-wait",
        "--",
        "true",
    ]));
    (out, started.elapsed())
}

fn assert_within(what: &str, took: Duration, low: Duration, high: Duration, out: &Output) {
    eprintln!("{what}: {took:?}");
    assert!(
        took >= low && took <= high,
        "{what}: took {took:?}, not within {low:?}..{high:?}; stderr: {}",
        stderr(out)
    );
}

/// The cases on one paused server: `url` names it with the default connect timeout
/// (5 s), `short` with `connect_timeout=1s`.
fn wait_bounds_connecting(backend: &str, url: &str, short: &str) {
    let second = Duration::from_secs(1);
    // --wait shorter than the connect timeout: the wait ends the command.
    let (out, took) = timed_run(url, &["--wait", "1s"]);
    assert_within(
        &format!("{backend} --wait 1s"),
        took,
        second,
        second + MARGIN,
        &out,
    );
    assert_code(&out, UNAVAILABLE);
    assert!(stderr(&out).contains("--wait 1s"), "{}", stderr(&out));
    // `hold` acquires the same way.
    let started = Instant::now();
    let out = output(fencelock().args(["hold", "--url", url, "--wait", "1s", "connect-wait"]));
    let took = started.elapsed();
    assert_within(
        &format!("{backend} hold --wait 1s"),
        took,
        second,
        second + MARGIN,
        &out,
    );
    assert_code(&out, UNAVAILABLE);
    // The connect timeout, when shorter, still applies.
    let (out, took) = timed_run(short, &["--wait", "30s"]);
    assert_code(&out, UNAVAILABLE);
    assert_within(
        &format!("{backend} connect_timeout=1s --wait 30s"),
        took,
        second / 2,
        second + MARGIN,
        &out,
    );
    // -n does not wait for the lock, but connecting gets its connect timeout.
    let (out, took) = timed_run(short, &["-n"]);
    assert_code(&out, UNAVAILABLE);
    assert_within(
        &format!("{backend} connect_timeout=1s -n"),
        took,
        second / 2,
        second + MARGIN,
        &out,
    );
}

#[test]
fn wait_bounds_connecting_to_a_stopped_etcd() {
    let etcd = EtcdServer::start();
    etcd.pause();
    let endpoint = etcd.endpoint();
    wait_bounds_connecting(
        "etcd",
        &format!("etcd://{endpoint}/connect-wait"),
        &format!("etcd://{endpoint}/connect-wait?connect_timeout=1s"),
    );
    etcd.resume();
}

#[test]
fn wait_bounds_connecting_to_a_stopped_zookeeper() {
    let zk = ZkServer::start();
    zk.pause();
    let hosts = zk.connect_string();
    wait_bounds_connecting(
        "zookeeper",
        &format!("zk://{hosts}/connect-wait"),
        &format!("zk://{hosts}/connect-wait?connect_timeout=1s"),
    );
    zk.resume();
}

#[test]
fn wait_bounds_connecting_to_a_stopped_redis() {
    let redis = RedisServer::start();
    redis.pause();
    let url = redis.url();
    let separator = if url.contains('?') { '&' } else { '?' };
    wait_bounds_connecting(
        "redis",
        &url,
        &format!("{url}{separator}connect_timeout=1s"),
    );
    redis.resume();
}
