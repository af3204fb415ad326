#!/usr/bin/env bash
# Redis time of the sharing scripts (INFO commandstats, usec per EVALSHA), in one Redis and one
# run: lua/region_global.lua as it was at REV (default 2100a6a, before the max-min split moved to
# lua/max_min.lua) against this tree's, 20,000 trades each, two alternating rounds; then
# lua/quota_share.lua, 20,000 claims among 10 holders.
#
#   bash bench/sharing_scripts.sh [REV]
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port $port --save '' --appendonly no --daemonize no --logfile '' >/dev/null &
rpid=$!; trap "kill $rpid; rm -rf $work" EXIT
for _ in $(seq 50); do redis-cli -p $port ping >/dev/null 2>&1 && break; sleep 0.1; done
git show "${1:-2100a6a}":crates/floodgate/lua/region_global.lua > "$work"/old.lua
{ cat crates/floodgate/lua/max_min.lua; echo; cat crates/floodgate/lua/region_global.lua; } > "$work"/new.lua
{ cat crates/floodgate/lua/max_min.lua; echo; cat crates/floodgate/lua/quota_share.lua; } > "$work"/quota.lua
old=$(redis-cli -p $port -x script load < "$work"/old.lua)
new=$(redis-cli -p $port -x script load < "$work"/new.lua)
quota=$(redis-cli -p $port -x script load < "$work"/quota.lua)
gen() { # sha n
  for i in $(seq $2); do
    r=$((i % 3))
    echo "EVALSHA $1 5 rec{l} press{l} born{l} gen{l} rep{l} r$r r0,r1,r2 60000 0 1000 1 lim \"token_bucket 100 1000000 100\" 100 $((20 + i % 40)) $((30 + i % 50)) 0 1"
  done > "$work/$1.txt"
}
genq() { for i in $(seq $2); do echo "EVALSHA $1 1 q{l} claim h$((i % 10)) 100000 4000 $((5000 + (i % 7) * 3000)) 0 15000 1000"; done > "$work/q.txt"; }
gen $old 20000; gen $new 20000; genq $quota 20000
cost() { redis-cli -p $port info commandstats | tr -d '\r' | awk -F'[:,=]' '/^cmdstat_evalsha:/ {printf "%d calls, %.2f usec per call", $3, $5/$3}'; }
for round in 1 2; do
  for which in old new; do
    sha=$([ $which = old ] && echo $old || echo $new)
    redis-cli -p $port flushall >/dev/null; redis-cli -p $port config resetstat >/dev/null
    redis-cli -p $port < "$work/$sha.txt" > /dev/null
    echo "round $round region_global $which: $(cost)"
  done
done
redis-cli -p $port flushall >/dev/null; redis-cli -p $port config resetstat >/dev/null
redis-cli -p $port < "$work/q.txt" > /dev/null
echo "quota_share claim (10 holders): $(cost)"

