//! Helpers for the end-to-end tests of the `fencelock` binary.

#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A name no other test run uses.
pub fn unique(label: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("cli-{label}-{}-{nanos}", std::process::id())
}

/// A URL for each backend whose sessions / leases can be as short as 2 s.
pub fn etcd_url() -> String {
    format!(
        "etcd://{}/fencelock-cli?lease=2s",
        fencelock_testkit::EtcdServer::shared().endpoint()
    )
}

pub fn zk_url() -> String {
    format!(
        "zk://{}/fencelock-cli?session_timeout=2s&min_lease=1s",
        fencelock_testkit::ZkServer::shared().connect_string()
    )
}

pub fn redis_url() -> String {
    fencelock_testkit::RedisServer::shared().url()
}

/// The documented exit codes.
pub const USAGE: i32 = 64;
pub const NOT_ACQUIRED: i32 = 75;
pub const LOST: i32 = 76;
pub const CANNOT_EXECUTE: i32 = 126;
pub const NOT_FOUND: i32 = 127;

/// `fencelock` with a clean environment (no `FENCELOCK_URL` or `FENCELOCK_CONFIG`).
pub fn fencelock() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_fencelock"));
    command
        .env_remove("FENCELOCK_URL")
        .env_remove("FENCELOCK_CONFIG")
        .stdin(Stdio::null());
    command
}

/// Waits until `pid` is gone (or a zombie), at most `timeout`; whether it is.
pub fn gone_within(pid: u32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while alive(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// A background `fencelock run --url mem:// NAME` whose command is a `sleep 30` that
/// wrote its pid to a file first; returns it and the command's pid.
pub fn run_sleeper(name: &str, dir: &Path) -> (Running, u32) {
    run_sleeper_at("mem://", name, dir)
}

/// [`run_sleeper`] on the backend at `url`.
pub fn run_sleeper_at(url: &str, name: &str, dir: &Path) -> (Running, u32) {
    let pidfile = dir.join("pid");
    let running = Running::start(
        fencelock()
            .args(["run", "--url", url, name, "--", "sh", "-c"])
            .arg(r#"echo $$ > "$0.tmp"; mv "$0.tmp" "$0"; exec sleep 30"#)
            .arg(&pidfile),
    );
    wait_for_file(&pidfile, Duration::from_secs(20));
    let pid = read_pid(&pidfile);
    (running, pid)
}

/// Reads a pid the command wrote (atomically, with a rename) to `path`.
pub fn read_pid(path: &Path) -> u32 {
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Runs to completion (at most 60 s) and returns the output.
pub fn output(command: &mut Command) -> Output {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn fencelock");
    let pid = child.id();
    let watchdog = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
            if !fencelock_testkit::process_alive(pid) {
                return;
            }
        }
        signal(pid, Signal::SIGKILL);
    });
    let out = child.wait_with_output().expect("wait for fencelock");
    let _ = watchdog.join();
    out
}

/// stderr as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// stdout as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts the exit code, and that fencelock's own failures are one `fencelock: ` line.
pub fn assert_code(out: &Output, code: i32) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "stdout: {}\nstderr: {}",
        stdout(out),
        stderr(out)
    );
    // fencelock's own outcomes end in one error line; a command's status passes through.
    if [64, 69, 70, 75, 76, 126, 127].contains(&code) {
        let err = stderr(out);
        let ours: Vec<_> = err
            .lines()
            .filter(|l| l.starts_with("fencelock: "))
            .collect();
        assert_eq!(ours.len(), 1, "one error line expected: {err}");
    }
}

/// Sends a signal to a process.
pub fn signal(pid: u32, signal: Signal) {
    let _ = kill(Pid::from_raw(pid as i32), signal);
}

/// A background `fencelock run`, stopped (with its command) when dropped.
pub struct Running {
    child: Option<Child>,
    pid: u32,
}

impl Running {
    /// Starts `command` with piped output.
    pub fn start(command: &mut Command) -> Self {
        let child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn fencelock");
        Running {
            pid: child.id(),
            child: Some(child),
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits at most `timeout` for it to exit (then kills it) and returns its output.
    pub fn wait(mut self, timeout: Duration) -> Output {
        let mut child = self.child.take().expect("not waited yet");
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if child.try_wait().expect("try_wait").is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if child.try_wait().expect("try_wait").is_none() {
            let _ = child.kill();
        }
        child.wait_with_output().expect("wait_with_output")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(None) = child.try_wait() {
            // SIGTERM is forwarded to the command, which then ends with fencelock.
            signal(self.pid, Signal::SIGCONT);
            signal(self.pid, Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Waits until `path` exists (at most `timeout`).
pub fn wait_for_file(path: &Path, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether a process with this id exists.
pub fn alive(pid: u32) -> bool {
    fencelock_testkit::process_alive(pid)
}

/// Checks a `bench --json` document has every field.
pub fn check_bench_json(text: &str, workload: &str, baseline: bool) -> serde_json::Value {
    let doc: serde_json::Value = serde_json::from_str(text.trim()).expect("bench --json parses");
    for field in [
        "url",
        "backend",
        "workload",
        "clients",
        "duration_s",
        "rounds",
        "hold_s",
        "lease_s",
        "fencelock",
        "baseline",
    ] {
        assert!(doc.get(field).is_some(), "missing {field}: {doc}");
    }
    assert_eq!(doc["workload"], workload);
    let mut runs = vec![&doc["fencelock"]];
    if baseline {
        runs.push(&doc["baseline"]);
    } else {
        assert!(doc["baseline"].is_null());
    }
    for run in runs {
        for field in [
            "description",
            "ops",
            "elapsed_s",
            "ops_per_sec",
            "p50_us",
            "p99_us",
            "p999_us",
            "max_us",
            "per_client_ops",
            "fairness",
        ] {
            assert!(run.get(field).is_some(), "missing {field}: {run}");
        }
        assert!(run["ops"].as_u64().unwrap() > 0, "{run}");
        // Grants to another client than the one before: contended only.
        if workload == "contended" {
            let handoffs = run["handoffs"].as_u64().expect("handoffs");
            assert!(handoffs < run["ops"].as_u64().unwrap(), "{run}");
            assert!(run["handoffs_per_sec"].as_f64().is_some(), "{run}");
        } else {
            assert!(run["handoffs"].is_null(), "{run}");
            assert!(run["handoffs_per_sec"].is_null(), "{run}");
        }
        assert!(run["p99_us"].as_f64().unwrap() >= run["p50_us"].as_f64().unwrap());
        assert_eq!(
            run["per_client_ops"].as_array().unwrap().len() as u64,
            doc["clients"].as_u64().unwrap()
        );
    }
    doc
}

/// The state letter of process `pid` from `/proc` (`T` stopped, `S` sleeping; `?` when
/// gone).
pub fn process_state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next())
        .unwrap_or('?')
}
