//! The command line of `fencelock bench`.

use std::time::Duration;

use clap::{Args, ValueEnum};

use super::UrlArg;
use crate::duration;

pub(super) const BENCH_HELP: &str = "\
Workloads: uncontended (one client, one name: acquire+release latency p50/p99/
p99.9, ops/s); contended (N clients, each with its own connection, on one name:
handoffs/s and per-client fairness); many-keys (N workers on distinct names
over one connection: locks/s). --baseline also runs the raw-client floor of the
URL's backend (mem: tokio Mutex; etcd: create-if-absent txn + delete; ZooKeeper:
create ephemeral + delete; Redis: SET NX PX + compare-and-delete script), so the
difference is the library's overhead on this deployment. Each implementation is
warmed up (--warmup), then measured in --rounds rounds, library and floor
interleaved; latencies go into an HDR histogram. --hold keeps each lock that long;
--lease sets the library's lease. Handoffs are grants to another client than the
grant before. A flag the workload would not use is refused (exit 64).

Scale workloads (one client, the library only, checked as they run): waiters
(--count waiters queued on one name in batches, then served: each exactly once,
in batch order where the backend claims FIFO; memory per waiter; hand-off latency
with the whole queue, 1,000 and 10 left); held (--count locks held at once,
renewing, for 5 lease periods: none lost; memory per held lock; acquires with all
held against acquires before the fill, paced alike); cycles (--count acquire+release on distinct
names: memory after against a warm-up, nothing left on the server). Memory is
this process's resident set. --processes N (waiters only) queues the waiters
from N child processes of this binary instead, count/N each, started one after
another (each once all of its waiters are queued), all served in one queue; memory
is then the children's resident sets.

Examples:
  fencelock bench --workload uncontended --duration 5s --baseline
  fencelock bench --url etcd://127.0.0.1:2379/bench --workload contended --clients 8 --json
  fencelock bench --url zk://127.0.0.1:2181/bench --workload waiters --count 10000 --processes 10

Exit codes: 0, 64 usage, 69 backend unavailable, 70 a scale workload's check failed,
74 output unwritable.";

/// The bench workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// One client, one name, sequential acquire+release.
    Uncontended,
    /// N clients contending on one name.
    Contended,
    /// N workers on distinct names.
    ManyKeys,
    /// Scale: --count waiters (default 10,000) queued on one name, then served.
    Waiters,
    /// Scale: --count locks (default 100,000) held at once for 5 lease periods.
    Held,
    /// Scale: --count acquire+release cycles (default 1,000,000) on distinct names.
    Cycles,
}

impl Workload {
    /// The name used on the command line and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Workload::Uncontended => "uncontended",
            Workload::Contended => "contended",
            Workload::ManyKeys => "many-keys",
            Workload::Waiters => "waiters",
            Workload::Held => "held",
            Workload::Cycles => "cycles",
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
    // The flags one workload uses and another does not are `Option`s without a clap
    // default, so that one given explicitly to a workload that would ignore it can be
    // refused (`bench::check_flags`); the accessors below apply the defaults.
    /// Contended and many-keys: clients or workers [default: 4]
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub clients: Option<u16>,
    /// How long to measure each implementation, split into --rounds [default: 5s]
    #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
    pub duration: Option<Duration>,
    /// Unmeasured run of each implementation first [default: 1s]
    #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
    pub warmup: Option<Duration>,
    /// Rounds, the library and the floor interleaved (so both see the same machine)
    /// [default: 3]
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=100))]
    pub rounds: Option<u16>,
    /// How long each holder keeps the lock (inside the critical section) [default: 0]
    #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
    pub hold: Option<Duration>,
    /// Also run the raw-client floor of the backend
    #[arg(long)]
    pub baseline: bool,
    /// Scale workloads: how many waiters, held locks or cycles
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub count: Option<u64>,
    /// The renewing lease of every lock the library takes [default: the backend's]
    #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
    pub lease: Option<Duration>,
    /// Waiters workload: queue the --count waiters from this many processes of this
    /// binary (count/N each), started one after another [default: 1]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub processes: Option<u16>,
    /// Internal: run as child process INDEX of a `--processes` waiters bench
    #[arg(long, hide = true, value_name = "INDEX", requires = "waiters_name")]
    pub waiters_child: Option<u16>,
    /// Internal: the name the children of a `--processes` waiters bench queue on
    #[arg(long, hide = true, value_name = "NAME", requires = "waiters_child")]
    pub waiters_name: Option<String>,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
    /// No progress lines on stderr
    #[arg(short, long)]
    pub quiet: bool,
}

impl BenchArgs {
    /// `--clients`, 4 by default.
    pub fn clients(&self) -> u16 {
        self.clients.unwrap_or(4)
    }

    /// `--duration`, 5 s by default.
    pub fn duration(&self) -> Duration {
        self.duration.unwrap_or(Duration::from_secs(5))
    }

    /// `--warmup`, 1 s by default.
    pub fn warmup(&self) -> Duration {
        self.warmup.unwrap_or(Duration::from_secs(1))
    }

    /// `--rounds`, 3 by default.
    pub fn rounds(&self) -> u16 {
        self.rounds.unwrap_or(3)
    }

    /// `--hold`, none by default.
    pub fn hold(&self) -> Duration {
        self.hold.unwrap_or_default()
    }

    /// `--processes`, 1 by default.
    pub fn processes(&self) -> u16 {
        self.processes.unwrap_or(1)
    }
}
