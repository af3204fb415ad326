#!/usr/bin/env bash
# What the operator features cost on the request path: the gateway (memory store) without an
# access log, with a JSON access log to a file, and without a log but with 1,000 overrides in
# force (the load's own client among them), under the same wrk load, rounds interleaved.
#
#   bash bench/operations.sh [seconds] [connections]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
connections=${2:-64}
for tool in wrk curl; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install wrk curl)" >&2; exit 1; }
done
cargo build --release -p floodgate-gateway -p floodgate --example overhead --bin floodgate >/dev/null 2>&1
source bench/common.sh

upstream_port=$(free_port)
target/release/examples/overhead plain "$upstream_port" & pids+=($!)
wait_for "http://127.0.0.1:$upstream_port/"

start_floodgate "store: { backend: memory }"
plain_port=$started_port
start_floodgate "store: { backend: memory }
access_log: { path: \"$work/access.log\", format: json }"
logged_port=$started_port
admin=$(free_port)
overrides_port=$(free_port)
cat > "$work/overrides.yaml" <<YAML
listen: "127.0.0.1:$overrides_port"
admin: { listen: "127.0.0.1:$admin" }
upstream: "http://127.0.0.1:$upstream_port"
store: { backend: memory }
plans:
  anonymous:
    limits: [ { name: per-second, algorithm: token_bucket, limit: 100000000, window: 1s } ]
  free:
    limits: [ { name: per-second, algorithm: token_bucket, limit: 100000000, window: 1s } ]
YAML
RUST_LOG=error target/release/floodgate serve --config "$work/overrides.yaml" >/dev/null 2>"$work/overrides.log" & pids+=($!)
wait_for "http://127.0.0.1:$overrides_port/"
body='{"name": "per-second", "limit": 200000000, "expires_in": "1h"}'
curl -fs -X PUT "http://127.0.0.1:$admin/admin/clients/overrides?ip=127.0.0.1" -d "$body" >/dev/null
for i in $(seq 999); do
    curl -fs -X PUT "http://127.0.0.1:$admin/admin/clients/overrides?api_key=bench-$i" -d "$body" >/dev/null
done
in_force=$(curl -fs "http://127.0.0.1:$admin/admin/clients/overrides?per_page=1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["total"])')

echo "machine: $(nproc) cores; wrk -t1 -c$connections -d${seconds}s; same upstream (examples/overhead.rs); $in_force overrides in force"
for round in 1 2 3; do
    load no-log "$plain_port"
    load access-log-json-file "$logged_port"
    load 1000-overrides "$overrides_port"
done
lines=$(wc -l < "$work/access.log")
dropped=$(curl -fs "http://127.0.0.1:$(sed -n 's/^admin: { listen: "127.0.0.1:\([0-9]*\)" }$/\1/p' "$work/floodgate-$logged_port.yaml")/metrics" | awk '/^floodgate_access_log_dropped_total / {print $2}')
echo "access log: $lines lines written, ${dropped:-0} dropped"
