#pragma once
/// \file flash.hpp
/// Tiled attention with an online softmax: the n x m score table is never formed.

#include <algorithm>
#include <cmath>
#include <limits>

#include "detail/pipeline.hpp"
#include "softmax.hpp"
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
  Matrix<T> q_scaled;  ///< rows x d_k: scale * Q_i
  Matrix<T> s_ij;      ///< rows x cols: scores, then unnormalised probabilities of one tile
  Matrix<T> o_i;       ///< rows x d_v: running, unnormalised output
  Vector<T> m_i;       ///< running row maxima
  Vector<T> l_i;       ///< running row sums
};

/// One block of query rows [i0, i0 + rows) against every key it may see.
///
/// Shape contract: Q n x d_k, K m x d_k, V m x d_v; O n x d_v receives rows [i0, i0 + rows);
/// lse (optional) n entries. Keys outside the rows' causal/window range are never visited; key
/// tiles that a boolean mask forbids entirely are skipped.
///
/// Passes (for each key tile j of the block's range):
///   1. s_ij = (scale Q_i) K_j^T, then softcap, bias, ALiBi and masks (the pipeline of
///      `attention_kernel`, on the tile).
///   2. Online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax";
///      Rabe & Staats 2021; FlashAttention, Dao et al. 2022). With the running max m and sum l of a
///      row, and the tile's row max m~:
///        m' = max(m, m~),  p_ij = exp(s_ij - m'),
///        l' = exp(m - m') l + sum_j p_ij,
///        o' = exp(m - m') o + sum_j p_ij v_j.
///      Both rescalings multiply by the same exp(m - m') <= 1, so o / l is unchanged by a new max;
///      m starts at -inf (or at the sink logit, with l = exp(sink - sink) = 1), and exp(-inf) = 0.
///   3. o_ij += p_ij V_j (one GEMM per tile).
/// Finally O_i = o / l, guarded: a row that saw no key (l = 0) is zero; lse = m + log(l).
template <class T>
void flash_block(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, const AttentionOptions<T>& options,
                 const FlashTiles& tiles, Index i0, Index rows, FlashScratch<T>& scratch,
                 Eigen::Ref<Matrix<T>> O, Vector<T>* lse) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const Index n = Q.rows();
  const Index m = K.rows();
  const T scale = scale_of(options, Q.cols());

  scratch.q_scaled.noalias() = scale * Q.middleRows(i0, rows);
  scratch.o_i.setZero(rows, V.cols());
  scratch.m_i.setConstant(rows, options.sink ? *options.sink : neg_inf);
  scratch.l_i.setConstant(rows, options.sink ? T(1) : T(0));

  // Keys the block may see: ranges begin and end are non-decreasing in the query index.
  const Index keys_begin = key_range(i0, n, m, options.causal, options.window).begin;
  const Index keys_end = key_range(i0 + rows - 1, n, m, options.causal, options.window).end;
  for (Index j0 = keys_begin; j0 < keys_end; j0 += tiles.key_cols) {
    const Index cols = std::min(tiles.key_cols, keys_end - j0);
    if (options.mask && !options.mask->block(i0, j0, rows, cols).any()) continue;

    // 1. Scores of the tile, through the same pipeline as the materialised path.
    scratch.s_ij.resize(rows, cols);
    scratch.s_ij.noalias() = scratch.q_scaled * K.middleRows(j0, cols).transpose();
    apply_softcap<T>(options, scratch.s_ij);
    apply_bias_and_mask<T>(options, {n, m, i0, j0}, scratch.s_ij);

    // 2. Online softmax, row by row (`online_softmax_step`), rescaling the running output.
    for (Index r = 0; r < rows; ++r) {
      const T alpha = online_softmax_step<T>(scratch.s_ij.row(r), scratch.m_i(r), scratch.l_i(r));
      if (alpha != T(1)) scratch.o_i.row(r) *= alpha;
    }

    // 3. Weighted values of the tile.
    scratch.o_i.noalias() += scratch.s_ij * V.middleRows(j0, cols);
  }

  for (Index r = 0; r < rows; ++r) {
    const T l = scratch.l_i(r);
    O.row(i0 + r) = scratch.o_i.row(r) * (l > T(0) ? T(1) / l : T(0));
    if (lse) (*lse)(i0 + r) = l > T(0) ? scratch.m_i(r) + std::log(l) : neg_inf;
  }
}

/// The tiled kernel over all query blocks, in parallel when OpenMP is on. Each block is computed
/// by one thread in a fixed order, so the result does not depend on the thread count.
template <class T>
void flash_kernel(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, const AttentionOptions<T>& options,
                  const FlashTiles& tiles, Eigen::Ref<Matrix<T>> O, Vector<T>* lse) {
  const Index n = Q.rows();
  if (lse) lse->resize(n);
  const Index blocks = (n + tiles.query_rows - 1) / tiles.query_rows;
  parallel_for<FlashScratch<T>>(blocks, [&](Index b, FlashScratch<T>& scratch) {
    const Index i0 = b * tiles.query_rows;
    flash_block<T>(Q, K, V, options, tiles, i0, std::min(tiles.query_rows, n - i0), scratch, O,
                   lse);
  });
}

/// Whether `scaled_dot_product_attention` takes the tiled path: when the n x m table would no
/// longer fit in a core's L2 cache (256 x 256 floats = 256 KiB), tiling pays for its bookkeeping.
inline bool prefer_flash(Index n, Index m) { return n * m > 256 * 256; }

inline void require_tiles(const char* function, const FlashTiles& tiles) {
  if (tiles.query_rows < 1 || tiles.key_cols < 1) {
    fail(function, "tile sizes must be at least 1, got ", tiles.query_rows, " x ", tiles.key_cols);
  }
}

}  // namespace detail

/// Attention by tiles with an online softmax (FlashAttention's algorithm on the CPU): the same
/// result as `scaled_dot_product_attention`, without ever forming the n x m score table.
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param options  every `AttentionOptions` field; tiles entirely above the causal diagonal or
///                 outside the window are never computed
/// \param tiles    tile sizes (query rows x key columns)
/// \returns n x d_v
/// \throws shape_error on mismatched shapes or invalid options.
/// \note Extra memory O((tile rows + tile cols) (d_k + d_v)) per thread plus the output; no n x m
///       table. Agrees with the materialised path to float rounding (a different summation order).
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> flash_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const AttentionOptions<typename DQ::Scalar>& options = {}, const FlashTiles& tiles = {}) {
  using T = typename DQ::Scalar;
  detail::check_attention("flash_attention", Q, K, V, options);
  detail::require_tiles("flash_attention", tiles);
  Matrix<T> O(Q.rows(), V.cols());
  detail::flash_kernel<T>(Q, K, V, options, tiles, O, nullptr);
  return O;
}

/// `flash_attention` that also returns each row's log-sum-exp of its (masked) logits,
/// `lse_i = log(sum_j exp(s_ij))` (`-inf` for a row that may attend nothing; the sink is included
/// when set): what gradients and the merging of partial results need.
/// \param log_sum_exp  resized to n
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
  detail::flash_kernel<T>(Q, K, V, options, tiles, O, &log_sum_exp);
  return O;
}

}  // namespace attn
