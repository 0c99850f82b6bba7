//! `fencelock` end to end on real etcd, ZooKeeper and Redis servers (fencelock-testkit):
//! two processes on one name never overlap, a lost lock stops the command, `--wait`
//! gives up with its exit code, signals release the lock, `inspect` sees the holder,
//! `bench --json` parses.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;

/// The critical section every holder runs: it fails loudly if it finds another holder
/// inside, and appends its token to the log on the way out.
const CRITICAL: &str = r#"
dir="$0"
if [ -e "$dir/inside" ]; then echo "overlap $FENCELOCK_TOKEN" >> "$dir/overlap"; fi
echo "$FENCELOCK_TOKEN" > "$dir/inside"
sleep 0.2
rm -f "$dir/inside"
echo "$FENCELOCK_TOKEN" >> "$dir/log"
"#;

fn two_processes_never_overlap(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let name = unique("exclusion");
    let rounds = 3;
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (url, name, path) = (url.to_owned(), name.clone(), dir.path().to_owned());
            std::thread::spawn(move || {
                for _ in 0..rounds {
                    let out = output(
                        fencelock()
                            .args(["run", "--url", &url, "--wait", "30s", &name, "--"])
                            .args(["sh", "-c", CRITICAL])
                            .arg(&path),
                    );
                    assert_code(&out, 0);
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    assert!(
        !dir.path().join("overlap").exists(),
        "two holders overlapped"
    );
    let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
    let tokens: Vec<u64> = log.lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(tokens.len(), 2 * rounds, "{log}");
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens grow in holding order: {tokens:?}"
    );
}

/// A holder frozen (SIGSTOP) past its lease learns of the loss when it wakes and stops
/// its command at once; meanwhile another process got the lock.
fn a_frozen_holder_stops_its_command_when_it_wakes(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let name = unique("frozen");
    let ready = dir.path().join("ready");
    let holder = Running::start(
        fencelock()
            .args(["run", "--url", url, "--lease", "2s", &name, "--"])
            .args(["sh", "-c", r#"touch "$0"; exec sleep 60"#])
            .arg(&ready),
    );
    wait_for_file(&ready, Duration::from_secs(20));
    signal(holder.pid(), Signal::SIGSTOP);
    // Another process gets the lock once the frozen holder's lease has run out.
    let taken =
        output(fencelock().args(["run", "--url", url, "--wait", "20s", &name, "--", "true"]));
    assert_code(&taken, 0);
    signal(holder.pid(), Signal::SIGCONT);
    let woke = Instant::now();
    let out = holder.wait(Duration::from_secs(20));
    assert_code(&out, LOST);
    assert!(stderr(&out).contains("SIGTERM"), "{}", stderr(&out));
    assert!(woke.elapsed() < Duration::from_secs(10));
}

/// `--wait` gives up with 75 while another process holds the lock; SIGTERM to the holder
/// reaches its command and frees the lock; `inspect` sees the holder's token.
fn waiting_signals_and_inspect(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let name = unique("wait");
    let ready = dir.path().join("ready");
    let holder = Running::start(
        fencelock()
            .args(["run", "--url", url, &name, "--"])
            .args([
                "sh",
                "-c",
                r#"echo "$FENCELOCK_TOKEN" > "$0.tmp"; mv "$0.tmp" "$0"; exec sleep 60"#,
            ])
            .arg(&ready),
    );
    wait_for_file(&ready, Duration::from_secs(20));
    let token: u64 = std::fs::read_to_string(&ready)
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    let inspect = output(fencelock().args(["inspect", "--json", "--url", url, &name]));
    assert_code(&inspect, 0);
    let info: serde_json::Value = serde_json::from_str(&stdout(&inspect)).unwrap();
    assert_eq!(info["held"], true, "{info}");
    assert_eq!(info["token"], token, "{info}");

    let start = Instant::now();
    let timed_out =
        output(fencelock().args(["run", "--url", url, "--wait", "300ms", &name, "--", "true"]));
    assert_code(&timed_out, NOT_ACQUIRED);
    assert!(
        stderr(&timed_out).contains("not acquired within"),
        "{}",
        stderr(&timed_out)
    );
    assert!(start.elapsed() < Duration::from_secs(15));
    let busy = output(fencelock().args(["run", "--url", url, "--wait", "0", &name, "--", "true"]));
    assert_code(&busy, NOT_ACQUIRED);

    // Ctrl-Z while waiting stops the waiter at once (not later, once it holds the lock);
    // continued, it waits on, and SIGTERM then ends it.
    let waiter = Running::start(
        fencelock().args(["run", "--url", url, "--wait", "60s", &name, "--", "true"]),
    );
    std::thread::sleep(Duration::from_millis(500));
    let state = process_state;
    signal(waiter.pid(), Signal::SIGTSTP);
    let deadline = Instant::now() + Duration::from_secs(5);
    while state(waiter.pid()) != 'T' {
        assert!(
            Instant::now() < deadline,
            "a waiting fencelock ignored Ctrl-Z"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(waiter.pid(), Signal::SIGCONT);
    signal(waiter.pid(), Signal::SIGTERM);
    let out = waiter.wait(Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(143), "{}", stderr(&out));

    signal(holder.pid(), Signal::SIGTERM);
    let out = holder.wait(Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(143), "{}", stderr(&out));
    let after = output(fencelock().args(["run", "--url", url, "--wait", "0", &name, "--", "true"]));
    assert_code(&after, 0);
}

/// `url` with the facade's own query options added (`retry=`, `max_waiters=`), which
/// every consumer of the URL must accept, the raw-client floor of `--baseline` too.
fn with_facade_options(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}retry=2&max_waiters=64")
}

fn bench_json(url: &str) {
    let url = with_facade_options(url);
    let out = output(fencelock().args([
        "bench",
        "--url",
        &url,
        "--workload",
        "contended",
        "--clients",
        "2",
        "--duration",
        "500ms",
        "--warmup",
        "200ms",
        "--baseline",
        "--json",
    ]));
    assert_code(&out, 0);
    check_bench_json(&stdout(&out), "contended", true);
}

/// The scale workloads run and check themselves on a real server (small counts here;
/// the numbers in the README come from the defaults): every waiter served once in
/// order, no held lock lost over 5 lease periods, no name left after the cycles.
fn scale_workloads(url: &str) {
    for (workload, count, field) in [
        ("waiters", "300", "served_exactly_once"),
        ("held", "300", "lost"),
        ("cycles", "2000", "names_left"),
    ] {
        let out = output(fencelock().args([
            "bench",
            "--url",
            url,
            "--workload",
            workload,
            "--count",
            count,
            "--lease",
            "2s",
            "--json",
            "--quiet",
        ]));
        assert_code(&out, 0);
        let doc: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(doc["workload"], workload, "{doc}");
        match workload {
            "waiters" => {
                assert_eq!(doc[field], true, "{doc}");
                if doc["fifo_claimed"] == true {
                    assert_eq!(doc["batch_order_inversions"], 0, "{doc}");
                }
                assert!(doc["rss_bytes_per_waiter"].is_number(), "{doc}");
                // Read from the server itself (which the other tests share: only that
                // the counters are there is checked, not their values).
                let counters: &[&str] = match doc["backend"].as_str() {
                    Some("etcd") => &["watch_events", "proposals"],
                    Some("zookeeper") => &["deletion_notifications", "packets_received"],
                    _ => &["publish_calls", "script_calls"],
                };
                for counter in counters {
                    assert!(
                        doc["server_per_handoff"][counter]
                            .as_f64()
                            .is_some_and(|n| n >= 0.0),
                        "{counter}: {doc}"
                    );
                }
            }
            _ => assert_eq!(doc[field], 0, "{doc}"),
        }
    }
}

/// `--processes 3`: 60 waiters queued from 3 child processes, 20 each, one after the
/// other, then served: each exactly once, each process's own in the order they were
/// queued where the backend claims FIFO; the memory is the children's.
fn waiters_from_processes(url: &str) {
    let out = output(fencelock().args([
        "bench",
        "--url",
        url,
        "--workload",
        "waiters",
        "--count",
        "60",
        "--processes",
        "3",
        "--lease",
        "2s",
        "--json",
        "--quiet",
    ]));
    assert_code(&out, 0);
    let doc: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(doc["workload"], "waiters", "{doc}");
    assert_eq!(doc["processes"], 3, "{doc}");
    assert_eq!(doc["waiters"], 60, "{doc}");
    assert_eq!(doc["waiters_per_process"], 20, "{doc}");
    assert_eq!(doc["served_exactly_once"], true, "{doc}");
    assert!(doc["batch_order_inversions"].is_u64(), "{doc}");
    if doc["fifo_claimed"] == true {
        assert_eq!(doc["batch_order_inversions_within_processes"], 0, "{doc}");
        assert_eq!(doc["fifo_checked"], "within_processes", "{doc}");
    }
    assert!(doc["rss_bytes_per_waiter"].as_f64().unwrap() > 0.0, "{doc}");
    for field in ["queue_full", "queue_10", "longest_over_shortest"] {
        assert!(
            doc["handoff_us_median"][field].is_number(),
            "{field}: {doc}"
        );
    }
    assert!(doc["handoffs_per_sec"].as_f64().unwrap() > 0.0, "{doc}");
    assert!(doc["drain_s"].as_f64().unwrap() > 0.0, "{doc}");
    let counters = doc["server_per_handoff"]
        .as_object()
        .expect("server counters");
    assert!(
        !counters.is_empty() && counters.values().all(serde_json::Value::is_number),
        "{doc}"
    );
}

fn unreachable_backend_is_69(url: &str) {
    let out = output(fencelock().args(["inspect", "--url", url, "a"]));
    assert_code(&out, 69);
}

/// `hold` prints `NAME<TAB>KEY<TAB>TOKEN`, holds until SIGTERM and releases; meanwhile
/// `--nonblock` fails at once with `--conflict-exit-code`, `--wait 1s` gives up after
/// 1 s (not before it, and without hanging, whatever the backend) and says so in the
/// user's words; `FENCELOCK_KEY` names the key on every backend.
fn hold_nonblock_wait_and_key(url: &str) {
    let name = unique("hold");
    let holder = Running::start(fencelock().args(["hold", "--url", url, &name]));
    let deadline = Instant::now() + Duration::from_secs(20);
    let token = loop {
        let out = output(fencelock().args(["inspect", "--json", "--url", url, &name]));
        let info: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        if info["held"] == true {
            break info["token"].as_u64().unwrap();
        }
        assert!(Instant::now() < deadline, "hold never took the lock");
        std::thread::sleep(Duration::from_millis(50));
    };

    let start = Instant::now();
    let busy =
        output(fencelock().args(["run", "--url", url, "-n", "-E", "3", &name, "--", "true"]));
    assert_code(&busy, 3);
    assert!(start.elapsed() < Duration::from_secs(5));

    let start = Instant::now();
    let waited = output(fencelock().args(["run", "--url", url, "-w", "1s", &name, "--", "true"]));
    let took = start.elapsed();
    assert_code(&waited, NOT_ACQUIRED);
    assert!(
        stderr(&waited).contains("not acquired within 1s:"),
        "{}",
        stderr(&waited)
    );
    // It waited the 1 s. The process start and connect (a ZooKeeper session, on a busy
    // machine) come on top of it: 3 s in all says it gave up rather than hung.
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(3),
        "--wait 1s took {took:?}"
    );

    signal(holder.pid(), Signal::SIGTERM);
    let out = holder.wait(Duration::from_secs(20));
    assert_code(&out, 0);
    let line = stdout(&out);
    let fields: Vec<&str> = line.trim_end().split('\t').collect();
    assert_eq!(fields.len(), 3, "{line}");
    assert_eq!(fields[0], name);
    assert_ne!(fields[1], "-", "the backend's key: {line}");
    assert_eq!(fields[2].parse::<u64>().unwrap(), token);

    let run = output(fencelock().args([
        "run",
        "--url",
        url,
        "-n",
        &name,
        "-c",
        "echo \"$FENCELOCK_KEY\"",
    ]));
    assert_code(&run, 0);
    // Each holder has its own key on etcd (the lease id) and ZooKeeper (the sequence).
    assert!(
        stdout(&run).trim().contains(&name),
        "FENCELOCK_KEY {:?}",
        stdout(&run)
    );
    assert!(fields[1].contains(&name), "{line}");
}

/// `list` shows a held lock under its prefix with its token; `revoke` without `--yes`
/// changes nothing and exits 64; with `--yes` it takes the lock away, and the process
/// holding it stops its command and exits with the loss code.
fn list_and_revoke(url: &str) {
    let prefix = format!("{}/", unique("list"));
    let name = format!("{prefix}job");
    let dir = tempfile::tempdir().unwrap();
    let (holder, _child) = run_sleeper_at(url, &name, dir.path());
    let deadline = Instant::now() + Duration::from_secs(20);
    let listed = loop {
        let out = output(fencelock().args(["list", "--json", "--url", url, &prefix]));
        assert_code(&out, 0);
        let listed: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        if listed.as_array().is_some_and(|a| !a.is_empty()) {
            break listed;
        }
        assert!(Instant::now() < deadline, "the held lock was never listed");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["name"], name.as_str());
    let token = listed[0]["token"].as_u64().expect("a token");
    let text = output(fencelock().args(["list", "--url", url, &prefix]));
    assert!(
        stdout(&text).starts_with(&format!("{name}\ttoken={token}\t")),
        "{}",
        stdout(&text)
    );

    let refused = output(fencelock().args(["revoke", "--url", url, &name]));
    assert_code(&refused, 64);
    assert!(stderr(&refused).contains("--yes"), "{}", stderr(&refused));
    assert!(alive(holder.pid()), "revoke without --yes changed nothing");

    let revoked = output(fencelock().args(["revoke", "--json", "--yes", "--url", url, &name]));
    assert_code(&revoked, 0);
    let answer: serde_json::Value = serde_json::from_str(&stdout(&revoked)).unwrap();
    assert_eq!(answer["revoked"], true, "{answer}");
    assert_eq!(answer["token"].as_u64(), Some(token));
    // The holder notices (at once on etcd and ZooKeeper, at its next renewal on Redis).
    let out = holder.wait(Duration::from_secs(30));
    assert_code(&out, LOST);

    let again = output(fencelock().args(["revoke", "--yes", "--url", url, &name]));
    assert_code(&again, 0);
    assert!(stdout(&again).contains("not held"), "{}", stdout(&again));
}

/// A command that starts a worker in the background and exits at once (`worker & exit
/// 0`): the worker may still write, so the lock is kept until it is gone too; another
/// process gets it only then.
fn processes_left_in_the_group_keep_the_lock(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let name = unique("background");
    let pidfile = dir.path().join("pid");
    let holder = Running::start(
        fencelock()
            .args(["run", "--url", url, &name, "--", "sh", "-c"])
            .arg(r#"sleep 30 & echo $! > "$0.tmp"; mv "$0.tmp" "$0"; exit 0"#)
            .arg(&pidfile),
    );
    wait_for_file(&pidfile, Duration::from_secs(20));
    let worker = read_pid(&pidfile);
    // Long after the shell exited, the worker still runs: nobody else gets the lock.
    std::thread::sleep(Duration::from_millis(500));
    let other = output(fencelock().args(["run", "--url", url, "-n", &name, "--", "true"]));
    assert_code(&other, NOT_ACQUIRED);
    assert!(alive(holder.pid()), "fencelock exited while the worker ran");
    signal(worker, Signal::SIGKILL);
    let out = holder.wait(Duration::from_secs(10));
    assert_code(&out, 0);
    let after = output(fencelock().args(["run", "--url", url, "-n", &name, "--", "true"]));
    assert_code(&after, 0);
}

/// A lock revoked while its command runs is reported as a `lost` JSON event and exit
/// 76, whether the holder notices before the command exits (etcd's and ZooKeeper's
/// watches) or only when its release finds the key gone (Redis, between renewals).
fn a_revoked_lock_is_a_lost_event(url: &str) {
    let name = unique("revoked");
    let out = output(
        fencelock()
            .args(["run", "--json", "--url", url, &name, "--", "sh", "-c"])
            .arg(r#""$0" revoke --yes --url "$1" "$2" >/dev/null 2>&1"#)
            .arg(env!("CARGO_BIN_EXE_fencelock"))
            .arg(url)
            .arg(&name),
    );
    assert_code(&out, LOST);
    let events: Vec<serde_json::Value> = stderr(&out)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "lost" && e["name"] == name.as_str()),
        "no lost event: {}",
        stderr(&out)
    );
}

macro_rules! backend_tests {
    ($backend:ident, $url:expr, $dead:expr) => {
        mod $backend {
            use super::*;

            #[test]
            fn two_processes_never_overlap() {
                super::two_processes_never_overlap(&$url);
            }

            #[test]
            fn a_frozen_holder_stops_its_command_when_it_wakes() {
                super::a_frozen_holder_stops_its_command_when_it_wakes(&$url);
            }

            #[test]
            fn waiting_signals_and_inspect() {
                super::waiting_signals_and_inspect(&$url);
            }

            #[test]
            fn hold_nonblock_wait_and_key() {
                super::hold_nonblock_wait_and_key(&$url);
            }

            #[test]
            fn list_and_revoke() {
                super::list_and_revoke(&$url);
            }

            #[test]
            fn processes_left_in_the_group_keep_the_lock() {
                super::processes_left_in_the_group_keep_the_lock(&$url);
            }

            #[test]
            fn a_revoked_lock_is_a_lost_event() {
                super::a_revoked_lock_is_a_lost_event(&$url);
            }

            #[test]
            fn bench_json() {
                super::bench_json(&$url);
            }

            #[test]
            fn scale_workloads() {
                super::scale_workloads(&$url);
            }

            #[test]
            fn waiters_from_processes() {
                super::waiters_from_processes(&$url);
            }

            #[test]
            fn unreachable_backend_is_69() {
                let port = fencelock_testkit::free_port();
                super::unreachable_backend_is_69(&format!($dead, port));
            }
        }
    };
}

backend_tests!(etcd, etcd_url(), "etcd://127.0.0.1:{}/x?connect_timeout=1s");
backend_tests!(
    zookeeper,
    zk_url(),
    "zk://127.0.0.1:{}/x?session_timeout=2s&min_lease=1s"
);
backend_tests!(redis, redis_url(), "redis://127.0.0.1:{}?timeout=1s");

/// Without `--lease` the backend's configured lease holds (`lease=2s` here), not a
/// second default of the command line's.
#[test]
fn the_lease_comes_from_the_url() {
    let url = etcd_url();
    let name = unique("lease");
    let holder = Running::start(fencelock().args(["hold", "--url", &url, &name]));
    let deadline = Instant::now() + Duration::from_secs(20);
    let remaining = loop {
        let out = output(fencelock().args(["inspect", "--json", "--url", &url, &name]));
        let info: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        if info["held"] == true {
            break info["remaining_lease_ms"].as_u64().unwrap();
        }
        assert!(Instant::now() < deadline, "hold never took the lock");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        remaining <= 2000,
        "a lease of {remaining} ms, not the URL's 2s"
    );
    drop(holder);
}

/// Redis is refused where linearizability is required, with exit 64 naming it, and
/// accepted where strong-enough fencing is all that is asked.
#[test]
fn capabilities_refuse_what_a_backend_lacks() {
    let url = redis_url();
    let out =
        output(fencelock().args(["capabilities", "--url", &url, "--require", "linearizable"]));
    assert_code(&out, USAGE);
    assert!(stderr(&out).contains("linearizable"), "{}", stderr(&out));
    let out = output(fencelock().args(["capabilities", "--url", &url]));
    assert_code(&out, 0);
    assert!(
        stdout(&out).contains("linearizable    no"),
        "{}",
        stdout(&out)
    );
    let out = output(fencelock().args([
        "capabilities",
        "--url",
        &etcd_url(),
        "--require",
        "linearizable",
    ]));
    assert_code(&out, 0);
}

/// The child processes of `pid` (from `/proc/*/stat`: "pid (comm) state ppid ...").
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat")).is_ok_and(|stat| {
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(pid)
            })
        })
        .collect()
}

/// A `--processes` waiters bench on etcd, started, and its children once at least `n`
/// of them have been started.
fn processes_bench(url: &str, n: usize) -> (Running, Vec<u32>) {
    let bench = Running::start(fencelock().args([
        "bench",
        "--url",
        url,
        "--workload",
        "waiters",
        "--count",
        "3000",
        "--processes",
        "3",
        "--quiet",
    ]));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut children = Vec::new();
    while Instant::now() < deadline {
        for child in children_of(bench.pid()) {
            // Once it runs the child bench (not the parent's image before exec).
            let running = std::fs::read(format!("/proc/{child}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("--waiters-child"));
            if running && !children.contains(&child) {
                children.push(child);
            }
        }
        if children.len() >= n {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(children.len() >= n, "children started: {children:?}");
    (bench, children)
}

/// Waits until nothing is held or waited on under `prefix` (at most 10 s: the leases
/// of killed clients are 2 s).
fn nothing_left(url: &str, prefix: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let listed = output(fencelock().args(["list", "--json", "--url", url, prefix]));
        assert_code(&listed, 0);
        let listed: serde_json::Value = serde_json::from_str(&stdout(&listed)).unwrap();
        if listed.as_array().is_some_and(Vec::is_empty) {
            return;
        }
        assert!(Instant::now() < deadline, "left behind: {listed}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// SIGTERM to a `--processes` waiters bench while its children queue: it stops them
/// (they drop their waiters), exits 143, and leaves no process, waiter or holder behind.
#[test]
fn interrupting_a_processes_bench_stops_its_children() {
    let url = etcd_url();
    // The second child starts once the first has queued its waiters.
    let (bench, children) = processes_bench(&url, 2);
    let prefix = format!("fencelock-bench/{}-", bench.pid());
    signal(bench.pid(), Signal::SIGTERM);
    let out = bench.wait(Duration::from_secs(20));
    assert_code(&out, 143);
    assert!(stderr(&out).contains("interrupted"), "{}", stderr(&out));
    for child in children {
        assert!(
            gone_within(child, Duration::from_secs(5)),
            "child {child} outlived the bench"
        );
    }
    // The children's waiters and the parent's holder are gone from etcd.
    nothing_left(&url, &prefix);
}

/// A child that fails (here: interrupted) fails the bench, which names it, stops the
/// others and leaves nothing behind.
#[test]
fn a_failing_child_fails_the_bench() {
    let url = etcd_url();
    let (bench, children) = processes_bench(&url, 1);
    let prefix = format!("fencelock-bench/{}-", bench.pid());
    signal(children[0], Signal::SIGINT);
    let out = bench.wait(Duration::from_secs(20));
    assert_code(&out, 70);
    // "interrupted by SIGINT" once its handlers are installed, "signal: 2" before.
    assert!(
        stderr(&out).contains("child process 1 of 3 failed") && stderr(&out).contains("SIGINT"),
        "{}",
        stderr(&out)
    );
    assert!(gone_within(children[0], Duration::from_secs(5)));
    nothing_left(&url, &prefix);
}
