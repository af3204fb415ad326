#!/usr/bin/env bash
# Envoy rate limit service benchmark (issue 16): ShouldRateLimit calls/s against one floodgate
# (memory store, then one local Redis) from the gRPC load client `rls_load`, next to
# redis-benchmark -c 50 -P 16 running floodgate's check script by EVALSHA on the same Redis,
# in one session. The domain's one descriptor is a token bucket of 10^9/s (every call admitted
# and written), the same script and arguments as bench/redis_store.sh.
#
#   bash bench/rls.sh [seconds] [callers]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
callers=${2:-64}
for tool in redis-server redis-benchmark redis-cli; do
    command -v "$tool" >/dev/null || { echo "$tool is missing: apt-get install redis-server redis-tools" >&2; exit 1; }
done
cargo build --release -p floodgate-gateway --bin floodgate --example rls_load >/dev/null 2>&1
cargo build --release -p floodgate --example redis_bench >/dev/null 2>&1
load=target/release/examples/rls_load
source bench/common.sh

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile '' >/dev/null &
pids+=($!)
for _ in $(seq 50); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.1; done
sha=$(target/release/examples/redis_bench script | redis-cli -p "$redis_port" -x SCRIPT LOAD)
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}')"

mkdir -p "$work/rls"
cat > "$work/rls/bench.yaml" <<YAML
domain: bench
descriptors:
  - key: client
    algorithm: token_bucket
    rate_limit: { unit: second, requests_per_unit: 1000000000 }
YAML

start_rls() { # store-yaml
    local port admin rls; port=$(free_port); admin=$(free_port); rls=$(free_port)
    cat > "$work/floodgate-$rls.yaml" <<YAML
listen: "127.0.0.1:$port"
admin: { listen: "127.0.0.1:$admin" }
rls: { listen: "127.0.0.1:$rls", config_dir: "$work/rls" }
$1
YAML
    RUST_LOG=warn target/release/floodgate serve --config "$work/floodgate-$rls.yaml" >/dev/null 2>"$work/floodgate-$rls.log" &
    pids+=($!)
    wait_for "http://127.0.0.1:$admin/healthz"
    rls_port=$rls
}

echo "== redis-benchmark -c 50 -P 16, EVALSHA of the check script"
redis-benchmark -p "$redis_port" -c 50 -P 16 -n $((seconds * 300000)) -q \
    EVALSHA "$sha" 1 'fg:{rls:bench}:bench:client' check '' token_bucket 1000000000 1000000 1000000000 1 1 '' \
    | tr '\r' '\n' | tail -n 2

start_rls "store: { backend: memory }"
echo "== floodgate RLS, memory store, $callers callers on 4 connections"
"$load" "127.0.0.1:$rls_port" "$callers" 4 "$seconds"

start_rls "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\" }"
echo "== floodgate RLS, Redis store, $callers callers on 4 connections"
"$load" "127.0.0.1:$rls_port" "$callers" 4 "$seconds"
