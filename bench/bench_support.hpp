#pragma once
// Shared pieces of the benchmarks: random inputs, the context every binary records (Eigen's SIMD
// set, the compiler, attn's thread count), naive baselines.

#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <algorithm>
#include <attn/attn.hpp>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace attn_bench {

/// A matrix of N(0, 1) entries from a fixed seed.
template <class T>
attn::Matrix<T> random_matrix(attn::Index rows, attn::Index cols, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<T> normal(T(0), T(1));
  attn::Matrix<T> M(rows, cols);
  for (attn::Index i = 0; i < M.size(); ++i) M.data()[i] = normal(rng);
  return M;
}

/// A row-major (a, b, c) tensor of N(0, 1) entries from a fixed seed: (heads, tokens, features)
/// or (batch, tokens, features).
template <class T>
attn::Tensor3<T> random_tensor(attn::Index a, attn::Index b, attn::Index c, std::uint32_t seed) {
  attn::Tensor3<T> t(a, b, c);
  Eigen::Map<attn::Matrix<T>>(t.data(), a * b, c) = random_matrix<T>(a * b, c, seed);
  return t;
}

/// The compiler that built this binary, as it names itself.
inline std::string compiler_name() {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "gcc " __VERSION__;
#elif defined(_MSC_VER)
  return "msvc " + std::to_string(_MSC_VER);
#else
  return "unknown";
#endif
}

/// Records, once per benchmark binary, the vector instruction set Eigen compiled for, Eigen's
/// version, the compiler and the number of threads attn's kernels use (OMP_NUM_THREADS with the
/// openmp target, else 1): the scripts print them beside the numbers.
inline void add_context() {
  benchmark::AddCustomContext("eigen_simd", Eigen::SimdInstructionSetsInUse());
  benchmark::AddCustomContext("eigen_version", std::to_string(EIGEN_WORLD_VERSION) + "." +
                                                   std::to_string(EIGEN_MAJOR_VERSION) + "." +
                                                   std::to_string(EIGEN_MINOR_VERSION));
  benchmark::AddCustomContext("compiler", compiler_name());
  benchmark::AddCustomContext("attn_threads", std::to_string(attn::num_threads()));
}

/// The streaming baseline of the decoding benchmarks: the sum of a 512 MiB float buffer (larger
/// than any cache they read) in `chunks` contiguous chunks over attn's threads; its
/// `bytes_per_second` is what the machine streams at all.
inline void stream_sum(benchmark::State& state, attn::Index chunks) {
  const attn::Index floats = attn::Index(1) << 27;  // 512 MiB
  attn::Matrix<float> buffer = attn::Matrix<float>::Constant(1, floats, 1.0f);
  const attn::Index chunk = floats / chunks;
  std::vector<double> partial(static_cast<std::size_t>(chunks));
  for (auto _ : state) {
    attn::detail::parallel_for<int>(chunks, [&](attn::Index c, int&) {
      partial[static_cast<std::size_t>(c)] =
          static_cast<double>(buffer.middleCols(c * chunk, chunk).sum());
    });
    benchmark::DoNotOptimize(partial.data());
  }
  state.SetBytesProcessed(state.iterations() * floats * static_cast<std::int64_t>(sizeof(float)));
  state.counters["threads"] = attn::num_threads();
}

/// The `main` of a Google Benchmark program: flags, the context above, every case selected.
inline int run_benchmarks(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  add_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

/// The naive baseline: S = scale * Q K^T by three plain loops.
template <class T>
void naive_scores(const Eigen::Ref<const attn::Matrix<T>>& Q,
                  const Eigen::Ref<const attn::Matrix<T>>& K, T scale, attn::Matrix<T>& S) {
  S.resize(Q.rows(), K.rows());
  for (attn::Index i = 0; i < Q.rows(); ++i) {
    for (attn::Index j = 0; j < K.rows(); ++j) {
      T dot = 0;
      for (attn::Index c = 0; c < Q.cols(); ++c) dot += Q(i, c) * K(j, c);
      S(i, j) = scale * dot;
    }
  }
}

/// The naive baseline of full attention: plain loops for scores, softmax and the weighted sum.
/// S is the n x m work table (resized), O the n x d_v output (already that shape: a slice of a
/// larger tensor is fine).
template <class T>
void naive_attention(const Eigen::Ref<const attn::Matrix<T>>& Q,
                     const Eigen::Ref<const attn::Matrix<T>>& K,
                     const Eigen::Ref<const attn::Matrix<T>>& V, bool causal, attn::Matrix<T>& S,
                     Eigen::Ref<attn::Matrix<T>> O) {
  const T scale = T(1) / std::sqrt(static_cast<T>(Q.cols()));
  naive_scores<T>(Q, K, scale, S);
  O.setZero();
  const attn::Index shift = K.rows() - Q.rows();
  for (attn::Index i = 0; i < Q.rows(); ++i) {
    const attn::Index end = causal ? std::min(K.rows(), i + shift + 1) : K.rows();
    T max = -std::numeric_limits<T>::infinity();
    for (attn::Index j = 0; j < end; ++j) max = std::max(max, S(i, j));
    T sum = 0;
    for (attn::Index j = 0; j < end; ++j) sum += (S(i, j) = std::exp(S(i, j) - max));
    for (attn::Index j = 0; j < end; ++j) {
      const T p = S(i, j) / sum;
      for (attn::Index c = 0; c < V.cols(); ++c) O(i, c) += p * V(j, c);
    }
  }
}

}  // namespace attn_bench
