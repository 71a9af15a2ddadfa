//! A `begin_for` cut short (by its time limit, or by a caller that went away) while the
//! database's answer to `BEGIN` is still on its way leaves no pooled connection inside a
//! transaction.
//!
//! sqlx 0.8.6 counts a transaction only once `BEGIN` is answered, so a `pool.begin()`
//! dropped in that window hands its connection back to the pool in a transaction
//! nothing ends (sqlx issue #4393). The store's own statements later run on that
//! connection inside it, uncommitted, and once one fails every statement there gets
//! `25P02`. The database's answers pass through a proxy here that can hold them back,
//! which opens that window on purpose.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_postgres::{PostgresStore, TxError};
use idem_store::{RecordRef, Scope};
use idem_test_support::postgres::PostgresServer;
use sqlx::postgres::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP proxy to `upstream` that holds every chunk the server sends for the delay
/// currently set (milliseconds), and passes the client's bytes on at once.
async fn delaying_proxy(upstream: SocketAddr) -> (SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let delay = Arc::new(AtomicU64::new(0));
    let shared = delay.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(upstream).await else {
                continue;
            };
            let delay = shared.clone();
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                loop {
                    let n = match server_read.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let ms = delay.load(Ordering::SeqCst);
                    if ms > 0 {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    if client_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, delay)
}

/// Sessions of the test database left inside a transaction and idle.
async fn idle_in_transaction(direct: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() \
         AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(direct)
    .await
    .unwrap()
}

/// Waits (up to 10 s) until no session is idle inside a transaction; the count last seen.
async fn settled(direct: &PgPool) -> i64 {
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let n = idle_in_transaction(direct).await;
        if n == 0 || tokio::time::Instant::now() > until {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn protected_request() -> tonic::Request<()> {
    let mut request = tonic::Request::new(());
    request.extensions_mut().insert(RecordRef::new(
        Scope(rand::random()),
        1,
        Duration::from_secs(60),
        Duration::from_secs(10),
    ));
    request
}

struct Env {
    _server: PostgresServer,
    direct: PgPool,
    store: PostgresStore,
    delay: Arc<AtomicU64>,
}

/// A store with one pooled connection, through the proxy, and a direct pool to watch.
async fn start() -> Option<Env> {
    let server = PostgresServer::start()?;
    let direct = server.pool(1).await;
    let (proxy, delay) = delaying_proxy(([127, 0, 0, 1], server.port()).into()).await;
    let url = server.url().replace(
        &format!(":{}/", server.port()),
        &format!(":{}/", proxy.port()),
    );
    assert_ne!(url, server.url(), "the store goes through the proxy");
    let store = PostgresStore::builder(url)
        .max_connections(1)
        .statement_timeout(Duration::from_millis(200))
        .no_sweep()
        .connect()
        .await
        .expect("connect through the proxy");
    // The pool's connection is open and back in the pool (its release ping answered)
    // before the delay starts.
    sqlx::query("SELECT 1").execute(store.pool()).await.unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while store.pool().num_idle() < 1 {
        assert!(
            tokio::time::Instant::now() < until,
            "the connection stays out"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Some(Env {
        _server: server,
        direct,
        store,
        delay,
    })
}

impl Env {
    /// The pool's one connection still works outside a transaction: a failed
    /// statement does not leave the next one answering `25P02`.
    async fn assert_connection_clean(&self) {
        assert_eq!(
            settled(&self.direct).await,
            0,
            "a session left in a transaction"
        );
        let failed = sqlx::query("SELECT 1/0").execute(self.store.pool()).await;
        assert!(
            matches!(&failed, Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("22012")),
            "{failed:?}"
        );
        sqlx::query("SELECT 1")
            .execute(self.store.pool())
            .await
            .expect("the pooled connection is not inside an aborted transaction");
        // And a begin_for now gets a transaction of its own that commits.
        let request = protected_request();
        let tx = self.store.begin_for(&request).await.unwrap();
        tx.rollback().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn begin_for_past_its_time_limit_leaves_no_connection_in_a_transaction() {
    let Some(env) = start().await else {
        return;
    };
    env.delay.store(800, Ordering::SeqCst);
    let request = protected_request();
    let err = env.store.begin_for(&request).await.unwrap_err();
    assert!(
        matches!(err, TxError::Database(sqlx::Error::PoolTimedOut)),
        "{err}"
    );
    env.delay.store(0, Ordering::SeqCst);
    env.assert_connection_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn begin_for_dropped_by_its_caller_leaves_no_connection_in_a_transaction() {
    let Some(env) = start().await else {
        return;
    };
    env.delay.store(800, Ordering::SeqCst);
    let store = env.store.clone();
    // A handler whose caller went away: its future is dropped mid-`BEGIN`.
    let handler = tokio::spawn(async move {
        let request = protected_request();
        let _tx = store.begin_for(&request).await;
        std::future::pending::<()>().await;
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    handler.abort();
    assert!(handler.await.unwrap_err().is_cancelled());
    env.delay.store(0, Ordering::SeqCst);
    env.assert_connection_clean().await;
}
