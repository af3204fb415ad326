#!/usr/bin/env bash
# Several regions, one limit: three regions in one process, each with its own redis-server and
# gateways, a global redis-server behind a fault-injecting proxy per region (50 ms each way: a
# 100 ms round trip; the partition shape cuts the first region off for 5 s, then heals), a token bucket of
# 300/s (burst 300), the issue's shapes (concentrated, spread, moving, partition), traded
# shares (`store.region`) beside fixed ones (`store.share`: each region 1/3, no global store)
# on the same setup and load (fresh servers for each run). Prints the table BENCHMARKS.md keeps, and each region's share
# and admissions second by second. crates/floodgate-test-support/src/regions.rs is the harness.
#
#   bash bench/regions.sh [seconds per shape] [gateways per region]     (default: 10 s; 2)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v redis-server >/dev/null || { echo "redis-server is missing: apt-get install redis-server" >&2; exit 1; }
cargo build --release -p floodgate --example regions >/dev/null 2>&1
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}'), commit $(git rev-parse --short HEAD)"
target/release/examples/regions "${1:-10}" "${2:-2}"
