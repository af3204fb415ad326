#!/usr/bin/env bash
# Where a decision that begins a window spends its Redis time (issue 47: "about 55 µs per call
# is the script's own work; find it before redesigning around it"). One Redis, the library of
# the working tree, redis-benchmark as the caller (16 connections, no pipelining: one decision
# per call, as an RLS caller's), a fixed window of 10^9 per second (nothing denied) on
# `fgbench:{user:N}:r:l` with N drawn from `users` (1,000,000 by default: almost every decision
# begins its key's window, the case the issue measured). Each row is one function:
#   library        floodgate's check, as the gateway calls it (the working tree's)
#   before         the same, of revision BEFORE (default HEAD)
#   no fast path   the same library with fixed_windows_at_once skipped (check_one goes to
#                  `decide` at once): what the fast path's failed attempt costs a window start
#   same commands  no logic: the commands a window start runs (TIME, HGET, HLEN, HSET,
#                  PEXPIRE), the same reply
#   bare           no logic: TIME, HGET, HINCRBY (the count path's commands)
#   reference      INCRBY + EXPIRE as two calls (envoyproxy/ratelimit's per descriptor)
# usec per call from INFO commandstats (reset before each; a function's line includes the
# commands it runs, which have lines of their own). Then the library again with two busy loops
# on the machine's cores: commandstats times are wall-clock, so a Redis thread that is
# preempted mid-call is charged the wait.
#
#   bash bench/window_start_cost.sh [rounds] [requests] [users] [BEFORE]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
requests=${2:-200000}
users=${3:-1000000}
before=${4:-HEAD}
for tool in redis-server redis-cli redis-benchmark; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install redis-server redis-tools)" >&2; exit 1; }
done
source bench/common.sh

# check.lua with check_one's fast path attempt skipped (the rest of the library as it is).
no_fast_path() { # file (stdin: its text)
    if [ "$1" = lua/check.lua ]; then
        sed '/^local function check_one/,/^end/ s/^  if SERVER_CLOCK then$/  if false then/'
    else
        cat
    fi
}

start_redis
lua_library work fg | rcli -x function load replace >/dev/null
lua_library "$before" before | rcli -x function load replace >/dev/null
lua_library work nofast no_fast_path | rcli -x function load replace >/dev/null
grep -q "^  if false then" <(lua_library work nofast no_fast_path) || { echo "the fast path's switch was not found in check.lua" >&2; exit 1; }
rcli -x function load replace >/dev/null <<'LUA'
#!lua name=floors
redis.register_function('same_check', function(keys, args)
  local time = redis.call('TIME')
  local now = time[1] * 1000000 + time[2]
  local key = keys[1]
  redis.call('HGET', key, 'f')
  redis.call('HLEN', key)
  local start = now - now % 1000000
  redis.call('HSET', key, 'w', start, 'f', start, 'c', 1)
  redis.call('PEXPIRE', key, 1000)
  return { now, 1, 999999999, 1000000 - now % 1000000, -1 }
end)
redis.register_function('bare_check', function(keys, args)
  local time = redis.call('TIME')
  redis.call('HGET', keys[1], 'f')
  local count = redis.call('HINCRBY', keys[1], 'c', 1)
  return { time[1] * 1000000 + time[2], 1, 1000000000 - count, 1, -1 }
end)
LUA
echo "machine: $(nproc) cores, $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), redis $(redis-server --version | awk '{print $3}'), commit $(git rev-parse --short HEAD) (working tree: the library), before: $(git rev-parse --short "$before"); $requests calls per point over $users users"

# usec per call and calls of `command` since the last reset.
stat() { # command
    rcli info commandstats | tr -d '\r' | awk -F'[:,=]' -v name="cmdstat_$1" '$1 == name {printf "%.2f %d", $5 / $3, $3}'
}
usec_of() { stat "$1" | cut -d' ' -f1; }
run() { # args...
    rcli config resetstat >/dev/null
    redis-benchmark -p "$redis_port" -c 16 -P 1 -n "$requests" -r "$users" -q "$@" >/dev/null 2>&1
}
spec="fixed_window 1000000000 1000000"
key="fgbench:{user:__rand_int__}:r:l"
# The commands one library call ran, per call: name x calls per FCALL (usec per call).
nested() {
    local fcalls; fcalls=$(stat fcall | cut -d' ' -f2)
    for command in time hget hlen hmget del hset pexpire hincrby; do
        stat "$command" | awk -v c="$command" -v f="$fcalls" 'NF == 2 {printf "%s %.2f (%s) ", c, $2 / f, $1}'
    done
}
busy() { (while :; do :; done) & busy1=$!; (while :; do :; done) & busy2=$!; }
unbusy() { kill "$busy1" "$busy2" 2>/dev/null || true; wait "$busy1" "$busy2" 2>/dev/null || true; }

echo "| round | library | before | no fast path | same commands | bare | INCRBY + EXPIRE | library, two busy loops |"
echo "|---|---|---|---|---|---|---|---|"
for round in $(seq "$rounds"); do
    run FCALL fg_check 1 "$key" check "" "$spec" 1
    library_usec=$(usec_of fcall)
    library_nested=$(nested)
    rcli flushall >/dev/null
    run FCALL before_check 1 "$key" check "" "$spec" 1
    before_usec=$(usec_of fcall)
    rcli flushall >/dev/null
    run FCALL nofast_check 1 "$key" check "" "$spec" 1
    nofast_usec=$(usec_of fcall)
    rcli flushall >/dev/null
    run FCALL same_check 1 "$key"
    same_usec=$(usec_of fcall)
    rcli flushall >/dev/null
    run FCALL bare_check 1 "$key"
    bare_usec=$(usec_of fcall)
    rcli flushall >/dev/null
    run INCRBY "$key" 1
    incrby=$(usec_of incrby)
    run EXPIRE "$key" 1
    expire=$(usec_of expire)
    rcli flushall >/dev/null
    busy
    run FCALL fg_check 1 "$key" check "" "$spec" 1
    busy_usec=$(usec_of fcall)
    unbusy
    rcli flushall >/dev/null
    printf '| %d | %s | %s | %s | %s | %s | %s + %s | %s |\n' "$round" "$library_usec" "$before_usec" "$nofast_usec" "$same_usec" "$bare_usec" "$incrby" "$expire" "$busy_usec"
    echo "  library's commands per call: $library_nested"
done
