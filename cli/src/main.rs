//! The `fencelock` command: run a command under a distributed lock, hold, inspect, list
//! or revoke locks, benchmark a deployment. See `fencelock --help` and `cli/README.md`.

mod args;
mod backend;
mod bench;
mod capabilities;
mod child;
mod completions;
mod duration;
mod elect;
mod events;
mod exit;
mod hold;
mod inspect;
mod list;
mod logging;
mod run;
mod signals;

use std::process::ExitCode;

use clap::Parser;
use clap::error::ErrorKind;

use args::{Cli, Command};
use exit::{Failure, code};

fn main() -> ExitCode {
    if let Some(code) = child::guardian_main() {
        return code;
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    logging::init(&cli.command);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return fail(Failure::new(code::INTERNAL, e.to_string())),
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run::run(args).await,
            Command::Elect(args) => elect::elect(args).await,
            Command::Inspect(args) => inspect::inspect(args).await,
            Command::List(args) => list::list(args).await,
            Command::Revoke(args) => list::revoke(args).await,
            Command::Hold(args) => hold::hold(args).await,
            Command::Capabilities(args) => capabilities::capabilities(args).await,
            Command::Completions(args) => completions::completions(&args),
            Command::Bench(args) => bench::bench(args).await,
        }
    });
    // Do not wait for background work (best-effort releases) longer than this.
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(status) => ExitCode::from(status),
        Err(failure) => fail(failure),
    }
}

fn fail(failure: Failure) -> ExitCode {
    crate::exit::say!("fencelock: {failure}");
    ExitCode::from(failure.code)
}

/// Help and version go to stdout with status 0; anything else is clap's whole message
/// (what is wrong, its suggestions, the usage line), its first line starting with
/// `fencelock: `, and status 64.
fn usage_error(error: clap::Error) -> ExitCode {
    match error.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = error.print();
            ExitCode::SUCCESS
        }
        _ => fail(Failure::usage(usage_message(&error))),
    }
}

/// Clap's message without its `error: ` prefix; for `run` and `elect`, a tip when a
/// word after the name looks like the command given without `--`, or the command is
/// missing.
fn usage_message(error: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue};
    let text = error.to_string();
    let text = text.trim_end().trim_start_matches("error: ");
    let command_line: Vec<String> = std::env::args().skip(1).collect();
    let Some(subcommand) = command_line
        .iter()
        .find(|a| !a.starts_with('-'))
        .filter(|sub| *sub == "run" || *sub == "elect")
    else {
        return text.to_owned();
    };
    let what = if subcommand == "elect" {
        "ELECTION [VALUE]"
    } else {
        "NAME"
    };
    let tip = match (error.kind(), error.get(ContextKind::InvalidArg)) {
        (ErrorKind::UnknownArgument, Some(ContextValue::String(arg))) if !arg.starts_with('-') => {
            format!("fencelock {subcommand} [OPTIONS] {what} -- {arg} ...")
        }
        (ErrorKind::MissingRequiredArgument, Some(ContextValue::Strings(args)))
            if args.iter().any(|a| a.contains("COMMAND")) =>
        {
            format!("fencelock {subcommand} [OPTIONS] {what} -- COMMAND [ARGS]...")
        }
        _ => return text.to_owned(),
    };
    let tip = format!(
        "tip: the command goes after `--`: {tip}\n     or is one shell command: -c 'STRING' (run with sh -c)"
    );
    // Before clap's closing "For more information, try '--help'.", when it has one.
    match text.rsplit_once("\n\n") {
        Some((body, more)) if more.starts_with("For more information") => {
            format!("{body}\n\n{tip}\n\n{more}")
        }
        _ => format!("{text}\n\n{tip}"),
    }
}
