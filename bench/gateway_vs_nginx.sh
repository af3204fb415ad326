#!/usr/bin/env bash
# nginx (proxy_pass + a limit_req zone set too high to reject), a bare hyper reverse proxy (the
# gateway's HTTP stack with nothing of floodgate's, on either of its runtimes:
# examples/bare_proxy.rs) and floodgate (memory
# store on the multi-thread runtime, memory store with `server.workers: per_core`, then Redis
# store) in front of the same upstream, under the same wrk load, in one session; then nginx and
# floodgate again behind a TLS listener with the same certificate (keep-alive, plain upstream).
# Each server's CPU time over its loads is printed at the end (user+system, ms per 1,000
# requests), so that throughput can be read against what each spent.
#
#   bash bench/gateway_vs_nginx.sh [seconds] [connections]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
connections=${2:-64}
for tool in wrk nginx redis-server openssl; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install wrk nginx redis-server)" >&2; exit 1; }
done
cargo build --release -p floodgate-gateway -p floodgate --example overhead --example bare_proxy --bin floodgate >/dev/null 2>&1
source bench/common.sh

upstream_port=$(free_port)
target/release/examples/overhead plain "$upstream_port" & pids+=($!)
wait_for "http://127.0.0.1:$upstream_port/"

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile '' >/dev/null & pids+=($!)

nginx_tls_port=$(free_port)
# One self-signed P-256 certificate for both TLS listeners.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 \
    -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 \
    -keyout "$work/tls.key" -out "$work/tls.crt" >/dev/null 2>&1
start_nginx "$nginx_tls_port"
bare_port=$(free_port)
target/release/examples/bare_proxy "$bare_port" "$upstream_port" multi_thread & pids+=($!); bare_pid=$!
wait_for "http://127.0.0.1:$bare_port/"
bare_per_core_port=$(free_port)
target/release/examples/bare_proxy "$bare_per_core_port" "$upstream_port" per_core & pids+=($!); bare_per_core_pid=$!
wait_for "http://127.0.0.1:$bare_per_core_port/"


start_floodgate "store: { backend: memory }
server: { workers: multi_thread }"
memory_port=$started_port; memory_pid=$started_pid
start_floodgate "store: { backend: memory }
server: { workers: per_core }"
per_core_port=$started_port; per_core_pid=$started_pid
start_floodgate "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\" }
server: { workers: multi_thread }"
redis_gateway_port=$started_port; redis_gateway_pid=$started_pid
start_floodgate "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\" }
server: { workers: per_core }"
redis_per_core_port=$started_port; redis_per_core_pid=$started_pid
start_floodgate "listen_tls: { cert: \"$work/tls.crt\", key: \"$work/tls.key\" }" https
tls_gateway_port=$started_port; tls_gateway_pid=$started_pid

ticks=$(getconf CLK_TCK)
# CPU time (user+system, clock ticks) of the processes given and of their children.
cpu_ticks() {
    local total=0 pid
    for pid in "$@" $(pgrep -P "$(IFS=,; echo "$*")" || true); do
        total=$((total + $(awk '{print $14 + $15}' "/proc/$pid/stat")))
    done
    echo "$total"
}
# `load`, then the CPU the server (its processes given) spent per 1,000 requests of the load.
measure() { # name port scheme pid...
    local name=$1 port=$2 scheme=$3 before after requests
    shift 3
    before=$(cpu_ticks "$@")
    load "$name" "$port" "$scheme"
    after=$(cpu_ticks "$@")
    requests=$(awk '/requests in/ {print $1}' "$work/wrk.txt")
    awk -v spent=$((after - before)) -v hz="$ticks" -v n="$requests" -v name="$name" \
        'BEGIN { printf "%-26s cpu %.1f ms per 1,000 requests\n", name, spent * 1e6 / hz / n }'
}

echo "machine: $(nproc) cores; wrk -t1 -c$connections -d${seconds}s; same upstream (axum hello, examples/overhead.rs)"
for round in 1 2 3; do
    measure nginx "$nginx_port" http "$nginx_pid"
    measure bare-hyper-multi-thread "$bare_port" http "$bare_pid"
    measure bare-hyper-per-core "$bare_per_core_port" http "$bare_per_core_pid"
    measure floodgate-multi-thread "$memory_port" http "$memory_pid"
    measure floodgate-per-core "$per_core_port" http "$per_core_pid"
    measure floodgate-redis-multi "$redis_gateway_port" http "$redis_gateway_pid"
    measure floodgate-redis-per-core "$redis_per_core_port" http "$redis_per_core_pid"
done
echo "TLS listener (same certificate, keep-alive, plain upstream):"
for round in 1 2 3; do
    measure nginx-tls "$nginx_tls_port" https "$nginx_pid"
    measure floodgate-tls-per-core "$tls_gateway_port" https "$tls_gateway_pid"
done
