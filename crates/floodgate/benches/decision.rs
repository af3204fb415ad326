//! Time per decision of each algorithm on the memory store, next to governor's keyed limiter
//! measured in the same run.
//!
//! `cargo bench -p floodgate --bench decision`. Results and the machine are in BENCHMARKS.md.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_main};
use floodgate::{Algorithm, Limit, MemoryStore, Store, store::Check, store::Lease};
use governor::{Quota, RateLimiter};

/// High enough that nothing is denied during a run: the admitted path is what is measured.
const LIMIT: u64 = 1_000_000_000;
const KEY_COUNTS: [usize; 2] = [1, 100_000];

fn key(index: usize) -> String {
    format!("fg:{{ip:{index:032x}}}:default:per-second")
}

fn checks_for(algorithm: Algorithm, keys: usize) -> Vec<[Check; 1]> {
    let window = Duration::from_secs(1);
    // The log keeps one entry per admitted request; a small limit and a short window keep
    // its memory bounded during the run (it then denies, which costs the same scan).
    let limit = match algorithm {
        Algorithm::SlidingWindowLog => Limit::new("l", algorithm, 100, window),
        Algorithm::Concurrency => Limit::new("l", algorithm, LIMIT, Duration::from_millis(1)),
        _ => Limit::new("l", algorithm, LIMIT, window),
    };
    let limit = Arc::new(limit.unwrap());
    (0..keys)
        .map(|index| [Check::new(key(index), limit.clone(), 1)])
        .collect()
}

/// Runs `per_thread` on `threads` threads, `iterations` calls in all; returns the wall time.
fn on_threads(threads: usize, iterations: u64, per_thread: impl Fn(usize, u64) + Sync) -> Duration {
    let share = iterations / threads as u64;
    let started = Instant::now();
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let per_thread = &per_thread;
            scope.spawn(move || per_thread(thread, share));
        }
    });
    started.elapsed()
}

fn algorithms(c: &mut Criterion) {
    for &keys in &KEY_COUNTS {
        for threads in [1usize, 2] {
            let mut group = c.benchmark_group(format!("decision/{keys}-keys/{threads}-threads"));
            group.throughput(Throughput::Elements(1));
            group.measurement_time(Duration::from_secs(3));
            group.warm_up_time(Duration::from_secs(1));

            let quota = Quota::per_second(NonZeroU32::new(u32::MAX).unwrap());
            let governor = RateLimiter::<String, _, _>::keyed(quota);
            let governor_keys: Vec<String> = (0..keys).map(key).collect();
            group.bench_function(BenchmarkId::from_parameter("governor-keyed"), |b| {
                b.iter_custom(|iterations| {
                    on_threads(threads, iterations, |thread, count| {
                        let mut index = thread * 7919;
                        for _ in 0..count {
                            index = (index + 1) % keys;
                            black_box(governor.check_key(&governor_keys[index]).is_ok());
                        }
                    })
                })
            });

            for algorithm in Algorithm::ALL {
                let store = MemoryStore::new();
                let checks = checks_for(algorithm, keys);
                group.bench_function(BenchmarkId::from_parameter(algorithm.as_str()), |b| {
                    b.iter_custom(|iterations| {
                        on_threads(threads, iterations, |thread, count| {
                            let mut index = thread * 7919;
                            for _ in 0..count {
                                index = (index + 1) % keys;
                                let (outcome, lease) = store.check_one(&checks[index][0], None);
                                black_box(outcome.allowed);
                                // Concurrency leases are released as a finished response would.
                                if let Some(id) = lease {
                                    let key = checks[index][0].key.clone();
                                    // The memory store releases during the call; its future is already complete.
                                    drop(Store::release(&store, vec![Lease { key, id, cost: 1 }]));
                                }
                            }
                        })
                    })
                });
            }

            // The full `Decision` (binding limit, statuses) the layer works with.
            let store = MemoryStore::new();
            let checks = checks_for(Algorithm::TokenBucket, keys);
            group.bench_function(BenchmarkId::from_parameter("token_bucket-decision"), |b| {
                b.iter_custom(|iterations| {
                    on_threads(threads, iterations, |thread, count| {
                        let mut index = thread * 7919;
                        for _ in 0..count {
                            index = (index + 1) % keys;
                            black_box(
                                store
                                    .check_and_consume_now(&checks[index], None)
                                    .is_allowed(),
                            );
                        }
                    })
                })
            });

            // The same token bucket through the async `Store` trait the layer uses.
            let store = MemoryStore::new();
            let checks = checks_for(Algorithm::TokenBucket, keys);
            group.bench_function(BenchmarkId::from_parameter("token_bucket-via-trait"), |b| {
                b.iter_custom(|iterations| {
                    on_threads(threads, iterations, |thread, count| {
                        let mut context = Context::from_waker(Waker::noop());
                        let mut index = thread * 7919;
                        for _ in 0..count {
                            index = (index + 1) % keys;
                            let mut future = store.check_and_consume(&checks[index], None);
                            match future.as_mut().poll(&mut context) {
                                Poll::Ready(decision) => black_box(decision.unwrap().is_allowed()),
                                Poll::Pending => unreachable!("the memory store never waits"),
                            };
                        }
                    })
                })
            });
            group.finish();
        }
    }
}

// criterion's macro generates an undocumented function.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::algorithms);
}
use group::benches;
criterion_main!(benches);
