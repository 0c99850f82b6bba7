//! A userspace TCP proxy that injects network faults between a client and a server.
//!
//! This kernel has no `netem`; etcd's own robustness suite uses an L4 proxy in front of
//! each member for the same faults. The proxy runs on plain threads (no async runtime),
//! so it works under any test runtime and outlives none of them: dropping the handle
//! stops it and closes every connection.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, mpsc};
use std::thread;
use std::time::{Duration, Instant};

/// What the proxy does to the traffic it carries. Switchable at run time with
/// [`FaultProxy::set`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fault {
    /// Forward everything at once.
    #[default]
    Pass,
    /// Hold every chunk, in both directions, for a time drawn uniformly from
    /// `min..=max` (order is kept: a chunk waits for the one before it).
    Delay {
        /// The shortest delay.
        min: Duration,
        /// The longest delay.
        max: Duration,
    },
    /// A partition: new connections are not accepted (they wait in the listen backlog),
    /// nothing is forwarded either way, and open sockets stay open. Held data flows
    /// again when the fault is lifted, as TCP retransmission would deliver it.
    Blackhole,
    /// Requests reach the server; its answers are read and thrown away (a reply lost
    /// after the server applied the request). Usually followed by
    /// [`reset_connections`](FaultProxy::reset_connections), since the streams are
    /// then out of step.
    DropReplies,
    /// Requests reach the server at once; its answers are held this long each from
    /// when they arrive (order is kept): a request applied on time whose reply
    /// arrives late, as over a slow link. Held replies are queued without bound (the
    /// server is never slowed down), and a fault set while they wait applies to them
    /// when they are due: [`Blackhole`](Fault::Blackhole) holds them longer,
    /// [`DropReplies`](Fault::DropReplies) drops them.
    DelayReplies(Duration),
}

/// A running proxy from a free loopback port to one upstream address.
///
/// ```no_run
/// use fencelock_testkit::{Fault, FaultProxy, RedisServer};
///
/// let redis = RedisServer::start();
/// let proxy = FaultProxy::start(&redis.addr());
/// // connect the client to proxy.addr() instead of redis.addr(), then:
/// proxy.set(Fault::Blackhole);
/// proxy.set(Fault::Pass);
/// ```
pub struct FaultProxy {
    shared: Arc<Shared>,
    port: u16,
}

struct Shared {
    upstream: SocketAddr,
    fault: Mutex<Fault>,
    changed: Condvar,
    /// Both sockets of every open connection, to close them on reset, and whether it is
    /// exempt from faults.
    connections: Mutex<Vec<Connection>>,
    stopped: AtomicBool,
    accepted: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    dropped_down: AtomicU64,
}

/// One proxied connection: the client-side and server-side sockets.
struct Connection {
    client: TcpStream,
    server: TcpStream,
    exempt: Arc<AtomicBool>,
}

impl Shared {
    fn connections(&self) -> MutexGuard<'_, Vec<Connection>> {
        self.connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn fault(&self) -> MutexGuard<'_, Fault> {
        self.fault.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits while the proxy is blackholed (or until it stops); returns the fault then
    /// in force. An exempt connection never waits and sees [`Fault::Pass`].
    fn wait_unless_blackholed(&self, exempt: &AtomicBool) -> Fault {
        if exempt.load(Ordering::SeqCst) {
            return Fault::Pass;
        }
        let mut fault = self.fault();
        while *fault == Fault::Blackhole && !self.stopped.load(Ordering::SeqCst) {
            fault = self
                .changed
                .wait_timeout(fault, Duration::from_millis(100))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        *fault
    }
}

impl FaultProxy {
    /// Starts a proxy to `upstream` (`host:port`) on a free loopback port, passing
    /// everything.
    ///
    /// Panics if `upstream` does not resolve or no port can be bound.
    pub fn start(upstream: &str) -> Self {
        let upstream = upstream
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .unwrap_or_else(|| panic!("fencelock-testkit: cannot resolve {upstream}"));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a proxy port");
        let port = listener.local_addr().expect("proxy address").port();
        let shared = Arc::new(Shared {
            upstream,
            fault: Mutex::new(Fault::Pass),
            changed: Condvar::new(),
            connections: Mutex::new(Vec::new()),
            stopped: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
            bytes_up: AtomicU64::new(0),
            bytes_down: AtomicU64::new(0),
            dropped_down: AtomicU64::new(0),
        });
        let accepting = shared.clone();
        thread::Builder::new()
            .name(format!("fault-proxy-{port}"))
            .spawn(move || accept_loop(&listener, &accepting))
            .expect("spawn the proxy thread");
        FaultProxy { shared, port }
    }

    /// The proxy's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`: the address clients connect to instead of the upstream.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Switches the fault; takes effect for the next chunk on every connection.
    pub fn set(&self, fault: Fault) {
        *self.shared.fault() = fault;
        self.shared.changed.notify_all();
    }

    /// The fault in force.
    pub fn fault(&self) -> Fault {
        *self.shared.fault()
    }

    /// Closes every open connection that is not exempt
    /// ([`exempt_open_connections`](FaultProxy::exempt_open_connections)), both sides
    /// (clients see the connection end and reconnect, through the proxy, under the fault
    /// then in force).
    pub fn reset_connections(&self) {
        self.close(|c| !c.exempt.load(Ordering::SeqCst));
    }

    /// Exempts the connections open now from every fault, for as long as they stay
    /// open; returns how many connections the proxy has accepted and not reset (closed
    /// ones included). Connections opened later are not exempt.
    ///
    /// For clients whose servers announce the proxy's address (Sentinel, Redis
    /// Cluster), so that every client connects through it: connect the clients that must
    /// keep working (and the servers' own links through the proxy), exempt their
    /// connections, then connect the client to cut off and set the fault.
    pub fn exempt_open_connections(&self) -> usize {
        let connections = self.shared.connections();
        for c in connections.iter() {
            c.exempt.store(true, Ordering::SeqCst);
        }
        self.shared.changed.notify_all();
        connections.len()
    }

    fn close(&self, which: impl Fn(&Connection) -> bool) {
        let closing: Vec<Connection> = {
            let mut connections = self.shared.connections();
            let (closing, kept) = std::mem::take(&mut *connections)
                .into_iter()
                .partition(|c| which(c));
            *connections = kept;
            closing
        };
        for c in closing {
            let _ = c.client.shutdown(Shutdown::Both);
            let _ = c.server.shutdown(Shutdown::Both);
        }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Bytes forwarded client → server so far.
    pub fn bytes_up(&self) -> u64 {
        self.shared.bytes_up.load(Ordering::SeqCst)
    }

    /// Bytes forwarded server → client so far.
    pub fn bytes_down(&self) -> u64 {
        self.shared.bytes_down.load(Ordering::SeqCst)
    }

    /// Bytes of server answers thrown away under [`Fault::DropReplies`].
    pub fn dropped_replies(&self) -> u64 {
        self.shared.dropped_down.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        self.close(|_| true);
        // Wake the accept loop so it sees `stopped`.
        let _ = TcpStream::connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], self.port)),
            Duration::from_millis(200),
        );
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    loop {
        // Under a blackhole, connections wait in the listen backlog, unanswered.
        let new = AtomicBool::new(false);
        shared.wait_unless_blackholed(&new);
        let Ok((client, _)) = listener.accept() else {
            continue;
        };
        if shared.stopped.load(Ordering::SeqCst) {
            return;
        }
        shared.wait_unless_blackholed(&new);
        let Ok(server) = TcpStream::connect_timeout(&shared.upstream, Duration::from_secs(2))
        else {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) = (
            client.try_clone(),
            server.try_clone(),
            client.try_clone(),
            server.try_clone(),
        ) else {
            continue;
        };
        let exempt = Arc::new(AtomicBool::new(false));
        shared.connections().push(Connection {
            client: c3,
            server: s3,
            exempt: exempt.clone(),
        });
        let (up, down) = (shared.clone(), shared.clone());
        let up_exempt = exempt.clone();
        let _ = thread::Builder::new()
            .name("fault-proxy-up".into())
            .spawn(move || pump(client, server, &up, &up_exempt, false));
        let _ = thread::Builder::new()
            .name("fault-proxy-down".into())
            .spawn(move || pump(s2, c2, &down, &exempt, true));
    }
}

/// Copies `from` → `to` under the fault in force; `reply` is the server → client side.
///
/// Replies go through a writer thread that sends each chunk when it is due, so
/// [`Fault::DelayReplies`] delays every chunk by the same time from its arrival, as a
/// slow link does (chunks do not wait for each other's delays, only for their turn).
fn pump(
    mut from: TcpStream,
    to: TcpStream,
    shared: &Arc<Shared>,
    exempt: &Arc<AtomicBool>,
    reply: bool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut sink = Sink::new(to, shared, exempt, reply);
    static STREAMS: AtomicU64 = AtomicU64::new(1);
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ STREAMS.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
        | 1;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut due = Instant::now();
        if shared.stopped.load(Ordering::SeqCst) {
            break;
        }
        match shared.wait_unless_blackholed(exempt) {
            Fault::DropReplies if reply => {
                shared.dropped_down.fetch_add(n as u64, Ordering::SeqCst);
                continue;
            }
            Fault::DelayReplies(delay) if reply => due = Instant::now() + delay,
            Fault::Delay { min, max } => {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let span = max.saturating_sub(min).as_micros() as u64;
                let extra = if span == 0 { 0 } else { seed % (span + 1) };
                thread::sleep(min + Duration::from_micros(extra));
            }
            _ => {}
        }
        if !sink.send(due, &buf[..n]) {
            break;
        }
    }
    sink.finish();
    let _ = from.shutdown(Shutdown::Read);
}

/// Where [`pump`] writes: at once (requests), or through a writer thread that keeps
/// each chunk until it is due (replies).
enum Sink {
    Direct(TcpStream, Arc<Shared>),
    Queued(
        mpsc::Sender<(Instant, Vec<u8>)>,
        Option<thread::JoinHandle<()>>,
    ),
}

impl Sink {
    fn new(to: TcpStream, shared: &Arc<Shared>, exempt: &Arc<AtomicBool>, reply: bool) -> Self {
        if !reply {
            return Sink::Direct(to, shared.clone());
        }
        let (chunks, queue) = mpsc::channel::<(Instant, Vec<u8>)>();
        let (shared, exempt) = (shared.clone(), exempt.clone());
        let writer = thread::Builder::new()
            .name("fault-proxy-write".into())
            .spawn(move || {
                let mut to = to;
                for (due, chunk) in queue {
                    let now = Instant::now();
                    if due > now {
                        thread::sleep(due - now);
                    }
                    // A partition set meanwhile holds what was queued before it, too,
                    // and replies dropped from now on include those queued.
                    if shared.wait_unless_blackholed(&exempt) == Fault::DropReplies {
                        shared
                            .dropped_down
                            .fetch_add(chunk.len() as u64, Ordering::SeqCst);
                        continue;
                    }
                    if to.write_all(&chunk).is_err() {
                        break;
                    }
                    shared
                        .bytes_down
                        .fetch_add(chunk.len() as u64, Ordering::SeqCst);
                }
                let _ = to.shutdown(Shutdown::Write);
            })
            .ok();
        Sink::Queued(chunks, writer)
    }

    /// Writes (or queues) `chunk` to go at `due`; false if the other side is gone.
    fn send(&mut self, due: Instant, chunk: &[u8]) -> bool {
        match self {
            Sink::Direct(to, shared) => {
                if to.write_all(chunk).is_err() {
                    return false;
                }
                shared
                    .bytes_up
                    .fetch_add(chunk.len() as u64, Ordering::SeqCst);
                true
            }
            Sink::Queued(chunks, _) => chunks.send((due, chunk.to_vec())).is_ok(),
        }
    }

    /// Sends what is queued, then closes the writing side.
    fn finish(self) {
        match self {
            Sink::Direct(to, _) => {
                let _ = to.shutdown(Shutdown::Write);
            }
            Sink::Queued(chunks, writer) => {
                drop(chunks);
                if let Some(writer) = writer {
                    let _ = writer.join();
                }
            }
        }
    }
}
