#!/usr/bin/env bash
# The fleet simulation: N batched nodes in one process (each with its own connection and its
# own trading task every 100 ms, as N gateways) against one real Redis, driven by the design
# notes' traffic shapes (uniform round-robin, 80% on one node, a client moving between nodes,
# a cold burst on every node at once) against a token bucket of 100/s (burst 100); prints what
# each admitted against its allowance (capacity + refill while the run lasted) and the script
# calls per node and interval. crates/floodgate-test-support/src/fleet.rs is the harness.
#
#   bash bench/fleet.sh [seconds per shape] [nodes ...]     (default: 10 s; 4 20 200)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
shift || true
command -v redis-server >/dev/null || { echo "redis-server is missing: apt-get install redis-server" >&2; exit 1; }
cargo build --release -p floodgate --example fleet >/dev/null 2>&1
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile '' >/dev/null &
redis=$!
trap 'kill $redis 2>/dev/null || true' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}')"
target/release/examples/fleet "redis://127.0.0.1:$port" "$seconds" "$@"
