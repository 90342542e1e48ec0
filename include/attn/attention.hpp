#pragma once
/// \file attention.hpp
/// Scaled dot-product attention, `softmax(Q K^T / sqrt(d_k)) V`, with its options (causal
/// alignment, query offset, windows on both sides, boolean mask, additive bias, scale,
/// soft-capping, ALiBi, sink), and the teaching trace of every intermediate table.

#include <cmath>
#include <limits>

#include "detail/paths.hpp"
#include "detail/pipeline.hpp"
#include "error.hpp"
#include "flash.hpp"
#include "scores.hpp"
#include "softmax.hpp"
#include "types.hpp"

namespace attn {
/// Scaled dot-product attention, `softmax(scale * Q K^T + bias, masked) V`, into caller storage.
/// \param Q        n x d_k queries, one row per token (any Eigen expression, either storage order)
/// \param K        m x d_k keys: Q's scalar type, or `Eigen::half` / `Eigen::bfloat16` (widened
///                 to Q's type in the kernels, as a `KVCache` with `KVStorage::Float16` /
///                 `BFloat16` reads its rows; the result is then exactly that of the widened keys)
/// \param V        m x d_v values, of K's scalar type
/// \param options  causal alignment, query offset, windows, mask (n x m), bias (n x m), scale,
///                 softcap, ALiBi, sink
/// \param out      resized to n x d_v (no allocation when it already has that shape): row i is the
///                 attention-weighted average of the rows of V; a query that may attend no key
///                 gets a zero row
/// \throws shape_error on mismatched shapes or invalid options.
/// \note 4 n m d flops (d_k = d_v = d). `detail::choose_path` picks the path: the materialised
///       n x m table for small problems, the tiled `flash_attention` kernel (memory O((n + m) d))
///       for larger ones, the decoding kernel for one query; all agree to float rounding.
template <class DQ, class DK, class DV>
void scaled_dot_product_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                  const Eigen::MatrixBase<DV>& V,
                                  const AttentionOptions<typename DQ::Scalar>& options,
                                  Matrix<typename DQ::Scalar>& out) {
  using T = typename DQ::Scalar;
  detail::check_attention_kv("scaled_dot_product_attention", Q, K, V, options);
  out.resize(Q.rows(), V.cols());
  detail::PathScratch<T> scratch;
  const detail::ScoreRule<T> rule = detail::make_rule(options, Q.rows(), K.rows(), Q.cols());
  detail::with_kv_blocks<T>(K, V, [&](const auto& K_b, const auto& V_b) {
    detail::attend_one<T>(Q, detail::kernel_block<T>(K_b), detail::kernel_block<T>(V_b), rule,
                          scratch, out, nullptr, false);
  });
}

/// Scaled dot-product attention (see the overload writing into caller storage).
/// \param Q        n x d_k queries
/// \param K        m x d_k keys: Q's scalar type, or `Eigen::half` / `Eigen::bfloat16`
/// \param V        m x d_v values, of K's scalar type
/// \param options  causal alignment, query offset, windows, mask (n x m), bias (n x m), scale,
///                 softcap, ALiBi, sink
/// \returns n x d_v
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> scaled_dot_product_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const AttentionOptions<typename DQ::Scalar>& options = {}) {
  Matrix<typename DQ::Scalar> out;
  scaled_dot_product_attention(Q, K, V, options, out);
  return out;
}

/// Attention that also returns its n x m weights (see `scaled_dot_product_attention`).
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param options  as for `scaled_dot_product_attention`
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
  detail::materialised_kernel<T>(Q, K, V, detail::make_rule(options, Q.rows(), K.rows(), Q.cols()),
                                 result.weights, result.output, nullptr);
  return result;
}

/// Every intermediate table of one attention call, in the order the documents compute them:
/// raw scores, scaled, masked, row maxima, exponentials, row sums, weights, output.
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param options  as for `scaled_dot_product_attention`
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
  const detail::ScoreRule<T> rule = detail::make_rule(options, q.rows(), k.rows(), q.cols());
  AttentionTrace<T> trace;
  detail::scores_kernel<T>(q, k, T(1), trace.scores);
  trace.scaled = rule.scale * trace.scores;
  // A score that came out not finite is computed again in the other paths' order, (scale q) . k:
  // the raw sum may have overflowed where the scaled score is finite (entries near 1e19 with a
  // scale of 1e-38), or met two infinities that the scaled sum does not.
  for (Index i = 0; i < q.rows(); ++i) {
    for (Index j = 0; j < k.rows(); ++j) {
      if (!std::isfinite(trace.scaled(i, j))) {
        trace.scaled(i, j) = (rule.scale * q.row(i)).dot(k.row(j));
      }
    }
  }
  rule.apply_softcap(trace.scaled);
  trace.masked = trace.scaled;
  rule.apply_tables(trace.masked, 0, 0);
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
  detail::repair_rows<T>(q, k, v, rule, 0, q.rows(), trace.output, nullptr);
  return trace;
}

/// Options types that extend `AttentionOptions` (`MultiHeadOptions`) are refused at compile time
/// rather than cut down to it (their padding, weight flags and per-head values would be dropped).
template <class DQ, class DK, class DV, class Options, class... Rest,
          detail::if_extended_options<Options, typename DQ::Scalar> = 0>
void scaled_dot_product_attention(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                                  const Eigen::MatrixBase<DV>&, const Options&, Rest&&...) = delete;
/// Likewise for `attention_with_weights`.
template <class DQ, class DK, class DV, class Options,
          detail::if_extended_options<Options, typename DQ::Scalar> = 0>
void attention_with_weights(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                            const Eigen::MatrixBase<DV>&, const Options&) = delete;
/// Likewise for `trace_attention`.
template <class DQ, class DK, class DV, class Options,
          detail::if_extended_options<Options, typename DQ::Scalar> = 0>
void trace_attention(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                     const Eigen::MatrixBase<DV>&, const Options&) = delete;

}  // namespace attn
