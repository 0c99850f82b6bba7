//! `connect_from_env` and `connect_from_env_or_memory` with the real process environment.
//!
//! The environment is process-wide and setting it is `unsafe` in edition 2024, so each
//! case runs this test binary again as a child process, with the environment the case
//! needs, and the child ([`child_connects_from_env`]) prints what the two functions
//! returned. The rules themselves are unit-tested in `src/connect.rs` without touching
//! the environment.

use std::process::Command;

/// Turns [`child_connects_from_env`] into the child.
const CHILD: &str = "FENCELOCK_TEST_CONNECT_ENV_CHILD";

/// Only does something when run by [`outcome`]: prints one line per function, `ok:BACKEND`
/// or `err:KIND:MESSAGE`.
#[tokio::test(flavor = "current_thread")]
async fn child_connects_from_env() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let show =
        |result: Result<std::sync::Arc<dyn fencelock::DistributedLock>, fencelock::Error>| {
            match result {
                Ok(locks) => format!("ok:{}", locks.backend()),
                Err(fencelock::Error::InvalidConfig(message)) => {
                    format!("err:invalid-config:{message}")
                }
                Err(e) => format!("err:other:{e}"),
            }
        };
    println!(
        "CONNECT_FROM_ENV {}",
        show(fencelock::connect_from_env().await)
    );
    println!(
        "CONNECT_FROM_ENV_OR_MEMORY {}",
        show(fencelock::connect_from_env_or_memory().await)
    );
}

/// What the two functions return in a child whose environment is this one's without
/// any `FENCELOCK_URL`/`FENCELOCK_CONFIG`, plus `vars`.
fn outcome(vars: &[(&str, &str)]) -> (String, String) {
    let mut child = Command::new(std::env::current_exe().unwrap());
    child
        .args([
            "child_connects_from_env",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env_remove("FENCELOCK_URL")
        .env_remove("FENCELOCK_CONFIG");
    for (name, value) in vars {
        child.env(name, value);
    }
    let output = child.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "child failed: {stdout}");
    let line = |prefix: &str| {
        stdout
            .lines()
            // The test harness may print `test NAME ... ` before it on the line.
            .find_map(|l| l.split_once(prefix).map(|(_, rest)| rest))
            .unwrap_or_else(|| panic!("no {prefix:?} line in: {stdout}"))
            .to_owned()
    };
    (
        line("CONNECT_FROM_ENV "),
        line("CONNECT_FROM_ENV_OR_MEMORY "),
    )
}

/// Nothing set: `connect_from_env` refuses, naming the variables it read, and does not
/// fall back to a process-local `mem://`.
#[test]
fn unset_is_an_error_naming_the_variables() {
    let (from_env, or_memory) = outcome(&[]);
    assert!(
        from_env.starts_with("err:invalid-config:")
            && from_env.contains("FENCELOCK_URL")
            && from_env.contains("FENCELOCK_CONFIG"),
        "{from_env}"
    );
    assert_eq!(or_memory, "ok:mem");
}

/// A misspelled variable is no backend either, and the error names it.
#[test]
fn a_misspelled_variable_is_named() {
    let (from_env, or_memory) = outcome(&[("FENCELOCK_ULR", "etcd://127.0.0.1:1/x")]);
    assert!(
        from_env.starts_with("err:invalid-config:") && from_env.contains("FENCELOCK_ULR"),
        "{from_env}"
    );
    assert_eq!(or_memory, "ok:mem");
}

/// Memory when written out; an empty variable counts as unset.
#[test]
fn mem_when_written_out() {
    assert_eq!(
        outcome(&[("FENCELOCK_URL", "mem://")]),
        ("ok:mem".into(), "ok:mem".into())
    );
    let (from_env, _) = outcome(&[("FENCELOCK_URL", ""), ("FENCELOCK_CONFIG", "")]);
    assert!(from_env.starts_with("err:invalid-config:"), "{from_env}");
}

/// The config file named by `FENCELOCK_CONFIG` is read.
#[test]
fn config_file_from_the_environment() {
    let dir = std::env::temp_dir().join(format!("fencelock-connect-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("fencelock.toml");
    std::fs::write(&file, "backend = \"mem\"\n").unwrap();
    let outcome = outcome(&[("FENCELOCK_CONFIG", file.to_str().unwrap())]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(outcome, ("ok:mem".into(), "ok:mem".into()));
}
