//! The parent's side of its child processes: starting each, reading its report from
//! its stdout, and stopping those still running.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{ChildStdin, Command};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::args::{Backend, BenchArgs};
use crate::exit::{Failure, code};

/// How long stopped children get to drop their waiters and exit before they are killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// What the parent learns from one child.
pub(super) struct ChildReport {
    /// Its index.
    pub(super) index: usize,
    /// Resident set before and after queuing its waiters.
    pub(super) rss: (Option<u64>, Option<u64>),
    /// (grant time in ns, batch) per served waiter.
    pub(super) grants: Vec<(u64, usize)>,
    /// When all of its waiters had been served and had released.
    pub(super) done_ns: u64,
}

/// The children of the parent: a task per child (which owns the process, reads its
/// output and waits for it) and the write ends of their stdins.
pub(super) struct Children {
    pub(super) tasks: JoinSet<Result<ChildReport, Failure>>,
    stdins: Vec<ChildStdin>,
}

impl Children {
    /// No children yet.
    pub(super) fn new() -> Self {
        Children {
            tasks: JoinSet::new(),
            stdins: Vec::new(),
        }
    }

    /// Starts child `index`; the receiver fires once all of its waiters are queued, and
    /// fails if the child ends first.
    pub(super) fn start(
        &mut self,
        args: &BenchArgs,
        target: &Backend,
        name: &str,
        index: usize,
        per: u64,
    ) -> Result<oneshot::Receiver<()>, Failure> {
        let exe = std::env::current_exe().map_err(|e| {
            Failure::new(
                code::INTERNAL,
                format!("cannot find this program to start child processes: {e}"),
            )
        })?;
        let mut command = Command::new(exe);
        command.args(["bench", "--workload", "waiters", "--quiet", "--count"]);
        command.arg(per.to_string());
        command.arg("--waiters-child").arg(index.to_string());
        command.arg("--waiters-name").arg(name);
        // The URL goes through the environment, not the command line: it may hold a
        // password, which every user could read in the process list.
        command
            .env_remove("FENCELOCK_URL")
            .env_remove("FENCELOCK_CONFIG");
        match target {
            Backend::Url(url) => {
                command.env("FENCELOCK_URL", url);
            }
            Backend::File(path) => {
                command.arg("--config").arg(path);
            }
        }
        for requirement in &args.url.require {
            command.arg("--require").arg(requirement);
        }
        if let Some(lease) = args.lease {
            command
                .arg("--lease")
                .arg(format!("{}ns", lease.as_nanos()));
        }
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command.spawn().map_err(|e| {
            Failure::new(
                code::INTERNAL,
                format!("cannot start child process {index}: {e}"),
            )
        })?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(Failure::new(
                code::INTERNAL,
                format!("child process {index} has no pipes"),
            ));
        };
        self.stdins.push(stdin);
        let (queued, queued_rx) = oneshot::channel();
        let processes = args.processes();
        self.tasks.spawn(async move {
            let errors = tokio::spawn(async move {
                let mut text = String::new();
                let _ = BufReader::new(stderr).read_to_string(&mut text).await;
                text
            });
            let read = read_report(index, stdout, queued).await;
            let status = child.wait().await;
            let errors = errors.await.unwrap_or_default();
            let said = errors
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(|l| format!(": {}", l.trim_start_matches("fencelock: ")))
                .unwrap_or_default();
            let which = format!("child process {} of {processes}", index + 1);
            match status {
                Ok(status) if status.success() => {}
                Ok(status) => {
                    return Err(Failure::new(
                        code::INTERNAL,
                        format!("{which} failed ({status}){said}"),
                    ));
                }
                Err(e) => {
                    return Err(Failure::new(
                        code::INTERNAL,
                        format!("{which}: cannot wait for it: {e}"),
                    ));
                }
            }
            read.map_err(|e| Failure::new(code::INTERNAL, format!("{which}: {e}{said}")))
        });
        Ok(queued_rx)
    }

    /// The failure of child `index`, which ended before it had queued its waiters (or
    /// of another that failed first).
    pub(super) async fn failure(&mut self, index: usize) -> Failure {
        while let Some(joined) = self.tasks.join_next().await {
            match joined {
                Ok(Err(failure)) => return failure,
                Ok(Ok(_)) => {}
                Err(error) => return Failure::new(code::INTERNAL, format!("a child: {error}")),
            }
        }
        Failure::new(
            code::INTERNAL,
            format!(
                "child process {} ended before it had queued its waiters",
                index + 1
            ),
        )
    }

    /// Stops the children: closes their stdins (they drop their waiters, close their
    /// clients and exit), waits at most [`STOP_GRACE`], then kills those left.
    pub(super) async fn stop(mut self) {
        self.stdins.clear();
        let _ = tokio::time::timeout(STOP_GRACE, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        // Dropping the tasks drops the processes left, which kills them (kill_on_drop).
        self.tasks.shutdown().await;
    }
}

/// Reads a child's report from its stdout; `queued` fires at its `queued` line.
async fn read_report(
    index: usize,
    stdout: tokio::process::ChildStdout,
    queued: oneshot::Sender<()>,
) -> Result<ChildReport, String> {
    let mut queued = Some(queued);
    let mut lines = BufReader::new(stdout).lines();
    let mut report = ChildReport {
        index,
        rss: (None, None),
        grants: Vec::new(),
        done_ns: 0,
    };
    let mut served = None;
    while let Some(line) = lines
        .next_line()
        .await
        .map_err(|e| format!("cannot read its report: {e}"))?
    {
        let doc: Value = serde_json::from_str(&line)
            .map_err(|e| format!("a line of its report is not JSON ({e}): {line}"))?;
        if let Some(at) = doc["grant_ns"].as_u64() {
            let batch = doc["batch"].as_u64().unwrap_or(u64::MAX);
            report
                .grants
                .push((at, usize::try_from(batch).unwrap_or(usize::MAX)));
        } else if doc.get("queued").is_some() {
            report.rss = (doc["rss_before"].as_u64(), doc["rss_queued"].as_u64());
            if let Some(queued) = queued.take() {
                let _ = queued.send(());
            }
        } else if let Some(done) = doc["done_ns"].as_u64() {
            report.done_ns = done;
            served = doc["served"].as_u64();
        }
    }
    match served {
        Some(n) if n == report.grants.len() as u64 => Ok(report),
        Some(n) => Err(format!(
            "it reported {n} grants but printed {}",
            report.grants.len()
        )),
        None => Err("its report ended before its last line".into()),
    }
}
