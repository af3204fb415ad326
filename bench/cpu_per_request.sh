#!/usr/bin/env bash
# Where a proxied request's CPU goes: user and kernel time per request of nginx's workers, of
# the floodgate gateway (per_core, memory store, then Redis store) and of redis-server, read from
# /proc/<pid>/task/*/stat around one wrk run each, in front of the same upstream.
#
#   bash bench/cpu_per_request.sh [seconds] [connections] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-8}
connections=${2:-64}
rounds=${3:-3}
for tool in wrk nginx redis-server; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install wrk nginx redis-server)" >&2; exit 1; }
done
cargo build --release -p floodgate-gateway -p floodgate --example overhead --bin floodgate >/dev/null 2>&1
source bench/common.sh

upstream_port=$(free_port)
target/release/examples/overhead plain "$upstream_port" & pids+=($!)
wait_for "http://127.0.0.1:$upstream_port/"
redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile '' >/dev/null &
redis_pid=$!; pids+=($redis_pid)

start_nginx
nginx_workers=$(pgrep -f "nginx: worker" | tr '\n' ' ')

start_floodgate "store: { backend: memory }
server: { workers: per_core }"
memory_port=$started_port; memory_pid=${pids[-1]}
start_floodgate "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\" }
server: { workers: per_core }"
redis_gateway_port=$started_port; redis_gateway_pid=${pids[-1]}

# Clock ticks (user, system) of every thread of the given processes.
ticks() {
    local user=0 system=0 fields
    for pid in "$@"; do
        for stat in /proc/"$pid"/task/*/stat; do
            read -r -a fields < "$stat" || continue
            user=$((user + fields[13])); system=$((system + fields[14]))
        done
    done
    echo "$user $system"
}

# name port pid... : load on port, CPU of the pids.
measure() {
    local name=$1 port=$2; shift 2
    local hz; hz=$(getconf CLK_TCK)
    read -r user0 system0 < <(ticks "$@")
    wrk -t1 -c"$connections" -d"${seconds}s" "http://127.0.0.1:$port/" > "$work/wrk.txt"
    read -r user1 system1 < <(ticks "$@")
    local requests; requests=$(awk '/requests in/ {print $1}' "$work/wrk.txt")
    awk -v name="$name" -v r="$requests" -v s="$seconds" -v hz="$hz" \
        -v u=$((user1 - user0)) -v k=$((system1 - system0)) 'BEGIN {
        printf "%-22s %7.0f req/s   user %5.1f us/req   kernel %5.1f us/req\n",
            name, r / s, u * 1e6 / hz / r, k * 1e6 / hz / r }'
}

echo "machine: $(nproc) cores; wrk -t1 -c$connections -d${seconds}s; CPU per request from /proc"
for round in $(seq "$rounds"); do
    echo "round $round"
    measure nginx "$nginx_port" $nginx_workers
    measure "floodgate, memory" "$memory_port" "$memory_pid"
    measure "floodgate, Redis" "$redis_gateway_port" "$redis_gateway_pid"
    measure "  redis-server" "$redis_gateway_port" "$redis_pid"
done
