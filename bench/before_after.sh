#!/usr/bin/env bash
# The request path before and after a revision, in one session: the axum layer
# (examples/overhead.rs, `limited`: memory store, both header sets) and the gateway (memory store;
# memory store with a route that reserves an estimate; Redis store), each built at REV and at the
# working tree, under the same wrk load, before and after alternating within every round, at 1
# and at 64 connections. Gateway requests carry an `x-api-key`, so the credential is read and
# checked as every keyed request's is. Prints each run, then the median after/before ratio of
# requests/s and of p99 per row.
#
#   bash bench/before_after.sh REV [seconds] [rounds]
#   ROWS="layer" CONNECTIONS="64" bash bench/before_after.sh REV 5 7     (some rows, some loads)
#
# REV is built once in a git worktree at /tmp/floodgate-before-<rev> with its own target
# directory beside it (kept for the next run).
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$(git rev-parse --short "${1:?usage: bench/before_after.sh REV [seconds] [rounds]}")
seconds=${2:-5}
rounds=${3:-3}
for tool in wrk redis-server; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install wrk redis-server)" >&2; exit 1; }
done

before_tree=/tmp/floodgate-before-$rev
[ -d "$before_tree" ] || git worktree add --detach "$before_tree" "$rev" >/dev/null
build() { # tree target-dir
    (cd "$1" && CARGO_TARGET_DIR=$2 cargo build --release -p floodgate-gateway -p floodgate \
        --example overhead --bin floodgate >/dev/null 2>&1)
}
build "$before_tree" "$before_tree-target"
build . "$PWD/target"
before_bin=$before_tree-target/release
after_bin=$PWD/target/release
source bench/common.sh

upstream_port=$(free_port)
"$after_bin/examples/overhead" plain "$upstream_port" & pids+=($!)
wait_for "http://127.0.0.1:$upstream_port/"
redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile '' >/dev/null & pids+=($!)

declare -A port
for side in before after; do
    bin_dir=${side}_bin
    layer_port=$(free_port)
    "${!bin_dir}/examples/overhead" limited "$layer_port" & pids+=($!)
    wait_for "http://127.0.0.1:$layer_port/"
    port[layer-$side]=$layer_port
    floodgate_bin=${!bin_dir}/floodgate
    start_floodgate "store: { backend: memory }"
    port[gateway-memory-$side]=$started_port
    start_floodgate "store: { backend: memory }
routes:
  - { match: \"GET /\", cost_header: \"x-tokens-used\", estimate_header: \"x-max-tokens\", estimate_max: 16 }"
    port[gateway-estimate-$side]=$started_port
    start_floodgate "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\" }"
    port[gateway-redis-$side]=$started_port
done

results=$work/results.txt
run() { # row side connections
    wrk -t1 -c"$3" -d"${seconds}s" --latency -H 'x-api-key: bench-key' -H 'x-max-tokens: 4' \
        "http://127.0.0.1:${port[$1-$2]}/" > "$work/wrk.txt"
    local rps p50 p99 non2xx requests
    read -r rps p50 p99 non2xx requests < <(wrk_figures)
    printf '%-18s %-6s c=%-3s %10s req/s   p99 %8s   non-2xx %s\n' "$1" "$2" "$3" "$rps" "$p99" "$non2xx"
    echo "$1 $3 $2 $round $rps $p99" >> "$results"
}

echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}'), $(date -u +%FT%TZ)"
echo "before: $rev; after: the working tree at $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (modified)'); wrk -t1 -d${seconds}s, $rounds rounds"
for round in $(seq "$rounds"); do
    for connections in ${CONNECTIONS:-1 64}; do
        for row in ${ROWS:-layer gateway-memory gateway-estimate gateway-redis}; do
            # Alternate which side goes first, so neither always runs on a warmer machine.
            if [ $((round % 2)) = 1 ]; then sides="before after"; else sides="after before"; fi
            for side in $sides; do run "$row" "$side" "$connections"; done
        done
    done
done

echo
echo "median after/before per row (requests/s; p99, lower is better):"
python3 bench/ratios.py before "$results"
