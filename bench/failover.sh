#!/usr/bin/env bash
# The cluster-failover run: a master of a 3-master, 1-replica Redis Cluster (every node behind
# a fault proxy, cluster-node-timeout 1000 ms) killed under load, in exact mode, batched mode,
# with hot identities and under a global ceiling; prints the errors, the time from the first
# error to the last, the time to promotion, and what each identity was admitted against its
# limit (healthy-master and killed-master identities apart).
# crates/floodgate-test-support/src/failover.rs is the harness.
#
#   bash bench/failover.sh [MODE ...]     (exact batched hot-identities global-ceiling; default all)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v redis-server >/dev/null || { echo "redis-server is missing: apt-get install redis-server" >&2; exit 1; }
cargo build --release -p floodgate --example failover >/dev/null 2>&1
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}')"
"${CARGO_TARGET_DIR:-target}"/release/examples/failover "$@"
