#!/usr/bin/env bash
# Scale-out benchmark, in one session:
#  1. the gateway on the memory store, on Redis exact, and on Redis batched (sync_interval 100ms),
#     under the same wrk load (one client: its IP is one identity), with the Redis script calls
#     each run cost, per decision;
#  2. RedisStore decisions/s on one Redis node next to a 3-master Redis Cluster (64 callers, each
#     its own identity, so the cluster spreads them over its masters).
#
#   bash bench/scale_out.sh [seconds] [connections]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
connections=${2:-64}
for tool in wrk redis-server redis-cli; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install wrk redis-server)" >&2; exit 1; }
done
cargo build --release -p floodgate-gateway -p floodgate --example overhead --example redis_bench --bin floodgate >/dev/null 2>&1
source bench/common.sh
start_redis() { # port [extra args...]
    local port=$1; shift
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile '' "$@" >/dev/null & pids+=($!)
    for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && return 0; sleep 0.1; done
    echo "redis on $port did not start" >&2; exit 1
}
script_calls() { # port
    redis-cli -p "$1" INFO commandstats | tr -d '\r' | awk -F'[=,]' '/^cmdstat_evalsha:|^cmdstat_eval:/ {sum += $2} END {print sum + 0}'
}

echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}')"

upstream_port=$(free_port)
target/release/examples/overhead plain "$upstream_port" & pids+=($!)
wait_for "http://127.0.0.1:$upstream_port/"
redis_port=$(free_port)
start_redis "$redis_port"


start_floodgate "store: { backend: memory }"
memory_port=$started_port
start_floodgate "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\" }"
exact_port=$started_port
start_floodgate "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\", sync_interval: 100ms }"
batched_port=$started_port

load() { # name port
    local before after requests rps p99
    before=$(script_calls "$redis_port")
    wrk -t1 -c"$connections" -d"${seconds}s" --latency "http://127.0.0.1:$2/" > "$work/wrk.txt"
    after=$(script_calls "$redis_port")
    rps=$(awk '/Requests\/sec/ {print $2}' "$work/wrk.txt")
    p99=$(awk '$1=="99%" {print $2}' "$work/wrk.txt")
    requests=$(awk '/requests in/ {print $1}' "$work/wrk.txt")
    printf '%-18s %12s req/s   p99 %8s   redis script calls %7s = %.5f per decision\n' \
        "$1" "$rps" "$p99" "$((after - before))" "$(python3 -c "print(($after - $before) / $requests)")"
}

echo "== gateway: wrk -t1 -c$connections -d${seconds}s, same upstream (examples/overhead.rs plain)"
for round in 1 2 3; do
    load memory "$memory_port"
    load redis-exact "$exact_port"
    load redis-batched "$batched_port"
done

echo "== RedisStore decisions/s, 64 callers with their own identities (multiplexed)"
single_port=$(free_port)
start_redis "$single_port"
cluster_ports=()
for _ in 1 2 3; do
    port=$(free_port)
    start_redis "$port" --cluster-enabled yes --cluster-config-file "$work/nodes-$port.conf" --cluster-node-timeout 1000
    cluster_ports+=("$port")
done
redis-cli --cluster create $(printf '127.0.0.1:%s ' "${cluster_ports[@]}") --cluster-replicas 0 --cluster-yes >/dev/null
for _ in $(seq 100); do
    redis-cli -p "${cluster_ports[0]}" CLUSTER INFO | grep -q cluster_state:ok && break; sleep 0.1
done
cluster_url="cluster:$(printf 'redis://127.0.0.1:%s,' "${cluster_ports[@]}" | sed 's/,$//')"
cluster_calls() { local sum=0; for port in "${cluster_ports[@]}"; do sum=$((sum + $(script_calls "$port"))); done; echo "$sum"; }
bench_run() { # label url calls-function
    local before after output decisions
    before=$($3)
    output=$(target/release/examples/redis_bench "$2" spread multiplexed 64 "$seconds")
    after=$($3)
    decisions=$(echo "$output" | sed -E 's/.*\(([0-9]+) in.*/\1/')
    printf '%-18s %s; %s script calls = %.4f per decision\n' "$1" "$output" "$((after - before))" \
        "$(python3 -c "print(($after - $before) / $decisions)")"
}
single_calls() { script_calls "$single_port"; }
for round in 1 2 3; do
    bench_run "one node:" "redis://127.0.0.1:$single_port" single_calls
    bench_run "3-master cluster:" "$cluster_url" cluster_calls
done
