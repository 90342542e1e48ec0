#pragma once
/// \file attention.hpp
/// Scaled dot-product attention, `softmax(Q K^T / sqrt(d_k)) V`, with its options (causal
/// alignment, sliding window, boolean mask, additive bias, scale, soft-capping, ALiBi, sink), and
/// the teaching trace of every intermediate table.

#include <cmath>
#include <limits>

#include "detail/pipeline.hpp"
#include "error.hpp"
#include "flash.hpp"
#include "softmax.hpp"
#include "threads.hpp"
#include "types.hpp"

namespace attn {
namespace detail {

/// The materialised path. Shape contract: Q n x d_k, K m x d_k, V m x d_v; P becomes the n x m
/// weights; O, already n x d_v (a block of a larger matrix is fine), receives the output.
/// Memory: the n x m table P (reused across calls when it already has the right size).
/// Blocks of query rows run in parallel (`parallel_for`); each block goes through the pipeline:
/// scores `(scale Q_b) K^T`, softcap, bias/ALiBi/masks, row softmax, `P_b V`.
template <class T>
void attention_kernel(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V,
                      const AttentionOptions<T>& options, Matrix<T>& P, Eigen::Ref<Matrix<T>> O) {
  ATTN_ASSERT(O.rows() == Q.rows() && O.cols() == V.cols());
  const Index n = Q.rows();
  const Index m = K.rows();
  const T scale = scale_of(options, Q.cols());
  P.resize(n, m);
  constexpr Index block_rows = 64;
  const Index blocks = (n + block_rows - 1) / block_rows;
  parallel_for<Matrix<T>>(blocks, [&](Index b, Matrix<T>& q_scaled) {
    const Index i0 = b * block_rows;
    const Index rows = std::min(block_rows, n - i0);
    q_scaled.noalias() = scale * Q.middleRows(i0, rows);
    Eigen::Ref<Matrix<T>> P_b = P.middleRows(i0, rows);
    P_b.noalias() = q_scaled * K.transpose();
    apply_softcap<T>(options, P_b);
    apply_bias_and_mask<T>(options, {n, m, i0, 0}, P_b);
    for (Index r = 0; r < rows; ++r) softmax_row_inplace<T>(P_b.row(r), options.sink);
    O.middleRows(i0, rows).noalias() = P_b * V;
  });
}

/// One head inside a parallel loop over heads: the materialised kernel when its weights are wanted
/// (they are left in P) or the problem is small, the tiled kernel otherwise (P is then untouched).
template <class T>
void head_attention(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, const AttentionOptions<T>& options,
                    Matrix<T>& P, Eigen::Ref<Matrix<T>> O, bool keep_weights = false) {
  if (keep_weights || !prefer_flash(Q.rows(), K.rows())) {
    attention_kernel<T>(Q, K, V, options, P, O);
  } else {
    flash_kernel<T>(Q, K, V, options, FlashTiles{}, O, nullptr);
  }
}

}  // namespace detail

/// Scaled dot-product attention: `softmax(scale * Q K^T + bias, masked) V`.
/// \param Q        n x d_k queries, one row per token (any Eigen expression, either storage order)
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param options  causal alignment, window, mask (n x m), bias (n x m), scale, softcap, ALiBi,
/// sink \returns n x d_v: row i is the attention-weighted average of the rows of V. A query that
/// may
///          attend no key gets a zero row.
/// \throws shape_error on mismatched shapes or invalid options.
/// \note 4 n m d flops (d_k = d_v = d). Small problems go through the materialised n x m table,
///       larger ones through the tiled `flash_attention` kernel (see `detail::prefer_flash`), whose
///       memory is O((n + m) d); both agree to float rounding.
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> scaled_dot_product_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const AttentionOptions<typename DQ::Scalar>& options = {}) {
  using T = typename DQ::Scalar;
  detail::check_attention("scaled_dot_product_attention", Q, K, V, options);
  Matrix<T> O(Q.rows(), V.cols());
  if (detail::prefer_flash(Q.rows(), K.rows())) {
    detail::flash_kernel<T>(Q, K, V, options, FlashTiles{}, O, nullptr);
  } else {
    Matrix<T> P;
    detail::attention_kernel<T>(Q, K, V, options, P, O);
  }
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
  detail::apply_softcap<T>(options, trace.scaled);
  trace.masked = trace.scaled;
  detail::apply_bias_and_mask<T>(options, {q.rows(), k.rows(), 0, 0}, trace.masked);
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
