#!/usr/bin/env bash
# What a fixed window's decision costs Redis, before and after a change of the Lua library, in
# one Redis and run (issue 35): both libraries are loaded side by side (each under its own
# name) and called by redis-benchmark -c 50 -P 16 on one key, on three, and as a batch of 12
# one-key decisions (what coalescing sends under load), every call admitted (10^9 per hour, the
# window begun before the count); then the reference of issue 35,
# redis-benchmark -c 50 -P 2 of INCRBY and of EXPIRE (envoyproxy/ratelimit's two commands per
# descriptor, their usec per call summed); and the floor: a function that only runs TIME and,
# per key, HGET and HINCRBY, as the lean path does, and replies alike. usec per call from INFO
# commandstats, reset before each; commands run inside a function have lines of their own and
# are not added.
#
#   bash bench/fixed_window_cost.sh [BEFORE (a git revision, default HEAD)] [rounds] [requests]
#
# "after" is the working tree. The library is assembled as script.rs assembles it: the files
# its include_str! lines name, in their order, under a library header.
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:-HEAD}
rounds=${2:-3}
requests=${3:-300000}
for tool in redis-server redis-cli redis-benchmark; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install redis-server redis-tools)" >&2; exit 1; }
done
source bench/common.sh

start_redis
library() { lua_library "$@"; }
library "$before" before | rcli -x function load replace >/dev/null
library work after | rcli -x function load replace >/dev/null
# The floor of any script that decides as the lean path does: TIME, then per key one HGET and
# one HINCRBY, and the same reply, with no logic at all (what is left above it is the library's
# own work).
rcli -x function load replace >/dev/null <<'LUA'
#!lua name=floor
redis.register_function('floor_check', function(keys, args)
  local time = redis.call('TIME')
  local reply = { time[1] * 1000000 + time[2], 1 }
  for i = 1, #keys do
    redis.call('HGET', keys[i], 'f')
    local count = redis.call('HINCRBY', keys[i], 'c', args[2 + 2 * i])
    reply[#reply + 1], reply[#reply + 2], reply[#reply + 3] = 1000000000 - count, 1, -1
  end
  return reply
end)
LUA
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}'); before: $(git rev-parse --short "$before"), after: the working tree; $requests calls per point"

usec_per_call() { # command
    rcli info commandstats | tr -d '\r' | awk -F'[:,=]' -v name="cmdstat_$1" '$1 == name {printf "%.2f", $5 / $3}'
}
measure() { # command-stat pipeline args...
    local command=$1 pipeline=$2; shift 2
    rcli config resetstat >/dev/null
    redis-benchmark -p "$redis_port" -c 50 -P "$pipeline" -n "$requests" -q "$@" >/dev/null 2>&1
    usec_per_call "$command"
}
spec="fixed_window 1000000000 3600000000"
# batch LIB: the arguments of a 'batch' call of 12 one-key decisions.
batch() {
    local lib=$1 i
    batch_args=(FCALL "${lib}_check" 12)
    for i in $(seq 12); do batch_args+=("fgbench:{b}:$lib:$i"); done
    batch_args+=(batch "" 12)
    for i in $(seq 12); do batch_args+=(1 2 "$spec" 1); done
}
echo "| round | before, 1 key | after, 1 key | before, 3 keys | after, 3 keys | before, batch of 12 | after, batch of 12 | floor: 1 key / 3 keys | INCRBY + EXPIRE | after per descriptor (x reference): 1 key / 3 keys / in a batch |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for round in $(seq "$rounds"); do
    declare -A usec=()
    for lib in before after; do
        # The first call of each key begins its window (the full path); the counts follow.
        rcli fcall "${lib}_check" 1 "fgbench:{a}:$lib:one" check "" "$spec" 1 >/dev/null
        rcli fcall "${lib}_check" 3 "fgbench:{a}:$lib:x" "fgbench:{a}:$lib:y" "fgbench:{a}:$lib:z" check "" "$spec" 1 "$spec" 1 "$spec" 1 >/dev/null
        usec[$lib-1]=$(measure fcall 16 FCALL "${lib}_check" 1 "fgbench:{a}:$lib:one" check "" "$spec" 1)
        usec[$lib-3]=$(measure fcall 16 FCALL "${lib}_check" 3 "fgbench:{a}:$lib:x" "fgbench:{a}:$lib:y" "fgbench:{a}:$lib:z" check "" "$spec" 1 "$spec" 1 "$spec" 1)
        batch "$lib"
        rcli "${batch_args[@]}" >/dev/null
        usec[$lib-batch]=$(requests=$((requests / 4)) measure fcall 16 "${batch_args[@]}")
    done
    floor1=$(measure fcall 16 FCALL floor_check 1 "fgbench:{a}:floor:one" check "" "$spec" 1)
    floor3=$(measure fcall 16 FCALL floor_check 3 "fgbench:{a}:floor:x" "fgbench:{a}:floor:y" "fgbench:{a}:floor:z" check "" "$spec" 1 "$spec" 1 "$spec" 1)
    incrby=$(measure incrby 2 INCRBY fgbench:reference 1)
    expire=$(measure expire 2 EXPIRE fgbench:reference 100)
    reference=$(echo "$incrby + $expire" | bc -l)
    ratios=$(echo "${usec[after-1]} ${usec[after-3]} ${usec[after-batch]} $reference" |
        awk '{printf "%.2f (%.1fx) / %.2f (%.1fx) / %.2f (%.1fx)", $1, $1 / $4, $2 / 3, $2 / 3 / $4, $3 / 12, $3 / 12 / $4}')
    printf '| %d | %s | %s | %s | %s | %s | %s | %s / %s | %s + %s = %.2f | %s |\n' "$round" "${usec[before-1]}" "${usec[after-1]}" \
        "${usec[before-3]}" "${usec[after-3]}" "${usec[before-batch]}" "${usec[after-batch]}" "$floor1" "$floor3" "$incrby" "$expire" "$reference" "$ratios"
    rcli flushall >/dev/null
done
