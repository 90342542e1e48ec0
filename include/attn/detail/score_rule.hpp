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
#include <tuple>
#include <type_traits>
#include <utility>

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

template <class T>
struct ScoreRule;

// The built-in options are variants of one mechanism: each is a stage of the score rule, a small
// type with the members of its kind, as a user's variant has (variant.hpp). Score stages change a
// score (`apply` on a tile and on one entry; `slope`, d out / d in from the output, where the
// stage is not linear); mask stages forbid keys (`forbids_all` on a tile, `apply_row`,
// `allows`). `ScoreRule` names its stages once, in pipeline order (`score_stages`,
// `mask_stages`), and every operation on the scores folds over them: a new option is a new
// stage and one entry there, and no kernel tests an option by name.

/// Softcap, `s -> c tanh(s / c)`: the same function at every entry (`uniform`), not linear.
template <class T>
struct SoftcapStage : std::optional<T> {
  static constexpr bool uniform = true;
  static constexpr bool linear = false;
  SoftcapStage() = default;
  SoftcapStage(std::optional<T> c) : std::optional<T>(c) {}  // NOLINT: as the option converts
  SoftcapStage(T c) : std::optional<T>(c) {}                 // NOLINT
  bool active() const { return this->has_value(); }
  void apply(Eigen::Ref<Matrix<T>> S, const ScoreRule<T>&, Index, Index) const {
    const T c = **this;
    S = c * (S.array() * (T(1) / c)).tanh();
  }
  T apply(T s, const ScoreRule<T>&, Index, Index) const { return **this * std::tanh(s / **this); }
  /// d out / d in from the outputs `out` of the stage: into G (`first`), else multiplied into it.
  template <class Tile>
  void slope(const Tile& out, Matrix<T>& G, bool first) const {
    const T c = **this;
    if (first) {
      G = T(1) - (out.array() * (T(1) / c)).square();
    } else {
      G.array() *= T(1) - (out.array() * (T(1) / c)).square();
    }
  }
  T slope(T out) const {
    const T t = out * (T(1) / **this);
    return T(1) - t * t;
  }
};

/// An n x m bias added to the scores; a -inf entry masks its key, whatever the score.
template <class T>
struct BiasStage : TableView<T> {
  static constexpr bool uniform = false;
  static constexpr bool linear = true;
  BiasStage() = default;
  BiasStage(const T* table, Index row_stride) : TableView<T>{table, row_stride} {}
  bool active() const { return this->data != nullptr; }
  void apply(Eigen::Ref<Matrix<T>> S, const ScoreRule<T>&, Index i0, Index j0) const {
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    for (Index r = 0; r < S.rows(); ++r) {
      T* s = S.data() + r * S.outerStride();
      const T* b = this->row(i0 + r) + j0;
      for (Index c = 0; c < S.cols(); ++c) s[c] = b[c] == neg_inf ? neg_inf : s[c] + b[c];
    }
  }
  T apply(T s, const ScoreRule<T>&, Index i, Index j) const {
    const T b = this->row(i)[j];
    return b == -std::numeric_limits<T>::infinity() ? b : s + b;
  }
};

/// ALiBi, `s - slope |p_i - p_j|` by the rule's positions.
template <class T>
struct AlibiStage : std::optional<T> {
  static constexpr bool uniform = false;
  static constexpr bool linear = true;
  AlibiStage() = default;
  AlibiStage(std::optional<T> slope) : std::optional<T>(slope) {}  // NOLINT
  AlibiStage(T slope) : std::optional<T>(slope) {}                 // NOLINT
  bool active() const { return this->has_value(); }
  void apply(Eigen::Ref<Matrix<T>> S, const ScoreRule<T>& rule, Index i0, Index j0) const {
    const T slope = **this;
    for (Index r = 0; r < S.rows(); ++r) {
      T* s = S.data() + r * S.outerStride();
      const Index delta = rule.distance(i0 + r, j0);
      for (Index c = 0; c < S.cols(); ++c) s[c] -= slope * static_cast<T>(std::abs(delta - c));
    }
  }
  T apply(T s, const ScoreRule<T>& rule, Index i, Index j) const {
    return s - **this * static_cast<T>(std::abs(rule.distance(i, j)));
  }
};

/// A mask of n x m booleans (true = may attend), or of 1 x m (`stride` 0: the same row for every
/// query, as key padding is).
struct MaskStage : TableView<bool> {
  MaskStage() = default;
  MaskStage(const bool* table, Index row_stride) : TableView<bool>{table, row_stride} {}
  bool active() const { return data != nullptr; }
  /// Whether no query of [i0, i0 + rows) may attend any key of [j0, j0 + cols).
  bool forbids_all(Index i0, Index rows, Index j0, Index cols) const {
    const Index distinct_rows = stride == 0 ? std::min<Index>(rows, 1) : rows;
    for (Index r = 0; r < distinct_rows; ++r) {
      const bool* allowed = row(i0 + r) + j0;
      if (std::any_of(allowed, allowed + cols, [](bool b) { return b; })) return false;
    }
    return true;
  }
  /// Sets to -inf the entries [begin, end) of row i (key columns from j0) that the mask forbids.
  template <class T>
  void apply_row(T* s, Index i, Index j0, Index begin, Index end) const {
    const bool* allowed = row(i) + j0;
    for (Index c = begin; c < end; ++c) {
      if (!allowed[c]) s[c] = -std::numeric_limits<T>::infinity();
    }
  }
  bool allows(Index i, Index j) const { return row(i)[j]; }
};

/// The resolved score rule of one call (or of one block of its keys). Cheap to copy: the tables
/// are views of the caller's storage, which must outlive the rule.
template <class T>
struct ScoreRule {
  Index n = 0;  ///< queries
  Index m = 0;  ///< key columns
  T scale = T(1);
  SoftcapStage<T> softcap;
  AlibiStage<T> alibi_slope;
  BiasStage<T> bias;    ///< n x m, added after the softcap; -inf entries mask
  MaskStage mask;       ///< n x m, true = may attend
  MaskStage key_valid;  ///< 1 x m (stride 0), false = padding, for every query
  /// The softmax's extra logit (a term of its denominator, not a score): the online softmax starts
  /// from it and the merge protocol adds it once.
  std::optional<T> sink;
  Index q_position = 0;               ///< position of query 0
  Index k_position = 0;               ///< position of key column 0
  bool causal = false;                ///< keys after the query's position are forbidden
  std::optional<Index> window_left;   ///< keys before position p - w are forbidden
  std::optional<Index> window_right;  ///< keys after position p + r are forbidden
  bool left_unbounded = false;      ///< the window does not apply to this block (pinned cache rows)
  Index column0 = 0;                ///< first column of this block in the call's n x m tables
  Index table_cols = 0;             ///< columns of the call's tables (m of the whole call)
  bool reduced_arithmetic = false;  ///< StoredArithmetic::Reduced: bfloat16 / int8 instructions

  /// The score stages in pipeline order (the uniform ones first: `apply_uniform` runs them apart).
  auto score_stages() const { return score_stages_of(*this); }
  auto score_stages() { return score_stages_of(*this); }
  /// The mask stages beside the key ranges (an and: their order does not matter).
  auto mask_stages() const { return std::tie(mask, key_valid); }

  /// Whether anything but the key ranges changes or forbids a score: the kernels run a tile
  /// through `apply` only then (or when it crosses the edge of a row's range).
  bool changes_scores() const {
    return any_stage(score_stages(), [](const auto& stage) { return stage.active(); }) ||
           any_stage(mask_stages(), [](const auto& stage) { return stage.active(); });
  }
  /// Whether a stage that depends on the query and the key is set (a table, ALiBi): the decoding
  /// kernel runs the uniform stages alone.
  bool has_per_entry() const {
    return any_stage(score_stages(),
                     [](const auto& stage) {
                       return !std::decay_t<decltype(stage)>::uniform && stage.active();
                     }) ||
           any_stage(mask_stages(), [](const auto& stage) { return stage.active(); });
  }
  /// Whether a score stage that is not linear is set: the backward multiplies by its slope.
  bool has_slope() const {
    return any_stage(score_stages(), [](const auto& stage) {
      return !std::decay_t<decltype(stage)>::linear && stage.active();
    });
  }

  /// The key columns query `i` may see by position (causal, both windows); the mask stages may
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

  /// The rule of n queries over m keys with this rule's scale and uniform stages, and nothing else
  /// (no range, table, position-dependent stage or sink).
  ScoreRule uniform_part(Index queries, Index keys_count) const {
    ScoreRule part;
    part.n = queries;
    part.m = keys_count;
    part.table_cols = keys_count;
    part.scale = scale;
    copy_uniform(score_stages(), part.score_stages(),
                 std::make_index_sequence<std::tuple_size_v<decltype(score_stages())>>{});
    return part;
  }

  /// Whether no query of [i0, i0 + rows) may attend any key of [j0, j0 + cols) by the masks.
  bool masked_out(Index i0, Index rows, Index j0, Index cols) const {
    return any_stage(mask_stages(), [&](const auto& stage) {
      return stage.active() && stage.forbids_all(i0, rows, j0, cols);
    });
  }

  /// Pipeline step 2 alone: the uniform score stages (softcap) on scaled scores; with `G`, their
  /// slope d out / d in into G (set to it).
  template <class Tile = Eigen::Ref<Matrix<T>>>
  void apply_uniform(Tile&& S, Matrix<T>* G = nullptr) const {
    static_assert(stages_in_order(static_cast<decltype(score_stages())*>(nullptr)),
                  "the uniform score stages come first, and the others are linear");
    bool first = true;
    for_each_stage(score_stages(), [&](const auto& stage) {
      using Stage = std::decay_t<decltype(stage)>;
      if constexpr (Stage::uniform) {
        if (!stage.active()) return;
        stage.apply(S, *this, 0, 0);
        if constexpr (!Stage::linear) {
          if (G) stage.slope(S, *G, first);
          first = false;
        }
      }
    });
  }

  /// Pipeline steps 2 to 4 on a tile of scaled scores `S` (rows [i0, i0 + S.rows()), key columns
  /// [j0, j0 + S.cols())): the score stages (softcap `c tanh(s / c)`, `+ bias` (a -inf bias masks
  /// the key, whatever the score), ALiBi `- slope |p_i - p_j|`), then every key the query may not
  /// see to -inf. NaN scores of visible keys stay NaN; those of forbidden keys become -inf.
  void apply(Eigen::Ref<Matrix<T>> S, Index i0, Index j0) const {
    apply_uniform(S);
    apply_per_entry(S, i0, j0);
  }

  /// Pipeline steps 3 and 4 alone (`apply` without the uniform stages): the score stages that
  /// depend on the entry, then the key ranges and the mask stages.
  void apply_per_entry(Eigen::Ref<Matrix<T>> S, Index i0, Index j0) const {
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    for_each_stage(score_stages(), [&](const auto& stage) {
      if constexpr (!std::decay_t<decltype(stage)>::uniform) {
        if (stage.active()) stage.apply(S, *this, i0, j0);
      }
    });
    const Index cols = S.cols();
    for (Index r = 0; r < S.rows(); ++r) {
      const Index i = i0 + r;
      T* s = S.data() + r * S.outerStride();
      const KeyRange visible = keys(i);
      const Index begin = std::clamp<Index>(visible.begin - j0, 0, cols);
      const Index end = std::clamp<Index>(visible.end - j0, begin, cols);
      std::fill(s, s + begin, neg_inf);
      std::fill(s + end, s + cols, neg_inf);
      for_each_stage(mask_stages(), [&](const auto& stage) {
        if (stage.active()) stage.apply_row(s, i, j0, begin, end);
      });
    }
  }

  /// Whether query i may attend key column j (its range and the mask stages).
  bool allows(Index i, Index j) const {
    const KeyRange visible = keys(i);
    if (j < visible.begin || j >= visible.end) return false;
    return !any_stage(mask_stages(),
                      [&](const auto& stage) { return stage.active() && !stage.allows(i, j); });
  }

  /// The final logit of one entry (steps 2 to 4 on a single scaled score): -inf when forbidden.
  T logit(T scaled, Index i, Index j) const {
    if (!allows(i, j)) return -std::numeric_limits<T>::infinity();
    T s = scaled;
    for_each_stage(score_stages(), [&](const auto& stage) {
      if (stage.active()) s = stage.apply(s, *this, i, j);
    });
    return s;
  }

  /// d logit / d s of one entry at `s`, the input of the score stages (1 when every stage is
  /// linear), each stage's slope from its output.
  T slope(T s, Index i, Index j) const {
    T g = T(1);
    for_each_stage(score_stages(), [&](const auto& stage) {
      if (!stage.active()) return;
      s = stage.apply(s, *this, i, j);
      if constexpr (!std::decay_t<decltype(stage)>::linear) g *= stage.slope(s);
    });
    return g;
  }

 private:
  // The one list of score stages, for both constnesses.
  template <class Rule>
  static auto score_stages_of(Rule& rule) {
    return std::tie(rule.softcap, rule.bias, rule.alibi_slope);
  }
  // What `apply_uniform` and the backward's slope rely on: the uniform stages come first, and a
  // stage that depends on the entry is linear (its slope is 1).
  template <class... S>
  static constexpr bool stages_in_order(const std::tuple<S...>*) {
    bool per_entry_seen = false;
    bool ordered = true;
    ((ordered = ordered && !(std::decay_t<S>::uniform && per_entry_seen) &&
                (std::decay_t<S>::uniform || std::decay_t<S>::linear),
      per_entry_seen = per_entry_seen || !std::decay_t<S>::uniform),
     ...);
    return ordered;
  }
  template <class Stages, class F>
  static void for_each_stage(const Stages& stages, F&& f) {
    std::apply([&](const auto&... stage) { (f(stage), ...); }, stages);
  }
  template <class Stages, class F>
  static bool any_stage(const Stages& stages, F&& f) {
    return std::apply([&](const auto&... stage) { return (f(stage) || ...); }, stages);
  }
  template <class From, class To, std::size_t... I>
  static void copy_uniform(const From& from, To to, std::index_sequence<I...>) {
    const auto copy = [](const auto& a, auto& b) {
      if constexpr (std::decay_t<decltype(a)>::uniform) {
        b = a;
      } else {
        static_cast<void>(a), static_cast<void>(b);
      }
    };
    (copy(std::get<I>(from), std::get<I>(to)), ...);
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
