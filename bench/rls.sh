#!/usr/bin/env bash
# Envoy's rate limit service under the client the ecosystem uses: ShouldRateLimit from grpc-go
# (bench/grpc_load, which pings on data as Envoy's peers do) against an RLS-only floodgate on
# one local Redis, at 1, 8 and 64 callers over 1 and 4 HTTP/2 connections, one and three
# descriptors, every call admitted and one user far over its limit. Per point: calls/s, p50,
# p99 (grpc_load, every call's latency), Redis time per call and per descriptor (INFO
# commandstats, reset before the point), and the gateway's CPU time per call (/proc/PID/stat
# over the point). The reference, in the same Redis and run: redis-benchmark -P 2 of INCRBY and
# of EXPIRE, the two commands envoyproxy/ratelimit sends per descriptor (their µs summed).
#
#   bash bench/rls.sh [seconds per point] [rounds]
#
# RLS_UNIT=second gives the domain's limits per-second windows (default: minute), so that the
# 1,000 users' windows begin often (issue 47's case).
#
# Before/after in one run: FLOODGATE_BINARIES="before=/path/to/floodgate after=target/release/floodgate"
# starts one gateway per binary on the same Redis and runs every point against each in turn.
# POINTS="regex" runs only the points whose label matches. Each round starts with the next
# binary (the order measurably matters on 2 shared cores).
#
# Redis time counts what the gateway sends: the library's FCALL/EVALSHA lines plus any other
# command not run inside the library. commandstats also lists the commands a script runs, on
# their own lines; those (the names the Lua library calls) are not added again.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-5}
rounds=${2:-2}
target=${CARGO_TARGET_DIR:-target}
for tool in redis-server redis-benchmark redis-cli python3 curl; do
    command -v "$tool" >/dev/null || { echo "$tool is missing: apt-get install redis-server redis-tools python3 curl" >&2; exit 1; }
done
# grpc-go from Debian (no Go module proxy is needed: GOPATH mode on /usr/share/gocode).
if ! command -v go >/dev/null || [ ! -d /usr/share/gocode/src/google.golang.org/grpc ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get install -y golang-go golang-google-grpc-dev >/dev/null
    else
        echo "Go and grpc-go are missing: as root, apt-get install golang-go golang-google-grpc-dev" >&2
        exit 1
    fi
fi
mkdir -p "$target/grpc_load"
GO111MODULE=off GOPATH=/usr/share/gocode GOCACHE="$(cd "$target/grpc_load" && pwd)/cache" \
    go build -o "$target/grpc_load/grpc_load" bench/grpc_load/main.go
load=$target/grpc_load/grpc_load
cargo build --release -p floodgate-gateway --bin floodgate >/dev/null 2>&1
source bench/common.sh

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile '' >/dev/null &
pids+=($!)
for _ in $(seq 50); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.1; done
rcli() { redis-cli -p "$redis_port" "$@"; }
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}'), $(go version | awk '{print $3}'), grpc-go $(awk -F'"' '/Version =/ {print $2}' /usr/share/gocode/src/google.golang.org/grpc/version.go); ${seconds}s per point"

# Commands the Lua library runs (listed in commandstats too, not sent by the gateway).
inner=$(grep -ohE "(redis\.p?call|read_own)\('[A-Z]+'" crates/floodgate/lua/*.lua | sed -E "s/.*'([A-Z]+)'/\1/" | tr 'A-Z' 'a-z' | sort -u | tr '\n' ' ')
# Calls and usec the gateway caused since the last CONFIG RESETSTAT: "calls usec".
redis_cost() {
    rcli info commandstats | tr -d '\r' | awk -F'[:,=]' -v inner=" $inner " '
        /^cmdstat_/ { name = substr($1, 9)
            if (name ~ /^(fcall|fcall_ro|evalsha|evalsha_ro|eval|eval_ro)$/ || index(inner, " " name " ") == 0) {
                if (name != "config" && name != "info") { calls += $3; usec += $5 } } }
        END { printf "%d %d\n", calls, usec }'
}

# --- the reference: what envoyproxy/ratelimit's fixed window costs Redis --------------------
reference() {
    local total=0 command
    for command in INCRBY EXPIRE; do
        rcli config resetstat >/dev/null
        if [ "$command" = INCRBY ]; then
            redis-benchmark -p "$redis_port" -c 50 -P 2 -n 200000 -q INCRBY 'rl:bench:user:u1' 1 >/dev/null 2>&1
        else
            redis-benchmark -p "$redis_port" -c 50 -P 2 -n 200000 -q EXPIRE 'rl:bench:user:u1' 60 >/dev/null 2>&1
        fi
        local per
        per=$(rcli info commandstats | tr -d '\r' | awk -F'[:,=]' -v name="cmdstat_${command,,}" '$1 == name {printf "%.3f", $5 / $3}')
        printf '  %-6s %6s us/call\n' "$command" "$per" >&2
        total=$(echo "$total + $per" | bc -l)
    done
    printf '%.3f' "$total"
}

# --- the gateway ----------------------------------------------------------------------------
mkdir -p "$work/rls"
cat > "$work/rls/bench.yaml" <<YAML
domain: bench
descriptors:
  - key: user
    rate_limit: { unit: ${RLS_UNIT:-minute}, requests_per_unit: 1000000000 }
  - key: user
    value: over
    rate_limit: { unit: ${RLS_UNIT:-minute}, requests_per_unit: 10 }
  - key: org
    rate_limit: { unit: ${RLS_UNIT:-minute}, requests_per_unit: 1000000000 }
  - key: route
    rate_limit: { unit: ${RLS_UNIT:-minute}, requests_per_unit: 1000000000 }
YAML
ticks=$(getconf CLK_TCK)
binaries=${FLOODGATE_BINARIES:-floodgate=$target/release/floodgate}
labels=(); rls_ports=(); gateways=()
for entry in $binaries; do
    label=${entry%%=*}; binary=${entry#*=}
    admin=$(free_port); rls_port=$(free_port)
    cat > "$work/floodgate-$label.yaml" <<YAML
admin: { listen: "127.0.0.1:$admin" }
rls: { listen: "127.0.0.1:$rls_port", config_dir: "$work/rls" }
store: { backend: redis, url: "redis://127.0.0.1:$redis_port" }
YAML
    RUST_LOG=warn "$binary" serve --config "$work/floodgate-$label.yaml" >/dev/null 2>"$work/floodgate-$label.log" &
    pids+=($!)
    labels+=("$label"); rls_ports+=("$rls_port"); gateways+=($!)
    wait_for "http://127.0.0.1:$admin/healthz"
done

# One point: grpc_load with the given arguments; prints one table line.
point() { # label descriptors grpc_load-args...
    local g
    [[ "$1" =~ ${POINTS:-.} ]] || return 0
    # Each round starts with the next binary: the one that goes last runs measurably slower.
    local n=${#labels[@]} i
    for i in $(seq 0 $((n - 1))); do
        g=$(( (i + round - 1) % n ))
        gateway=${gateways[$g]} rls_port=${rls_ports[$g]} point_on "$1 [${labels[$g]}]" "${@:2}"
    done
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$gateway/stat"; }
point_on() { # label descriptors grpc_load-args...
    local label=$1 descriptors=$2; shift 2
    "$load" -addr "127.0.0.1:$rls_port" -seconds 1 "$@" >/dev/null 2>&1 # warm: connections, windows
    rcli config resetstat >/dev/null
    local before after line calls
    before=$(cpu_ticks)
    line=$("$load" -addr "127.0.0.1:$rls_port" -seconds "$seconds" "$@")
    after=$(cpu_ticks)
    read -r redis_calls redis_usec <<< "$(redis_cost)"
    calls=$(sed -E 's/.* calls=([0-9]+).*/\1/' <<< "$line")
    local rate p50 p99 ok over errors
    rate=$(sed -E 's/.*calls_per_s=([0-9]+).*/\1/' <<< "$line")
    p50=$(sed -E 's/.*p50_ms=([0-9.]+).*/\1/' <<< "$line")
    p99=$(sed -E 's/.*p99_ms=([0-9.]+).*/\1/' <<< "$line")
    ok=$(sed -E 's/.* ok=([0-9]+).*/\1/' <<< "$line")
    over=$(sed -E 's/.*over_limit=([0-9]+).*/\1/' <<< "$line")
    errors=$(sed -E 's/.*errors=([0-9]+).*/\1/' <<< "$line")
    local per_call per_descriptor cpu ratio
    per_call=$(echo "$redis_usec / $calls" | bc -l)
    per_descriptor=$(echo "$per_call / $descriptors" | bc -l)
    ratio=$(echo "$per_descriptor / $reference" | bc -l)
    cpu=$(echo "($after - $before) * 1000000 / $ticks / $calls" | bc -l)
    printf '| %-44s | %7s | %7s | %7s | %6.2f | %6.2f (%4.1fx) | %7.3f | %6.1f | %s ok, %s over, %s err |\n' \
        "$label" "$rate" "$p50" "$p99" "$per_call" "$per_descriptor" "$ratio" "$(echo "$redis_calls / $calls" | bc -l)" "$cpu" "$ok" "$over" "$errors"
}

for round in $(seq "$rounds"); do
    echo "== round $round: reference (redis-benchmark -c 50 -P 2, same Redis)"
    reference=$(reference)
    echo "  INCRBY + EXPIRE = $reference us per descriptor"
    echo "| point | calls/s | p50 ms | p99 ms | Redis us/call | Redis us/descriptor (x ref) | Redis calls/call | gateway CPU us/call | answers |"
    echo "|---|---|---|---|---|---|---|---|---|"
    point "1 caller, 1 conn, 1 descriptor" 1 -callers 1 -conns 1
    point "8 callers, 1 conn, 1 descriptor" 1 -callers 8 -conns 1
    point "8 callers, 4 conns, 1 descriptor" 1 -callers 8 -conns 4
    point "64 callers, 1 conn, 1 descriptor" 1 -callers 64 -conns 1
    point "64 callers, 4 conns, 1 descriptor" 1 -callers 64 -conns 4
    point "1 caller, 1 conn, 3 descriptors" 3 -callers 1 -conns 1 -descriptors 3
    point "64 callers, 4 conns, 3 descriptors" 3 -callers 64 -conns 4 -descriptors 3
    point "64 callers, 4 conns, 1 user over" 1 -callers 64 -conns 4 -user over
done
