// The n x n score kernel and the full attention path, each beside its naive baseline.
//   build/bench/attn_bench --benchmark_filter=Scores
// Read ratios within one run: these machines are shared and noisy.

#include "bench_support.hpp"

namespace {

using attn::Index;

constexpr double kFlopsPerScore = 2.0;      // one multiply-add per (i, j, c)
constexpr double kFlopsPerAttention = 4.0;  // Q K^T and P V

template <class T>
void BM_Scores(benchmark::State& state) {
  const Index n = state.range(0);
  const Index d = state.range(1);
  const attn::Matrix<T> Q = attn_bench::random_matrix<T>(n, d, 1);
  const attn::Matrix<T> K = attn_bench::random_matrix<T>(n, d, 2);
  attn::Matrix<T> S = attn::Matrix<T>::Zero(n, n);  // touched: no page faults in the timing
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  for (auto _ : state) {
    attn::scores(Q, K, scale, S);
    benchmark::DoNotOptimize(S.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOP/s"] = benchmark::Counter(kFlopsPerScore * static_cast<double>(n * n * d),
                                                benchmark::Counter::kIsIterationInvariantRate);
}

template <class T>
void BM_ScoresNaive(benchmark::State& state) {
  const Index n = state.range(0);
  const Index d = state.range(1);
  const attn::Matrix<T> Q = attn_bench::random_matrix<T>(n, d, 1);
  const attn::Matrix<T> K = attn_bench::random_matrix<T>(n, d, 2);
  attn::Matrix<T> S = attn::Matrix<T>::Zero(n, n);  // touched: no page faults in the timing
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  for (auto _ : state) {
    attn_bench::naive_scores(Q, K, scale, S);
    benchmark::DoNotOptimize(S.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOP/s"] = benchmark::Counter(kFlopsPerScore * static_cast<double>(n * n * d),
                                                benchmark::Counter::kIsIterationInvariantRate);
}

template <class T>
void BM_Attention(benchmark::State& state) {
  const Index n = state.range(0);
  const Index d = state.range(1);
  const bool causal = state.range(2) != 0;
  const attn::Matrix<T> Q = attn_bench::random_matrix<T>(n, d, 1);
  const attn::Matrix<T> K = attn_bench::random_matrix<T>(n, d, 2);
  const attn::Matrix<T> V = attn_bench::random_matrix<T>(n, d, 3);
  attn::AttentionOptions<T> options;
  if (causal) options.causal = attn::Causal::BottomRight;
  for (auto _ : state) {
    attn::Matrix<T> O = attn::scaled_dot_product_attention(Q, K, V, options);
    benchmark::DoNotOptimize(O.data());
  }
  const double useful = causal ? 0.5 : 1.0;
  state.counters["FLOP/s"] =
      benchmark::Counter(useful * kFlopsPerAttention * static_cast<double>(n * n * d),
                         benchmark::Counter::kIsIterationInvariantRate);
}

/// The materialised path alone (attention_with_weights keeps the n x m weights).
template <class T>
void BM_Materialised(benchmark::State& state) {
  const Index n = state.range(0);
  const Index d = state.range(1);
  const bool causal = state.range(2) != 0;
  const attn::Matrix<T> Q = attn_bench::random_matrix<T>(n, d, 1);
  const attn::Matrix<T> K = attn_bench::random_matrix<T>(n, d, 2);
  const attn::Matrix<T> V = attn_bench::random_matrix<T>(n, d, 3);
  attn::AttentionOptions<T> options;
  if (causal) options.causal = attn::Causal::BottomRight;
  for (auto _ : state) {
    attn::Attention<T> result = attn::attention_with_weights(Q, K, V, options);
    benchmark::DoNotOptimize(result.output.data());
  }
  const double useful = causal ? 0.5 : 1.0;
  state.counters["FLOP/s"] =
      benchmark::Counter(useful * kFlopsPerAttention * static_cast<double>(n * n * d),
                         benchmark::Counter::kIsIterationInvariantRate);
}

/// The tiled path; window > 0 adds a causal sliding window (FLOPs count the visible keys only).
template <class T>
void BM_Flash(benchmark::State& state) {
  const Index n = state.range(0);
  const Index d = state.range(1);
  const bool causal = state.range(2) != 0;
  const Index window = state.range(3);
  const attn::Matrix<T> Q = attn_bench::random_matrix<T>(n, d, 1);
  const attn::Matrix<T> K = attn_bench::random_matrix<T>(n, d, 2);
  const attn::Matrix<T> V = attn_bench::random_matrix<T>(n, d, 3);
  attn::AttentionOptions<T> options;
  if (causal) options.causal = attn::Causal::BottomRight;
  if (window > 0) options.window = window;
  for (auto _ : state) {
    attn::Matrix<T> O = attn::flash_attention(Q, K, V, options);
    benchmark::DoNotOptimize(O.data());
  }
  const double pairs = window > 0 ? static_cast<double>(n) * static_cast<double>(window + 1)
                       : causal   ? 0.5 * static_cast<double>(n * n)
                                  : static_cast<double>(n * n);
  state.counters["FLOP/s"] = benchmark::Counter(kFlopsPerAttention * pairs * static_cast<double>(d),
                                                benchmark::Counter::kIsIterationInvariantRate);
}

template <class T>
void BM_AttentionNaive(benchmark::State& state) {
  const Index n = state.range(0);
  const Index d = state.range(1);
  const bool causal = state.range(2) != 0;
  const attn::Matrix<T> Q = attn_bench::random_matrix<T>(n, d, 1);
  const attn::Matrix<T> K = attn_bench::random_matrix<T>(n, d, 2);
  const attn::Matrix<T> V = attn_bench::random_matrix<T>(n, d, 3);
  attn::Matrix<T> S;
  attn::Matrix<T> O;
  for (auto _ : state) {
    attn_bench::naive_attention(Q, K, V, causal, S, O);
    benchmark::DoNotOptimize(O.data());
  }
  const double useful = causal ? 0.5 : 1.0;
  state.counters["FLOP/s"] =
      benchmark::Counter(useful * kFlopsPerAttention * static_cast<double>(n * n * d),
                         benchmark::Counter::kIsIterationInvariantRate);
}

const std::vector<int64_t> kSizes = {128, 256, 512, 1024, 2048, 4096};

BENCHMARK(BM_Scores<float>)->ArgsProduct({kSizes, {64, 128}})->ArgNames({"n", "d"});
BENCHMARK(BM_Scores<double>)->ArgsProduct({kSizes, {64, 128}})->ArgNames({"n", "d"});
BENCHMARK(BM_ScoresNaive<float>)->ArgsProduct({{128, 512, 1024}, {64}})->ArgNames({"n", "d"});
BENCHMARK(BM_Attention<float>)
    ->ArgsProduct({{128, 512, 1024, 2048}, {64}, {0, 1}})
    ->ArgNames({"n", "d", "causal"});
BENCHMARK(BM_Attention<double>)
    ->ArgsProduct({{128, 512, 1024, 2048}, {64}, {0, 1}})
    ->ArgNames({"n", "d", "causal"});
BENCHMARK(BM_Materialised<float>)
    ->ArgsProduct({{512, 1024, 2048}, {64}, {0, 1}})
    ->ArgNames({"n", "d", "causal"});
BENCHMARK(BM_Flash<float>)
    ->ArgsProduct({{512, 1024, 2048, 4096}, {64, 128}, {0, 1}, {0}})
    ->ArgNames({"n", "d", "causal", "window"});
BENCHMARK(BM_Flash<float>)
    ->ArgsProduct({{2048, 4096}, {64}, {1}, {256}})
    ->ArgNames({"n", "d", "causal", "window"});
BENCHMARK(BM_Flash<double>)
    ->ArgsProduct({{512, 2048}, {64}, {0, 1}, {0}})
    ->ArgNames({"n", "d", "causal", "window"});
BENCHMARK(BM_AttentionNaive<float>)
    ->ArgsProduct({{128, 512, 1024}, {64}, {0, 1}})
    ->ArgNames({"n", "d", "causal"});

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  attn_bench::add_simd_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
