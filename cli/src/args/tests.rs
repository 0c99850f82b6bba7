use std::time::Duration;

use super::*;
use clap::CommandFactory;

#[test]
fn the_command_line_is_consistent() {
    Cli::command().debug_assert();
}

/// The exit codes `--help` lists, the README's table lists and `exit::code` defines
/// are the same; 76 is `hold`'s as well as `run`'s.
#[test]
fn help_and_readme_list_every_exit_code() {
    use crate::exit::code;
    let defined = [
        code::USAGE,
        code::UNAVAILABLE,
        code::INTERNAL,
        code::IO_ERROR,
        code::NOT_ACQUIRED,
        code::LOST,
        code::CANNOT_EXECUTE,
        code::NOT_FOUND,
    ];
    // `  64       ...` in the help, `| 64 | ...` and `| 126 / 127 | ...` in the README.
    let codes_in = |lines: Vec<&str>| {
        let mut codes: Vec<u8> = lines
            .iter()
            .flat_map(|l| l.split(['/', ' ']).filter_map(|w| w.parse::<u8>().ok()))
            .filter(|&c| c != code::OK)
            .collect();
        codes.sort_unstable();
        codes
    };
    let help: Vec<&str> = EXIT_CODES
        .lines()
        .filter(|l| l.starts_with("  ") && l.trim_start().starts_with(char::is_numeric))
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    let readme = include_str!("../../README.md");
    let table: Vec<&str> = readme
        .split("## Exit codes")
        .nth(1)
        .expect("the README has an exit code section")
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| code"))
        .map(|l| l.split('|').nth(1).unwrap())
        .collect();
    assert_eq!(codes_in(help), defined, "--help: {EXIT_CODES}");
    assert_eq!(codes_in(table), defined, "README");
    let lost = EXIT_CODES.lines().find(|l| l.contains("  76 ")).unwrap();
    assert!(lost.contains("run") && lost.contains("hold"), "{lost}");
}

#[test]
fn backend_precedence() {
    let env = |v: &str| Some(OsString::from(v));
    let url = |u: &str| Ok(Backend::Url(u.into()));
    let file = |p: &str| Ok(Backend::File(p.into()));
    assert_eq!(
        resolve_backend(
            Some("etcd://a".into()),
            None,
            env("zk://b"),
            env("f"),
            false
        ),
        url("etcd://a")
    );
    assert_eq!(
        resolve_backend(None, Some("c.toml".into()), env("zk://b"), None, false),
        file("c.toml")
    );
    assert_eq!(
        resolve_backend(None, None, env("zk://b"), None, false),
        url("zk://b")
    );
    assert_eq!(
        resolve_backend(None, None, env(""), env("f"), false),
        file("f")
    );
    assert!(resolve_backend(None, None, env("zk://b"), env("f"), false).is_err());
    // No silent in-process default for run, inspect and hold; bench keeps one.
    let none = resolve_backend(None, None, env(""), None, false).unwrap_err();
    assert!(
        none.contains("--url") && none.contains("FENCELOCK_CONFIG"),
        "{none}"
    );
    assert_eq!(resolve_backend(None, None, None, None, true), url("mem://"));
}

#[test]
fn run_takes_the_command_after_double_dash() {
    let cli =
        Cli::try_parse_from(["fencelock", "run", "--wait", "2s", "job", "--", "ls", "-l"]).unwrap();
    let Command::Run(run) = cli.command else {
        panic!("not run")
    };
    assert_eq!(run.wait.wait.map(|w| w.value), Some(Duration::from_secs(2)));
    assert_eq!(run.command, ["ls", "-l"]);
    assert!(Cli::try_parse_from(["fencelock", "run", "job"]).is_err());
    let cli = Cli::try_parse_from(["fencelock", "run", "-n", "-c", "echo hi", "job"]).unwrap();
    let Command::Run(run) = cli.command else {
        panic!("not run")
    };
    assert!(run.wait.nonblock && run.command.is_empty());
    assert_eq!(run.child.shell.as_deref(), Some("echo hi".as_ref()));
    for conflicting in [
        &["fencelock", "run", "-n", "-w", "1s", "job", "--", "true"][..],
        &["fencelock", "run", "-c", "true", "job", "--", "true"],
        &[
            "fencelock",
            "run",
            "--url",
            "mem://",
            "--config",
            "f",
            "job",
            "--",
            "true",
        ],
        &["fencelock", "run", "-q", "-v", "job", "--", "true"],
    ] {
        assert!(Cli::try_parse_from(conflicting).is_err(), "{conflicting:?}");
    }
    let cli = Cli::try_parse_from(["fencelock", "run", "--timeout", "250ms", "j", "-c", "x"]);
    assert!(cli.is_ok(), "--timeout is an alias of --wait");
    for flag in ["--command", "--shell"] {
        let cli = Cli::try_parse_from(["fencelock", "run", flag, "echo hi", "job"]).unwrap();
        let Command::Run(run) = cli.command else {
            panic!("not run")
        };
        assert_eq!(
            run.child.shell.as_deref(),
            Some("echo hi".as_ref()),
            "{flag}"
        );
    }
}

#[test]
fn permits_are_n_of_limit() {
    let ok = |text: &str| parse_permits(text).map(|p| (p.count(), p.limit()));
    assert_eq!(ok("1/3"), Ok((1, 3)));
    assert_eq!(ok(" 3 / 3 "), Ok((3, 3)));
    for bad in [
        "0/3",
        "4/3",
        "1/0",
        "0/0",
        "3",
        "",
        "/",
        "1/",
        "a/3",
        "1/3/5",
        "-1/3",
        "1/4294967296",
    ] {
        assert!(parse_permits(bad).is_err(), "{bad:?}");
    }
    let cli = Cli::try_parse_from(["fencelock", "run", "--permits", "2/5", "j", "--", "true"]);
    let Command::Run(run) = cli.unwrap().command else {
        panic!("not run")
    };
    assert_eq!(run.permits, Some(Permits::new(2, 5).unwrap()));
}

#[test]
fn elect_takes_an_optional_value_before_the_command() {
    let cli = Cli::try_parse_from(["fencelock", "elect", "e", "v", "--", "ls"]).unwrap();
    let Command::Elect(elect) = cli.command else {
        panic!("not elect")
    };
    assert_eq!(
        (elect.election.as_str(), elect.value()),
        ("e", "v".to_owned())
    );
    let cli = Cli::try_parse_from(["fencelock", "elect", "-c", "true", "e"]).unwrap();
    let Command::Elect(elect) = cli.command else {
        panic!("not elect")
    };
    assert!(elect.value().ends_with(&format!(":{}", std::process::id())));
    let run = elect.into_run();
    assert_eq!((run.name.as_str(), run.permits), ("e", None));
    assert!(Cli::try_parse_from(["fencelock", "elect", "e", "v"]).is_err());
}
