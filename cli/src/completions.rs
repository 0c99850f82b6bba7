//! `fencelock completions SHELL`: a completion script for the shell, on stdout.

use clap::CommandFactory;

use crate::args::{Cli, CompletionsArgs};
use crate::exit::code;

/// Prints the completion script.
pub fn completions(args: &CompletionsArgs) -> u8 {
    let mut command = Cli::command();
    clap_complete::generate(
        args.shell,
        &mut command,
        "fencelock",
        &mut std::io::stdout(),
    );
    code::OK
}
