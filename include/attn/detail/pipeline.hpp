#pragma once
/// \file detail/pipeline.hpp
/// The score pipeline shared by the materialised and the tiled paths: argument checks, scale,
/// softcap, bias, ALiBi and masks, applied to the whole n x m table or to one tile of it.

#include <algorithm>
#include <cmath>
#include <limits>

#include "../error.hpp"
#include "../mask.hpp"
#include "../projection.hpp"
#include "../scores.hpp"
#include "../types.hpp"

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
  if (options.sink &&
      (std::isnan(*options.sink) || *options.sink > std::numeric_limits<T>::max())) {
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
void apply_softcap(const AttentionOptions<T>& options, Eigen::Ref<Matrix<T>> S) {
  if (!options.softcap) return;
  const T c = *options.softcap;
  S = c * (S.array() * (T(1) / c)).tanh();
}

/// Where a tile of scores sits in the full n x m table: rows [i0, i0 + S.rows()), columns
/// [j0, j0 + S.cols()). The materialised path passes the whole table (i0 = j0 = 0).
struct TilePosition {
  Index n;   ///< queries in the full table
  Index m;   ///< keys in the full table
  Index i0;  ///< first query row of the tile
  Index j0;  ///< first key column of the tile
};

/// Pipeline steps 3 and 4 on a tile: `+ bias`, `- slope |i + shift - j|`, then every disallowed
/// key (causal, window, mask) to -inf.
template <class T>
void apply_bias_and_mask(const AttentionOptions<T>& options, const TilePosition& at,
                         Eigen::Ref<Matrix<T>> S) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const Index rows = S.rows();
  const Index cols = S.cols();
  if (options.bias) S += options.bias->block(at.i0, at.j0, rows, cols);
  const Index shift = causal_shift(options.causal, at.n, at.m);
  for (Index r = 0; r < rows; ++r) {
    const Index i = at.i0 + r;
    Eigen::Ref<RowVector<T>> row = S.row(r);
    if (options.alibi_slope) {
      const T slope = *options.alibi_slope;
      const T position = static_cast<T>(i + shift);
      const T first_key = static_cast<T>(at.j0);
      row.array() -=
          slope *
          (RowVector<T>::LinSpaced(cols, first_key, first_key + static_cast<T>(cols - 1)).array() -
           position)
              .abs();
    }
    const KeyRange keys = key_range(i, at.n, at.m, options.causal, options.window);
    const Index begin = std::clamp<Index>(keys.begin - at.j0, 0, cols);
    const Index end = std::clamp<Index>(keys.end - at.j0, begin, cols);
    row.head(begin).setConstant(neg_inf);
    row.tail(cols - end).setConstant(neg_inf);
  }
  if (options.mask) S = options.mask->block(at.i0, at.j0, rows, cols).select(S, neg_inf);
}

}  // namespace detail
}  // namespace attn
