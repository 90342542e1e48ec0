// The machine's single-core FMA peak, so that the other benchmarks' FLOP/s can be read as a
// fraction of it:  build/bench/attn_peak_fma_bench
// Independent chains of fused multiply-adds on the widest vectors the compiler targets (GCC/Clang
// vector extensions; -march=native in the benchmark build): enough chains to cover the FMA
// latency times the number of FMA units, so the loop is bound by throughput.

#include <benchmark/benchmark.h>

#include <cstddef>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));

constexpr int kChains = 12;  // >= latency (4 cycles) x units (2), with room to spare
constexpr int kSteps = 1 << 16;

void BM_PeakFmaFloat(benchmark::State& state) {
  Vec acc[kChains];
  Vec a;
  Vec b;
  for (int l = 0; l < kLanes; ++l) {
    a[l] = 0.999999f;
    b[l] = 1e-7f;
  }
  for (Vec& v : acc) v = b;
  for (auto _ : state) {
    for (int step = 0; step < kSteps; ++step) {
      for (Vec& v : acc) v = v * a + b;  // contracted to one FMA per chain with -march=native
    }
    benchmark::DoNotOptimize(acc);
  }
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * kLanes * kChains * static_cast<double>(kSteps),
                         benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::to_string(kLanes) + " float lanes, " + std::to_string(kChains) + " chains");
}
BENCHMARK(BM_PeakFmaFloat);

}  // namespace

BENCHMARK_MAIN();
