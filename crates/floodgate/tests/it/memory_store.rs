//! The memory store under real concurrency, and its memory under rotating keys.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use floodgate::{
    Algorithm, Limit, MemoryStore, Store, store::Check, time::FakeClock, time::Timestamp,
};

const START: Timestamp = Timestamp::from_secs(1_700_006_400);

fn capacity_limit(algorithm: Algorithm) -> Arc<Limit> {
    // 1000 per hour: nothing refills during the test, so exactly 1000 may pass.
    Arc::new(
        Limit::new(
            algorithm.as_str(),
            algorithm,
            1000,
            Duration::from_secs(3600),
        )
        .unwrap(),
    )
}

#[test]
fn many_threads_on_one_key_admit_exactly_the_capacity() {
    for algorithm in Algorithm::ALL {
        let clock = FakeClock::new(START);
        let store = MemoryStore::builder().clock(clock).build();
        let checks = Arc::new([Check::new("fg:{ip:hot}:r:x", capacity_limit(algorithm), 1)]);
        let admitted = Arc::new(AtomicU64::new(0));
        let threads = 8;
        let start_line = Arc::new(Barrier::new(threads));
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (store, checks, admitted, start_line) = (
                    store.clone(),
                    checks.clone(),
                    admitted.clone(),
                    start_line.clone(),
                );
                std::thread::spawn(move || {
                    start_line.wait();
                    for _ in 0..500 {
                        if store.check_and_consume_now(&checks[..], None).is_allowed() {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for handle in handles {
            handle.join().unwrap();
        }
        // A leaky bucket admits one request to leave now plus a queue of `burst`.
        let capacity = if algorithm == Algorithm::LeakyBucket {
            1001
        } else {
            1000
        };
        assert_eq!(admitted.load(Ordering::Relaxed), capacity, "{algorithm}");
    }
}

/// A single GCRA limit on a key that exists is decided by compare-and-swap under the shard's
/// shared lock; a request with several limits on the same key holds the lock exclusively. Mixed
/// on one hot key, they must still count every admission exactly once, and a request denied by
/// its second limit must not charge the first.
#[test]
fn single_and_multi_limit_requests_on_one_gcra_key_count_exactly() {
    let store = MemoryStore::builder().clock(FakeClock::new(START)).build();
    let hot = capacity_limit(Algorithm::Gcra);
    let narrow = Arc::new(Limit::gcra("narrow", 300, Duration::from_secs(3600)).unwrap());
    let single = Arc::new([Check::new("fg:{ip:hot}:r:gcra", hot.clone(), 1)]);
    let double = Arc::new([
        Check::new("fg:{ip:hot}:r:gcra", hot, 1),
        Check::new("fg:{ip:hot}:r:narrow", narrow, 1),
    ]);
    let threads = 8;
    let start_line = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|thread| {
            let (store, single, double, start_line) = (
                store.clone(),
                single.clone(),
                double.clone(),
                start_line.clone(),
            );
            std::thread::spawn(move || {
                let checks: &[Check] = if thread % 2 == 0 {
                    &single[..]
                } else {
                    &double[..]
                };
                start_line.wait();
                (0..400)
                    .filter(|_| store.check_and_consume_now(checks, None).is_allowed())
                    .count()
            })
        })
        .collect();
    let admitted: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let by_double: usize = admitted.iter().skip(1).step_by(2).sum();
    let total: usize = admitted.iter().sum();
    // 3,200 requests for 1,000: the hot limit is spent exactly, and no two-limit request got
    // past the narrow one's 300.
    assert_eq!(total, 1000, "{admitted:?}");
    assert!(by_double <= 300, "{admitted:?}");
    let left = store.peek_now(&single[..], None);
    assert_eq!(left.limits()[0].remaining, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tasks_on_one_key_admit_exactly_the_capacity() {
    let store = Arc::new(MemoryStore::builder().clock(FakeClock::new(START)).build());
    // Two limits per request, on different shards, to exercise multi-shard locking too.
    let checks: Arc<[Check]> = Arc::new([
        Check::new("fg:{ip:hot}:r:a", capacity_limit(Algorithm::Gcra), 1),
        Check::new(
            "fg:{global}:r:b",
            capacity_limit(Algorithm::SlidingWindowCounter),
            1,
        ),
    ]);
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (store, checks) = (store.clone(), checks.clone());
            tokio::spawn(async move {
                let mut admitted = 0u64;
                for _ in 0..40 {
                    let decision = store.check_and_consume(&checks, None).await.unwrap();
                    admitted += u64::from(decision.is_allowed());
                    tokio::task::yield_now().await;
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    assert_eq!(admitted, 1000);
}

#[test]
fn keys_still_in_use_survive_eviction() {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let limit = Arc::new(Limit::fixed_window("hourly", 5, Duration::from_secs(3600)).unwrap());
    let checks = [Check::new("fg:{ip:a}:r:hourly", limit, 1)];
    for _ in 0..5 {
        store.check_and_consume_now(&checks, None);
    }
    clock.advance(Duration::from_secs(60));
    assert_eq!(store.evict_expired(), 0);
    assert!(
        !store.check_and_consume_now(&checks, None).is_allowed(),
        "state was kept"
    );
}

#[tokio::test(start_paused = true)]
async fn background_eviction_returns_memory_without_traffic() {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .evict_every(Duration::from_secs(10))
        .build();
    let limit = Arc::new(Limit::gcra("per-second", 10, Duration::from_secs(1)).unwrap());
    for client in 0..1000 {
        let checks = [Check::new(
            format!("fg:{{ip:{client}}}:r:l"),
            limit.clone(),
            1,
        )];
        store.check_and_consume_now(&checks, None);
    }
    assert_eq!(store.len(), 1000);
    clock.advance(Duration::from_secs(5));
    // Paused tokio time: advancing runs the eviction task's due ticks deterministically.
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert!(store.is_empty());
}
