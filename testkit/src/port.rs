//! Free loopback ports.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// Ports this process has already handed out, never handed out twice.
static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// Returns a TCP port on 127.0.0.1 that was free a moment ago.
///
/// The port is found by binding `127.0.0.1:0` and dropping the listener, so another
/// process may take it before the caller binds it; the server launchers retry on fresh
/// ports when that happens. A port is never returned twice by the same process.
pub fn free_port() -> u16 {
    free_ports(1)[0]
}

/// Returns `n` distinct free TCP ports on 127.0.0.1 (see [`free_port`]).
///
/// All `n` listeners are held until every port is chosen, so the ports differ.
pub fn free_ports(n: usize) -> Vec<u16> {
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
    let mut held = Vec::with_capacity(n);
    let mut ports = Vec::with_capacity(n);
    while ports.len() < n {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap_or_else(|e| panic!("fencelock-testkit: cannot bind 127.0.0.1:0: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("fencelock-testkit: no local address: {e}"))
            .port();
        if handed_out.insert(port) {
            ports.push(port);
        }
        held.push(listener);
        assert!(
            held.len() < 10_000,
            "fencelock-testkit: ran out of free loopback ports"
        );
    }
    ports
}

/// Whether something accepts TCP connections on 127.0.0.1:`port` (250 ms timeout).
pub fn port_open(port: u16) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    TcpStream::connect_timeout(&addr, Duration::from_millis(250)).is_ok()
}
