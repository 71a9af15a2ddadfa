//! Label values with a bounded set: `grpc.method` and `grpc.status`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use idem_core::config::ServiceConfig;
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
pub(crate) struct MethodCounters<T> {
    /// Read on a path's first call only (then `by_path` answers); written by
    /// [`add_method`](Self::add_method).
    methods: RwLock<MethodLabels>,
    /// Path → its label's counters; bounded (unknown paths past it look their label up).
    by_path: RwLock<FirstFew<String, Arc<PerMethod<T>>>>,
    /// Label → counters: the paths of one label (`"other"`) share them.
    by_label: RwLock<HashMap<String, Arc<PerMethod<T>>>>,
}

/// Most paths remembered by [`MethodCounters`].
const PATHS_MAX: usize = 2_000;

/// A map whose first [`FIRST_FEW`] keys are kept in a list and found by comparison,
/// the rest hashed: a service's few methods (and the few outcomes of one) are found
/// without hashing the key (SipHash, about 300 instructions for a method path), while
/// keys a caller makes up past them still cost no more than a hash lookup.
pub(crate) struct FirstFew<K, V> {
    first: Vec<(K, V)>,
    rest: HashMap<K, V>,
}

/// How many keys [`FirstFew`] keeps in its list.
const FIRST_FEW: usize = 16;

impl<K, V> Default for FirstFew<K, V> {
    fn default() -> Self {
        FirstFew {
            first: Vec::new(),
            rest: HashMap::new(),
        }
    }
}

impl<K: std::hash::Hash + Eq, V> FirstFew<K, V> {
    pub(crate) fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        match self.first.iter().find(|(k, _)| k.borrow() == key) {
            Some((_, v)) => Some(v),
            None if self.rest.is_empty() => None,
            None => self.rest.get(key),
        }
    }

    /// The value of `key`, inserted with `make` if absent.
    pub(crate) fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> &V {
        if let Some(i) = self.first.iter().position(|(k, _)| *k == key) {
            return &self.first[i].1;
        }
        if self.first.len() < FIRST_FEW && !self.rest.contains_key(&key) {
            self.first.push((key, make()));
            return &self.first[self.first.len() - 1].1;
        }
        self.rest.entry(key).or_insert_with(make)
    }

    pub(crate) fn len(&self) -> usize {
        self.first.len() + self.rest.len()
    }

    pub(crate) fn clear(&mut self) {
        self.first.clear();
        self.rest.clear();
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.first
            .iter()
            .map(|(k, v)| (k, v))
            .chain(self.rest.iter())
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
            by_path: RwLock::default(),
            by_label: RwLock::default(),
        }
    }

    /// Labels one more method by name, for its calls from now on.
    pub(crate) fn add_method(&self, method: &str) {
        write(&self.methods).add(method);
        // A path seen before keeps no stale label.
        write(&self.by_path).clear();
    }

    /// The counters of the call to `path`.
    pub(crate) fn of(&self, path: &str) -> Arc<PerMethod<T>> {
        if let Some(c) = read(&self.by_path).get(path) {
            return c.clone();
        }
        let label = read(&self.methods).of(path);
        let counts = write(&self.by_label)
            .entry(label.as_str().into_owned())
            .or_insert_with(|| {
                Arc::new(PerMethod {
                    method: KeyValue::new("grpc.method", label),
                    counts: T::default(),
                })
            })
            .clone();
        let mut by_path = write(&self.by_path);
        if by_path.len() < PATHS_MAX {
            by_path.get_or_insert_with(path.to_owned(), || counts.clone());
        }
        counts
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
pub(crate) struct Bound<T, const N: usize>([OnceLock<BoundHistogram<T>>; N]);

impl<T, const N: usize> Default for Bound<T, N> {
    fn default() -> Self {
        Bound([const { OnceLock::new() }; N])
    }
}

impl<T, const N: usize> Bound<T, N> {
    /// Records `value` on series `i`, binding it with `bind` the first time. An `i` past
    /// the table (a status code newer than this build) binds for this value alone.
    pub(crate) fn record(&self, i: usize, value: T, bind: impl FnOnce() -> BoundHistogram<T>) {
        match self.0.get(i) {
            Some(series) => series.get_or_init(bind).record(value),
            None => bind().record(value),
        }
    }
}

/// Series per `grpc.status`: codes 0 to 16.
pub(crate) const STATUS_COUNT: usize = 17;

/// The index of `code` in a [`Bound`] per status.
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

    #[test]
    fn first_few_finds_every_key_listed_or_hashed() {
        let mut m = FirstFew::<String, usize>::default();
        for i in 0..FIRST_FEW + 9 {
            assert_eq!(*m.get_or_insert_with(format!("/p.S/M{i}"), || i), i);
        }
        assert_eq!(m.len(), FIRST_FEW + 9);
        for i in 0..FIRST_FEW + 9 {
            assert_eq!(m.get(format!("/p.S/M{i}").as_str()), Some(&i));
            // Present: `make` is not called again, the first value stays.
            assert_eq!(
                *m.get_or_insert_with(format!("/p.S/M{i}"), || usize::MAX),
                i
            );
        }
        assert_eq!(m.get("/p.S/none"), None);
        assert_eq!(m.iter().count(), FIRST_FEW + 9);
        m.clear();
        assert_eq!((m.len(), m.get("/p.S/M0")), (0, None));
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
