//! Logging: the library's `tracing` events (a lost lock, a failed release, retries,
//! and with `RUST_LOG=debug` much more) on stderr, filtered as `RUST_LOG` says.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::args::Command;

/// Installs the subscriber: `RUST_LOG`'s filter (`EnvFilter` syntax: `debug`,
/// `fencelock_etcd=trace,warn`), else [`default_filter`]; to stderr, coloured only when
/// stderr is a terminal and `NO_COLOR` is not set. A `RUST_LOG` that does not parse is
/// reported once and the default applies.
pub fn init(command: &Command) {
    let default = default_filter(command);
    let mut refused = None;
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            refused = Some(e);
            EnvFilter::new(default)
        }),
        _ => EnvFilter::new(default),
    };
    let ansi = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    // Writing a line that cannot be written (a closed stderr) is ignored by the
    // formatter, never a panic.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
    if let Some(error) = refused {
        crate::exit::say!(
            "fencelock: warning: RUST_LOG is ignored ({error}); logging at {default}"
        );
    }
}

/// Without `RUST_LOG`: `warn`, so that every loss of a held lock is logged with its
/// cause; `error` with `--quiet`; nothing with `--json` on `run`, `hold` and `elect`,
/// whose stderr then carries only JSON lines (the loss is a `lost` event there).
pub fn default_filter(command: &Command) -> &'static str {
    let output = match command {
        Command::Run(args) => Some(&args.output),
        Command::Elect(args) => Some(&args.output),
        Command::Hold(args) => Some(&args.output),
        _ => None,
    };
    match output {
        Some(output) if output.json => "off",
        Some(output) if output.quiet => "error",
        _ => "warn",
    }
}
