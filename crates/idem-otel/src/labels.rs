//! Label values with a bounded set: `grpc.method` and `grpc.status`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};

use idem_core::config::ServiceConfig;
pub(crate) use idem_core::striped::{STRIPES, Striped, stripe};
use opentelemetry::metrics::BoundHistogram;
use opentelemetry::{KeyValue, Value};
use tonic::Code;

/// `grpc.method` label of a method the config does not name.
pub const OTHER: &str = "other";

/// Most distinct method labels a client learns from service-level names.
const LEARNED_MAX: usize = 1_000;

/// Which method paths get their own `grpc.method` label; every other one is `"other"`.
#[derive(Debug)]
pub(crate) struct MethodLabels {
    /// `/pkg.Service/Method` → `pkg.Service/Method`.
    exact: HashMap<String, Value>,
    /// Services whose every method is labelled (client side only).
    services: HashSet<String>,
    learned: Learned,
}

/// Label values learned as they come, up to a bound; `"other"` beyond it.
#[derive(Debug)]
pub(crate) struct Learned {
    most: usize,
    values: RwLock<HashMap<String, Arc<str>>>,
    other: Arc<str>,
}

impl Learned {
    /// At most `most` distinct values.
    pub(crate) fn new(most: usize) -> Self {
        Learned {
            most,
            values: RwLock::default(),
            other: Arc::from(OTHER),
        }
    }

    /// The label of `name`: itself while fewer than the bound have been seen.
    pub(crate) fn of(&self, name: &str) -> Arc<str> {
        if let Some(v) = self
            .values
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
        {
            return v.clone();
        }
        let mut values = self.values.write().unwrap_or_else(PoisonError::into_inner);
        if values.len() >= self.most {
            return self.other.clone();
        }
        let v = Arc::<str>::from(name);
        values.insert(name.to_owned(), v.clone());
        v
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.values.read().unwrap().len()
    }
}

impl MethodLabels {
    /// The methods `config` names exactly; with `by_service`, also every method of the
    /// services it names (a client calls only methods compiled into it; a server must
    /// not, or a caller could make a label per made-up method name).
    pub(crate) fn from_config(config: &ServiceConfig, by_service: bool) -> Self {
        let mut labels = MethodLabels {
            exact: HashMap::new(),
            services: HashSet::new(),
            learned: Learned::new(LEARNED_MAX),
        };
        for name in config.method_configs().iter().flat_map(|m| m.names()) {
            match (&name.service, &name.method) {
                (Some(s), Some(m)) => labels.add(&format!("{s}/{m}")),
                (Some(s), None) if by_service => {
                    labels.services.insert(s.clone());
                }
                _ => {}
            }
        }
        labels
    }

    /// Labels `pkg.Service/Method` (with or without its leading `/`) by its name.
    pub(crate) fn add(&mut self, method: &str) {
        let name = method.trim_start_matches('/');
        let value = Value::from(Arc::<str>::from(name));
        self.exact.insert(format!("/{name}"), value);
    }

    /// The `grpc.method` value of the call to `path`.
    pub(crate) fn of(&self, path: &str) -> Value {
        if let Some(v) = self.exact.get(path) {
            return v.clone();
        }
        let service = path.trim_start_matches('/').split_once('/').map(|(s, _)| s);
        if !service.is_some_and(|s| self.services.contains(s)) {
            return Value::from(OTHER);
        }
        Value::from(self.learned.of(&path[1..]))
    }
}

/// Counters kept here per `grpc.method` label and read by the SDK at each collection
/// (observable counters): an SDK counter update hashes its attributes (about 1,400
/// instructions), a lookup here by the call's path and an atomic add cost a fraction,
/// and a counter loses nothing by being read late.
///
/// A call finds its path's counters without a lock and without touching a reference
/// count (both would write to memory every worker thread shares, once per call).
pub(crate) struct MethodCounters<T> {
    /// Read on a path's first call only (then `by_path` answers); written by
    /// [`add_method`](Self::add_method).
    methods: RwLock<MethodLabels>,
    /// Path → its label's counters, with the [`epoch`](Self::epoch) they were looked up
    /// in; bounded (unknown paths past it look their label up).
    by_path: FirstFew<Box<str>, (u64, Arc<PerMethod<T>>)>,
    /// Bumped by [`add_method`](Self::add_method): paths remembered before it are looked
    /// up again, so none keeps a stale label.
    epoch: AtomicU64,
    /// Label → counters: the paths of one label (`"other"`) share them.
    by_label: RwLock<HashMap<String, Arc<PerMethod<T>>>>,
}

/// Most paths remembered by [`MethodCounters`].
const PATHS_MAX: usize = 2_000;

/// A map whose first [`FIRST_FEW`] keys sit in slots set once and read without a lock,
/// found by comparison; the rest are hashed behind a lock. A service's few methods (and
/// the few outcomes of one) are found with a load and a compare each: no hashing (SipHash,
/// about 300 instructions for a method path) and no lock (a write to memory every worker
/// thread shares, once per call); keys a caller makes up past them cost a hash lookup
/// under a read lock, as a plain map would. Keys are never removed.
pub(crate) struct FirstFew<K, V> {
    first: [OnceLock<(K, V)>; FIRST_FEW],
    /// Used once every slot is taken.
    rest: RwLock<HashMap<K, Arc<V>>>,
}

/// How many keys [`FirstFew`] keeps in slots.
const FIRST_FEW: usize = 16;

impl<K, V> Default for FirstFew<K, V> {
    fn default() -> Self {
        FirstFew {
            first: [const { OnceLock::new() }; FIRST_FEW],
            rest: RwLock::default(),
        }
    }
}

impl<K: std::hash::Hash + Eq, V> FirstFew<K, V> {
    /// Calls `f` with the value of `key`, inserting `make()` (the owned key and its value)
    /// if it is absent and `insert` allows; `None` if it is absent and may not be added.
    pub(crate) fn with<Q, R>(
        &self,
        key: &Q,
        make: impl FnOnce() -> (K, V),
        insert: impl FnOnce(usize) -> bool,
        f: impl FnOnce(&V) -> R,
    ) -> Option<R>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        let mut make = Some(make);
        for slot in &self.first {
            // Slots fill in order, and each is set once, by whoever comes first: a caller
            // that finds another key in a slot it tried to fill moves on with its own.
            let (k, v) = match slot.get() {
                Some(kv) => kv,
                None => {
                    slot.get_or_init(|| make.take().expect("taken only by the slot it filled")())
                }
            };
            if k.borrow() == key {
                return Some(f(v));
            }
        }
        if let Some(v) = read(&self.rest).get(key).cloned() {
            return Some(f(&v));
        }
        let mut rest = write(&self.rest);
        let v = match rest.get(key) {
            Some(v) => v.clone(),
            None if insert(FIRST_FEW + rest.len()) => {
                let (k, v) = make.take().expect("not taken: every slot held another key")();
                rest.entry(k).or_insert(Arc::new(v)).clone()
            }
            None => return None,
        };
        drop(rest);
        Some(f(&v))
    }

    /// How many keys are held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.first.iter().take_while(|s| s.get().is_some()).count() + read(&self.rest).len()
    }

    /// Calls `f` with every key and value.
    pub(crate) fn each(&self, mut f: impl FnMut(&K, &V)) {
        for (k, v) in self.first.iter().map_while(OnceLock::get) {
            f(k, v);
        }
        for (k, v) in read(&self.rest).iter() {
            f(k, v);
        }
    }
}

/// One method label's counters.
pub(crate) struct PerMethod<T> {
    /// `grpc.method`.
    pub(crate) method: KeyValue,
    pub(crate) counts: T,
}

impl<T: Default> MethodCounters<T> {
    pub(crate) fn new(methods: MethodLabels) -> Self {
        MethodCounters {
            methods: RwLock::new(methods),
            by_path: FirstFew::default(),
            epoch: AtomicU64::new(0),
            by_label: RwLock::default(),
        }
    }

    /// Labels one more method by name, for its calls from now on.
    pub(crate) fn add_method(&self, method: &str) {
        write(&self.methods).add(method);
        self.epoch.fetch_add(1, Ordering::Relaxed);
    }

    /// Calls `f` with the counters of the call to `path`.
    pub(crate) fn with<R>(&self, path: &str, f: impl FnOnce(&PerMethod<T>) -> R) -> R {
        let epoch = self.epoch.load(Ordering::Relaxed);
        let mut f = Some(f);
        let found = self.by_path.with(
            path,
            || (path.into(), (epoch, self.lookup(path))),
            |held| held < PATHS_MAX,
            |(seen, counts)| match *seen == epoch {
                true => Some(f.take().expect("called once")(counts)),
                false => None,
            },
        );
        match found.flatten() {
            Some(r) => r,
            // Unknown past the bound, or remembered before the last `add_method`.
            None => f.take().expect("not called")(&self.lookup(path)),
        }
    }

    /// The counters of `path`'s label, made if new.
    fn lookup(&self, path: &str) -> Arc<PerMethod<T>> {
        let label = read(&self.methods).of(path);
        write(&self.by_label)
            .entry(label.as_str().into_owned())
            .or_insert_with(|| {
                Arc::new(PerMethod {
                    method: KeyValue::new("grpc.method", label),
                    counts: T::default(),
                })
            })
            .clone()
    }

    /// Every label's counters, for a collection.
    pub(crate) fn each(&self, mut f: impl FnMut(&PerMethod<T>)) {
        for c in read(&self.by_label).values() {
            f(c);
        }
    }
}

pub(crate) fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

/// `N` histogram series of one instrument, each bound to its attribute set at its first
/// recording: a recording on a bound series skips the SDK's per-call attribute hashing
/// and lookup. Bound lazily, so a series that never gets a value is never exported.
///
/// Values reach the SDK in batches: a thread appends to its own stripe's buffer and
/// hands the buffer over once it holds [`BATCH`] values; [`flush`](Self::flush) hands
/// over the rest, and the metrics call it from their observable instruments' callbacks,
/// which the SDK runs at every collection before it reads any instrument (and when
/// dropped). A bound series takes a mutex inside the SDK for each value: fed one value
/// at a time from two worker threads, its cache lines move between the cores at every
/// call.
pub(crate) struct BoundSeries<T, const N: usize> {
    series: [OnceLock<BoundHistogram<T>>; N],
    pending: [Unflushed<T>; STRIPES],
}

/// One stripe's values not yet handed to the SDK: series index and value.
#[repr(align(128))]
struct Unflushed<T>(Mutex<Vec<(u8, T)>>);

/// Values a thread buffers per [`BoundSeries`] before it hands them to the SDK.
const BATCH: usize = 64;

impl<T, const N: usize> Default for BoundSeries<T, N> {
    fn default() -> Self {
        const { assert!(N <= 256, "series indices are kept in a u8") };
        BoundSeries {
            series: [const { OnceLock::new() }; N],
            pending: std::array::from_fn(|_| Unflushed(Mutex::default())),
        }
    }
}

impl<T, const N: usize> BoundSeries<T, N> {
    /// Records `value` on series `i`, binding it with `bind` the first time. An `i` past
    /// the table (a status code newer than this build) binds for this value alone.
    pub(crate) fn record(&self, i: usize, value: T, bind: impl FnOnce() -> BoundHistogram<T>) {
        let (Some(series), Ok(index)) = (self.series.get(i), u8::try_from(i)) else {
            return bind().record(value);
        };
        series.get_or_init(bind);
        let mut pending = lock(&self.pending[stripe()].0);
        if pending.capacity() == 0 {
            pending.reserve_exact(BATCH);
        }
        pending.push((index, value));
        if pending.len() >= BATCH {
            self.hand_over(&mut pending);
        }
    }

    /// Hands every buffered value to the SDK.
    pub(crate) fn flush(&self) {
        for p in &self.pending {
            self.hand_over(&mut lock(&p.0));
        }
    }

    fn hand_over(&self, pending: &mut Vec<(u8, T)>) {
        for (i, value) in pending.drain(..) {
            if let Some(series) = self.series[usize::from(i)].get() {
                series.record(value);
            }
        }
    }
}

impl<T, const N: usize> Drop for BoundSeries<T, N> {
    fn drop(&mut self) {
        self.flush();
    }
}

/// `m`, locked (a panic while it was held leaves nothing half-done here).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Series per `grpc.status`: codes 0 to 16.
pub(crate) const STATUS_COUNT: usize = 17;

/// The index of `code` in a [`BoundSeries`] per status.
pub(crate) fn status_index(code: Code) -> usize {
    usize::try_from(code as i32).unwrap_or(usize::MAX)
}

/// `grpc.status`: the code's canonical name (`UNAVAILABLE`).
pub(crate) fn status(code: Code) -> KeyValue {
    KeyValue::new("grpc.status", idem_core::code::code_name(code))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// The value of `key` in `m`, inserted as `value` if new.
    fn get_or_insert(m: &FirstFew<String, usize>, key: &str, value: usize) -> usize {
        m.with(key, || (key.to_owned(), value), |_| true, |v| *v)
            .expect("insert allowed")
    }

    #[test]
    fn first_few_finds_every_key_in_slots_or_hashed() {
        let m = FirstFew::<String, usize>::default();
        for i in 0..FIRST_FEW + 9 {
            assert_eq!(get_or_insert(&m, &format!("/p.S/M{i}"), i), i);
        }
        assert_eq!(m.len(), FIRST_FEW + 9);
        for i in 0..FIRST_FEW + 9 {
            // Present: `make` is not called again, the first value stays.
            assert_eq!(get_or_insert(&m, &format!("/p.S/M{i}"), usize::MAX), i);
        }
        // Absent and not allowed in: nothing is called, nothing is added.
        let none = m.with(
            "/p.S/none",
            || unreachable!(),
            |_| false,
            |_| unreachable!(),
        );
        assert_eq!((none, m.len()), (None::<()>, FIRST_FEW + 9));
        let mut seen = Vec::new();
        m.each(|k, v| seen.push((k.clone(), *v)));
        seen.sort_by_key(|(_, v)| *v);
        let want: Vec<_> = (0..FIRST_FEW + 9)
            .map(|i| (format!("/p.S/M{i}"), i))
            .collect();
        assert_eq!(seen, want);
    }

    #[test]
    fn first_few_keeps_one_value_per_key_when_threads_race() {
        let m = FirstFew::<String, usize>::default();
        let made = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..4 {
                let (m, made) = (&m, &made);
                s.spawn(move || {
                    for i in 0..FIRST_FEW * 2 {
                        let key = format!("/p.S/M{}", (i + t * 3) % (FIRST_FEW * 2));
                        m.with(
                            &key,
                            || (key.clone(), made.fetch_add(1, Ordering::Relaxed)),
                            |_| true,
                            |_| (),
                        );
                    }
                });
            }
        });
        assert_eq!(m.len(), FIRST_FEW * 2);
        // Each key was made once: a racer that loses a slot never calls its `make`, and
        // none is called for a key already there.
        assert_eq!(made.load(Ordering::Relaxed), FIRST_FEW * 2);
    }

    #[test]
    fn a_path_seen_before_a_new_method_label_gets_the_new_label() {
        let config = ServiceConfig::from_json(r#"{"methodConfig": []}"#).unwrap();
        let counters = MethodCounters::<Striped<1>>::new(MethodLabels::from_config(&config, false));
        let label = |path| {
            counters.with(path, |m| {
                m.counts.add(0);
                m.method.value.clone()
            })
        };
        assert_eq!(label("/a.B/C"), Value::from(OTHER));
        counters.add_method("a.B/C");
        assert_eq!(label("/a.B/C"), Value::from("a.B/C"));
        assert_eq!(label("/a.B/C"), Value::from("a.B/C"));
        let mut counts = Vec::new();
        counters.each(|m| counts.push((m.method.value.to_string(), m.counts.get(0))));
        counts.sort();
        assert_eq!(counts, [("a.B/C".to_owned(), 2), (OTHER.to_owned(), 1)]);
    }

    #[test]
    fn paths_past_the_bound_are_counted_under_their_label() {
        let config = ServiceConfig::from_json(r#"{"methodConfig": []}"#).unwrap();
        let counters = MethodCounters::<Striped<1>>::new(MethodLabels::from_config(&config, false));
        for i in 0..PATHS_MAX + 10 {
            counters.with(&format!("/made.Up/M{i}"), |m| m.counts.add(0));
        }
        assert_eq!(counters.by_path.len(), PATHS_MAX);
        let mut total = 0;
        counters.each(|m| total += m.counts.get(0));
        assert_eq!(total, PATHS_MAX as u64 + 10);
    }

    /// The count of every series of the one histogram a collection of `provider` holds.
    fn counts(
        provider: &opentelemetry_sdk::metrics::SdkMeterProvider,
        exporter: &opentelemetry_sdk::metrics::InMemoryMetricExporter,
    ) -> Vec<u64> {
        use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
        exporter.reset();
        provider.force_flush().unwrap();
        let all = exporter.get_finished_metrics().unwrap();
        let mut counts = Vec::new();
        for m in all
            .iter()
            .flat_map(|rm| rm.scope_metrics())
            .flat_map(|s| s.metrics())
        {
            if let AggregatedMetrics::F64(MetricData::Histogram(h)) = m.data() {
                counts.extend(h.data_points().map(|p| p.count()));
            }
        }
        counts.sort_unstable();
        counts
    }

    #[test]
    fn bound_series_hand_over_full_batches_at_once_and_the_rest_when_flushed_or_dropped() {
        use opentelemetry::metrics::MeterProvider as _;
        use opentelemetry_sdk::metrics::{
            InMemoryMetricExporter, PeriodicReader, SdkMeterProvider,
        };
        let exporter = InMemoryMetricExporter::default();
        let reader = PeriodicReader::builder(exporter.clone()).build();
        let provider = SdkMeterProvider::builder().with_reader(reader).build();
        let histogram = provider.meter("t").f64_histogram("h").build();
        let bound = BoundSeries::<f64, 2>::default();
        let histogram = &histogram;
        let bind = |i: usize| move || histogram.bind(&[KeyValue::new("i", i as i64)]);
        // From 3 threads: 3 full batches on series 0, and 10 values left in buffers.
        std::thread::scope(|s| {
            for t in 0..3 {
                let bound = &bound;
                s.spawn(move || {
                    for v in 0..BATCH {
                        bound.record(0, v as f64, bind(0));
                    }
                    if t == 0 {
                        for v in 0..10 {
                            bound.record(1, v as f64, bind(1));
                        }
                    }
                });
            }
        });
        // Whole batches are in the SDK already; series 1 is bound but its values wait.
        assert_eq!(counts(&provider, &exporter), [0, 3 * BATCH as u64]);
        bound.flush();
        assert_eq!(counts(&provider, &exporter), [10, 3 * BATCH as u64]);
        // An index past the table is recorded at once, on a series of its own.
        bound.record(7, 1.0, bind(7));
        bound.record(1, 1.0, bind(1));
        assert_eq!(counts(&provider, &exporter), [1, 10, 3 * BATCH as u64]);
        drop(bound);
        assert_eq!(counts(&provider, &exporter), [1, 11, 3 * BATCH as u64]);
    }

    #[test]
    fn only_named_methods_get_a_label() {
        let config = ServiceConfig::from_json(
            r#"{"methodConfig": [
                {"name": [{"service": "a.B", "method": "C"}], "timeout": "1s"},
                {"name": [{"service": "x.Y"}], "timeout": "1s"},
                {"name": [{}], "timeout": "1s"}]}"#,
        )
        .unwrap();
        let server = MethodLabels::from_config(&config, false);
        assert_eq!(server.of("/a.B/C"), Value::from("a.B/C"));
        assert_eq!(server.of("/x.Y/Z"), Value::from(OTHER));
        assert_eq!(server.of("/q.R/S"), Value::from(OTHER));
        let client = MethodLabels::from_config(&config, true);
        assert_eq!(client.of("/x.Y/Z"), Value::from("x.Y/Z"));
        for i in 0..2 * LEARNED_MAX {
            client.of(&format!("/x.Y/M{i}"));
        }
        assert_eq!(client.learned.len(), LEARNED_MAX);
        assert_eq!(client.of("/x.Y/M999999"), Value::from(OTHER));
    }
}
