#pragma once
/// \file detail/online_softmax.hpp
/// The online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax";
/// Rabe & Staats 2021; FlashAttention, Dao et al. 2022) and the merge of two partial results by
/// their log-sum-exp: written once here, used by the tiled kernel, the decoding kernel, the cache
/// and everything that splits the keys into blocks.
///
/// State of one query row after some keys: the running max `m`, the running sum
/// `l = sum_j exp(s_j - m)` and the running, unnormalised output `o = sum_j exp(s_j - m) v_j`.
/// A new tile with row max m~ gives m' = max(m, m~), alpha = exp(m - m'), l' = alpha l +
/// sum_j exp(s_j - m'), o' = alpha o + sum_j exp(s_j - m') v_j: both are rescaled by the same
/// alpha <= 1, so o / l does not change with a new max. m starts at -inf (exp(-inf) = 0 on the
/// first visible tile), or at the sink logit with l = exp(sink - sink) = 1 (the sink takes weight
/// but gives no value). NaN propagates through every step (the maxima are NaN-propagating), so a
/// NaN in anything a row uses leaves that row NaN.

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "../softmax.hpp"
#include "../types.hpp"

namespace attn {
namespace detail {

/// One row's step over a tile of its logits: `s` becomes p_j = exp(s_j - m') in place, m and l
/// are updated. A row with nothing visible yet (m' = -inf) becomes zeros and returns 1, m and l
/// unchanged.
/// \returns alpha = exp(m - m'), by which the caller rescales the row's running output.
template <class T>
T online_softmax_step(Eigen::Ref<RowVector<T>> s, T& m, T& l) {
  T min = T(0);
  const T m_new = nan_max(m, tile_max<T>(s, FastExp<T>::vectorised ? &min : nullptr));
  if (m_new == -std::numeric_limits<T>::infinity()) {
    s.setZero();
    return T(1);
  }
  const T alpha = std::exp(m - m_new);
  // Float rows in one vectorised pass (a masked entry's exp is exactly 0), without the checks
  // below the normal range when the row's smallest entry needs none (s_j - m' >= min - m', as
  // rounding is monotonic); others skip their leading and trailing -inf runs first, then take
  // Eigen's exp.
  if constexpr (FastExp<T>::vectorised) {
    const bool normal = min - m_new >= ExpConstants::normal_floor;
    l = alpha * l + exp_shifted_sum<T>(s.data(), s.size(), m_new, normal);
  } else {
    l = alpha * l + exp_shifted_inplace<T>(s, m_new);
  }
  m = m_new;
  return alpha;
}

/// The online-softmax state of a block of query rows: start, step (by the caller's tiles, with
/// `online_softmax_step` and the rescale of `o`), finish.
template <class T>
struct OnlineSoftmax {
  Matrix<T> o;  ///< rows x d_v running, unnormalised output
  Vector<T> m;  ///< running maxima
  Vector<T> l;  ///< running sums

  /// Start: nothing seen yet; the sink (when set) is the first "key", with weight and no value.
  void start(Index rows, Index d_v, std::optional<T> sink) {
    o.setZero(rows, d_v);
    m.setConstant(rows, sink ? *sink : -std::numeric_limits<T>::infinity());
    l.setConstant(rows, sink ? T(1) : T(0));
  }

  /// The rows' step over a tile of logits P (rows x cols, replaced by the unnormalised
  /// probabilities) and its value rows V_tile (cols x d_v): o' = alpha o + P V_tile.
  template <class Values>
  void step(Eigen::Ref<Matrix<T>> P, const Values& V_tile) {
    for (Index r = 0; r < P.rows(); ++r) {
      const T alpha = online_softmax_step<T>(P.row(r), m(r), l(r));
      if (alpha != T(1)) o.row(r) *= alpha;
    }
    o.noalias() += P * V_tile;
  }

  /// Finish: out = o / l, guarded (a row that saw no key, l = 0, is zero; a NaN stays NaN), and
  /// lse_i = m_i + log(l_i) (-inf for a row that saw nothing).
  void finish(Eigen::Ref<Matrix<T>> out, T* lse) const {
    for (Index r = 0; r < o.rows(); ++r) {
      const T sum = l(r);
      out.row(r) = o.row(r) * (sum == T(0) ? T(0) : T(1) / sum);
      if (lse) lse[r] = sum == T(0) ? -std::numeric_limits<T>::infinity() : m(r) + std::log(sum);
    }
  }
};

/// Merges a partial result (o_b, lse_b) of a row over some keys into (o_a, lse_a) over others, so
/// that (o_a, lse_a) becomes the result over both: with M = max(lse_a, lse_b),
/// o = (e^(lse_a - M) o_a + e^(lse_b - M) o_b) / (e^(lse_a - M) + e^(lse_b - M)),
/// lse = M + log(e^(lse_a - M) + e^(lse_b - M)). A part with lse = -inf (no key) has no weight;
/// two empty parts stay empty (zero output, -inf); a NaN in either part makes the row NaN. Neither
/// part may include the sink: it is added once, by `merge_sink`.
template <class T>
void merge_partial(Eigen::Ref<RowVector<T>> o_a, T& lse_a,
                   const Eigen::Ref<const RowVector<T>>& o_b, T lse_b) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  if (lse_b == neg_inf) return;
  if (lse_a == neg_inf) {
    o_a = o_b;
    lse_a = lse_b;
    return;
  }
  const T M = nan_max(lse_a, lse_b);
  const T w_a = std::exp(lse_a - M);
  const T w_b = std::exp(lse_b - M);
  const T sum = w_a + w_b;
  o_a = (w_a * o_a + w_b * o_b) / sum;
  lse_a = M + std::log(sum);
}

/// Adds a sink logit to a merged row: o *= e^lse / (e^lse + e^sink), lse = log(e^lse + e^sink).
/// A row with no key (lse = -inf) stays zero.
template <class T>
void merge_sink(Eigen::Ref<RowVector<T>> o, T& lse, std::optional<T> sink) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  if (!sink || lse == neg_inf) return;
  const T M = nan_max(lse, *sink);
  const T w = std::exp(lse - M);
  const T sum = w + std::exp(*sink - M);
  o *= w / sum;
  lse = M + std::log(sum);
}

}  // namespace detail
}  // namespace attn
