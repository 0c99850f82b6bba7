//! Network namespaces for partition tests: one namespace per cluster member, joined by a
//! bridge in the test process's own namespace, with `iptables` DROP rules to cut links.
//!
//! ```text
//!   test process (root namespace), 10.231.S.1 on bridge flbS
//!        ├── veth ── namespace fencelock-S-0: member 0 at 10.231.S.11
//!        ├── veth ── namespace fencelock-S-1: member 1 at 10.231.S.12
//!        └── veth ── namespace fencelock-S-2: member 2 at 10.231.S.13
//! ```
//!
//! `S` is a slot from 1 to 254 claimed atomically by creating the bridge `flbS` (whose
//! alias records the owning process id), so concurrent test processes never share a
//! subnet. Clients in the test process reach every member at its address; the members
//! reach each other over the bridge. [`NetLab::isolate`] cuts one member from the others
//! while its clients stay connected to it; [`NetLab::heal`] removes every rule.
//!
//! Dropping the [`NetLab`] deletes its namespaces (and the rules inside them), veths and
//! bridge. A test process killed before that leaves them behind; the next [`NetLab`]
//! created on the machine removes what belonged to dead processes.
//!
//! Needs root, `ip` (iproute2) and `iptables`. Where network namespaces cannot be
//! created, [`NetLab::create`] panics with the reason: the tests that need it fail, they
//! never skip.

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use crate::binaries::require_program;
use crate::process::{lock, process_alive};

/// Namespaces are named `fencelock-<slot>-<member>`.
const NS_PREFIX: &str = "fencelock-";
/// Bridges are named `flb<slot>`; their alias is `fencelock-pid-<owner pid>`.
const BRIDGE_PREFIX: &str = "flb";
const OWNER_PREFIX: &str = "fencelock-pid-";
/// Subnets are `10.231.<slot>.0/24`.
const SUBNET: [u8; 2] = [10, 231];
/// Member `i` is `10.231.<slot>.<FIRST_MEMBER + i>`.
const FIRST_MEMBER: u8 = 11;

/// Namespaces on one bridge; see the module documentation. Everything is deleted on drop.
pub struct NetLab {
    slot: u8,
    bridge: String,
    members: Vec<Member>,
    /// Cuts in force, as (member whose namespace holds the rules, peer address).
    cuts: Mutex<Vec<(usize, Ipv4Addr)>>,
}

struct Member {
    namespace: String,
    ip: Ipv4Addr,
    /// The veth end on the bridge, in the root namespace.
    host_link: String,
}

impl NetLab {
    /// Creates `n` namespaces on a new bridge, each with its own address, loopback up.
    ///
    /// Panics, naming the cause, if this machine cannot do it: not root, no network
    /// namespaces, `ip` or `iptables` missing (run `./scripts/test`, which installs and
    /// checks them).
    pub fn create(n: usize) -> NetLab {
        assert!(
            (1..=200).contains(&n),
            "fencelock-testkit: a NetLab has 1 to 200 members"
        );
        require_program("ip", "iproute2");
        require_program("iptables", "iptables");
        sweep_stale();
        let slot = claim_slot();
        let bridge = format!("{BRIDGE_PREFIX}{slot}");
        let mut lab = NetLab {
            slot,
            bridge: bridge.clone(),
            members: Vec::new(),
            cuts: Mutex::new(Vec::new()),
        };
        // From here on, a failure drops `lab`, which deletes what was made.
        let host = lab.host_ip();
        must(ip(["addr", "add", &format!("{host}/24"), "dev", &bridge]));
        must(ip(["link", "set", &bridge, "up"]));
        for i in 0..n {
            let namespace = format!("{NS_PREFIX}{slot}-{i}");
            let host_link = format!("flh{slot}-{i}");
            let inner = format!("fln{slot}-{i}");
            let member_ip = Ipv4Addr::new(SUBNET[0], SUBNET[1], slot, FIRST_MEMBER + i as u8);
            if let Err(e) = ip(["netns", "add", &namespace]) {
                drop(lab);
                panic!(
                    "fencelock-testkit: cannot create a network namespace on this machine \
                     ({e}); the isolation tests need root and network namespaces \
                     (CONFIG_NET_NS) and fail rather than skip without them"
                );
            }
            lab.members.push(Member {
                namespace: namespace.clone(),
                ip: member_ip,
                host_link: host_link.clone(),
            });
            must(ip([
                "link", "add", &host_link, "type", "veth", "peer", "name", &inner, "netns",
                &namespace,
            ]));
            must(ip([
                "-n",
                &namespace,
                "addr",
                "add",
                &format!("{member_ip}/24"),
                "dev",
                &inner,
            ]));
            must(ip(["-n", &namespace, "link", "set", &inner, "up"]));
            must(ip(["-n", &namespace, "link", "set", "lo", "up"]));
            must(ip(["link", "set", &host_link, "master", &bridge, "up"]));
            // A rule-less table now, so the first cut does not pay for loading it, and so
            // a broken iptables fails here, with its message, rather than mid-test.
            if let Err(e) = lab.iptables(i, &["-L", "-n"]) {
                drop(lab);
                panic!(
                    "fencelock-testkit: iptables does not work in a network namespace ({e}); \
                     the isolation tests need it (Debian package `iptables`)"
                );
            }
        }
        lab
    }

    /// The number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether there are no members (never true for a created lab).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The test process's address on the bridge: where the members see clients come from.
    pub fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(SUBNET[0], SUBNET[1], self.slot, 1)
    }

    /// Member `i`'s address.
    pub fn ip(&self, i: usize) -> Ipv4Addr {
        self.members[i].ip
    }

    /// Member `i`'s namespace name (for `ip netns exec`).
    pub fn namespace(&self, i: usize) -> &str {
        &self.members[i].namespace
    }

    /// `command` rewritten to run in member `i`'s namespace (`ip netns exec NS ...`), with
    /// its arguments, environment and directory. `ip netns exec` execs the program, so
    /// the child's pid is the program's.
    pub fn command_in(&self, i: usize, command: &Command) -> Command {
        in_namespace(&self.members[i].namespace, command)
    }

    /// Cuts member `i` off from every other member, both ways (its packets to them and
    /// theirs to it are dropped in its namespace). Clients in the test process still
    /// reach it, on their open connections too.
    pub fn isolate(&self, i: usize) {
        for j in (0..self.len()).filter(|&j| j != i) {
            self.cut(i, j);
        }
    }

    /// Cuts the link between members `i` and `j`, both ways.
    pub fn cut(&self, i: usize, j: usize) {
        let peer = self.ip(j);
        self.drop_peer(i, peer);
    }

    /// Cuts member `i` off from the test process (its clients), both ways; the members
    /// still reach each other.
    pub fn cut_host(&self, i: usize) {
        self.drop_peer(i, self.host_ip());
    }

    /// Removes every cut: traffic flows again, on the connections that survived too.
    pub fn heal(&self) {
        let mut cuts = lock(&self.cuts);
        let mut namespaces: Vec<usize> = cuts.iter().map(|(i, _)| *i).collect();
        namespaces.sort_unstable();
        namespaces.dedup();
        for i in namespaces {
            for chain in ["INPUT", "OUTPUT"] {
                if let Err(e) = self.iptables(i, &["-F", chain]) {
                    panic!("fencelock-testkit: cannot remove the cuts of member {i}: {e}");
                }
            }
        }
        cuts.clear();
    }

    /// The cuts in force, as (member, peer address).
    pub fn cuts(&self) -> Vec<(usize, Ipv4Addr)> {
        lock(&self.cuts).clone()
    }

    fn drop_peer(&self, i: usize, peer: Ipv4Addr) {
        let peer_text = peer.to_string();
        let mut cuts = lock(&self.cuts);
        if cuts.contains(&(i, peer)) {
            return;
        }
        for rule in [
            ["-A", "INPUT", "-s", &peer_text, "-j", "DROP"],
            ["-A", "OUTPUT", "-d", &peer_text, "-j", "DROP"],
        ] {
            if let Err(e) = self.iptables(i, &rule) {
                panic!("fencelock-testkit: cannot cut member {i} from {peer}: {e}");
            }
        }
        cuts.push((i, peer));
    }

    /// Runs `iptables -w ARGS` in member `i`'s namespace.
    fn iptables(&self, i: usize, args: &[&str]) -> Result<String, String> {
        let mut command = vec!["netns", "exec", self.namespace(i), "iptables", "-w"];
        command.extend_from_slice(args);
        ip(command)
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        for member in &self.members {
            let _ = ip(["netns", "del", &member.namespace]);
            // The kernel frees a namespace (and the veth in it) asynchronously: delete the
            // pair from our end as well.
            let _ = ip(["link", "del", &member.host_link]);
        }
        let _ = ip(["link", "del", &self.bridge]);
    }
}

impl std::fmt::Debug for NetLab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetLab")
            .field("bridge", &self.bridge)
            .field("host", &self.host_ip())
            .field(
                "members",
                &self
                    .members
                    .iter()
                    .map(|m| (m.namespace.as_str(), m.ip))
                    .collect::<Vec<_>>(),
            )
            .field("cuts", &self.cuts())
            .finish()
    }
}

/// `command` rewritten as `nsenter --net=/run/netns/NAMESPACE PROGRAM ARGS...` (like
/// `ip netns exec`, but without remounting `/`, which a chroot cannot), with the same
/// environment changes and working directory. `nsenter` execs the program, so the
/// child's pid is the program's.
pub(crate) fn in_namespace(namespace: &str, command: &Command) -> Command {
    let mut wrapped = Command::new(require_program("nsenter", "util-linux"));
    wrapped
        .arg(format!("--net=/run/netns/{namespace}"))
        .arg(command.get_program())
        .args(command.get_args());
    for (key, value) in command.get_envs() {
        match value {
            Some(value) => {
                wrapped.env(key, value);
            }
            None => {
                wrapped.env_remove(key);
            }
        }
    }
    if let Some(dir) = command.get_current_dir() {
        wrapped.current_dir(dir);
    }
    wrapped
}

/// Runs `ip ARGS`; the error carries its stderr.
fn ip<I, S>(args: I) -> Result<String, String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<S> = args.into_iter().collect();
    let shown = args
        .iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    // `ip -n NS ...` and `ip netns exec NS ...` remount `/` and `/sys` for the namespace,
    // which fails where `/` is not a mount point (a chroot, such as the fresh-machine
    // test's); `nsenter --net` only switches the network namespace, which is all the
    // lab needs.
    let texts: Vec<String> = args
        .iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect();
    let mut command = match texts.as_slice() {
        [n, namespace, rest @ ..] if n == "-n" => {
            let mut c = Command::new(require_program("nsenter", "util-linux"));
            c.arg(format!("--net=/run/netns/{namespace}"))
                .arg(require_program("ip", "iproute2"))
                .args(rest);
            c
        }
        [netns, exec, namespace, program, rest @ ..] if netns == "netns" && exec == "exec" => {
            let mut c = Command::new(require_program("nsenter", "util-linux"));
            c.arg(format!("--net=/run/netns/{namespace}"))
                .arg(program)
                .args(rest);
            c
        }
        _ => {
            let mut c = Command::new(require_program("ip", "iproute2"));
            c.args(&args);
            c
        }
    };
    let output = command
        .output()
        .map_err(|e| format!("`ip {shown}` could not run: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "`ip {shown}` failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

fn must(result: Result<String, String>) {
    if let Err(e) = result {
        panic!("fencelock-testkit: cannot set up the network namespaces: {e}");
    }
}

/// Claims a free slot by creating its bridge (an atomic claim: a second `ip link add` of
/// the same name fails) and recording this process as its owner.
fn claim_slot() -> u8 {
    let pid = std::process::id();
    let start = (pid % 254) as u8;
    let mut last_error = String::new();
    for k in 0..254u16 {
        let slot = ((u16::from(start) + k) % 254 + 1) as u8;
        let bridge = format!("{BRIDGE_PREFIX}{slot}");
        if subnet_in_use(slot) {
            continue;
        }
        match ip(["link", "add", &bridge, "type", "bridge"]) {
            Ok(_) => {
                must(ip([
                    "link",
                    "set",
                    "dev",
                    &bridge,
                    "alias",
                    &format!("{OWNER_PREFIX}{pid}"),
                ]));
                return slot;
            }
            Err(e) => last_error = e,
        }
    }
    panic!(
        "fencelock-testkit: cannot create a bridge for the network namespaces (no free slot; \
         last error: {last_error}); the isolation tests need root"
    );
}

/// Whether an address of 10.231.`slot`.0/24 is already configured on some interface.
fn subnet_in_use(slot: u8) -> bool {
    let prefix = format!(" {}.{}.{slot}.", SUBNET[0], SUBNET[1]);
    ip(["-4", "-o", "addr", "show"]).is_ok_and(|out| out.lines().any(|l| l.contains(&prefix)))
}

/// Deletes the bridges (and their namespaces) of test processes that are gone, and
/// namespaces whose bridge is gone.
fn sweep_stale() {
    if let Ok(entries) = std::fs::read_dir("/sys/class/net") {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(slot) = name
                .strip_prefix(BRIDGE_PREFIX)
                .and_then(|s| s.parse::<u8>().ok())
            else {
                continue;
            };
            let alias = std::fs::read_to_string(entry.path().join("ifalias")).unwrap_or_default();
            let owner = alias
                .trim()
                .strip_prefix(OWNER_PREFIX)
                .and_then(|p| p.parse::<u32>().ok());
            match owner {
                Some(pid) if !process_alive(pid) => {
                    delete_namespaces_of(slot);
                    let _ = ip(["link", "del", &name]);
                }
                // Alive, or being set up right now (no alias yet).
                _ => {}
            }
        }
    }
    for namespace in namespaces() {
        let slot = namespace
            .strip_prefix(NS_PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|s| s.parse::<u8>().ok());
        // A namespace is made after its bridge and deleted before it: one whose bridge
        // is gone now was left behind.
        if let Some(slot) = slot {
            let bridge = PathBuf::from(format!("/sys/class/net/{BRIDGE_PREFIX}{slot}"));
            if !bridge.exists() {
                let _ = ip(["netns", "del", &namespace]);
            }
        }
    }
}

fn delete_namespaces_of(slot: u8) {
    let prefix = format!("{NS_PREFIX}{slot}-");
    for namespace in namespaces() {
        if namespace.starts_with(&prefix) {
            let _ = ip(["netns", "del", &namespace]);
        }
    }
}

/// The named network namespaces (`/run/netns`).
fn namespaces() -> Vec<String> {
    std::fs::read_dir(PathBuf::from("/run/netns"))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}
