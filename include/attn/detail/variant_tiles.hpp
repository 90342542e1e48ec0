#pragma once
/// \file detail/variant_tiles.hpp
/// A variant (variant.hpp) on a tile of scores, as the kernels apply it: its score modification
/// of every entry, the key columns its ranges leave to a block of rows, its mask on a tile.

#include <algorithm>
#include <limits>

#include "../types.hpp"
#include "../variant.hpp"
#include "score_rule.hpp"

namespace attn {
namespace detail {

/// The variant's score modification on a tile of scaled scores (rows [i0, i0 + rows), key columns
/// [j0, j0 + cols)), before the rule's steps: every entry, as the rule's softcap takes every entry.
template <class T, class Variant>
void variant_scores(const BoundVariant<Variant>& variant, const ScoreRule<T>& rule, T* s,
                    Index s_stride, Index i0, Index rows, Index j0, Index cols) {
  for (Index r = 0; r < rows; ++r) {
    variant_score_run(*variant.variant, s + r * s_stride, cols,
                      variant.at(rule.q_position + i0 + r, rule.k_position + j0));
  }
}

/// The tile of the rule's queries [i0, i0 + rows) x key columns [j0, j0 + cols), at their
/// positions, as the variant sees it.
template <class T, class Variant>
TileAt rule_tile(const BoundVariant<Variant>& variant, const ScoreRule<T>& rule, Index i0,
                 Index rows, Index j0, Index cols) {
  return variant.tile(rule.q_position + i0, rule.q_position + i0 + rows, rule.k_position + j0,
                      rule.k_position + j0 + cols);
}

/// The variant's kind of the rule's tile [i0, i0 + rows) x [j0, j0 + cols) (`classify_tile`;
/// Full for a variant without a mask).
template <class T, class Variant>
TileKind classify_rule_tile(const BoundVariant<Variant>& variant, const ScoreRule<T>& rule,
                            Index i0, Index rows, Index j0, Index cols) {
  if constexpr (variant_masks_v<Variant>) {
    return classify_tile(*variant.variant, rule_tile(variant, rule, i0, rows, j0, cols));
  } else {
    static_cast<void>(variant), static_cast<void>(rule), static_cast<void>(i0);
    static_cast<void>(rows), static_cast<void>(j0), static_cast<void>(cols);
    return TileKind::Full;
  }
}

/// The key columns [begin, end) of `range` that some row of [i0, i0 + rows) may see by the
/// variant's ranges of keys (their hull), or `range` itself when the variant gives none: the tiles
/// outside are never visited.
template <class T, class Variant>
KeyRange variant_columns(const BoundVariant<Variant>& variant, const ScoreRule<T>& rule,
                         KeyRange range, Index i0, Index rows) {
  if constexpr (variant_ranges_v<Variant>) {
    Index begin = std::numeric_limits<Index>::max();
    Index end = std::numeric_limits<Index>::min();
    for (Index r = 0; r < rows; ++r) {
      const PositionRange keys =
          variant.variant->keys(variant.at(rule.q_position + i0 + r, rule.k_position));
      if (keys.empty()) continue;
      begin = std::min(begin, keys.begin);
      end = std::max(end, keys.end);
    }
    if (begin >= end) return {range.begin, range.begin};
    // In columns, without overflow for ranges that reach the ends of Index.
    const Index first = rule.k_position;
    const Index column_begin = begin <= first ? 0 : std::min(begin - first, rule.m);
    const Index column_end = end <= first ? 0 : std::min(end - first, rule.m);
    return {std::max(range.begin, column_begin), std::min(range.end, column_end)};
  } else {
    static_cast<void>(variant);
    static_cast<void>(rule);
    static_cast<void>(i0);
    static_cast<void>(rows);
    return range;
  }
}

/// The variant's mask on a Partial tile, after the rule's steps: forbidden entries to -inf (row
/// by row outside a variant's range of keys, else key by key).
template <class T, class Variant>
void variant_mask_tile(const BoundVariant<Variant>& variant, const ScoreRule<T>& rule, T* s,
                       Index s_stride, Index i0, Index rows, Index j0, Index cols) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const Index first_key = rule.k_position + j0;  // the tile's keys are [first_key, + cols)
  for (Index r = 0; r < rows; ++r) {
    T* row = s + r * s_stride;
    const Index query = rule.q_position + i0 + r;
    if constexpr (variant_ranges_v<Variant>) {
      const PositionRange keys = variant.variant->keys(variant.at(query, first_key));
      // In tile columns, without overflow for ranges that reach the ends of Index.
      const Index begin = keys.begin <= first_key ? 0 : std::min(keys.begin - first_key, cols);
      const Index end = keys.end <= first_key ? 0 : std::min(keys.end - first_key, cols);
      if (begin >= end) {
        std::fill(row, row + cols, neg_inf);
      } else {
        std::fill(row, row + begin, neg_inf);
        std::fill(row + end, row + cols, neg_inf);
      }
    } else {
      for (Index c = 0; c < cols; ++c) {
        if (!variant.variant->allowed(variant.at(query, first_key + c))) row[c] = neg_inf;
      }
    }
  }
}

}  // namespace detail
}  // namespace attn
