#pragma once
/// \file mask.hpp
/// Causal and sliding-window masks, and applying a mask to a score table.

#include <algorithm>
#include <limits>

#include "error.hpp"
#include "types.hpp"

namespace attn {
namespace detail {

/// The offset between query and key positions: `m - n` for bottom-right alignment, else 0.
inline Index causal_shift(Causal align, Index n, Index m) {
  return align == Causal::BottomRight ? m - n : 0;
}

/// The half-open range [begin, end) of keys that query `i` may attend under a causal alignment and
/// an optional window. Every mask in `attn` (the Mask tables, the materialised path, the tiled
/// path) derives from this one function.
struct KeyRange {
  Index begin;
  Index end;
};

inline KeyRange key_range(Index i, Index n, Index m, Causal align, std::optional<Index> window) {
  const Index shift = causal_shift(align, n, m);
  Index end = m;
  if (align != Causal::None) end = std::clamp<Index>(i + shift + 1, 0, m);
  Index begin = 0;
  if (window) begin = std::clamp<Index>(i + shift - *window, 0, m);
  return {begin, std::max(begin, end)};
}

inline void require_sizes(const char* function, Index n, Index m) {
  if (n < 0 || m < 0) fail(function, "sizes must be non-negative, got n = ", n, ", m = ", m);
}

inline void require_window(const char* function, Index window) {
  if (window < 0) fail(function, "window must be >= 0, got ", window);
}

/// The n x m mask of a causal alignment and an optional window.
inline Mask range_mask(Index n, Index m, Causal align, std::optional<Index> window) {
  Mask allowed = Mask::Constant(n, m, false);
  for (Index i = 0; i < n; ++i) {
    const KeyRange keys = key_range(i, n, m, align, window);
    allowed.row(i).segment(keys.begin, keys.end - keys.begin).setConstant(true);
  }
  return allowed;
}

}  // namespace detail

/// The causal mask of `n` queries over `m` keys.
/// \param n      number of queries (rows), >= 0
/// \param m      number of keys (columns), >= 0
/// \param align  `BottomRight` (default): query `i` sees keys `j <= i + m - n`;
///               `TopLeft`: keys `j <= i`; `None`: every key.
/// \returns an n x m mask, `true` = may attend.
/// \throws shape_error if `n` or `m` is negative.
inline Mask causal_mask(Index n, Index m, Causal align = Causal::BottomRight) {
  detail::require_sizes("causal_mask", n, m);
  return detail::range_mask(n, m, align, std::nullopt);
}

/// The sliding-window mask: the mask that `AttentionOptions{causal = align, window = window}`
/// applies. Query `i` sees keys `i + shift - window ... i + shift` (itself and `window` keys before
/// it), where `shift` is `m - n` for `BottomRight` and 0 otherwise. With `align == Causal::None`
/// only the lower bound applies (no causal upper bound). \param n, m    queries and keys, >= 0
/// \param window  how many keys before the query's own position stay visible, >= 0
/// \returns an n x m mask, `true` = may attend.
/// \throws shape_error if a size or the window is negative.
inline Mask sliding_window_mask(Index n, Index m, Index window,
                                Causal align = Causal::BottomRight) {
  detail::require_sizes("sliding_window_mask", n, m);
  detail::require_window("sliding_window_mask", window);
  return detail::range_mask(n, m, align, window);
}

/// Sets every disallowed entry of `S` to `-inf`, so that the softmax gives it exactly zero weight.
/// \param S        n x m scores, modified in place
/// \param allowed  n x m mask, `true` = keep
/// \throws shape_error if the shapes differ.
template <class T>
void apply_mask(Matrix<T>& S, const Mask& allowed) {
  static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
  detail::require_table("apply_mask", "mask", allowed, S.rows(), S.cols());
  S = allowed.select(S, -std::numeric_limits<T>::infinity());
}

}  // namespace attn
