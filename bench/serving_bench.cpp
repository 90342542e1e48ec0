// Many sequences at once (issue 41): the packed variable-length prefill against the loop it
// replaces. bench/compare_serving.py runs every case in one process per round and prints the
// ratios against the targets.
//   build/bench/attn_serving_bench --benchmark_filter=varlen
// BM_varlen_prefill: `varlen_attention` over 16 sequences of 64 .. 4096 tokens (causal,
// bottom-right; 8 query heads over 2 key/value heads, d = 64), on `threads` threads.
// BM_per_sequence_flash: the same work as one `flash_attention` call per sequence and query head.

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "bench_support.hpp"

namespace {

using attn::Index;

constexpr Index prefill_heads = 8;
constexpr Index prefill_kv_heads = 2;
constexpr Index prefill_dim = 64;

/// 16 lengths drawn uniformly from 64 .. 4096 by a fixed seed (the same batch in every run).
std::vector<int> prefill_lengths() {
  std::mt19937 rng(41);
  std::uniform_int_distribution<int> length(64, 4096);
  std::vector<int> lengths(16);
  for (int& n : lengths) n = length(rng);
  return lengths;
}

struct PackedPrefill {
  std::vector<int> offsets{0};
  attn::Tensor3<float> Q, K, V, out;
  double flops = 0;  // the causal products: 2 (d_k + d_v) per visible (query, key), per head
  PackedPrefill() {
    for (const int n : prefill_lengths()) {
      offsets.push_back(offsets.back() + n);
      flops +=
          2.0 * double(2 * prefill_dim) * double(prefill_heads) * double(n) * double(n + 1) / 2.0;
    }
    const Index total = offsets.back();
    Q = attn_bench::random_tensor<float>(prefill_heads, total, prefill_dim, 1);
    K = attn_bench::random_tensor<float>(prefill_kv_heads, total, prefill_dim, 2);
    V = attn_bench::random_tensor<float>(prefill_kv_heads, total, prefill_dim, 3);
    out.resize(prefill_heads, total, prefill_dim);
  }
};

const PackedPrefill& prefill() {
  static const PackedPrefill batch;
  return batch;
}

void set_counters(benchmark::State& state, double flops) {
  state.counters["threads"] = attn::num_threads();
  state.counters["FLOP/s"] =
      benchmark::Counter(double(state.iterations()) * flops, benchmark::Counter::kIsRate);
}

void BM_varlen_prefill(benchmark::State& state) {
  attn::set_num_threads(int(state.range(0)));
  const PackedPrefill& x = prefill();
  attn::Tensor3<float> out = x.out;
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  for (auto _ : state) {
    attn::varlen_attention(x.Q, x.K, x.V, x.offsets, x.offsets, options, {}, out);
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(state, x.flops);
  attn::set_num_threads(0);
}

void BM_per_sequence_flash(benchmark::State& state) {
  attn::set_num_threads(int(state.range(0)));
  const PackedPrefill& x = prefill();
  const Index total = x.offsets.back();
  const Index group = prefill_heads / prefill_kv_heads;
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  attn::Matrix<float> out;
  const auto rows = [&](const attn::Tensor3<float>& t, Index h, Index first, Index n) {
    return Eigen::Map<const attn::Matrix<float>>(t.data() + (h * total + first) * prefill_dim, n,
                                                 prefill_dim);
  };
  for (auto _ : state) {
    for (std::size_t b = 0; b + 1 < x.offsets.size(); ++b) {
      const Index first = x.offsets[b];
      const Index n = x.offsets[b + 1] - first;
      for (Index h = 0; h < prefill_heads; ++h) {
        attn::flash_attention(rows(x.Q, h, first, n), rows(x.K, h / group, first, n),
                              rows(x.V, h / group, first, n), options, out);
        benchmark::DoNotOptimize(out.data());
      }
    }
  }
  set_counters(state, x.flops);
  attn::set_num_threads(0);
}

void thread_counts(benchmark::internal::Benchmark* b) {
  b->Arg(1)->Arg(2)->ArgNames({"threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_varlen_prefill)->Apply(thread_counts);
BENCHMARK(BM_per_sequence_flash)->Apply(thread_counts);

int main(int argc, char** argv) { return attn_bench::run_benchmarks(argc, argv); }
