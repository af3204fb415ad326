#!/usr/bin/env bash
# Layer overhead: the same axum hello-world plain, behind floodgate's RateLimitLayer (memory
# store, peer IP) and behind its peer tower_governor 0.8 (headers on, peer IP), under the same
# loopback wrk load, rotating through the three in each round of one session. Prints
# requests/s and latency per run, then each round's ratios and their medians.
#
#   bash bench/layer_overhead.sh [duration-seconds] [connections] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-8}
connections=${2:-64}
rounds=${3:-7}
command -v wrk >/dev/null || { echo "wrk is missing: apt-get install wrk" >&2; exit 1; }
cargo build --release -p floodgate --example overhead >/dev/null 2>&1
server=target/release/examples/overhead
results=$(mktemp)
trap 'rm -f "$results"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

run() { # round mode
    local port; port=$(free_port)
    "$server" "$2" "$port" & local pid=$!
    for _ in $(seq 50); do curl -fs "http://127.0.0.1:$port/" >/dev/null 2>&1 && break; sleep 0.1; done
    wrk -t1 -c"$connections" -d"${duration}s" --latency "http://127.0.0.1:$port/" > "/tmp/overhead-$2.txt"
    kill "$pid"; wait "$pid" 2>/dev/null || true
    local rps p50 p99
    rps=$(awk '/Requests\/sec/ {print $2}' "/tmp/overhead-$2.txt")
    p50=$(awk '$1=="50%" {print $2}' "/tmp/overhead-$2.txt")
    p99=$(awk '$1=="99%" {print $2}' "/tmp/overhead-$2.txt")
    printf 'round %s %-9s %12s req/s   p50 %8s   p99 %8s\n' "$1" "$2" "$rps" "$p50" "$p99"
    echo "$1 $2 $rps" >> "$results"
}

echo "wrk -t1 -c$connections -d${duration}s, $rounds rounds, server: tokio multi-thread on $(nproc) cores, loopback"
modes=(plain limited governor)
for round in $(seq "$rounds"); do
    # Rotate the order so that no mode always runs first (or last) in a round.
    for offset in 0 1 2; do
        run "$round" "${modes[$(( (round + offset) % 3 ))]}"
    done
done

python3 - "$results" <<'PY'
import statistics, sys
rates = {}
for line in open(sys.argv[1]):
    round_, mode, rps = line.split()
    rates.setdefault(int(round_), {})[mode] = float(rps)
vs_governor, vs_plain, governor_vs_plain = [], [], []
print("round  floodgate/tower_governor  floodgate/plain  tower_governor/plain")
for round_, r in sorted(rates.items()):
    vs_governor.append(r["limited"] / r["governor"])
    vs_plain.append(r["limited"] / r["plain"])
    governor_vs_plain.append(r["governor"] / r["plain"])
    print(f"{round_:>5}  {vs_governor[-1]:>24.2f}  {vs_plain[-1]:>15.2f}  {governor_vs_plain[-1]:>20.2f}")
print(f"median {statistics.median(vs_governor):>23.2f}  {statistics.median(vs_plain):>15.2f}  {statistics.median(governor_vs_plain):>20.2f}")
PY
