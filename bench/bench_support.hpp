#pragma once
// Shared pieces of the benchmarks: random inputs, the Eigen SIMD set in the context, naive
// baselines.

#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <attn/attn.hpp>
#include <cmath>
#include <limits>
#include <random>

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

/// Records the vector instruction set Eigen compiled for, once per benchmark binary.
inline void add_simd_context() {
  benchmark::AddCustomContext("eigen_simd", Eigen::SimdInstructionSetsInUse());
  benchmark::AddCustomContext("eigen_version", std::to_string(EIGEN_WORLD_VERSION) + "." +
                                                   std::to_string(EIGEN_MAJOR_VERSION) + "." +
                                                   std::to_string(EIGEN_MINOR_VERSION));
}

/// The naive baseline: S = scale * Q K^T by three plain loops.
template <class T>
void naive_scores(const attn::Matrix<T>& Q, const attn::Matrix<T>& K, T scale, attn::Matrix<T>& S) {
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
template <class T>
void naive_attention(const attn::Matrix<T>& Q, const attn::Matrix<T>& K, const attn::Matrix<T>& V,
                     bool causal, attn::Matrix<T>& S, attn::Matrix<T>& O) {
  const T scale = T(1) / std::sqrt(static_cast<T>(Q.cols()));
  naive_scores(Q, K, scale, S);
  O.setZero(Q.rows(), V.cols());
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
