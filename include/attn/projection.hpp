#pragma once
/// \file projection.hpp
/// The projections `Q = X W_Q`, `K = X W_K`, `V = X W_V` (the documents' convention: one row per
/// token, `W` of shape (d_in, d_out)).

#include "detail/score_tiles.hpp"
#include "error.hpp"
#include "types.hpp"

namespace attn {
namespace detail {

template <class A, class B>
void require_same_scalar() {
  static_assert(std::is_same_v<typename A::Scalar, typename B::Scalar>,
                "attn: all operands must have the same scalar type (float or double)");
  static_assert(is_supported_scalar_v<typename A::Scalar>, "attn works on floating-point scalars");
}

template <class DX, class DW>
void check_projection(const char* function, const Eigen::MatrixBase<DX>& X,
                      const Eigen::MatrixBase<DW>& W, const char* w_name) {
  require_same_scalar<DX, DW>();
  require_inner(function, "X", X, w_name, W);
}

}  // namespace detail

/// `X W`: projects each token (row of `X`).
/// \param X  n x d_in, one row per token
/// \param W  d_in x d_out
/// \returns n x d_out
/// \throws shape_error if `X.cols() != W.rows()`.
template <class DX, class DW>
Matrix<typename DX::Scalar> project(const Eigen::MatrixBase<DX>& X,
                                    const Eigen::MatrixBase<DW>& W) {
  detail::check_projection("project", X, W, "W");
  using T = typename DX::Scalar;
  // Operands are evaluated to row-major storage first (a no-op for row-major matrices), so the
  // result has the same bits whatever the inputs' storage order or expression.
  const detail::ConstRef<T> x(X);
  const detail::ConstRef<T> w(W);
  Matrix<T> Y(x.rows(), w.cols());
  detail::product_kernel<T>(x, w, Y);
  return Y;
}

/// `X W + b`, with `b` broadcast over the rows.
/// \param X  n x d_in
/// \param W  d_in x d_out
/// \param b  a vector of d_out entries (row or column)
/// \returns n x d_out
/// \throws shape_error on mismatched shapes.
template <class DX, class DW, class DB>
Matrix<typename DX::Scalar> project(const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DW>& W,
                                    const Eigen::MatrixBase<DB>& b) {
  detail::check_projection("project", X, W, "W");
  detail::require_same_scalar<DX, DB>();
  if ((b.rows() != 1 && b.cols() != 1) || b.size() != W.cols()) {
    detail::fail("project", "b is ", detail::shape_of(b), " but must be a vector of ", W.cols(),
                 " entries (W is ", detail::shape_of(W), ")");
  }
  using T = typename DX::Scalar;
  const detail::ConstRef<T> x(X);
  const detail::ConstRef<T> w(W);
  Matrix<T> Y(x.rows(), w.cols());
  detail::product_kernel<T>(x, w, Y);
  if (b.rows() == 1) {
    Y.rowwise() += b.row(0);
  } else {
    Y.rowwise() += b.col(0).transpose();
  }
  return Y;
}

/// Queries, keys and values of one sequence: `{X W_Q, X W_K, X W_V}`. With several heads side by
/// side, W_K may be narrower than W_Q (grouped-query attention: `heads` query heads over
/// `kv_heads` key heads of the same width, so W_Q has heads d_k columns and W_K kv_heads d_k).
/// \param X    n x d_in
/// \param W_Q  d_in x (heads d_k)
/// \param W_K  d_in x (kv_heads d_k), its width dividing W_Q's (equal for one head)
/// \param W_V  d_in x (kv_heads d_v)
/// \returns `{Q, K, V}`: Q n x (heads d_k), K n x (kv_heads d_k), V n x (kv_heads d_v)
/// \throws shape_error if a W has the wrong number of rows or W_K's width does not divide W_Q's.
template <class DX, class DQ, class DK, class DV>
QKV<typename DX::Scalar> project_qkv(const Eigen::MatrixBase<DX>& X,
                                     const Eigen::MatrixBase<DQ>& W_Q,
                                     const Eigen::MatrixBase<DK>& W_K,
                                     const Eigen::MatrixBase<DV>& W_V) {
  detail::check_projection("project_qkv", X, W_Q, "W_Q");
  detail::check_projection("project_qkv", X, W_K, "W_K");
  detail::check_projection("project_qkv", X, W_V, "W_V");
  if (W_K.cols() == 0 || W_Q.cols() % W_K.cols() != 0) {
    detail::fail(
        "project_qkv", "W_K is ", detail::shape_of(W_K), " and W_Q ", detail::shape_of(W_Q),
        ": W_K's width must divide W_Q's (equal widths, or heads query heads over kv_heads ",
        "key heads of one width)");
  }
  using T = typename DX::Scalar;
  const detail::ConstRef<T> x(X);  // evaluate an expression X once, not three times
  QKV<T> qkv{Matrix<T>(X.rows(), W_Q.cols()), Matrix<T>(X.rows(), W_K.cols()),
             Matrix<T>(X.rows(), W_V.cols())};
  detail::product_kernel<T>(x, W_Q, qkv.Q);
  detail::product_kernel<T>(x, W_K, qkv.K);
  detail::product_kernel<T>(x, W_V, qkv.V);
  return qkv;
}

}  // namespace attn
