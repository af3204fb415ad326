#!/usr/bin/env bash
# Layer overhead in instructions: the same in-process apps as `overhead cpu` (plain axum,
# floodgate's layer on a memory store with its default headers and with the IETF set alone,
# tower_governor 0.8), each called N times under
# valgrind's callgrind. Only the request loop is counted (`--toggle-collect` on
# `time_per_request`: no start-up, no other thread), less quanta's one-time clock calibration,
# whose instruction count moves by millions between runs; what is left, over N, is the
# instructions per request. Unlike the clock, the count does not move with the machine's load
# (it leaves out cache misses and the cost of contention, which the wrk runs of
# layer_overhead.sh include).
#
#   bash bench/layer_instructions.sh [N] [BINARY]
# BINARY: an `overhead` example built from another commit, to compare (default: this tree's).
set -euo pipefail
cd "$(dirname "$0")/.."
requests=${1:-20000}
command -v valgrind >/dev/null || { echo "valgrind is missing: apt-get install valgrind" >&2; exit 1; }
binary=${2:-}
if [ -z "$binary" ]; then
    cargo build --release -p floodgate --example overhead >/dev/null 2>&1
    binary=target/release/examples/overhead
fi
profile=$(mktemp)
trap 'rm -f "$profile"' EXIT

per_request() { # mode -> instructions per request
    valgrind --tool=callgrind --toggle-collect='overhead::time_per_request*' \
        --callgrind-out-file="$profile" "$binary" calls "$1" "$requests" >/dev/null 2>&1
    callgrind_annotate --inclusive=yes "$profile" | python3 -c '
import re, sys
text = sys.stdin.read()
total = int(re.search(r"([\d,]+) \(100.0%\)\s+PROGRAM TOTALS", text).group(1).replace(",", ""))
calibration = re.search(r"^\s*([\d,]+) .*quanta::Clock::new", text, re.M)
once = int(calibration.group(1).replace(",", "")) if calibration else 0
print(round((total - once) / int(sys.argv[1])))' "$requests"
}

declare -A count
for mode in plain limited ietf adaptive governor; do
    count[$mode]=$(per_request "$mode")
    printf '%-9s %7d instructions per request\n' "$mode" "${count[$mode]}"
done
ours=$(( count[limited] - count[plain] ))
ietf=$(( count[ietf] - count[plain] ))
theirs=$(( count[governor] - count[plain] ))
adaptive=$(( count[adaptive] - count[plain] ))
echo "adaptive concurrency over plain axum: $adaptive"
echo "over plain axum: floodgate $ours, with the IETF headers alone $ietf, tower_governor $theirs (tower_governor / floodgate $(python3 -c "print(round($theirs / $ours, 2))"), with the IETF headers alone $(python3 -c "print(round($theirs / $ietf, 2))"))"
