//! The TCP fault proxy: one listener on 127.0.0.1 forwarding every connection to one
//! upstream address, through whatever [`NetFault`] is set at the moment.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Which way bytes flow through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the connecting side (the client) to the upstream (the server).
    Upstream,
    /// From the upstream back to the client.
    Downstream,
    /// Both ways.
    Both,
}

impl Direction {
    fn covers(self, way: Direction) -> bool {
        self == Direction::Both || self == way
    }

    fn name(self) -> &'static str {
        match self {
            Direction::Upstream => "upstream",
            Direction::Downstream => "downstream",
            Direction::Both => "both ways",
        }
    }
}

/// One network fault, applied to every connection of a proxy (those open when it is set
/// and those opened while it lasts) until it is cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetFault {
    /// Bytes flowing this way are read and thrown away; no connection is closed, so only
    /// the peers' timeouts notice. A TCP stream cannot skip bytes, so when the partition
    /// heals each connection that lost bytes is reset (as a real connection dies once
    /// its retransmissions give up).
    Partition(Direction),
    /// Every chunk waits this long before it is passed on.
    Latency(Duration),
    /// Each connection is reset (RST, both sides) once it has passed on this many more
    /// bytes, counted over both directions from the moment the fault is set.
    ResetAfter(u64),
    /// The proxy stops reading this way: the sender's writes block once the socket
    /// buffers are full, and the receiver gets nothing (a half-open peer).
    StopReading(Direction),
    /// At most `bytes` pass on each `every`, each way.
    Drip {
        /// Bytes per step.
        bytes: usize,
        /// Time between steps.
        every: Duration,
    },
}

impl NetFault {
    /// The fault kind, plural, as the demo counts them: `partitions`, `latency spikes`,
    /// `resets`, `half-open`, `drips`.
    pub fn kind(&self) -> &'static str {
        match self {
            NetFault::Partition(_) => "partitions",
            NetFault::Latency(_) => "latency spikes",
            NetFault::ResetAfter(_) => "resets",
            NetFault::StopReading(_) => "half-open",
            NetFault::Drip { .. } => "drips",
        }
    }
}

impl std::fmt::Display for NetFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NetFault::Partition(d) => write!(f, "partition {}", d.name()),
            NetFault::Latency(d) => write!(f, "latency +{} ms", d.as_millis()),
            NetFault::ResetAfter(n) => write!(f, "reset after {n} bytes"),
            NetFault::StopReading(d) => write!(f, "stop reading {}", d.name()),
            NetFault::Drip { bytes, every } => {
                write!(f, "drip {bytes} bytes every {} ms", every.as_millis())
            }
        }
    }
}

/// What a proxy has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Connections accepted.
    pub connections: u64,
    /// Bytes passed on from client to upstream.
    pub upstream: u64,
    /// Bytes passed on from upstream to client.
    pub downstream: u64,
    /// Bytes thrown away by a partition.
    pub dropped: u64,
    /// Connections reset by the proxy (after N bytes, or after losing bytes).
    pub resets: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    upstream: AtomicU64,
    downstream: AtomicU64,
    dropped: AtomicU64,
    resets: AtomicU64,
}

/// The fault in force and a number that changes each time one is set, so a connection
/// restarts a [`NetFault::ResetAfter`] budget for each new fault.
#[derive(Debug, Clone, Copy, Default)]
struct State {
    fault: Option<NetFault>,
    generation: u64,
}

/// A TCP proxy on 127.0.0.1 in front of one upstream address. Dropping it stops the
/// listener and every connection it forwards.
pub struct FaultProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    state: watch::Sender<State>,
    counters: Arc<Counters>,
    accept: JoinHandle<()>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.upstream)
            .field("fault", &self.fault())
            .finish()
    }
}

impl FaultProxy {
    /// A proxy on a free loopback port forwarding to `upstream`, with no fault.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        Self::listen(TcpListener::bind("127.0.0.1:0").await?, upstream)
    }

    /// A proxy accepting on `listener` (bound beforehand, e.g. to reserve its port for a
    /// Redis Cluster node to announce), forwarding to `upstream`, with no fault.
    pub fn listen(listener: TcpListener, upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let addr = listener.local_addr()?;
        let (state, _) = watch::channel(State::default());
        let counters = Arc::new(Counters::default());
        let accept = tokio::spawn(accept_loop(
            listener,
            upstream,
            state.clone(),
            counters.clone(),
        ));
        Ok(FaultProxy {
            addr,
            upstream,
            state,
            counters,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where connections are forwarded.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Puts `fault` in force (replacing the one before), or none.
    pub fn set(&self, fault: Option<NetFault>) {
        self.state.send_modify(|s| {
            s.fault = fault;
            s.generation += 1;
        });
    }

    /// Clears the fault in force.
    pub fn heal(&self) {
        self.set(None);
    }

    /// The fault in force.
    pub fn fault(&self) -> Option<NetFault> {
        self.state.borrow().fault
    }

    /// What it has done so far.
    pub fn stats(&self) -> ProxyStats {
        let c = &self.counters;
        ProxyStats {
            connections: c.connections.load(Ordering::Relaxed),
            upstream: c.upstream.load(Ordering::Relaxed),
            downstream: c.downstream.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            resets: c.resets.load(Ordering::Relaxed),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    state: watch::Sender<State>,
    counters: Arc<Counters>,
) {
    // Connections die with the accept loop: they are tasks of this set.
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                counters.connections.fetch_add(1, Ordering::Relaxed);
                let state = state.subscribe();
                let counters = counters.clone();
                connections.spawn(async move {
                    // Upstream refused: the client sees its connection closed.
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        forward(client, server, state, counters).await;
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Why a connection ended.
enum End {
    /// Both directions reached end of stream, or a socket failed.
    Closed,
    /// The proxy resets it.
    Reset,
}

/// What both directions of one connection share.
struct Conn {
    state: watch::Receiver<State>,
    counters: Arc<Counters>,
    /// Bytes were thrown away by a partition: reset once it heals.
    lost: AtomicBool,
    /// The [`NetFault::ResetAfter`] budget: the generation it belongs to, bytes left.
    budget: Mutex<(u64, u64)>,
}

async fn forward(
    mut client: TcpStream,
    mut server: TcpStream,
    state: watch::Receiver<State>,
    counters: Arc<Counters>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let conn = Conn {
        state,
        counters,
        lost: AtomicBool::new(false),
        budget: Mutex::new((u64::MAX, 0)),
    };
    let end = {
        let (cr, mut cw) = client.split();
        let (sr, mut sw) = server.split();
        let up = pump(cr, &mut sw, Direction::Upstream, &conn);
        let down = pump(sr, &mut cw, Direction::Downstream, &conn);
        tokio::pin!(up, down);
        let (mut up_done, mut down_done) = (false, false);
        loop {
            tokio::select! {
                end = &mut up, if !up_done => match end {
                    End::Reset => break End::Reset,
                    End::Closed => up_done = true,
                },
                end = &mut down, if !down_done => match end {
                    End::Reset => break End::Reset,
                    End::Closed => down_done = true,
                },
                else => break End::Closed,
            }
        }
    };
    if let End::Reset = end {
        conn.counters.resets.fetch_add(1, Ordering::Relaxed);
        // Closing with a zero linger sends RST instead of FIN.
        let _ = client.set_zero_linger();
        let _ = server.set_zero_linger();
    }
}

/// Passes bytes from `from` to `to` (one direction of a connection) under the fault in
/// force, until end of stream, a socket error, or a reset.
async fn pump(
    mut from: tokio::net::tcp::ReadHalf<'_>,
    to: &mut tokio::net::tcp::WriteHalf<'_>,
    way: Direction,
    conn: &Conn,
) -> End {
    let mut state = conn.state.clone();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let now = *state.borrow_and_update();
        if conn.lost.load(Ordering::Relaxed) && !matches!(now.fault, Some(NetFault::Partition(_))) {
            return End::Reset;
        }
        if matches!(now.fault, Some(NetFault::StopReading(d)) if d.covers(way)) {
            if state.changed().await.is_err() {
                return End::Closed;
            }
            continue;
        }
        let n = tokio::select! {
            // A fault set before the bytes arrived applies to them.
            biased;
            changed = state.changed() => {
                if changed.is_err() {
                    return End::Closed;
                }
                continue;
            }
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return End::Closed;
                }
                Ok(n) => n,
            },
        };
        // The fault in force when the bytes arrived decides their fate; bytes read just
        // as the proxy stopped reading wait until it reads again.
        let mut now = *state.borrow_and_update();
        while matches!(now.fault, Some(NetFault::StopReading(d)) if d.covers(way)) {
            if state.changed().await.is_err() {
                return End::Closed;
            }
            now = *state.borrow_and_update();
        }
        match now.fault {
            Some(NetFault::Partition(d)) if d.covers(way) => {
                conn.counters.dropped.fetch_add(n as u64, Ordering::Relaxed);
                conn.lost.store(true, Ordering::Relaxed);
            }
            Some(NetFault::ResetAfter(limit)) => {
                let allowed = conn.take_budget(now.generation, limit, n as u64);
                if write(to, &buf[..allowed as usize], way, conn)
                    .await
                    .is_err()
                {
                    return End::Closed;
                }
                if allowed < n as u64 {
                    return End::Reset;
                }
            }
            Some(NetFault::Latency(d)) => {
                tokio::time::sleep(d).await;
                if write(to, &buf[..n], way, conn).await.is_err() {
                    return End::Closed;
                }
            }
            Some(NetFault::Drip { bytes, every }) => {
                for chunk in buf[..n].chunks(bytes.max(1)) {
                    tokio::time::sleep(every).await;
                    if write(to, chunk, way, conn).await.is_err() {
                        return End::Closed;
                    }
                }
            }
            _ => {
                if write(to, &buf[..n], way, conn).await.is_err() {
                    return End::Closed;
                }
            }
        }
    }
}

impl Conn {
    /// Takes up to `want` bytes of the reset budget of fault `generation` (which starts
    /// at `limit`); returns how many may pass.
    fn take_budget(&self, generation: u64, limit: u64, want: u64) -> u64 {
        let mut b = self.budget.lock().expect("budget lock");
        if b.0 != generation {
            *b = (generation, limit);
        }
        let allowed = want.min(b.1);
        b.1 -= allowed;
        allowed
    }
}

async fn write(
    to: &mut tokio::net::tcp::WriteHalf<'_>,
    bytes: &[u8],
    way: Direction,
    conn: &Conn,
) -> std::io::Result<()> {
    // Counted before the write, so a peer that has read them finds them counted.
    let counter = match way {
        Direction::Downstream => &conn.counters.downstream,
        _ => &conn.counters.upstream,
    };
    counter.fetch_add(bytes.len() as u64, Ordering::Relaxed);
    to.write_all(bytes).await
}
