//! Distributed exactness across OS processes: 4 processes × 32 tasks, each process with its own
//! connection, on one key of one redis-server, admit exactly the capacity, for every algorithm.
//!
//! A custom harness (`harness = false`): run without arguments it is the parent, which starts
//! redis-server and re-runs this same binary as the children. The children run at the same
//! time: each connects, says `ready`, and waits on its stdin until the parent has heard every
//! child ready and tells them all to go.

use floodgate_test_support as support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use floodgate::store::RedisStore;
use floodgate::{Algorithm, Limit, Store, store::Check, time::Timestamp};

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
        // Connected before the start signal, so that no child is still connecting when the
        // others run.
        let warm = [Check::new("fg:{ip:warm}:r:processes", limit.clone(), 0)];
        store.check_and_consume(&warm, Some(NOW)).await.unwrap();
        println!("ready");
        let mut go = String::new();
        std::io::stdin().read_line(&mut go).unwrap();
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
        let mut children: Vec<_> = (0..PROCESSES)
            .map(|_| {
                let mut child = Command::new(&executable)
                    .env(URL_VAR, server.url())
                    .env(ALGORITHM_VAR, algorithm.as_str())
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("spawn a child process");
                let lines = BufReader::new(child.stdout.take().unwrap()).lines();
                (child, lines)
            })
            .collect();
        for (_, lines) in &mut children {
            let ready = lines.next().expect("a line").expect("readable");
            assert_eq!(ready, "ready");
        }
        // Every child is connected and waiting: all start now.
        for (child, _) in &mut children {
            writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
        }
        let admitted: u64 = children
            .into_iter()
            .map(|(mut child, mut lines)| {
                let count = lines.next().expect("a count").expect("readable");
                assert!(child.wait().unwrap().success(), "child failed");
                count.trim().parse::<u64>().expect("a count")
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
