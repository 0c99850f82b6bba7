//! One raw request/response exchange over TCP (loopback, or a member's address in a
//! network namespace), for readiness probes.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Connects to 127.0.0.1:`port`, writes `request`, and reads until `complete` says the
/// bytes read so far are a whole answer, or the peer closes the connection. Fails with
/// `TimedOut`/`WouldBlock` if `timeout` passes first.
pub(crate) fn exchange(
    port: u16,
    request: &[u8],
    timeout: Duration,
    complete: impl Fn(&[u8]) -> bool,
) -> io::Result<Vec<u8>> {
    exchange_at(Ipv4Addr::LOCALHOST, port, request, timeout, complete)
}

/// [`exchange`] with `ip`:`port` instead of 127.0.0.1:`port`.
pub(crate) fn exchange_at(
    ip: Ipv4Addr,
    port: u16,
    request: &[u8],
    timeout: Duration,
    complete: impl Fn(&[u8]) -> bool,
) -> io::Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let addr = SocketAddr::from((ip, port));
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(request)?;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut chunk) {
            Ok(0) => return Ok(answer),
            Ok(n) => {
                answer.extend_from_slice(&chunk[..n]);
                if complete(&answer) {
                    return Ok(answer);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// A plain HTTP/1.1 request to `ip`:`port` with `Connection: close`; returns the whole
/// response (status line, headers and body) as text.
pub(crate) fn http(
    ip: Ipv4Addr,
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    timeout: Duration,
) -> io::Result<String> {
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {ip}:{port}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = exchange_at(ip, port, request.as_bytes(), timeout, |_| false)?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}
