//! Tests of `idem.memoryStore` and `idem.redis`.

use std::time::Duration;

use serde_json::{Value, json};

use crate::config::fixtures::*;
use crate::config::*;

#[test]
fn idem_memory_store() {
    let (s, _) = settings(
        json!({"memoryStore": {"maxEntries": 10, "maxBytes": 4096, "maxInFlightPerTenant": 2,
               "maxEntriesPerTenant": 5, "maxBytesPerTenant": 2048, "sweepInterval": "0.5s",
               "minRetention": "90s"}}),
    )
    .unwrap();
    assert_eq!(
        s.memory_store,
        MemoryStoreSettings {
            max_entries: 10,
            max_bytes: 4096,
            max_in_flight_per_tenant: Some(2),
            max_entries_per_tenant: Some(5),
            max_bytes_per_tenant: Some(2048),
            sweep_interval: Duration::from_millis(500),
            min_retention: Duration::from_secs(90),
        }
    );
    // minRetention: 2 minutes by default; zero (evict any completed record at a
    // bound) is allowed.
    let (s, _) = settings(json!({"memoryStore": {}})).unwrap();
    assert_eq!(s.memory_store.min_retention, Duration::from_secs(120));
    let (s, w) = settings(json!({"memoryStore": {"minRetention": "0s"}})).unwrap();
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(s.memory_store.min_retention, Duration::ZERO);
    let (s, _) = settings(json!({"memoryStore": {"minRetention": "86400s"}})).unwrap();
    assert_eq!(s.memory_store.min_retention, Duration::from_secs(86_400));
    // Absent per-tenant bounds are a share of the store-wide ones.
    let (s, w) = settings(json!({"memoryStore": {"maxEntries": 1600, "maxBytes": 4096}})).unwrap();
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(
        (
            s.memory_store.tenant_in_flight_bound(),
            s.memory_store.tenant_entries_bound(),
            s.memory_store.tenant_bytes_bound()
        ),
        (100, 400, 1024)
    );
    // The retired tombstoneTtl and per-tenant bounds above the store's are warnings.
    let (s, w) = settings(json!({"memoryStore": {"maxEntries": 10, "maxEntriesPerTenant": 20, "tombstoneTtl": "60s"}})).unwrap();
    assert_eq!(s.memory_store.tenant_entries_bound(), 10);
    assert_eq!(
        w,
        vec![
            "idem.memoryStore.tombstoneTtl: no longer used: a released record is removed, and \
             an in-flight record whose lease ended is dropped one lease later"
                .to_owned(),
            "idem.memoryStore.maxEntriesPerTenant: is above the store-wide bound (10); the \
             store-wide bound applies"
                .to_owned(),
        ]
    );
    let (s, _) = settings(json!({"memoryStore": {"maxEntries": 10}})).unwrap();
    assert_eq!(
        s.memory_store.max_bytes,
        MemoryStoreSettings::default().max_bytes
    );
    // The largest bounds that can be allocated are accepted.
    let (s, _) = settings(json!({"memoryStore": {"maxEntries": 4_294_967_296_u64,
        "maxBytes": 281_474_976_710_656_u64, "sweepInterval": "0.001s"}}))
    .unwrap();
    assert_eq!(s.memory_store.max_entries, 1 << 32);
    assert_eq!(s.memory_store.sweep_interval, Duration::from_millis(1));
    let bad = [
        (
            json!({"maxEntries": 0}),
            "idem.memoryStore.maxEntries: must be an integer > 0",
        ),
        (
            json!({"maxBytes": -1}),
            "idem.memoryStore.maxBytes: must be an integer > 0",
        ),
        (
            json!({"sweepInterval": "0s"}),
            "idem.memoryStore.sweepInterval: must be a duration > 0",
        ),
        (
            json!({"sweepInterval": "0.0005s"}),
            "idem.memoryStore.sweepInterval: must be at least 0.001s: tokio's timers tick in \
             milliseconds",
        ),
        (
            json!({"maxEntries": 4_294_967_297_u64}),
            "idem.memoryStore.maxEntries: must be at most 4294967296: a bound no process can \
             reach bounds nothing",
        ),
        (
            json!({"maxBytes": 281_474_976_710_657_u64}),
            "idem.memoryStore.maxBytes: must be at most 281474976710656 (the address space \
             of this machine's processes): a bound no process can reach bounds nothing",
        ),
        (
            json!({"minRetention": "-1s"}),
            "idem.memoryStore.minRetention: must be a proto3 JSON duration such as \"1.5s\": must not have a sign",
        ),
        (
            json!({"minRetention": 600}),
            "idem.memoryStore.minRetention: must be a duration string such as \"1.5s\", not a number",
        ),
    ];
    assert_settings_errors("memoryStore", &bad);
}

#[test]
fn idem_redis() {
    let (s, _) = settings(json!({"redis": {"url": "redis://127.0.0.1:6379/0"}})).unwrap();
    assert_eq!(
        s.redis,
        Some(RedisSettings {
            url: "redis://127.0.0.1:6379/0".into(),
            key_prefix: "idem:".into(),
            command_timeout: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(2),
            max_in_flight_per_tenant: Some(1000),
            max_bytes_per_tenant: None,
            cluster_nodes: vec![],
            replica_acks: 0,
            replica_ack_timeout: Duration::from_millis(100),
        })
    );
    let quota = |v: serde_json::Value| {
        settings(json!({"redis": {"url": "redis://c", "maxInFlightPerTenant": v}}))
            .map(|(s, _)| s.redis.unwrap().max_in_flight_per_tenant)
    };
    assert_eq!(quota(json!(16)), Ok(Some(16)));
    assert_eq!(quota(json!(0)), Ok(None), "0: no per-tenant bound");
    assert_eq!(
        quota(json!(-1)),
        Err(vec![
            "idem.redis.maxInFlightPerTenant: must be an integer >= 0 (0: no per-tenant bound)"
                .to_owned()
        ])
    );
    let bytes = |v: serde_json::Value| {
        settings(json!({"redis": {"url": "redis://c", "maxBytesPerTenant": v}}))
            .map(|(s, _)| s.redis.unwrap().max_bytes_per_tenant)
    };
    assert_eq!(bytes(json!(1 << 20)), Ok(Some(1 << 20)));
    assert_eq!(bytes(json!(0)), Ok(None), "0: no per-tenant bound");
    assert_eq!(
        bytes(json!("1MiB")),
        Err(vec![
            "idem.redis.maxBytesPerTenant: must be an integer >= 0 (0: no per-tenant bound) \
             (a JSON number, not a string)"
                .to_owned()
        ])
    );
    let (s, _) = settings(json!({"redis": {"url": "rediss://cache:6380", "keyPrefix": "shop:", "commandTimeout": "0.2s", "connectTimeout": "1s"}})).unwrap();
    let r = s.redis.unwrap();
    assert_eq!(
        (r.key_prefix.as_str(), r.command_timeout, r.connect_timeout),
        ("shop:", Duration::from_millis(200), Duration::from_secs(1))
    );
    let url_rule = "must be a redis://, rediss://, redis+unix:// or unix:// URL";
    let bad = [
        (
            json!({}),
            format!("idem.redis.url: is required (or clusterNodes) and {url_rule}"),
        ),
        (
            json!({"url": "http://cache"}),
            format!("idem.redis.url: {url_rule}"),
        ),
        (
            json!({"url": "redis://"}),
            format!("idem.redis.url: {url_rule}"),
        ),
        (
            json!({"url": "redis://c", "commandTimeout": "0s"}),
            "idem.redis.commandTimeout: must be a duration > 0".to_owned(),
        ),
        (
            json!({"url": "redis://c", "keyPrefix": 1}),
            "idem.redis.keyPrefix: must be a string, not a number".to_owned(),
        ),
        (
            json!({"url": "redis://c", "clusterNodes": ["redis://a:7000"]}),
            "idem.redis.url: must not be given with clusterNodes (one endpoint, or a cluster)"
                .to_owned(),
        ),
        (
            json!({"clusterNodes": []}),
            "idem.redis.clusterNodes: must be a non-empty array of redis:// URLs (Redis Cluster seed nodes)"
                .to_owned(),
        ),
        (
            json!({"clusterNodes": ["redis://a:7000", "unix:///tmp/s"]}),
            "idem.redis.clusterNodes[1]: must be a redis:// or rediss:// URL".to_owned(),
        ),
        (
            json!({"url": "redis://c", "replicaAcks": -1}),
            "idem.redis.replicaAcks: must be an integer in 0..=1000 (0: no confirmation)"
                .to_owned(),
        ),
        (
            json!({"url": "redis://c", "replicaAcks": 1, "replicaAckTimeout": "0.5s"}),
            "idem.redis.replicaAckTimeout: must be shorter than commandTimeout (WAIT runs within a command)"
                .to_owned(),
        ),
    ];
    assert_settings_errors("redis", &bad);
    // Two bad nodes: both named.
    assert_eq!(
        settings(json!({"redis": {"clusterNodes": ["http://a", "redis://b:1", 7]}})),
        Err(vec![
            "idem.redis.clusterNodes[0]: must be a redis:// or rediss:// URL".to_owned(),
            "idem.redis.clusterNodes[2]: must be a redis:// or rediss:// URL".to_owned(),
        ])
    );
    let (s, _) = settings(json!({"redis": {"clusterNodes": ["redis://10.0.0.1:7000", "rediss://10.0.0.2:7000"], "replicaAcks": 1, "replicaAckTimeout": "0.05s"}})).unwrap();
    let r = s.redis.unwrap();
    assert_eq!(r.url, "");
    assert_eq!(
        r.cluster_nodes,
        vec!["redis://10.0.0.1:7000", "rediss://10.0.0.2:7000"]
    );
    assert_eq!(
        (r.replica_acks, r.replica_ack_timeout),
        (1, Duration::from_millis(50))
    );
}

#[test]
fn a_single_tenant_gets_the_whole_store() {
    let whole = |s: &MemoryStoreSettings| {
        (
            s.tenant_in_flight_bound(),
            s.tenant_entries_bound(),
            s.tenant_bytes_bound(),
        )
    };
    let (s, w) = settings(json!({"tenant": {"single": "shop"}})).unwrap();
    assert!(w.is_empty(), "{w:?}");
    let m = &s.memory_store;
    assert_eq!(whole(m), (m.max_entries, m.max_entries, m.max_bytes));
    // Explicit shares stay; the others are the store's (in-flight within the records).
    let (s, _) = settings(json!({
        "tenant": {"single": "shop"},
        "memoryStore": {"maxEntries": 1000, "maxBytes": 4096, "maxEntriesPerTenant": 10}
    }))
    .unwrap();
    assert_eq!(whole(&s.memory_store), (10, 10, 4096));
    // Several tenants (a header, or a resolver set in code): a share each.
    for tenant in [json!({"header": "x-tenant"}), json!(null)] {
        let doc = match tenant {
            Value::Null => json!({"memoryStore": {"maxEntries": 1600, "maxBytes": 4096}}),
            t => json!({"tenant": t, "memoryStore": {"maxEntries": 1600, "maxBytes": 4096}}),
        };
        let (s, _) = settings(doc).unwrap();
        assert_eq!(whole(&s.memory_store), (100, 400, 1024));
    }
    // In code: the same widening.
    let code = MemoryStoreSettings {
        max_bytes_per_tenant: Some(7),
        ..MemoryStoreSettings::default()
    }
    .for_single_tenant();
    assert_eq!(
        whole(&code),
        (code.max_entries, code.max_entries, 7),
        "{code:?}"
    );
}
