#!/usr/bin/python3
"""Multi-head attention forward: attn against PyTorch's nn.MultiheadAttention, in one run.

    python3 bench/compare_mha.py --build build

Runs the Google Benchmark binary bench/attn_multi_head_bench (BM_MultiHeadForward<float>, one
thread) and, in the same run, PyTorch's nn.MultiheadAttention (float32, eval mode, torch.no_grad(),
need_weights=False, batch_first=True, torch.set_num_threads(1)) on the same shapes: E = 512, 8
heads, self-attention on x of shape (B, T, 512) for T in {128, 512, 2048} and B in {1, 8}. Prints a
markdown table of wall-clock medians and the ratio PyTorch / ours.

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
import platform
import shlex
import statistics
import subprocess
import sys
import time

EMBED_DIM = 512
HEADS = 8
SHAPES = [(1, 128), (1, 512), (1, 2048), (8, 128), (8, 512), (8, 2048)]  # (B, T)
ACCEPTANCE_SHAPE = (1, 2048)
ACCEPTANCE_RATIO = 2.0
WARMUP_S = 0.3
MIN_TIME_S = 0.2
BENCH_NAME = "BM_MultiHeadForward<float>/T:{T}/B:{B}"
ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "GOTO_NUM_THREADS": "1",
}


def repeats_for(batch, tokens):
    """Repeats per shape: fewer for the large ones, so that the whole run stays within about four
    minutes (PyTorch on the reference BLAS needs 25-45 s per call at B=8, T=2048 on a 2-core VM)."""
    work = batch * tokens
    if work <= 1024:
        return 5
    if work <= 4096:
        return 3
    return 2


def log(message):
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# PyTorch side (runs in the child process: the BLAS reads its environment when it loads)
# --------------------------------------------------------------------------------------------


def timed_median(call, repeats):
    """The policy above: warm-up, then `repeats` repeats of >= MIN_TIME_S; median ms per call."""
    start = time.perf_counter()
    call()
    while time.perf_counter() - start < WARMUP_S:
        call()
    per_call = []
    for _ in range(repeats):
        calls = 0
        start = time.perf_counter()
        while True:
            call()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= MIN_TIME_S:
                break
        per_call.append(1e3 * elapsed / calls)
    return statistics.median(per_call), per_call


def loaded_libraries(words):
    """Shared libraries mapped into this process whose file name contains one of `words`."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            name = os.path.basename(path)
            if any(w in name for w in words) and path not in found:
                found.append(path)
    return found


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

            median, runs = timed_median(call, repeats_for(batch, tokens))
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


def run_torch(shapes, blas_dir):
    env = dict(os.environ)
    env.update(ONE_THREAD)
    env["OPENBLAS_CORETYPE"] = "SkylakeX"
    if blas_dir:
        env["LD_LIBRARY_PATH"] = blas_dir + (
            ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    spec = json.dumps(shapes)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-worker", spec],
                          env=env, stdout=subprocess.PIPE, check=True)
    return json.loads(proc.stdout)


# --------------------------------------------------------------------------------------------
# Our side: the Google Benchmark binary
# --------------------------------------------------------------------------------------------


def to_ms(value, unit):
    return value * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def run_ours(binary, shapes):
    env = dict(os.environ)
    env.update(ONE_THREAD)
    results = {}
    context = {}
    for batch, tokens in shapes:
        name = BENCH_NAME.format(T=tokens, B=batch)
        repeats = repeats_for(batch, tokens)
        cmd = [binary, "--benchmark_filter=^%s$" % name, "--benchmark_format=json",
               "--benchmark_repetitions=%d" % repeats, "--benchmark_min_time=%g" % MIN_TIME_S,
               "--benchmark_min_warmup_time=%g" % WARMUP_S]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              check=True, universal_newlines=True)
        report = json.loads(proc.stdout)
        context = report["context"]
        runs = [to_ms(b["real_time"], b["time_unit"]) for b in report["benchmarks"]
                if b.get("run_type") == "iteration" and b["run_name"] == name]
        if len(runs) != repeats:
            sys.exit("compare_mha.py: expected %d runs of %s, got %d" % (repeats, name, len(runs)))
        median = statistics.median(runs)
        results["%d,%d" % (batch, tokens)] = {"median_ms": median, "runs_ms": runs}
        log("[attn]    B=%d T=%d: %.2f ms (runs %s)"
            % (batch, tokens, median, ", ".join("%.2f" % r for r in runs)))
    return results, context


# --------------------------------------------------------------------------------------------
# Machine, compiler and flags
# --------------------------------------------------------------------------------------------


def cpu_model():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cmake_cache(build):
    cache = {}
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            for line in f:
                if "=" in line and not line.startswith(("#", "//")):
                    key, value = line.rstrip("\n").split("=", 1)
                    cache[key.split(":", 1)[0]] = value
    except OSError:
        pass
    return cache


def compiler_and_flags(build):
    cache = cmake_cache(build)
    compiler = cache.get("CMAKE_CXX_COMPILER", "c++")
    try:
        version = subprocess.run([compiler, "--version"], stdout=subprocess.PIPE,
                                 universal_newlines=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        version = compiler
    flags = None
    # The exact compile line, when the build uses Ninja.
    try:
        commands = subprocess.run(["ninja", "-C", build, "-t", "commands", "attn_multi_head_bench"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  universal_newlines=True).stdout
        for line in commands.splitlines():
            if "multi_head_bench.cpp" in line and " -c " in line:
                words = shlex.split(line)
                flags = " ".join(w for w in words[1:] if w.startswith(("-O", "-m", "-f", "-DNDEBUG",
                                                                       "-std", "-g")))
    except OSError:
        pass
    if not flags:
        build_type = cache.get("CMAKE_BUILD_TYPE", "")
        flags = " ".join(filter(None, [
            cache.get("CMAKE_CXX_FLAGS", ""),
            cache.get("CMAKE_CXX_FLAGS_" + build_type.upper(), ""),
            "-march=native" if cache.get("ATTN_BENCH_NATIVE", "ON") == "ON" else ""]))
    return version, flags, cache.get("CMAKE_BUILD_TYPE", "?")


# --------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default="build", help="the CMake build directory (default: build)")
    parser.add_argument("--blas-dir", default="",
                        help="a directory holding a libblas.so.3 for PyTorch (LD_LIBRARY_PATH)")
    parser.add_argument("--torch-worker", metavar="SHAPES", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_worker:
        torch_worker([tuple(s) for s in json.loads(args.torch_worker)])
        return

    started = time.perf_counter()
    binary = os.path.join(args.build, "bench", "attn_multi_head_bench")
    if not os.access(binary, os.X_OK):
        sys.exit("compare_mha.py: %s not found; build it first:\n"
                 "  cmake -S . -B %s -G Ninja -DCMAKE_BUILD_TYPE=Release && "
                 "ninja -C %s attn_multi_head_bench" % (binary, args.build, args.build))

    log("Running %s (one thread) ..." % binary)
    ours, context = run_ours(binary, SHAPES)
    log("Running PyTorch nn.MultiheadAttention (child process, OPENBLAS_CORETYPE=SkylakeX, "
        "one thread) ...")
    torch_report = run_torch(SHAPES, args.blas_dir)
    theirs = torch_report["results"]
    info = torch_report["info"]

    compiler, flags, build_type = compiler_and_flags(args.build)
    blas = info["blas"]
    blas_names = ", ".join(blas) if blas else "none found"
    # Debian's reference BLAS lives in .../blas/libblas.so.3 (the libblas3 package).
    reference_blas = any("/blas/libblas.so" in p for p in blas) and not any(
        w in p for p in blas for w in ("openblas", "mkl", "blis"))

    print("## Multi-head attention forward: attn vs PyTorch nn.MultiheadAttention")
    print()
    print("- machine: %s, %s logical CPUs (%s)" % (cpu_model(), os.cpu_count(), platform.machine()))
    print("- attn: %s, build type %s, flags `%s`; Eigen %s, SIMD %s; %s thread(s)"
          % (compiler, build_type, flags, context.get("eigen_version", "?"),
             context.get("eigen_simd", "?"), context.get("attn_threads", "?")))
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
    print()
    print("| shape (B, T, E) | repeats | ours (ms) | PyTorch (ms) | PyTorch / ours |")
    print("|---|---:|---:|---:|---:|")
    for batch, tokens in SHAPES:
        key = "%d,%d" % (batch, tokens)
        a = ours[key]["median_ms"]
        p = theirs[key]["median_ms"]
        ratio = p / a
        verdict = "%.2fx faster" % ratio if ratio >= 1 else "%.2fx slower" % (1 / ratio)
        print("| (%d, %d, %d) | %d | %.2f | %.2f | %s |"
              % (batch, tokens, EMBED_DIM, repeats_for(batch, tokens), a, p, verdict))
    print()
    batch, tokens = ACCEPTANCE_SHAPE
    key = "%d,%d" % (batch, tokens)
    ratio = theirs[key]["median_ms"] / ours[key]["median_ms"]
    print("Acceptance (E = %d, h = %d, T = %d, B = %d, one thread): %.2fx faster than PyTorch, "
          "target >= %.0fx: %s"
          % (EMBED_DIM, HEADS, tokens, batch, ratio, ACCEPTANCE_RATIO,
             "met" if ratio >= ACCEPTANCE_RATIO else "NOT met"))
    print()
    print("(total run time %.0f s)" % (time.perf_counter() - started))


if __name__ == "__main__":
    main()
