#pragma once
/// \file detail/exact_rows.hpp
/// The naive twin of every attention kernel, row by row: each visible key's logit by the score
/// rule, the row's max, sum and weighted values, skipping every key the row may not attend. The
/// fast kernels call it for the rows whose result is not finite: there a forbidden key's NaN or
/// infinite value may have reached the row through `0 * NaN` in a product (a forbidden key gets
/// weight 0, and the kernels multiply whole tiles). The rule of the Conventions is that such a key
/// never reaches the row; a NaN that the row really uses stays NaN here too.

#include <cmath>
#include <limits>

#include "../softmax.hpp"
#include "../types.hpp"
#include "../variant.hpp"
#include "score_rule.hpp"

namespace attn {
namespace detail {

/// The logit of query i and key column j by the rule and the variant: the variant's score of the
/// scaled score, then the rule's steps, then the variant's mask (the tiled kernel's order).
template <class T, class Variant>
T variant_logit(const ScoreRule<T>& rule, const BoundVariant<Variant>& variant, T scaled, Index i,
                Index j) {
  if constexpr (is_variant_v<Variant>) {
    const ScoreAt at = variant.at(rule.q_position + i, rule.k_position + j);
    const T logit = rule.logit(variant_score(*variant.variant, scaled, at), i, j);
    if (!variant_allows(*variant.variant, at)) return -std::numeric_limits<T>::infinity();
    return logit;
  } else {
    return rule.logit(scaled, i, j);
  }
}

/// Row i of attention by `rule` (and the variant), computed key by key. Shape contract: Q n x d_k
/// (unscaled), K m x d_k, V m x d_v, out 1 x d_v; lse (optional) receives m_i + log(l_i) (sink
/// included when set).
template <class T, class Variant = NoVariant>
void exact_row(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, const ScoreRule<T>& rule, Index i,
               Eigen::Ref<RowVector<T>> out, T* lse, const BoundVariant<Variant>& variant = {}) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const KeyRange keys = rule.keys(i);
  // (scale q) . k, the materialised path's order: the sum cannot overflow where the scaled score
  // is representable.
  const RowVector<T> q = rule.scale * Q.row(i);
  T max = rule.sink ? *rule.sink : neg_inf;
  for (Index j = keys.begin; j < keys.end; ++j) {
    max = nan_max(max, variant_logit(rule, variant, q.dot(K.row(j)), i, j));
  }
  out.setZero();
  if (max == neg_inf) {
    if (lse) *lse = neg_inf;
    return;
  }
  T sum = rule.sink ? std::exp(*rule.sink - max) : T(0);
  for (Index j = keys.begin; j < keys.end; ++j) {
    const T s = variant_logit(rule, variant, q.dot(K.row(j)), i, j);
    if (s == neg_inf) continue;  // forbidden: never multiplied, whatever V_j holds
    const T p = std::exp(s - max);
    sum += p;
    out += p * V.row(j);
  }
  out /= sum;
  if (lse) *lse = max + std::log(sum);
}

/// Recomputes with `exact_row` the rows [i0, i0 + rows) of O whose values are not all finite.
/// The test is one vectorised sum of the block (any NaN or infinity makes it non-finite; a finite
/// block whose sum overflows only costs a needless, exact recomputation), then one sum per row.
template <class T, class Variant = NoVariant>
void repair_rows(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, const ScoreRule<T>& rule, Index i0,
                 Index rows, Eigen::Ref<Matrix<T>> O, T* lse,
                 const BoundVariant<Variant>& variant = {}) {
  if (std::isfinite(O.middleRows(i0, rows).sum())) return;
  for (Index i = i0; i < i0 + rows; ++i) {
    if (!std::isfinite(O.row(i).sum())) {
      exact_row<T>(Q, K, V, rule, i, O.row(i), lse ? lse + i : nullptr, variant);
    }
  }
}

}  // namespace detail
}  // namespace attn
