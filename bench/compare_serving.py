#!/usr/bin/python3
"""Issue 41's targets for many sequences at once, in one run: the packed prefill so far.

    python3 bench/compare_serving.py --build build
    python3 bench/compare_serving.py --build build --quick        (smoke test)

Runs build/bench/attn_serving_bench: BM_varlen_prefill (`varlen_attention` over 16 sequences of
64 .. 4096 tokens, causal, 8 query heads over 2 key/value heads, d = 64) and BM_per_sequence_flash
(the same work as one `flash_attention` call per sequence and query head), each on one and on two
threads (the cases set the thread count themselves), in one process per round, --repetitions
rounds, so that every ratio compares neighbours in time. Prints a markdown table with each case's
median time and the two ratios the issue sets: the packed call on one thread within 1.1x of the
per-sequence calls on one thread, and at least 1.8x faster on two threads than on one.

Standard library only; run it with /usr/bin/python3.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (Rounds, compiler_and_flags, log, machine_line,  # noqa: E402
                          markdown_table, require_binary, rounds_arguments, verdict)

PREFILL_WITHIN = 1.1
PREFILL_TWO_THREADS = 1.8


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = rounds_arguments(parser)
    script = "compare_serving.py"
    binary = require_binary(args.build, "attn_serving_bench", script)
    varlen = "BM_varlen_prefill/threads:%d"
    loop = "BM_per_sequence_flash/threads:%d"
    names = [varlen % 1, loop % 1, varlen % 2, loop % 2]
    log("%s: %d rounds of %s" % (script, args.repetitions, ", ".join(names)))
    rounds = Rounds(binary, names, args, script)
    median = rounds.median

    packed_over_loop = 1.0 / rounds.speedup(loop % 1, varlen % 1)
    two_over_one = rounds.speedup(varlen % 1, varlen % 2)
    rows = [[n, "%.1f" % median(n), "%.1f" % (median(n, "FLOP/s") / 1e9)] for n in names]
    version, flags, build_type = compiler_and_flags(args.build, "attn_serving_bench",
                                                    "serving_bench.cpp")
    print("Machine: %s" % machine_line())
    print("Compiler: %s; %s build, %s" % (version, build_type, flags))
    print("Command: python3 bench/compare_serving.py --build %s; medians of %d rounds" %
          (args.build, args.repetitions))
    print()
    print("\n".join(markdown_table(["case", "ms", "GFLOP/s"], rows, right=(1, 2))))
    print()
    print("| target | measured | |")
    print("|---|---:|---|")
    print("| packed prefill, one thread, over the per-sequence `flash_attention` calls <= %.1fx "
          "| %.2fx | %s |" % (PREFILL_WITHIN, packed_over_loop,
                              verdict(packed_over_loop <= PREFILL_WITHIN)))
    print("| packed prefill, two threads over one >= %.1fx | %.2fx | %s |" %
          (PREFILL_TWO_THREADS, two_over_one, verdict(two_over_one >= PREFILL_TWO_THREADS)))


if __name__ == "__main__":
    main()
