//! `fencelock elect` and `fencelock run --permits` end to end on real etcd, ZooKeeper and
//! Redis servers (fencelock-testkit): leaders take turns, one at a time, with growing
//! tokens; a leader frozen past its lease stops its command when it wakes; a semaphore
//! of LIMIT runs at most LIMIT commands, the next one conflicts or waits.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;

/// The leader's work: it fails loudly if it finds another leader inside, and appends
/// its token and value to the log on the way out.
const TERM: &str = r#"
dir="$0"
if [ -e "$dir/inside" ]; then echo "overlap $FENCELOCK_TOKEN" >> "$dir/overlap"; fi
echo "$FENCELOCK_TOKEN" > "$dir/inside"
sleep 0.2
rm -f "$dir/inside"
echo "$FENCELOCK_TOKEN $FENCELOCK_VALUE" >> "$dir/log"
"#;

/// Two candidates campaign three times each: one leader at a time, each term's token
/// above the one before, each with its own value.
fn leaders_take_turns(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let election = unique("elect");
    let rounds = 3;
    let candidates: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|value| {
            let (url, election, path) = (url.to_owned(), election.clone(), dir.path().to_owned());
            std::thread::spawn(move || {
                for _ in 0..rounds {
                    let out = output(
                        fencelock()
                            .args(["elect", "--url", &url, "--wait", "30s", &election, value])
                            .args(["--", "sh", "-c", TERM])
                            .arg(&path),
                    );
                    assert_code(&out, 0);
                }
            })
        })
        .collect();
    for candidate in candidates {
        candidate.join().unwrap();
    }
    assert!(!dir.path().join("overlap").exists(), "two leaders at once");
    let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
    let terms: Vec<(u64, &str)> = log
        .lines()
        .map(|l| {
            let (token, value) = l.split_once(' ').unwrap();
            (token.parse().unwrap(), value)
        })
        .collect();
    assert_eq!(terms.len(), 2 * rounds, "{log}");
    assert!(
        terms.windows(2).all(|w| w[0].0 < w[1].0),
        "tokens grow term after term: {terms:?}"
    );
    for value in ["a", "b"] {
        assert_eq!(
            terms.iter().filter(|t| t.1 == value).count(),
            rounds,
            "{log}"
        );
    }
}

/// A leader frozen (SIGSTOP) past its lease loses leadership to the other candidate,
/// and stops its command when it wakes (exit 76), as `run` does for a lost lock.
fn a_frozen_leader_stops_its_command_when_it_wakes(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let election = unique("frozen-leader");
    let ready = dir.path().join("ready");
    let leader = Running::start(
        fencelock()
            .args(["elect", "--url", url, "--lease", "2s", &election, "first"])
            .args(["--", "sh", "-c", r#"touch "$0"; exec sleep 60"#])
            .arg(&ready),
    );
    wait_for_file(&ready, Duration::from_secs(20));
    let first_token = {
        let out = output(fencelock().args(["inspect", "--url", url, "--json", &election]));
        assert_code(&out, 0);
        let doc: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        doc["token"].as_u64()
    };
    // While it leads, another candidate that does not wait is refused: 75.
    let refused = output(fencelock().args(["elect", "--url", url, "-n", &election, "--", "true"]));
    assert_code(&refused, NOT_ACQUIRED);
    assert!(
        stderr(&refused).contains(&format!(
            "leadership of {election:?} is held by another owner"
        )),
        "{}",
        stderr(&refused)
    );
    signal(leader.pid(), Signal::SIGSTOP);
    let next = output(
        fencelock()
            .args(["elect", "--url", url, "--wait", "20s", &election, "second"])
            .args([
                "--",
                "sh",
                "-c",
                r#"echo "$FENCELOCK_TOKEN $FENCELOCK_VALUE""#,
            ]),
    );
    assert_code(&next, 0);
    let (token, value) = stdout(&next)
        .trim()
        .split_once(' ')
        .map(|(t, v)| (t.parse::<u64>().unwrap(), v.to_owned()))
        .unwrap();
    assert_eq!(value, "second");
    if let Some(first) = first_token {
        assert!(
            token > first,
            "the new term's token {token} is above {first}"
        );
    }
    signal(leader.pid(), Signal::SIGCONT);
    let woke = Instant::now();
    let out = leader.wait(Duration::from_secs(20));
    assert_code(&out, LOST);
    let err = stderr(&out);
    assert!(
        err.contains(&format!("leadership of {election:?} was lost")) && err.contains("SIGTERM"),
        "{err}"
    );
    assert!(woke.elapsed() < Duration::from_secs(10));
}

/// A background `fencelock run --permits PERMITS NAME` whose command touches a file and
/// sleeps; returns once the command runs.
fn slot_holder(url: &str, permits: &str, name: &str, ready: &std::path::Path) -> Running {
    let running = Running::start(
        fencelock()
            .args([
                "run",
                "--url",
                url,
                "--permits",
                permits,
                name,
                "--",
                "sh",
                "-c",
            ])
            .arg(r#"touch "$0"; exec sleep 60"#)
            .arg(ready),
    );
    wait_for_file(ready, Duration::from_secs(20));
    running
}

/// LIMIT commands run at once on a semaphore of LIMIT; one more conflicts at once with
/// `-n`, or waits until a slot is given back; a request with another LIMIT is refused.
fn a_semaphore_runs_at_most_limit_commands(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let name = unique("slots");
    let first = slot_holder(url, "1/2", &name, &dir.path().join("1"));
    let _second = slot_holder(url, "1/2", &name, &dir.path().join("2"));
    let third = output(fencelock().args([
        "run",
        "--url",
        url,
        "-n",
        "--permits",
        "1/2",
        &name,
        "--",
        "true",
    ]));
    assert_code(&third, NOT_ACQUIRED);
    assert!(
        stderr(&third).contains(&format!("semaphore {name:?} (1 of 2 permits)")),
        "{}",
        stderr(&third)
    );
    let mismatched = output(fencelock().args([
        "run",
        "--url",
        url,
        "-n",
        "--permits",
        "1/3",
        &name,
        "--",
        "true",
    ]));
    assert_code(&mismatched, USAGE);
    // A lock of the same name is another namespace: free.
    let lock = output(fencelock().args(["run", "--url", url, "-n", &name, "--", "true"]));
    assert_code(&lock, 0);
    // The third waits; it runs once the first gives its slot back.
    let ran = dir.path().join("third");
    let waiting = Running::start(
        fencelock()
            .args([
                "run",
                "--url",
                url,
                "--wait",
                "30s",
                "--permits",
                "1/2",
                &name,
            ])
            .args(["--", "sh", "-c", r#"echo "$FENCELOCK_PERMITS" > "$0""#])
            .arg(&ran),
    );
    assert!(!ran.exists(), "ran while both slots were held");
    drop(first);
    let out = waiting.wait(Duration::from_secs(30));
    assert_code(&out, 0);
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "1/2\n");
}

macro_rules! backend_tests {
    ($backend:ident, $url:expr) => {
        mod $backend {
            use super::*;

            #[test]
            fn leaders_take_turns() {
                super::leaders_take_turns(&$url);
            }

            #[test]
            fn a_frozen_leader_stops_its_command_when_it_wakes() {
                super::a_frozen_leader_stops_its_command_when_it_wakes(&$url);
            }

            #[test]
            fn a_semaphore_runs_at_most_limit_commands() {
                super::a_semaphore_runs_at_most_limit_commands(&$url);
            }
        }
    };
}

backend_tests!(etcd, etcd_url());
backend_tests!(zookeeper, zk_url());
backend_tests!(redis, redis_url());
