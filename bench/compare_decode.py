#!/usr/bin/python3
"""One decoding step with the cache in float, float16, bfloat16 and int8, in one run: issue 13's table.

    python3 bench/compare_decode.py --build build                (one thread)
    python3 bench/compare_decode.py --build build --threads 2
    python3 bench/compare_decode.py --build build --quick        (smoke test)

Runs build/bench/attn_decode_bench: BM_stream_sum (what the machine streams at all), then for each
cache length (1k, 4k, 16k tokens; 32 query heads over 8 key/value heads, d = 128) BM_decode_step
(float storage), BM_decode_stored for each reduced format, BM_decode_bf16_arithmetic
(bfloat16 keys, scores by vdpbf16ps where the CPU has AVX512_BF16) and BM_decode_int8_arithmetic
(int8 keys and values, scores by vpdpbusd and values by vpdpwssd where the CPU has AVX512_VNNI),
in one process, --repetitions rounds (each case >= --min-time seconds per round), so that every
ratio compares neighbours in time.
Prints a markdown table: each format's median time, its speed-up over the float step (the median
of the rounds' ratios), the bytes it streams (`KVCache::bytes()`), its bandwidth as a fraction
of BM_stream_sum's, and for the formats computed in float its products' fraction of the FMA peak
(build/bench/attn_peak_fma_bench, run first) and the fraction the speed-up target would take.
Targets (at 16k tokens): float16 and bfloat16 at least 1.8x the float step, int8 at least 3x, each
at 80% or more of the bandwidth for its bytes.
With one thread it then prints where a step's time goes, for the formats computed in float
(BM_decode_phase, same run): per key and key/value head, the scores, the online softmax and the
values each alone, their sum, the whole tile, the step itself, and what the target leaves a step
at 16k tokens (the float step's time over the target speed-up): where the phases alone already
take more, the target is beyond the kernels as they run.

Standard library only; run it with /usr/bin/python3.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (Rounds, compiler_and_flags, fma_peak, log,  # noqa: E402
                          machine_line, markdown_table, peak_share, percent, require_binary,
                          rounds_arguments, verdict)

FORMATS = [(0, "float (Same)"), (1, "Float16"), (2, "BFloat16"), (3, "Int8"),
           (4, "BFloat16, vdpbf16ps"), (5, "Int8, VNNI")]
TARGET_SPEEDUP = {1: 1.8, 2: 1.8, 3: 3.0, 4: 1.8, 5: 3.0}
TARGET_BANDWIDTH = 0.8
TARGET_TOKENS = 16384
# Formats whose scores and values are float multiply-adds on the widened keys and values: their
# step cannot beat its products at the FMA peak.
FLOAT_ARITHMETIC = (0, 1, 2, 3)
QUERY_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def case_name(tokens, storage):
    if storage == 0:
        return "BM_decode_step/tokens:%d" % tokens
    if storage == 4:  # bfloat16 keys with bfloat16 arithmetic (where the CPU has AVX512_BF16)
        return "BM_decode_bf16_arithmetic/tokens:%d" % tokens
    if storage == 5:  # int8 keys with integer arithmetic (where the CPU has AVX512_VNNI)
        return "BM_decode_int8_arithmetic/tokens:%d" % tokens
    return "BM_decode_stored/tokens:%d/storage:%d" % (tokens, storage)


def phase_name(phase, storage):
    """BM_decode_phase: 0 scores, 1 online softmax, 2 values, 3 the whole tile, alone."""
    return "BM_decode_phase/phase:%d/storage:%d" % (phase, storage)


def phase_rows(median, peak_one_core):
    """The phase table: per key and key/value head, each phase alone, their sum, the whole tile,
    the step (at each length) and what the speed-up target leaves a step at 16k tokens."""
    def per_key_ns(name, keys):
        return median(name) * 1e6 / keys

    tile_keys = 8 * 64  # BM_decode_phase: 8 tiles of 64 keys, one per key/value head
    float_step = per_key_ns(case_name(TARGET_TOKENS, 0), TARGET_TOKENS * KV_HEADS)
    rows = []
    for storage, label in FORMATS:
        if storage not in FLOAT_ARITHMETIC:
            continue
        phases = [per_key_ns(phase_name(p, storage), tile_keys) for p in range(4)]
        # 4 heads x 2 d flops per key for the scores, the same for the values
        products = 2.0 * (QUERY_HEADS // KV_HEADS) * HEAD_DIM
        share = [percent(peak_share(products, phases[p] * 1e-6, peak_one_core)) for p in (0, 2)]
        steps = ["%.1f" % per_key_ns(case_name(t, storage), t * KV_HEADS) for t in (1024, 16384)]
        allows = "-"
        if storage in TARGET_SPEEDUP:
            allows = "%.1f" % (float_step / TARGET_SPEEDUP[storage])
        rows.append([label] + ["%.1f" % x for x in phases[:3]] + ["%.1f" % sum(phases[:3]),
                     "%.1f" % phases[3]] + steps + [allows] + share)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = rounds_arguments(parser)
    script = "compare_decode.py"
    binary = require_binary(args.build, "attn_decode_bench", script)
    token_counts = [1024, 4096, 16384]
    names = ["BM_stream_sum"] + [case_name(t, s) for t in token_counts for s, _ in FORMATS]
    names += [phase_name(phase, s) for s in FLOAT_ARITHMETIC for phase in range(4)]
    log("%s: FMA peak (attn_peak_fma_bench) ..." % script)
    peak = fma_peak(args.build, args.min_time, 3, script)[0] * args.threads
    rounds = Rounds(binary, names, args, script)
    median = rounds.median

    stream = median("BM_stream_sum", "bytes_per_second")
    rows = []
    all_met = True
    for tokens in token_counts:
        base = case_name(tokens, 0)
        for storage, label in FORMATS:
            name = case_name(tokens, storage)
            speedup = rounds.speedup(base, name)
            bandwidth = median(name, "bytes_per_second")
            fraction = bandwidth / stream
            bytes_streamed = bandwidth * median(name) / 1e3
            # Q K^T and P V: 2 flops per product, one product per (query head, token, feature) each
            flops = 4.0 * QUERY_HEADS * tokens * HEAD_DIM
            of_peak, needs = "-", "-"
            if storage in FLOAT_ARITHMETIC:
                of_peak = percent(peak_share(flops, median(name), peak))
            target = ""
            if tokens == TARGET_TOKENS and storage in TARGET_SPEEDUP:
                met = speedup >= TARGET_SPEEDUP[storage] and fraction >= TARGET_BANDWIDTH
                all_met = all_met and met
                target = "%s (>= %.1fx, >= %.0f%%)" % (verdict(met), TARGET_SPEEDUP[storage],
                                                       100 * TARGET_BANDWIDTH)
                if storage in FLOAT_ARITHMETIC:
                    needs = percent(peak_share(flops, median(base) / TARGET_SPEEDUP[storage], peak))
            rows.append([tokens, label, "%.1f" % (bytes_streamed / 2**20), "%.3f" % median(name),
                         "%.2f" % speedup, "%.1f" % (bandwidth / 1e9),
                         "%.0f%%" % (100 * fraction), of_peak, needs, target])

    version, flags, build_type = compiler_and_flags(args.build, "attn_decode_bench",
                                                    "decode_bench.cpp")
    print("Machine: %s; %d thread(s); streamed bandwidth %.1f GB/s (BM_stream_sum, same run); "
          "FMA peak %.1f GFLOP/s over the thread(s) (attn_peak_fma_bench, same run)" %
          (machine_line(), args.threads, stream / 1e9, peak / 1e9))
    print("Compiler: %s; %s build, %s" % (version, build_type, flags))
    print("Command: python3 bench/compare_decode.py --build %s --threads %d" %
          (args.build, args.threads))
    print("Shape: 1 query, 32 query heads over 8 key/value heads, d = 128; medians of %d rounds" %
          args.repetitions)
    print()
    header = ["tokens", "storage", "MiB streamed", "step ms", "speed-up over float", "GB/s",
              "% of stream", "% of FMA peak", "FMA % the speed-up target needs", "target"]
    print("\n".join(markdown_table(header, rows, right=range(len(header) - 1))))
    print()
    for storage, counter, label in ((4, "vdpbf16ps", "BFloat16, vdpbf16ps"),
                                    (5, "vnni", "Int8, VNNI")):
        ran = median(case_name(TARGET_TOKENS, storage), counter)
        print("%s %s on this machine (the row '%s' is otherwise the float path)"
              % (counter, "ran" if ran else "did not run", label))
    print("% of FMA peak: 4 x 32 heads x tokens x 128 flops (the products of Q K^T and P V) over "
          "the step's time, for the formats computed by float multiply-adds (the integer and "
          "vdpbf16ps rows: -); the target column's need is that count over the float step's "
          "time / the target: above 100%, float arithmetic cannot meet it on this machine")
    print("Targets at %d tokens: %s" % (TARGET_TOKENS, verdict(all_met)))
    if args.threads == 1:
        print()
        print("Where a step's time goes (BM_decode_phase, same run): ns per key and key/value head "
              "(4 query heads); the phases alone over 8 tiles of 64 keys in the second-level "
              "cache, the whole tile (`decode_tile`), the step over the cache, and the float step "
              "at %d tokens over the speed-up target" % TARGET_TOKENS)
        print()
        header = ["storage", "scores", "softmax", "values", "sum of the three", "tile",
                  "step, 1k tokens", "step, 16k tokens", "the target allows", "scores % of FMA peak",
                  "values % of FMA peak"]
        print("\n".join(markdown_table(header, phase_rows(median, peak),
                                       right=range(1, len(header)))))


if __name__ == "__main__":
    main()
