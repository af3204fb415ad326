#!/usr/bin/env bash
# The fault-schedule checker on N random schedules: each a fresh fleet (exact, batched, cluster
# exact or batched, sharded or regions, by the seed) against real redis-server processes, a FaultProxy in front of
# every Redis link, a mixed workload (four algorithms, costs 1 to 4, a limit every decision names,
# refunds after the response) and random faults from the seed (late replies, answers dropped
# after Redis applied the call, black holes, Redis restarted empty, the global store restored
# from an older snapshot, a region partitioned, a batched node restarted, a cluster master killed
# and its replica promoted). Every decision is checked afterwards: never
# above the limit. Prints a line per schedule, the summary (schedules, faults per kind,
# decisions checked, violations), and for each violation the command that replays its seed.
# crates/floodgate-test-support/src/chaos.rs is the harness; CI runs seeds 1 to 24.
#
#   bash bench/chaos.sh [N] [first seed]      (default: 100 schedules from a random seed)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v redis-server >/dev/null || { echo "redis-server is missing: apt-get install redis-server" >&2; exit 1; }
count="${1:-100}"
from="${2:-$(( (RANDOM << 15 | RANDOM) + 1000 ))}"
echo "machine: $(nproc) cores, redis $(redis-server --version | awk '{print $3}'), commit $(git rev-parse --short HEAD); seeds $from to $((from + count - 1))"
FLOODGATE_CHAOS_COUNT="$count" FLOODGATE_CHAOS_FROM="$from" \
    cargo test --release -p floodgate --test it chaos:: -- --nocapture 2>&1 \
    | grep -E '^(seed |schedules|faults injected|decisions checked|violations|  replay|time:)'
