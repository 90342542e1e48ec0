#pragma once
/// \file detail/backward_kernels.hpp
/// The kernels of `attention_backward`: one tile step (P and dS of a block of queries against a
/// block of keys, recomputed from the forward's log-sum-exp by the one score rule), the
/// materialised backward (small problems: the n x m tables P and dS, then whole products), the
/// tiled backward (FlashAttention-2's: the keys in blocks, each block's dK and dV accumulated by
/// one thread over every query block that sees it; never an n x m table), and their naive twin,
/// entry by entry, which recomputes every gradient row that came out not finite (so a forbidden
/// key or query never reaches a gradient through 0 * NaN in a tile product).
///
/// Determinism: every output row is accumulated by one thread in a fixed order. dK and dV rows
/// belong to the task of their key block. dQ takes a contribution from every key block: the key
/// blocks are grouped into at most `backward_max_parts` parts (a number fixed by m and the tiles,
/// never by the thread count), each part accumulates its own partial dQ, and the partials are
/// summed in part order. The result is then the same bits for any number of threads.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../flash.hpp"
#include "../softmax.hpp"
#include "../threads.hpp"
#include "../types.hpp"
#include "paths.hpp"
#include "score_rule.hpp"
#include "value_tiles.hpp"

namespace attn {
namespace detail {

/// The most parts the tiled backward splits the keys into (each part keeps an n x d_k partial dQ).
inline constexpr Index backward_max_parts = 16;

/// The backward runs where the forward would: tiled beyond the crossover, materialised below it
/// (one query included: its tables are 1 x m).
template <class T>
Path backward_path(const ScoreRule<T>& rule, Index d_k, Index d_v) {
  return choose_path(rule, d_k, d_v, false) == Path::Tiled ? Path::Tiled : Path::Materialised;
}

/// The forward on `path`, keeping the output O (n x d_v) and each row's log-sum-exp (n). With a
/// variant, the tiled kernel on either path (the one that takes variants).
template <class T, class Variant = NoVariant>
void forward_for_backward(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, const ScoreRule<T>& rule,
                          Path path, Eigen::Ref<Matrix<T>> O, Vector<T>& lse,
                          const BoundVariant<Variant>& variant = {}) {
  lse.resize(Q.rows());
  if (path == Path::Tiled || is_variant_v<Variant>) {
    flash_kernel_on<T>(Q, K, V, rule, FlashTiles{}, O, lse.data(), variant);
  } else {
    struct ForwardWeights {};  // this thread's n x m table, reused between calls
    materialised_kernel<T>(Q, K, V, rule, thread_buffer<ForwardWeights, Matrix<T>>(), O,
                           lse.data());
  }
}

/// Per-thread working memory of a tile step.
template <class T>
struct BackwardScratch {
  Matrix<T> P;   ///< rows x cols: logits, then probabilities
  Matrix<T> dS;  ///< rows x cols: dP, then dS
  Matrix<T> G;   ///< rows x cols: the softcap's derivative 1 - tanh^2(s / c)
  Matrix<T> Gv;  ///< rows x cols: a variant's d score / d s
  Matrix<T> S0;  ///< rows x cols: the scaled scores a learnable variant's gradient takes
};

/// The inputs of a backward every step reads: the forward's operands, its log-sum-exp, dO and
/// D = rowsum(dO o O), the rule and the variant (none by default).
template <class T, class Variant = NoVariant>
struct BackwardInputs {
  ConstRef<T> Q;
  ConstRef<T> K;
  ConstRef<T> V;
  ConstRef<T> dO;
  const Vector<T>& lse;
  const Vector<T>& D;
  const ScoreRule<T>& rule;
  BoundVariant<Variant> variant = {};
  /// Where the variant's parameter gradient goes (learnable variants; null: not asked for).
  typename GradientOf<Variant>::type* dparams = nullptr;
};

/// One parameter gradient per task of a parallel loop, each zero (none when not asked for), and
/// their sum in task order into `in.dparams`: the bits do not depend on the thread count.
template <class T, class Variant>
struct TaskGradients {
  using Gradient = typename GradientOf<Variant>::type;
  std::vector<Gradient> tasks;
  TaskGradients(const BackwardInputs<T, Variant>& in, Index count) {
    if constexpr (variant_learns_v<Variant>) {
      if (in.dparams) {
        tasks.assign(static_cast<std::size_t>(count), in.variant.variant->zero_gradient());
      }
    } else {
      static_cast<void>(in);
      static_cast<void>(count);
    }
  }
  Gradient* of(Index task) {
    return tasks.empty() ? nullptr : &tasks[static_cast<std::size_t>(task)];
  }
  void sum_into(const BackwardInputs<T, Variant>& in) const {
    if constexpr (variant_learns_v<Variant>) {
      if (!in.dparams) return;
      *in.dparams = in.variant.variant->zero_gradient();
      for (const Gradient& g : tasks) *in.dparams += g;
    } else {
      static_cast<void>(in);
    }
  }
};

/// K and V packed once per call into the score kernel's panels (for S = Q K^T and dP = dO V^T),
/// or none (the materialised path's Eigen products).
template <class T>
struct PackedOperands {
  PackedKeys<T> K;
  PackedKeys<T> V;
  explicit operator bool() const { return K.panels != nullptr; }
};

/// One tile step: for queries [i0, i0 + rows) and keys [j0, j0 + cols), the probabilities
/// P_ij = exp(z_ij - lse_i) into `scratch.P` and the unscaled score gradient dS_ij (dZ_ij through
/// the softcap) into `scratch.dS`, both rows x cols at the start of their rows (row strides
/// `P.outerStride()`, `dS.outerStride()`); dbias (when not null) receives dZ of the tile.
/// With `packed`, j0 is on a register panel and the products run in the score kernel's register
/// tiles (the buffers are then padded to whole panels); without, in Eigen's GEMM.
///
/// Passes:
///   1. s = scale Q_i K_j^T; a variant's score v(s) with Gv = v'(s); softcap t = c tanh(s / c)
///      with G = 1 - (t / c)^2; the score rule's tables and key ranges where they change anything
///      and the variant's mask (forbidden entries -> -inf).
///   2. P = exp(z - lse_i) (exactly 0 where forbidden; a row with lse = -inf sees nothing: zeros).
///   3. dP = dO_i V_j^T; dZ = P o (dP - D_i), exactly 0 where P is 0 (no 0 * NaN);
///      dS = dZ o G o Gv, exactly 0 where dZ is.
/// `kind` is the variant's classification of the tile (`classify_rule_tile`; Full without a
/// mask): the mask is evaluated entry by entry unless it is Full.
template <class T, class Variant = NoVariant>
void backward_tile(const BackwardInputs<T, Variant>& in, const PackedOperands<T>& packed, Index i0,
                   Index rows, Index j0, Index cols, TileKind kind, BackwardScratch<T>& scratch,
                   T* dbias, Index dbias_stride,
                   typename GradientOf<Variant>::type* dparams = nullptr) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  using Tile = Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>;
  const ScoreRule<T>& rule = in.rule;
  const Index width = packed ? whole_panels<T>(cols) : cols;
  if (scratch.P.rows() < rows || scratch.P.cols() < width) {
    scratch.P.resize(std::max(rows, scratch.P.rows()), std::max(width, scratch.P.cols()));
    scratch.dS.resize(scratch.P.rows(), scratch.P.cols());
  }
  Tile P(scratch.P.data(), rows, cols, Eigen::OuterStride<>(scratch.P.outerStride()));
  Tile dS(scratch.dS.data(), rows, cols, Eigen::OuterStride<>(scratch.dS.outerStride()));
  const auto products = [&](ConstRef<T> A, const PackedKeys<T>& B_packed, ConstRef<T> B, T scale,
                            Tile& out) {
    if (packed) {
      constexpr Index w = ScoreTile<T>::cols;
      for (Index jj = 0; jj < cols; jj += w) {
        score_panel<T>(A.data() + i0 * A.outerStride(), A.outerStride(), rows,
                       B_packed.panel(j0 + jj), w, A.cols(), scale, out.data() + jj,
                       out.outerStride(), w, false);
      }
    } else {
      out.noalias() = (scale * A.middleRows(i0, rows)) * B.middleRows(j0, cols).transpose();
    }
  };

  // 1. Logits by the variant's score and the score rule.
  products(in.Q, packed.K, in.K, rule.scale, P);
  if constexpr (variant_learns_v<Variant>) {
    if (dparams) scratch.S0 = P;
  }
  if constexpr (variant_scores_v<Variant>) {
    scratch.Gv.resize(rows, cols);
    for (Index r = 0; r < rows; ++r) {
      const Index query = rule.q_position + i0 + r;
      for (Index c = 0; c < cols; ++c) {
        scratch.Gv(r, c) =
            in.variant.variant->dscore(P(r, c), in.variant.at(query, rule.k_position + j0 + c));
      }
    }
    variant_scores<T>(in.variant, rule, P.data(), P.outerStride(), i0, rows, j0, cols);
  }
  const bool sloped = rule.has_slope();  // G = d z / d (the variant's score), through the rule
  if (sloped) scratch.G.resize(rows, cols);
  rule.apply_uniform(P, sloped ? &scratch.G : nullptr);
  const KeyRange first_row = rule.keys(i0);
  const KeyRange last_row = rule.keys(i0 + rows - 1);
  const bool inside = last_row.begin <= j0 && first_row.end >= j0 + cols;
  if (rule.has_per_entry() || !inside) rule.apply_per_entry(P, i0, j0);
  if constexpr (variant_masks_v<Variant>) {
    if (kind != TileKind::Full) {
      variant_mask_tile<T>(in.variant, rule, P.data(), P.outerStride(), i0, rows, j0, cols);
    }
  }

  // 2. Probabilities from the log-sum-exp.
  for (Index r = 0; r < rows; ++r) {
    const T lse_i = in.lse(i0 + r);
    if (lse_i == neg_inf) {
      P.row(r).setZero();
    } else {
      exp_shifted_inplace<T>(P.row(r), lse_i);
    }
  }

  // 3. dP, dZ, dS.
  products(in.dO, packed.V, in.V, T(1), dS);
  for (Index r = 0; r < rows; ++r) {
    const T D_i = in.D(i0 + r);
    T* ds = dS.data() + r * dS.outerStride();
    const T* p = P.data() + r * P.outerStride();
    for (Index c = 0; c < cols; ++c) ds[c] = p[c] == T(0) ? T(0) : p[c] * (ds[c] - D_i);
    if (dbias) std::copy(ds, ds + cols, dbias + (i0 + r) * dbias_stride + j0);
  }
  if (sloped) dS.array() *= scratch.G.array();
  if constexpr (variant_learns_v<Variant>) {
    if (dparams) {  // dS is dL / d(the variant's score) here
      for (Index r = 0; r < rows; ++r) {
        const Index query = rule.q_position + i0 + r;
        const T* ds = dS.data() + r * dS.outerStride();
        for (Index c = 0; c < cols; ++c) {
          if (ds[c] == T(0)) continue;
          in.variant.variant->gradient(*dparams, scratch.S0(r, c), ds[c],
                                       in.variant.at(query, rule.k_position + j0 + c));
        }
      }
    }
  } else {
    static_cast<void>(dparams);
  }
  if constexpr (variant_scores_v<Variant>) {
    for (Index r = 0; r < rows; ++r) {
      T* ds = dS.data() + r * dS.outerStride();
      for (Index c = 0; c < cols; ++c) {
        if (ds[c] != T(0)) ds[c] *= scratch.Gv(r, c);
      }
    }
  }
}

/// The naive twin of one entry: whether query i may attend key j, and then p_ij and the unscaled
/// dS_ij, from the score rule's `logit` (and the variant's) and dot products.
template <class T, class Variant>
bool exact_entry(const BackwardInputs<T, Variant>& in, Index i, Index j, T& p, T& ds) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const ScoreRule<T>& rule = in.rule;
  const T scaled = rule.scale * in.Q.row(i).dot(in.K.row(j));
  const T z = variant_logit(rule, in.variant, scaled, i, j);
  if (z == neg_inf) return false;
  p = in.lse(i) == neg_inf ? T(0) : std::exp(z - in.lse(i));
  const T dz = p == T(0) ? T(0) : p * (in.dO.row(i).dot(in.V.row(j)) - in.D(i));
  T modified = scaled;  // the rule's input: the variant's score of the scaled score
  T dvariant = T(1);
  if constexpr (variant_scores_v<Variant>) {
    const ScoreAt at = in.variant.at(rule.q_position + i, rule.k_position + j);
    modified = in.variant.variant->score(scaled, at);
    dvariant = in.variant.variant->dscore(scaled, at);
  }
  ds = dz;
  if (rule.has_slope()) ds *= rule.slope(modified, i, j);
  if (ds != T(0)) ds *= dvariant;
  return true;
}

/// Recomputes, entry by entry and skipping every forbidden pair, each row of dQ, dK and dV that is
/// not finite. A NaN the row really uses stays NaN.
template <class T, class Variant>
void repair_gradients(const BackwardInputs<T, Variant>& in, AttentionGrads<T>& grads) {
  const Index n = in.Q.rows();
  const Index m = in.K.rows();
  const T scale = in.rule.scale;
  T p = T(0);
  T ds = T(0);
  if (!std::isfinite(grads.dQ.sum())) {
    for (Index i = 0; i < n; ++i) {
      if (std::isfinite(grads.dQ.row(i).sum())) continue;
      grads.dQ.row(i).setZero();
      for (Index j = 0; j < m; ++j) {
        if (exact_entry(in, i, j, p, ds) && ds != T(0))
          grads.dQ.row(i) += (scale * ds) * in.K.row(j);
      }
    }
  }
  if (std::isfinite(grads.dK.sum()) && std::isfinite(grads.dV.sum())) return;
  for (Index j = 0; j < m; ++j) {
    const bool dk_bad = !std::isfinite(grads.dK.row(j).sum());
    const bool dv_bad = !std::isfinite(grads.dV.row(j).sum());
    if (!dk_bad && !dv_bad) continue;
    if (dk_bad) grads.dK.row(j).setZero();
    if (dv_bad) grads.dV.row(j).setZero();
    for (Index i = 0; i < n; ++i) {
      if (!exact_entry(in, i, j, p, ds)) continue;
      if (dk_bad && ds != T(0)) grads.dK.row(j) += (scale * ds) * in.Q.row(i);
      if (dv_bad && p != T(0)) grads.dV.row(j) += p * in.dO.row(i);
    }
  }
}

/// The materialised backward: the n x m tables P and dS in blocks of query rows (in parallel),
/// dQ of each block at once, then dV = P^T dO and dK = scale dS^T Q by blocks of key rows (in
/// parallel). Shape contract as `backward_kernel`.
template <class T, class Variant>
void materialised_backward(const BackwardInputs<T, Variant>& in, Matrix<T>& P, Matrix<T>& dS,
                           AttentionGrads<T>& grads) {
  const Index n = in.Q.rows();
  const Index m = in.K.rows();
  constexpr Index block = 64;
  P.resize(n, m);
  dS.resize(n, m);
  T* dbias = grads.dbias.size() ? grads.dbias.data() : nullptr;
  const Index d_k = in.Q.cols();
  const Index d_v = in.V.cols();
  // S = Q K^T, dP = dO V^T and dQ = dS K; then dV = P^T dO and dK = dS^T Q.
  const double rows_flops = 2.0 * double(n) * double(m) * double(2 * d_k + d_v);
  const Index blocks = (n + block - 1) / block;
  TaskGradients<T, Variant> dparams(in, blocks);
  parallel_for<BackwardScratch<T>>(blocks, rows_flops, [&](Index b, BackwardScratch<T>& s) {
    const Index i0 = b * block;
    const Index rows = std::min(block, n - i0);
    backward_tile<T>(in, PackedOperands<T>{}, i0, rows, 0, m,
                     classify_rule_tile(in.variant, in.rule, i0, rows, 0, m), s, dbias, m,
                     dparams.of(b));
    P.middleRows(i0, rows) = s.P.topLeftCorner(rows, m);
    dS.middleRows(i0, rows) = s.dS.topLeftCorner(rows, m);
    grads.dQ.middleRows(i0, rows).noalias() = (in.rule.scale * dS.middleRows(i0, rows)) * in.K;
  });
  dparams.sum_into(in);
  parallel_for<int>((m + block - 1) / block, attention_flops(n, m, d_k, d_v), [&](Index b, int&) {
    const Index j0 = b * block;
    const Index cols = std::min(block, m - j0);
    grads.dV.middleRows(j0, cols).noalias() = P.middleCols(j0, cols).transpose() * in.dO;
    grads.dK.middleRows(j0, cols).noalias() =
        (in.rule.scale * dS.middleCols(j0, cols).transpose()) * in.Q;
  });
}

/// The key blocks of the tiled backward and their grouping into parts (fixed by m and the tiles).
struct KeyParts {
  Index key_cols = 0;  ///< keys per block
  Index blocks = 0;    ///< key blocks
  Index per_part = 0;  ///< blocks per part
  Index parts = 0;     ///< parts (<= backward_max_parts)
};

inline KeyParts key_parts(Index m, Index key_cols) {
  KeyParts k;
  k.key_cols = key_cols;
  k.blocks = (m + key_cols - 1) / key_cols;
  k.per_part = std::max<Index>(1, (k.blocks + backward_max_parts - 1) / backward_max_parts);
  k.parts = (k.blocks + k.per_part - 1) / k.per_part;
  return k;
}

/// The tiled backward (FlashAttention-2's, Dao 2023, Algorithm 2). Each part (a task of the
/// parallel loop) takes its key blocks one after the other; for a key block K_j, V_j it visits
/// every query block whose key range meets it (the others, causal or windowed, are skipped) and
/// accumulates, in the value kernel's register tiles, dV_j += P^T dO_i, dK_j += dS^T Q_i (both
/// reading P and dS transposed in place) and its own partial dQ_i += dS K_j. Finally dK *= scale
/// and dQ = scale sum_p partial_p, in part order. Shape contract as `backward_kernel`;
/// `packed_K` and `packed_V` have room for K and V in panels (`whole_panels(m) d_k` and
/// `whole_panels(m) d_v`), which each part fills with its own keys' panels, on the thread that
/// reads them; key blocks are whole panels.
template <class T, class Variant>
void tiled_backward(const BackwardInputs<T, Variant>& in, T* packed_K, T* packed_V,
                    const BackwardTiles& tiles, std::vector<Matrix<T>>& partial,
                    AttentionGrads<T>& grads) {
  const Index n = in.Q.rows();
  const Index m = in.K.rows();
  const Index d_k = in.Q.cols();
  const Index d_v = in.V.cols();
  const PackedOperands<T> packed{{packed_K, d_k}, {packed_V, d_v}};
  const ScoreRule<T>& rule = in.rule;
  const KeyParts kp = key_parts(m, whole_panels<T>(tiles.key_cols));
  partial.resize(static_cast<std::size_t>(kp.parts));
  // The query rows [begin, end) each part touches (causal and window ranges leave parts of dQ
  // untouched: they are neither zeroed nor summed).
  std::vector<KeyRange> touched(static_cast<std::size_t>(kp.parts), KeyRange{n, 0});
  T* dbias = grads.dbias.size() ? grads.dbias.data() : nullptr;
  // The block mask of the call: each tile's kind (Empty where the rule's ranges and tables or the
  // variant rule it out), found once, by the part that owns the tile's keys, and read twice.
  const Index query_tiles = (n + tiles.query_rows - 1) / tiles.query_rows;
  std::vector<TileKind> kinds(static_cast<std::size_t>(kp.blocks * query_tiles));
  const auto kind_at = [&](Index blk, Index i0) -> TileKind& {
    return kinds[static_cast<std::size_t>(blk * query_tiles + i0 / tiles.query_rows)];
  };
  const auto classify = [&](Index i0, Index rows, Index j0, Index cols) {
    const KeyRange range = rule.keys(i0, rows);
    if (range.end <= j0 || range.begin >= j0 + cols || rule.masked_out(i0, rows, j0, cols)) {
      return TileKind::Empty;
    }
    return classify_rule_tile(in.variant, in.rule, i0, rows, j0, cols);
  };
  // The five products of the backward: 2 n m (3 d_k + 2 d_v) flops.
  const double flops = 2.0 * double(n) * double(m) * double(3 * d_k + 2 * d_v);
  TaskGradients<T, Variant> dparams(in, kp.parts);
  parallel_for<BackwardScratch<T>>(kp.parts, flops, [&](Index part, BackwardScratch<T>& s) {
    const Index first_block = part * kp.per_part;
    const Index last_block = std::min(kp.blocks, first_block + kp.per_part);
    // The part's keys and values into their panels, by the thread that reads them (packed by the
    // calling thread, they were taken from its cache line by line at every call).
    const Index end_key = std::min(m, last_block * kp.key_cols);
    for (Index p = first_block * kp.key_cols / ScoreTile<T>::cols; p < panel_count<T>(end_key);
         ++p) {
      pack_panel<T>(in.K, p, packed_K);
      pack_panel<T>(in.V, p, packed_V);
    }
    KeyRange& rows_touched = touched[static_cast<std::size_t>(part)];
    for (Index blk = first_block; blk < last_block; ++blk) {
      const Index j0 = blk * kp.key_cols;
      const Index cols = std::min(kp.key_cols, m - j0);
      for (Index i0 = 0; i0 < n; i0 += tiles.query_rows) {
        const Index rows = std::min(tiles.query_rows, n - i0);
        TileKind& kind = kind_at(blk, i0);
        kind = classify(i0, rows, j0, cols);
        if (kind == TileKind::Empty) continue;
        rows_touched.begin = std::min(rows_touched.begin, i0);
        rows_touched.end = std::max(rows_touched.end, i0 + rows);
      }
    }
    Matrix<T>& dQ_p = partial[static_cast<std::size_t>(part)];
    dQ_p.resize(n, d_k);
    if (rows_touched.begin < rows_touched.end) {
      dQ_p.middleRows(rows_touched.begin, rows_touched.end - rows_touched.begin).setZero();
    }
    for (Index blk = first_block; blk < last_block; ++blk) {
      const Index j0 = blk * kp.key_cols;
      const Index cols = std::min(kp.key_cols, m - j0);
      T* dK_j = grads.dK.data() + j0 * d_k;
      T* dV_j = grads.dV.data() + j0 * d_v;
      grads.dK.middleRows(j0, cols).setZero();
      grads.dV.middleRows(j0, cols).setZero();
      for (Index i0 = 0; i0 < n; i0 += tiles.query_rows) {
        const Index rows = std::min(tiles.query_rows, n - i0);
        const TileKind kind = kind_at(blk, i0);
        if (kind == TileKind::Empty) continue;
        backward_tile<T>(in, packed, i0, rows, j0, cols, kind, s, dbias, m, dparams.of(part));
        const Index p_stride = s.P.outerStride();
        const Index ds_stride = s.dS.outerStride();
        value_tiles<T, true>(cols, rows, d_v, s.P.data(), p_stride,
                             in.dO.data() + i0 * in.dO.outerStride(), in.dO.outerStride(), nullptr,
                             dV_j, d_v);
        value_tiles<T, true>(cols, rows, d_k, s.dS.data(), ds_stride,
                             in.Q.data() + i0 * in.Q.outerStride(), in.Q.outerStride(), nullptr,
                             dK_j, d_k);
        value_tiles<T>(rows, cols, d_k, s.dS.data(), ds_stride,
                       in.K.data() + j0 * in.K.outerStride(), in.K.outerStride(), nullptr,
                       dQ_p.data() + i0 * d_k, d_k);
      }
      grads.dK.middleRows(j0, cols) *= rule.scale;
    }
  });
  dparams.sum_into(in);
  // The sum of the partial dQ: n d_k additions per part, on the calling thread below `team_flops`
  // (a team for the sum alone cost the backward more than it saved; see docs/benchmarks.md).
  constexpr Index block = 64;
  const double sum_flops = double(n) * double(d_k) * double(kp.parts);
  parallel_for<int>((n + block - 1) / block, sum_flops, [&](Index b, int&) {
    const Index i0 = b * block;
    const Index i1 = std::min(n, i0 + block);
    auto dQ_b = grads.dQ.middleRows(i0, i1 - i0);
    dQ_b.setZero();
    for (std::size_t p = 0; p < partial.size(); ++p) {
      const Index begin = std::max(i0, touched[p].begin);
      const Index end = std::min(i1, touched[p].end);
      if (begin < end) {
        grads.dQ.middleRows(begin, end - begin) += partial[p].middleRows(begin, end - begin);
      }
    }
    dQ_b *= rule.scale;
  });
}

/// Per-thread (calling thread) memory of the backward kept between calls.
template <class T>
struct BackwardBuffers {
  Matrix<T> P, dS;                 ///< the materialised path's n x m tables
  std::vector<Matrix<T>> partial;  ///< the tiled path's partial dQ, one per part
  Vector<T> D;                     ///< rowsum(dO o O)
  Vector<T> packed_K, packed_V;    ///< the tiled path's K and V in register panels
};

/// The backward of one attention call on `path`, from the forward's output O and log-sum-exp.
/// Shape contract: Q n x d_k, K m x d_k, V m x d_v, O and dO n x d_v, lse n; grads resized to dQ
/// n x d_k, dK m x d_k, dV m x d_v, dbias n x m (when the rule has a bias, else empty), dsink.
template <class T, class Variant = NoVariant>
void backward_kernel(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, ConstRef<T> O,
                     const Vector<T>& lse, ConstRef<T> dO, const ScoreRule<T>& rule, Path path,
                     const BackwardTiles& tiles, AttentionGrads<T>& grads,
                     const BoundVariant<Variant>& variant = {},
                     typename GradientOf<Variant>::type* dparams = nullptr) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const Index n = Q.rows();
  const Index m = K.rows();
  BackwardBuffers<T>& store = thread_buffer<BackwardBuffers<T>, BackwardBuffers<T>>();
  grads.dQ.resize(n, Q.cols());
  grads.dK.resize(m, K.cols());
  grads.dV.resize(m, V.cols());
  if (rule.bias) {
    grads.dbias.setZero(n, m);
  } else {
    grads.dbias.resize(0, 0);
  }
  grads.dsink = T(0);
  // D_i = rowsum(dO o O)_i = sum_j P_ij dP_ij (O_i = sum_j P_ij V_j).
  store.D = (dO.array() * O.array()).rowwise().sum();
  const BackwardInputs<T, Variant> in{Q, K, V, dO, lse, store.D, rule, variant, dparams};
  if (n == 0 || m == 0) {
    grads.dQ.setZero();
    grads.dK.setZero();
    grads.dV.setZero();
    TaskGradients<T, Variant>(in, 0).sum_into(in);
  } else if (path == Path::Tiled) {
    store.packed_K.resize(whole_panels<T>(m) * K.cols());
    store.packed_V.resize(whole_panels<T>(m) * V.cols());
    tiled_backward<T>(in, store.packed_K.data(), store.packed_V.data(), tiles, store.partial,
                      grads);
  } else {
    materialised_backward<T>(in, store.P, store.dS, grads);
  }
  repair_gradients<T>(in, grads);
  // The sink s takes weight P_i,sink = exp(s - lse_i) and gives no value (dP_i,sink = 0), so
  // dZ_i,sink = -P_i,sink D_i.
  if (rule.sink) {
    for (Index i = 0; i < n; ++i) {
      if (lse(i) != neg_inf) grads.dsink -= std::exp(*rule.sink - lse(i)) * store.D(i);
    }
  }
}

/// A variant's mask classified once per call on a grid of cells of `row_step` queries x
/// `col_step` keys (n m / 512 kinds; a multiple of both kernels' grids, the forward's 36 x 512 and
/// the backward's 128 x 128), for one binding (batch item and heads). A tile's kind combines the
/// cells it touches: Empty or Full where all of them are, else Partial (always correct, also where
/// a tile cuts a cell).
struct BlockMask {
  static constexpr Index row_step = 4;
  static constexpr Index col_step = 128;
  Index q_position = 0;  ///< position of query 0
  Index k_position = 0;  ///< position of key 0
  Index rows = 0;        ///< cells down
  Index cols = 0;        ///< cells across
  std::vector<TileKind> kinds;

  template <class V>
  BlockMask(const BoundVariant<V>& variant, Index q0, Index n, Index k0, Index m)
      : q_position(q0),
        k_position(k0),
        rows((n + row_step - 1) / row_step),
        cols((m + col_step - 1) / col_step),
        kinds(static_cast<std::size_t>(rows * cols)) {
    parallel_for<int>(rows, double(n) * double(m), [&](Index r, int&) {
      const Index i = r * row_step;
      for (Index c = 0; c < cols; ++c) {
        const Index j = c * col_step;
        kinds[static_cast<std::size_t>(r * cols + c)] = classify_by_mask(
            *variant.variant, variant.tile(q0 + i, q0 + std::min(n, i + row_step), k0 + j,
                                           k0 + std::min(m, j + col_step)));
      }
    });
  }

  /// The kind of the queries at positions [q_begin, q_end) x keys at [k_begin, k_end).
  TileKind of(const PositionRange& queries, const PositionRange& keys) const {
    const Index r0 = (queries.begin - q_position) / row_step;
    const Index r1 = (queries.end - q_position + row_step - 1) / row_step;
    const Index c0 = (keys.begin - k_position) / col_step;
    const Index c1 = (keys.end - k_position + col_step - 1) / col_step;
    const TileKind first = kinds[static_cast<std::size_t>(r0 * cols + c0)];
    if (first == TileKind::Partial) return first;
    for (Index r = r0; r < r1; ++r) {
      for (Index c = c0; c < c1; ++c) {
        if (kinds[static_cast<std::size_t>(r * cols + c)] != first) return TileKind::Partial;
      }
    }
    return first;
  }
};

/// Variant V whose tile classification is read from a `BlockMask` built for one binding; any
/// other binding (never asked by the calls that build one) is classified by the mask.
template <class V>
struct BlockMasked : V {
  const BlockMask* blocks;
  TileAt bound;  ///< the binding (batch item, heads) of `blocks`
  BlockMasked(const V& variant, const BlockMask& block_mask, const BoundVariant<V>& binding)
      : V(variant), blocks(&block_mask), bound(binding.tile(0, 0, 0, 0)) {}
  TileKind tile(const TileAt& at) const {
    if (at.batch != bound.batch || at.head != bound.head || at.kv_head != bound.kv_head) {
      return classify_by_mask(static_cast<const V&>(*this), at);
    }
    return blocks->of(at.queries, at.keys);
  }
};

/// Calls `body(variant)`, or, for a variant that masks but does not classify tiles, `body` with the
/// same variant whose tiles are read from a `BlockMask` of the n queries and m keys of `rule`,
/// classified once for everything `body` runs (a forward and its backward).
template <class T, class Variant, class Body>
void with_block_mask(const ScoreRule<T>& rule, Index n, Index m,
                     const BoundVariant<Variant>& variant, Body&& body) {
  if constexpr (variant_masks_v<Variant> && !variant_tiles_v<Variant> &&
                !is_checked<Variant>::value) {
    if (n > 0 && m > 0) {
      const BlockMask blocks(variant, rule.q_position, n, rule.k_position, m);
      const BlockMasked<Variant> masked(*variant.variant, blocks, variant);
      body(BoundVariant<BlockMasked<Variant>>{&masked, variant.batch, variant.head,
                                              variant.kv_head});
      return;
    }
  }
  body(variant);
}

/// The forward on `path` (its output and log-sum-exp kept), then the backward on the same path,
/// both reading one block mask of a variant without tiles (`with_block_mask`).
template <class T, class Variant = NoVariant>
void forward_and_backward(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, ConstRef<T> dO,
                          const ScoreRule<T>& rule, Path path, const BackwardTiles& tiles,
                          AttentionGrads<T>& grads, const BoundVariant<Variant>& variant = {},
                          typename GradientOf<Variant>::type* dparams = nullptr) {
  Matrix<T> O(Q.rows(), V.cols());
  Vector<T> lse(Q.rows());
  with_block_mask<T>(rule, Q.rows(), K.rows(), variant, [&](const auto& bound) {
    forward_for_backward<T>(Q, K, V, rule, path, O, lse, bound);
    backward_kernel<T>(Q, K, V, O, lse, dO, rule, path, tiles, grads, bound, dparams);
  });
}

}  // namespace detail
}  // namespace attn
