#!/usr/bin/env bash
# Layer overhead in instructions: the same in-process apps as `overhead cpu` (plain axum,
# floodgate's layer on a memory store, tower_governor 0.8), each called N and 2N times under
# valgrind's callgrind; the difference over N is the instructions per request, start-up left
# out. Unlike the clock, the count does not move with the machine's load (it leaves out cache
# misses and the cost of contention, which the wrk runs of layer_overhead.sh include).
#
#   bash bench/layer_instructions.sh [N] [BINARY]
# BINARY: an `overhead` example built from another commit, to compare (default: this tree's).
set -euo pipefail
cd "$(dirname "$0")/.."
requests=${1:-5000}
command -v valgrind >/dev/null || { echo "valgrind is missing: apt-get install valgrind" >&2; exit 1; }
binary=${2:-}
if [ -z "$binary" ]; then
    cargo build --release -p floodgate --example overhead >/dev/null 2>&1
    binary=target/release/examples/overhead
fi

count() { # mode requests -> instructions of the whole run
    valgrind --tool=callgrind --callgrind-out-file=/dev/null "$binary" calls "$1" "$2" 2>&1 \
        | awk '/Collected/ {print $4}'
}

declare -A per_request
for mode in plain limited governor; do
    once=$(count "$mode" "$requests")
    twice=$(count "$mode" $((2 * requests)))
    per_request[$mode]=$(( (twice - once) / requests ))
    printf '%-9s %7d instructions per request\n' "$mode" "${per_request[$mode]}"
done
ours=$(( per_request[limited] - per_request[plain] ))
theirs=$(( per_request[governor] - per_request[plain] ))
echo "over plain axum: floodgate $ours, tower_governor $theirs (tower_governor / floodgate $(python3 -c "print(round($theirs / $ours, 2))"))"
