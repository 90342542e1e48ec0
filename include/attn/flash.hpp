#pragma once
/// \file flash.hpp
/// Tiled attention with an online softmax: the n x m score table is never formed.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "detail/bfloat16_tiles.hpp"
#include "detail/exact_rows.hpp"
#include "detail/online_softmax.hpp"
#include "detail/pipeline.hpp"
#include "detail/score_rule.hpp"
#include "detail/score_tiles.hpp"
#include "detail/stored.hpp"
#include "detail/value_tiles.hpp"
#include "detail/variant_tiles.hpp"
#include "threads.hpp"
#include "variant.hpp"

namespace attn {

/// Tile sizes of `flash_attention` (rows of queries x keys per tile). The key tiles are rounded up
/// to a whole number of the score kernel's register panels (32 floats or 16 doubles with AVX-512,
/// 16 / 8 with AVX, 8 / 4 with SSE) and start on one, so that the keys are packed once per call.
/// The defaults, 36 x 512, were chosen by measurement (see docs/benchmarks.md): a row's
/// online-softmax step and the reload of its running output come once per 512 keys.
struct FlashTiles {
  /// Queries per tile (at least 1).
  Index query_rows = 36;
  /// Keys per tile (at least 1; rounded up to whole register panels).
  Index key_cols = 512;
};

/// Tile sizes of the tiled backward (`attention_backward`, `flash_attention_backward`): query rows
/// x key columns per tile. The key tiles are rounded up to whole register panels, as `FlashTiles`'
/// are. The defaults, 128 x 128, were chosen by measurement (see docs/benchmarks.md).
struct BackwardTiles {
  /// Queries per tile (at least 1).
  Index query_rows = 128;
  /// Keys per tile (at least 1; rounded up to whole register panels).
  Index key_cols = 128;
};

namespace detail {

/// The keys of one call packed for the score tiles (`pack_panel`), by each thread that reads them:
/// panel p holds keys [p w, (p + 1) w), w = `ScoreTile<T>::cols`. For the bfloat16 score tiles
/// (detail/bfloat16_tiles.hpp) the keys are in `bfloat16_panels` instead, and the queries they
/// meet, rounded, in `bfloat16_queries` (`panels` is then null).
template <class T>
struct PackedKeys {
  const T* panels = nullptr;
  Index d = 0;
  const std::uint32_t* bfloat16_panels = nullptr;   ///< `pack_bfloat16_keys`, or null
  const std::uint32_t* bfloat16_queries = nullptr;  ///< `pack_bfloat16_queries` of the call's Q
  const std::uint32_t* bfloat16_values = nullptr;   ///< `pack_bfloat16_values`, or null
  const T* panel(Index j0) const {
    constexpr Index w = ScoreTile<T>::cols;
    return panels + (j0 / w) * d * w;
  }
  /// Feature pairs per row of the bfloat16 operands.
  Index pairs() const { return (d + 1) / 2; }
  const std::uint32_t* bfloat16_panel(Index j0) const {
    return bfloat16_panels + (j0 / bfloat16_panel_keys) * pairs() * bfloat16_panel_keys;
  }
};

/// Per-thread working memory of the tiled kernel: O(tile (d_v + key_cols)).
template <class T>
struct FlashScratch {
  Matrix<T> s;             ///< rows x key tile: logits, then unnormalised probabilities
  Vector<T> alpha;         ///< each row's rescale of its running output for the current tile
  OnlineSoftmax<T> state;  ///< running output, maxima and sums of the block's rows
  Matrix<T> values;        ///< stored values: the tile's rows widened to T
  std::vector<std::uint32_t> p_bfloat16;  ///< probabilities rounded (bfloat16 value tiles)
  std::optional<PackedKeys<T>> keys;  ///< the keys as this thread packed them (`flash_kernel_on`)
};

/// Keys in a stored format (detail/stored.hpp) packed for the score tiles, widened on the way
/// (the packed panels are a copy in any case): a panel's rows widened a packet at a time
/// (`widen_into`; element by element was slower, see docs/benchmarks.md), then packed as keys of
/// T (`pack_panel`).
template <class T, class Codec>
const T* pack_keys(const StoredBlock<Codec, T>& K) {
  constexpr Index cols = ScoreTile<T>::cols;
  T* packed = packed_panels<T>(K.rows(), K.cols());
  struct WidenedPanel {};
  Matrix<T>& rows = thread_buffer<WidenedPanel, Matrix<T>>();  // one panel's keys widened
  for (Index p = 0; p < panel_count<T>(K.rows()); ++p) {
    const Index j0 = p * cols;
    K.middleRows(j0, std::min(cols, K.rows() - j0)).widen_into(rows);
    pack_panel<T>(rows, 0, packed + p * K.cols() * cols);
  }
  return packed;
}

/// The keys of one call packed for the score tiles (by the calling thread, into its own buffers):
/// float panels (`pack_keys`); or, for float queries over keys and values stored in bfloat16 with
/// `StoredArithmetic::Reduced` on a CPU with AVX512_BF16 (in translation units where
/// `bfloat16_tiles_compiled()`), the operands of detail/bfloat16_tiles.hpp: the keys and the
/// rounded queries in pairs of features, and, when d_v is a multiple of 16, the values in pairs of
/// keys.
template <class T, class KBlock, class VBlock>
PackedKeys<T> pack_for_scores(ConstRef<T> Q, const KBlock& K, const VBlock& V,
                              const ScoreRule<T>& rule) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<codec_of_t<KBlock, T>, BFloat16Codec> &&
                bfloat16_tiles_compiled()) {
    if (rule.reduced_arithmetic && bfloat16_arithmetic_available()) {
      struct BFloat16Operands {
        std::vector<std::uint32_t> keys, queries, values;  // grown to the largest call
      };
      auto& [keys, queries, values] = thread_buffer<BFloat16Operands, BFloat16Operands>();
      PackedKeys<T> packed{nullptr, K.cols()};
      const Index panels = (K.rows() + bfloat16_panel_keys - 1) / bfloat16_panel_keys;
      const auto grow = [](std::vector<std::uint32_t>& buffer, Index size) {
        if (buffer.size() < std::size_t(size)) buffer.resize(std::size_t(size));
      };
      grow(keys, panels * bfloat16_panel_keys * packed.pairs());
      grow(queries, Q.rows() * packed.pairs());
      pack_bfloat16_keys(K, keys.data());
      pack_bfloat16_queries(Q, queries.data());
      packed.bfloat16_panels = keys.data();
      packed.bfloat16_queries = queries.data();
      if (bfloat16_value_width(V.cols())) {
        grow(values, panels * bfloat16_panel_keys / 2 * V.cols());
        pack_bfloat16_values(V, values.data());
        packed.bfloat16_values = values.data();
      }
      return packed;
    }
  }
  return PackedKeys<T>{pack_keys<T>(K), K.cols()};
}

/// Rows [j0, j0 + cols) of the values as the value kernel reads them: in place for T, widened
/// into `scratch.values` for a stored format. Returns the first row and sets `stride`.
template <class T>
const T* value_rows(ConstRef<T> V, Index j0, Index, FlashScratch<T>&, Index& stride) {
  stride = V.outerStride();
  return V.data() + j0 * stride;
}
template <class T, class Codec>
const T* value_rows(const StoredBlock<Codec, T>& V, Index j0, Index cols, FlashScratch<T>& scratch,
                    Index& stride) {
  V.middleRows(j0, cols).widen_into(scratch.values);
  stride = scratch.values.outerStride();
  return scratch.values.data();
}

/// `repair_rows` for keys and values in a stored format: widened first, only when a row needs it.
template <class T, class Codec, class Variant = NoVariant>
void repair_rows(ConstRef<T> Q, const StoredBlock<Codec, T>& K, const StoredBlock<Codec, T>& V,
                 const ScoreRule<T>& rule, Index i0, Index rows, Eigen::Ref<Matrix<T>> O, T* lse,
                 const BoundVariant<Variant>& variant = {}) {
  if (std::isfinite(O.middleRows(i0, rows).sum())) return;
  Matrix<T> K_wide, V_wide;
  K.widen_into(K_wide);
  V.widen_into(V_wide);
  repair_rows<T>(Q, K_wide, V_wide, rule, i0, rows, O, lse, variant);
}

/// S = scale * Q_i K_j^T for the block's rows and the key tile [j0, j0 + cols), j0 on a panel:
/// the score kernel's register tiles, panel by panel (one panel stays in L1 while the block's
/// tiles use it). Columns past the last key of a partial panel are written too (scores against
/// the zero padding) and overwritten by the caller.
template <class T>
void flash_scores(ConstRef<T> Q, const PackedKeys<T>& keys, T scale, Index i0, Index rows, Index j0,
                  Index cols, T* s, Index s_stride) {
  constexpr Index w = ScoreTile<T>::cols;
#if defined(ATTN_X86_TARGETS)
  if constexpr (std::is_same_v<T, float> && bfloat16_tiles_compiled()) {
    if (keys.bfloat16_panels) {
      const Index pairs = keys.pairs();
      for (Index jj = 0; jj < cols; jj += w) {
        bfloat16_score_panel(keys.bfloat16_queries + i0 * pairs, pairs, rows,
                             keys.bfloat16_panel(j0 + jj), pairs, scale, s + jj, s_stride);
      }
      return;
    }
  }
#endif
  for (Index jj = 0; jj < cols; jj += w) {
    score_panel<T>(Q.data() + i0 * Q.outerStride(), Q.outerStride(), rows, keys.panel(j0 + jj), w,
                   Q.cols(), scale, s + jj, s_stride, w, false);
  }
}

/// One block of query rows [i0, i0 + rows) against every key the rule lets them see.
///
/// Shape contract: Q n x d_k, K m x d_k (and `keys`, K packed), V m x d_v; O n x d_v receives
/// rows [i0, i0 + rows); lse (optional) n entries. Key tiles outside the rows' range (causal,
/// windows) are never visited; key tiles that the masks forbid entirely are skipped.
///
/// Passes, for each key tile j of the block's range:
///   1. s_ij = scale Q_i K_j^T in the score kernel's register tiles (`flash_scores`), then the
///      score rule on the tile where it changes anything (softcap, bias, ALiBi, masks, or a tile
///      that crosses the edge of a row's key range).
///   2. Each row's online-softmax step (`online_softmax_step`: its max, the vectorised exp and
///      sum, its rescale alpha), then o_i = diag(alpha) o_i + p_ij V_j in the value kernel's
///      register tiles (`value_tiles`), the rescale fused into the load of o_i.
/// With bfloat16 operands in `keys` (`pack_for_scores`), both products take the bfloat16 tiles
/// instead (`bfloat16_score_panel`; p_ij rounded, then `bfloat16_value_tiles`).
/// Finally O_i = o_i / l_i, guarded, and lse_i = m_i + log(l_i); rows that came out not finite are
/// recomputed key by key (`repair_rows`), so a forbidden key's NaN value never reaches them.
/// K and V are blocks of T or `StoredBlock`s (the keys are then widened when packed, the values
/// tile by tile).
template <class T, class KBlock, class VBlock, class Variant = NoVariant>
void flash_block(ConstRef<T> Q, const KBlock& K, const VBlock& V, const PackedKeys<T>& keys,
                 const ScoreRule<T>& rule, const FlashTiles& tiles, Index i0, Index rows,
                 FlashScratch<T>& scratch, Eigen::Ref<Matrix<T>> O, T* lse,
                 const BoundVariant<Variant>& variant = {}) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  constexpr Index w = ScoreTile<T>::cols;
  const Index tile_cols = whole_panels<T>(tiles.key_cols);
  const Index d_v = V.cols();
  if (scratch.s.rows() < rows || scratch.s.cols() != tile_cols) {
    scratch.s.resize(std::max(rows, tiles.query_rows), tile_cols);
  }
  scratch.alpha.resize(rows);
  scratch.state.start(rows, d_v, rule.sink);
  T* s = scratch.s.data();
  const Index s_stride = scratch.s.outerStride();
  const bool plain = !rule.changes_scores();
  const KeyRange range = variant_columns<T>(variant, rule, rule.keys(i0, rows), i0, rows);
  const KeyRange first_row = rule.keys(i0);
  const KeyRange last_row = rule.keys(i0 + rows - 1);
  for (Index j0 = range.begin / w * w; j0 < range.end; j0 += tile_cols) {
    const Index cols = std::min(tile_cols, range.end - j0);
    if (rule.masked_out(i0, rows, j0, cols)) continue;
    TileKind kind = TileKind::Full;  // of the variant's mask
    if constexpr (variant_masks_v<Variant>) {
      kind = classify_rule_tile(variant, rule, i0, rows, j0, cols);
      if (kind == TileKind::Empty) continue;
    }

    // 1. Logits of the tile; the variant's score, the rule and the variant's mask where they
    //    change anything.
    flash_scores<T>(Q, keys, rule.scale, i0, rows, j0, cols, s, s_stride);
    if constexpr (variant_scores_v<Variant>) {
      variant_scores<T>(variant, rule, s, s_stride, i0, rows, j0, cols);
    }
    const Index padded = whole_panels<T>(cols);
    const bool inside = last_row.begin <= j0 && first_row.end >= j0 + cols;
    if (!plain || !inside) {
      Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>> tile(s, rows, cols,
                                                          Eigen::OuterStride<>(s_stride));
      rule.apply(tile, i0, j0);
    }
    if constexpr (variant_masks_v<Variant>) {
      if (kind == TileKind::Partial) {
        variant_mask_tile<T>(variant, rule, s, s_stride, i0, rows, j0, cols);
      }
    }

    // 2. Online softmax of each row, then the weighted values with the rescale.
    for (Index r = 0; r < rows; ++r) {
      T* row = s + r * s_stride;
      std::fill(row + cols, row + padded, neg_inf);
      Eigen::Map<RowVector<T>> logits(row, padded);
      scratch.alpha(r) = online_softmax_step<T>(logits, scratch.state.m(r), scratch.state.l(r));
    }
#if defined(ATTN_X86_TARGETS)
    if constexpr (std::is_same_v<T, float> && bfloat16_tiles_compiled()) {
      if (keys.bfloat16_values) {
        const Index pairs = padded / 2;
        scratch.p_bfloat16.resize(std::size_t(rows * pairs));
        for (Index r = 0; r < rows; ++r) {
          round_to_bfloat16(s + r * s_stride, padded, scratch.p_bfloat16.data() + r * pairs);
        }
        bfloat16_value_tiles(rows, pairs, d_v, scratch.p_bfloat16.data(), pairs,
                             keys.bfloat16_values + j0 / 2 * d_v, scratch.alpha.data(),
                             scratch.state.o.data(), scratch.state.o.outerStride());
        continue;
      }
    }
#endif
    Index v_stride = 0;
    const T* v_rows = value_rows<T>(V, j0, cols, scratch, v_stride);
    value_tiles<T>(rows, cols, d_v, s, s_stride, v_rows, v_stride, scratch.alpha.data(),
                   scratch.state.o.data(), scratch.state.o.outerStride());
  }
  scratch.state.finish(O.middleRows(i0, rows), lse ? lse + i0 : nullptr);
  repair_rows<T>(Q, K, V, rule, i0, rows, O, lse, variant);
}

/// The largest |x| of `count` consecutive entries, NaN entries skipped (a NaN must not hide the
/// magnitude of the others). NaN lanes are zeroed before the max, whose NaN rule differs between
/// SIMD sets; Eigen's NaN-skipping `maxCoeff` takes one entry at a time, a cost short calls see
/// (docs/benchmarks.md).
template <class T>
T largest_magnitude_skipping_nan(const T* x, Index count) {
  namespace ei = Eigen::internal;
  using Packet = typename ei::packet_traits<T>::type;
  constexpr Index w = ei::packet_traits<T>::size;
  T largest = T(0);
  Index i = 0;
  if constexpr (w > 1) {
    Packet a = ei::pset1<Packet>(T(0));
    Packet b = a;
    for (; i + 2 * w <= count; i += 2 * w) {
      const Packet x0 = ei::pabs(ei::ploadu<Packet>(x + i));
      const Packet x1 = ei::pabs(ei::ploadu<Packet>(x + i + w));
      a = ei::pmax(a, ei::pand(x0, ei::pcmp_eq(x0, x0)));
      b = ei::pmax(b, ei::pand(x1, ei::pcmp_eq(x1, x1)));
    }
    largest = ei::predux_max(ei::pmax(a, b));
  }
  for (; i < count; ++i) {
    const T magnitude = std::abs(x[i]);
    if (magnitude > largest) largest = magnitude;  // false for NaN
  }
  return largest;
}

/// The largest |k| a block of keys may hold: scanned for T, bfloat16 and int8 (its scales), the
/// format's largest finite value for float16.
template <class T>
T largest_key(ConstRef<T> K) {
  if (K.outerStride() == K.cols()) return largest_magnitude_skipping_nan(K.data(), K.size());
  T largest = T(0);
  for (Index j = 0; j < K.rows(); ++j) {
    largest =
        std::max(largest, largest_magnitude_skipping_nan(K.data() + j * K.outerStride(), K.cols()));
  }
  return largest;
}
template <class T, class Codec>
T largest_key(const StoredBlock<Codec, T>& K) {
  if constexpr (std::is_same_v<Codec, Float16Codec>) {
    return T(65504);
  } else if constexpr (std::is_same_v<Codec, Int8Codec>) {
    T largest = T(0);
    for (Index j = 0; j < K.rows(); ++j) largest = std::max(largest, std::abs(K.scale(j)));
    return T(127) * largest;
  } else {
    std::uint16_t bits = 0;  // |x| orders like the bits below the sign; NaN (above 0x7f80) skipped
    for (Index j = 0; j < K.rows(); ++j) {
      const typename Codec::Bits* row = K.data() + j * K.outerStride();
      for (Index c = 0; c < K.cols(); ++c) {
        const auto magnitude =
            std::uint16_t(Eigen::numext::bit_cast<std::uint16_t>(row[c]) & std::uint16_t(0x7fff));
        if (magnitude <= std::uint16_t(0x7f80)) bits = std::max(bits, magnitude);
      }
    }
    return T(static_cast<float>(Eigen::numext::bit_cast<typename Codec::Bits>(bits)));
  }
}

/// Whether `scale (Q K^T)`, computed as the tiles compute it (the sum first, then the scale),
/// could overflow T where `(scale Q) K^T` would not: |q . k| <= d max|q| max|k|, with half the
/// range kept for the rounding of the partial sums. NaN entries are left out of the maxima (a NaN
/// row stays NaN either way; the other rows still need the guard).
template <class T, class KBlock>
bool product_may_overflow(ConstRef<T> Q, const KBlock& K, T scale) {
  if (Q.size() == 0 || K.rows() == 0 || !(std::abs(scale) < T(1))) return false;
  using Wide = std::conditional_t<std::is_same_v<T, float>, double, long double>;
  const Wide limit = Wide(std::numeric_limits<T>::max()) / 2;
  const Wide q = Wide(largest_key<T>(Q)) * Wide(Q.cols());
  if (!(q * Wide(std::numeric_limits<T>::max()) > limit)) return false;  // no key can overflow it
  return q * Wide(largest_key<T>(K)) > limit;
}

/// Calls `run(Q, rule)` with the scale applied to the queries first when the tiles' product
/// could overflow (`product_may_overflow`): the materialised path's order, `(scale Q) K^T`, for
/// the price of a copy of Q in the rare calls that need it.
template <class T, class KBlock, class Run>
void with_safe_scale(ConstRef<T> Q, const KBlock& K, const ScoreRule<T>& rule, Run&& run) {
  if (!product_may_overflow<T>(Q, K, rule.scale)) {
    run(Q, rule);
    return;
  }
  const Matrix<T> scaled = rule.scale * Q;
  ScoreRule<T> unit = rule;
  unit.scale = T(1);
  run(ConstRef<T>(scaled), unit);
}

/// The query blocks [0, n) of one head, on this thread: the tiled path of `run_path` (K and V
/// blocks of T or `StoredBlock`s).
template <class T, class KBlock, class VBlock, class Variant = NoVariant>
void flash_blocks(ConstRef<T> Q, const KBlock& K, const VBlock& V, const ScoreRule<T>& rule,
                  const FlashTiles& tiles, FlashScratch<T>& scratch, Eigen::Ref<Matrix<T>> O,
                  T* lse, const BoundVariant<Variant>& variant = {}) {
  with_safe_scale<T>(Q, K, rule, [&](ConstRef<T> Q_s, const ScoreRule<T>& rule_s) {
    const PackedKeys<T> keys = pack_for_scores<T>(Q_s, K, V, rule_s);
    for (Index i0 = 0; i0 < Q_s.rows(); i0 += tiles.query_rows) {
      flash_block<T>(Q_s, K, V, keys, rule_s, tiles, i0,
                     std::min(tiles.query_rows, Q_s.rows() - i0), scratch, O, lse, variant);
    }
  });
}

/// The tiled kernel over all query blocks, in parallel when OpenMP is on: each thread packs K for
/// itself, into its own buffers, before its first block; then each block is computed by one
/// thread in a fixed order, so the result does not depend on the thread count. The blocks are
/// handed out last first: with a causal mask the last ones see the most keys, and the short ones
/// then fill the threads' ends. K and V are blocks of T or `StoredBlock`s.
///
/// Why a copy per thread: one copy packed by the calling thread and read by the team had to be
/// taken back from the other threads' caches, line by line, at every call. A copy packed by each
/// thread for itself costs one packing per thread and no such transfer (see docs/benchmarks.md).
template <class T, class KBlock, class VBlock, class Variant = NoVariant>
void flash_kernel_on(ConstRef<T> Q, const KBlock& K, const VBlock& V, const ScoreRule<T>& rule,
                     const FlashTiles& tiles, Eigen::Ref<Matrix<T>> O, T* lse,
                     const BoundVariant<Variant>& variant = {}) {
  const Index n = Q.rows();
  if (n == 0) return;
  const Index blocks = (n + tiles.query_rows - 1) / tiles.query_rows;
  const double flops = attention_flops(n, K.rows(), K.cols(), V.cols());
  with_safe_scale<T>(Q, K, rule, [&](ConstRef<T> Q_s, const ScoreRule<T>& rule_s) {
    parallel_for<FlashScratch<T>>(blocks, flops, [&](Index b, FlashScratch<T>& scratch) {
      if (!scratch.keys) scratch.keys = pack_for_scores<T>(Q_s, K, V, rule_s);
      const Index i0 = (blocks - 1 - b) * tiles.query_rows;
      flash_block<T>(Q_s, K, V, *scratch.keys, rule_s, tiles, i0,
                     std::min(tiles.query_rows, n - i0), scratch, O, lse, variant);
    });
  });
}

/// `flash_kernel_on` over keys and values of T.
template <class T>
void flash_kernel(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, const ScoreRule<T>& rule,
                  const FlashTiles& tiles, Eigen::Ref<Matrix<T>> O, T* lse) {
  flash_kernel_on<T>(Q, K, V, rule, tiles, O, lse);
}

/// The checking mode (`Checked`): every tile the tiled kernel will classify for the call, in its
/// order, checked against the variant's mask (a superset: tiles the rule's masks skip too).
template <class T, class Variant>
void check_kernel_tiles(const ScoreRule<T>& rule, const FlashTiles& tiles,
                        const BoundVariant<Variant>& variant) {
  if constexpr (is_checked<Variant>::value && variant_masks_v<Variant>) {
    constexpr Index w = ScoreTile<T>::cols;
    const Index tile_cols = whole_panels<T>(tiles.key_cols);
    for (Index i0 = 0; i0 < rule.n; i0 += tiles.query_rows) {
      const Index rows = std::min(tiles.query_rows, rule.n - i0);
      const KeyRange range = rule.keys(i0, rows);
      for (Index j0 = range.begin / w * w; j0 < range.end; j0 += tile_cols) {
        const Index cols = std::min(tile_cols, range.end - j0);
        check_tile(*variant.variant, rule_tile(variant, rule, i0, rows, j0, cols));
      }
    }
  } else {
    static_cast<void>(rule);
    static_cast<void>(tiles);
    static_cast<void>(variant);
  }
}

/// Tile sizes (`FlashTiles`, `BackwardTiles`) must be at least 1.
template <class Tiles>
void require_tiles(const char* function, const Tiles& tiles) {
  if (tiles.query_rows < 1 || tiles.key_cols < 1) {
    fail(function, "tile sizes must be at least 1, got ", tiles.query_rows, " x ", tiles.key_cols);
  }
}

}  // namespace detail

/// Attention by tiles with an online softmax (FlashAttention's algorithm on the CPU), into caller
/// storage: the same result as `scaled_dot_product_attention`, without ever forming the n x m
/// score table.
/// \param Q        n x d_k queries
/// \param K        m x d_k keys: Q's scalar type, or `Eigen::half` / `Eigen::bfloat16` (widened
///                 to Q's type when packed for the score tiles; bfloat16 keys and values of float
///                 queries go through `vdpbf16ps` instead with `StoredArithmetic::Reduced`)
/// \param V        m x d_v values, of K's scalar type (a stored format is widened tile by tile)
/// \param options  every `AttentionOptions` field; tiles entirely outside the rows' key range
///                 (causal, windows, query offset) are never computed
/// \param out      resized to n x d_v (no allocation when it already has that shape)
/// \param tiles    tile sizes (query rows x key columns)
/// \throws shape_error on mismatched shapes or invalid options.
/// \note Extra memory O((tile rows + tile cols) (d_k + d_v)) per thread; no n x m table. Agrees
///       with the materialised path to float rounding (a different summation order).
template <class DQ, class DK, class DV>
void flash_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                     const Eigen::MatrixBase<DV>& V,
                     const AttentionOptions<typename DQ::Scalar>& options,
                     Matrix<typename DQ::Scalar>& out, const FlashTiles& tiles = {}) {
  using T = typename DQ::Scalar;
  detail::check_attention_kv("flash_attention", Q, K, V, options);
  detail::require_tiles("flash_attention", tiles);
  out.resize(Q.rows(), V.cols());
  const detail::ScoreRule<T> rule = detail::make_rule(options, Q.rows(), K.rows(), Q.cols());
  detail::with_kv_blocks<T>(K, V, [&](const auto& K_b, const auto& V_b) {
    detail::flash_kernel_on<T>(Q, detail::kernel_block<T>(K_b), detail::kernel_block<T>(V_b), rule,
                               tiles, out, nullptr);
  });
}

/// `flash_attention` returning its n x d_v result (see the overload writing into caller storage).
/// \param Q        n x d_k queries
/// \param K        m x d_k keys: Q's scalar type, or `Eigen::half` / `Eigen::bfloat16`
/// \param V        m x d_v values, of K's scalar type
/// \param options  every `AttentionOptions` field
/// \param tiles    tile sizes (query rows x key columns)
/// \returns n x d_v
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> flash_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const AttentionOptions<typename DQ::Scalar>& options = {}, const FlashTiles& tiles = {}) {
  Matrix<typename DQ::Scalar> out;
  flash_attention(Q, K, V, options, out, tiles);
  return out;
}

/// `flash_attention` that also returns each row's log-sum-exp of its (masked) logits,
/// `lse_i = log(sum_j exp(s_ij))`, the sink's `exp(sink)` included when set (so a row that may
/// attend nothing has `-inf`, or the sink logit itself with a sink): what gradients and the
/// merging of partial results need.
/// \param Q            n x d_k queries
/// \param K            m x d_k keys: Q's scalar type, or `Eigen::half` / `Eigen::bfloat16`
/// \param V            m x d_v values, of K's scalar type
/// \param options      every `AttentionOptions` field
/// \param log_sum_exp  resized to n
/// \param tiles        tile sizes (query rows x key columns)
/// \returns n x d_v
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> flash_attention(const Eigen::MatrixBase<DQ>& Q,
                                            const Eigen::MatrixBase<DK>& K,
                                            const Eigen::MatrixBase<DV>& V,
                                            const AttentionOptions<typename DQ::Scalar>& options,
                                            Vector<typename DQ::Scalar>& log_sum_exp,
                                            const FlashTiles& tiles = {}) {
  using T = typename DQ::Scalar;
  detail::check_attention_kv("flash_attention", Q, K, V, options);
  detail::require_tiles("flash_attention", tiles);
  Matrix<T> O(Q.rows(), V.cols());
  log_sum_exp.resize(Q.rows());
  const detail::ScoreRule<T> rule = detail::make_rule(options, Q.rows(), K.rows(), Q.cols());
  detail::with_kv_blocks<T>(K, V, [&](const auto& K_b, const auto& V_b) {
    detail::flash_kernel_on<T>(Q, detail::kernel_block<T>(K_b), detail::kernel_block<T>(V_b), rule,
                               tiles, O, log_sum_exp.data());
  });
  return O;
}

/// `flash_attention` with a variant (variant.hpp, docs/variants.md), into caller storage: its
/// score modification of each scaled score, before the options' softcap, bias and ALiBi, and its
/// mask beside the options' masks. Tiles the variant calls Empty are skipped, Full ones run
/// without its mask, and only Partial ones evaluate it entry by entry. `ScoreAt::batch`, `head`
/// and `kv_head` are 0; query i stands at position `i + shift` (the options' query offset), key j
/// at position j.
/// \param Q        n x d_k queries
/// \param K        m x d_k keys: Q's scalar type, or `Eigen::half` / `Eigen::bfloat16`
/// \param V        m x d_v values, of K's scalar type
/// \param variant  a variant (`is_variant_v`), checked by `check_variant`; `checked(variant)`
///                 checks its tile classifications first
/// \param options  every `AttentionOptions` field
/// \param out      resized to n x d_v (no allocation when it already has that shape)
/// \param tiles    tile sizes (query rows x key columns)
template <class DQ, class DK, class DV, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
void flash_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                     const Eigen::MatrixBase<DV>& V, const Variant& variant,
                     const AttentionOptions<typename DQ::Scalar>& options,
                     Matrix<typename DQ::Scalar>& out, const FlashTiles& tiles = {}) {
  using T = typename DQ::Scalar;
  check_variant<Variant, T>();
  detail::check_attention_kv("flash_attention", Q, K, V, options);
  detail::require_tiles("flash_attention", tiles);
  out.resize(Q.rows(), V.cols());
  const detail::ScoreRule<T> rule = detail::make_rule(options, Q.rows(), K.rows(), Q.cols());
  detail::require_variant_positions("flash_attention", rule.q_position, rule.n, 0, rule.m);
  const detail::BoundVariant<Variant> bound{&variant};
  detail::check_kernel_tiles<T>(rule, tiles, bound);
  detail::with_kv_blocks<T>(K, V, [&](const auto& K_b, const auto& V_b) {
    detail::flash_kernel_on<T>(Q, detail::kernel_block<T>(K_b), detail::kernel_block<T>(V_b), rule,
                               tiles, out, nullptr, bound);
  });
}

/// `flash_attention` with a variant, returning its n x d_v result (see the overload writing into
/// caller storage).
/// \param Q        n x d_k queries
/// \param K        m x d_k keys: Q's scalar type, or `Eigen::half` / `Eigen::bfloat16`
/// \param V        m x d_v values, of K's scalar type
/// \param variant  a variant (`is_variant_v`)
/// \param options  every `AttentionOptions` field
/// \param tiles    tile sizes (query rows x key columns)
/// \returns n x d_v
template <class DQ, class DK, class DV, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
Matrix<typename DQ::Scalar> flash_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Variant& variant, const AttentionOptions<typename DQ::Scalar>& options = {},
    const FlashTiles& tiles = {}) {
  Matrix<typename DQ::Scalar> out;
  flash_attention(Q, K, V, variant, options, out, tiles);
  return out;
}

/// `flash_attention` with a variant that also returns each row's log-sum-exp (see the overload
/// above and the one without a variant): `-inf` for a row that may attend nothing.
/// \param Q            n x d_k queries
/// \param K            m x d_k keys: Q's scalar type, or `Eigen::half` / `Eigen::bfloat16`
/// \param V            m x d_v values, of K's scalar type
/// \param variant      a variant (`is_variant_v`), checked by `check_variant`
/// \param options      every `AttentionOptions` field
/// \param log_sum_exp  resized to n
/// \param tiles        tile sizes (query rows x key columns)
/// \returns n x d_v
template <class DQ, class DK, class DV, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
Matrix<typename DQ::Scalar> flash_attention(const Eigen::MatrixBase<DQ>& Q,
                                            const Eigen::MatrixBase<DK>& K,
                                            const Eigen::MatrixBase<DV>& V, const Variant& variant,
                                            const AttentionOptions<typename DQ::Scalar>& options,
                                            Vector<typename DQ::Scalar>& log_sum_exp,
                                            const FlashTiles& tiles = {}) {
  using T = typename DQ::Scalar;
  check_variant<Variant, T>();
  detail::check_attention_kv("flash_attention", Q, K, V, options);
  detail::require_tiles("flash_attention", tiles);
  Matrix<T> O(Q.rows(), V.cols());
  log_sum_exp.resize(Q.rows());
  const detail::ScoreRule<T> rule = detail::make_rule(options, Q.rows(), K.rows(), Q.cols());
  detail::require_variant_positions("flash_attention", rule.q_position, rule.n, 0, rule.m);
  const detail::BoundVariant<Variant> bound{&variant};
  detail::check_kernel_tiles<T>(rule, tiles, bound);
  detail::with_kv_blocks<T>(K, V, [&](const auto& K_b, const auto& V_b) {
    detail::flash_kernel_on<T>(Q, detail::kernel_block<T>(K_b), detail::kernel_block<T>(V_b), rule,
                               tiles, O, log_sum_exp.data(), bound);
  });
  return O;
}

/// Options types that extend `AttentionOptions` (`MultiHeadOptions`) are refused at compile time
/// rather than cut down to it.
template <class DQ, class DK, class DV, class Options, class... Rest,
          detail::if_extended_options<Options, typename DQ::Scalar> = 0>
void flash_attention(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                     const Eigen::MatrixBase<DV>&, const Options&, Rest&&...) = delete;

}  // namespace attn
