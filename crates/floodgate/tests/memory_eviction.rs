//! Memory under a million rotating keys. Alone in its test binary: the allocator counts every
//! thread's bytes, so no other test may run beside it.

use std::alloc::System;
use std::sync::Arc;
use std::time::Duration;

use cap::Cap;
use floodgate::{Limit, MemoryStore, store::Check, time::FakeClock, time::Timestamp};

/// Counts live heap bytes, so the test measures the store rather than guessing.
#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

fn live_bytes() -> isize {
    ALLOCATOR.allocated() as isize
}

const START: Timestamp = Timestamp::from_secs(1_700_006_400);

#[test]
fn a_million_rotating_keys_are_evicted_once_idle() {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        // Only the explicit sweep below evicts, so the peak is measured.
        .sweep_interval(Duration::from_secs(3600))
        .build();
    let limit = Arc::new(Limit::token_bucket("per-second", 10, Duration::from_secs(1)).unwrap());
    let baseline = live_bytes();

    let keys = 1_000_000;
    let mut checks = vec![Check::new("", limit.clone(), 1)];
    for client in 0..keys {
        checks[0] = Check::new(
            format!("fg:{{ip:{client:016x}}}:default:per-second"),
            limit.clone(),
            1,
        );
        assert!(store.check_and_consume_now(&checks, None).is_allowed());
    }
    drop(checks);
    assert_eq!(store.len(), keys);
    let peak = live_bytes() - baseline;
    assert!(
        peak > 50 * keys as isize,
        "the keys are really held: {peak} bytes"
    );

    // Idle for longer than it takes each bucket to refill: every key is now fresh.
    clock.advance(Duration::from_secs(2));
    assert_eq!(store.evict_expired(), keys);
    assert!(store.is_empty());
    let after = live_bytes() - baseline;
    eprintln!("memory store: {peak} bytes for {keys} keys, {after} bytes after eviction");
    assert!(
        after < 256 * 1024,
        "{after} bytes still held after eviction (peak {peak})"
    );
}
