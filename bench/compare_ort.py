#!/usr/bin/python3
"""Attention and the score kernel: attn against ONNX Runtime's best graph, interleaved in one run.

    python3 bench/compare_ort.py --build build [--markdown ort.md]
    python3 bench/compare_ort.py --build build --quick --sizes 512 --threads 1   (smoke test)

For each n (default 512, 2048, 4096) and each thread count (default 1, 2), runs in turn
  - our Google Benchmark binary build/bench/attn_bench, OMP_NUM_THREADS=<threads>: the score kernel
    (BM_Scores), `flash_attention` for one head (BM_Flash) and `attention_heads` for 8 heads
    (BM_Heads), full and causal, float32, d = 64, n = m, every call into caller storage;
  - the peer ../shared/peers/ort_attention.js (ONNX Runtime 1.30 from npm, in --ort-dir) with
    ORT_NS=<n> and --threads <threads> (intraOpNumThreads), which times the same shapes through
    the com.microsoft MultiHeadAttention operator, the opset-23 Attention operator and a plain
    MatMul/Softmax/MatMul graph (one head), after checking each against a float64 reference;
so that the machine's noise at that moment hits both sides alike (the order alternates). The FMA
peak (build/bench/attn_peak_fma_bench) is measured at the start and at the end, and the best of the
two is used. Prints markdown: ORT's best valid graph / attn per op, n, heads and threads, both
sides' fraction of the FMA peak (times the thread count) and the fraction attn would need for the
ratio target, the two-thread speed-ups, causal / full, and the targets of issue 11 with PASS or
MISS. Standard library only; run it with /usr/bin/python3.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (compiler_and_flags, fma_peak, log, machine_line,  # noqa: E402
                          markdown_table, peak_share, percent, require_binary, run_benchmarks,
                          threads_env, verdict)

SCRIPT = "compare_ort.py"
D = 64
HEADS = (1, 8)
OPS = ("full", "causal", "score")
LABELS = {"full": "full attention", "causal": "causal", "score": "score kernel"}
# Our case for (op, heads).
OURS = {
    ("full", 1): "BM_Flash<float>/n:{n}/d:64/causal:0/window:0",
    ("causal", 1): "BM_Flash<float>/n:{n}/d:64/causal:1/window:0",
    ("full", 8): "BM_Heads<float>/n:{n}/d:64/heads:8/causal:0",
    ("causal", 8): "BM_Heads<float>/n:{n}/d:64/heads:8/causal:1",
    ("score", 1): "BM_Scores<float>/n:{n}/d:64",
}
# The peer's graphs (its CSV `op` column) that compute (op, heads); the best valid one counts.
ORT_GRAPHS = {
    ("full", 1): ["attention_mha", "attention_attn23", "attention_matmul"],
    ("full", 8): ["attention_mha", "attention_attn23"],
    ("causal", 1): ["causal_mha", "causal_attn23", "causal_matmul"],
    ("causal", 8): ["causal_mha", "causal_attn23"],
    ("score", 1): ["score"],
}
CHECK_TOLERANCE = 1e-4  # max |error| against float64 at n = 128 for a graph to count
NPM_INSTALL = ("mkdir -p {dir} && cd {dir} && npm init -y && "
               "npm install --ignore-scripts onnxruntime-node@1.30.0 onnx-proto@8.0.1")
# Issue 11's targets.
FULL_RATIO = 1.3
FULL_PEAK = 0.70
PEAK_AT_N = 2048
SPEEDUP = 1.8
CAUSAL_RATIO = 3.0
CAUSAL_OVER_FULL = 0.55
CAUSAL_FROM_N = 2048


def useful_flops(op, n, heads):
    """Q K^T and P V over the visible pairs (causal: half), per call; the score kernel Q K^T."""
    pairs = n * n * (0.5 if op == "causal" else 1.0)
    return (2.0 if op == "score" else 4.0) * pairs * D * heads


def cases():
    return [(op, heads) for op in OPS for heads in HEADS if (op, heads) in OURS]


# --------------------------------------------------------------------------------------------
# The two sides
# --------------------------------------------------------------------------------------------


def run_ours(binary, n, threads, args):
    names = [OURS[c].format(n=n) for c in cases()]
    runs, context = run_benchmarks(binary, names, threads_env(threads), args.repetitions,
                                   args.min_time, args.warmup, SCRIPT)
    for c in cases():
        run = runs[OURS[c].format(n=n)]
        log("[attn] %s heads=%d n=%d threads=%d: %.3f ms (runs %s)"
            % (c[0], c[1], n, threads, run["median_ms"],
               ", ".join("%.3f" % r for r in run["runs_ms"])))
    return {c: runs[OURS[c].format(n=n)]["median_ms"] for c in cases()}, context


def parse_check(line):
    """{graph: max |error| or None for a failure} from the peer's '# onnxruntime-node ...' line."""
    try:
        checks = json.loads(line[line.index("{"):])
    except ValueError:
        return {}
    parsed = {}
    for graph, value in checks.items():
        try:
            parsed[graph] = float(value)
        except ValueError:
            parsed[graph] = None
    return parsed


def graph_valid(graph, checks):
    """Whether a CSV op (attention_mha, causal_attn23, score, ...) passed the peer's check."""
    if graph == "score":
        return True  # MatMul and Mul only; the peer does not check it
    kind, causal = graph.split("_", 1)[1], graph.startswith("causal")
    error = checks.get(kind + ("_causal" if causal else ""))
    return error is not None and error <= CHECK_TOLERANCE


def run_ort(node, peer, ort_dir, n, threads):
    env = threads_env(threads)
    env.update({"ORT_DIR": ort_dir, "ORT_NS": str(n)})
    cmd = [node, peer, "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True)
    if proc.returncode != 0:
        sys.exit("%s: %s failed (exit %d):\n%s" % (SCRIPT, " ".join(cmd), proc.returncode,
                                                  proc.stderr.strip()))
    version, checks, times = "?", {}, {}
    for line in proc.stdout.splitlines():
        if line.startswith("# onnxruntime-node"):
            version = line.split()[2]
            checks = parse_check(line)
        elif line.startswith("ort-"):
            fields = line.split(",")
            graph, rows, heads, ms = fields[1], int(fields[2]), int(fields[4]), float(fields[7])
            if rows == n and ms == ms:  # NaN: the graph failed to run
                times[(graph, heads)] = ms
    best = {}
    for c in cases():
        valid = [(times[(g, c[1])], g) for g in ORT_GRAPHS[c]
                 if (g, c[1]) in times and graph_valid(g, checks)]
        best[c] = min(valid) if valid else (float("nan"), "none valid")
        log("[ort]  %s heads=%d n=%d threads=%d: %.3f ms (%s)"
            % (c[0], c[1], n, threads, best[c][0], best[c][1]))
    return best, {"version": version, "checks": checks}


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def fmt(value, digits=3):
    return "n/a" if value != value else "%.*f" % (digits, value)


def main_rows(sizes, threads_list, ours, theirs, peak, targets):
    rows = []
    for op, heads in cases():
        for n in sizes:
            for t in threads_list:
                mine, (other, graph) = ours[(n, t)][(op, heads)], theirs[(n, t)][(op, heads)]
                ratio = other / mine
                fraction = peak_share(useful_flops(op, n, heads), mine, peak * t)
                peer_fraction = peak_share(useful_flops(op, n, heads), other, peak * t)
                wanted, ok, needs = "", None, "-"
                if op == "full":
                    wanted, ok = ">= %.1fx" % FULL_RATIO, ratio >= FULL_RATIO
                    needs = percent(FULL_RATIO * peer_fraction)
                    if t == 1 and n == PEAK_AT_N:
                        wanted += ", >= %.0f%% peak" % (100 * FULL_PEAK)
                        ok = ok and fraction >= FULL_PEAK
                elif op == "causal" and n >= CAUSAL_FROM_N:
                    wanted, ok = ">= %.0fx" % CAUSAL_RATIO, ratio >= CAUSAL_RATIO
                    needs = percent(CAUSAL_RATIO * peer_fraction)
                if ok is not None:
                    targets.append(ok)
                rows.append([LABELS[op], n, heads, t, fmt(mine), fmt(other), graph, fmt(ratio, 2),
                             percent(fraction), percent(peer_fraction), needs,
                             wanted or "-", "-" if ok is None else verdict(ok)])
    return rows


def speedup_rows(sizes, threads_list, ours, theirs, targets):
    rows = []
    for t in [t for t in threads_list if t != 1]:
        for op, heads in cases():
            for n in sizes:
                one, many = ours[(n, 1)][(op, heads)], ours[(n, t)][(op, heads)]
                peer = theirs[(n, 1)][(op, heads)][0] / theirs[(n, t)][(op, heads)][0]
                ok = one / many >= SPEEDUP if op == "full" and t == 2 else None
                if ok is not None:
                    targets.append(ok)
                rows.append([LABELS[op], n, heads, t, fmt(one), fmt(many), fmt(one / many, 2),
                             fmt(peer, 2), ">= %.1fx" % SPEEDUP if ok is not None else "-",
                             "-" if ok is None else verdict(ok)])
    return rows


def causal_rows(sizes, threads_list, ours, targets):
    rows = []
    for heads in HEADS:
        for n in sizes:
            for t in threads_list:
                causal, full = ours[(n, t)][("causal", heads)], ours[(n, t)][("full", heads)]
                ok = causal / full <= CAUSAL_OVER_FULL if n >= CAUSAL_FROM_N else None
                if ok is not None:
                    targets.append(ok)
                rows.append([n, heads, t, fmt(causal), fmt(full), fmt(causal / full, 2),
                             "<= %.2f" % CAUSAL_OVER_FULL if ok is not None else "-",
                             "-" if ok is None else verdict(ok)])
    return rows


def report(args, sizes, threads_list, ours, theirs, contexts, peak, ort_info, seconds):
    context = contexts[(sizes[0], threads_list[0])]
    compiler, flags, build_type = compiler_and_flags(args.build, "attn_bench",
                                                     "attention_bench.cpp")
    compiler = context.get("compiler", compiler)
    node_version = subprocess.run([args.node, "--version"], stdout=subprocess.PIPE,
                                  universal_newlines=True).stdout.strip()
    attn_threads = {t: contexts[(sizes[0], t)].get("attn_threads", "?") for t in threads_list}
    lines = ["## attn vs ONNX Runtime: float32, d = 64, n = m, one run", ""]
    lines.append("- machine: %s" % machine_line())
    lines.append("- attn: %s, build type %s, flags `%s`; Eigen %s, SIMD %s"
                 % (compiler, build_type, flags, context.get("eigen_version", "?"),
                    context.get("eigen_simd", "?")))
    lines.append("- FMA peak: %.1f GFLOP/s on one core (`attn_peak_fma_bench`, %s; best of the "
                 "runs at the start and the end); the fraction of peak of a t-thread row is "
                 "against t times it" % (peak[0] * 1e-9, peak[1] or "?"))
    lines.append("- ONNX Runtime: onnxruntime-node %s on Node.js %s, CPU execution provider; "
                 "graphs checked against float64 at n = 128 (max |error|): %s"
                 % (ort_info["version"], node_version,
                    ", ".join("%s %s" % (g, "FAIL" if e is None else "%.1e" % e)
                              for g, e in sorted(ort_info["checks"].items()))))
    lines.append("- threads: attn OMP_NUM_THREADS=t (attn_threads in the benchmark context: %s); "
                 "ORT `--threads t` (intraOpNumThreads), OMP_NUM_THREADS=t"
                 % ", ".join("t=%d: %s" % (t, attn_threads[t]) for t in threads_list))
    lines.append("- timing: attn the wall-clock median of %d repetition(s) of >= %g s each "
                 "(Google Benchmark); ORT the median of >= 7 calls and >= 0.5 s after a warm-up "
                 "call (the peer's own policy); each (n, threads) runs both sides back to back"
                 % (args.repetitions, args.min_time))
    lines.append("- ratio = ORT's best valid graph / attn: above 1, attn is faster. attn: "
                 "`flash_attention` (1 head), `attention_heads` on (8, n, 64) tensors (8 heads), "
                 "`scores` (score kernel)")
    lines.append("- % of FMA peak: the useful products (4 n m d per head, half the pairs when "
                 "causal, 2 n m d for the score kernel) over the time, on both sides, whatever "
                 "the side computes (ORT's causal graphs form the whole table); 'attn % the ratio "
                 "target needs' = the ratio target x ORT's %: above 100%, no kernel can meet the "
                 "ratio on this machine in this run")
    lines.append("")
    targets = []
    lines += markdown_table(
        ["op", "n", "heads", "threads", "attn (ms)", "ORT best (ms)", "ORT graph", "ORT / attn",
         "attn % of FMA peak", "ORT % of FMA peak", "attn % the ratio target needs", "target",
         "PASS/MISS"],
        main_rows(sizes, threads_list, ours, theirs, peak[0], targets),
        right={1, 2, 3, 4, 5, 7, 8, 9, 10})
    if len(threads_list) > 1 and 1 in threads_list:
        lines += ["", "Speed-up with threads (1-thread time / t-thread time):", ""]
        lines += markdown_table(
            ["op", "n", "heads", "threads", "attn 1 thread (ms)", "attn t threads (ms)",
             "attn speed-up", "ORT speed-up", "target", "PASS/MISS"],
            speedup_rows(sizes, threads_list, ours, theirs, targets), right=range(1, 8))
    lines += ["", "Causal / full, our own times:", ""]
    lines += markdown_table(
        ["n", "heads", "threads", "causal (ms)", "full (ms)", "causal / full", "target",
         "PASS/MISS"], causal_rows(sizes, threads_list, ours, targets), right=range(0, 6))
    lines += ["", "Targets (issue 11): %d of %d met. (total run time %.0f s)"
              % (sum(targets), len(targets), seconds)]
    return lines


# --------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default="build", help="the CMake build directory (build)")
    parser.add_argument("--ort-dir", default="/tmp/ortpeer",
                        help="the npm folder with onnxruntime-node and onnx-proto (/tmp/ortpeer)")
    parser.add_argument("--peer", default=os.path.normpath(os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "peers",
        "ort_attention.js")), help="the peer script (../shared/peers/ort_attention.js)")
    parser.add_argument("--node", default="node", help="the Node.js executable (node)")
    parser.add_argument("--sizes", default="512,2048,4096", help="n values (512,2048,4096)")
    parser.add_argument("--threads", default="1,2", help="thread counts (1,2)")
    parser.add_argument("--repetitions", type=int, default=3,
                        help="our repetitions per case (3; --quick: 1)")
    parser.add_argument("--min-time", type=float, default=0.3,
                        help="our seconds per repetition (0.3; --quick: 0.05)")
    parser.add_argument("--warmup", type=float, default=0.2,
                        help="our warm-up seconds per case (0.2; --quick: 0)")
    parser.add_argument("--quick", action="store_true",
                        help="one short repetition on our side, for smoke tests (the peer keeps "
                             "its own policy)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables to FILE")
    args = parser.parse_args()
    if args.quick:
        args.repetitions, args.min_time, args.warmup = 1, 0.05, 0.0
    sizes = [int(s) for s in args.sizes.split(",") if s]
    threads_list = [int(t) for t in args.threads.split(",") if t]

    ort_dir = os.path.abspath(args.ort_dir)
    if not all(os.path.isdir(os.path.join(ort_dir, "node_modules", p))
               for p in ("onnxruntime-node", "onnx-proto")):
        print("%s: ONNX Runtime is not installed in %s; install it with:\n  %s"
              % (SCRIPT, ort_dir, NPM_INSTALL.format(dir=ort_dir)), file=sys.stderr)
        sys.exit(2)
    if shutil.which(args.node) is None:
        print("%s: %s not found: the peer needs Node.js (Debian: apt-get install -y nodejs)"
              % (SCRIPT, args.node), file=sys.stderr)
        sys.exit(2)
    if not os.path.isfile(args.peer):
        print("%s: the peer script %s is missing (--peer)" % (SCRIPT, args.peer), file=sys.stderr)
        sys.exit(2)
    binary = require_binary(args.build, "attn_bench", SCRIPT)

    started = time.perf_counter()
    log("FMA peak (attn_peak_fma_bench) ...")
    peak = fma_peak(args.build, args.min_time, max(args.repetitions, 1), SCRIPT)
    ours, theirs, contexts, ort_info = {}, {}, {}, {}
    step = 0
    for n in sizes:
        for t in threads_list:
            sides = ["ours", "ort"] if step % 2 == 0 else ["ort", "ours"]
            step += 1
            for side in sides:
                if side == "ours":
                    ours[(n, t)], contexts[(n, t)] = run_ours(binary, n, t, args)
                else:
                    theirs[(n, t)], ort_info = run_ort(args.node, args.peer, ort_dir, n, t)
    end_peak = fma_peak(args.build, args.min_time, max(args.repetitions, 1), SCRIPT)
    peak = max(peak, end_peak)
    lines = report(args, sizes, threads_list, ours, theirs, contexts, peak, ort_info,
                   time.perf_counter() - started)
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
        log("wrote %s" % args.markdown)


if __name__ == "__main__":
    main()
