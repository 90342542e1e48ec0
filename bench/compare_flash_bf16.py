#!/usr/bin/python3
"""The tiled kernel over bfloat16 keys and values against the float kernel, in one run: issue 13.

    python3 bench/compare_flash_bf16.py --build build                (one thread)
    python3 bench/compare_flash_bf16.py --build build --threads 2
    python3 bench/compare_flash_bf16.py --build build --quick        (smoke test)

Runs build/bench/attn_bench's BM_Flash<float> (float keys and values), BM_FlashBFloat16Keys with
vdpbf16ps:0 (bfloat16 keys and values widened to float, the float kernel's arithmetic) and with
vdpbf16ps:1 (`StoredArithmetic::Reduced`: score and value tiles by AVX512_BF16's vdpbf16ps,
where the CPU has it) for n = 512 and 2048, d = 64 and 128, full and causal, in one process,
--repetitions rounds (each case >= --min-time seconds per round), so that every ratio compares
neighbours in time; and build/bench/attn_peak_fma_bench for the FMA peak. Prints a markdown table:
the float kernel's GFLOP/s and fraction of the peak, and each bfloat16 case's speed-up over it
(the median of the rounds' ratios) and its useful GFLOP/s as a fraction of the same FMA peak.

Issue 13's target for the tiled kernel (3x the float kernel at n = 2048) is for AMX tiles, on a
CPU that has AMX; the script says whether this one does (/proc/cpuinfo).

Standard library only; run it with /usr/bin/python3.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (Rounds, compiler_and_flags, fma_peak, machine_line,  # noqa: E402
                          markdown_table, require_binary, rounds_arguments)


def case(n, d, causal, kind):
    if kind == "float":
        return "BM_Flash<float>/n:%d/d:%d/causal:%d/window:0" % (n, d, causal)
    return "BM_FlashBFloat16Keys/n:%d/d:%d/causal:%d/window:0/vdpbf16ps:%d" % (
        n, d, causal, 1 if kind == "vdpbf16ps" else 0)


def has_amx():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(" amx_bf16" in line for line in cpuinfo if line.startswith("flags"))
    except OSError:
        return False


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = rounds_arguments(parser)
    script = "compare_flash_bf16.py"
    binary = require_binary(args.build, "attn_bench", script)
    shapes = [(n, d, causal) for n in (512, 2048) for d in (64, 128) for causal in (0, 1)]
    kinds = ["float", "widened", "vdpbf16ps"]
    names = [case(n, d, c, k) for n, d, c in shapes for k in kinds]
    peak, peak_label = fma_peak(args.build, args.min_time, script=script)
    rounds = Rounds(binary, names, args, script)
    median, speedup = rounds.median, rounds.speedup

    total_peak = peak * args.threads
    rows = []
    for n, d, causal in shapes:
        base = case(n, d, causal, "float")
        row = [n, d, "causal" if causal else "full",
               "%.1f (%.0f%%)" % (median(base, "FLOP/s") / 1e9,
                                  100 * median(base, "FLOP/s") / total_peak)]
        for kind in kinds[1:]:
            name = case(n, d, causal, kind)
            row.append("%.2f (%.0f%%)" % (speedup(base, name),
                                          100 * median(name, "FLOP/s") / total_peak))
        rows.append(row)
    ran = all(median(case(n, d, c, "vdpbf16ps"), "vdpbf16ps") == 1 for n, d, c in shapes)

    version, flags, build_type = compiler_and_flags(args.build, "attn_bench",
                                                    "attention_bench.cpp")
    print("Machine: %s; %d thread(s); FMA peak %.1f GFLOP/s per core (attn_peak_fma_bench, %s)" %
          (machine_line(), args.threads, peak / 1e9, peak_label or "?"))
    print("Compiler: %s; %s build, %s" % (version, build_type, flags))
    print("Command: python3 bench/compare_flash_bf16.py --build %s --threads %d" %
          (args.build, args.threads))
    print("One head, n queries over n keys; medians of %d rounds; (%%) = useful GFLOP/s as a "
          "fraction of the FMA peak%s" % (args.repetitions,
                                          " times %d" % args.threads if args.threads > 1 else ""))
    print()
    header = ["n", "d", "mask", "float: GFLOP/s (% of peak)", "bfloat16 K/V, widened: x float",
              "bfloat16 K/V, vdpbf16ps: x float"]
    print("\n".join(markdown_table(header, rows, right=range(len(header)))))
    print()
    print("vdpbf16ps %s on this machine (the last column is otherwise the widened path)" %
          ("ran" if ran else "did not run"))
    print("AMX: %s (issue 13's 3x target at n = 2048 is for AMX tiles)" %
          ("this CPU has it; attn has no AMX path yet" if has_amx() else
           "not on this CPU, so no AMX path and no 3x target here"))


if __name__ == "__main__":
    main()
