"""Helpers shared by the compare scripts (compare_mha.py, compare_peers.py, compare_ort.py).

Standard library only: the scripts run under Debian's /usr/bin/python3.
"""

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "GOTO_NUM_THREADS")
ONE_THREAD = {name: "1" for name in THREAD_VARIABLES}
# Google Benchmark appends this to the name of a case registered with UseRealTime().
REAL_TIME_SUFFIX = "/real_time"
# Fields of a Google Benchmark JSON run that are not user counters.
GBENCH_FIELDS = {"family_index", "per_family_instance_index", "repetitions", "repetition_index",
                 "threads", "iterations", "real_time", "cpu_time"}


def log(message):
    print(message, file=sys.stderr, flush=True)


def threads_env(threads, base=None):
    """A copy of `base` (default: this process's environment) with every threading library set to
    `threads` threads: OMP_NUM_THREADS sets attn's (the openmp target), the others the BLASes'."""
    env = dict(os.environ if base is None else base)
    env.update({name: str(threads) for name in THREAD_VARIABLES})
    return env


def to_ms(value, unit):
    return value * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def timed_median(call, repeats, warmup_s=0.3, min_time_s=0.2):
    """A warm-up of at least `warmup_s` seconds (at least one call), then `repeats` repeats, each
    running calls until `min_time_s` seconds have passed (at least one call) and giving the mean
    time per call. Returns (median ms per call, [ms per call of each repeat])."""
    start = time.perf_counter()
    call()
    while time.perf_counter() - start < warmup_s:
        call()
    per_call = []
    for _ in range(repeats):
        calls = 0
        start = time.perf_counter()
        while True:
            call()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time_s:
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


# --------------------------------------------------------------------------------------------
# Our side: Google Benchmark binaries
# --------------------------------------------------------------------------------------------


def require_binary(build, target, script):
    """build/bench/<target>, or exits naming the command that builds it."""
    binary = os.path.join(build, "bench", target)
    if not os.access(binary, os.X_OK):
        sys.exit("%s: %s not found; build it first:\n"
                 "  cmake -S . -B %s -G Ninja -DCMAKE_BUILD_TYPE=Release && "
                 "cmake --build %s --target %s" % (script, binary, build, build, target))
    return binary


def benchmark_names(binary, pattern="."):
    """The cases of `binary` matching the regex `pattern`, without the /real_time suffix."""
    proc = subprocess.run([binary, "--benchmark_list_tests=true",
                           "--benchmark_filter=" + pattern], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, check=True, universal_newlines=True)
    return [strip_real_time(line.strip()) for line in proc.stdout.splitlines() if line.strip()]


def strip_real_time(name):
    return name[:-len(REAL_TIME_SUFFIX)] if name.endswith(REAL_TIME_SUFFIX) else name


def run_benchmarks(binary, names, env, repetitions, min_time_s, warmup_s=0.0, script="bench"):
    """Runs the cases `names` (names as registered, without /real_time) of a Google Benchmark
    binary in one process. Returns ({name: {"runs_ms": [wall-clock ms per iteration of each
    repetition], "median_ms": ..., "counter_values": {counter: [value of each repetition]},
    "counters": {counter: median}, "label": ...}}, the report's context). Exits if a case did not
    run."""
    pattern = "^(%s)(%s)?$" % ("|".join(n.replace("+", r"\+") for n in names), REAL_TIME_SUFFIX)
    cmd = [binary, "--benchmark_filter=" + pattern, "--benchmark_format=json",
           "--benchmark_repetitions=%d" % repetitions, "--benchmark_min_time=%g" % min_time_s]
    if warmup_s > 0:
        cmd.append("--benchmark_min_warmup_time=%g" % warmup_s)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True)
    if proc.returncode != 0:
        sys.exit("%s: %s failed (exit %d):\n%s" % (script, " ".join(cmd), proc.returncode,
                                                  proc.stderr.strip()))
    report = json.loads(proc.stdout)
    runs = {}
    for b in report["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        run = runs.setdefault(strip_real_time(b["run_name"]),
                              {"runs_ms": [], "counter_runs": {}, "label": b.get("label", "")})
        run["runs_ms"].append(to_ms(b["real_time"], b["time_unit"]))
        for key, value in b.items():
            if key not in GBENCH_FIELDS and isinstance(value, (int, float)):
                run["counter_runs"].setdefault(key, []).append(value)
    missing = [n for n in names if n not in runs]
    if missing:
        sys.exit("%s: %s has no case %s: rebuild it from this tree" % (script, binary,
                                                                      ", ".join(missing)))
    for run in runs.values():
        run["median_ms"] = statistics.median(run["runs_ms"])
        run["counter_values"] = run.pop("counter_runs")
        run["counters"] = {k: statistics.median(v) for k, v in run["counter_values"].items()}
    return runs, report["context"]


def rounds_arguments(parser, quick_help="one short round"):
    """The options of the scripts that time their cases in rounds: --build, --threads,
    --repetitions (rounds), --min-time (seconds per case and round), --quick (one short round,
    and whatever else the script says in `quick_help`). Returns the parsed arguments."""
    parser.add_argument("--build", default="build", help="the CMake build folder (Release)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per case and round")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    args = parser.parse_args()
    if args.quick:
        args.repetitions, args.min_time = 1, 0.05
    return args


class Rounds:
    """The cases `names` of `binary` run `args.repetitions` times in turn, one process a round
    (`run_benchmarks`), so that each ratio compares neighbours in time; medians over the rounds."""

    def __init__(self, binary, names, args, script):
        env = threads_env(args.threads)
        self.rounds = []
        for r in range(args.repetitions):
            log("%s: round %d of %d" % (script, r + 1, args.repetitions))
            self.rounds.append(run_benchmarks(binary, names, env, 1, args.min_time, warmup_s=0.1,
                                              script=script)[0])

    def median(self, name, key=None):
        """The median ms per call of case `name`, or of its counter `key`."""
        if key is None:
            return statistics.median(r[name]["median_ms"] for r in self.rounds)
        return statistics.median(r[name]["counters"][key] for r in self.rounds)

    def speedup(self, base, name):
        """The median over the rounds of time(base) / time(name)."""
        return statistics.median(r[base]["median_ms"] / r[name]["median_ms"]
                                 for r in self.rounds)


def fma_peak(build, min_time_s, repetitions=3, script="bench"):
    """The single-core FMA peak from build/bench/attn_peak_fma_bench: (FLOP/s, the best of its
    repetitions, as noise on a shared machine only lowers it; the binary's label)."""
    binary = require_binary(build, "attn_peak_fma_bench", script)
    name = "BM_PeakFmaFloat"
    runs, _ = run_benchmarks(binary, [name], ONE_THREAD, repetitions, min_time_s, script=script)
    return max(runs[name]["counter_values"]["FLOP/s"]), runs[name]["label"]


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


def machine_line():
    return "%s, %s logical CPUs (%s)" % (cpu_model(), os.cpu_count(), platform.machine())


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


def compiler_and_flags(build, target="attn_multi_head_bench", source="multi_head_bench.cpp"):
    """(compiler --version's first line, the flags `source` of `target` is compiled with, the
    build type), from the build's CMakeCache.txt and, with Ninja, the exact compile line."""
    cache = cmake_cache(build)
    compiler = cache.get("CMAKE_CXX_COMPILER", "c++")
    try:
        version = subprocess.run([compiler, "--version"], stdout=subprocess.PIPE,
                                 universal_newlines=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        version = compiler
    flags = None
    try:
        commands = subprocess.run(["ninja", "-C", build, "-t", "commands", target],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  universal_newlines=True).stdout
        for line in commands.splitlines():
            if source in line and " -c " in line:
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
# Output
# --------------------------------------------------------------------------------------------


def markdown_table(header, rows, right=()):
    """Lines of a markdown table; the columns whose index is in `right` are right-aligned."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if i in right else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def verdict(ok):
    return "PASS" if ok else "MISS"


def peak_share(flops, ms, peak):
    """The fraction of `peak` (FLOP/s) that `flops` done in `ms` milliseconds take."""
    return flops / (ms * 1e-3) / peak


def percent(fraction):
    """A fraction as a whole percentage; n/a for NaN (a case that did not run)."""
    return "n/a" if fraction != fraction else "%.0f%%" % (100 * fraction)
