#!/usr/bin/env bash
# Redis store benchmark: floodgate's decisions/s with 64 callers against one local Redis, next
# to redis-benchmark -c 50 -P 16 running the same check script by EVALSHA, in one session;
# then p50/p99 latency at half of floodgate's throughput.
#
#   bash bench/redis_store.sh [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
for tool in redis-server redis-benchmark redis-cli; do
    command -v "$tool" >/dev/null || { echo "$tool is missing: apt-get install redis-server redis-tools" >&2; exit 1; }
done
cargo build --release -p floodgate --example redis_bench >/dev/null 2>&1
bench=target/release/examples/redis_bench

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile '' >/dev/null &
redis=$!
trap 'kill $redis 2>/dev/null || true' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
url="redis://127.0.0.1:$port"

# The exact script floodgate runs, loaded so that redis-benchmark can call it by EVALSHA.
sha=$("$bench" script | redis-cli -p "$port" -x SCRIPT LOAD)
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}')"
echo "script sha: $sha"

# Same token bucket: limit 10^9 per second, one key, server time.
echo "== redis-benchmark -c 50 -P 16, EVALSHA of the check script"
redis-benchmark -p "$port" -c 50 -P 16 -n $((seconds * 300000)) -q \
    EVALSHA "$sha" 1 'fg:{ip:bench}:r:bench' check '' token_bucket 1000000000 1000000 1000000000 1 1 '' \
    | tr '\r' '\n' | tail -n 2

for mode in multiplexed pool:16 pool:64; do
    echo "== floodgate RedisStore ($mode), 64 callers"
    "$bench" "$url" throughput "$mode" 64 "$seconds"
done

echo "== floodgate RedisStore (multiplexed) latency at half of its throughput"
full=$("$bench" "$url" throughput multiplexed 64 "$seconds" | awk '{print $1}')
"$bench" "$url" latency multiplexed 64 "$seconds" "$(python3 -c "print(int($full / 2))")"
