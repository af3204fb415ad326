#!/usr/bin/env bash
# Adaptive concurrency (issue 49, SPEC §11): the same load through three gateways in one run,
# one arm after the other. An upstream of 16 workers x 20 ms (800 requests per second),
# offered 1,600 per second (20 % critical, 30 % default, 50 % sheddable, 200 clients) for
# SECONDS (default 30); in the middle third, half the workers are taken away. Arms: no
# shedding; a static concurrency ceiling tuned for full capacity (19 in flight); floodgate's
# adaptive limit (three classes: critical reserving 20 %, default 10 %). See
# crates/floodgate-gateway/examples/adaptive_bench.rs for what is measured.
#
#   bash bench/adaptive.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
cargo build --release -p floodgate-gateway --bin floodgate --example adaptive_bench >/dev/null 2>&1
source bench/common.sh
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), $seconds s per arm, $(date -u +%FT%TZ), $(git rev-parse --short HEAD)"

run_arm() { # name yaml
    upstream_port=$(free_port)
    local gateway_port; gateway_port=$(free_port)
    target/release/examples/adaptive_bench "$upstream_port" "http://127.0.0.1:$gateway_port/" "$seconds" \
        > "$work/$1.json" &
    local bench=$!
    local admin; admin=$(free_port)
    cat > "$work/$1.yaml" <<YAML
listen: "127.0.0.1:$gateway_port"
admin: { listen: "127.0.0.1:$admin" }
upstream: "http://127.0.0.1:$upstream_port"
upstream_timeout: 10s
$2
plans:
  anonymous:
    limits: [ { name: per-second, algorithm: token_bucket, limit: 100000000, window: 1s } ]
  free:
    limits: [ { name: per-second, algorithm: token_bucket, limit: 100000000, window: 1s } ]
YAML
    RUST_LOG=warn target/release/floodgate serve --config "$work/$1.yaml" >/dev/null 2>"$work/$1.log" &
    local gateway=$!
    wait "$bench"
    kill "$gateway" 2>/dev/null || true
    wait "$gateway" 2>/dev/null || true
    echo "$1: $(cat "$work/$1.json")"
}

run_arm none ""
run_arm static 'global:
  "GET /": [ { name: ceiling, algorithm: concurrency, limit: 19, window: 30s } ]'
run_arm adaptive 'identity:
  trusted_proxies: ["127.0.0.1/32"]
adaptive_concurrency:
  class_header: x-priority
  default_class: default
  classes:
    - { name: critical, reserve: 0.2 }
    - { name: default, reserve: 0.1 }
    - { name: sheddable }'
