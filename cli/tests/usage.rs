//! `fencelock` end to end on `mem://`, for what a new user meets first: usage errors
//! that say what is wrong (clap's whole message, the usage line, a tip about `--`),
//! flock's `-c`/`--command` and `-n`/`--nonblock`, the README's config file with
//! `metrics = true`, logging through `RUST_LOG`, `run --permits` and `elect`.

mod common;

use std::time::Duration;

use common::*;

/// The command line's own failure line, and the rest of clap's message after it.
fn usage_failure(args: &[&str]) -> String {
    let out = output(fencelock().args(args));
    assert_code(&out, USAGE);
    let err = stderr(&out);
    assert!(err.starts_with("fencelock: "), "{err}");
    assert!(
        !err.contains("\x1b["),
        "no colours when not a terminal: {err:?}"
    );
    err
}

#[test]
fn a_missing_command_is_named_with_the_usage_line() {
    let err = usage_failure(&["run", "--url", "mem://", "x"]);
    assert!(
        err.contains("the following required arguments were not provided:\n  <COMMAND>..."),
        "{err}"
    );
    assert!(err.contains("Usage: fencelock run "), "{err}");
    assert!(
        err.contains(
            "tip: the command goes after `--`: fencelock run [OPTIONS] NAME -- COMMAND [ARGS]..."
        ),
        "{err}"
    );
    assert!(err.contains("-c 'STRING'"), "{err}");
}

#[test]
fn a_command_without_double_dash_gets_a_tip() {
    let err = usage_failure(&["run", "--url", "mem://", "x", "echo", "hi"]);
    assert!(
        err.starts_with("fencelock: unexpected argument 'echo' found"),
        "{err}"
    );
    assert!(
        err.contains("Usage: fencelock run [OPTIONS] <NAME> [-- <COMMAND>...]"),
        "{err}"
    );
    assert!(
        err.contains("tip: the command goes after `--`: fencelock run [OPTIONS] NAME -- echo ..."),
        "{err}"
    );
    let err = usage_failure(&["elect", "--url", "mem://", "leader", "value", "echo", "hi"]);
    assert!(
        err.contains("fencelock elect [OPTIONS] ELECTION [VALUE] -- echo ..."),
        "{err}"
    );
}

#[test]
fn clap_suggestions_reach_the_user() {
    let err = usage_failure(&["run", "--url", "mem://", "--wiat", "1s", "x", "--", "true"]);
    assert!(err.contains("unexpected argument '--wiat' found"), "{err}");
    assert!(
        err.contains("tip: a similar argument exists: '--wait'"),
        "{err}"
    );
    assert!(err.contains("Usage: fencelock run "), "{err}");
    let err = usage_failure(&["elcet", "--url", "mem://", "x", "--", "true"]);
    assert!(err.contains("unrecognized subcommand 'elcet'"), "{err}");
    assert!(err.contains("Usage: fencelock <COMMAND>"), "{err}");
}

/// flock's `-c STRING` (and its long form `--command`), `-n` / `--nonblock`.
#[test]
fn flock_habits_command_string_and_nonblock() {
    for flag in ["-c", "--command", "--shell"] {
        let out = output(fencelock().args([
            "run",
            "--url",
            "mem://",
            "--nonblock",
            flag,
            r#"echo "token=$FENCELOCK_TOKEN"; exit 3"#,
            "job",
        ]));
        assert_code(&out, 3);
        assert_eq!(stdout(&out), "token=1\n", "{flag}");
    }
    let err = usage_failure(&["run", "--url", "mem://", "-c", "true", "job", "--", "true"]);
    assert!(err.contains("cannot be used with"), "{err}");
    let err = usage_failure(&[
        "run", "--url", "mem://", "-n", "-w", "1s", "job", "--", "true",
    ]);
    assert!(err.contains("cannot be used with"), "{err}");
}

/// The config file of fencelock's README says `metrics = true`; the command accepts it.
#[test]
fn the_readme_config_file_with_metrics_runs() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fencelock.toml");
    std::fs::write(
        &file,
        "backend = \"mem\"\nprefix = \"locks\"\nmetrics = true\n",
    )
    .unwrap();
    let out = output(
        fencelock()
            .args(["run", "--config"])
            .arg(&file)
            .args(["job", "--", "true"]),
    );
    assert_code(&out, 0);
    let out = output(
        fencelock()
            .env("FENCELOCK_URL", "mem://?metrics=true&metrics_names=true")
            .args(["run", "job", "--", "true"]),
    );
    assert_code(&out, 0);
}

/// What `cargo install` builds is the CLI with its own features, not the workspace's
/// union (which these tests run with): the facade's `metrics` must be among them.
#[test]
fn the_cli_is_built_with_the_metrics_feature() {
    let manifest = include_str!("../Cargo.toml");
    let facade = manifest
        .lines()
        .find(|l| l.starts_with("fencelock = "))
        .expect("the CLI depends on the facade");
    for feature in ["\"full\"", "\"metrics\""] {
        assert!(facade.contains(feature), "{feature} missing: {facade}");
    }
}

#[test]
fn rust_log_debug_logs_and_the_default_is_quiet() {
    let out = output(
        fencelock()
            .env("RUST_LOG", "debug")
            .args(["run", "--url", "mem://", "job", "--", "true"]),
    );
    assert_code(&out, 0);
    let err = stderr(&out);
    assert!(
        err.lines()
            .any(|l| l.contains(" DEBUG ") && l.contains("acquired lock \"job\"")),
        "{err}"
    );
    assert!(!err.contains("\x1b["), "plain when not a terminal: {err:?}");
    let out = output(
        fencelock()
            .env_remove("RUST_LOG")
            .args(["run", "--url", "mem://", "-v", "job", "--", "true"]),
    );
    assert_code(&out, 0);
    let err = stderr(&out);
    assert!(
        !err.contains("DEBUG") && !err.contains(" INFO "),
        "default: {err}"
    );
    let out = output(
        fencelock()
            .env("RUST_LOG", "fencelock=[")
            .args(["run", "--url", "mem://", "job", "--", "true"]),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("RUST_LOG is ignored"),
        "{}",
        stderr(&out)
    );
}

/// Without `RUST_LOG` a loss is logged at warn by the library, with its cause, besides
/// the command line's own failure line; `--json` keeps stderr JSON lines only.
#[test]
fn a_loss_is_logged_at_warn_by_default() {
    let lose = |json: bool| {
        let mut command = fencelock();
        command.env_remove("RUST_LOG").args([
            "run",
            "--url",
            "mem://",
            "--fixed-lease",
            "300ms",
            "--kill-grace",
            "1s",
        ]);
        if json {
            command.arg("--json");
        }
        output(command.args(["lost", "--", "sleep", "30"]))
    };
    let out = lose(false);
    assert_code(&out, LOST);
    let err = stderr(&out);
    assert!(
        err.lines()
            .any(|l| l.contains(" WARN ") && l.contains("lost") && l.contains("lease_expired")),
        "{err}"
    );
    let out = lose(true);
    assert_eq!(out.status.code(), Some(LOST), "{}", stderr(&out));
    let err = stderr(&out);
    for line in err.lines().filter(|l| !l.starts_with("fencelock: ")) {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "not JSON: {line}\n{err}"
        );
    }
    assert!(err.contains("\"event\":\"lost\""), "{err}");
}

#[test]
fn permits_must_be_n_of_limit() {
    for (bad, says) in [
        ("0/2", "N and LIMIT are at least 1, not 0/2"),
        ("1/0", "N and LIMIT are at least 1, not 1/0"),
        ("3/2", "N is at most LIMIT: 3 permits of a semaphore of 2"),
        ("x", "expected N/LIMIT"),
        ("1/", "expected N/LIMIT"),
        ("1/2/3", "expected N/LIMIT"),
        ("a/2", "expected N/LIMIT"),
        ("1/99999999999", "expected N/LIMIT"),
    ] {
        let err = usage_failure(&[
            "run",
            "--url",
            "mem://",
            "--permits",
            bad,
            "x",
            "--",
            "true",
        ]);
        assert!(
            err.contains(&format!("invalid value '{bad}' for '--permits <N/LIMIT>'")),
            "{err}"
        );
        assert!(err.contains(says), "{bad}: {err}");
    }
}

#[test]
fn permits_are_in_the_environment() {
    let out = output(fencelock().args([
        "run",
        "--url",
        "mem://",
        "--permits",
        "2/3",
        "--json",
        "slots",
        "--",
        "sh",
        "-c",
        r#"echo "$FENCELOCK_PERMITS $FENCELOCK_NAME $FENCELOCK_TOKEN""#,
    ]));
    assert_code(&out, 0);
    assert_eq!(stdout(&out), "2/3 slots 1\n");
    let acquired: serde_json::Value =
        serde_json::from_str(stderr(&out).lines().next().unwrap()).unwrap();
    assert_eq!(acquired["event"], "acquired");
    assert_eq!(acquired["token"], 1);
}

#[test]
fn elect_runs_its_command_as_leader() {
    let out = output(fencelock().args([
        "elect",
        "--url",
        "mem://",
        "scheduler",
        "host-a:8080",
        "--",
        "sh",
        "-c",
        r#"echo "$FENCELOCK_NAME $FENCELOCK_VALUE $FENCELOCK_TOKEN"; exit 4"#,
    ]));
    assert_code(&out, 4);
    assert_eq!(stdout(&out), "scheduler host-a:8080 1\n");
    // The default value: HOST:PID.
    let out = output(fencelock().args([
        "elect",
        "--url",
        "mem://",
        "-c",
        r#"echo "$FENCELOCK_VALUE""#,
        "scheduler",
    ]));
    assert_code(&out, 0);
    let value = stdout(&out);
    let (host, pid) = value.trim().rsplit_once(':').expect("HOST:PID");
    assert!(!host.is_empty() && pid.parse::<u32>().is_ok(), "{value}");
}

/// Leadership lost (a fixed lease that runs out) stops the command as `run` does.
#[test]
fn elect_stops_its_command_when_leadership_is_lost() {
    let start = std::time::Instant::now();
    let out = output(fencelock().args([
        "elect",
        "--url",
        "mem://",
        "--fixed-lease",
        "500ms",
        "scheduler",
        "--",
        "sleep",
        "30",
    ]));
    assert_code(&out, LOST);
    let err = stderr(&out);
    assert!(
        err.contains("fencelock: leadership of \"scheduler\" was lost") && err.contains("SIGTERM"),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(10));
}
