//! The command line.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use fencelock::Permits;

use crate::duration::DurationArg;

mod bench;

use bench::BENCH_HELP;
pub use bench::{BenchArgs, Workload};

const EXIT_CODES: &str = "\
Exit codes:
  0        success (run, elect: the command's own status is passed through;
           a command killed by signal N gives 128+N)
  64       bad usage: option, duration, URL, scheme, lock name, lease, or a
           requirement not met
  69       the lock backend is unreachable or failed
  70       internal error (bench: a scale workload's check failed)
  74       standard output could not be written (a closed pipe, a full disk)
  75       not acquired: someone else holds the lock (within --wait, or at once
           with -n), the semaphore's permits are taken, not elected, or the URL's
           max_waiters= limit is full; run, elect and hold: -E CODE changes it
  76       run, elect, hold: the lock (permits, leadership) was lost while held
           (run, elect: the command was stopped), or found lost at release
  126/127  run, elect: the command could not be executed / was not found
  128+N    run, elect, hold: signal N (SIGINT, SIGTERM, SIGHUP) arrived while waiting
           for the lock

Environment:
  FENCELOCK_URL, FENCELOCK_CONFIG  the backend when --url and --config are not given
  RUST_LOG  what is logged on stderr (EnvFilter syntax, e.g. debug); default warn,
            so a lost lock is always logged (error with -q, nothing with --json)";

/// Distributed locks with fencing tokens over etcd, ZooKeeper, Redis and memory.
#[derive(Debug, Parser)]
#[command(name = "fencelock", version, after_help = EXIT_CODES)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a command while holding a lock; stop it if the lock is lost.
    #[command(after_help = RUN_HELP)]
    Run(RunArgs),
    /// Run a command while leader of an election; stop it if leadership is lost.
    #[command(after_help = ELECT_HELP)]
    Elect(ElectArgs),
    /// Show who holds a lock, its token, remaining lease and waiters.
    #[command(after_help = INSPECT_HELP)]
    Inspect(InspectArgs),
    /// List the locks under a name prefix that are held or waited for.
    #[command(after_help = LIST_HELP)]
    List(ListArgs),
    /// Take a lock away from its holder (force-release); needs --yes.
    #[command(after_help = REVOKE_HELP)]
    Revoke(RevokeArgs),
    /// Take a lock and hold it until a signal; print its name, key and token.
    #[command(after_help = HOLD_HELP)]
    Hold(HoldArgs),
    /// Measure lock latency and throughput on a deployment.
    #[command(after_help = BENCH_HELP)]
    Bench(BenchArgs),
    /// Show what a backend guarantees; fail if it lacks a --require'd property.
    #[command(after_help = CAPABILITIES_HELP)]
    Capabilities(CapabilitiesArgs),
    /// Print a shell completion script.
    #[command(after_help = COMPLETIONS_HELP)]
    Completions(CompletionsArgs),
}

const CAPABILITIES_HELP: &str = "\
Connects and prints the backend's guarantees: linearizable grants, fencing token
strength, FIFO waiting, how loss is detected, waiter counts, the shortest lease.
With --require (or the URL's require=, or the config file's), a backend lacking a
property is refused: exit 64 naming what is missing. The tool for choosing a backend
per deployment, and for a start-up check in CI.

Examples:
  fencelock capabilities --url redis://127.0.0.1:6379
  fencelock capabilities --url etcd://127.0.0.1:2379/locks --require linearizable --require fencing=strong --json

Exit codes: 0, 64 usage or a requirement not met, 69 backend unavailable,
74 output unwritable.";

const COMPLETIONS_HELP: &str = "\
Examples:
  fencelock completions bash > /etc/bash_completion.d/fencelock
  fencelock completions zsh > \"${fpath[1]}/_fencelock\"";

/// `fencelock capabilities`.
#[derive(Debug, Args)]
pub struct CapabilitiesArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

/// `fencelock completions`.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

const RUN_HELP: &str = "\
The backend is required: --url, --config, FENCELOCK_URL or FENCELOCK_CONFIG
(mem:// only when written out: it locks inside this one process).

The command sees FENCELOCK_TOKEN (the fencing token: pass it to every write),
FENCELOCK_NAME, FENCELOCK_BACKEND and, where the backend has one, FENCELOCK_KEY.
With --permits N/LIMIT, NAME is a semaphore of LIMIT permits (every holder must
give the same LIMIT) and the command runs holding N of them, so at most LIMIT/N
such commands run at once, like `consul lock -n LIMIT`; it also sees
FENCELOCK_PERMITS=N/LIMIT, and a loss stops it as a lost lock does.
It runs in a process group of its own (with /dev/null as stdin if fencelock's
is a terminal). If the lock is lost, the group gets SIGTERM, then SIGKILL after
--kill-grace, and fencelock exits with 76. SIGINT, SIGTERM and SIGHUP are
forwarded to the group once; Ctrl-Z stops the group, then fencelock. The lock is
released when the command exits. If fencelock itself dies (even by SIGKILL), its
guardian process kills the command's whole group with SIGKILL, also what the
command left in it after it exited (Linux only: it needs PR_SET_PDEATHSIG);
processes that leave the group (setsid, daemons) are out of reach.

Examples:
  fencelock run --url etcd://127.0.0.1:2379/locks -w 10s nightly-report -- ./report.sh
  FENCELOCK_URL=redis://127.0.0.1:6379 fencelock run -n billing -c 'echo $FENCELOCK_TOKEN'
  fencelock run --url etcd://127.0.0.1:2379/locks --permits 1/3 encoders -- ./encode.sh

Exit codes: the command's own; 64 usage, 69 backend unavailable, 75 (or -E)
not acquired within --wait, 76 lock lost, 126/127 command not executable / not found.";

const HOLD_HELP: &str = "\
Prints `NAME KEY TOKEN`, separated by tabs (a name may contain spaces, never a
tab; KEY is - where the backend has none; --json: an object) once acquired, then
holds the lock until SIGINT, SIGTERM or SIGHUP, releases it and exits 0. Exits 76
if the lock is lost meanwhile. Like `etcdctl lock NAME`.

Examples:
  fencelock hold --url zk://127.0.0.1:2181/locks maintenance
  fencelock hold --url etcd://127.0.0.1:2379/locks 'nightly report' | cut -f3   # the token

Exit codes: 0, 64 usage, 69 backend unavailable, 74 output unwritable (the lock
is released), 75 (or -E) not acquired, 76 lost.";

const INSPECT_HELP: &str = "\
Examples:
  fencelock inspect --url zk://127.0.0.1:2181/locks nightly-report
  FENCELOCK_CONFIG=/etc/fencelock.toml fencelock inspect --json orders/SKU-8842

Exit codes: 0 (held or not), 64 usage, 69 backend unavailable, 74 output unwritable.";

const LIST_HELP: &str = "\
Lists every lock whose name starts with PREFIX (all locks without one) that
someone holds or waits for, with its holder's token and lease. It reads every
matching key or node, so keep the prefix narrow on large deployments.

Examples:
  fencelock list --url etcd://127.0.0.1:2379/locks orders/
  fencelock list --json

Exit codes: 0 (even when nothing is listed), 64 usage, 69 backend unavailable,
74 output unwritable.";

const REVOKE_HELP: &str = "\
Deletes the holder's key or node, as an operator would by hand: the holder's
guard reports the loss (at once on etcd and ZooKeeper, at its next renewal on
Redis), and the next waiter gets the lock with a larger token. The revoked
holder may still be working until it notices: only resources that check
fencing tokens refuse it at once. Without --yes, prints who holds the lock
and changes nothing.

Examples:
  fencelock revoke --url zk://127.0.0.1:2181/locks nightly-report         # who holds it
  fencelock revoke --url zk://127.0.0.1:2181/locks --yes nightly-report   # take it away

Exit codes: 0 revoked (or nobody held it), 64 usage or --yes missing,
69 backend unavailable, 74 output unwritable.";

/// Where the locks live.
#[derive(Debug, Args)]
pub struct UrlArg {
    /// Lock backend URL [env: FENCELOCK_URL]
    #[arg(long, value_name = "URL", conflicts_with = "config")]
    pub url: Option<String>,
    /// TOML config file naming the backend [env: FENCELOCK_CONFIG]
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A capability the backend must have, e.g. linearizable or fencing=strong
    /// (repeatable; added to the URL's or file's own)
    #[arg(long, value_name = "REQUIREMENT")]
    pub require: Vec<String>,
}

/// The backend to connect to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// A URL.
    Url(String),
    /// A TOML config file.
    File(PathBuf),
}

impl UrlArg {
    /// The backend: `--url` or `--config`, else `FENCELOCK_URL` or `FENCELOCK_CONFIG`
    /// (set and not empty; not both). With none of them, `mem://` if `default_mem`.
    ///
    /// # Errors
    ///
    /// A message when no backend is given (and `default_mem` is false), or both
    /// variables are set.
    pub fn resolve(&self, default_mem: bool) -> Result<Backend, String> {
        resolve_backend(
            self.url.clone(),
            self.config.clone(),
            std::env::var_os("FENCELOCK_URL"),
            std::env::var_os("FENCELOCK_CONFIG"),
            default_mem,
        )
    }
}

fn resolve_backend(
    url: Option<String>,
    config: Option<PathBuf>,
    env_url: Option<OsString>,
    env_config: Option<OsString>,
    default_mem: bool,
) -> Result<Backend, String> {
    if let Some(url) = url {
        return Ok(Backend::Url(url));
    }
    if let Some(path) = config {
        return Ok(Backend::File(path));
    }
    let env_url = env_url.filter(|v| !v.is_empty());
    let env_config = env_config.filter(|v| !v.is_empty());
    match (env_url, env_config) {
        (Some(_), Some(_)) => Err(
            "FENCELOCK_URL and FENCELOCK_CONFIG are both set: keep one, or pass --url or --config"
                .into(),
        ),
        (Some(url), None) => Ok(Backend::Url(url.to_string_lossy().into_owned())),
        (None, Some(path)) => Ok(Backend::File(PathBuf::from(path))),
        (None, None) if default_mem => Ok(Backend::Url("mem://".into())),
        (None, None) => Err(
            "no lock backend given: pass --url URL or --config FILE, or set \
             FENCELOCK_URL or FENCELOCK_CONFIG (--url mem:// locks inside this one process only)"
                .into(),
        ),
    }
}

/// How to wait for the lock and what to do when it is not acquired (`run`, `hold`).
#[derive(Debug, Args)]
pub struct WaitArgs {
    /// Give up if the lock is not acquired within this long (0: do not wait)
    /// [default: wait forever]
    #[arg(short = 'w', long, visible_alias = "timeout", value_name = "DURATION")]
    pub wait: Option<DurationArg>,
    /// Do not wait: fail at once if the lock is held (same as --wait 0)
    #[arg(short = 'n', long, conflicts_with = "wait")]
    pub nonblock: bool,
    /// Exit code when the lock is not acquired [default: 75]
    #[arg(short = 'E', long, value_name = "CODE", value_parser = clap::value_parser!(u8).range(1..=255))]
    pub conflict_exit_code: Option<u8>,
    /// Renewing lease, renewed every third of it [default: the backend's configured
    /// lease: etcd `lease=`, ZooKeeper `session_timeout=`, Redis 30s]
    #[arg(long, value_name = "DURATION")]
    pub lease: Option<DurationArg>,
    /// A fixed lease instead, never renewed: the lock is lost when it runs out
    #[arg(long, value_name = "DURATION", conflicts_with = "lease")]
    pub fixed_lease: Option<DurationArg>,
}

/// What fencelock prints about itself (`run`, `hold`).
#[derive(Debug, Args)]
pub struct OutputArgs {
    /// Print nothing but errors
    #[arg(short, long, conflicts_with = "verbose")]
    pub quiet: bool,
    /// Also print when the lock is acquired and released
    #[arg(short, long)]
    pub verbose: bool,
    /// Print events as JSON lines on stderr: acquired (name, backend, key, token),
    /// released, lost (cause), not_acquired
    #[arg(long)]
    pub json: bool,
}

/// How the command runs under the lock (`run`, `elect`): `sh -c STRING` instead of a
/// COMMAND, and how long it gets between SIGTERM and SIGKILL once the lock is lost.
#[derive(Debug, Args)]
pub struct CommandArgs {
    /// Time between SIGTERM and SIGKILL when the lock is lost
    #[arg(long, value_name = "DURATION", default_value = "10s")]
    pub kill_grace: DurationArg,
    /// Run this shell command (`sh -c STRING`) instead of a COMMAND after --
    #[arg(
        short = 'c',
        long = "command",
        visible_alias = "shell",
        value_name = "STRING",
        conflicts_with = "command"
    )]
    pub shell: Option<OsString>,
}

/// `fencelock run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub url: UrlArg,
    #[command(flatten)]
    pub wait: WaitArgs,
    #[command(flatten)]
    pub output: OutputArgs,
    #[command(flatten)]
    pub child: CommandArgs,
    /// Take N of the LIMIT permits of semaphore NAME instead of the lock NAME (every
    /// holder must give the same LIMIT)
    #[arg(long, value_name = "N/LIMIT", value_parser = parse_permits)]
    pub permits: Option<Permits>,
    /// The lock name
    pub name: String,
    /// The command and its arguments, after --
    #[arg(last = true, required_unless_present = "shell", value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Parses `--permits N/LIMIT`: N permits (1 to LIMIT) of a semaphore of LIMIT.
///
/// # Errors
///
/// A message saying what is wrong: not `N/LIMIT`, not numbers, N of 0, N above LIMIT.
pub fn parse_permits(text: &str) -> Result<Permits, String> {
    let parsed = text.split_once('/').and_then(|(n, limit)| {
        Some((
            n.trim().parse::<u32>().ok()?,
            limit.trim().parse::<u32>().ok()?,
        ))
    });
    let Some((count, limit)) = parsed else {
        return Err(
            "expected N/LIMIT, two whole numbers: N permits of a semaphore of LIMIT, e.g. 1/3"
                .into(),
        );
    };
    if count == 0 || limit == 0 {
        return Err(format!("N and LIMIT are at least 1, not {count}/{limit}"));
    }
    if count > limit {
        return Err(format!(
            "N is at most LIMIT: {count} permits of a semaphore of {limit} can never be granted"
        ));
    }
    Permits::new(count, limit).map_err(|e| e.to_string())
}

const ELECT_HELP: &str = "\
Campaigns for leadership of ELECTION with VALUE (default HOST:PID), waiting as
--wait says, and once elected runs the command, like `etcdctl elect` with a
command. The command sees FENCELOCK_TOKEN (the term's fencing token, larger than
every earlier term's: pass it to every write), FENCELOCK_VALUE, FENCELOCK_NAME (the
election), FENCELOCK_BACKEND and, where the backend has one, FENCELOCK_KEY. It runs
as `run` runs its command (a process group of its own, signals forwarded); if
leadership is lost, the group gets SIGTERM, then SIGKILL after --kill-grace, and
fencelock exits with 76. When the command exits, fencelock resigns and exits with
its status. An election is a lock whose holder publishes a value: campaigning and
`run` on the same name exclude each other.

Examples:
  fencelock elect --url etcd://127.0.0.1:2379/elections scheduler \"$(hostname)\" -- ./scheduler
  fencelock elect --url redis://127.0.0.1:6379 -w 1m indexer -c 'exec ./indexer --token \"$FENCELOCK_TOKEN\"'

Exit codes: the command's own; 64 usage, 69 backend unavailable, 75 (or -E)
not elected within --wait, 76 leadership lost, 126/127 command not executable / not
found.";

/// `fencelock elect`.
#[derive(Debug, Args)]
// The shared --kill-grace speaks of leadership here (in place: `mut_arg` would move it
// to the end of the completion scripts).
#[command(mut_args(|arg| match arg.get_id().as_str() {
    "kill_grace" => arg.help("Time between SIGTERM and SIGKILL when leadership is lost"),
    _ => arg,
}))]
pub struct ElectArgs {
    #[command(flatten)]
    pub url: UrlArg,
    #[command(flatten)]
    pub wait: WaitArgs,
    #[command(flatten)]
    pub output: OutputArgs,
    #[command(flatten)]
    pub child: CommandArgs,
    /// The election name
    pub election: String,
    /// What the leader publishes (observers and `inspect` see it) [default: HOST:PID]
    pub value: Option<String>,
    /// The command and its arguments, after --
    #[arg(last = true, required_unless_present = "shell", value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

impl ElectArgs {
    /// The value to campaign with: VALUE, else `HOST:PID`.
    pub fn value(&self) -> String {
        self.value.clone().unwrap_or_else(|| {
            let host = nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| "localhost".into());
            format!("{host}:{}", std::process::id())
        })
    }

    /// The same command line as `run` would take, for the shared supervision.
    pub fn into_run(self) -> RunArgs {
        RunArgs {
            url: self.url,
            wait: self.wait,
            output: self.output,
            child: self.child,
            permits: None,
            name: self.election,
            command: self.command,
        }
    }
}

/// `fencelock hold`.
#[derive(Debug, Args)]
pub struct HoldArgs {
    #[command(flatten)]
    pub url: UrlArg,
    #[command(flatten)]
    pub wait: WaitArgs,
    #[command(flatten)]
    pub output: OutputArgs,
    /// The lock name
    pub name: String,
}

/// `fencelock inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
    /// The lock name
    pub name: String,
}

/// `fencelock list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// Print JSON (one array) instead of text
    #[arg(long)]
    pub json: bool,
    /// List only names starting with this (all names when omitted)
    #[arg(default_value = "")]
    pub prefix: String,
}

/// `fencelock revoke`.
#[derive(Debug, Args)]
pub struct RevokeArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// Really revoke; without it, only show who holds the lock
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
    /// The lock name
    pub name: String,
}

#[cfg(test)]
mod tests;
