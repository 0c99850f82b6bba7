//! The `fencelock` command: run a command under a distributed lock, hold, inspect, list
//! or revoke locks, benchmark a deployment. See `fencelock --help` and `cli/README.md`.

mod args;
mod backend;
mod bench;
mod capabilities;
mod child;
mod completions;
mod duration;
mod events;
mod exit;
mod hold;
mod inspect;
mod list;
mod run;
mod signals;

use std::process::ExitCode;

use clap::Parser;
use clap::error::ErrorKind;

use args::{Cli, Command};
use exit::{Failure, code};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
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

/// Help and version go to stdout with status 0; anything else is one line and status 64.
fn usage_error(error: clap::Error) -> ExitCode {
    match error.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = error.print();
            ExitCode::SUCCESS
        }
        _ => {
            let text = error.to_string();
            let first = text
                .lines()
                .next()
                .unwrap_or("bad usage")
                .trim_start_matches("error: ");
            fail(Failure::usage(format!("{first} (see fencelock --help)")))
        }
    }
}
