#pragma once
/// \file flash.hpp
/// Tiled attention with an online softmax: the n x m score table is never formed.

#include <algorithm>
#include <cmath>
#include <limits>

#include "detail/exact_rows.hpp"
#include "detail/online_softmax.hpp"
#include "detail/pipeline.hpp"
#include "detail/score_rule.hpp"
#include "threads.hpp"

namespace attn {

/// Tile sizes of `flash_attention` (rows of queries x keys per tile).
struct FlashTiles {
  Index query_rows = 64;
  Index key_cols = 256;
};

namespace detail {

/// Per-thread working memory of the tiled kernel: O(tile (d_v + key_cols)).
template <class T>
struct FlashScratch {
  Matrix<T> q_scaled;      ///< rows x d_k: scale * Q_i
  Matrix<T> s_ij;          ///< rows x cols: logits, then unnormalised probabilities of one tile
  OnlineSoftmax<T> state;  ///< running output, maxima and sums of the block's rows
};

/// One block of query rows [i0, i0 + rows) against every key the rule lets them see.
///
/// Shape contract: Q n x d_k, K m x d_k, V m x d_v; O n x d_v receives rows [i0, i0 + rows);
/// lse (optional) n entries. Keys outside the rows' range (causal, windows) are never visited;
/// key tiles that the masks forbid entirely are skipped.
///
/// Passes (for each key tile j of the block's range):
///   1. s_ij = (scale Q_i) K_j^T, then the score rule on the tile (softcap, bias, ALiBi, masks).
///   2. The online softmax of the tile's rows and o_i' = alpha o_i + p_ij V_j (`OnlineSoftmax`).
/// Finally O_i = o_i / l_i, guarded, and lse_i = m_i + log(l_i); rows that came out not finite are
/// recomputed key by key (`repair_rows`), so a forbidden key's NaN value never reaches them.
template <class T>
void flash_block(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, const ScoreRule<T>& rule,
                 const FlashTiles& tiles, Index i0, Index rows, FlashScratch<T>& scratch,
                 Eigen::Ref<Matrix<T>> O, T* lse) {
  scratch.q_scaled.noalias() = rule.scale * Q.middleRows(i0, rows);
  scratch.state.start(rows, V.cols(), rule.sink);
  const KeyRange keys = rule.keys(i0, rows);
  for (Index j0 = keys.begin; j0 < keys.end; j0 += tiles.key_cols) {
    const Index cols = std::min(tiles.key_cols, keys.end - j0);
    if (rule.masked_out(i0, rows, j0, cols)) continue;

    // 1. Logits of the tile, through the score rule.
    scratch.s_ij.resize(rows, cols);
    scratch.s_ij.noalias() = scratch.q_scaled * K.middleRows(j0, cols).transpose();
    rule.apply(scratch.s_ij, i0, j0);

    // 2. Online softmax and weighted values of the tile.
    scratch.state.step(scratch.s_ij, V.middleRows(j0, cols));
  }
  scratch.state.finish(O.middleRows(i0, rows), lse ? lse + i0 : nullptr);
  repair_rows<T>(Q, K, V, rule, i0, rows, O, lse);
}

/// The tiled kernel over all query blocks, in parallel when OpenMP is on. Each block is computed
/// by one thread in a fixed order, so the result does not depend on the thread count.
template <class T>
void flash_kernel(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, const ScoreRule<T>& rule,
                  const FlashTiles& tiles, Eigen::Ref<Matrix<T>> O, T* lse) {
  const Index n = Q.rows();
  const Index blocks = (n + tiles.query_rows - 1) / tiles.query_rows;
  parallel_for<FlashScratch<T>>(blocks, [&](Index b, FlashScratch<T>& scratch) {
    const Index i0 = b * tiles.query_rows;
    flash_block<T>(Q, K, V, rule, tiles, i0, std::min(tiles.query_rows, n - i0), scratch, O, lse);
  });
}

inline void require_tiles(const char* function, const FlashTiles& tiles) {
  if (tiles.query_rows < 1 || tiles.key_cols < 1) {
    fail(function, "tile sizes must be at least 1, got ", tiles.query_rows, " x ", tiles.key_cols);
  }
}

}  // namespace detail

/// Attention by tiles with an online softmax (FlashAttention's algorithm on the CPU), into caller
/// storage: the same result as `scaled_dot_product_attention`, without ever forming the n x m
/// score table.
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
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
  detail::check_attention("flash_attention", Q, K, V, options);
  detail::require_tiles("flash_attention", tiles);
  out.resize(Q.rows(), V.cols());
  detail::flash_kernel<T>(Q, K, V, detail::make_rule(options, Q.rows(), K.rows(), Q.cols()), tiles,
                          out, nullptr);
}

/// `flash_attention` returning its n x d_v result (see the overload writing into caller storage).
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
/// \param log_sum_exp  resized to n
/// \returns n x d_v
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> flash_attention(const Eigen::MatrixBase<DQ>& Q,
                                            const Eigen::MatrixBase<DK>& K,
                                            const Eigen::MatrixBase<DV>& V,
                                            const AttentionOptions<typename DQ::Scalar>& options,
                                            Vector<typename DQ::Scalar>& log_sum_exp,
                                            const FlashTiles& tiles = {}) {
  using T = typename DQ::Scalar;
  detail::check_attention("flash_attention", Q, K, V, options);
  detail::require_tiles("flash_attention", tiles);
  Matrix<T> O(Q.rows(), V.cols());
  log_sum_exp.resize(Q.rows());
  detail::flash_kernel<T>(Q, K, V, detail::make_rule(options, Q.rows(), K.rows(), Q.cols()), tiles,
                          O, log_sum_exp.data());
  return O;
}

/// Options types that extend `AttentionOptions` (`MultiHeadOptions`) are refused at compile time
/// rather than cut down to it.
template <class DQ, class DK, class DV, class Options, class... Rest,
          detail::if_extended_options<Options, typename DQ::Scalar> = 0>
void flash_attention(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                     const Eigen::MatrixBase<DV>&, const Options&, Rest&&...) = delete;

}  // namespace attn
