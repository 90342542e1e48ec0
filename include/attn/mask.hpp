#pragma once
/// \file mask.hpp
/// Causal and sliding-window masks, and applying a mask to a score table.

#include <algorithm>
#include <limits>

#include "detail/score_rule.hpp"
#include "error.hpp"
#include "types.hpp"

namespace attn {
namespace detail {

inline void require_sizes(const char* function, Index n, Index m) {
  if (n < 0 || m < 0) fail(function, "sizes must be non-negative, got n = ", n, ", m = ", m);
}

/// The n x m mask of a causal alignment and an optional window: the key ranges of the score rule
/// (detail/score_rule.hpp), written out as a table.
inline Mask range_mask(Index n, Index m, Causal align, std::optional<Index> window) {
  AttentionOptions<float> options;
  options.causal = align;
  options.window = window;
  const ScoreRule<float> rule = make_rule(options, n, m, 1);
  Mask allowed = Mask::Constant(n, m, false);
  for (Index i = 0; i < n; ++i) {
    const KeyRange keys = rule.keys(i);
    bool* row = allowed.data() + i * m;  // row-major; std::fill avoids a GCC 12 false
    std::fill(row + keys.begin, row + keys.end, true);  // -Wstringop-overflow on bool packets
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
/// only the lower bound applies (no causal upper bound).
/// \param n, m    queries and keys, >= 0
/// \param window  how many keys before the query's own position stay visible, >= 0
/// \param align   `BottomRight` (default), `TopLeft` or `None`: where the window ends (above)
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
