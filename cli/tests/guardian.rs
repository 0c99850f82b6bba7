//! A `fencelock run` that dies (SIGKILL: a crash, the OOM killer, `kill -9`) takes its
//! whole command with it, not only the command's own process: the worker of `sh -c
//! 'worker; true'`, of a pipeline or of `sh -c 'a; b'` must not write on once the lease
//! ran out and a second `run` was granted the lock. Real processes on a real Redis
//! server with a 2 s lease, as the report measured (issue 35, item 1).

mod common;

use std::os::unix::process::ExitStatusExt as _;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use fencelock_testkit::RedisServer;
use nix::sys::signal::Signal;

/// A name no other test run uses.
fn unique(label: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("cli-guardian-{label}-{}-{nanos}", std::process::id())
}

/// The worker: a shell script (a process of its own, the command's grandchild) that
/// writes its pid, then appends a numbered `first N` line to the log every 20 ms, for
/// at most 30 s (so a worker a failed run leaves behind ends by itself).
const WORKER: &str = r#"
echo $$ > "$PIDFILE.tmp"; mv "$PIDFILE.tmp" "$PIDFILE"
i=0
while [ $i -lt 1500 ]; do
    i=$((i + 1))
    echo "first $i" >> "$LOG"
    sleep 0.02
done
"#;

/// The second holder: marks its grant in the same log, stays inside for a while (the
/// window in which a surviving worker would be seen), and marks its end.
const SECOND: &str = r#"
echo "second granted $FENCELOCK_TOKEN" >> "$LOG"
sleep 1
echo "second done" >> "$LOG"
"#;

/// Kills the worker if a failed test left it running (it also ends by itself).
struct Reap(Option<u32>);

impl Drop for Reap {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            signal(pid, Signal::SIGKILL);
        }
    }
}

/// `fencelock run` of `shape` (a `sh -c` script whose `$0` is the worker's script) holds
/// the lock while the worker writes; fencelock is SIGKILLed; a second `run` of the same
/// name is granted once the lease ran out. No line of the worker may follow the second
/// holder's grant, and the worker must be gone. With `after` set, fencelock is killed
/// only once its stderr has a line containing `after` (an event of the run).
fn killed_fencelock_leaves_no_writer(label: &str, shape: &str, after: Option<&str>) {
    let dir = tempfile::tempdir().unwrap();
    let url = RedisServer::shared().url();
    let name = unique(label);
    let log = dir.path().join("log");
    let pidfile = dir.path().join("worker.pid");
    let worker = dir.path().join("worker.sh");
    let errors = dir.path().join("stderr");
    std::fs::write(&worker, WORKER).unwrap();
    let env = |command: &mut std::process::Command| {
        command.env("LOG", &log).env("PIDFILE", &pidfile);
    };

    // Not `Running`: its pipes would stay open in a surviving worker, and reading
    // them to their end would wait for the worker to finish.
    let mut first = fencelock();
    first
        .args(["run", "--url", &url, "--lease", "2s", &name, "--"])
        .args(["sh", "-c", shape])
        .arg(&worker)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&errors).unwrap());
    env(&mut first);
    let mut first = first.spawn().expect("spawn fencelock");
    wait_for_file(&pidfile, Duration::from_secs(20));
    let reap = Reap(Some(read_pid(&pidfile)));
    wait_for_line(&log, "first ", Duration::from_secs(20));
    if let Some(event) = after {
        wait_for_text(&errors, event, Duration::from_secs(20));
    }

    signal(first.id(), Signal::SIGKILL);
    let status = first.wait().expect("wait for fencelock");
    assert_eq!(
        status.signal(),
        Some(9),
        "fencelock was not killed: {status}"
    );

    let mut second = fencelock();
    second
        .args(["run", "--url", &url, "--wait", "30s", &name, "--"])
        .args(["sh", "-c", SECOND]);
    env(&mut second);
    let out = output(&mut second);
    assert_code(&out, 0);

    let text = std::fs::read_to_string(&log).unwrap();
    let granted = text
        .lines()
        .position(|l| l.starts_with("second granted"))
        .unwrap_or_else(|| panic!("no grant marker in the log:\n{text}"));
    let late: Vec<&str> = text
        .lines()
        .skip(granted)
        .filter(|l| l.starts_with("first "))
        .collect();
    assert!(
        late.is_empty(),
        "{label}: the killed fencelock's worker wrote {} line(s) after the second holder's \
         grant (first of them {:?}):\n{text}",
        late.len(),
        late.first()
    );
    assert!(text.contains("second done"), "{text}");
    let worker_pid = reap.0.unwrap_or_default();
    assert!(
        gone_within(worker_pid, Duration::from_secs(10)),
        "{label}: the worker {worker_pid} outlived the killed fencelock"
    );
}

/// Waits until `path` has a line starting with `prefix` (at most `timeout`).
fn wait_for_line(path: &Path, prefix: &str, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.lines().any(|l| l.starts_with(prefix)) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {prefix:?} line in {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `path` contains `text` (at most `timeout`).
fn wait_for_text(path: &Path, text: &str, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    while !std::fs::read_to_string(path)
        .unwrap_or_default()
        .contains(text)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no {text:?} in {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// (a) The worker is a foreground grandchild: `sh` waits for it, then runs `true`.
#[test]
fn a_foreground_grandchild_dies_with_fencelock() {
    killed_fencelock_leaves_no_writer("grandchild", r#"sh "$0"; true"#, None);
}

/// (b) The worker is the first member of a pipeline.
#[test]
fn a_pipeline_dies_with_fencelock() {
    killed_fencelock_leaves_no_writer("pipeline", r#"sh "$0" | cat"#, None);
}

/// (c) `sh -c 'a; b'` where `b` is the writer.
#[test]
fn the_second_step_of_a_script_dies_with_fencelock() {
    killed_fencelock_leaves_no_writer("steps", r#"echo report > /dev/null; sh "$0""#, None);
}

/// (d) The command's own process exited, leaving the worker in its group (`worker &
/// exit 0`): fencelock keeps the lock while the worker runs (it says so), and its death
/// must still stop the worker, although the guardian exited with the command.
#[test]
fn a_worker_left_in_the_group_dies_with_fencelock() {
    killed_fencelock_leaves_no_writer(
        "left",
        r#"sh "$0" & exit 0"#,
        Some("the lock is kept until the processes it left"),
    );
}

/// The command starts as it would without the guardian between it and fencelock: no
/// signal blocked or ignored (the guardian blocks every signal for itself).
#[test]
fn the_command_inherits_no_blocked_or_ignored_signal() {
    let out = output(fencelock().args([
        "run",
        "--url",
        "mem://",
        "mask",
        "--",
        "grep",
        "-E",
        "^Sig(Blk|Ign)",
        "/proc/self/status",
    ]));
    assert_code(&out, 0);
    let text = stdout(&out);
    let mask = |field: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .unwrap_or_else(|| panic!("no {field} in {text}"))
    };
    assert_eq!(mask("SigBlk:"), 0, "{text}");
    // Signals 1 to 31 (bits 0 to 30): the guardian's, and the ones fencelock forwards.
    // What the test's own parent may ignore of the others passes through as before.
    assert_eq!(mask("SigIgn:") & 0x7fff_ffff, 0, "{text}");
}

/// A command's exit code, or its death by a signal, reaches fencelock through the
/// guardian unchanged (128 + the signal, as a shell reports it).
#[test]
fn exit_codes_and_signal_deaths_pass_through_the_guardian() {
    for (script, code) in [
        ("exit 0", 0),
        ("exit 3", 3),
        ("exit 200", 200),
        ("kill -TERM $$", 143),
        ("kill -INT $$", 130),
        ("kill -SEGV $$", 139),
        ("kill -KILL $$", 137),
    ] {
        let out = output(
            fencelock().args(["run", "--url", "mem://", "status", "--", "sh", "-c", script]),
        );
        assert_eq!(out.status.code(), Some(code), "{script}: {}", stderr(&out));
    }
}

/// The guardian's own first argument, typed by hand, is refused as a usage error.
#[test]
fn the_guardian_argument_alone_is_a_usage_error() {
    let out = output(fencelock().args(["__fencelock-guardian", "x"]));
    assert_code(&out, USAGE);
}

/// fencelock goes on as soon as the command started, not when it ends: the pipe on
/// which the guardian reports a failure to start is not the command's (a command that
/// kept it open would keep fencelock from handling signals or a loss while it runs).
#[test]
fn fencelock_goes_on_while_the_command_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (running, pid) = run_sleeper("started", dir.path());
    signal(running.pid(), Signal::SIGTERM);
    let out = running.wait(Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(143), "{}", stderr(&out));
    assert!(gone_within(pid, Duration::from_secs(5)));
}
