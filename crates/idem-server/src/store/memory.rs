//! The in-memory store (being written: issue 4).

/// The embedded default store.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {}
