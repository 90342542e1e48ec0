#!/usr/bin/python3
"""Two builds of one benchmark binary, compared in one run: whole processes in turn.

    python3 bench/compare_builds.py --before OLD/bench/attn_bench --after build/bench/attn_bench \
        --filter 'BM_Flash<float>' --rounds 4

Runs the two binaries one after the other (before, after; then after, before; ...) for --rounds
rounds, each with --benchmark_filter, one thread (OMP_NUM_THREADS=1) and, with --cpu, pinned to
that CPU (taskset). Prints a markdown table: each benchmark's median time per build over the rounds
and their ratio after / before (below 1: the after build is faster), then the ratios' median and
range. A change is compared against its parent this way (docs/benchmarks.md, "From one process to
the next": the same binary moves between processes, so ratios come from alternating rounds).

Standard library only; run it with /usr/bin/python3.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def run(binary, pattern, min_time, cpu):
    command = [binary, "--benchmark_filter=" + pattern, "--benchmark_min_time=%g" % min_time,
               "--benchmark_format=json"]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu)] + command
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return {b["name"]: b["real_time"] for b in json.loads(done.stdout)["benchmarks"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the benchmark binary of the old build")
    parser.add_argument("--after", required=True, help="the same binary of the new build")
    parser.add_argument("--filter", required=True, help="--benchmark_filter for both")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    parser.add_argument("--min-time", type=float, default=0.1, help="seconds per case per round")
    parser.add_argument("--cpu", type=int, default=None, help="pin both to this CPU (taskset)")
    args = parser.parse_args()
    for binary in (args.before, args.after):
        if not os.access(binary, os.X_OK):
            sys.exit("not an executable: " + binary)

    times = {"before": {}, "after": {}}
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for build in order:
            binary = args.before if build == "before" else args.after
            for name, t in run(binary, args.filter, args.min_time, args.cpu).items():
                times[build].setdefault(name, []).append(t)
        print("round %d of %d done" % (r + 1, args.rounds), file=sys.stderr)

    names = [name for name in times["after"] if name in times["before"]]
    if not names:
        sys.exit("no benchmark matched --filter in both builds")
    print("| benchmark | before | after | after / before |")
    print("|---|---:|---:|---:|")
    ratios = []
    for name in names:
        before = statistics.median(times["before"][name])
        after = statistics.median(times["after"][name])
        ratios.append(after / before)
        print("| %s | %.4g | %.4g | %.3f |" % (name, before, after, after / before))
    print()
    print("after / before over %d benchmarks, %d rounds: median %.3f, range %.3f-%.3f"
          % (len(ratios), args.rounds, statistics.median(ratios), min(ratios), max(ratios)))


if __name__ == "__main__":
    main()
