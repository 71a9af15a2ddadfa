//! A Redis-backed idempotency [`Store`](idem_store::Store) for `idem-server`,
//! so several instances of a service act as one.
//!
//! # When to use it
//! The in-memory store (`idem_store::memory::MemoryStore`) is right when one process
//! serves a method: it costs no network hop. As soon as a service runs as two or more
//! instances behind a load balancer, a retry can land on another instance than the
//! first attempt; with per-process memory it would run a second time. Point every
//! instance at one Redis with [`RedisStore`] and they share the
//! records: a key runs once across all of them, and a duplicate on any instance waits
//! for or replays the outcome.
//!
//! # Setup
//! ```no_run
//! # async fn f() -> Result<(), idem_redis::ConnectError> {
//! use idem_redis::RedisStore;
//! // Defaults: keyPrefix "idem:", command timeout 500 ms, connect timeout 2 s.
//! let store = RedisStore::connect("redis://127.0.0.1:6379/0").await?;
//! // Or from the service config's `idem.redis` object:
//! // let store = RedisStore::from_settings(config.settings().redis.as_ref().unwrap()).await?;
//! // Then hand `store` to the server layer in place of the memory store.
//! # let _ = store; Ok(()) }
//! ```
//! In the service config:
//! ```json
//! { "idem": { "redis": { "url": "redis://redis:6379/0", "keyPrefix": "idem:",
//!                        "commandTimeout": "0.5s", "connectTimeout": "2s" } } }
//! ```
//!
//! # Redis settings a deployment needs
//! - `maxmemory-policy noeviction`. Every record has a TTL, so `volatile-*` policies
//!   evict them as readily as `allkeys-*`; an evicted record lets a duplicate run again.
//!   With `noeviction` a full Redis refuses writes instead, which the store reports as
//!   unavailable (the call fails closed with UNAVAILABLE and the client retries).
//!   Size `maxmemory` for (calls per second × record TTL × response size).
//! - Persistence: `appendonly yes` with `appendfsync everysec` (at most about a second
//!   of records lost on a crash); RDB snapshots alone lose minutes.
//! - Replication: a failover to a replica that had not received the latest writes
//!   loses those records, and a retry then runs the handler again. Either accept that
//!   window, or have every claim and completion confirmed on replicas with `WAIT`
//!   ([`RedisStoreBuilder::replica_acks`], `idem.redis.replicaAcks`; see "Replica
//!   confirmation").
//! - Redis 6.2 or newer (tested with 7.0; Redis Cluster needs 7.0 for sharded pub/sub).
//!   Scripts need `EVALSHA`/`SCRIPT LOAD`, and `CONFIG GET` is used at start only
//!   (refusing it only skips the checks).
//!
//! At connect, [`RedisStore::check_server`] warns through `tracing` when the eviction
//! policy could drop records or persistence is off.
//!
//! # Redis Cluster
//! [`RedisStore::cluster_builder`] (or `idem.redis.clusterNodes`) connects to a Redis
//! Cluster through the `redis` crate's cluster client, given one or more seed nodes:
//! ```no_run
//! # async fn f() -> Result<(), idem_redis::ConnectError> {
//! let store = idem_redis::RedisStore::cluster_builder([
//!     "redis://10.0.0.1:7000",
//!     "redis://10.0.0.2:7000",
//! ])
//! .connect()
//! .await?;
//! # let _ = store; Ok(()) }
//! ```
//! - A cluster node given as a single endpoint ([`RedisStore::connect`], `url`) is
//!   refused at connect (`INFO cluster` says `cluster_enabled:1`): that connection
//!   would reach only the node's own slots and every other record would fail.
//! - **Same scripts, one slot each.** Everything about a record is one hash whose name
//!   carries the record's hash tag (`{<scope hex>}`), and each script touches only its
//!   `KEYS[1]`, so no script is ever `CROSSSLOT`. The per-tenant quotas are keys of
//!   their own (tagged with the tenant), written in a step of their own (see
//!   "Per-tenant quota"): a tenant's counts and its records live in different slots by
//!   design (on a single endpoint the same scripts take the tenant's keys too, and the
//!   step costs no round trip). Trade-off: the count of one tenant is one key on one master, which every
//!   fresh call of that tenant writes; a single-tenant service at high rates makes that
//!   master the hot spot (`max_in_flight_per_tenant(None)` removes the step).
//!   Tagging the records with the tenant instead would put a whole tenant on one master,
//!   which is worse.
//! - **Routing and topology changes** are the client's: each command goes to the master
//!   of its key's slot; `MOVED` (a slot moved) refreshes the slot map; `ASK` (a slot
//!   being migrated, the key already on the target) sends `ASKING` and the command to
//!   the target; a node lost is reconnected, and after a failover the promoted replica
//!   is found. Every command stays under the command timeout, so while a shard has no
//!   master the calls on its slots fail closed (UNAVAILABLE) and the client retries.
//!   A master that stops answering with its connections open (a partition, a hung
//!   host) is not left to the client, which would retry it until the connections die:
//!   a command timeout rebuilds the cluster connection in the background (at most once
//!   per command timeout; the slot map is read again from a node that answers), so the
//!   calls follow a failover within a few seconds while the old master stays cut off.
//!   Keepalive and `TCP_USER_TIMEOUT` on the node connections drop a peer the network
//!   lost within seconds too.
//!   A script missing on a node (`NOSCRIPT`: a node that joined, or a restart) is loaded
//!   on every node and the call sent again.
//! - **Waiting** uses sharded pub/sub: the complete and release scripts `SPUBLISH` on
//!   the record's channel `<key>:done` (the same hash tag, so the same slot and master),
//!   and waiters `SSUBSCRIBE` through a RESP3 cluster connection of their own, which
//!   subscribes again after reconnections and slot moves. Messages published while it
//!   was away are lost; a disconnection wakes the waiters, which read the record again,
//!   and the polling fallback covers the rest. [`WaitStrategy::Poll`] works too.
//! - Tested (`tests/cluster.rs` here, `tests/redis_cluster.rs` and the cluster case of
//!   `tests/chaos.rs` in the workspace) against a private 3-master, 3-replica cluster:
//!   the conformance suite, 500 keys called on three instances at once, a master
//!   SIGKILLed mid-run while cut off from its replica, and slots migrated mid-run.
//!
//! # Replica confirmation
//! Redis replication is asynchronous: a master acknowledges a write before its replicas
//! have it, and a failover to a replica that missed the write forgets it. For an
//! idempotency store that means a claim or a completion the store confirmed can vanish,
//! and a retry then runs the handler a second time. [`RedisStoreBuilder::replica_acks`]
//! (`"replicaAcks": 1, "replicaAckTimeout": "0.1s"`) closes most of that window: the
//! store sends `WAIT <n> <timeout>` behind each claim and completion, in the same
//! pipeline (so on the connection that wrote), and answers only when `n` replicas have
//! the write. A claim that is not confirmed in time is released and refused
//! (UNAVAILABLE; nothing ran); a completion is retried by the layer, its lease renewed
//! meanwhile. Lease renewals are not confirmed (see the builder). Costs, measured in
//! BENCHMARKS.md: a replay nothing; a fresh call one more round trip and two replication
//! delays. And availability: writes to a shard with fewer than `n` live replicas fail
//! closed, so after a failover the shard refuses new claims until a replica is back; run
//! `n + 1` replicas per master to ride out the loss of one. It is not consensus: Redis
//! can still promote a replica that missed a write (the confirming replica failing with
//! its master). In `tests/redis_cluster.rs`, a master killed while cut off from its
//! replica cost 21–26 double executions out of 1,500 intents without confirmation and
//! none with it.
//!
//! # Key layout
//! One Redis hash per record, named `<prefix>{<scope hex>}`: the scope is the SHA-256
//! of the length-prefixed (tenant, method, key), so raw client input never appears in
//! a key name, and the braces are a Redis Cluster hash tag that keeps a record in one
//! slot. The fence lives inside the record. Besides records, only one sorted set per
//! tenant with calls in flight, `<prefix>tenant:{<tenant digest hex>}`, and with
//! `maxBytesPerTenant` a sorted set `…:bytes` and a hash `…:sizes` beside it (see
//! "Per-tenant quota"); no global counter, no index. Fields: `s` state (`i` in flight,
//! `c` completed, `r` released tombstone, rare: see "Fences"), `f`
//! fence, `fp` fingerprint (32 raw bytes), `c` claimant id, `l` lease deadline (ms on
//! the Redis server's clock), `k` outcome kind, `o` outcome bytes (binary-safe).
//!
//! # Scripts
//! Each operation is one Lua script (`EVALSHA`; the script is loaded at connect and
//! again on `NOSCRIPT`, e.g. after a Redis restart), atomic on its key, and sets the
//! key's expiry (`PEXPIRE`) in the same script:
//!
//! - **claim**: no record → in flight, first fence = the Redis server's clock in
//!   microseconds (see "Fences" below). Released tombstone → in flight with
//!   fence + 1 (or the clock, if that is higher), whatever the fingerprint. Different fingerprint → `Mismatch` (in flight
//!   or completed). Completed → the outcome, in the same reply (so a replay is one
//!   round trip). In flight with a live lease: the same claimant (a claim re-sent after
//!   a lost reply) gets its fence back and its lease extended; anyone else gets
//!   `InFlight` with the lease time left. Expired lease → taken over with fence + 1.
//! - **renew / complete / release**: succeed only when the record is in flight with
//!   the presented fence; otherwise `Fenced` with the current fence. Complete stores
//!   the outcome and sets the record TTL; release deletes the record (see "Fences").
//!   Both `PUBLISH` the fence on `<key>:done` for waiters (see "Waiting" below).
//! - **tenant quotas**: on a single endpoint inside the claim, complete and release
//!   scripts; on a Cluster the account, tenant-complete and tenant-release scripts on
//!   the tenant's keys (see "Per-tenant quota").
//! - **read** (`get`, and `wait`'s polling): state, fence, lease time left.
//!
//! Lease expiry is judged with `redis.call('TIME')`, the Redis server's clock, so
//! instances whose clocks disagree agree on who holds a lease.
//!
//! # Decisions
//! - **Lifetimes.** A completed record lives for the TTL given to `complete`. An
//!   in-flight record's key expires one lease after its lease ends (`2 × lease`,
//!   pushed back by every renewal): a holder that stalled can still record its outcome
//!   while nobody took over, and a claim abandoned by a crashed instance costs memory
//!   for seconds, not a day. A released record is deleted at once.
//! - **Fences** start, for a new record, at the Redis server's `TIME` in microseconds
//!   (about 1.7e15 today; exact in Lua numbers until the year 2255) and grow by one on
//!   each takeover. Invariant: a fence handed out at server time `t` is at most `t` in
//!   microseconds (a takeover needs a lease to have ended, milliseconds after the fence
//!   it replaces). So a record created after an earlier one of the same scope was
//!   deleted (released) or expired starts above every fence the earlier one handed out,
//!   and a stale holder (one taken over, or one retrying a release whose reply was lost)
//!   can never present the new record's fence: its `renew`/`complete`/`release` is
//!   `Fenced`. Fences stay monotonic for the handler's own downstream guards as well.
//!   That is why release needs no tombstone. The argument assumes the Redis server's
//!   clock does not step back (keep it NTP-slewed); release checks it: if the clock is
//!   behind the released fence, it keeps a small tombstone (`s`, `f`) until the clock
//!   passes that fence, and the next claim starts above it. What the assumption still
//!   covers alone: records that expired, and a failover to a replica whose clock is
//!   behind by more than the time since the release.
//!
//!   A tombstone tied to the lease (kept for lease + margin) was considered and
//!   rejected: a live holder's late requests do arrive within its lease, but a paused
//!   process can come back at any time, so no TTL covers every stale holder; the clock
//!   does. And a tombstone per rejected call (about 250 bytes for as long as it lives)
//!   lets cheap failing calls fill `maxmemory`: at 1 000 rejected calls a second, a
//!   10-second tombstone is 2.5 MB. Deleting the record keeps a flood of rejected
//!   calls at zero bytes (`a_flood_of_released_claims_leaves_maxmemory_room_for_real_calls`
//!   in `tests/bounds.rs`: 10 000 claim + release under `maxmemory 2mb`, no key left,
//!   memory flat).
//! - **Per-tenant quota.** At most `maxInFlightPerTenant` (default 1000) records of
//!   one tenant are in flight at once, across every instance. Each tenant with calls in
//!   flight has a sorted set `<prefix>tenant:{<tenant hex>}`: one member per held claim
//!   (scope + fence), scored with its lease deadline on the server clock. On a single
//!   endpoint the claim script itself drops members whose lease ended and, for a claim
//!   it acquires, adds this one unless the tenant already holds its quota, before it
//!   writes the record; refused, nothing is written. On a Redis Cluster the tenant's
//!   set is in another slot, so a claim runs in two single-slot steps (which work
//!   wherever a record's key does, a Cluster proxy included): (1) the claim script on
//!   the record; (2) only if that acquired the record, the account script on the
//!   tenant's keys; over the quota, the record is released again (nothing ran). Either
//!   way the claim fails with `StoreError::Full` (RESOURCE_EXHAUSTED with a retry
//!   delay, never a second run). Renewal refreshes the member's deadline; complete and
//!   release remove it (in their own script on a single endpoint; beside it on a
//!   Cluster). Replays, in-flight duplicates and mismatches never reach the quota.
//!
//!   **Stored bytes** ([`RedisStoreBuilder::max_bytes_per_tenant`],
//!   `maxBytesPerTenant`, off by default): as in the memory store, a record is charged
//!   its stored response plus [`RECORD_OVERHEAD_BYTES`]; a new record that does not fit
//!   is refused (`Full`), a response that does not fit is recorded as not retained (the
//!   handler ran: a duplicate gets a clear error, never a second run). Each charge is a
//!   member of the tenant's sorted set `…:bytes`, scored with when it ends (the record's
//!   TTL; an in-flight record's `2 × lease`), its size in the hash `…:sizes` with their
//!   sum. Redis expires records on its own and tells nobody, so every script that reads
//!   the sum first drops the charges whose time has passed (at most 256 a call, oldest
//!   first; each is dropped once): an expired record never holds quota. A release takes
//!   its charge back at once; an operator's delete (`idem records delete`) leaves it
//!   until the record's TTL would have ended (the record does not name its tenant). On
//!   a Cluster the completion's tenant step runs before the record's (it decides
//!   whether the response is kept): one round trip more while the quota is on.
//!
//!   The counts are approximate and heal themselves; exactly-once never depends on
//!   them. A claim whose instance crashed, or whose complete never came, leaves the
//!   count when its lease ends (members are scored by lease deadline); the keys
//!   themselves expire a second after their last lease or charge. If a Cluster's
//!   tenant step cannot reach Redis the claim stands, uncounted (and a response stays
//!   kept, uncharged).
//! - **Same-claimant re-claim** extends the lease to `now + lease` (never shortens it).
//! - **Renew after the lease ran out** still succeeds while nobody has taken over: the
//!   fence is still current.
//! - **Durations** are sent in whole milliseconds, at least 1 ms and at most ten years.
//! - **Waiting.** [`wait`](idem_store::Store::wait) reads the record (state,
//!   fence, lease left) and returns as soon as it is no longer the same live claim.
//!   With [`WaitStrategy::Notify`] (the default) it first subscribes to
//!   `<prefix>{<scope hex>}:done`, which the complete and release scripts `PUBLISH` to,
//!   then reads again (so a completion between the first read and the subscription is
//!   not missed), and sleeps until a message, the next fallback poll (50 ms doubling to
//!   250 ms), one millisecond past the lease end, or `until`. One subscriber connection
//!   per store, opened on the first wait; subscriptions are reference-counted per
//!   record. If that connection drops, its waiters are woken and keep polling. With
//!   [`WaitStrategy::Poll`] it only polls (2 ms doubling to 50 ms). Lease expiry
//!   publishes nothing; both strategies wake at the lease end by themselves.
//!
//!   Measured on this machine (`wait_latency_notify_versus_poll` in `tests/redis.rs`,
//!   40 waits per strategy, completion 0–300 ms after the wait began): notify saw the
//!   completion 0.45 ms late on average (p50 0.24 ms) at 9.2 Redis commands per waited
//!   call; polling 25.7 ms late on average (p90 49 ms) at 11.5 commands (debug build;
//!   release: 0.18 ms against 26 ms). Notify is the
//!   default; polling is there for deployments where pub/sub is unavailable or
//!   restricted (some proxies and managed services).
//! - **Errors.** A command that times out (command timeout, default 500 ms) or fails
//!   on the connection, and server conditions that pass (`LOADING`, `OOM`, `READONLY`,
//!   cluster down…) are `StoreError::Unavailable`; a reply of the wrong shape, a key of
//!   the wrong type or a record missing a field is `StoreError::Corrupt`. Nothing in a
//!   reply can panic. The connection reconnects on its own (exponential backoff).
//!
//! # Round trips
//! On a single endpoint, a fresh protected call is 2 round trips: claim (with the
//! tenant's quotas in the same script) and complete (which takes the claim out of the
//! count in the same script). A replay: 1 (claim returns the outcome). On a Redis
//! Cluster the tenant's keys are in another slot: claim, account, complete (the
//! tenant's `ZREM` sent beside it) = 3 round trips (4 with `maxBytesPerTenant`, whose
//! tenant step must run before the completion), 2 without per-tenant quotas. Counted
//! from Redis's own `INFO commandstats` by `cargo bench --bench layers -- redis`. The
//! layer renews the lease every `leaseTtl / 3` while the handler runs; each renewal is
//! one more `EVALSHA` (two with a quota), so only handlers that run that long pay it.

mod builder;
mod check;
mod conn;
mod notify;
mod quota;
mod records;
mod replica;
mod reply;
mod scripts;
mod store;
mod tenant;

pub use builder::{
    ConnectError, DEFAULT_COMMAND_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_KEY_PREFIX,
    DEFAULT_MAX_IN_FLIGHT_PER_TENANT, DEFAULT_POLL_MAX, DEFAULT_POLL_MIN, NOTIFY_POLL_MAX,
    NOTIFY_POLL_MIN, RedisStoreBuilder, WaitStrategy,
};
pub use check::ServerReport;
pub use replica::ReplicaAcks;
pub use store::RedisStore;
pub use tenant::RECORD_OVERHEAD_BYTES;
