#!/usr/bin/python3
"""Attention backward over its forward, in one run: the ratio table of issue 12.

    python3 bench/compare_backward.py --build build              (one thread)
    python3 bench/compare_backward.py --build build --threads 2
    python3 bench/compare_backward.py --build build --quick      (smoke test: n <= 1024)

Runs build/bench/attn_backward_bench: for each shape (n = 512 .. 4096, d = 64, 1 and 8 heads,
causal and not) BM_Forward (flash_attention with the log-sum-exp) and BM_Backward
(attention_backward from that forward's output and log-sum-exp) one after the other, --repetitions
times (each a Google Benchmark run of >= --min-time seconds), so that both sides of each ratio see
the same machine state. Prints a markdown table of wall-clock medians, the median of the rounds'
backward / forward, the backward's FLOP/s (10 n^2 d per head, halved when
causal: the five products S, dP, dV, dK, dQ) as a fraction of the single-core FMA peak
(build/bench/attn_peak_fma_bench, measured before and after, the best kept; times the thread
count), and the target: backward at most 2.5x the forward (FlashAttention-2 counts the backward as
2.5x the forward's flops).

Standard library only; run it with /usr/bin/python3.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (benchmark_names, compiler_and_flags, fma_peak, log,  # noqa: E402
                          machine_line, markdown_table, require_binary, rounds_arguments,
                          run_benchmarks, threads_env, verdict)

TARGET = 2.5


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = rounds_arguments(parser, quick_help="n <= 1024, one short round")
    script = "compare_backward.py"
    binary = require_binary(args.build, "attn_backward_bench", script)

    peak_before, _ = fma_peak(args.build, 0.2, script=script)
    env = threads_env(args.threads)
    rows = []
    results = []
    for name in benchmark_names(binary, "^BM_Backward<"):
        fields = dict(part.split(":") for part in name.split("/")[1:])
        n, heads, causal = int(fields["n"]), int(fields["heads"]), fields["causal"] == "1"
        if args.quick and n > 1024:
            continue
        forward = name.replace("BM_Backward<", "BM_Forward<")
        log("%s: %s" % (script, name))
        # Forward and backward alternate, one repetition each, `repetitions` times: each ratio
        # compares two neighbours in time, and the median of the ratios is reported.
        rounds = [run_benchmarks(binary, [forward, name], env, 1, args.min_time, warmup_s=0.1,
                                 script=script)[0] for _ in range(args.repetitions)]
        results.append((n, heads, causal, [r[forward] for r in rounds], [r[name] for r in rounds]))
    peak_after, _ = fma_peak(args.build, 0.2, script=script)
    peak = max(peak_before, peak_after) * args.threads

    all_met = True
    for n, heads, causal, fwd, bwd in results:
        ratio = statistics.median(b["median_ms"] / f["median_ms"] for f, b in zip(fwd, bwd))
        fwd_ms = statistics.median(f["median_ms"] for f in fwd)
        bwd_ms = statistics.median(b["median_ms"] for b in bwd)
        fwd_flops = statistics.median(f["counters"]["FLOP/s"] for f in fwd)
        bwd_flops = statistics.median(b["counters"]["FLOP/s"] for b in bwd)
        met = ratio <= TARGET
        all_met = all_met and met
        rows.append([n, heads, "yes" if causal else "no", "%.2f" % fwd_ms, "%.2f" % bwd_ms,
                     "%.2f" % ratio, "%.0f%%" % (100 * bwd_flops / peak),
                     "%.0f%%" % (100 * fwd_flops / peak), verdict(met)])

    version, flags, build_type = compiler_and_flags(args.build, "attn_backward_bench",
                                                    "backward_bench.cpp")
    print("Machine: %s; %d thread(s); FMA peak %.0f GFLOP/s per core (attn_peak_fma_bench, same "
          "run)" % (machine_line(), args.threads, peak / args.threads / 1e9))
    print("Compiler: %s; %s build, %s" % (version, build_type, flags))
    print("Command: python3 bench/compare_backward.py --build %s --threads %d" %
          (args.build, args.threads))
    print()
    header = ["n", "heads", "causal", "forward ms", "backward ms", "backward / forward",
              "backward % peak", "forward % peak", "<= %.1fx" % TARGET]
    print("\n".join(markdown_table(header, rows, right=range(len(header)))))
    print()
    print("Target backward <= %.1fx forward on every shape: %s" % (TARGET, verdict(all_met)))


if __name__ == "__main__":
    main()
