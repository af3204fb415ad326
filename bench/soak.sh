#!/usr/bin/env bash
# Soak: two gateways on one Redis side by side, exact and batched, for MINUTES (default 30)
# under mixed traffic (steady clients, denied abusers, rotating identities, concurrency leases
# on a slow route; see crates/floodgate-gateway/examples/soak_driver.rs), while their
# configuration is reloaded every 5 s, Redis is restarted every 60 s and its client connections
# are killed (CLIENT KILL) every 25 s. Every 10 s it samples each gateway's RSS, descriptors,
# threads, p99 and 5xx; at the end it prints the samples and whether each stayed flat.
# Not part of scripts/test.sh (it is long).
#
#   bash bench/soak.sh [minutes]
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-30}
for tool in redis-server redis-cli curl python3; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install redis-server redis-tools curl python3)" >&2; exit 1; }
done
cargo build --release -p floodgate-gateway --bin floodgate --example soak_driver >/dev/null 2>&1
source bench/common.sh

redis_port=$(free_port)
start_redis() {
    redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
        --daemonize yes --logfile "$work/redis.log" --pidfile "$work/redis.pid" >/dev/null
    for _ in $(seq 50); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && return 0; sleep 0.1; done
    echo "redis did not start" >&2; exit 1
}
stop_redis() { redis-cli -p "$redis_port" shutdown nosave >/dev/null 2>&1 || true; }
trap 'stop_redis; cleanup' EXIT
start_redis

upstream_port=$(free_port)
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}'), $minutes minutes"

# The configuration of gateway $1 ($2: its store section, $3: extra endpoint limits), with the
# per-second limit $4 (the reloads alternate it, so that each one applies new text).
write_config() { # name store endpoints limit
    local file="$work/$1.yaml"
    cat > "$file.tmp" <<YAML
listen: "127.0.0.1:${ports[$1]}"
admin: { listen: "127.0.0.1:${admins[$1]}" }
upstream: "http://127.0.0.1:$upstream_port"
$2
on_store_error: open
plans:
  anonymous:
    limits: [ { name: per-second, algorithm: token_bucket, limit: 20, window: 1s } ]
  free:
    limits:
      - { name: per-second, algorithm: token_bucket, limit: $4, window: 1s }
      - { name: per-minute, algorithm: fixed_window, limit: 100000, window: 60s }
$3
YAML
    mv "$file.tmp" "$file"
}
declare -A ports admins stores endpoints
for name in exact batched; do ports[$name]=$(free_port); admins[$name]=$(free_port); done
stores[exact]="store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\", timeout: 50ms }"
stores[batched]="store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\", timeout: 50ms, sync_interval: 100ms, max_keys: 300 }"
# Concurrency leases need an exact store; the batched gateway counts the slow route instead.
endpoints[exact]='    endpoints:
      "GET /slow": [ { name: slow, algorithm: concurrency, limit: 2, window: 30s } ]'
endpoints[batched]='    endpoints:
      "GET /slow": [ { name: slow, algorithm: sliding_window_counter, limit: 50, window: 1s } ]'

targets=()
for name in exact batched; do
    write_config "$name" "${stores[$name]}" "${endpoints[$name]}" 20
    RUST_LOG=warn target/release/floodgate serve --config "$work/$name.yaml" >/dev/null 2>"$work/$name.log" &
    pid=$!; pids+=("$pid")
    for _ in $(seq 100); do curl -fs "http://127.0.0.1:${admins[$name]}/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
    targets+=("$name=http://127.0.0.1:${ports[$name]}@$pid")
done

# The operator's side: reloads, Redis restarts, killed connections.
(
    limit=20
    for second in $(seq 1 $((minutes * 60))); do
        sleep 1
        if (( second % 5 == 0 )); then
            limit=$(( limit == 20 ? 21 : 20 ))
            for name in exact batched; do write_config "$name" "${stores[$name]}" "${endpoints[$name]}" "$limit"; done
        fi
        if (( second % 60 == 30 )); then stop_redis; sleep 0.2; start_redis; fi
        if (( second % 25 == 0 )); then
            redis-cli -p "$redis_port" CLIENT KILL TYPE normal SKIPME yes >/dev/null 2>&1 || true
        fi
    done
) &
operator=$!
pids+=("$operator")
restarts_expected=$(( (minutes * 60 + 30) / 60 ))

status=0
target/release/examples/soak_driver "127.0.0.1:$upstream_port" "$minutes" "${targets[@]}" || status=$?
echo "redis restarts: $restarts_expected scheduled, $(grep -c 'Ready to accept connections' "$work/redis.log" || true) starts in its log"
for name in exact batched; do
    reloads=$(curl -fs "http://127.0.0.1:${admins[$name]}/metrics" | grep '^floodgate_config_reloads_total' | tr '\n' ' ' || true)
    echo "$name: ${reloads:-no reloads counted}; ERROR log lines: $(grep -c 'ERROR' "$work/$name.log" || true)"
done
exit "$status"
