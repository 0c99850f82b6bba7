//! `fencelock completions SHELL`: a completion script for the shell, on stdout.

use clap::CommandFactory;

use crate::args::{Cli, CompletionsArgs};
use crate::exit::code;

/// Prints the completion script.
///
/// # Errors
///
/// [`code::IO_ERROR`](crate::exit::code::IO_ERROR) when standard output cannot be written.
pub fn completions(args: &CompletionsArgs) -> Result<u8, crate::exit::Failure> {
    let mut command = Cli::command();
    // Into a buffer first: `generate` panics on a failed write.
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, "fencelock", &mut script);
    crate::exit::print_out(&String::from_utf8_lossy(&script))?;
    Ok(code::OK)
}
