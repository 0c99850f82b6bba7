//! `fencelock` end to end on `mem://`: what one process can show (memory locks live in
//! one process, so exclusion between processes is tested on the real backends).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;

#[test]
fn run_exports_token_name_and_backend_and_passes_the_exit_code() {
    let out = output(fencelock().args([
        "run",
        "jobs/nightly",
        "--",
        "sh",
        "-c",
        r#"echo "$FENCELOCK_TOKEN|$FENCELOCK_NAME|$FENCELOCK_BACKEND"; exit 3"#,
    ]));
    assert_code(&out, 3);
    let line = stdout(&out);
    let parts: Vec<_> = line.trim().split('|').collect();
    assert!(parts[0].parse::<u64>().unwrap() > 0, "{line}");
    assert_eq!(parts[1..], ["jobs/nightly", "mem"]);

    let ok = output(fencelock().args(["run", "--url", "mem://", "a", "--", "true"]));
    assert_code(&ok, 0);
}

#[test]
fn the_url_comes_from_the_flag_then_the_environment() {
    let out = output(
        fencelock()
            .env("FENCELOCK_URL", "consul://127.0.0.1:8500")
            .args(["inspect", "a"]),
    );
    assert_code(&out, USAGE);
    assert!(stderr(&out).contains("consul"), "{}", stderr(&out));
    let out = output(
        fencelock()
            .env("FENCELOCK_URL", "consul://127.0.0.1:8500")
            .args(["inspect", "--url", "mem://", "a"]),
    );
    assert_code(&out, 0);
}

#[test]
fn usage_errors_are_one_line_with_code_64() {
    for args in [
        &["run", "--url", "consul://x", "a", "--", "true"][..],
        &["run", "--url", "no-scheme", "a", "--", "true"],
        &["run", "--wait", "5 weeks", "a", "--", "true"],
        &["run", "a"],
        &["run", "", "--", "true"],
        &["run", "--lease", "0s", "a", "--", "true"],
        &["bench", "--workload", "sideways"],
        &["inspect"],
        &["frobnicate"],
    ] {
        let out = output(fencelock().args(args));
        assert_code(&out, USAGE);
    }
}

#[test]
fn a_missing_or_unexecutable_command_has_its_own_code() {
    let out = output(fencelock().args(["run", "a", "--", "/nonexistent/fencelock-test"]));
    assert_code(&out, NOT_FOUND);
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("not-executable");
    std::fs::write(&script, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = output(fencelock().args(["run", "a", "--"]).arg(&script));
    assert_code(&out, CANNOT_EXECUTE);
}

#[test]
fn a_lost_lock_stops_the_command_with_sigterm() {
    let start = Instant::now();
    let out =
        output(fencelock().args(["run", "--fixed-lease", "1s", "short", "--", "sleep", "30"]));
    assert_code(&out, LOST);
    assert!(stderr(&out).contains("SIGTERM"), "{}", stderr(&out));
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_command_ignoring_sigterm_is_killed_after_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    let start = Instant::now();
    let out = output(
        fencelock()
            .args([
                "run",
                "--fixed-lease",
                "1s",
                "--kill-grace",
                "300ms",
                "stubborn",
                "--",
                "sh",
                "-c",
                r#"trap "" TERM; touch "$0"; while :; do sleep 0.05; done"#,
            ])
            .arg(&ready),
    );
    assert_code(&out, LOST);
    assert!(ready.exists());
    assert!(stderr(&out).contains("SIGKILL"), "{}", stderr(&out));
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn sigterm_is_forwarded_to_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    let got = dir.path().join("got-term");
    let running = Running::start(
        fencelock()
            .args([
                "run",
                "forwarded",
                "--",
                "sh",
                "-c",
                r#"trap 'touch "$1"; exit 7' TERM; touch "$0"; while :; do sleep 0.05; done"#,
            ])
            .arg(&ready)
            .arg(&got),
    );
    wait_for_file(&ready, Duration::from_secs(20));
    signal(running.pid(), Signal::SIGTERM);
    let out = running.wait(Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    assert!(got.exists());
}

#[test]
fn inspect_prints_text_and_json() {
    let out = output(fencelock().args(["inspect", "free-lock"]));
    assert_code(&out, 0);
    assert!(stdout(&out).contains("held     no"), "{}", stdout(&out));
    let out = output(fencelock().args(["inspect", "--json", "free-lock"]));
    assert_code(&out, 0);
    let doc: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(doc["held"], false);
    assert_eq!(doc["backend"], "mem");
}

#[test]
fn every_subcommand_has_help_with_an_example() {
    for sub in ["run", "inspect", "bench"] {
        let out = output(fencelock().args([sub, "--help"]));
        assert_code(&out, 0);
        let help = stdout(&out);
        assert!(help.contains("Examples:"), "{sub}: {help}");
        assert!(help.contains(&format!("fencelock {sub}")), "{sub}: {help}");
    }
    let out = output(fencelock().arg("--help"));
    assert!(stdout(&out).contains("75"), "the exit codes are listed");
}

#[test]
fn bench_json_has_every_field_for_each_workload() {
    for (workload, clients) in [("uncontended", 1), ("contended", 3), ("many-keys", 3)] {
        let out = output(fencelock().args([
            "bench",
            "--workload",
            workload,
            "--clients",
            "3",
            "--duration",
            "300ms",
            "--baseline",
            "--json",
        ]));
        assert_code(&out, 0);
        let doc = check_bench_json(&stdout(&out), workload, true);
        assert_eq!(doc["clients"], clients);
        assert_eq!(doc["backend"], "mem");
    }
    let out =
        output(fencelock().args(["bench", "--workload", "uncontended", "--duration", "200ms"]));
    assert_code(&out, 0);
    assert!(stdout(&out).contains("p99"), "{}", stdout(&out));
}
