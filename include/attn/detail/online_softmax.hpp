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

/// `online_softmax_step` of rows [0, rows) of a tile (row r at `s + r * stride`, `cols` logits;
/// its m, l and alpha at m[r], l[r], alpha[r]): the same values, bit for bit. Float rows of whole
/// pairs of packets go four at a time, their maxima and exponentials interleaved: one row's step
/// is a chain of dependent instructions (maximum, reduction, exp's polynomial, sum) that leaves
/// the processor idle, and four independent chains fill it (see docs/benchmarks.md). The tiled
/// kernel keeps one step per row: its blocks gained nothing from this (rows crossing a causal
/// diagonal need the checks). Rows that need the checks below the normal range, or see nothing,
/// take `online_softmax_step`'s own path.
template <class T>
void online_softmax_rows(T* s, Index stride, Index rows, Index cols, T* m, T* l, T* alpha) {
  Index r0 = 0;
  if constexpr (FastExp<T>::vectorised) {
    using Packet = typename FastExp<T>::Packet;
    using namespace Eigen::internal;
    constexpr Index lanes = FastExp<T>::lanes;
    constexpr Index G = 4;
    constexpr T inf = std::numeric_limits<T>::infinity();
    if (cols > 0 && cols % (2 * lanes) == 0) {
      for (; r0 + G <= rows; r0 += G) {
        // 1. Each row's maximum and minimum (as `packet_max`).
        Packet max0[G], max1[G], min0[G], min1[G];
        for (Index g = 0; g < G; ++g) {
          max0[g] = max1[g] = pset1<Packet>(-inf);
          min0[g] = min1[g] = pset1<Packet>(inf);
        }
        for (Index j = 0; j < cols; j += 2 * lanes) {
          for (Index g = 0; g < G; ++g) {
            const T* row = s + (r0 + g) * stride + j;
            const Packet a = ploadu<Packet>(row);
            const Packet b = ploadu<Packet>(row + lanes);
            max0[g] = pmax(max0[g], a);
            max1[g] = pmax(max1[g], b);
            min0[g] = pmin(min0[g], a);
            min1[g] = pmin(min1[g], b);
          }
        }
        // 2. Each row's new maximum. Rows that need the checks, and rows with nothing above -inf
        //    (all masked, or NaN among -inf: `tile_max`'s NaN rule), are done here, alone, by
        //    `online_softmax_step`.
        bool fast[G];
        T m_new[G];
        for (Index g = 0; g < G; ++g) {
          const Index r = r0 + g;
          const T max = predux_max(pmax(max0[g], max1[g]));
          const T min = predux_min(pmin(min0[g], min1[g]));
          m_new[g] = nan_max(m[r], max);
          fast[g] = max != -inf && min - m_new[g] >= ExpConstants::normal_floor;
          if (!fast[g]) {
            alpha[r] =
                online_softmax_step<T>(Eigen::Map<RowVector<T>>(s + r * stride, cols), m[r], l[r]);
          }
        }
        // 3. The exponentials and sums of the other rows, interleaved (as `exp_shifted_sum`).
        Packet sum0[G], sum1[G];
        for (Index g = 0; g < G; ++g) sum0[g] = sum1[g] = pset1<Packet>(T(0));
        for (Index j = 0; j < cols; j += 2 * lanes) {
          for (Index g = 0; g < G; ++g) {
            if (!fast[g]) continue;
            T* row = s + (r0 + g) * stride + j;
            const Packet shift = pset1<Packet>(m_new[g]);
            const Packet e0 = exp_normal_range(psub(ploadu<Packet>(row), shift));
            const Packet e1 = exp_normal_range(psub(ploadu<Packet>(row + lanes), shift));
            pstoreu(row, e0);
            pstoreu(row + lanes, e1);
            sum0[g] = padd(sum0[g], e0);
            sum1[g] = padd(sum1[g], e1);
          }
        }
        for (Index g = 0; g < G; ++g) {
          if (!fast[g]) continue;
          const Index r = r0 + g;
          alpha[r] = std::exp(m[r] - m_new[g]);
          l[r] = alpha[r] * l[r] + predux(padd(sum0[g], sum1[g]));
          m[r] = m_new[g];
        }
      }
    }
  }
  for (; r0 < rows; ++r0) {
    alpha[r0] =
        online_softmax_step<T>(Eigen::Map<RowVector<T>>(s + r0 * stride, cols), m[r0], l[r0]);
  }
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

/// The merge protocol of attention over blocks of keys, used by every path that splits them (the
/// decoding kernel's parts, a cache's pinned and recent rows, the layer's appended keys, a ring's
/// pieces): each block is attended without the sink, giving rows (o, lse); the blocks are merged
/// into the first, one after another in a fixed order (`merge_block`), and the sink is added once
/// at the end (`finish_merge`). The order fixes the bits, whatever the threads or ranks did.
///
/// Merges the rows of one block's result (o_part, lse_part) into (o, lse), row by row.
template <class T>
void merge_block(Eigen::Ref<Matrix<T>> o, T* lse, ConstRef<T> o_part, const T* lse_part) {
  for (Index r = 0; r < o.rows(); ++r)
    merge_partial<T>(o.row(r), lse[r], o_part.row(r), lse_part[r]);
}

/// The end of the merge protocol (`merge_block`): the sink, when set, added to every row once.
template <class T>
void finish_merge(Eigen::Ref<Matrix<T>> o, T* lse, std::optional<T> sink) {
  if (!sink) return;
  for (Index r = 0; r < o.rows(); ++r) merge_sink<T>(o.row(r), lse[r], sink);
}

}  // namespace detail
}  // namespace attn
