#pragma once
/// \file detail/score_rule.hpp
/// The one score rule of `attn`: which keys each query sees and what is done to a score before the
/// softmax. Every path (the materialised table, the tiled kernel, the decoding kernel, the cache,
/// the heads and the layer) builds a `ScoreRule` from the call's options and applies it; no other
/// code decides which keys a query sees.
///
/// Positions: query `i` stands at key position `q_position + i`, key column `j` at position
/// `k_position + j`. For a plain call `k_position` is 0 and `q_position` is the query offset of the
/// Conventions (`query_offset`, else `m - n` for `BottomRight`, else 0); a block of the keys (the
/// pinned rows of a cache, one rank's keys of a ring) is the same rule with its own `k_position`
/// and its own columns of the tables (`columns`).

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "../error.hpp"
#include "../scores.hpp"
#include "../types.hpp"
#include "checked.hpp"

namespace attn {
namespace detail {

/// The half-open range [begin, end) of key columns a query may attend.
struct KeyRange {
  Index begin;
  Index end;
};

/// The query offset of the Conventions: `query_offset` when set, else `m - n` for bottom-right
/// alignment, else 0.
template <class T>
Index query_position(const AttentionOptions<T>& options, Index n, Index m) {
  if (options.query_offset) return *options.query_offset;
  return options.causal == Causal::BottomRight ? m - n : 0;
}

/// A read-only view of a row-major table (mask or bias) from some column on: entry (i, j) of the
/// view is `data[i * stride + j]`. Empty (`data == nullptr`) when the call has no such table.
template <class S>
struct TableView {
  const S* data = nullptr;
  Index stride = 0;
  explicit operator bool() const { return data != nullptr; }
  const S* row(Index i) const { return data + i * stride; }
};

/// The resolved score rule of one call (or of one block of its keys). Cheap to copy: the tables
/// are views of the caller's storage, which must outlive the rule.
template <class T>
struct ScoreRule {
  Index n = 0;  ///< queries
  Index m = 0;  ///< key columns
  T scale = T(1);
  std::optional<T> softcap;
  std::optional<T> alibi_slope;
  std::optional<T> sink;
  Index q_position = 0;               ///< position of query 0
  Index k_position = 0;               ///< position of key column 0
  bool causal = false;                ///< keys after the query's position are forbidden
  std::optional<Index> window_left;   ///< keys before position p - w are forbidden
  std::optional<Index> window_right;  ///< keys after position p + r are forbidden
  bool left_unbounded = false;      ///< the window does not apply to this block (pinned cache rows)
  TableView<bool> mask;             ///< n x m, true = may attend
  TableView<bool> key_valid;        ///< 1 x m (stride 0), false = padding, for every query
  TableView<T> bias;                ///< n x m, added after the softcap; -inf entries mask
  Index column0 = 0;                ///< first column of this block in the call's n x m tables
  Index table_cols = 0;             ///< columns of the call's tables (m of the whole call)
  bool reduced_arithmetic = false;  ///< StoredArithmetic::Reduced: bfloat16 / int8 instructions

  /// Whether anything but the key range restricts or changes the scores of a row (a mask, key
  /// padding, a bias or ALiBi): then the scores must go through `apply`, not only the range.
  bool has_tables() const { return mask || key_valid || bias || alibi_slope.has_value(); }

  /// The key columns query `i` may see by position (causal, both windows); the mask tables may
  /// forbid more of them.
  KeyRange keys(Index i) const {
    // Exact in a wider type: any query offset or window, however large, has its meaning.
    const WideIndex p = wide(q_position) + wide(i) - wide(k_position);  // in column units
    WideIndex end = wide(m);
    if (causal) end = std::min(end, p + wide(1));
    if (window_right) end = std::min(end, p + wide(*window_right) + wide(1));
    const Index e = narrow_clamped(end, 0, m);
    Index begin = 0;
    if (window_left && !left_unbounded) begin = narrow_clamped(p - wide(*window_left), 0, e);
    return {begin, e};
  }

  /// p_i - (k_position + j), the query-to-key distance ALiBi uses, clamped to half the Index
  /// range (a distance that large gives a penalty no float can tell from its neighbours).
  Index distance(Index i, Index j) const {
    return narrow_clamped(wide(q_position) + wide(i) - wide(k_position) - wide(j), index_min / 2,
                          index_max / 2);
  }

  /// The union of the ranges of queries [i0, i0 + rows): begins and ends are non-decreasing in i.
  KeyRange keys(Index i0, Index rows) const {
    const KeyRange first = keys(i0);
    const KeyRange last = keys(i0 + rows - 1);
    return {first.begin, std::max(first.end, last.end)};
  }

  /// The rule of the key columns [j0, j0 + cols) alone, as a block of its own.
  ScoreRule columns(Index j0, Index cols) const {
    ScoreRule block = *this;
    block.m = cols;
    block.k_position = k_position + j0;
    block.column0 = column0 + j0;
    if (mask) block.mask.data = mask.data + j0;
    if (key_valid) block.key_valid.data = key_valid.data + j0;
    if (bias) block.bias.data = bias.data + j0;
    return block;
  }

  /// Whether no query of [i0, i0 + rows) may attend any key of [j0, j0 + cols) by the masks.
  bool masked_out(Index i0, Index rows, Index j0, Index cols) const {
    if (key_valid &&
        std::none_of(key_valid.data + j0, key_valid.data + j0 + cols, [](bool b) { return b; })) {
      return true;
    }
    if (!mask) return false;
    for (Index r = 0; r < rows; ++r) {
      const bool* row = mask.row(i0 + r) + j0;
      if (std::any_of(row, row + cols, [](bool b) { return b; })) return false;
    }
    return true;
  }

  /// Pipeline step 2 alone: `s -> c tanh(s / c)` when a softcap is set.
  void apply_softcap(Eigen::Ref<Matrix<T>> S) const {
    if (!softcap) return;
    const T c = *softcap;
    S = c * (S.array() * (T(1) / c)).tanh();
  }

  /// Pipeline steps 2 to 4 on a tile of scaled scores `S` (rows [i0, i0 + S.rows()), key columns
  /// [j0, j0 + S.cols())): softcap `c tanh(s / c)`, `+ bias` (a -inf bias masks the key, whatever
  /// the score), ALiBi `- slope |p_i - p_j|`, then every key the query may not see to -inf. NaN
  /// scores of visible keys stay NaN; those of forbidden keys become -inf.
  void apply(Eigen::Ref<Matrix<T>> S, Index i0, Index j0) const {
    apply_softcap(S);
    apply_tables(S, i0, j0);
  }

  /// Pipeline steps 3 and 4 alone (`apply` without the softcap).
  void apply_tables(Eigen::Ref<Matrix<T>> S, Index i0, Index j0) const {
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    const Index rows = S.rows();
    const Index cols = S.cols();
    for (Index r = 0; r < rows; ++r) {
      const Index i = i0 + r;
      T* s = S.data() + r * S.outerStride();
      if (bias) {
        const T* b = bias.row(i) + j0;
        for (Index c = 0; c < cols; ++c) s[c] = b[c] == neg_inf ? neg_inf : s[c] + b[c];
      }
      if (alibi_slope) {
        const T slope = *alibi_slope;
        const Index delta = distance(i, j0);
        for (Index c = 0; c < cols; ++c) s[c] -= slope * static_cast<T>(std::abs(delta - c));
      }
      const KeyRange visible = keys(i);
      const Index begin = std::clamp<Index>(visible.begin - j0, 0, cols);
      const Index end = std::clamp<Index>(visible.end - j0, begin, cols);
      std::fill(s, s + begin, neg_inf);
      std::fill(s + end, s + cols, neg_inf);
      if (mask) {
        const bool* allowed = mask.row(i) + j0;
        for (Index c = begin; c < end; ++c) {
          if (!allowed[c]) s[c] = neg_inf;
        }
      }
      if (key_valid) {
        const bool* valid = key_valid.data + j0;
        for (Index c = begin; c < end; ++c) {
          if (!valid[c]) s[c] = neg_inf;
        }
      }
    }
  }

  /// The final logit of one entry (steps 2 to 4 on a single scaled score): -inf when forbidden.
  T logit(T scaled, Index i, Index j) const {
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    const KeyRange visible = keys(i);
    if (j < visible.begin || j >= visible.end) return neg_inf;
    if (mask && !mask.row(i)[j]) return neg_inf;
    if (key_valid && !key_valid.data[j]) return neg_inf;
    T s = softcap ? *softcap * std::tanh(scaled / *softcap) : scaled;
    if (bias) {
      if (bias.row(i)[j] == neg_inf) return neg_inf;
      s += bias.row(i)[j];
    }
    if (alibi_slope) {
      s -= *alibi_slope * static_cast<T>(std::abs(distance(i, j)));
    }
    return s;
  }
};

template <class T>
T scale_of(const AttentionOptions<T>& options, Index d_k) {
  return options.scale ? *options.scale : default_scale<T>(d_k);
}

/// The rule of a call with n queries of width d_k over m keys (the options already checked).
template <class T>
ScoreRule<T> make_rule(const AttentionOptions<T>& options, Index n, Index m, Index d_k) {
  ScoreRule<T> rule;
  rule.n = n;
  rule.m = m;
  rule.scale = scale_of(options, d_k);
  rule.softcap = options.softcap;
  rule.alibi_slope = options.alibi_slope;
  rule.sink = options.sink;
  rule.q_position = query_position(options, n, m);
  rule.causal = options.causal != Causal::None;
  rule.window_left = options.window;
  rule.window_right = options.window_right;
  rule.table_cols = m;
  rule.reduced_arithmetic = options.stored_arithmetic == StoredArithmetic::Reduced;
  if (options.mask) rule.mask = {options.mask->data(), options.mask->cols()};
  if (options.bias) rule.bias = {options.bias->data(), options.bias->cols()};
  return rule;
}

inline void require_window(const char* function, Index window, const char* name = "window") {
  if (window < 0) fail(function, name, " must be >= 0, got ", window);
}

template <class T>
void require_sink(const char* function, const char* name, T sink) {
  if (std::isnan(sink) || sink > std::numeric_limits<T>::max()) {
    fail(function, name, " must be a number below +inf, got ", sink);
  }
}

/// Checks the options of an attention call with n queries and m keys.
template <class T>
void check_options(const char* function, const AttentionOptions<T>& options, Index n, Index m) {
  if (options.mask) require_table(function, "mask", *options.mask, n, m);
  if (options.bias) require_table(function, "bias", *options.bias, n, m);
  if (options.window) require_window(function, *options.window);
  if (options.window_right) require_window(function, *options.window_right, "window_right");
  if (options.scale) require_finite_scale(function, *options.scale);
  if (options.softcap && !(std::isfinite(*options.softcap) && *options.softcap > T(0))) {
    fail(function, "softcap must be finite and > 0, got ", *options.softcap);
  }
  if (options.alibi_slope && !std::isfinite(*options.alibi_slope)) {
    fail(function, "alibi_slope must be finite, got ", *options.alibi_slope);
  }
  if (options.sink) require_sink(function, "sink", *options.sink);
}

}  // namespace detail
}  // namespace attn
