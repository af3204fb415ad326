"""Median ratios of wrk runs to a reference side, round by round.

Reads lines `row connections side round requests_per_second p99` (p99 as wrk prints it:
`812.00us`, `1.20ms`, `2s`) and prints, for each row and number of connections, each other
side's median ratio to REFERENCE of requests per second and of p99 over the rounds both ran.

    python3 bench/ratios.py REFERENCE RESULTS
"""

import re
import statistics
import sys


def milliseconds(text):
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def main(reference, path):
    runs = {}
    for line in open(path):
        row, connections, side, round_, rps, p99 = line.split()
        by_round = runs.setdefault((row, int(connections)), {}).setdefault(side, {})
        by_round[round_] = (float(rps), milliseconds(p99))
    for (row, connections), sides in sorted(runs.items(), key=lambda item: (item[0][1], item[0][0])):
        base = sides[reference]
        for side, by_round in sorted(sides.items()):
            if side == reference:
                continue
            rounds = [r for r in by_round if r in base]
            rps = statistics.median(by_round[r][0] / base[r][0] for r in rounds)
            p99 = statistics.median(by_round[r][1] / base[r][1] for r in rounds)
            print(f"{row:<18} {side:<7} c={connections:<3} req/s {rps:.2f}x   p99 {p99:.2f}x   "
                  f"({len(rounds)} rounds)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
