//! The process's own CPU time, read from `/proc`, for "client CPU per op".

use std::time::Duration;

/// `USER_HZ`: the unit of `utime` and `stime` in `/proc/<pid>/stat`, 100 per second on
/// every Linux architecture this runs on (the kernel's ABI value, whatever its internal
/// tick rate; `sysconf(_SC_CLK_TCK)` would need `unsafe`).
pub const USER_HZ: u64 = 100;

/// How far apart the two readings of [`ProcessCpu::since`] may be and still count as
/// agreeing: `/proc/self/stat` truncates each reading to a tick, so two readings differ
/// from the exact value by up to two ticks, plus a little for the time between reads.
const AGREE: Duration = Duration::from_millis(30);

/// A reading of this process's own CPU time (user + system, all threads), for "client
/// CPU per op": read before and after a run, [`ProcessCpu::since`] divided by the ops.
///
/// Two sources, both read at once:
/// - the sum over live threads of `/proc/self/task/*/schedstat`'s first field (ns run
///   on a CPU): precise, but a thread that exits takes its time with it;
/// - `utime + stime` of `/proc/self/stat` (fields 14 and 15, in [`USER_HZ`] ticks):
///   it keeps exited threads' time, but only to 10 ms.
///
/// [`ProcessCpu::since`] uses the precise sum when the two agree to within two ticks (no
/// thread that ran for long exited in between), and the tick count otherwise. Measure
/// runs that use at least a second of CPU for a count good to 1 %. Outside Linux (no
/// `/proc`) every reading is zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessCpu {
    /// `utime + stime`, ticks.
    ticks: Option<u64>,
    /// The live threads' run time, ns.
    threads_ns: Option<u64>,
}

impl ProcessCpu {
    /// Reads the process's CPU time now.
    #[must_use]
    pub fn now() -> Self {
        // Threads first, then the process total: a thread that exits between the two
        // reads makes them disagree, and the total wins.
        let threads_ns = threads_ns();
        let ticks = stat_ticks();
        ProcessCpu { ticks, threads_ns }
    }

    /// The CPU time the process used from `start` to this reading (zero if `/proc` could
    /// not be read).
    #[must_use]
    pub fn since(&self, start: &ProcessCpu) -> Duration {
        let ticks = match (self.ticks, start.ticks) {
            (Some(end), Some(begin)) => Some(Duration::from_nanos(
                end.saturating_sub(begin)
                    .saturating_mul(1_000_000_000 / USER_HZ),
            )),
            _ => None,
        };
        let threads = match (self.threads_ns, start.threads_ns) {
            (Some(end), Some(begin)) if end >= begin => Some(Duration::from_nanos(end - begin)),
            _ => None,
        };
        match (threads, ticks) {
            (Some(precise), Some(coarse)) if precise.abs_diff(coarse) <= AGREE => precise,
            (_, Some(coarse)) => coarse,
            (Some(precise), None) => precise,
            (None, None) => Duration::ZERO,
        }
    }
}

/// `utime + stime` from `/proc/self/stat`, in ticks.
fn stat_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    parse_stat_ticks(&stat)
}

/// `utime + stime` (fields 14 and 15) of a `/proc/<pid>/stat` line. The command name
/// (field 2) is in parentheses and may hold spaces and parentheses: fields are counted
/// from the last `)`, after which field 3 comes.
fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_ascii_whitespace().skip(14 - 3);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime.saturating_add(stime))
}

/// The sum of the first field of `/proc/self/task/*/schedstat` (ns on a CPU) over the
/// live threads. A thread that exits while this reads is left out.
fn threads_ns() -> Option<u64> {
    let mut sum = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let Ok(task) = task else { continue };
        let Ok(schedstat) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        let ns: u64 = schedstat.split_ascii_whitespace().next()?.parse().ok()?;
        sum = sum.saturating_add(ns);
    }
    Some(sum)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn stat_ticks_count_from_the_last_parenthesis() {
        let line = "42 (a) b) (c) S 1 42 42 0 -1 4194304 96 0 0 0 7 5 0 0 20 0 1 0 1 2 3";
        assert_eq!(parse_stat_ticks(line), Some(12));
        assert_eq!(parse_stat_ticks("42 (x) S 1"), None);
        assert_eq!(parse_stat_ticks(""), None);
    }

    #[test]
    fn process_cpu_counts_this_threads_work() {
        let start = ProcessCpu::now();
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(200) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let used = ProcessCpu::now().since(&start);
        // Some of the 200 ms spun (a busy machine may take part of it away); at most
        // what two cores give in the wall-clock time (other tests run alongside).
        assert!(used >= Duration::from_millis(50), "{used:?}");
        assert!(
            used <= spin.elapsed() * 2 + Duration::from_millis(60),
            "{used:?}"
        );
        assert_eq!(start.since(&start), Duration::ZERO);
        assert_eq!(
            ProcessCpu::default().since(&ProcessCpu::default()),
            Duration::ZERO
        );
    }
}
