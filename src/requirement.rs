//! Capability requirements: properties a deployment refuses to run without.

use std::fmt;
use std::str::FromStr;

use fencelock_core::{DistributedLock, Error, FencingStrength, LossDetection};

/// A property a deployment requires of its lock backend, checked when connecting.
///
/// Written in configuration as `linearizable`, `fencing` (any trustworthy fencing: at
/// least best-effort), `fencing=strong`, `fencing=best-effort`, `fifo`,
/// `loss-detection=notified`, `counts-waiters`, `election`, `semaphore` or `rw-lock`
/// (`_` may stand for `-`): in a URL as `?require=linearizable,fencing=strong`, in a
/// config file as `require = ["linearizable", "fencing=strong"]`.
///
/// # Examples
///
/// ```
/// use fencelock::{FencingStrength, Requirement};
///
/// let r: Requirement = "fencing=strong".parse()?;
/// assert_eq!(r, Requirement::Fencing(FencingStrength::Strong));
/// assert_eq!(r.to_string(), "fencing=strong");
/// # Ok::<(), fencelock::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Requirement {
    /// Grants are ordered by a linearizable log (etcd, ZooKeeper, memory), so no failover
    /// can admit a second holder. Plain Redis does not qualify.
    Linearizable,
    /// Fencing tokens at least this strong.
    Fencing(FencingStrength),
    /// Waiters are granted in the order they started waiting.
    Fifo,
    /// Loss is detected at least this way.
    LossDetection(LossDetection),
    /// `inspect` counts waiters.
    CountsWaiters,
    /// Leader election: `campaign`, `leader` and `observe`. Not in a migration's
    /// two-leg phases.
    Election,
    /// Semaphores: `acquire_permits`. Not on Redlock, nor in a migration's two-leg
    /// phases.
    Semaphore,
    /// Read-write locks: `acquire_read` and `acquire_write`. Not on Redlock, nor in a
    /// migration's two-leg phases.
    RwLock,
}

impl Requirement {
    /// Checks the requirement against what `lock` reports.
    ///
    /// # Errors
    ///
    /// [`Error::RequirementNotMet`] naming the requirement, and saying what the backend
    /// offers instead and why.
    pub fn check(&self, lock: &dyn DistributedLock) -> Result<(), Error> {
        let caps = lock.capabilities();
        let backend = lock.backend();
        let reason = match *self {
            Requirement::Linearizable if !caps.linearizable => format!(
                "{backend} does not order lock grants through a linearizable log{}",
                why_not_linearizable(backend)
            ),
            Requirement::Fencing(wanted) if caps.fencing < wanted => format!(
                "{backend} offers {} fencing tokens{}",
                caps.fencing,
                if caps.fencing == FencingStrength::BestEffort {
                    " (they grow unless data loss meets a clock step back; not proven by \
                     a replicated log)"
                } else {
                    ""
                }
            ),
            Requirement::Fifo if !caps.fifo => {
                format!("{backend} does not grant waiters in the order they started waiting")
            }
            Requirement::LossDetection(wanted) if caps.loss_detection < wanted => {
                format!("{backend} detects loss by {} only", caps.loss_detection)
            }
            Requirement::CountsWaiters if !caps.counts_waiters => {
                format!("{backend} cannot count waiters")
            }
            Requirement::Election if !caps.election => {
                format!("{backend} has no leader election{}", why_missing(backend))
            }
            Requirement::Semaphore if !caps.semaphore => {
                format!("{backend} has no semaphores{}", why_missing(backend))
            }
            Requirement::RwLock if !caps.rw_lock => {
                format!("{backend} has no read-write locks{}", why_missing(backend))
            }
            _ => return Ok(()),
        };
        Err(Error::RequirementNotMet {
            backend,
            requirement: self.to_string(),
            reason,
        })
    }
}

fn why_not_linearizable(backend: &str) -> &'static str {
    match backend {
        "redis" => {
            " (Redis replicates asynchronously: a failover can lose a lock and admit a \
             second holder); use etcd or ZooKeeper"
        }
        "migration" => {
            " (a migration is only as strong as the weakest leg its phase takes: services \
             that take only the legacy lock are excluded by the legacy backend alone)"
        }
        _ => "",
    }
}

/// Why `backend` lacks a primitive (election, semaphore, read-write lock), where it is
/// not plain.
fn why_missing(backend: &str) -> &'static str {
    match backend {
        "migration" => {
            " in a two-leg phase (legacy-first, target-first): both backends would have to \
             agree on it, which nothing guarantees; the single-leg phases have those of \
             their leg"
        }
        "redis" => {
            " on Redlock (a majority of independent instances can bound neither a \
             semaphore's holders nor a read-write lock's); a single Redis, Sentinel or \
             Cluster has them"
        }
        _ => "",
    }
}

/// Checks every requirement, in order, and fails on the first one not met.
///
/// # Errors
///
/// As [`Requirement::check`].
pub(crate) fn check_all(
    lock: &dyn DistributedLock,
    requirements: &[Requirement],
) -> Result<(), Error> {
    requirements.iter().try_for_each(|r| r.check(lock))
}

/// Parses a comma-separated list of requirements (the URL form).
pub(crate) fn parse_list(text: &str) -> Result<Vec<Requirement>, Error> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect()
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Requirement::Linearizable => f.write_str("linearizable"),
            Requirement::Fencing(strength) => write!(f, "fencing={strength}"),
            Requirement::Fifo => f.write_str("fifo"),
            Requirement::LossDetection(how) => write!(f, "loss-detection={how}"),
            Requirement::CountsWaiters => f.write_str("counts-waiters"),
            Requirement::Election => f.write_str("election"),
            Requirement::Semaphore => f.write_str("semaphore"),
            Requirement::RwLock => f.write_str("rw-lock"),
        }
    }
}

impl FromStr for Requirement {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        let normalized = text.trim().to_ascii_lowercase().replace('_', "-");
        let (key, value) = match normalized.split_once(['=', ':']) {
            Some((key, value)) => (key.trim(), Some(value.trim())),
            None => (normalized.as_str(), None),
        };
        let requirement = match (key, value) {
            ("linearizable", None) => Requirement::Linearizable,
            ("fencing", None | Some("best-effort")) => {
                Requirement::Fencing(FencingStrength::BestEffort)
            }
            ("fencing", Some("strong")) => Requirement::Fencing(FencingStrength::Strong),
            ("fifo", None) => Requirement::Fifo,
            ("loss-detection", Some("notified")) => {
                Requirement::LossDetection(LossDetection::Notified)
            }
            ("loss-detection", Some("deadline")) => {
                Requirement::LossDetection(LossDetection::Deadline)
            }
            ("counts-waiters", None) => Requirement::CountsWaiters,
            ("election", None) => Requirement::Election,
            ("semaphore", None) => Requirement::Semaphore,
            ("rw-lock", None) => Requirement::RwLock,
            _ => {
                return Err(Error::InvalidConfig(format!(
                    "unknown requirement {text:?}; expected linearizable, fencing, \
                     fencing=strong, fencing=best-effort, fifo, loss-detection=notified, \
                     counts-waiters, election, semaphore or rw-lock"
                )));
            }
        };
        Ok(requirement)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencelock_core::MemoryLock;

    #[test]
    fn names_round_trip() {
        for text in [
            "linearizable",
            "fencing=best-effort",
            "fencing=strong",
            "fifo",
            "loss-detection=notified",
            "loss-detection=deadline",
            "counts-waiters",
            "election",
            "semaphore",
            "rw-lock",
        ] {
            assert_eq!(text.parse::<Requirement>().unwrap().to_string(), text);
        }
        assert_eq!(
            "Fencing:Strong".parse::<Requirement>().unwrap(),
            Requirement::Fencing(FencingStrength::Strong)
        );
        assert_eq!(
            "fencing".parse::<Requirement>().unwrap(),
            Requirement::Fencing(FencingStrength::BestEffort)
        );
        for bad in ["", "fast", "fencing=perfect", "fifo=yes"] {
            assert!(matches!(
                bad.parse::<Requirement>(),
                Err(Error::InvalidConfig(_))
            ));
        }
        assert_eq!(
            parse_list("linearizable, fifo,").unwrap(),
            [Requirement::Linearizable, Requirement::Fifo]
        );
    }

    #[test]
    fn memory_meets_everything_it_claims() {
        let lock = MemoryLock::new();
        let all: Vec<Requirement> =
            parse_list("linearizable,fencing=strong,loss-detection=notified").unwrap();
        check_all(&lock, &all).unwrap();
        let caps = lock.capabilities();
        assert_eq!(Requirement::Fifo.check(&lock).is_ok(), caps.fifo);
        if !caps.counts_waiters {
            let err = Requirement::CountsWaiters.check(&lock).unwrap_err();
            assert!(matches!(err, Error::RequirementNotMet { .. }), "{err}");
        }
    }
}
