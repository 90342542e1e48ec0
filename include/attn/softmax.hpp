#pragma once
/// \file softmax.hpp
/// The numerically stable row softmax.

#include <algorithm>
#include <cmath>
#include <limits>

#include "detail/fast_exp.hpp"
#include "error.hpp"
#include "types.hpp"

namespace attn {
namespace detail {

/// What one row's softmax computed: the subtracted maximum and the denominator.
template <class T>
struct RowStats {
  T max;  ///< max over the row (and the sink); -inf when the row is empty or all -inf
  T sum;  ///< sum of exp(x - max) over the row (plus exp(sink - max)); 0 for an empty row
};

/// `max(a, b)` that returns NaN when either is NaN (`std::max(-inf, NaN)` returns -inf, which
/// would turn a NaN row into an empty one).
template <class T>
T nan_max(T a, T b) {
  return (std::isnan(a) || std::isnan(b)) ? std::numeric_limits<T>::quiet_NaN() : std::max(a, b);
}

/// The maximum of a row of logits for the softmax: -inf for an empty row, NaN when the row has a
/// NaN and nothing else but -inf. Eigen's fast maximum may skip a NaN; that is safe everywhere
/// else, because the NaN still reaches the row's sum and output through `exp` (Eigen's vectorised
/// exp and `std::exp` both return NaN for NaN), but not when the rest is -inf: the row would be
/// taken for one that sees nothing. The NaN-propagating maximum slows the tiled kernel (see
/// docs/benchmarks.md), so it is asked for only then. With `min`, also the row's minimum in the
/// same pass for float rows vectorised (a NaN may be skipped; +inf for an empty row), -inf for
/// other rows.
template <class T>
T tile_max(const Eigen::Ref<const RowVector<T>>& row, T* min = nullptr) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  if (row.size() == 0) {
    if (min) *min = -neg_inf;
    return neg_inf;
  }
  T max;
  if constexpr (FastExp<T>::vectorised) {
    max = packet_max<T>(row.data(), row.size(), min);
  } else {
    max = row.maxCoeff();
    if (min) *min = neg_inf;  // not computed: no row is taken for one that needs no checks
  }
  if (max == neg_inf && row.hasNaN()) return std::numeric_limits<T>::quiet_NaN();
  return max;
}

/// The most negative argument for which exp gives a normal number (exp(-87) = 1.6e-38 > FLT_MIN;
/// exp(-708) = 3.3e-308 > DBL_MIN).
template <class T>
constexpr T exp_normal_floor() {
  return std::numeric_limits<T>::digits > 24 ? T(-708) : T(-87);
}

/// `row -> exp(row - max)` in place for a finite `max`, with exactly what `std::exp` gives where it
/// matters: 0 for -inf (masked) scores and for arguments that underflow. Float rows take the
/// library's vectorised exp (`detail/fast_exp.hpp`, within 1 ulp, exact underflow). Eigen's exp
/// clamps its argument, returning a tiny denormal there instead, so it is used only when every
/// shifted score is above `exp_normal_floor` (one vectorised min tells); other rows take `std::exp`
/// per entry (so does a NaN or +inf `max`: its row stays NaN). Leading and trailing -inf runs (causal
/// and window masks) are zeroed without any exp.
/// \returns the sum of the new row.
template <class T>
T exp_shifted_inplace(Eigen::Ref<RowVector<T>> row, T max) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const Index size = row.size();
  Index begin = 0;
  Index end = size;
  while (begin < end && row(begin) == neg_inf) ++begin;
  while (end > begin && row(end - 1) == neg_inf) --end;
  row.head(begin).setZero();
  row.tail(size - end).setZero();
  if (begin == end) return T(0);
  Eigen::Ref<RowVector<T>> visible = row.segment(begin, end - begin);
  if constexpr (FastExp<T>::vectorised) {
    return exp_shifted_sum(visible.data(), visible.size(), max);
  }
  if (visible.minCoeff() - max >= exp_normal_floor<T>()) {
    visible.array() = (visible.array() - max).exp();
  } else {
    visible = visible.unaryExpr([max](T x) { return std::exp(x - max); });
  }
  return visible.sum();
}

/// The first half of one row's softmax, in place: `row -> exp(row - max)` (see
/// `exp_shifted_inplace`). A row with no finite entry (and no sink) becomes all zero with sum 0.
/// \param row   1 x m scores, replaced by their shifted exponentials
/// \param sink  optional sink logit: takes part in the max and adds exp(sink - max) to the sum
template <class T>
RowStats<T> exp_row_inplace(Eigen::Ref<RowVector<T>> row, std::optional<T> sink = {}) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  T max = tile_max<T>(row);
  if (sink) max = nan_max(max, *sink);
  if (max == neg_inf) {  // nothing to attend
    row.setZero();
    return {max, T(0)};
  }
  T sum = exp_shifted_inplace<T>(row, max);
  if (sink) sum += std::exp(*sink - max);
  return {max, sum};
}

/// `row /= sum`, guarded: zeros when `sum` is 0 (a row that may attend nothing), never 0/0.
/// After `exp_row_inplace` a non-zero sum is >= 1: the entry (or sink) equal to the max gives
/// exp(0). A NaN sum (a NaN score) keeps the row NaN.
template <class T>
void normalise_inplace(Eigen::Ref<RowVector<T>> row, T sum) {
  row *= sum == T(0) ? T(0) : T(1) / sum;
}

/// One row of the softmax, in place.
template <class T>
RowStats<T> softmax_row_inplace(Eigen::Ref<RowVector<T>> row, std::optional<T> sink = {}) {
  const RowStats<T> stats = exp_row_inplace<T>(row, sink);
  normalise_inplace<T>(row, stats.sum);
  return stats;
}

}  // namespace detail

/// Softmax of each row of `S`, in place: `S(i, j) = exp(S(i, j) - max_i) / sum_j exp(...)`.
/// Stable for any finite scores (the row maximum is subtracted first); `-inf` entries get exactly
/// 0; a row that is entirely `-inf` becomes all zeros (never NaN).
/// \param S  n x m scores, replaced by n x m weights
/// \note O(n m) time, no allocation.
template <class T>
void softmax_rows_inplace(Matrix<T>& S) {
  static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
  for (Index i = 0; i < S.rows(); ++i) detail::softmax_row_inplace<T>(S.row(i));
}

/// Softmax of each row of `S` (see `softmax_rows_inplace`).
/// \param S  n x m scores, any Eigen expression
/// \returns n x m weights; each row sums to 1, or is all zero if the row was all `-inf`.
template <class Derived>
Matrix<typename Derived::Scalar> softmax_rows(const Eigen::MatrixBase<Derived>& S) {
  Matrix<typename Derived::Scalar> P = S;
  softmax_rows_inplace(P);
  return P;
}

}  // namespace attn
