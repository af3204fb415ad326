//! Distributed exactness across OS processes: 4 processes × 32 tasks, each process with its own
//! connection, on one key of one redis-server, admit exactly the capacity, for every algorithm.
//!
//! A custom harness (`harness = false`): run without arguments it is the parent, which starts
//! redis-server and re-runs this same binary as the children.

mod support;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use floodgate::store::RedisStore;
use floodgate::{Algorithm, Check, Limit, Store, Timestamp};

const URL_VAR: &str = "FLOODGATE_TEST_REDIS_URL";
const ALGORITHM_VAR: &str = "FLOODGATE_TEST_ALGORITHM";
const PROCESSES: usize = 4;
const TASKS: usize = 32;
const CAPACITY: u64 = 10;
const NOW: Timestamp = Timestamp::from_secs(1_700_006_400);

fn limit(algorithm: Algorithm) -> Arc<Limit> {
    Arc::new(
        Limit::new(
            algorithm.as_str(),
            algorithm,
            CAPACITY,
            Duration::from_secs(3600),
        )
        .unwrap(),
    )
}

/// One process: `TASKS` tasks ask until denied; prints how many were admitted.
fn child(url: String, algorithm: Algorithm) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let admitted: u64 = runtime.block_on(async move {
        let store = RedisStore::builder(url)
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let limit = limit(algorithm);
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let (store, limit) = (store.clone(), limit.clone());
                tokio::spawn(async move {
                    let checks = [Check::new("fg:{ip:hot}:r:processes", limit, 1)];
                    let mut admitted = 0u64;
                    while store
                        .check_and_consume(&checks, Some(NOW))
                        .await
                        .unwrap()
                        .is_allowed()
                    {
                        admitted += 1;
                    }
                    admitted
                })
            })
            .collect();
        let mut admitted = 0;
        for task in tasks {
            admitted += task.await.unwrap();
        }
        admitted
    });
    println!("{admitted}");
}

fn main() {
    if let (Ok(url), Ok(algorithm)) = (std::env::var(URL_VAR), std::env::var(ALGORITHM_VAR)) {
        child(url, algorithm.parse().expect("an algorithm name"));
        return;
    }
    let mut server = support::RedisServer::start();
    let executable = std::env::current_exe().expect("this test's path");
    let (mut passed, mut failed) = (0, 0);
    for algorithm in Algorithm::ALL {
        let children: Vec<_> = (0..PROCESSES)
            .map(|_| {
                Command::new(&executable)
                    .env(URL_VAR, server.url())
                    .env(ALGORITHM_VAR, algorithm.as_str())
                    .output()
                    .expect("spawn a child process")
            })
            .collect();
        let admitted: u64 = children
            .iter()
            .map(|output| {
                assert!(
                    output.status.success(),
                    "child failed: {}",
                    String::from_utf8_lossy(&output.stderr)
                );
                String::from_utf8_lossy(&output.stdout)
                    .trim()
                    .parse::<u64>()
                    .expect("a count")
            })
            .sum();
        let expected = if algorithm == Algorithm::LeakyBucket {
            CAPACITY + 1
        } else {
            CAPACITY
        };
        if admitted == expected {
            passed += 1;
            println!("test {algorithm} across {PROCESSES} processes ... ok ({admitted} admitted)");
        } else {
            failed += 1;
            println!(
                "test {algorithm} across {PROCESSES} processes ... FAILED: {admitted} admitted, capacity {expected}"
            );
        }
        let _: () = server.command(&["FLUSHALL"]);
    }
    server.kill();
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}
