#!/usr/bin/python3
"""Issue 41's targets for many sequences at once, in one run.

    python3 bench/compare_serving.py --build build
    python3 bench/compare_serving.py --build build --quick        (smoke test)

Runs build/bench/attn_serving_bench: BM_varlen_prefill (`varlen_attention` over 16 sequences of
64 .. 4096 tokens, causal, 8 query heads over 2 key/value heads, d = 64) and BM_per_sequence_flash
(the same work as one `flash_attention` call per sequence and query head), each on one and on two
threads (the cases set the thread count themselves), in one process per round, --repetitions
rounds, so that every ratio compares neighbours in time. Prints a markdown table with each case's
median time and the two ratios the issue sets: the packed call on one thread within 1.1x of the
per-sequence calls on one thread, and at least 1.8x faster on two threads than on one.
Then, on two threads: BM_paged_decode (one decoding step of a batch in one `PagedKVCache::attend`
call; 32 query heads over 8 key/value heads, d = 128, float16 storage, pages of 16 tokens, the
default, and of 256) beside BM_kvcache_loop (the
same step as one `KVCache::attend` per sequence over the same rows) and BM_stream_sum (what the
machine streams), for 32 sequences of mixed lengths (128k tokens) and for 64 sequences of 64 .. 512
tokens: the batched step's bandwidth for the bytes it reads as a share of the streamed one (target
85%), and its speed over the loop (targets: never slower; 1.5x with the short sequences). And
BM_cache_memory's counters: 64 sequences of 100 .. 8000 tokens in pages against the tokens' own
bytes (target: within 2%) and against one KVCache each. And BM_shared_prefix: a decoding step of
16 sequences forked from one 4096-token prompt with 256 tokens each of their own, with cascades
against each sequence reading the prompt's pages itself (target: 4x).

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
    paged = "BM_paged_decode/batch:%d/page:%d/threads:2"
    cached = "BM_kvcache_loop/batch:%d/threads:2"
    stream = "BM_stream_sum/threads:2"
    memory = "BM_cache_memory/iterations:1"
    shared = "BM_shared_prefix/cascade:%d"
    names += [paged % (0, 16), paged % (0, 256), cached % 0, paged % (1, 16), paged % (1, 256),
              cached % 1, stream, memory, shared % 0, shared % 1]
    log("%s: %d rounds of %s" % (script, args.repetitions, ", ".join(names)))
    rounds = Rounds(binary, names, args, script)
    median = rounds.median

    packed_over_loop = 1.0 / rounds.speedup(loop % 1, varlen % 1)
    two_over_one = rounds.speedup(varlen % 1, varlen % 2)
    rows = [[n, "%.1f" % median(n), "%.1f" % (median(n, "FLOP/s") / 1e9)] for n in names[:4]]
    streamed = median(stream, "bytes_per_second")
    decode_rows = []
    targets = []
    for batch, label, speed_target in ((0, "32 sequences, 128k tokens", 1.0),
                                       (1, "64 sequences of 64 .. 512", 1.5)):
        for page in (16, 256):
            case = paged % (batch, page)
            share = median(case, "bytes_per_second") / streamed
            over_loop = rounds.speedup(cached % batch, case)
            decode_rows.append(["%s, pages of %d" % (label, page),
                                "%.1f" % (median(case) * 1e3),
                                "%.1f" % (median(cached % batch) * 1e3),
                                "%.2fx" % over_loop, "%.0f%%" % (100 * share)])
            which = "%s, pages of %d" % (label, page)
            targets.append(("batched decode, %s: share of the streamed bandwidth >= 85%%" % which,
                            "%.0f%%" % (100 * share), share >= 0.85))
            targets.append(("batched decode, %s: over the loop of KVCache::attend >= %.1fx" %
                            (which, speed_target), "%.2fx" % over_loop,
                            over_loop >= speed_target))
    cascade_speedup = rounds.speedup(shared % 0, shared % 1)
    targets.append(("shared prefix, 16 sequences of 4096 + 256 tokens, cascade over each alone "
                    ">= 4x", "%.2fx" % cascade_speedup, cascade_speedup >= 4.0))
    paged_bytes = median(memory, "paged_bytes")
    token_bytes = median(memory, "token_bytes")
    kvcache_bytes = median(memory, "kvcache_bytes")
    waste = paged_bytes / token_bytes - 1.0
    targets.append(("memory: pages in use over the tokens' own bytes <= 1.02",
                    "%.4f" % (paged_bytes / token_bytes), waste <= 0.02))
    version, flags, build_type = compiler_and_flags(args.build, "attn_serving_bench",
                                                    "serving_bench.cpp")
    print("Machine: %s" % machine_line())
    print("Compiler: %s; %s build, %s" % (version, build_type, flags))
    print("Command: python3 bench/compare_serving.py --build %s; medians of %d rounds" %
          (args.build, args.repetitions))
    print()
    print("\n".join(markdown_table(["case", "ms", "GFLOP/s"], rows, right=(1, 2))))
    print()
    print("Batched decoding step, two threads; streamed bandwidth %.1f GB/s (BM_stream_sum)" %
          (streamed / 1e9))
    print()
    print("\n".join(markdown_table(["batch", "PagedKVCache::attend us", "KVCache::attend loop us",
                                     "speed-up", "% of stream"], decode_rows,
                                    right=(1, 2, 3, 4))))
    print()
    print("Memory, 64 sequences of 100 .. 8000 tokens (float16, 8 key/value heads, d = 128): "
          "pages %.1f MiB, the tokens' own bytes %.1f MiB, one KVCache each %.1f MiB (%.2fx)" %
          (paged_bytes / 2**20, token_bytes / 2**20, kvcache_bytes / 2**20,
           kvcache_bytes / token_bytes))
    print()
    print("Shared prefix, one decoding step of 16 sequences forked from a 4096-token prompt, 256 "
          "tokens each of their own: %.1f us with cascades, %.1f us each reading the prompt "
          "itself" % (median(shared % 1) * 1e3, median(shared % 0) * 1e3))
    print()
    print("| target | measured | |")
    print("|---|---:|---|")
    print("| packed prefill, one thread, over the per-sequence `flash_attention` calls <= %.1fx "
          "| %.2fx | %s |" % (PREFILL_WITHIN, packed_over_loop,
                              verdict(packed_over_loop <= PREFILL_WITHIN)))
    print("| packed prefill, two threads over one >= %.1fx | %.2fx | %s |" %
          (PREFILL_TWO_THREADS, two_over_one, verdict(two_over_one >= PREFILL_TWO_THREADS)))
    for label, measured, ok in targets:
        print("| %s | %s | %s |" % (label, measured, verdict(ok)))


if __name__ == "__main__":
    main()
