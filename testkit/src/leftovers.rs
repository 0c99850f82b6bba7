//! C5, what a scenario left behind on the servers: etcd keys and leases, ZooKeeper
//! ephemeral nodes, Redis keys and channels with subscribers. Read from the servers
//! themselves (`etcdctl`, the `dump` four-letter word, raw RESP), never through the
//! client under test.
//!
//! Each probe returns a list of descriptions, empty when nothing is left;
//! [`assert_none_within`] polls one until it is empty, since some things go away on
//! their own within a bound (a Redis waiter marker, a lease after its TTL, an ephemeral
//! node with its session).
//!
//! ```no_run
//! use std::time::Duration;
//! use fencelock_testkit::{EtcdServer, leftovers};
//!
//! let etcd = EtcdServer::start();
//! // ... a scenario with prefix "f4", its clients dropped ...
//! leftovers::assert_none_within("etcd", Duration::from_secs(3), || {
//!     let mut left = leftovers::etcd_keys(&etcd.endpoint(), "f4");
//!     left.extend(leftovers::etcd_leases(&etcd.endpoint()));
//!     left
//! });
//! ```

use std::process::Command;
use std::time::{Duration, Instant};

use crate::ZkServer;
use crate::binaries::require_program;
use crate::net::exchange;

/// How long the servers must stay clean once they are, before a probe counts as empty:
/// a write still in flight (a create sent before a cancelled acquire's clean-up) lands
/// within it.
pub const SETTLE: Duration = Duration::from_millis(300);

/// Polls `probe` every 50 ms until it returns nothing, twice, [`SETTLE`] apart; panics
/// with the last leftovers if that takes longer than `bound` (+ [`SETTLE`]). Returns how
/// long it took.
pub fn assert_none_within(
    what: &str,
    bound: Duration,
    mut probe: impl FnMut() -> Vec<String>,
) -> Duration {
    let start = Instant::now();
    let mut clean_since: Option<Instant> = None;
    loop {
        let left = probe();
        if left.is_empty() {
            let since = *clean_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= SETTLE {
                return start.elapsed();
            }
        } else {
            clean_since = None;
            assert!(
                start.elapsed() < bound,
                "{what}: left behind {bound:?} after the scenario: {left:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn etcdctl(endpoint: &str, args: &[&str]) -> String {
    let output = Command::new(require_program("etcdctl", "etcd-client"))
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints=http://{endpoint}"))
        .arg("--command-timeout=2s")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("fencelock-testkit: cannot run etcdctl: {e}"));
    assert!(
        output.status.success(),
        "fencelock-testkit: etcdctl {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The keys under `prefix` on the etcd server at `endpoint` (`host:port`), as `key K`.
pub fn etcd_keys(endpoint: &str, prefix: &str) -> Vec<String> {
    etcdctl(endpoint, &["get", "--prefix", "--keys-only", prefix])
        .lines()
        .filter(|line| !line.is_empty())
        .map(|key| format!("key {key}"))
        .collect()
}

/// Every lease on the etcd server at `endpoint`, as `lease ID (hex)`. Leases have no
/// prefix: use a server of the scenario's own, and call this after its clients are
/// gone.
pub fn etcd_leases(endpoint: &str) -> Vec<String> {
    etcdctl(endpoint, &["lease", "list"])
        .lines()
        .filter(|line| !line.is_empty() && !line.starts_with("found "))
        .map(|id| format!("lease {id}"))
        .collect()
}

/// The ephemeral nodes at or below `under` on `server` (from its `dump` four-letter
/// word, which lists them per session; on an ensemble, ask the leader), as
/// `ephemeral PATH`.
pub fn zookeeper_ephemerals(server: &ZkServer, under: &str) -> Vec<String> {
    let dump = server
        .four_letter_word("dump")
        .unwrap_or_else(|e| panic!("fencelock-testkit: ZooKeeper dump failed: {e}"));
    assert!(
        dump.contains("ephemeral nodes dump"),
        "fencelock-testkit: not a dump (is this server the leader?): {dump}"
    );
    let under = under.trim_end_matches('/');
    dump.lines()
        .map(str::trim)
        .filter(|line| {
            line.strip_prefix(under)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        })
        .map(|path| format!("ephemeral {path}"))
        .collect()
}

/// The keys matching `pattern` (a `KEYS` glob) on the Redis server on 127.0.0.1:`port`,
/// except fencing-token counters (keys ending in `:token`, or containing
/// `fencelock-token`), which outlive their locks by design (`token_ttl`), as `key K`.
pub fn redis_keys(port: u16, pattern: &str) -> Vec<String> {
    resp_strings(port, &["KEYS", pattern])
        .into_iter()
        .filter(|key| !key.ends_with(":token") && !key.contains("fencelock-token"))
        .map(|key| format!("key {key}"))
        .collect()
}

/// The channels matching `pattern` that have subscribers on the Redis server on
/// 127.0.0.1:`port`, as `subscribed channel C`.
pub fn redis_subscribed_channels(port: u16, pattern: &str) -> Vec<String> {
    resp_strings(port, &["PUBSUB", "CHANNELS", pattern])
        .into_iter()
        .map(|channel| format!("subscribed channel {channel}"))
        .collect()
}

/// Sends one command and reads an array of bulk strings.
fn resp_strings(port: u16, args: &[&str]) -> Vec<String> {
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    let answer = exchange(port, request.as_bytes(), Duration::from_secs(2), |a| {
        parse_array(a).is_some() || (a.starts_with(b"-") && a.ends_with(b"\r\n"))
    })
    .unwrap_or_else(|e| panic!("fencelock-testkit: Redis on port {port}: {e}"));
    parse_array(&answer).unwrap_or_else(|| {
        panic!(
            "fencelock-testkit: Redis on port {port} answered {args:?} with {:?}",
            String::from_utf8_lossy(&answer)
        )
    })
}

/// A whole RESP array of bulk strings, or `None` if `bytes` is not (yet) one.
fn parse_array(bytes: &[u8]) -> Option<Vec<String>> {
    let (count, mut rest) = header(bytes, b'*')?;
    let mut items = Vec::with_capacity(count);
    for _ in 0..count {
        let (len, after) = header(rest, b'$')?;
        let item = after.get(..len)?;
        rest = after.get(len..)?.strip_prefix(b"\r\n")?;
        items.push(String::from_utf8_lossy(item).into_owned());
    }
    rest.is_empty().then_some(items)
}

/// `KIND N\r\n` at the start of `bytes`: N and what follows.
fn header(bytes: &[u8], kind: u8) -> Option<(usize, &[u8])> {
    let bytes = bytes.strip_prefix(&[kind])?;
    let end = bytes.windows(2).position(|w| w == b"\r\n")?;
    let n = std::str::from_utf8(&bytes[..end]).ok()?.parse().ok()?;
    Some((n, &bytes[end + 2..]))
}

#[cfg(test)]
mod tests {
    use super::parse_array;

    #[test]
    fn resp_arrays() {
        assert_eq!(parse_array(b"*0\r\n"), Some(vec![]));
        assert_eq!(
            parse_array(b"*2\r\n$1\r\na\r\n$3\r\nb:c\r\n"),
            Some(vec!["a".to_string(), "b:c".to_string()])
        );
        assert_eq!(parse_array(b"*2\r\n$1\r\na\r\n$3\r\nb:"), None);
        assert_eq!(parse_array(b"-ERR\r\n"), None);
    }
}
