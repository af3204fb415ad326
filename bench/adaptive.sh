#!/usr/bin/env bash
# Adaptive concurrency (issue 49, SPEC §11): the same load through four gateways in one run,
# one arm after the other. An upstream of 16 workers x 20 ms (800 requests per second),
# offered 1,600 per second (20 % critical, 30 % default, 50 % sheddable, 200 clients) for
# SECONDS (default 30); in the middle third, half the workers are taken away. Arms: no
# shedding; a static concurrency ceiling tuned for full capacity (19 in flight); floodgate's
# adaptive limit (three classes: critical reserving 20 %, default 10 %); the same with
# critical requests waiting up to 100 ms for a place (`wait`). See
# crates/floodgate-gateway/examples/adaptive_bench.rs for what is measured. The adaptive arm's
# limit is sampled from /admin/adaptive every 100 ms, and the time it takes to settle after each
# capacity change is printed (settled: every later sample of the phase within 25 % of the
# median of its last 3 s).
#
#   bash bench/adaptive.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
cargo build --release -p floodgate-gateway --bin floodgate --example adaptive_bench >/dev/null 2>&1
source bench/common.sh
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), $seconds s per arm, $(date -u +%FT%TZ), $(git rev-parse --short HEAD)"

# The adaptive limit every 100 ms from the admin API on ADMIN_PORT: "seconds limit" lines,
# seconds from the sampler's start (the bench's, within a few ms). One process, so that sampling
# costs the machine little.
sample_limit() { # admin_port
    python3 -u - "$1" <<'PY'
import json, sys, time, urllib.request
port = sys.argv[1]
start = time.monotonic()
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/adaptive", timeout=1) as answer:
            upstreams = json.load(answer)["upstreams"]
        if upstreams:
            print(f"{time.monotonic() - start:.2f} {upstreams[0]['limit']}")
    except OSError:
        pass
    time.sleep(0.1)
PY
}

# Reads sample_limit's lines from FILE; prints how long the limit took to settle after each capacity
# change (at a third and two thirds of the load). The load starts a second after the bench's
# first request (its unloaded probe), which is when the first sample finds the upstream.
settling() { # file
    python3 - "$seconds" "$1" <<'PY'
import statistics, sys
seconds = float(sys.argv[1])
with open(sys.argv[2]) as lines:
    samples = [tuple(map(float, line.split())) for line in lines if line.strip()]
if samples:
    load_starts = samples[0][0] + 1.0
    samples = [(at - load_starts, limit) for at, limit in samples]
phase = seconds / 3
for name, change in (("halved", phase), ("restored", 2 * phase)):
    inside = [(at, limit) for at, limit in samples if change <= at < change + phase]
    tail = [limit for at, limit in inside if at >= change + phase - 3]
    if not tail:
        print(f"limit after the capacity {name}: no samples")
        continue
    settled = statistics.median(tail)
    late = [at for at, limit in inside if abs(limit - settled) > 0.25 * settled]
    took = (max(late) - change + 0.1) if late else 0.0
    before = [limit for at, limit in samples if change - 3 <= at < change]
    print(f"limit after the capacity {name}: {statistics.median(before) if before else '?'} "
          f"before, settled at {settled} within {took:.1f} s")
PY
}

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
    local sampler=""
    if [[ "$1" == adaptive* ]]; then
        sample_limit "$admin" > "$work/$1.limits.txt" &
        sampler=$!
    fi
    wait "$bench"
    if [ -n "$sampler" ]; then
        kill "$sampler" 2>/dev/null || true
    fi
    kill "$gateway" 2>/dev/null || true
    wait "$gateway" 2>/dev/null || true
    echo "$1: $(cat "$work/$1.json")"
    if [ -n "$sampler" ]; then
        settling "$work/$1.limits.txt"
    fi
}

run_arm none ""
run_arm static 'global:
  "GET /": [ { name: ceiling, algorithm: concurrency, limit: 19, window: 30s } ]'
adaptive_arm() { # name critical_class
    run_arm "$1" "identity:
  trusted_proxies: [\"127.0.0.1/32\"]
adaptive_concurrency:
  class_header: x-priority
  default_class: default
  classes:
    - $2
    - { name: default, reserve: 0.1 }
    - { name: sheddable }"
}
adaptive_arm adaptive '{ name: critical, reserve: 0.2 }'
# The same, critical requests that find the limit full waiting up to 100 ms for a place.
adaptive_arm adaptive_wait '{ name: critical, reserve: 0.2, wait: 100ms }'
