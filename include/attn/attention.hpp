#pragma once
/// \file attention.hpp
/// Scaled dot-product attention, `softmax(Q K^T / sqrt(d_k)) V`, with its options (causal
/// alignment, sliding window, boolean mask, additive bias, scale, soft-capping, ALiBi, sink), and the
/// teaching trace of every intermediate table.

#include <cmath>
#include <limits>

#include "error.hpp"
#include "mask.hpp"
#include "projection.hpp"
#include "scores.hpp"
#include "softmax.hpp"
#include "types.hpp"

namespace attn {
namespace detail {

/// Checks the options of an attention call with n queries and m keys.
template <class T>
void check_options(const char* function, const AttentionOptions<T>& options, Index n, Index m) {
  if (options.mask) require_table(function, "mask", *options.mask, n, m);
  if (options.bias) require_table(function, "bias", *options.bias, n, m);
  if (options.window) require_window(function, *options.window);
  if (options.scale) require_finite_scale(function, *options.scale);
  if (options.softcap && !(std::isfinite(*options.softcap) && *options.softcap > T(0))) {
    fail(function, "softcap must be finite and > 0, got ", *options.softcap);
  }
  if (options.alibi_slope && !std::isfinite(*options.alibi_slope)) {
    fail(function, "alibi_slope must be finite, got ", *options.alibi_slope);
  }
  if (options.sink && (std::isnan(*options.sink) || *options.sink > std::numeric_limits<T>::max())) {
    fail(function, "sink must be a number below +inf, got ", *options.sink);
  }
}

/// Checks the operands and options of an attention call (n queries, m keys).
template <class DQ, class DK, class DV>
void check_attention(const char* function, const Eigen::MatrixBase<DQ>& Q,
                     const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                     const AttentionOptions<typename DQ::Scalar>& options) {
  require_same_scalar<DQ, DK>();
  require_same_scalar<DQ, DV>();
  require_width(function, "Q", Q);
  require_same_cols(function, "K", K, "Q", Q);
  require_same_rows(function, "V", V, "K", K);
  check_options(function, options, Q.rows(), K.rows());
}

template <class T>
T scale_of(const AttentionOptions<T>& options, Index d_k) {
  return options.scale ? *options.scale : default_scale<T>(d_k);
}

/// Pipeline step 2: `s -> c * tanh(s / c)`.
template <class T>
void apply_softcap(const AttentionOptions<T>& options, Matrix<T>& S) {
  if (!options.softcap) return;
  const T c = *options.softcap;
  S = c * (S.array() * (T(1) / c)).tanh();
}

/// Pipeline steps 3 and 4: `+ bias`, `- slope |i + shift - j|`, then every disallowed key (causal,
/// window, mask) to -inf.
template <class T>
void apply_bias_and_mask(const AttentionOptions<T>& options, Matrix<T>& S) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const Index n = S.rows();
  const Index m = S.cols();
  if (options.bias) S += *options.bias;
  const Index shift = causal_shift(options.causal, n, m);
  for (Index i = 0; i < n; ++i) {
    Eigen::Ref<RowVector<T>> row = S.row(i);
    if (options.alibi_slope) {
      const T slope = *options.alibi_slope;
      const T position = static_cast<T>(i + shift);
      row.array() -= slope * (RowVector<T>::LinSpaced(m, T(0), static_cast<T>(m - 1)).array() -
                              position)
                                 .abs();
    }
    const KeyRange keys = key_range(i, n, m, options.causal, options.window);
    row.head(keys.begin).setConstant(neg_inf);
    row.tail(m - keys.end).setConstant(neg_inf);
  }
  if (options.mask) S = options.mask->select(S, neg_inf);
}

/// The logits that enter the softmax: steps 1 to 4 of the pipeline.
template <class T>
void logits_kernel(ConstRef<T> Q, ConstRef<T> K, const AttentionOptions<T>& options,
                   Matrix<T>& S) {
  scores_kernel<T>(Q, K, scale_of(options, Q.cols()), S);
  apply_softcap(options, S);
  apply_bias_and_mask(options, S);
}

/// The materialised path. Shape contract: Q n x d_k, K m x d_k, V m x d_v; P becomes the n x m
/// weights; O, already n x d_v (a block of a larger matrix is fine), receives the output.
/// Memory: the n x m table P (reused across calls when it already has the right size).
template <class T>
void attention_kernel(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V,
                      const AttentionOptions<T>& options, Matrix<T>& P, Eigen::Ref<Matrix<T>> O) {
  ATTN_ASSERT(O.rows() == Q.rows() && O.cols() == V.cols());
  logits_kernel<T>(Q, K, options, P);
  for (Index i = 0; i < P.rows(); ++i) softmax_row_inplace<T>(P.row(i), options.sink);
  O.noalias() = P * V;
}

}  // namespace detail

/// Scaled dot-product attention: `softmax(scale * Q K^T + bias, masked) V`.
/// \param Q        n x d_k queries, one row per token (any Eigen expression, either storage order)
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param options  causal alignment, window, mask (n x m), bias (n x m), scale, softcap, ALiBi, sink
/// \returns n x d_v: row i is the attention-weighted average of the rows of V. A query that may
///          attend no key gets a zero row.
/// \throws shape_error on mismatched shapes or invalid options.
/// \note Materialises the n x m weights: O(n m) memory, 4 n m d flops (d_k = d_v = d).
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> scaled_dot_product_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const AttentionOptions<typename DQ::Scalar>& options = {}) {
  using T = typename DQ::Scalar;
  detail::check_attention("scaled_dot_product_attention", Q, K, V, options);
  Matrix<T> P;
  Matrix<T> O(Q.rows(), V.cols());
  detail::attention_kernel<T>(Q, K, V, options, P, O);
  return O;
}

/// Attention that also returns its n x m weights (see `scaled_dot_product_attention`).
/// \returns `{output (n x d_v), weights (n x m)}`; each weight row sums to 1, or is all zero for a
///          query that may attend no key.
/// \throws shape_error on mismatched shapes or invalid options.
template <class DQ, class DK, class DV>
Attention<typename DQ::Scalar> attention_with_weights(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const AttentionOptions<typename DQ::Scalar>& options = {}) {
  using T = typename DQ::Scalar;
  detail::check_attention("attention_with_weights", Q, K, V, options);
  Attention<T> result{Matrix<T>(Q.rows(), V.cols()), Matrix<T>()};
  detail::attention_kernel<T>(Q, K, V, options, result.weights, result.output);
  return result;
}

/// Every intermediate table of one attention call, in the order the documents compute them:
/// raw scores, scaled, masked, row maxima, exponentials, row sums, weights, output.
/// \returns an `AttentionTrace` (see its fields for shapes).
/// \throws shape_error on mismatched shapes or invalid options.
/// \note For teaching and debugging: it keeps four n x m tables.
template <class DQ, class DK, class DV>
AttentionTrace<typename DQ::Scalar> trace_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const AttentionOptions<typename DQ::Scalar>& options = {}) {
  using T = typename DQ::Scalar;
  detail::check_attention("trace_attention", Q, K, V, options);
  const detail::ConstRef<T> q(Q);
  const detail::ConstRef<T> k(K);
  const detail::ConstRef<T> v(V);
  AttentionTrace<T> trace;
  detail::scores_kernel<T>(q, k, T(1), trace.scores);
  trace.scaled = detail::scale_of(options, q.cols()) * trace.scores;
  detail::apply_softcap(options, trace.scaled);
  trace.masked = trace.scaled;
  detail::apply_bias_and_mask(options, trace.masked);
  trace.exp = trace.masked;
  trace.weights.resize(trace.exp.rows(), trace.exp.cols());
  trace.row_max.resize(q.rows());
  trace.row_sum.resize(q.rows());
  for (Index i = 0; i < q.rows(); ++i) {
    const detail::RowStats<T> stats = detail::exp_row_inplace<T>(trace.exp.row(i), options.sink);
    trace.row_max(i) = stats.max;
    trace.row_sum(i) = stats.sum;
    trace.weights.row(i) = trace.exp.row(i);
    detail::normalise_inplace<T>(trace.weights.row(i), stats.sum);
  }
  trace.output.noalias() = trace.weights * v;
  return trace;
}

}  // namespace attn
