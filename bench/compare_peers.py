#!/usr/bin/python3
"""Single-head attention and the score kernel: attn against NumPy and PyTorch, in one run.

    python3 bench/compare_peers.py --build build

Runs bench/attn_bench (Google Benchmark; one thread) and, in the same run, a child process that
times the same shapes (float32, d = 64, one head, n = m) with
  - NumPy: the second document's own implementation (`softmax(Q @ K.T / np.sqrt(d_k)) @ V` with its
    max-subtracting softmax); causal adds a -inf mask before the softmax; scores: `Q @ K.T / sqrt(d)`;
  - PyTorch 1.13: `torch.matmul` + `torch.softmax`, and
    `torch.nn.functional._scaled_dot_product_attention` (1.13's private fused entry point).
The child runs with OPENBLAS_CORETYPE=SkylakeX: Debian's OpenBLAS 0.3.21 does not recognise this
CPU and would fall back to its generic Prescott kernels. Both sides run one thread. Prints a
markdown table of medians and the ratios theirs / ours (> 1: attn is faster), then the issue's
targets. Needs Debian's python3-numpy, python3-torch and libopenblas0-pthread.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (ONE_THREAD, compiler_and_flags, cpu_model,  # noqa: E402
                          loaded_libraries, log, require_binary, run_benchmarks, timed_median)

D = 64
SIZES = [512, 1024, 2048, 4096]
REPEATS = 5
WARMUP_S = 0.3
MIN_TIME_S = 0.2

# (row label, our benchmark name pattern, the peers' kernels to time)
ROWS = [
    ("scores", "BM_Scores<float>/n:{n}/d:64", ["numpy scores", "torch scores"]),
    ("attention", "BM_Flash<float>/n:{n}/d:64/causal:0/window:0",
     ["numpy attention", "torch matmul+softmax", "torch _sdpa"]),
    ("causal attention", "BM_Flash<float>/n:{n}/d:64/causal:1/window:0",
     ["numpy attention", "torch matmul+softmax", "torch _sdpa"]),
]


def peers_worker(sizes):
    """The child: NumPy and PyTorch kernels on each size; prints JSON {kernel: {n: ms}}."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    results = {}

    def softmax(x):  # the second document's own
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    for n in sizes:
        rng = np.random.default_rng(n)
        Q, K, V = (rng.standard_normal((n, D), dtype=np.float32) for _ in range(3))
        causal_bias = np.triu(np.full((n, n), -np.inf, dtype=np.float32), k=1)
        tq, tk, tv = (torch.from_numpy(a) for a in (Q, K, V))
        tmask = torch.ones(n, n, dtype=torch.bool).tril()
        scale = 1.0 / np.sqrt(D)
        kernels = {
            ("numpy scores", False): lambda: Q @ K.T / np.sqrt(D),
            ("torch scores", False): lambda: torch.matmul(tq, tk.T) / np.sqrt(D),
            ("numpy attention", False): lambda: softmax(Q @ K.T / np.sqrt(D)) @ V,
            ("numpy attention", True): lambda: softmax(Q @ K.T / np.sqrt(D) + causal_bias) @ V,
            ("torch matmul+softmax", False):
                lambda: torch.softmax(torch.matmul(tq, tk.T) * scale, dim=-1) @ tv,
            ("torch matmul+softmax", True):
                lambda: torch.softmax((torch.matmul(tq, tk.T) * scale).masked_fill(~tmask,
                                                                                   float("-inf")),
                                      dim=-1) @ tv,
            ("torch _sdpa", False): lambda: torch.nn.functional._scaled_dot_product_attention(
                tq[None], tk[None], tv[None], None, 0.0, False, False),
            ("torch _sdpa", True): lambda: torch.nn.functional._scaled_dot_product_attention(
                tq[None], tk[None], tv[None], None, 0.0, False, True),
        }
        with torch.no_grad():
            for (name, causal), call in kernels.items():
                median, runs = timed_median(call, REPEATS, WARMUP_S, MIN_TIME_S)
                key = "%s%s" % (name, " causal" if causal else "")
                results.setdefault(key, {})[str(n)] = median
                log("[peers] %s n=%d: %.3f ms" % (key, n, median))
    info = {"numpy": np.__version__, "torch": torch.__version__,
            "blas": loaded_libraries(("blas", "mkl", "blis"))}
    print(json.dumps({"results": results, "info": info}))


def run_peers(sizes):
    env = dict(os.environ)
    env.update(ONE_THREAD)
    env["OPENBLAS_CORETYPE"] = "SkylakeX"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--peers-worker",
                           json.dumps(sizes)], env=env, stdout=subprocess.PIPE, check=True)
    return json.loads(proc.stdout)


def run_ours(binary, names):
    env = dict(os.environ)
    env.update(ONE_THREAD)
    runs, context = run_benchmarks(binary, names, env, REPEATS, MIN_TIME_S, WARMUP_S,
                                   "compare_peers.py")
    return {name: run["median_ms"] for name, run in runs.items()}, context


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default="build", help="the CMake build directory")
    parser.add_argument("--peers-worker", metavar="SIZES", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peers_worker:
        peers_worker(json.loads(args.peers_worker))
        return
    started = time.perf_counter()
    binary = require_binary(args.build, "attn_bench", "compare_peers.py")
    names = [pattern.format(n=n) for _, pattern, _ in ROWS for n in SIZES]
    log("Running %s (one thread) ..." % binary)
    ours, context = run_ours(binary, names)
    log("Running NumPy and PyTorch (child process, OPENBLAS_CORETYPE=SkylakeX, one thread) ...")
    peers = run_peers(SIZES)
    theirs, info = peers["results"], peers["info"]
    compiler, flags, build_type = compiler_and_flags(args.build, "attn_bench",
                                                     "attention_bench.cpp")

    print("## Single head, float32, d = 64: attn vs NumPy and PyTorch (one run)")
    print()
    print("- machine: %s, %s logical CPUs" % (cpu_model(), os.cpu_count()))
    print("- attn: %s, %s, `%s`; Eigen %s, SIMD %s; one thread"
          % (compiler, build_type, flags, context.get("eigen_version", "?"),
             context.get("eigen_simd", "?")))
    print("- peers: NumPy %s, PyTorch %s, BLAS %s, OPENBLAS_CORETYPE=SkylakeX, one thread"
          % (info["numpy"], info["torch"], ", ".join(info["blas"]) or "?"))
    print("- wall-clock medians of %d repeats (each >= %g s after a %g s warm-up); "
          "ratio = theirs / ours, > 1 means attn is faster" % (REPEATS, MIN_TIME_S, WARMUP_S))
    print()
    print("| kernel | n | attn (ms) | peer | peer (ms) | peer / attn |")
    print("|---|---:|---:|---|---:|---:|")
    for label, pattern, peers_names in ROWS:
        for n in SIZES:
            mine = ours[pattern.format(n=n)]
            for peer in peers_names:
                key = peer + (" causal" if label.startswith("causal") else "")
                other = theirs[key][str(n)]
                print("| %s | %d | %.3f | %s | %.3f | %.2f |" % (label, n, mine, peer, other,
                                                                other / mine))
    print()
    flash = ours[ROWS[1][1].format(n=2048)]
    causal = ours[ROWS[2][1].format(n=2048)]
    scores = ours[ROWS[0][1].format(n=2048)]
    targets = [
        ("flash attention n = 2048 vs NumPy full attention", theirs["numpy attention"]["2048"] / flash,
         ">= 2.5x", theirs["numpy attention"]["2048"] / flash >= 2.5),
        ("causal flash n = 2048 / our non-causal", causal / flash, "<= 0.55", causal / flash <= 0.55),
        ("score kernel n = 2048 vs NumPy Q @ K.T / sqrt(d)", theirs["numpy scores"]["2048"] / scores,
         ">= 1.2x", theirs["numpy scores"]["2048"] / scores >= 1.2),
    ]
    print("| target | measured | wanted | |")
    print("|---|---:|---:|---|")
    for name, value, wanted, ok in targets:
        print("| %s | %.2f | %s | %s |" % (name, value, wanted, "met" if ok else "NOT met"))
    print()
    print("(total run time %.0f s)" % (time.perf_counter() - started))


if __name__ == "__main__":
    main()
