#!/usr/bin/env bash
# nginx (proxy_pass + a limit_req zone set too high to reject) and floodgate (memory store on the
# multi-thread runtime, memory store with `server.workers: per_core`, then Redis store) in front
# of the same upstream, under the same wrk load, in one session; then both
# again behind a TLS listener with the same certificate (keep-alive, plain upstream).
#
#   bash bench/gateway_vs_nginx.sh [seconds] [connections]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
connections=${2:-64}
for tool in wrk nginx redis-server openssl; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install wrk nginx redis-server)" >&2; exit 1; }
done
cargo build --release -p floodgate-gateway -p floodgate --example overhead --bin floodgate >/dev/null 2>&1
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


start_floodgate "store: { backend: memory }
server: { workers: multi_thread }"
memory_port=$started_port
start_floodgate "store: { backend: memory }
server: { workers: per_core }"
per_core_port=$started_port
start_floodgate "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\" }
server: { workers: multi_thread }"
redis_gateway_port=$started_port
start_floodgate "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\" }
server: { workers: per_core }"
redis_per_core_port=$started_port
start_floodgate "listen_tls: { cert: \"$work/tls.crt\", key: \"$work/tls.key\" }" https
tls_gateway_port=$started_port

echo "machine: $(nproc) cores; wrk -t1 -c$connections -d${seconds}s; same upstream (axum hello, examples/overhead.rs)"
for round in 1 2 3; do
    load nginx "$nginx_port"
    load floodgate-multi-thread "$memory_port"
    load floodgate-per-core "$per_core_port"
    load floodgate-redis-multi "$redis_gateway_port"
    load floodgate-redis-per-core "$redis_per_core_port"
done
echo "TLS listener (same certificate, keep-alive, plain upstream):"
for round in 1 2 3; do
    load nginx-tls "$nginx_tls_port" https
    load floodgate-tls-per-core "$tls_gateway_port" https
done
