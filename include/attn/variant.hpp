#pragma once
/// \file variant.hpp
/// Attention variants: a user type whose optional members change the scores, forbid keys or
/// classify whole tiles, evaluated where the scores are (docs/variants.md).
///
/// A variant `V` may have any of these members, each optional:
/// - `T score(T s, const ScoreAt& at) const`: the score modification (s is the scaled logit);
/// - `void scores(T* s, Index count, const ScoreAt& first) const`: optional batch form of `score`
///   on `count` consecutive keys of one query (`first` is the first key's), in place: the tiled
///   kernel calls it row by row where present, so a variant can vectorise its function;
/// - `T dscore(T s, const ScoreAt& at) const`: its derivative d score / d s at the same s (needed
///   by the backward when `score` is present: the library cannot differentiate a functor);
/// - `bool allowed(const ScoreAt& at) const`: the mask (`true` = the query may attend the key);
/// - `PositionRange keys(const ScoreAt& query) const`: the mask as one range of keys per query
///   (`at.key` unused), instead of `allowed` where the mask is a range: the kernels then clip
///   rows instead of asking key by key;
/// - `TileKind tile(const TileAt& at) const`: what the mask is on a whole tile of queries x keys
///   (`Empty`: no entry allowed, `Full`: every entry allowed, `Partial`: look at each entry). A
///   tile that is not known exactly may always be called `Partial`; calling it `Empty` or `Full`
///   wrongly drops or skips the mask (`check_tile` finds that).
///
/// A variant with learnable parameters (`T5Bias`) has, beside `score` and `dscore`:
/// - `using Gradient = ...;` (default-constructible, with `+=`), `Gradient zero_gradient() const`
///   and `void gradient(Gradient& g, T s, T d, const ScoreAt& at) const`, which adds to g the
///   contribution of one score: s the scaled logit it took, d = dL / d score. The backward sums
///   them tile by tile, each tile's sum in a fixed order, then the tiles' in a fixed order: the
///   bits do not depend on the thread count.
///
/// A member with one of these names but another signature is a compile-time error
/// (`check_variant`), never silently ignored. `score` and `dscore` may be templates over T.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "detail/checked.hpp"
#include "error.hpp"
#include "types.hpp"

namespace attn {

/// Where one score sits, as a variant sees it. Positions are absolute (after `query_offset`); in a
/// packed batch the `*_in_sequence` fields are the positions within the item's own sequence (they
/// equal `query` and `key` otherwise).
struct ScoreAt {
  Index batch = 0;              ///< batch item
  Index head = 0;               ///< query head
  Index kv_head = 0;            ///< key/value head
  Index query = 0;              ///< the query's position
  Index key = 0;                ///< the key's position
  Index query_in_sequence = 0;  ///< the query's position within its sequence
  Index key_in_sequence = 0;    ///< the key's position within its sequence
};

/// A half-open range of positions [begin, end).
struct PositionRange {
  Index begin = 0;  ///< first position
  Index end = 0;    ///< one past the last position
  /// Whether the range holds no position.
  /// \returns true when end <= begin
  bool empty() const { return end <= begin; }
};

/// A tile of scores: the queries at positions `queries` against the keys at positions `keys`, in
/// one head of one batch item.
struct TileAt {
  Index batch = 0;        ///< batch item
  Index head = 0;         ///< query head
  Index kv_head = 0;      ///< key/value head
  PositionRange queries;  ///< the queries' positions
  PositionRange keys;     ///< the keys' positions
};

/// What a variant's mask is on a tile: no entry allowed, every entry allowed, or some.
enum class TileKind { Empty, Full, Partial };

namespace detail {

/// Whether V has a member of a given name, of any kind (function, template, overload set): the
/// name is ambiguous in a class derived from V and from a class that has it too.
struct VariantMemberNames {
  int score;
  int scores;
  int dscore;
  int allowed;
  int keys;
  int tile;
  int gradient;
};
template <class V>
struct VariantNameProbe : V, VariantMemberNames {};

/// Defines `names_<member>` (internal; undefined after its four uses).
#define ATTN_DETAIL_VARIANT_NAME(member)                                        \
  template <class V, class = void>                                              \
  struct names_##member : std::true_type {};                                    \
  template <class V>                                                            \
  struct names_##member<V, std::void_t<decltype(&VariantNameProbe<V>::member)>> \
      : std::false_type {};
ATTN_DETAIL_VARIANT_NAME(score)
ATTN_DETAIL_VARIANT_NAME(scores)
ATTN_DETAIL_VARIANT_NAME(dscore)
ATTN_DETAIL_VARIANT_NAME(allowed)
ATTN_DETAIL_VARIANT_NAME(keys)
ATTN_DETAIL_VARIANT_NAME(tile)
ATTN_DETAIL_VARIANT_NAME(gradient)
#undef ATTN_DETAIL_VARIANT_NAME

template <class V, class T, class = void>
struct callable_score : std::false_type {};
template <class V, class T>
struct callable_score<
    V, T,
    std::enable_if_t<std::is_same_v<decltype(std::declval<const V&>().score(
                                        std::declval<T>(), std::declval<const ScoreAt&>())),
                                    T>>> : std::true_type {};
template <class V, class T, class = void>
struct callable_scores : std::false_type {};
template <class V, class T>
struct callable_scores<
    V, T,
    std::enable_if_t<std::is_void_v<decltype(std::declval<const V&>().scores(
        std::declval<T*>(), std::declval<Index>(), std::declval<const ScoreAt&>()))>>>
    : std::true_type {};
template <class V, class T, class = void>
struct callable_dscore : std::false_type {};
template <class V, class T>
struct callable_dscore<
    V, T,
    std::enable_if_t<std::is_same_v<decltype(std::declval<const V&>().dscore(
                                        std::declval<T>(), std::declval<const ScoreAt&>())),
                                    T>>> : std::true_type {};
template <class V, class = void>
struct callable_allowed : std::false_type {};
template <class V>
struct callable_allowed<
    V, std::enable_if_t<std::is_same_v<
           decltype(std::declval<const V&>().allowed(std::declval<const ScoreAt&>())), bool>>>
    : std::true_type {};
template <class V, class = void>
struct callable_keys : std::false_type {};
template <class V>
struct callable_keys<
    V, std::enable_if_t<std::is_same_v<
           decltype(std::declval<const V&>().keys(std::declval<const ScoreAt&>())), PositionRange>>>
    : std::true_type {};
template <class V, class = void>
struct callable_tile : std::false_type {};
template <class V>
struct callable_tile<
    V, std::enable_if_t<std::is_same_v<
           decltype(std::declval<const V&>().tile(std::declval<const TileAt&>())), TileKind>>>
    : std::true_type {};

template <class V, class T, class = void>
struct callable_gradient : std::false_type {};
template <class V, class T>
struct callable_gradient<
    V, T,
    std::enable_if_t<
        std::is_void_v<decltype(std::declval<const V&>().gradient(
            std::declval<typename V::Gradient&>(), std::declval<T>(), std::declval<T>(),
            std::declval<const ScoreAt&>()))> &&
        std::is_same_v<decltype(std::declval<const V&>().zero_gradient()), typename V::Gradient>>>
    : std::true_type {};

template <class V>
inline constexpr bool is_probeable_v = std::is_class_v<V> && !std::is_final_v<V>;

/// Whether V names any member of a variant (only asked of classes that can be probed).
template <class V, bool = is_probeable_v<V>>
struct names_any_member : std::false_type {};
template <class V>
struct names_any_member<V, true>
    : std::bool_constant<names_score<V>::value || names_scores<V>::value ||
                         names_dscore<V>::value || names_allowed<V>::value ||
                         names_keys<V>::value || names_tile<V>::value> {};

/// The variant of a call without one: it has no member, so every use of it compiles away.
struct NoVariant {};

/// The gradient type of a variant's parameters, or `NoGradient` for a variant without any.
struct NoGradient {};
template <class V, bool = names_gradient<V>::value>
struct GradientOf {
  using type = NoGradient;
};
template <class V>
struct GradientOf<V, true> {
  using type = typename V::Gradient;
};

/// A variant sees each query and key at its position, a tile as half-open position ranges: the
/// positions [q_first, q_first + n] and [k_first, k_first + m] of a call must fit in Index (a
/// query offset near the end of the range, which means "after every key" without a variant,
/// has no position to show a variant). \throws shape_error naming `function` otherwise.
inline void require_variant_positions(const char* function, Index q_first, Index n, Index k_first,
                                      Index m) {
  checked_add(function, q_first, n, "with a variant, the positions of the queries");
  checked_add(function, k_first, m, "with a variant, the positions of the keys");
}

/// A variant and where it runs (batch item and heads), as the kernels pass it along.
template <class V>
struct BoundVariant {
  const V* variant = nullptr;  ///< null for NoVariant
  Index batch = 0;
  Index head = 0;
  Index kv_head = 0;
  ScoreAt at(Index query, Index key) const {
    return {batch, head, kv_head, query, key, query, key};
  }
  TileAt tile(Index query_begin, Index query_end, Index key_begin, Index key_end) const {
    return {batch, head, kv_head, {query_begin, query_end}, {key_begin, key_end}};
  }
};

}  // namespace detail

/// Whether V can be passed where a call takes a variant: a class with at least one of a variant's
/// members (`score`, `dscore`, `allowed`, `tile`). Option structs and matrices are not.
template <class V>
inline constexpr bool is_variant_v = detail::names_any_member<V>::value;

/// Whether variant V modifies the scores (has a member `score`).
template <class V>
inline constexpr bool variant_scores_v = detail::names_score<V>::value;
/// Whether variant V masks keys (has a member `allowed` or `keys`).
template <class V>
inline constexpr bool variant_masks_v =
    detail::names_allowed<V>::value || detail::names_keys<V>::value;
/// Whether variant V gives its mask as one range of keys per query (has a member `keys`).
template <class V>
inline constexpr bool variant_ranges_v = detail::names_keys<V>::value;
/// Whether variant V has learnable parameters (a member `gradient`).
template <class V>
inline constexpr bool variant_learns_v = detail::names_gradient<V>::value;
/// Whether variant V classifies whole tiles itself (has a member `tile`).
template <class V>
inline constexpr bool variant_tiles_v = detail::names_tile<V>::value;

/// Checks at compile time what does not depend on the scalar type: V is a class, and its
/// `allowed` and `tile`, where present, have their signatures; `dscore` and `tile` come with
/// `score` and `allowed`.
/// \returns true (the checks are `static_assert`s)
template <class V>
constexpr bool check_variant_members() {
  static_assert(detail::is_probeable_v<V>,
                "attn: a variant must be a class type that is not final");
  static_assert(!detail::names_dscore<V>::value || detail::names_score<V>::value,
                "attn: the variant has `dscore` but no `score`");
  static_assert(!detail::names_scores<V>::value || detail::names_score<V>::value,
                "attn: the variant has `scores` but no `score`: `scores` is the batch form of "
                "`score`, which the library needs too");
  static_assert(!detail::names_allowed<V>::value || detail::callable_allowed<V>::value,
                "attn: the variant's `allowed` must be callable as `bool allowed(const ScoreAt& "
                "at) const`");
  static_assert(!detail::names_keys<V>::value || detail::callable_keys<V>::value,
                "attn: the variant's `keys` must be callable as `PositionRange keys(const ScoreAt& "
                "query) const`");
  static_assert(!detail::names_keys<V>::value || !detail::names_allowed<V>::value,
                "attn: the variant has both `keys` and `allowed`: its mask is one of them (a "
                "range of keys per query, or a rule per key)");
  static_assert(!detail::names_tile<V>::value || detail::callable_tile<V>::value,
                "attn: the variant's `tile` must be callable as `TileKind tile(const TileAt& at) "
                "const`");
  static_assert(!detail::names_tile<V>::value || variant_masks_v<V>,
                "attn: the variant has `tile` but no mask (`allowed` or `keys`): a tile "
                "classification describes a mask");
  return true;
}

/// Checks at compile time that V is a variant for scalar T: `check_variant_members`, and `score`
/// and `dscore`, where present, callable with T. With `for_backward`, a `score` needs its
/// `dscore`.
/// \returns true (the checks are `static_assert`s)
template <class V, class T, bool for_backward = false>
constexpr bool check_variant() {
  check_variant_members<V>();
  static_assert(!detail::names_score<V>::value || detail::callable_score<V, T>::value,
                "attn: the variant's `score` must be callable as `T score(T s, const ScoreAt& at) "
                "const`, returning T (the scalar type of the call)");
  static_assert(!detail::names_scores<V>::value || detail::callable_scores<V, T>::value,
                "attn: the variant's `scores` must be callable as `void scores(T* s, Index count, "
                "const ScoreAt& first) const` (the scalar type of the call)");
  static_assert(!detail::names_dscore<V>::value || detail::callable_dscore<V, T>::value,
                "attn: the variant's `dscore` must be callable as `T dscore(T s, const ScoreAt& "
                "at) const`, returning T (the scalar type of the call)");
  static_assert(!detail::names_gradient<V>::value || detail::callable_gradient<V, T>::value,
                "attn: a variant with learnable parameters needs `using Gradient = ...;`, "
                "`Gradient zero_gradient() const` and `void gradient(Gradient& g, T s, T d, const "
                "ScoreAt& at) const`");
  static_assert(!detail::names_gradient<V>::value || detail::names_score<V>::value,
                "attn: the variant has `gradient` but no `score`: its parameters act through the "
                "score");
  static_assert(!for_backward || !detail::names_score<V>::value || detail::names_dscore<V>::value,
                "attn: the backward needs the variant's `dscore(s, at)` (d score / d s) beside its "
                "`score`: the library cannot differentiate a functor");
  return true;
}

/// The variant's score of the scaled logit `s` (s itself when V has no `score`).
/// \param variant  the variant
/// \param s        a scaled logit
/// \param at       where it sits
/// \returns the modified logit
template <class T, class V>
T variant_score(const V& variant, T s, const ScoreAt& at) {
  if constexpr (variant_scores_v<V>) {
    return variant.score(s, at);
  } else {
    static_cast<void>(variant);
    static_cast<void>(at);
    return s;
  }
}

/// The variant's score of `count` consecutive scaled logits of one query, in place (`first` is the
/// first key's place; the others follow it key by key): its `scores` where present, else `score`
/// entry by entry, else nothing.
/// \param variant  the variant
/// \param s        `count` scaled logits of one query, in place
/// \param count    how many
/// \param first    where the first sits
template <class T, class V>
void variant_score_run(const V& variant, T* s, Index count, const ScoreAt& first) {
  if constexpr (detail::names_scores<V>::value) {
    variant.scores(s, count, first);
  } else if constexpr (variant_scores_v<V>) {
    ScoreAt at = first;
    for (Index c = 0; c < count; ++c) {
      s[c] = variant.score(s[c], at);
      ++at.key;
      ++at.key_in_sequence;
    }
  } else {
    static_cast<void>(variant);
    static_cast<void>(s);
    static_cast<void>(count);
    static_cast<void>(first);
  }
}

/// d score / d s at `s` (1 when V has no `score`).
/// \param variant  the variant
/// \param s        a scaled logit (before the variant's score)
/// \param at       where it sits
/// \returns d score / d s
template <class T, class V>
T variant_dscore(const V& variant, T s, const ScoreAt& at) {
  if constexpr (variant_scores_v<V>) {
    check_variant<V, T, true>();
    return variant.dscore(s, at);
  } else {
    static_cast<void>(variant);
    static_cast<void>(s);
    static_cast<void>(at);
    return T(1);
  }
}

/// Whether the variant lets the query attend the key (true when V has no mask).
/// \param variant  the variant
/// \param at       the query and the key
/// \returns true if the query may attend the key
template <class V>
bool variant_allows(const V& variant, const ScoreAt& at) {
  if constexpr (variant_ranges_v<V>) {
    const PositionRange keys = variant.keys(at);
    return at.key >= keys.begin && at.key < keys.end;
  } else if constexpr (variant_masks_v<V>) {
    return variant.allowed(at);
  } else {
    static_cast<void>(variant);
    static_cast<void>(at);
    return true;
  }
}

/// The tile's kind found by evaluating the mask on every entry (Full when V has no mask, Empty
/// for a tile without entries).
/// \param variant  the variant
/// \param tile     the queries and keys
/// \returns Empty, Full or Partial
template <class V>
TileKind classify_by_mask(const V& variant, const TileAt& tile) {
  if (tile.queries.empty() || tile.keys.empty()) return TileKind::Empty;
  if constexpr (!variant_masks_v<V>) {
    static_cast<void>(variant);
    return TileKind::Full;
  } else {
    bool any = false;
    bool all = true;
    ScoreAt at{tile.batch, tile.head, tile.kv_head, 0, 0, 0, 0};
    for (Index q = tile.queries.begin; q < tile.queries.end; ++q) {
      for (Index k = tile.keys.begin; k < tile.keys.end; ++k) {
        at.query = at.query_in_sequence = q;
        at.key = at.key_in_sequence = k;
        const bool allowed = variant_allows(variant, at);
        any = any || allowed;
        all = all && allowed;
        if (any && !all) return TileKind::Partial;
      }
    }
    return any ? TileKind::Full : TileKind::Empty;
  }
}

/// The tile's kind: the variant's own `tile` when it has one, else `classify_by_mask`.
/// \param variant  the variant
/// \param tile     the queries and keys
/// \returns Empty, Full or Partial
template <class V>
TileKind classify_tile(const V& variant, const TileAt& tile) {
  if (tile.queries.empty() || tile.keys.empty()) return TileKind::Empty;
  if constexpr (variant_tiles_v<V>) {
    return variant.tile(tile);
  } else {
    return classify_by_mask(variant, tile);
  }
}

/// The checking mode of a variant's tile classification: throws `shape_error` naming the tile
/// when `tile` calls it Empty or Full and the mask disagrees on some entry (Partial is always
/// correct). Costs one evaluation of the mask per entry of the tile.
/// \param variant  the variant
/// \param tile     the queries and keys
template <class V>
void check_tile(const V& variant, const TileAt& tile) {
  const TileKind claimed = classify_tile(variant, tile);
  if (claimed == TileKind::Partial) return;
  const TileKind actual = classify_by_mask(variant, tile);
  if (actual != claimed) {
    const auto name = [](TileKind k) {
      return k == TileKind::Empty ? "Empty" : k == TileKind::Full ? "Full" : "Partial";
    };
    detail::fail("attn::check_tile", "the variant calls the tile of queries [", tile.queries.begin,
                 ", ", tile.queries.end, ") x keys [", tile.keys.begin, ", ", tile.keys.end,
                 ") (batch ", tile.batch, ", head ", tile.head, ") ", name(claimed),
                 " but its mask makes it ", name(actual));
  }
}

/// The checking mode of a variant: the same variant, whose tile classifications the calls that
/// take it check against its mask before they compute (`check_tile` on every tile they will
/// classify, one thread, in order), throwing `shape_error` naming the first wrong tile. It costs
/// an evaluation of the mask per entry of those tiles: for tests and debugging.
template <class V>
struct Checked : V {
  /// Wraps `variant`.
  /// \param variant  the variant to wrap
  explicit Checked(V variant) : V(std::move(variant)) {}
};

/// `Checked` of a variant: `flash_attention(Q, K, V, attn::checked(my_variant))`.
/// \param variant  the variant to check
/// \returns the same variant, checked
template <class V>
Checked<V> checked(V variant) {
  check_variant_members<V>();
  return Checked<V>(std::move(variant));
}

namespace detail {
template <class V>
struct is_checked : std::false_type {};
template <class V>
struct is_checked<Checked<V>> : std::true_type {};
}  // namespace detail

/// The variant's mask on n queries at positions `query_position + i` and m keys at positions
/// `key_position + j` of one head, as an n x m table (for pictures, tests and the paths that take
/// a `mask`; it costs n m booleans).
/// \param variant         the variant
/// \param n               queries
/// \param m               keys
/// \param query_position  position of query 0
/// \param key_position    position of key 0
/// \param head            the query head and key/value head the variant sees
/// \returns n x m, true = may attend
template <class V>
Mask variant_mask(const V& variant, Index n, Index m, Index query_position = 0,
                  Index key_position = 0, Index head = 0) {
  if (n < 0 || m < 0) detail::fail("attn::variant_mask", "n and m must be >= 0, got ", n, ", ", m);
  check_variant_members<V>();
  Mask mask(n, m);
  ScoreAt at{0, head, head, 0, 0, 0, 0};
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < m; ++j) {
      at.query = at.query_in_sequence = query_position + i;
      at.key = at.key_in_sequence = key_position + j;
      mask(i, j) = variant_allows(variant, at);
    }
  }
  return mask;
}

// ---------------------------------------------------------------------------------------------
// Composition.

namespace detail {

/// The score part of `Both`: present only when a side modifies the scores.
template <class A, class B, bool scores = variant_scores_v<A> || variant_scores_v<B>>
struct BothScores {
  A first;
  B second;
};
template <class A, class B>
struct BothScores<A, B, true> {
  A first;
  B second;
  /// `second`'s modification of `first`'s.
  template <class T>
  T score(T s, const ScoreAt& at) const {
    return variant_score(second, variant_score(first, s, at), at);
  }
  /// The same on a run of keys, each side in its batch form where it has one.
  template <class T>
  void scores(T* s, Index count, const ScoreAt& first_key) const {
    variant_score_run(first, s, count, first_key);
    variant_score_run(second, s, count, first_key);
  }
  /// The chain rule through both.
  template <class T>
  T dscore(T s, const ScoreAt& at) const {
    return variant_dscore(second, variant_score(first, s, at), at) * variant_dscore(first, s, at);
  }
};

/// The keys a side of `Both` allows a query: its range, or every key for a side without a mask.
template <class V>
PositionRange side_keys(const V& variant, const ScoreAt& query) {
  if constexpr (variant_ranges_v<V>) {
    return variant.keys(query);
  } else {
    static_cast<void>(variant);
    static_cast<void>(query);
    return {std::numeric_limits<Index>::min(), std::numeric_limits<Index>::max()};
  }
}

/// Whether `Both` of A and B gives its mask as ranges: each side gives ranges or has no mask, and
/// one of them has a mask.
template <class A, class B>
inline constexpr bool both_ranges_v = (variant_ranges_v<A> || !variant_masks_v<A>)&&(
    variant_ranges_v<B> || !variant_masks_v<B>)&&(variant_masks_v<A> || variant_masks_v<B>);

/// The mask part of `Both`: the intersection of the ranges when both sides give ranges (or no
/// mask), else a rule per key.
template <class A, class B, bool ranges = both_ranges_v<A, B>>
struct BothMask : BothScores<A, B> {
  /// Both sides allow the key.
  /// \param at  the query and the key
  /// \returns true if both sides allow it
  bool allowed(const ScoreAt& at) const {
    return variant_allows(this->first, at) && variant_allows(this->second, at);
  }
};
template <class A, class B>
struct BothMask<A, B, true> : BothScores<A, B> {
  /// The intersection of both sides' ranges.
  /// \param query  the query (`key` unused)
  /// \returns the keys both sides allow it
  PositionRange keys(const ScoreAt& query) const {
    const PositionRange a = side_keys(this->first, query);
    const PositionRange b = side_keys(this->second, query);
    return {std::max(a.begin, b.begin), std::min(a.end, b.end)};
  }
};

/// The parameters of `Both`: those of the side that has them (one side at most).
template <class A, class B,
          int side = variant_learns_v<A>&& variant_learns_v<B>
                         ? 3
                         : (variant_learns_v<A> ? 1 : (variant_learns_v<B> ? 2 : 0))>
struct BothLearns : BothMask<A, B> {
  static_assert(!(variant_learns_v<A> && variant_learns_v<B>),
                "attn: both() of two variants with learnable parameters is not supported");
};
template <class A, class B>
struct BothLearns<A, B, 1> : BothMask<A, B> {
  using Gradient = typename A::Gradient;
  Gradient zero_gradient() const { return this->first.zero_gradient(); }
  /// The first side's parameters, through the second side's derivative.
  template <class T>
  void gradient(Gradient& g, T s, T d, const ScoreAt& at) const {
    const T inner = variant_score(this->first, s, at);
    this->first.gradient(g, s, d * variant_dscore(this->second, inner, at), at);
  }
};
template <class A, class B>
struct BothLearns<A, B, 2> : BothMask<A, B> {
  using Gradient = typename B::Gradient;
  Gradient zero_gradient() const { return this->second.zero_gradient(); }
  /// The second side's parameters, at the first side's score.
  template <class T>
  void gradient(Gradient& g, T s, T d, const ScoreAt& at) const {
    this->second.gradient(g, variant_score(this->first, s, at), d, at);
  }
};

}  // namespace detail

/// Two variants at once: a key is allowed where both allow it, and the score is `second`'s
/// modification of `first`'s. A tile is Empty where either side's is, Full where both are. The
/// learnable parameters of one side (at most) are those of the pair.
template <class A, class B>
struct Both : detail::BothLearns<A, B> {
  /// Empty if either side is Empty, Full if both are Full, else Partial.
  /// \param at  the tile's queries and keys
  /// \returns Empty, Full or Partial
  TileKind tile(const TileAt& at) const {
    const TileKind a = classify_tile(this->first, at);
    if (a == TileKind::Empty) return TileKind::Empty;
    const TileKind b = classify_tile(this->second, at);
    if (b == TileKind::Empty) return TileKind::Empty;
    return a == TileKind::Full && b == TileKind::Full ? TileKind::Full : TileKind::Partial;
  }
};

/// `Both` of two variants (their masks and'ed, their score modifications chained, first first).
/// \param first   the first variant (its score first)
/// \param second  the second
/// \returns both at once
template <class A, class B>
Both<A, B> both(A first, B second) {
  check_variant_members<A>();
  check_variant_members<B>();
  return Both<A, B>{{{{std::move(first), std::move(second)}}}};
}

/// Either of two masks: a key is allowed where one of them allows it. A tile is Full where either
/// side's is, Empty where both are. Masks only: a score modification has no meaning under "or".
template <class A, class B>
struct Either {
  static_assert(!variant_scores_v<A> && !variant_scores_v<B>,
                "attn: either() joins masks; a variant with `score` has no meaning under 'or' "
                "(use both())");
  A first;   ///< one mask
  B second;  ///< the other
  /// One side allows the key.
  /// \param at  the query and the key
  /// \returns true if the query may attend the key
  bool allowed(const ScoreAt& at) const {
    return variant_allows(first, at) || variant_allows(second, at);
  }
  /// Full if either side is Full, Empty if both are Empty, else Partial.
  /// \param at  the tile's queries and keys
  /// \returns Empty, Full or Partial
  TileKind tile(const TileAt& at) const {
    const TileKind a = classify_tile(first, at);
    if (a == TileKind::Full) return TileKind::Full;
    const TileKind b = classify_tile(second, at);
    if (b == TileKind::Full) return TileKind::Full;
    return a == TileKind::Empty && b == TileKind::Empty ? TileKind::Empty : TileKind::Partial;
  }
};

/// `Either` of two masks.
/// \param first   one mask
/// \param second  the other
/// \returns either of them
template <class A, class B>
Either<A, B> either(A first, B second) {
  check_variant_members<A>();
  check_variant_members<B>();
  return Either<A, B>{std::move(first), std::move(second)};
}

// ---------------------------------------------------------------------------------------------
// Ready variants.

/// Causal by positions: a query sees the keys at or before its own position.
struct CausalMask {
  /// Keys up to the query's position.
  /// \param query  the query (`key` unused)
  /// \returns the keys it may see
  PositionRange keys(const ScoreAt& query) const {
    return {std::numeric_limits<Index>::min(), query.query + 1};
  }
  /// Exact.
  /// \param at  the tile's queries and keys
  /// \returns Empty, Full or Partial
  TileKind tile(const TileAt& at) const {
    if (at.keys.begin > at.queries.end - 1) return TileKind::Empty;
    if (at.keys.end - 1 <= at.queries.begin) return TileKind::Full;
    return TileKind::Partial;
  }
};

/// Documents packed into one sequence: a query sees only the keys of its own document, and with
/// `causal` only those at or before it. Documents are contiguous runs of positions, given by their
/// boundaries (FlashAttention's `cu_seqlens`: 0, end of document 0, ..., total) or by one id per
/// position. Positions outside [0, total) belong to no document and see nothing.
class DocumentMask {
 public:
  /// From the boundaries: `offsets[0] == 0`, non-decreasing (an empty document is allowed); the
  /// last one is the total length.
  /// \param offsets  the documents' boundaries
  /// \param causal   whether a query sees only the keys at or before it
  explicit DocumentMask(std::vector<Index> offsets, bool causal = false)
      : offsets_(std::move(offsets)), causal_(causal) {
    if (offsets_.empty() || offsets_.front() != 0) {
      detail::fail("attn::DocumentMask", "offsets must start with 0",
                   offsets_.empty() ? ", got none" : ", got " + std::to_string(offsets_.front()));
    }
    for (std::size_t d = 1; d < offsets_.size(); ++d) {
      if (offsets_[d] < offsets_[d - 1]) {
        detail::fail("attn::DocumentMask", "offsets must not decrease, got offsets[", d - 1,
                     "] = ", offsets_[d - 1], " then offsets[", d, "] = ", offsets_[d]);
      }
    }
  }

  /// From one document id per position: each document's positions must be one contiguous run.
  /// \param ids     one document id per position
  /// \param causal  whether a query sees only the keys at or before it
  /// \returns the mask
  static DocumentMask from_ids(const std::vector<Index>& ids, bool causal = false) {
    std::vector<Index> offsets{0};
    std::vector<Index> seen;
    for (std::size_t p = 0; p < ids.size(); ++p) {
      if (p > 0 && ids[p] == ids[p - 1]) continue;
      if (std::find(seen.begin(), seen.end(), ids[p]) != seen.end()) {
        detail::fail("attn::DocumentMask::from_ids", "document ", ids[p],
                     " appears again at "
                     "position ",
                     p, " after another document: a document must be one run");
      }
      seen.push_back(ids[p]);
      if (p > 0) offsets.push_back(static_cast<Index>(p));
    }
    offsets.push_back(static_cast<Index>(ids.size()));
    return DocumentMask(std::move(offsets), causal);
  }

  /// The document of a position (-1 outside [0, total)).
  /// \param position  a position
  /// \returns its document
  Index document(Index position) const {
    if (position < 0 || position >= offsets_.back()) return -1;
    const auto after = std::upper_bound(offsets_.begin(), offsets_.end(), position);
    return static_cast<Index>(after - offsets_.begin()) - 1;
  }
  /// The total length (the last offset).
  /// \returns the total length
  Index total() const { return offsets_.back(); }
  /// Whether a query sees only the keys at or before it.
  /// \returns true when causal
  bool causal() const { return causal_; }

  /// The query's document (up to the query when causal); nothing outside every document.
  /// \param query  the query (`key` unused)
  /// \returns the keys it may see
  PositionRange keys(const ScoreAt& query) const {
    const Index d = document(query.query);
    if (d < 0) return {0, 0};
    const auto index = static_cast<std::size_t>(d);
    return {offsets_[index], causal_ ? query.query + 1 : offsets_[index + 1]};
  }

  /// From the documents at the tile's corners: Empty where the query and key documents do not
  /// meet, Full within one document (and, causal, with every key at or before every query).
  /// \param at  the tile's queries and keys
  /// \returns Empty, Full or Partial
  TileKind tile(const TileAt& at) const {
    const PositionRange q = clamp(at.queries);
    const PositionRange k = clamp(at.keys);
    if (q.empty() || k.empty()) return TileKind::Empty;
    if (causal_ && k.begin > q.end - 1) return TileKind::Empty;
    const Index q_first = document(q.begin);
    const Index q_last = document(q.end - 1);
    const Index k_first = document(k.begin);
    const Index k_last = document(k.end - 1);
    if (q_last < k_first || k_last < q_first) return TileKind::Empty;
    const bool one = q_first == q_last && k_first == k_last && q_first == k_first;
    const bool whole = q.begin == at.queries.begin && q.end == at.queries.end &&
                       k.begin == at.keys.begin && k.end == at.keys.end;
    if (one && whole && (!causal_ || k.end - 1 <= q.begin)) return TileKind::Full;
    return TileKind::Partial;
  }

 private:
  PositionRange clamp(PositionRange r) const {
    return {std::clamp<Index>(r.begin, 0, total()), std::clamp<Index>(r.end, 0, total())};
  }

  std::vector<Index> offsets_;
  bool causal_;
};

/// Prefix-LM: the first `prefix` positions see each other both ways; every later query sees the
/// whole prefix and the keys at or before it (causal).
struct PrefixLM {
  Index prefix = 0;  ///< positions [0, prefix) are the bidirectional prefix
  /// Keys before the prefix's end or up to the query, whichever reaches further.
  /// \param query  the query (`key` unused)
  /// \returns the keys it may see
  PositionRange keys(const ScoreAt& query) const {
    return {std::numeric_limits<Index>::min(), std::max(prefix, query.query + 1)};
  }
  /// Exact.
  /// \param at  the tile's queries and keys
  /// \returns Empty, Full or Partial
  TileKind tile(const TileAt& at) const {
    if (at.keys.end <= prefix || at.keys.end - 1 <= at.queries.begin) return TileKind::Full;
    if (at.keys.begin >= prefix && at.keys.begin > at.queries.end - 1) return TileKind::Empty;
    return TileKind::Partial;
  }
};

/// A dilated sliding window (causal): a query sees `window` keys, itself and every `dilation`-th
/// one before it: keys at query - t dilation for t = 0 .. window - 1.
class DilatedWindow {
 public:
  /// `window` and `dilation` at least 1.
  /// \param window    keys seen per query
  /// \param dilation  the step between them
  explicit DilatedWindow(Index window, Index dilation = 1) : window_(window), dilation_(dilation) {
    detail::require_positive_size("attn::DilatedWindow", "window", window_);
    detail::require_positive_size("attn::DilatedWindow", "dilation", dilation_);
  }
  /// The distance query - key is a multiple of `dilation` below `window` steps.
  /// \param at  the query and the key
  /// \returns true if the query may attend the key
  bool allowed(const ScoreAt& at) const {
    const Index distance = detail::saturating_sub(at.query, at.key);  // any positions
    return distance >= 0 && distance % dilation_ == 0 && distance / dilation_ < window_;
  }
  /// Empty where no distance of the tile can be allowed; Full only without dilation.
  /// \param at  the tile's queries and keys
  /// \returns Empty, Full or Partial
  TileKind tile(const TileAt& at) const {
    const Index nearest = detail::saturating_sub(at.queries.begin, at.keys.end - 1);   // smallest
    const Index farthest = detail::saturating_sub(at.queries.end - 1, at.keys.begin);  // largest
    const Index reach =
        window_ - 1 > detail::index_max / dilation_ ? detail::index_max : (window_ - 1) * dilation_;
    if (farthest < 0 || nearest > reach) return TileKind::Empty;
    if (dilation_ == 1 && nearest >= 0 && farthest <= reach) return TileKind::Full;
    return TileKind::Partial;
  }

 private:
  Index window_;
  Index dilation_;
};

/// A tree of draft tokens after a prefix (speculative decoding): draft token i stands at position
/// `prefix + i`; `parents[i]` is its parent draft token, or -1 for a child of the prefix's last
/// token. A draft token sees the whole prefix, its ancestors and itself; a prefix token sees the
/// prefix causally. Positions at or after `prefix + parents.size()` see nothing and are not seen.
class TreeMask {
 public:
  /// `parents[i]` must be -1 or a draft token before i (which makes the drafts a tree).
  /// \param prefix   tokens before the drafts
  /// \param parents  each draft token's parent (-1: the prefix)
  TreeMask(Index prefix, std::vector<Index> parents)
      : prefix_(prefix), parents_(std::move(parents)) {
    if (prefix_ < 0) detail::fail("attn::TreeMask", "prefix must be >= 0, got ", prefix_);
    const auto t = static_cast<Index>(parents_.size());
    depth_.assign(parents_.size(), 0);
    ancestors_.assign(parents_.size() * parents_.size(), false);
    for (Index i = 0; i < t; ++i) {
      const Index parent = parents_[static_cast<std::size_t>(i)];
      if (parent < -1 || parent >= i) {
        detail::fail("attn::TreeMask", "parents[", i, "] = ", parent,
                     " must be -1 (the prefix) or a draft token before ", i);
      }
      ancestor(i, i) = true;
      if (parent >= 0) {
        depth_[static_cast<std::size_t>(i)] = depth_[static_cast<std::size_t>(parent)] + 1;
        for (Index a = 0; a < i; ++a) ancestor(i, a) = ancestor(parent, a);
      }
    }
  }

  /// Draft token i's depth (0 for a child of the prefix): its position for RoPE is
  /// `prefix + depth(i)`.
  /// \param i  a draft token
  /// \returns its depth
  Index depth(Index i) const { return depth_.at(static_cast<std::size_t>(i)); }
  /// The drafts' RoPE positions, `prefix + depth(i)` for each draft token.
  /// \returns one position per draft token
  std::vector<Index> rope_positions() const {
    std::vector<Index> positions(depth_.size());
    for (std::size_t i = 0; i < depth_.size(); ++i) positions[i] = prefix_ + depth_[i];
    return positions;
  }
  /// Draft tokens.
  /// \returns the number of draft tokens
  Index drafts() const { return static_cast<Index>(parents_.size()); }
  /// The prefix's length.
  /// \returns the prefix's length
  Index prefix() const { return prefix_; }

  /// The rules above.
  /// \param at  the query and the key
  /// \returns true if the query may attend the key
  bool allowed(const ScoreAt& at) const {
    const Index end = prefix_ + drafts();
    if (at.query < 0 || at.key < 0 || at.query >= end || at.key >= end) return false;
    if (at.key < prefix_) return at.query >= prefix_ || at.key <= at.query;
    if (at.query < prefix_) return false;
    return ancestors_[static_cast<std::size_t>((at.query - prefix_) * drafts() + at.key - prefix_)];
  }
  /// Full for drafts against prefix keys, causal rules among prefix tokens, else Partial.
  /// \param at  the tile's queries and keys
  /// \returns Empty, Full or Partial
  TileKind tile(const TileAt& at) const {
    const Index end = prefix_ + drafts();
    if (at.queries.begin < 0 || at.keys.begin < 0 || at.queries.end > end || at.keys.end > end) {
      return TileKind::Partial;  // partly outside: left to the mask
    }
    if (at.keys.end <= prefix_) {
      if (at.queries.begin >= prefix_ || at.keys.end - 1 <= at.queries.begin) return TileKind::Full;
      if (at.keys.begin > at.queries.end - 1) return TileKind::Empty;
      return TileKind::Partial;
    }
    if (at.keys.begin >= prefix_ && at.queries.end <= prefix_) return TileKind::Empty;
    return TileKind::Partial;
  }

 private:
  std::vector<bool>::reference ancestor(Index i, Index a) {
    return ancestors_[static_cast<std::size_t>(i * drafts() + a)];
  }

  Index prefix_;
  std::vector<Index> parents_;
  std::vector<Index> depth_;
  std::vector<bool> ancestors_;  // drafts x drafts: (i, a) = a is i or an ancestor of i
};

/// Softcap as a score modification: `c tanh(s / c)`, the same function as the option `softcap`.
template <class T>
struct Softcap {
  T cap = T(1);  ///< c > 0
  /// c tanh(s / c).
  /// \param s   a scaled logit
  /// \param at  (unused)
  /// \returns c tanh(s / c)
  T score(T s, const ScoreAt& at) const {
    static_cast<void>(at);
    return cap * std::tanh(s / cap);
  }
  /// The same on `count` consecutive scores, vectorised (Eigen's tanh: agrees with `score` to
  /// rounding).
  /// \param s      `count` scaled logits, in place
  /// \param count  how many
  /// \param first  (unused)
  void scores(T* s, Index count, const ScoreAt& first) const {
    static_cast<void>(first);
    Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> run(s, count);
    run = cap * (run * (T(1) / cap)).tanh();
  }
  /// 1 - tanh(s / c)^2.
  /// \param s   a scaled logit
  /// \param at  (unused)
  /// \returns d score / d s
  T dscore(T s, const ScoreAt& at) const {
    static_cast<void>(at);
    const T t = std::tanh(s / cap);
    return T(1) - t * t;
  }
};

/// T5's relative position bias (Raffel et al. 2020): a learnable scalar per query head and bucket
/// of the distance key - query, added to the score. Distances below `buckets / 2` (per direction
/// when bidirectional) have a bucket each; longer ones share logarithmically wider buckets up to
/// `max_distance`, beyond which they share the last. Causal bucketing (`bidirectional` false)
/// maps every key after the query to bucket 0, as T5's decoder does.
/// Positions are those within the sequence (`ScoreAt::query_in_sequence`, `key_in_sequence`).
/// Its table is a parameter: the backward returns its gradient (`gradient`), reduced tile by tile
/// in a fixed order.
template <class T>
class T5Bias {
 public:
  /// \param heads          query heads (rows of the table)
  /// \param buckets        buckets per head (at least 2 per direction: 2, or 4 and even when
  ///                       bidirectional)
  /// \param max_distance   the distance from which every longer one shares the last bucket
  /// \param bidirectional  true for an encoder (both directions bucketed), false for a decoder
  T5Bias(Index heads, Index buckets = 32, Index max_distance = 128, bool bidirectional = true)
      : table_(Matrix<T>::Zero(heads, buckets)), bidirectional_(bidirectional) {
    detail::require_positive_size("attn::T5Bias", "heads", heads);
    // At least one exact bucket per direction: T5's logarithmic buckets divide by their count.
    if (buckets < 2 || (bidirectional && (buckets < 4 || buckets % 2 != 0))) {
      detail::fail("attn::T5Bias", "buckets must be at least 2 per direction (2, or an even 4 or ",
                   "more when bidirectional), got ", buckets);
    }
    side_ = bidirectional ? buckets / 2 : buckets;
    exact_ = side_ / 2;
    if (max_distance <= exact_) {
      detail::fail("attn::T5Bias", "max_distance must exceed the exact buckets (", exact_,
                   "), got ", max_distance);
    }
    max_distance_ = max_distance;
    // The buckets of the distances below max_distance, up to a bound on the table (a distance past
    // it is bucketed when asked); every longer distance takes the last bucket.
    by_distance_.resize(static_cast<std::size_t>(std::min<Index>(max_distance, 1 << 16)));
    for (std::size_t n = 0; n < by_distance_.size(); ++n) {
      by_distance_[n] = bucket_of_distance(static_cast<Index>(n));
    }
  }

  /// \param query  a query's position
  /// \param key    a key's position
  /// \returns the bucket of key - query
  Index bucket(Index query, Index key) const {
    // Saturated (and kept off INT64_MIN, whose negation overflows): past max_distance every
    // distance has the same bucket.
    const Index relative = std::max(detail::saturating_sub(key, query), -detail::index_max);
    Index offset = 0;
    Index n = 0;
    if (bidirectional_) {
      if (relative > 0) offset = side_;
      n = relative < 0 ? -relative : relative;
    } else {
      n = relative < 0 ? -relative : 0;
    }
    const auto tabled = static_cast<Index>(by_distance_.size());
    return offset +
           (n < tabled ? by_distance_[static_cast<std::size_t>(n)] : bucket_of_distance(n));
  }

  /// \returns the table, heads x buckets (zeros at construction)
  Matrix<T>& table() { return table_; }
  /// \returns the table, heads x buckets
  const Matrix<T>& table() const { return table_; }

  /// \param s   a scaled logit
  /// \param at  where it sits (`head`, `query_in_sequence`, `key_in_sequence`)
  /// \returns s + table(head, bucket)
  T score(T s, const ScoreAt& at) const {
    return s + table_(at.head, bucket(at.query_in_sequence, at.key_in_sequence));
  }
  /// \param s   a scaled logit (unused)
  /// \param at  where it sits (unused)
  /// \returns 1
  T dscore(T s, const ScoreAt& at) const {
    static_cast<void>(s);
    static_cast<void>(at);
    return T(1);
  }

  /// The gradient of the table: heads x buckets.
  using Gradient = Matrix<T>;
  /// \returns a zero gradient
  Gradient zero_gradient() const { return Gradient::Zero(table_.rows(), table_.cols()); }
  /// Adds one score's contribution: dL/d(score) to its entry of the table.
  /// \param g   the gradient being summed
  /// \param s   the scaled logit (unused: the bias is added)
  /// \param d   dL/d score at this entry
  /// \param at  where it sits
  void gradient(Gradient& g, T s, T d, const ScoreAt& at) const {
    static_cast<void>(s);
    g(at.head, bucket(at.query_in_sequence, at.key_in_sequence)) += d;
  }

 private:
  /// The bucket of a distance n >= 0 within one direction (T5: exact below `exact_`, then
  /// logarithmic up to `max_distance_`, the last bucket beyond).
  Index bucket_of_distance(Index n) const {
    if (n < exact_) return n;
    if (n >= max_distance_) return side_ - 1;
    const double scaled =
        std::log(static_cast<double>(n) / static_cast<double>(exact_)) /
        std::log(static_cast<double>(max_distance_) / static_cast<double>(exact_)) *
        static_cast<double>(side_ - exact_);
    return std::min(exact_ + static_cast<Index>(scaled), side_ - 1);
  }

  Matrix<T> table_;
  bool bidirectional_;
  Index side_ = 0;          ///< buckets per direction
  Index exact_ = 0;         ///< distances below it have a bucket each
  Index max_distance_ = 0;  ///< distances from it on share the last bucket
  std::vector<Index> by_distance_;
};

}  // namespace attn
