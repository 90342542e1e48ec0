// Multi-head attention forward (the second document's layer: E = 512, 8 heads), float, beside a
// baseline composed from the single-head API, and the layer's projections beside Eigen's GEMM.
//   build/bench/attn_multi_head_bench --benchmark_filter=MultiHeadForward/
//   python3 bench/compare_mha.py --build build     (the same shapes against PyTorch 1.13)
// The hot-path cases write into storage allocated before the timing (a first call fills the
// layer's workspace); BM_MultiHeadForwardAllocating times the convenience overload, which
// allocates on every call, on the same shapes. Read ratios within one run: these machines are
// shared and noisy.

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
  const attn::Tensor3<T> x = attn_bench::random_tensor<T>(batch, tokens, kEmbedDim, 2);
  attn::MultiHeadWorkspace<T> workspace;  // the hot path: storage reused from call to call
  attn::MultiHeadResult<T> result;
  const attn::MultiHeadOptions<T> options;
  layer.forward(x, x, x, options, workspace, result);  // sizes the workspace and the result
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
  const attn::Tensor3<T> x = attn_bench::random_tensor<T>(batch, tokens, kEmbedDim, 2);
  for (auto _ : state) {
    attn::MultiHeadResult<T> result = layer.forward(x, x, x);
    benchmark::DoNotOptimize(result.output.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, batch, tokens);
}

/// The baseline a user of the single-head API would write: per batch item and head, project with
/// the head's columns of W_Q, W_K, W_V (Eigen's GEMM), call `scaled_dot_product_attention` into
/// the head's output, copy it into its columns, then one output projection; all into storage
/// allocated before the timing.
template <class T>
void BM_MultiHeadForwardPerHead(benchmark::State& state) {
  const Index tokens = state.range(0);
  const Index batch = state.range(1);
  const attn::MultiHeadAttention<T> layer(attn::MultiHeadConfig{kEmbedDim, kHeads}, 1);
  const attn::Tensor3<T> x = attn_bench::random_tensor<T>(batch, tokens, kEmbedDim, 2);
  const Index head_dim = layer.head_dim();
  const attn::AttentionOptions<T> options;
  attn::Matrix<T> Q = attn::Matrix<T>::Zero(tokens, head_dim);
  attn::Matrix<T> K = attn::Matrix<T>::Zero(tokens, head_dim);
  attn::Matrix<T> V = attn::Matrix<T>::Zero(tokens, head_dim);
  attn::Matrix<T> head = attn::Matrix<T>::Zero(tokens, head_dim);
  attn::Matrix<T> concat = attn::Matrix<T>::Zero(tokens, kEmbedDim);
  attn::Matrix<T> out = attn::Matrix<T>::Zero(batch * tokens, kEmbedDim);
  for (auto _ : state) {
    for (Index b = 0; b < batch; ++b) {
      const Eigen::Map<const attn::Matrix<T>> X(x.data() + b * tokens * kEmbedDim, tokens,
                                                kEmbedDim);
      for (Index h = 0; h < kHeads; ++h) {
        const Index first = h * head_dim;
        Q.noalias() = X * layer.W_Q.middleCols(first, head_dim);
        Q.rowwise() += layer.b_Q.segment(first, head_dim);
        K.noalias() = X * layer.W_K.middleCols(first, head_dim);
        K.rowwise() += layer.b_K.segment(first, head_dim);
        V.noalias() = X * layer.W_V.middleCols(first, head_dim);
        V.rowwise() += layer.b_V.segment(first, head_dim);
        attn::scaled_dot_product_attention(Q, K, V, options, head);
        concat.middleCols(first, head_dim) = head;
      }
      out.middleRows(b * tokens, tokens).noalias() = concat * layer.W_O;
      out.middleRows(b * tokens, tokens).rowwise() += layer.b_O;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, batch, tokens);
}

/// One of the layer's projections, `X W_Q + b_Q` over all B T tokens (E x E), by `product` into
/// storage allocated before the timing. FLOP/s counts 2 B T E^2.
template <class T, class Product>
void run_projection(benchmark::State& state, const Product& product) {
  const Index rows = state.range(0) * state.range(1);
  const attn::MultiHeadAttention<T> layer(attn::MultiHeadConfig{kEmbedDim, kHeads}, 1);
  const attn::Matrix<T> X = attn_bench::random_matrix<T>(rows, kEmbedDim, 2);
  attn::Matrix<T> Y = attn::Matrix<T>::Zero(rows, kEmbedDim);
  for (auto _ : state) {
    product(X, layer.W_Q, Y);
    Y.rowwise() += layer.b_Q;
    benchmark::DoNotOptimize(Y.data());
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * static_cast<double>(rows) * static_cast<double>(kEmbedDim * kEmbedDim);
  state.counters["FLOP/s"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

/// The kernel `forward` runs for its projections (`detail::product_kernel`, the score kernel's
/// register tiles, W packed once per call); `project` itself has no caller-storage overload.
template <class T>
void BM_Projection(benchmark::State& state) {
  run_projection<T>(state, [](const attn::Matrix<T>& X, const attn::Matrix<T>& W,
                              attn::Matrix<T>& Y) { attn::detail::product_kernel<T>(X, W, Y); });
}

/// The projection's baseline: Eigen's GEMM, `Y.noalias() = X * W`.
template <class T>
void BM_ProjectionEigen(benchmark::State& state) {
  run_projection<T>(state, [](const attn::Matrix<T>& X, const attn::Matrix<T>& W,
                              attn::Matrix<T>& Y) { Y.noalias() = X * W; });
}

/// The layer's shapes, T in {128, 512, 2048} and B in {1, 8}, timed in wall-clock milliseconds.
void layer_shapes(benchmark::internal::Benchmark* b) {
  b->ArgsProduct({{128, 512, 2048}, {1, 8}})
      ->ArgNames({"T", "B"})
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
}

BENCHMARK_TEMPLATE(BM_MultiHeadForward, float)->Apply(layer_shapes);
BENCHMARK_TEMPLATE(BM_MultiHeadForwardAllocating, float)->Apply(layer_shapes);
BENCHMARK_TEMPLATE(BM_MultiHeadForwardPerHead, float)
    ->ArgsProduct({{128, 512}, {1}})
    ->ArgNames({"T", "B"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Projection, float)->Apply(layer_shapes);
BENCHMARK_TEMPLATE(BM_ProjectionEigen, float)->Apply(layer_shapes);

}  // namespace

int main(int argc, char** argv) { return attn_bench::run_benchmarks(argc, argv); }
