//! The store conformance suite against the memory store.

use crate::conformance;

use floodgate::MemoryStore;

async fn fresh_store() -> MemoryStore {
    MemoryStore::new()
}

conformance_suite!(fresh_store());
