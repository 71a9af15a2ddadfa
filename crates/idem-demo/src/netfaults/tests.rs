//! The proxy, one fault kind at a time, on real loopback sockets. Faults are set by
//! explicit commands; what is awaited is bytes and counters, never wall time (latency
//! and drips run on paused time).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// A proxy in front of a fresh listener, a client connected through it, and the server
/// side of that connection.
async fn connected() -> (FaultProxy, TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = FaultProxy::start(listener.local_addr().unwrap())
        .await
        .unwrap();
    let client = TcpStream::connect(proxy.addr()).await.unwrap();
    let (server, _) = listener.accept().await.unwrap();
    (proxy, client, server)
}

async fn read_exact(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0; n];
    s.read_exact(&mut buf).await.unwrap();
    buf
}

/// Waits (yielding, no clock) until `done` holds for the proxy's stats.
async fn until(proxy: &FaultProxy, done: impl Fn(&ProxyStats) -> bool) {
    while !done(&proxy.stats()) {
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The connection was reset or closed: a read ends (0 bytes or ECONNRESET).
async fn assert_ended(s: &mut TcpStream) {
    let mut buf = [0u8; 64];
    match s.read(&mut buf).await {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("{n} more bytes after the end"),
    }
}

#[tokio::test]
async fn forwards_both_ways_without_a_fault() {
    let (proxy, mut client, mut server) = connected().await;
    client.write_all(b"ping").await.unwrap();
    assert_eq!(read_exact(&mut server, 4).await, b"ping");
    server.write_all(b"pong!").await.unwrap();
    assert_eq!(read_exact(&mut client, 5).await, b"pong!");
    let s = proxy.stats();
    assert_eq!((s.connections, s.upstream, s.downstream), (1, 4, 5));
    assert_eq!((s.dropped, s.resets), (0, 0));
}

#[tokio::test]
async fn a_partition_drops_bytes_keeps_the_connection_open_then_resets_it() {
    let (proxy, mut client, mut server) = connected().await;
    proxy.set(Some(NetFault::Partition(Direction::Both)));
    client.write_all(b"lost-up").await.unwrap();
    server.write_all(b"lost-down").await.unwrap();
    until(&proxy, |s| s.dropped == 16).await;
    // Nothing arrived either way, and neither side was closed.
    let mut buf = [0u8; 16];
    assert!(
        matches!(client.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    );
    assert!(
        matches!(server.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    );
    assert_eq!((proxy.stats().upstream, proxy.stats().downstream), (0, 0));
    // Healed: the stream lost bytes, so both sides are reset.
    proxy.heal();
    assert_ended(&mut client).await;
    assert_ended(&mut server).await;
    assert_eq!(proxy.stats().resets, 1);
}

#[tokio::test]
async fn a_one_way_partition_drops_only_that_way() {
    let (proxy, mut client, mut server) = connected().await;
    proxy.set(Some(NetFault::Partition(Direction::Upstream)));
    client.write_all(b"request").await.unwrap();
    until(&proxy, |s| s.dropped == 7).await;
    server.write_all(b"still flows").await.unwrap();
    assert_eq!(read_exact(&mut client, 11).await, b"still flows");
    assert_eq!(proxy.stats().upstream, 0);
    proxy.heal();
    assert_ended(&mut server).await;
}

#[tokio::test]
async fn a_partition_that_dropped_nothing_leaves_the_connection_alone() {
    let (proxy, mut client, mut server) = connected().await;
    proxy.set(Some(NetFault::Partition(Direction::Both)));
    proxy.heal();
    client.write_all(b"after").await.unwrap();
    assert_eq!(read_exact(&mut server, 5).await, b"after");
    assert_eq!(proxy.stats().resets, 0);
}

#[tokio::test]
async fn reset_after_n_bytes_passes_exactly_n_then_resets() {
    let (proxy, mut client, mut server) = connected().await;
    client.write_all(b"before").await.unwrap();
    assert_eq!(read_exact(&mut server, 6).await, b"before");
    proxy.set(Some(NetFault::ResetAfter(5)));
    client.write_all(b"0123456789").await.unwrap();
    assert_eq!(read_exact(&mut server, 5).await, b"01234");
    assert_ended(&mut server).await;
    assert_ended(&mut client).await;
    let s = proxy.stats();
    assert_eq!((s.upstream, s.resets), (11, 1));
}

#[tokio::test]
async fn the_reset_budget_counts_both_directions() {
    let (proxy, mut client, mut server) = connected().await;
    proxy.set(Some(NetFault::ResetAfter(6)));
    client.write_all(b"abcd").await.unwrap();
    assert_eq!(read_exact(&mut server, 4).await, b"abcd");
    server.write_all(b"wxyz").await.unwrap();
    assert_eq!(read_exact(&mut client, 2).await, b"wx");
    assert_ended(&mut client).await;
    assert_eq!(proxy.stats().resets, 1);
}

#[tokio::test]
async fn stop_reading_blocks_the_sender_until_healed() {
    let (proxy, client, mut server) = connected().await;
    proxy.set(Some(NetFault::StopReading(Direction::Upstream)));
    // The proof that nobody reads, without a clock: the sender's buffers fill up until
    // the kernel refuses more.
    let chunk = vec![7u8; 64 * 1024];
    let mut sent = 0usize;
    loop {
        match client.try_write(&chunk) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
        tokio::task::yield_now().await;
    }
    assert!(sent > 0);
    // The fault was set before any byte was written: none was passed on.
    assert_eq!(proxy.stats().upstream, 0);
    proxy.heal();
    let got = read_exact(&mut server, sent).await;
    assert!(got.iter().all(|&b| b == 7));
    assert_eq!(proxy.stats().upstream, sent as u64);
}

#[tokio::test(start_paused = true)]
async fn latency_delays_each_chunk_by_the_set_time() {
    let (proxy, mut client, mut server) = connected().await;
    proxy.set(Some(NetFault::Latency(Duration::from_secs(30))));
    let t0 = tokio::time::Instant::now();
    client.write_all(b"slow").await.unwrap();
    assert_eq!(read_exact(&mut server, 4).await, b"slow");
    // Paused time: the 30 s are the proxy's sleep, not the machine's speed.
    assert!(t0.elapsed() >= Duration::from_secs(30));
    proxy.heal();
    let t1 = tokio::time::Instant::now();
    client.write_all(b"fast").await.unwrap();
    assert_eq!(read_exact(&mut server, 4).await, b"fast");
    assert!(t1.elapsed() < Duration::from_secs(30));
}

#[tokio::test(start_paused = true)]
async fn a_drip_passes_n_bytes_per_step() {
    let (proxy, mut client, mut server) = connected().await;
    proxy.set(Some(NetFault::Drip {
        bytes: 2,
        every: Duration::from_secs(10),
    }));
    let t0 = tokio::time::Instant::now();
    client.write_all(b"abcdefgh").await.unwrap();
    assert_eq!(read_exact(&mut server, 8).await, b"abcdefgh");
    // Four steps of 2 bytes, each after 10 s of paused time.
    assert!(t0.elapsed() >= Duration::from_secs(40));
    assert_eq!(proxy.stats().upstream, 8);
}

#[tokio::test]
async fn an_upstream_that_refuses_closes_the_client() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let proxy = FaultProxy::start(addr).await.unwrap();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_ended(&mut client).await;
}

#[test]
fn the_schedule_is_seeded() {
    let spec = ScheduleSpec::new(42, Duration::from_millis(100)..Duration::from_secs(2));
    let a: Vec<Step> = steps(&spec, 0).take(50).collect();
    let b: Vec<Step> = steps(&spec, 0).take(50).collect();
    assert_eq!(a, b);
    let other: Vec<Step> = steps(&spec, 1).take(50).collect();
    assert_ne!(a, other);
    let kinds: std::collections::BTreeSet<_> = a.iter().map(|s| s.fault.kind()).collect();
    assert_eq!(kinds.len(), 5, "50 steps draw every kind: {kinds:?}");
    for s in &a {
        if let NetFault::Partition(_) = s.fault {
            assert!(spec.partition.contains(&s.lasts));
        }
    }
}

#[tokio::test(start_paused = true)]
async fn the_driver_counts_faults_by_kind() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = std::sync::Arc::new(
        FaultProxy::start(listener.local_addr().unwrap())
            .await
            .unwrap(),
    );
    let spec = ScheduleSpec::new(3, Duration::from_millis(100)..Duration::from_secs(1));
    let driver = FaultDriver::start(&spec, vec![("p".into(), proxy.clone())], false);
    tokio::time::sleep(Duration::from_secs(60)).await;
    let counts = driver.stop();
    assert!(counts.total() > 10, "{counts}");
    let line = counts.to_string();
    assert!(
        line.starts_with(&format!("{} network faults: ", counts.total())),
        "{line}"
    );
    assert!(
        line.contains(" partitions, ") && line.contains(" drips"),
        "{line}"
    );
    assert_eq!(proxy.fault(), None, "stop heals");
}

/// The client ports in a `CLUSTER SLOTS` reply (`[[start, end, [ip, port, id], …], …]`).
fn slot_ports(reply: &idem_test_support::redis::RedisReply) -> Vec<u16> {
    use idem_test_support::redis::RedisReply::{Array, Int};
    let Array(Some(ranges)) = reply else {
        panic!("CLUSTER SLOTS: {reply:?}")
    };
    let mut ports = Vec::new();
    for range in ranges {
        let Array(Some(items)) = range else {
            panic!("a slot range: {range:?}")
        };
        for node in &items[2..] {
            match node {
                Array(Some(n)) => match n.get(1) {
                    Some(Int(p)) => ports.push(u16::try_from(*p).expect("a port")),
                    other => panic!("a node's port: {other:?}"),
                },
                other => panic!("a node: {other:?}"),
            }
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// A proxied cluster tells clients only its proxies' ports: `CLUSTER SLOTS` lists every
/// master at its proxy, and a `MOVED` redirect names a proxy; the nodes still answer on
/// their own ports (the harness's commands).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxied_cluster_announces_only_its_proxies() {
    let Some(c) = ProxiedCluster::start().await else {
        return;
    };
    let mut proxies: Vec<u16> = c.proxies().iter().map(|(_, p)| p.addr().port()).collect();
    proxies.sort_unstable();
    let nodes = c.cluster();
    tokio::task::block_in_place(|| {
        for port in nodes.ports() {
            assert!(!proxies.contains(&port), "node {port} on a proxy port");
            // Every master at its proxy (replicas that have replicated nothing yet are
            // left out of `CLUSTER SLOTS`), and no other port.
            let slots = nodes.cmd(port, &["CLUSTER", "SLOTS"]).unwrap();
            let listed = slot_ports(&slots);
            assert!(
                listed.iter().all(|p| proxies.contains(p)),
                "node {port}: {listed:?}, proxies {proxies:?}"
            );
            for m in nodes.masters() {
                let at = nodes.announced_port(m.port);
                assert!(listed.contains(&at), "node {port}: {listed:?} lacks {at}");
            }
        }
        let slot = nodes.slot_of("idem-test:moved");
        let owner = nodes.master_of_slot(slot);
        let other = nodes
            .masters()
            .into_iter()
            .find(|m| m.id != owner.id)
            .unwrap();
        let moved = nodes
            .cmd(other.port, &["GET", "idem-test:moved"])
            .unwrap()
            .text();
        let want = format!(
            "MOVED {slot} 127.0.0.1:{}",
            nodes.announced_port(owner.port)
        );
        assert_eq!(moved, want);
        assert_eq!(c.proxy_of(owner.port).upstream().port(), owner.port);
    });
}
