#pragma once
/// \file scores.hpp
/// The n x m score kernel `scale * Q K^T`.

#include <algorithm>
#include <cmath>

#include "detail/score_tiles.hpp"
#include "error.hpp"
#include "projection.hpp"
#include "threads.hpp"
#include "types.hpp"

namespace attn {
namespace detail {

/// The default scale `1 / sqrt(d_k)`.
template <class T>
T default_scale(Index d_k) {
  return T(1) / std::sqrt(static_cast<T>(d_k));
}

/// S = scale * Q K^T: K is packed into panels (once per thread that runs blocks of queries), then
/// register tiles of S are summed over d_k, scaled in the registers and written once
/// (detail/score_tiles.hpp): no zero fill, no second pass.
/// Shape contract: Q n x d, K m x d, S resized to n x m (no allocation when it already is).
/// The packed keys live in a buffer of each thread that grows to the largest m x d seen and is
/// kept between calls (the hot path allocates nothing).
template <class T>
void scores_kernel(ConstRef<T> Q, ConstRef<T> K, T scale, Matrix<T>& S) {
  S.resize(Q.rows(), K.rows());
  if (S.size() == 0) return;
  score_tiles<T>(
      Q, [&K] { return packed_key_panels<T>(pack_keys<T>(K), K.cols()); }, scale, S);
}

template <class T>
void require_finite_scale(const char* function, T scale) {
  if (!std::isfinite(scale)) fail(function, "scale must be finite, got ", scale);
}

template <class DQ, class DK>
void check_scores(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K) {
  require_same_scalar<DQ, DK>();
  require_width("scores", "Q", Q);
  require_same_cols("scores", "K", K, "Q", Q);
}

}  // namespace detail

/// The score table `scale * Q K^T`, written into caller storage (the hot path: no allocation once
/// `S` has the right size).
/// \param Q      n x d_k queries
/// \param K      m x d_k keys
/// \param scale  multiplies every score, finite
/// \param S      resized to n x m and overwritten
/// \throws shape_error if d_k is 0 or differs between Q and K, or scale is not finite.
/// \note 2 n m d_k flops; the scale is applied to each register tile before its one write. Keeps
///       a per-thread buffer of m x d_k scalars (the packed keys) between calls.
template <class DQ, class DK>
void scores(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
            typename DQ::Scalar scale, Matrix<typename DQ::Scalar>& S) {
  detail::check_scores(Q, K);
  detail::require_finite_scale("scores", scale);
  using T = typename DQ::Scalar;
  detail::scores_kernel<T>(Q, K, scale, S);
}

/// `scale * Q K^T` (see the overload writing into caller storage).
/// \param Q      n x d_k queries
/// \param K      m x d_k keys
/// \param scale  multiplies every score, finite
/// \returns n x m scores.
template <class DQ, class DK>
Matrix<typename DQ::Scalar> scores(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                   typename DQ::Scalar scale) {
  Matrix<typename DQ::Scalar> S;
  scores(Q, K, scale, S);
  return S;
}

/// `Q K^T / sqrt(d_k)`: the n x m score kernel of scaled dot-product attention.
/// \param Q  n x d_k queries, one row per token
/// \param K  m x d_k keys
/// \returns n x m scores; entry (i, j) says how well query i matches key j.
/// \throws shape_error if d_k is 0 or differs between Q and K.
template <class DQ, class DK>
Matrix<typename DQ::Scalar> scores(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K) {
  detail::check_scores(Q, K);
  return scores(Q, K, detail::default_scale<typename DQ::Scalar>(Q.cols()));
}

}  // namespace attn
