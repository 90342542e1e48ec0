// Multi-head attention forward (the second document's layer: E = 512, 8 heads), float, beside a
// baseline composed from the single-head API.
//   build/bench/attn_multi_head_bench --benchmark_filter=MultiHeadForward/
//   python3 bench/compare_mha.py --build build     (the same shapes against PyTorch 1.13)
// Read ratios within one run: these machines are shared and noisy.

#include <string>
#include <unsupported/Eigen/CXX11/Tensor>

#include "bench_support.hpp"

namespace {

using attn::Index;

constexpr Index kEmbedDim = 512;
constexpr Index kHeads = 8;

/// Floating-point operations of one self-attention forward over (batch, T, E): the four
/// projections (Q, K, V, output) at 2 B T E^2 each, and Q K^T plus P V at 2 B T^2 E each (summed
/// over the heads, whose widths add up to E).
double forward_flops(Index batch, Index tokens, Index embed) {
  const double b = static_cast<double>(batch);
  const double t = static_cast<double>(tokens);
  const double e = static_cast<double>(embed);
  return 4.0 * 2.0 * b * t * e * e + 4.0 * b * t * t * e;
}

/// (batch, tokens, E) of N(0, 1) entries from a fixed seed.
template <class T>
attn::Tensor3<T> random_tensor(Index batch, Index tokens, Index embed, std::uint32_t seed) {
  attn::Tensor3<T> x(batch, tokens, embed);
  Eigen::Map<attn::Matrix<T>>(x.data(), batch * tokens, embed) =
      attn_bench::random_matrix<T>(batch * tokens, embed, seed);
  return x;
}

void set_counters(benchmark::State& state, Index batch, Index tokens) {
  state.counters["FLOP/s"] = benchmark::Counter(forward_flops(batch, tokens, kEmbedDim),
                                                benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(batch * tokens),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

/// The layer: `MultiHeadAttention::forward(x, x, x)`, no weights returned (PyTorch's
/// need_weights=False).
template <class T>
void BM_MultiHeadForward(benchmark::State& state) {
  const Index tokens = state.range(0);
  const Index batch = state.range(1);
  const attn::MultiHeadAttention<T> layer(attn::MultiHeadConfig{kEmbedDim, kHeads}, 1);
  const attn::Tensor3<T> x = random_tensor<T>(batch, tokens, kEmbedDim, 2);
  attn::MultiHeadWorkspace<T> workspace;  // the hot path: storage reused from call to call
  attn::MultiHeadResult<T> result;
  const attn::MultiHeadOptions<T> options;
  for (auto _ : state) {
    layer.forward(x, x, x, options, workspace, result);
    benchmark::DoNotOptimize(result.output.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, batch, tokens);
}

/// The convenience overload, which allocates its intermediates and result on every call.
template <class T>
void BM_MultiHeadForwardAllocating(benchmark::State& state) {
  const Index tokens = state.range(0);
  const Index batch = state.range(1);
  const attn::MultiHeadAttention<T> layer(attn::MultiHeadConfig{kEmbedDim, kHeads}, 1);
  const attn::Tensor3<T> x = random_tensor<T>(batch, tokens, kEmbedDim, 2);
  for (auto _ : state) {
    attn::MultiHeadResult<T> result = layer.forward(x, x, x);
    benchmark::DoNotOptimize(result.output.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, batch, tokens);
}

/// The baseline a user of the single-head API would write: per batch item and head, project with
/// the head's columns of W_Q, W_K, W_V, call `scaled_dot_product_attention`, write the head's
/// output into its columns, then one output projection.
template <class T>
void BM_MultiHeadForwardPerHead(benchmark::State& state) {
  const Index tokens = state.range(0);
  const Index batch = state.range(1);
  const attn::MultiHeadAttention<T> layer(attn::MultiHeadConfig{kEmbedDim, kHeads}, 1);
  const attn::Tensor3<T> x = random_tensor<T>(batch, tokens, kEmbedDim, 2);
  const Index head_dim = layer.head_dim();
  attn::Matrix<T> concat(tokens, kEmbedDim);
  attn::Matrix<T> out(batch * tokens, kEmbedDim);
  for (auto _ : state) {
    for (Index b = 0; b < batch; ++b) {
      const Eigen::Map<const attn::Matrix<T>> X(x.data() + b * tokens * kEmbedDim, tokens,
                                                kEmbedDim);
      for (Index h = 0; h < kHeads; ++h) {
        const Index first = h * head_dim;
        const attn::Matrix<T> Q = attn::project(X, layer.W_Q.middleCols(first, head_dim),
                                                layer.b_Q.segment(first, head_dim));
        const attn::Matrix<T> K = attn::project(X, layer.W_K.middleCols(first, head_dim),
                                                layer.b_K.segment(first, head_dim));
        const attn::Matrix<T> V = attn::project(X, layer.W_V.middleCols(first, head_dim),
                                                layer.b_V.segment(first, head_dim));
        concat.middleCols(first, head_dim) = attn::scaled_dot_product_attention(Q, K, V);
      }
      out.middleRows(b * tokens, tokens) = attn::project(concat, layer.W_O, layer.b_O);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, batch, tokens);
}

BENCHMARK_TEMPLATE(BM_MultiHeadForward, float)
    ->ArgsProduct({{128, 512, 2048}, {1, 8}})
    ->ArgNames({"T", "B"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_MultiHeadForwardAllocating, float)
    ->ArgsProduct({{128, 512}, {1, 8}})
    ->ArgNames({"T", "B"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_MultiHeadForwardPerHead, float)
    ->ArgsProduct({{128, 512}, {1}})
    ->ArgNames({"T", "B"})
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  attn_bench::add_simd_context();
  benchmark::AddCustomContext("attn_threads", std::to_string(attn::num_threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
