#!/usr/bin/env bash
# Envoy's Rate Limit Quota Service (issue 46, SPEC §10a): ENVOYS emulated Envoys reporting
# every 5 s (as Envoy's filter does) to two floodgate servers sharing one Redis, BUCKETS
# per-user buckets of LIMIT per second (burst BURST), each requested by ENVOYS_PER_BUCKET
# Envoys (10 by default; one at 5x the others, together twice the limit), for SECONDS. Prints the client's figures (see
# crates/floodgate-gateway/examples/rlqs_bench.rs), the servers' CPU per report, and memory
# per bucket (the servers' RSS and Redis' used_memory near the run's end, against idle).
#
#   bash bench/rlqs.sh [SECONDS] [ENVOYS] [BUCKETS] [BURST] [LIMIT] [ENVOYS_PER_BUCKET]
#   MODE=rls bash bench/rlqs.sh ...    the same demand and limits through ShouldRateLimit, one
#                                      call per request (the same rule in an RLS domain file)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}; envoys=${2:-100}; buckets=${3:-1000}
limit=${5:-10}; burst=${4:-10}; per_bucket=${6:-10}
for tool in redis-server redis-cli curl; do
    command -v "$tool" >/dev/null || { echo "$tool is missing: apt-get install redis-server redis-tools curl" >&2; exit 1; }
done
cargo build --release -p floodgate-gateway --bin floodgate --example rlqs_bench >/dev/null 2>&1
source bench/common.sh
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}'), $(date -u +%FT%TZ), $(git rev-parse --short HEAD)"
echo "run: ${MODE:-rlqs}, $seconds s, $envoys Envoys, $buckets buckets of $limit/s (burst $burst), $per_bucket Envoys per bucket"

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile '' >/dev/null &
pids+=($!)
for _ in $(seq 50); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.1; done

servers=(); admins=(); server_pids=()
for _ in 1 2; do
    rls=$(free_port); admin=$(free_port); listen=$(free_port)
    mkdir -p "$work/rls-$rls"
    cat > "$work/rls-$rls/bench.yaml" <<YAML
domain: bench
descriptors:
  - key: user
    rate_limit: { unit: second, requests_per_unit: $limit }
    algorithm: token_bucket
    burst: $burst
YAML
    cat > "$work/floodgate-$rls.yaml" <<YAML
listen: "127.0.0.1:$listen"
admin: { listen: "127.0.0.1:$admin" }
store: { backend: redis, url: "redis://127.0.0.1:$redis_port" }
rls:
  listen: "127.0.0.1:$rls"
  config_dir: rls-$rls
  quota:
    domains:
      bench:
        - { name: per_user, bucket: { name: user, user: "*" }, limit: { limit: $limit, window: 1s, burst: $burst } }
YAML
    RUST_LOG=warn target/release/floodgate serve --config "$work/floodgate-$rls.yaml" >/dev/null 2>"$work/floodgate-$rls.log" &
    pids+=($!); server_pids+=($!)
    wait_for "http://127.0.0.1:$admin/healthz"
    servers+=("127.0.0.1:$rls"); admins+=("$admin")
done

cpu_ticks() { local total=0; for pid in "${server_pids[@]}"; do total=$((total + $(awk '{print $14 + $15}' "/proc/$pid/stat"))); done; echo "$total"; }
rss_kib() { local total=0; for pid in "${server_pids[@]}"; do total=$((total + $(awk '/VmRSS/ {print $2}' "/proc/$pid/status"))); done; echo "$total"; }
redis_bytes() { redis-cli -p "$redis_port" info memory | awk -F: '/^used_memory:/ {print $2+0}'; }
reports() { local total=0; for admin in "${admins[@]}"; do
    total=$((total + $(curl -fs "http://127.0.0.1:$admin/metrics" | awk '/^floodgate_rlqs_reports_total/ {sum += $2} END {print sum + 0}'))); done; echo "$total"; }

idle_rss=$(rss_kib); idle_redis=$(redis_bytes); cpu_before=$(cpu_ticks); reports_before=$(reports)
target/release/examples/rlqs_bench "$(IFS=,; echo "${servers[*]}")" "$seconds" "$envoys" "$buckets" "$per_bucket" "$limit" "$burst" "${MODE:-rlqs}" > "$work/client.json" &
client=$!
sleep "$(python3 -c "print($seconds * 0.9)")"
busy_rss=$(rss_kib); busy_redis=$(redis_bytes)
wait "$client"
cpu_after=$(cpu_ticks); reports_after=$(reports)
hz=$(getconf CLK_TCK)
echo "client: $(cat "$work/client.json")"
python3 - "$cpu_before" "$cpu_after" "$hz" "$reports_before" "$reports_after" "$idle_rss" "$busy_rss" "$idle_redis" "$busy_redis" "$buckets" "$per_bucket" <<'PY'
import sys
cpu0, cpu1, hz, r0, r1, rss0, rss1, red0, red1, buckets, per_bucket = map(float, sys.argv[1:])
reports = r1 - r0
cpu = (cpu1 - cpu0) / hz
print(f"servers: {reports:.0f} bucket reports, {cpu:.2f} s of CPU: {cpu / max(reports, 1) * 1e6:.1f} us per bucket report")
holdings = buckets * per_bucket
print(f"memory: servers' RSS +{(rss1 - rss0):.0f} KiB for {holdings:.0f} holdings ({(rss1 - rss0) * 1024 / holdings:.0f} B each); "
      f"Redis +{(red1 - red0) / 1024:.0f} KiB for {buckets:.0f} limits ({(red1 - red0) / buckets:.0f} B per limit)")
PY
