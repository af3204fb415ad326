//! The cluster-failover run of `bench/failover.sh`: a master of a 3-master, 1-replica proxied
//! Redis Cluster killed under load, in each mode; the errors, the error window, the time to
//! promotion, and what each identity was admitted against its limit.
//! `crates/floodgate-test-support/src/failover.rs` is the harness (and `tests/
//! partial_failures.rs` asserts on the same runs).
//!
//! `failover [MODE ...]` (exact, batched, hot-identities, global-ceiling; default all)

use floodgate_test_support::failover::{self, IdentityReport, Load, Mode};

/// `a/b/c` of the side's identities' admissions.
fn admitted(identities: &[&IdentityReport]) -> String {
    identities
        .iter()
        .map(|identity| identity.admitted().to_string())
        .collect::<Vec<_>>()
        .join("/")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut modes: Vec<Mode> = std::env::args()
        .skip(1)
        .map(|name| Mode::parse(&name).unwrap_or_else(|| panic!("unknown mode {name}")))
        .collect();
    if modes.is_empty() {
        modes = Mode::ALL.to_vec();
    }
    let load = Load::default();
    println!(
        "3 masters x 1 replica, every node behind a proxy, cluster-node-timeout 1000 ms; master 0 \
         killed after {:?} of load (writes paused until its replica caught up, then SIGKILL); load \
         {:?} after the promotion",
        load.before_kill, load.after_promotion
    );
    println!(
        "{} identities a side, {} tasks each, {} decisions/s an identity; limit {} an hour \
         (ceiling {}); store timeout {:?}, breaker 3 failures / 300 ms",
        load.identities_per_side,
        load.tasks_per_identity,
        load.rate_per_identity,
        load.limit,
        load.ceiling,
        load.timeout
    );
    println!(
        "{:<15} {:>10} {:>7} {:>11} {:>11} {:>13} {:>16} {:>16}",
        "mode",
        "promotion",
        "errors",
        "1st error",
        "last error",
        "error window",
        "healthy adm.",
        "killed adm."
    );
    for mode in modes {
        let report = failover::run(mode, load).await;
        let (first, last) = report.error_window().unwrap_or_default();
        let healthy: Vec<&IdentityReport> = report.side(false).collect();
        let killed: Vec<&IdentityReport> = report.side(true).collect();
        let healthy_errors: u64 = healthy.iter().map(|identity| identity.failed()).sum();
        println!(
            "{:<15} {:>9.2}s {:>7} {:>10.2}s {:>10.2}s {:>12.2}s {:>16} {:>16}",
            mode.name(),
            report.to_promotion().as_secs_f64(),
            report.failures().count(),
            first.as_secs_f64(),
            last.as_secs_f64(),
            (last - first).as_secs_f64(),
            admitted(&healthy),
            admitted(&killed),
        );
        if healthy_errors > 0 {
            println!("  {healthy_errors} errors on healthy-master identities");
        }
        if let Some((ceiling, admitted)) = report.ceiling {
            println!("  global ceiling: {admitted} admitted of {ceiling}");
        }
    }
}
