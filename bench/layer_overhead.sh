#!/usr/bin/env bash
# Layer overhead: the same axum hello-world plain, behind floodgate's RateLimitLayer (memory
# store, peer IP) and behind its peer tower_governor 0.8 (headers on, peer IP), under the same
# loopback wrk load, rotating through the three in each round of one session. Prints
# requests/s and latency per run, then each round's ratios and their medians. Also the
# server's own CPU time (user + system, from /proc) per request: wrk shares the two cores, so
# requests/s mixes the server's cost with the load generator's; the CPU per request does not,
# and its excess over plain axum is what each layer costs under load.
#
#   bash bench/layer_overhead.sh [duration-seconds] [connections] [rounds] [ietf]
# With `ietf`, each round also runs floodgate's layer sending the IETF set alone (two headers,
# as many as tower_governor sends).
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-8}
connections=${2:-64}
rounds=${3:-7}
with_ietf=${4:-}
command -v wrk >/dev/null || { echo "wrk is missing: apt-get install wrk" >&2; exit 1; }
cargo build --release -p floodgate --example overhead >/dev/null 2>&1
server=target/release/examples/overhead
results=$(mktemp)
trap 'rm -f "$results"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

run() { # round mode
    local port; port=$(free_port)
    "$server" "$2" "$port" & local pid=$!
    for _ in $(seq 50); do curl -fs "http://127.0.0.1:$port/" >/dev/null 2>&1 && break; sleep 0.1; done
    local ticks_before ticks_after
    ticks_before=$(cpu_ticks "$pid")
    wrk -t1 -c"$connections" -d"${duration}s" --latency "http://127.0.0.1:$port/" > "/tmp/overhead-$2.txt"
    ticks_after=$(cpu_ticks "$pid")
    kill "$pid"; wait "$pid" 2>/dev/null || true
    local rps p50 p99 requests cpu_us
    rps=$(awk '/Requests\/sec/ {print $2}' "/tmp/overhead-$2.txt")
    p50=$(awk '$1=="50%" {print $2}' "/tmp/overhead-$2.txt")
    p99=$(awk '$1=="99%" {print $2}' "/tmp/overhead-$2.txt")
    requests=$(awk '/requests in/ {print $1}' "/tmp/overhead-$2.txt")
    cpu_us=$(python3 -c "print(f'{($ticks_after - $ticks_before) * 1e6 / $ticks_per_second / $requests:.2f}')")
    printf 'round %s %-9s %12s req/s   p50 %8s   p99 %8s   server CPU %s us/request\n' \
        "$1" "$2" "$rps" "$p50" "$p99" "$cpu_us"
    echo "$1 $2 $rps $cpu_us" >> "$results"
}

ticks_per_second=$(getconf CLK_TCK)
cpu_ticks() { # pid -> user + system clock ticks the process has used
    awk '{print $14 + $15}' "/proc/$1/stat"
}

echo "wrk -t1 -c$connections -d${duration}s, $rounds rounds, server: tokio multi-thread on $(nproc) cores, loopback"
modes=(plain limited governor)
[ "$with_ietf" = ietf ] && modes+=(ietf)
for round in $(seq "$rounds"); do
    # Rotate the order so that no mode always runs first (or last) in a round.
    for offset in $(seq 0 $(( ${#modes[@]} - 1 ))); do
        run "$round" "${modes[$(( (round + offset) % ${#modes[@]} ))]}"
    done
done

python3 - "$results" <<'PY'
import statistics, sys
rates, cpu = {}, {}
for line in open(sys.argv[1]):
    round_, mode, rps, us = line.split()
    rates.setdefault(int(round_), {})[mode] = float(rps)
    cpu.setdefault(int(round_), {})[mode] = float(us)
vs_governor, vs_plain, governor_vs_plain, ours, theirs = [], [], [], [], []
print("round  floodgate/tower_governor  floodgate/plain  tower_governor/plain   CPU over plain (us): floodgate  tower_governor")
for round_, r in sorted(rates.items()):
    vs_governor.append(r["limited"] / r["governor"])
    vs_plain.append(r["limited"] / r["plain"])
    governor_vs_plain.append(r["governor"] / r["plain"])
    c = cpu[round_]
    ours.append(c["limited"] - c["plain"])
    theirs.append(c["governor"] - c["plain"])
    print(f"{round_:>5}  {vs_governor[-1]:>24.2f}  {vs_plain[-1]:>15.2f}  {governor_vs_plain[-1]:>20.2f}   {ours[-1]:>30.2f}  {theirs[-1]:>14.2f}")
median = statistics.median
print(f"median {median(vs_governor):>23.2f}  {median(vs_plain):>15.2f}  {median(governor_vs_plain):>20.2f}   {median(ours):>30.2f}  {median(theirs):>14.2f}")
if all("ietf" in r for r in rates.values()):
    ietf_vs_governor = [r["ietf"] / r["governor"] for r in rates.values()]
    ietf_cpu = [cpu[round_]["ietf"] - cpu[round_]["plain"] for round_ in rates]
    print(f"the IETF headers alone: floodgate/tower_governor median {median(ietf_vs_governor):.2f} "
          f"({min(ietf_vs_governor):.2f}-{max(ietf_vs_governor):.2f}), "
          f"CPU over plain {median(ietf_cpu):.2f} us")
PY
