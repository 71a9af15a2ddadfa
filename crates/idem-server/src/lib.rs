//! Server half of idem (being written: issue 4).

pub mod store;
