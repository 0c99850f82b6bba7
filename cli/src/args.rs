//! The command line.

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::duration;

const EXIT_CODES: &str = "\
Exit codes:
  0        success (run: the command's own status is passed through;
           a command killed by signal N gives 128+N)
  64       bad usage: option, duration, URL, scheme, lock name or lease
  69       the lock backend is unreachable or failed
  70       internal error
  75       not acquired within --wait: someone else holds the lock
  76       run: the lock was lost while the command ran (the command was stopped)
  126/127  run: the command could not be executed / was not found";

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
    /// Show who holds a lock, its token, remaining lease and waiters.
    #[command(after_help = INSPECT_HELP)]
    Inspect(InspectArgs),
    /// Measure lock latency and throughput on a deployment.
    #[command(after_help = BENCH_HELP)]
    Bench(BenchArgs),
}

const RUN_HELP: &str = "\
The command sees FENCELOCK_TOKEN (the fencing token: pass it to every write),
FENCELOCK_NAME, FENCELOCK_BACKEND and, where the backend has one, FENCELOCK_KEY.
If the lock is lost, the command gets SIGTERM, then SIGKILL after --kill-grace,
and fencelock exits with 76. SIGINT, SIGTERM and SIGHUP are forwarded to the
command; the lock is released when it exits.

Examples:
  fencelock run --url etcd://127.0.0.1:2379/locks --wait 10s nightly-report -- ./report.sh
  FENCELOCK_URL=redis://127.0.0.1:6379 fencelock run --wait 0 billing -- sh -c 'echo $FENCELOCK_TOKEN'

Exit codes: the command's own; 64 usage, 69 backend unavailable, 75 not acquired
within --wait, 76 lock lost, 126/127 command not executable / not found.";

const INSPECT_HELP: &str = "\
Examples:
  fencelock inspect --url zk://127.0.0.1:2181/locks nightly-report
  fencelock inspect --json orders/SKU-8842

Exit codes: 0 (held or not), 64 usage, 69 backend unavailable.";

const BENCH_HELP: &str = "\
Workloads: uncontended (one client, one name: acquire+release latency p50/p99,
ops/s); contended (N clients, each with its own connection, on one name:
handoffs/s and per-client fairness); many-keys (N workers on distinct names
over one connection: locks/s). --baseline also runs the raw-client floor of the
URL's backend (mem: tokio Mutex; etcd: create-if-absent txn + delete; ZooKeeper:
create ephemeral + delete; Redis: SET NX PX + compare-and-delete script), so the
difference is the library's overhead on this deployment.

Examples:
  fencelock bench --workload uncontended --duration 5s --baseline
  fencelock bench --url etcd://127.0.0.1:2379/bench --workload contended --clients 8 --json

Exit codes: 0, 64 usage, 69 backend unavailable.";

/// Where the locks live.
#[derive(Debug, Args)]
pub struct UrlArg {
    /// Lock backend URL [default: $FENCELOCK_URL, then mem://]
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
}

impl UrlArg {
    /// The URL to use: `--url`, else `FENCELOCK_URL` when set and not empty, else
    /// `mem://`.
    pub fn resolve(&self) -> String {
        resolve_url(self.url.clone(), std::env::var_os("FENCELOCK_URL"))
    }
}

fn resolve_url(flag: Option<String>, env: Option<OsString>) -> String {
    flag.or_else(|| {
        env.map(|v| v.to_string_lossy().into_owned())
            .filter(|v| !v.is_empty())
    })
    .unwrap_or_else(|| "mem://".to_owned())
}

/// `fencelock run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// Give up if the lock is not acquired within this long (0: do not wait)
    /// [default: wait forever]
    #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
    pub wait: Option<Duration>,
    /// Renewing lease: renewed every third of it while the command runs
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, default_value = "30s")]
    pub lease: Duration,
    /// A fixed lease instead, never renewed: the command is stopped when it runs out
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, conflicts_with = "lease")]
    pub fixed_lease: Option<Duration>,
    /// Time between SIGTERM and SIGKILL when the lock is lost
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, default_value = "10s")]
    pub kill_grace: Duration,
    /// The lock name
    pub name: String,
    /// The command and its arguments
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
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

/// The bench workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// One client, one name, sequential acquire+release.
    Uncontended,
    /// N clients contending on one name.
    Contended,
    /// N workers on distinct names.
    ManyKeys,
}

impl Workload {
    /// The name used on the command line and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Workload::Uncontended => "uncontended",
            Workload::Contended => "contended",
            Workload::ManyKeys => "many-keys",
        }
    }
}

/// `fencelock bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// What to measure
    #[arg(long, value_enum)]
    pub workload: Workload,
    /// Clients (contended) or workers (many-keys)
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub clients: u16,
    /// How long to run each measurement
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, default_value = "5s")]
    pub duration: Duration,
    /// Also run the raw-client floor of the backend
    #[arg(long)]
    pub baseline: bool,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn url_precedence() {
        let env = |v: &str| Some(OsString::from(v));
        assert_eq!(
            resolve_url(Some("etcd://a".into()), env("zk://b")),
            "etcd://a"
        );
        assert_eq!(resolve_url(None, env("zk://b")), "zk://b");
        assert_eq!(resolve_url(None, env("")), "mem://");
        assert_eq!(resolve_url(None, None), "mem://");
    }

    #[test]
    fn run_takes_the_command_after_double_dash() {
        let cli =
            Cli::try_parse_from(["fencelock", "run", "--wait", "2s", "job", "--", "ls", "-l"])
                .unwrap();
        let Command::Run(run) = cli.command else {
            panic!("not run")
        };
        assert_eq!(run.wait, Some(Duration::from_secs(2)));
        assert_eq!(run.command, ["ls", "-l"]);
        assert!(Cli::try_parse_from(["fencelock", "run", "job"]).is_err());
    }
}
