#!/usr/bin/env bash
# What adaptive concurrency costs the gateway's request path when it sheds nothing (issue 49's
# last goal): the same binary with `adaptive_concurrency` absent (`off`) and configured with
# three classes, a class header and a waiting class but no pressure (`on`: the upstream answers
# at once, the limit never binds), and, given REV, REV's binary with the same configuration as
# `off` (`before`: a build without the feature, or one before a change to it). Memory store,
# one wrk client at 1 and at 64 connections, the arms alternating in every round. Prints each
# run, then the median ratio to `off` of served (2xx) requests/s and of p99 per arm.
#
#   bash bench/adaptive_cost.sh [seconds] [rounds] [REV]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-5}
rounds=${2:-3}
rev=${3:-}
for tool in wrk; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install wrk)" >&2; exit 1; }
done
cargo build --release -p floodgate-gateway -p floodgate --example overhead --bin floodgate >/dev/null 2>&1
arms="off on"
if [ -n "$rev" ]; then
    rev=$(git rev-parse --short "$rev")
    before_tree=/tmp/floodgate-before-$rev
    [ -d "$before_tree" ] || git worktree add --detach "$before_tree" "$rev" >/dev/null
    (cd "$before_tree" && CARGO_TARGET_DIR=$before_tree-target cargo build --release \
        -p floodgate-gateway --bin floodgate >/dev/null 2>&1)
    arms="before off on"
fi
source bench/common.sh

upstream_port=$(free_port)
target/release/examples/overhead plain "$upstream_port" & pids+=($!)
wait_for "http://127.0.0.1:$upstream_port/"

declare -A port
start_floodgate "store: { backend: memory }"
port[off]=$started_port
start_floodgate "store: { backend: memory }
identity: { trusted_proxies: [\"127.0.0.1/32\"] }
adaptive_concurrency:
  class_header: x-priority
  default_class: default
  classes:
    - { name: critical, reserve: 0.2, wait: 100ms }
    - { name: default, reserve: 0.1 }
    - { name: sheddable }"
port[on]=$started_port
if [ -n "$rev" ]; then
    floodgate_bin=$before_tree-target/release/floodgate start_floodgate "store: { backend: memory }"
    port[before]=$started_port
fi

results=$work/results.txt
run() { # arm connections
    wrk -t1 -c"$2" -d"${seconds}s" --latency -H 'x-api-key: bench-key' -H 'x-priority: default' \
        "http://127.0.0.1:${port[$1]}/" > "$work/wrk.txt"
    local rps p50 p99 non2xx requests ok
    read -r rps p50 p99 non2xx requests < <(wrk_figures)
    # Served (2xx) per second: a shed 503 is quick, and counts in wrk's rate.
    ok=$(python3 -c "print(round($rps * (1 - $non2xx / $requests), 2))")
    printf '%-7s c=%-3s %10s req/s   %10s served/s   p99 %8s   non-2xx %s\n' "$1" "$2" "$rps" "$ok" "$p99" "$non2xx"
    echo "gateway $2 $1 $round $ok $p99" >> "$results"
}

echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), $(date -u +%FT%TZ), $(git rev-parse --short HEAD)${rev:+, before: $rev}; wrk -t1 -d${seconds}s, $rounds rounds"
for round in $(seq "$rounds"); do
    for connections in 1 64; do
        # Rotate which arm goes first, so that none always runs on a warmer machine.
        order=$(echo $arms | tr ' ' '\n' | awk -v r="$round" '{a[NR]=$0} END {for (i = 0; i < NR; i++) print a[(i + r) % NR + 1]}')
        for arm in $order; do run "$arm" "$connections"; done
    done
done

echo
echo "median ratio to off, round by round (req/s: served, 2xx, requests per second; p99 of all answers, lower is better):"
python3 bench/ratios.py off "$results"
