#!/usr/bin/env bash
# Layer overhead: the same axum hello-world with and without RateLimitLayer, under the same
# loopback wrk load, alternating runs in one session. Prints requests/s and latency per run.
#
#   bash bench/layer_overhead.sh [duration-seconds] [connections]
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-10}
connections=${2:-64}
command -v wrk >/dev/null || { echo "wrk is missing: apt-get install wrk" >&2; exit 1; }
cargo build --release -p floodgate --example overhead >/dev/null 2>&1
server=target/release/examples/overhead

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

run() { # mode
    local port; port=$(free_port)
    "$server" "$1" "$port" & local pid=$!
    for _ in $(seq 50); do curl -fs "http://127.0.0.1:$port/" >/dev/null 2>&1 && break; sleep 0.1; done
    wrk -t1 -c"$connections" -d"${duration}s" --latency "http://127.0.0.1:$port/" > "/tmp/overhead-$1.txt"
    kill "$pid"; wait "$pid" 2>/dev/null || true
    local rps p50 p99
    rps=$(awk '/Requests\/sec/ {print $2}' "/tmp/overhead-$1.txt")
    p50=$(awk '$1=="50%" {print $2}' "/tmp/overhead-$1.txt")
    p99=$(awk '$1=="99%" {print $2}' "/tmp/overhead-$1.txt")
    printf '%-8s %12s req/s   p50 %8s   p99 %8s\n' "$1" "$rps" "$p50" "$p99"
}

echo "wrk -t1 -c$connections -d${duration}s, server: tokio multi-thread on $(nproc) cores, loopback"
for round in 1 2 3; do
    run plain
    run limited
done
