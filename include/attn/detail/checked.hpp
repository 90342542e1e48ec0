#pragma once
/// \file detail/checked.hpp
/// The one place where user sizes and positions are added and multiplied. Two kinds of numbers
/// meet here, and they overflow differently:
/// - a size (rows, bytes, element counts) must be exact: an overflow is an error
///   (`checked_add`, `checked_mul`, which throw `shape_error` naming the function and the values);
/// - a position or a window bound only ever decides which keys a query sees, and a bound beyond
///   the Index range means "no bound" by the Conventions: it saturates (`saturating_add`), and a
///   query's key range is computed exactly in a wider type (`position_range`).

#include <limits>

#include "../error.hpp"
#include "../types.hpp"

namespace attn {
namespace detail {

inline constexpr Index index_max = std::numeric_limits<Index>::max();
inline constexpr Index index_min = std::numeric_limits<Index>::min();

/// a + b, clamped to the Index range.
constexpr Index saturating_add(Index a, Index b) {
  if (b > 0 && a > index_max - b) return index_max;
  if (b < 0 && a < index_min - b) return index_min;
  return a + b;
}

/// a - b, clamped to the Index range.
constexpr Index saturating_sub(Index a, Index b) {
  if (b < 0 && a > index_max + b) return index_max;
  if (b > 0 && a < index_min + b) return index_min;
  return a - b;
}

/// a + b for sizes: throws `shape_error` from `function` when it does not fit in Index.
template <class... Context>
Index checked_add(const char* function, Index a, Index b, const Context&... what) {
  if ((b > 0 && a > index_max - b) || (b < 0 && a < index_min - b)) {
    fail(function, what..., (sizeof...(what) ? " " : ""), "(", a, " + ", b,
         ") does not fit in a 64-bit index");
  }
  return a + b;
}

/// a * b for non-negative sizes: throws `shape_error` from `function` when it does not fit.
template <class... Context>
Index checked_mul(const char* function, Index a, Index b, const Context&... what) {
  ATTN_ASSERT(a >= 0 && b >= 0);
  if (a != 0 && b > index_max / a) {
    fail(function, what..., (sizeof...(what) ? " " : ""), "(", a, " x ", b,
         ") does not fit in a 64-bit index");
  }
  return a * b;
}

/// The product of non-negative extents, or throws naming `what` (e.g. "Q's element count").
template <class Extents, class... Context>
Index checked_product(const char* function, const Extents& extents, const Context&... what) {
  Index product = 1;
  for (const auto extent : extents) {
    product = checked_mul(function, product, static_cast<Index>(extent), what...);
  }
  return product;
}

/// The wide integer positions are compared in: exact for sums of a few Index values where the
/// compiler has a 128-bit type (GCC, Clang), else saturating Index arithmetic.
#if defined(__SIZEOF_INT128__)
__extension__ typedef __int128 WideIndex;
constexpr WideIndex wide(Index a) { return a; }
constexpr Index narrow_clamped(WideIndex a, Index lo, Index hi) {
  return a < lo ? lo : a > hi ? hi : static_cast<Index>(a);
}
#else
struct WideIndex {
  Index v;
};
constexpr WideIndex wide(Index a) { return {a}; }
constexpr WideIndex operator+(WideIndex a, WideIndex b) { return {saturating_add(a.v, b.v)}; }
constexpr WideIndex operator-(WideIndex a, WideIndex b) { return {saturating_sub(a.v, b.v)}; }
constexpr bool operator<(WideIndex a, WideIndex b) { return a.v < b.v; }
constexpr Index narrow_clamped(WideIndex a, Index lo, Index hi) {
  return a.v < lo ? lo : a.v > hi ? hi : a.v;
}
#endif

}  // namespace detail
}  // namespace attn
