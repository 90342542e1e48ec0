#pragma once
/// \file attention.hpp
/// Scaled dot-product attention, `softmax(Q K^T / sqrt(d_k)) V`, with its options (causal
/// alignment, query offset, windows on both sides, boolean mask, additive bias, scale,
/// soft-capping, ALiBi, sink), and the teaching trace of every intermediate table.

#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "detail/paths.hpp"
#include "detail/pipeline.hpp"
#include "error.hpp"
#include "flash.hpp"
#include "scores.hpp"
#include "softmax.hpp"
#include "types.hpp"
#include "variant.hpp"

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

namespace detail {

/// `trace_attention`'s tables, with a variant's score after the scale and its mask beside the
/// options' (none for `NoVariant`), in the tiled kernel's order.
template <class T, class Variant>
AttentionTrace<T> trace_tables(ConstRef<T> q, ConstRef<T> k, ConstRef<T> v,
                               const AttentionOptions<T>& options,
                               const BoundVariant<Variant>& variant) {
  const ScoreRule<T> rule = make_rule(options, q.rows(), k.rows(), q.cols());
  AttentionTrace<T> trace;
  scores_kernel<T>(q, k, T(1), trace.scores);
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
  if constexpr (variant_scores_v<Variant>) {
    for (Index i = 0; i < q.rows(); ++i) {
      for (Index j = 0; j < k.rows(); ++j) {
        trace.scaled(i, j) = variant.variant->score(
            trace.scaled(i, j), variant.at(rule.q_position + i, rule.k_position + j));
      }
    }
  }
  rule.apply_uniform(trace.scaled);
  trace.masked = trace.scaled;
  rule.apply_per_entry(trace.masked, 0, 0);
  if constexpr (variant_masks_v<Variant>) {
    for (Index i = 0; i < q.rows(); ++i) {
      for (Index j = 0; j < k.rows(); ++j) {
        if (!variant_allows(*variant.variant,
                            variant.at(rule.q_position + i, rule.k_position + j))) {
          trace.masked(i, j) = -std::numeric_limits<T>::infinity();
        }
      }
    }
  }
  trace.exp = trace.masked;
  trace.weights.resize(trace.exp.rows(), trace.exp.cols());
  trace.row_max.resize(q.rows());
  trace.row_sum.resize(q.rows());
  for (Index i = 0; i < q.rows(); ++i) {
    const RowStats<T> stats = exp_row_inplace<T>(trace.exp.row(i), options.sink);
    trace.row_max(i) = stats.max;
    trace.row_sum(i) = stats.sum;
    trace.weights.row(i) = trace.exp.row(i);
    normalise_inplace<T>(trace.weights.row(i), stats.sum);
  }
  trace.output.noalias() = trace.weights * v;
  repair_rows<T>(q, k, v, rule, 0, q.rows(), trace.output, nullptr, variant);
  return trace;
}

}  // namespace detail

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
  return detail::trace_tables<T>(Q, K, V, options, detail::BoundVariant<detail::NoVariant>{});
}

/// `trace_attention` with a variant (variant.hpp): `scaled` holds its score modification (after
/// the scale, before the options' softcap), `masked` its mask beside the options' masks, so the
/// tables show its effect. Query i stands at position `i + shift`, key j at position j.
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param variant  a variant (`is_variant_v`), checked by `check_variant`
/// \param options  as for `scaled_dot_product_attention`
/// \returns an `AttentionTrace` (see its fields for shapes).
template <class DQ, class DK, class DV, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
AttentionTrace<typename DQ::Scalar> trace_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Variant& variant, const AttentionOptions<typename DQ::Scalar>& options = {}) {
  using T = typename DQ::Scalar;
  check_variant<Variant, T>();
  detail::check_attention("trace_attention", Q, K, V, options);
  detail::require_variant_positions("trace_attention",
                                    detail::query_position(options, Q.rows(), K.rows()), Q.rows(),
                                    0, K.rows());
  return detail::trace_tables<T>(Q, K, V, options, detail::BoundVariant<Variant>{&variant});
}

/// `attention_with_weights` with a variant: the output and the n x m weights of
/// `trace_attention` with the same variant.
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param variant  a variant (`is_variant_v`), checked by `check_variant`
/// \param options  as for `scaled_dot_product_attention`
/// \returns `{output (n x d_v), weights (n x m)}`
template <class DQ, class DK, class DV, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
Attention<typename DQ::Scalar> attention_with_weights(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Variant& variant, const AttentionOptions<typename DQ::Scalar>& options = {}) {
  AttentionTrace<typename DQ::Scalar> trace = trace_attention(Q, K, V, variant, options);
  return {std::move(trace.output), std::move(trace.weights)};
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
