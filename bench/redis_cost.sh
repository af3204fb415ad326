#!/usr/bin/env bash
# What an exact decision costs Redis, the way Redis sees it (INFO commandstats, usec per call and
# per request), next to minimal scripts making the same decision in the same Redis and run:
#
#   1. redis-benchmark -P 16 -c 50 on one Redis: floodgate's check function (FCALL) and script
#      (EVALSHA) deciding one gcra limit and `per_ip` + two plan limits, a minimal GCRA script
#      (TIME, GET, SET PX; bench/reference/gcra_one.lua) by EVALSHA and as a function, a minimal
#      three-key script (bench/reference/three.lua), an empty EVALSHA and FCALL, INCRBY and
#      EXPIRE (how envoyproxy/ratelimit counts a fixed window; two commands, summed).
#   2. The gateway in exact mode under wrk, every request admitted: Redis usec per request for one
#      limit and for per_ip + two limits, with coalescing (the default) and without; the same
#      gateway on its memory store; nginx in front of the same upstream: req/s of each.
#   3. An abuser at ~100x its limit (100/s, wrk flat out): Redis calls per denied request, with
#      the deny cache (the default) and without.
#
#   bash bench/redis_cost.sh [seconds] [connections]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
connections=${2:-64}
for tool in wrk nginx redis-server redis-cli redis-benchmark; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install wrk nginx redis-server redis-tools)" >&2; exit 1; }
done
cargo build --release -p floodgate-gateway -p floodgate --example overhead --example redis_bench --bin floodgate >/dev/null 2>&1
source bench/common.sh
bench=target/release/examples/redis_bench

upstream_port=$(free_port)
target/release/examples/overhead plain "$upstream_port" & pids+=($!)
wait_for "http://127.0.0.1:$upstream_port/"
redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile '' >/dev/null & pids+=($!)
for _ in $(seq 50); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.1; done
rcli() { redis-cli -p "$redis_port" "$@"; }
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}'); wrk -t1 -c$connections -d${seconds}s"

# One line of INFO commandstats: calls and usec of `command` since the last CONFIG RESETSTAT.
stat() { rcli info commandstats | tr -d '\r' | awk -F'[:,=]' -v name="cmdstat_$1" '$1 == name {print $3, $5}'; }
usec_per_call() { stat "$1" | awk '{ if ($1 > 0) printf "%.2f", $2 / $1; else print "-" }'; }

# --- 1. redis-benchmark, one Redis ----------------------------------------------------------
"$bench" library | rcli -x function load replace >/dev/null
function=$("$bench" function)
script_sha=$("$bench" script | rcli -x script load)
one_sha=$(rcli -x script load < bench/reference/gcra_one.lua)
three_sha=$(rcli -x script load < bench/reference/three.lua)
empty_sha=$(rcli script load "return 1")
{ echo "#!lua name=floodgate_bench_reference"
  echo "redis.register_function('reference_empty', function() return 1 end)"
  echo "redis.register_function('reference_gcra_one', function(KEYS, ARGV)"
  cat bench/reference/gcra_one.lua
  echo "end)"; } | rcli -x function load replace >/dev/null
requests=$((seconds * 50000))
benchmark() { # label command-stat args...
    local label=$1 command=$2; shift 2
    rcli flushall >/dev/null; rcli config resetstat >/dev/null
    redis-benchmark -p "$redis_port" -c 50 -P 16 -n "$requests" -q "$@" >/dev/null 2>&1
    printf '  %-58s %6s us/call\n' "$label" "$(usec_per_call "$command")"
}
# gcra: 10^9 per second (every call admitted): a = burst 10^9, b = emission 1 µs; a spec and a
# cost per limit (see crates/floodgate/lua/check.lua).
one=('gcra 1000000000 1' 1)
three=('gcra 1000000000 1' 1 'gcra 1000000000 1' 1 'fixed_window 1000000000000 86400000000' 1)
# 16 one-limit decisions in one call, as coalescing sends them.
batch=(batch '' 16)
batch_keys=()
for i in $(seq 16); do batch+=(1 "${one[@]}"); batch_keys+=("fg:{ip:b$i}:r:l"); done
echo "== redis-benchmark -c 50 -P 16, same Redis (usec per call, from INFO commandstats)"
benchmark "floodgate FCALL, one gcra limit" fcall FCALL "$function" 1 'fg:{ip:b}:r:l' check '' "${one[@]}"
benchmark "floodgate EVALSHA (no functions), one gcra limit" evalsha EVALSHA "$script_sha" 1 'fg:{ip:b}:r:l' check '' "${one[@]}"
benchmark "minimal GCRA script (TIME GET SET PX), EVALSHA" evalsha EVALSHA "$one_sha" 1 'fg:{ip:b}:r:l' 1 1000000000
benchmark "minimal GCRA script, as a function" fcall FCALL reference_gcra_one 1 'fg:{ip:b}:r:l' 1 1000000000
rcli flushall >/dev/null; rcli config resetstat >/dev/null
redis-benchmark -p "$redis_port" -c 50 -P 16 -n $((requests / 8)) -q FCALL "$function" 16 "${batch_keys[@]}" "${batch[@]}" >/dev/null 2>&1
printf '  %-58s %6s us/decision\n' "floodgate FCALL, 16 coalesced one-limit decisions" "$(stat fcall | awk '{ printf "%.2f", $2 / $1 / 16 }')"
benchmark "floodgate FCALL, per_ip + two plan limits" fcall FCALL "$function" 3 'fg:{ip:b}:ip:ip' 'fg:{key:b}:free:s' 'fg:{key:b}:free:d' check '' "${three[@]}"
benchmark "minimal three-key script, EVALSHA" evalsha EVALSHA "$three_sha" 3 'fg:{ip:b}:ip:ip' 'fg:{key:b}:free:s' 'fg:{key:b}:free:d' 1 1000000000 1000000000000 86400000000
benchmark "empty EVALSHA" evalsha EVALSHA "$empty_sha" 0
benchmark "empty FCALL" fcall FCALL reference_empty 0
benchmark "INCRBY (envoyproxy/ratelimit's count, part 1)" incrby INCRBY 'rl:k' 1
benchmark "EXPIRE (part 2)" expire EXPIRE 'rl:k' 60

# --- 2. the gateway under wrk ---------------------------------------------------------------
store="store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\" }"
start_gateway() { # yaml
    local port admin; port=$(free_port); admin=$(free_port)
    cat > "$work/gw-$port.yaml" <<YAML
listen: "127.0.0.1:$port"
admin: { listen: "127.0.0.1:$admin" }
upstream: "http://127.0.0.1:$upstream_port"
$1
YAML
    RUST_LOG=warn target/release/floodgate serve --config "$work/gw-$port.yaml" >/dev/null 2>"$work/gw-$port.log" &
    pids+=($!)
    wait_for "http://127.0.0.1:$port/"
    started_port=$port
}
one_limit='plans:
  anonymous: { limits: [ { name: per-second, algorithm: gcra, limit: 1000000000, window: 1s } ] }
  free: { limits: [ { name: per-second, algorithm: gcra, limit: 1000000000, window: 1s } ] }'
three_limits='per_ip: [ { name: ip, algorithm: gcra, limit: 1000000000, window: 1s } ]
plans:
  anonymous: { limits: [] }
  free:
    limits:
      - { name: per-second, algorithm: gcra, limit: 1000000000, window: 1s }
      - { name: daily, algorithm: fixed_window, limit: 1000000000000, window: 1d }'
start_gateway "$store
$one_limit"; exact_one=$started_port
start_gateway "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\", coalesce: 0 }
$one_limit"; exact_one_plain=$started_port
start_gateway "$store
$three_limits"; exact_three=$started_port
start_gateway "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\", coalesce: 0 }
$three_limits"; exact_three_plain=$started_port
start_gateway "store: { backend: memory }
$one_limit"; memory_one=$started_port
start_nginx

# wrk against port $2 (with header $3), then the Redis time it cost per request.
load() { # label port [header]
    rcli config resetstat >/dev/null
    if [ -n "${3:-}" ]; then
        wrk -t1 -c"$connections" -d"${seconds}s" -H "$3" "http://127.0.0.1:$2/" > "$work/wrk.txt"
    else
        wrk -t1 -c"$connections" -d"${seconds}s" "http://127.0.0.1:$2/" > "$work/wrk.txt"
    fi
    local rps total non2xx calls usec
    rps=$(awk '/Requests\/sec/ {print $2}' "$work/wrk.txt")
    total=$(awk '/requests in/ {print $1}' "$work/wrk.txt")
    non2xx=$(awk '/Non-2xx/ {print $NF}' "$work/wrk.txt")
    read -r calls usec <<< "$(stat fcall)"
    calls=${calls:-0}; usec=${usec:-0}
    # Every decision that reaches Redis reads its first key once (GET or HMGET, inside the call).
    local gets hmgets reads
    gets=$(stat get | awk '{print $1}'); hmgets=$(stat hmget | awk '{print $1}')
    reads=$(( ${gets:-0} + ${hmgets:-0} ))
    printf '  %-34s %10s req/s  non-2xx %-7s Redis: %7s calls, %5.3f decisions/request, %5.1f decisions/call, %6.2f us/call, %5.2f us/request\n' \
        "$1" "$rps" "${non2xx:-0}" "$calls" "$(echo "$reads / ${LIMITS:-1} / $total" | bc -l)" \
        "$(echo "if ($calls > 0) $reads / ${LIMITS:-1} / $calls else 0" | bc -l)" \
        "$(echo "if ($calls > 0) $usec / $calls else 0" | bc -l)" "$(echo "$usec / $total" | bc -l)"
}
echo "== the gateway under wrk (every request admitted), Redis time from INFO commandstats"
for round in 1 2 3; do
    load "nginx" "$nginx_port"
    load "memory, one limit" "$memory_one"
    load "exact, one limit" "$exact_one"
    load "exact, one limit, no coalescing" "$exact_one_plain"
    LIMITS=3 load "exact, per_ip + 2 limits" "$exact_three" "x-api-key: bench"
    LIMITS=3 load "exact, per_ip + 2, no coalescing" "$exact_three_plain" "x-api-key: bench"
done

# --- 3. an abuser at ~100x its limit ----------------------------------------------------------
abuser='plans:
  anonymous: { limits: [ { name: per-second, algorithm: gcra, limit: 100, window: 1s } ] }
  free: { limits: [] }'
start_gateway "$store
$abuser"; abused=$started_port
start_gateway "store: { backend: redis, url: \"redis://127.0.0.1:$redis_port\", deny_cache: false }
$abuser"; abused_plain=$started_port
echo "== one client flat out against 100/s (gcra, retry window 10 ms): decisions reaching Redis"
for round in 1 2; do
    load "deny cache (default)" "$abused"
    load "no deny cache" "$abused_plain"
done
