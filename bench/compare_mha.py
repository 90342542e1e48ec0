#!/usr/bin/python3
"""Multi-head attention forward: attn against PyTorch's nn.MultiheadAttention, in one run.

    python3 bench/compare_mha.py --build build
    python3 bench/compare_mha.py --build build --quick      (smoke test: T <= 512, short runs)

Runs the Google Benchmark binary bench/attn_multi_head_bench (BM_MultiHeadForward<float>, one
thread) and, in the same run, PyTorch's nn.MultiheadAttention (float32, eval mode, torch.no_grad(),
need_weights=False, batch_first=True, torch.set_num_threads(1)) on the same shapes: E = 512, 8
heads, self-attention on x of shape (B, T, 512) for T in {128, 512, 2048} and B in {1, 8}. Prints a
markdown table of wall-clock medians and the ratio PyTorch / ours; beside them, from the same binary
and run, the allocating overload (BM_MultiHeadForwardAllocating) over the hot path, and one of the
layer's projections (BM_Projection: X W + b over the B T tokens) as a fraction of the single-core
FMA peak (build/bench/attn_peak_fma_bench, measured at the start and at the end, the best kept);
both layers' products as a fraction of that peak, and the fraction ours would need for the ratio
target; then issue 11's targets for the layer with PASS or MISS.

Timing policy, the same on both sides: a warm-up of at least WARMUP_S seconds (at least one call);
then R repeats, each running calls until MIN_TIME_S seconds have passed (at least one call) and
giving the mean time per call; the reported figure is the median over the repeats. R is smaller for
the large shapes (see repeats_for), which keeps the whole run to a few minutes.

PyTorch runs in a child process whose environment sets OPENBLAS_CORETYPE=SkylakeX (Debian's
OpenBLAS 0.3.21 does not recognise recent CPUs and falls back to slower kernels) and one thread for
every threading library. The script reports which BLAS the child actually loaded: Debian's
python3-torch calls whatever libblas.so.3 the system alternative points to, which is the
unoptimised reference BLAS unless an optimised one is installed. --blas-dir DIR puts DIR (holding a
libblas.so.3, e.g. OpenBLAS's openblas-pthread directory) first on the child's LD_LIBRARY_PATH.

Only the standard library and torch are used. Run it with /usr/bin/python3 (Debian's
python3-torch).
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (ONE_THREAD, benchmark_names, compiler_and_flags, fma_peak,  # noqa: E402
                          loaded_libraries, log, machine_line, markdown_table, peak_share,
                          percent, require_binary, run_benchmarks, timed_median, verdict)

EMBED_DIM = 512
HEADS = 8
SHAPES = [(1, 128), (1, 512), (1, 2048), (8, 128), (8, 512), (8, 2048)]  # (B, T)
QUICK_SHAPES = [(1, 128), (1, 512), (8, 128)]
WARMUP_S = 0.3
MIN_TIME_S = 0.2
BENCH_NAME = "BM_MultiHeadForward<float>/T:{T}/B:{B}"
ALLOCATING_NAME = "BM_MultiHeadForwardAllocating<float>/T:{T}/B:{B}"
PROJECTION_NAME = "BM_Projection<float>/T:{T}/B:{B}"
# Issue 11's targets for the layer.
LONG_TOKENS = 2048  # attention dominates there
LONG_RATIO = 2.0
OTHER_RATIO = 1.3
PROJECTION_PEAK = 0.80
ALLOCATING_OVER_HOT = 1.2


def repeats_for(batch, tokens):
    """Repeats per shape: fewer for the large ones, so that the whole run stays within about four
    minutes (PyTorch on the reference BLAS needs 25-45 s per call at B=8, T=2048 on a 2-core VM)."""
    work = batch * tokens
    if work <= 1024:
        return 5
    if work <= 4096:
        return 3
    return 2


# --------------------------------------------------------------------------------------------
# PyTorch side (runs in the child process: the BLAS reads its environment when it loads)
# --------------------------------------------------------------------------------------------


def cpu_capability(torch):
    """The vector instruction set PyTorch's own kernels dispatch to ("AVX2")."""
    for line in torch.__config__.show().splitlines():
        if "CPU capability usage:" in line:
            return line.split(":", 1)[1].strip()
    return ""


def torch_worker(shapes):
    import torch  # only the child imports torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(EMBED_DIM, HEADS, batch_first=True).eval()
    results = {}
    with torch.no_grad():
        probe = torch.randn(4, 4)
        probe @ probe  # loads the BLAS
        for batch, tokens in shapes:
            x = torch.randn(batch, tokens, EMBED_DIM)

            def call():
                out, weights = mha(x, x, x, need_weights=False)
                assert weights is None and out.shape == x.shape

            median, runs = timed_median(call, repeats_for(batch, tokens), WARMUP_S, MIN_TIME_S)
            results["%d,%d" % (batch, tokens)] = {"median_ms": median, "runs_ms": runs}
            log("[pytorch] B=%d T=%d: %.2f ms (runs %s)"
                % (batch, tokens, median, ", ".join("%.2f" % r for r in runs)))
    info = {
        "version": torch.__version__,
        "threads": torch.get_num_threads(),
        "blas": loaded_libraries(("blas", "mkl", "lapack", "blis")),
        "cpu_capability": cpu_capability(torch),
    }
    json.dump({"info": info, "results": results}, sys.stdout)


def run_torch(shapes, blas_dir, quick):
    env = dict(os.environ)
    env.update(ONE_THREAD)
    env["OPENBLAS_CORETYPE"] = "SkylakeX"
    if blas_dir:
        env["LD_LIBRARY_PATH"] = blas_dir + (
            ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    spec = json.dumps(shapes)
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", spec]
    proc = subprocess.run(cmd + (["--quick"] if quick else []), env=env, stdout=subprocess.PIPE,
                          check=True)
    return json.loads(proc.stdout)


# --------------------------------------------------------------------------------------------
# Our side: the Google Benchmark binaries
# --------------------------------------------------------------------------------------------


def run_ours(binary, shapes):
    """Per shape, in one process: the hot path, and the allocating overload and the projection
    where the binary has them. Returns ({"B,T": {"median_ms", "runs_ms", "allocating_ms",
    "projection_flops"} (NaN where the binary lacks the case)}, the context)."""
    available = set(benchmark_names(binary, "BM_(MultiHeadForwardAllocating|Projection)<"))
    results = {}
    context = {}
    for batch, tokens in shapes:
        hot, allocating, projection = (name.format(T=tokens, B=batch) for name in
                                       (BENCH_NAME, ALLOCATING_NAME, PROJECTION_NAME))
        names = [hot] + [n for n in (allocating, projection) if n in available]
        repeats = repeats_for(batch, tokens)
        runs, context = run_benchmarks(binary, names, ONE_THREAD, repeats, MIN_TIME_S, WARMUP_S,
                                       "compare_mha.py")
        nan = float("nan")
        result = {
            "median_ms": runs[hot]["median_ms"],
            "runs_ms": runs[hot]["runs_ms"],
            "allocating_ms": runs[allocating]["median_ms"] if allocating in runs else nan,
            "projection_flops": (2.0 * batch * tokens * EMBED_DIM * EMBED_DIM /
                                 (1e-3 * runs[projection]["median_ms"])
                                 if projection in runs else nan),
        }
        results["%d,%d" % (batch, tokens)] = result
        log("[attn]    B=%d T=%d: %.2f ms (runs %s); allocating %.2f ms; projection %.1f GFLOP/s"
            % (batch, tokens, result["median_ms"],
               ", ".join("%.2f" % r for r in result["runs_ms"]), result["allocating_ms"],
               1e-9 * result["projection_flops"]))
    return results, context


def fmt(pattern, value):
    return "n/a" if value != value else pattern % value


def layer_flops(batch, tokens):
    """The products of one forward: the four projections (Q, K, V in, and out: 2 B T E^2 each)
    and attention's Q K^T and P V over every head (4 B T^2 E)."""
    return 8.0 * batch * tokens * EMBED_DIM ** 2 + 4.0 * batch * tokens ** 2 * EMBED_DIM


def wanted_ratio(tokens):
    return LONG_RATIO if tokens >= LONG_TOKENS else OTHER_RATIO


def target_rows(shapes, ours, theirs, peak):
    """Issue 11's targets for the layer: one row per shape and target."""
    rows = []
    for batch, tokens in shapes:
        key = "%d,%d" % (batch, tokens)
        shape = "(%d, %d, %d)" % (batch, tokens, EMBED_DIM)
        mine = ours[key]
        ratio = theirs[key]["median_ms"] / mine["median_ms"]
        wanted = wanted_ratio(tokens)
        rows.append(["PyTorch / ours", shape, "%.2f" % ratio, ">= %.1f" % wanted,
                     verdict(ratio >= wanted)])
        fraction = mine["projection_flops"] / peak
        if fraction == fraction:
            rows.append(["projection / FMA peak", shape, "%.0f%%" % (100 * fraction),
                         ">= %.0f%%" % (100 * PROJECTION_PEAK),
                         verdict(fraction >= PROJECTION_PEAK)])
        slower = mine["allocating_ms"] / mine["median_ms"]
        if slower == slower:
            rows.append(["allocating / hot path", shape, "%.2f" % slower,
                         "<= %.1f" % ALLOCATING_OVER_HOT, verdict(slower <= ALLOCATING_OVER_HOT)])
    return rows


# --------------------------------------------------------------------------------------------


def main():
    global MIN_TIME_S, WARMUP_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default="build",
                        help="the CMake build directory (default: build)")
    parser.add_argument("--blas-dir", default="",
                        help="a directory holding a libblas.so.3 for PyTorch (LD_LIBRARY_PATH)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: the shapes with T <= 512 and B T <= 1024, short repeats")
    parser.add_argument("--torch-worker", metavar="SHAPES", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        MIN_TIME_S, WARMUP_S = 0.05, 0.05
    if args.torch_worker:
        torch_worker([tuple(s) for s in json.loads(args.torch_worker)])
        return

    started = time.perf_counter()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    binary = require_binary(args.build, "attn_multi_head_bench", "compare_mha.py")
    log("FMA peak (attn_peak_fma_bench) ...")
    peak = fma_peak(args.build, MIN_TIME_S, 3, "compare_mha.py")
    log("Running %s (one thread) ..." % binary)
    ours, context = run_ours(binary, shapes)
    log("Running PyTorch nn.MultiheadAttention (child process, OPENBLAS_CORETYPE=SkylakeX, "
        "one thread) ...")
    torch_report = run_torch(shapes, args.blas_dir, args.quick)
    theirs = torch_report["results"]
    info = torch_report["info"]
    peak = max(peak, fma_peak(args.build, MIN_TIME_S, 3, "compare_mha.py"))

    compiler, flags, build_type = compiler_and_flags(args.build)
    compiler = context.get("compiler", compiler)
    blas = info["blas"]
    blas_names = ", ".join(blas) if blas else "none found"
    # Debian's reference BLAS lives in .../blas/libblas.so.3 (the libblas3 package).
    reference_blas = any("/blas/libblas.so" in p for p in blas) and not any(
        w in p for p in blas for w in ("openblas", "mkl", "blis"))

    print("## Multi-head attention forward: attn vs PyTorch nn.MultiheadAttention")
    print()
    print("- machine: %s" % machine_line())
    print("- attn: %s, build type %s, flags `%s`; Eigen %s, SIMD %s; %s thread(s)"
          % (compiler, build_type, flags, context.get("eigen_version", "?"),
             context.get("eigen_simd", "?"), context.get("attn_threads", "?")))
    print("- FMA peak: %.1f GFLOP/s on one core (`attn_peak_fma_bench`, %s)"
          % (peak[0] * 1e-9, peak[1] or "?"))
    print("- PyTorch %s (CPU capability %s), %d thread(s); BLAS loaded: %s"
          % (info["version"], info["cpu_capability"] or "?", info["threads"], blas_names))
    print("- environment: OPENBLAS_CORETYPE=SkylakeX set for the PyTorch child%s; "
          "OMP/OPENBLAS/MKL_NUM_THREADS=1 for both"
          % (", LD_LIBRARY_PATH=%s first" % args.blas_dir if args.blas_dir else ""))
    if reference_blas:
        print("- **note**: PyTorch is running on the reference (netlib) BLAS, libblas.so.3 from "
              "Debian's libblas3, not on OpenBLAS: its matrix products are unoptimised, so the "
              "ratios below overstate attn's advantage. Install libopenblas0 or pass "
              "--blas-dir to compare against an optimised BLAS.")
    print("- float32, E = %d, %d heads, self-attention on x of shape (B, T, %d); wall-clock "
          "median over repeats (warm-up >= %g s, each repeat >= %g s)"
          % (EMBED_DIM, HEADS, EMBED_DIM, WARMUP_S, MIN_TIME_S))
    print("- ours: the hot path `forward(query, key, value, options, workspace, result)`; "
          "allocating: `forward(query, key, value)`; projection: `X W_Q + b_Q` over the B T "
          "tokens by the layer's kernel, as a fraction of the FMA peak")
    print()
    rows = []
    for batch, tokens in shapes:
        key = "%d,%d" % (batch, tokens)
        mine, other = ours[key], theirs[key]["median_ms"]
        ratio = other / mine["median_ms"]
        flops = layer_flops(batch, tokens)
        theirs_of_peak = peak_share(flops, other, peak[0])
        rows.append(["(%d, %d, %d)" % (batch, tokens, EMBED_DIM), repeats_for(batch, tokens),
                     "%.2f" % mine["median_ms"], fmt("%.2f", mine["allocating_ms"]),
                     fmt("%.2f", mine["allocating_ms"] / mine["median_ms"]),
                     fmt("%.0f%%", 100 * mine["projection_flops"] / peak[0]), "%.2f" % other,
                     "%.2fx faster" % ratio if ratio >= 1 else "%.2fx slower" % (1 / ratio),
                     percent(peak_share(flops, mine["median_ms"], peak[0])),
                     percent(theirs_of_peak), percent(wanted_ratio(tokens) * theirs_of_peak)])
    print("\n".join(markdown_table(
        ["shape (B, T, E)", "repeats", "ours (ms)", "allocating (ms)", "allocating / ours",
         "projection % of peak", "PyTorch (ms)", "PyTorch / ours", "ours: layer % of peak",
         "PyTorch: layer % of peak", "ours: % the ratio target needs"], rows,
        right=range(1, 11))))
    print()
    print("Layer % of peak: the products of a forward (the four projections, 8 B T E^2 flops, and "
          "attention's Q K^T and P V, 4 B T^2 E) over its time, on both sides; the ratio target's "
          "need is the target times PyTorch's fraction: above 100%, no implementation can meet it "
          "on this machine in this run.")
    print()
    targets = target_rows(shapes, ours, theirs, peak[0])
    print("\n".join(markdown_table(["target (issue 11)", "shape", "measured", "wanted", ""],
                                   targets, right={2, 3})))
    print()
    print("%d of %d targets met. (total run time %.0f s)"
          % (sum(row[-1] == "PASS" for row in targets), len(targets),
             time.perf_counter() - started))


if __name__ == "__main__":
    main()
