#pragma once
/// \file tensor.hpp
/// Row-major tensors for batches and heads, and matrix views of their slices.

#include <string>
#include <unsupported/Eigen/CXX11/Tensor>

#include "error.hpp"
#include "types.hpp"

namespace attn {

/// (batch, seq, features), or (heads, seq, features): row-major, so each slice along the first
/// dimension is a contiguous seq x features row-major matrix.
template <class T>
using Tensor3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;

/// (batch, heads, q, k).
template <class T>
using Tensor4 = Eigen::Tensor<T, 4, Eigen::RowMajor>;

namespace detail {

/// Slice `i` of a rank-3 tensor as a matrix (no copy).
template <class T>
Eigen::Map<const Matrix<T>> slice(const Tensor3<T>& t, Index i) {
  return {t.data() + i * t.dimension(1) * t.dimension(2), t.dimension(1), t.dimension(2)};
}
template <class T>
Eigen::Map<Matrix<T>> slice(Tensor3<T>& t, Index i) {
  return {t.data() + i * t.dimension(1) * t.dimension(2), t.dimension(1), t.dimension(2)};
}

/// A rank-3 tensor (a, b, c) seen as one (a * b) x c matrix (no copy).
template <class T>
Eigen::Map<const Matrix<T>> flatten(const Tensor3<T>& t) {
  return {t.data(), t.dimension(0) * t.dimension(1), t.dimension(2)};
}
template <class T>
Eigen::Map<Matrix<T>> flatten(Tensor3<T>& t) {
  return {t.data(), t.dimension(0) * t.dimension(1), t.dimension(2)};
}

template <class Tensor>
std::string dims_of(const Tensor& t) {
  std::string s = "(";
  for (std::size_t k = 0; k < static_cast<std::size_t>(Tensor::NumDimensions); ++k) {
    s += (k > 0 ? ", " : "") + std::to_string(t.dimensions()[k]);
  }
  return s + ")";
}

template <class T>
struct identity {
  using type = T;
};
/// Blocks template argument deduction (the scalar comes from the tensors, not the options).
template <class T>
using identity_t = typename identity<T>::type;

}  // namespace detail

/// The two layouts of several heads: `attention_heads` takes (heads, n, d) tensors, `KVCache` and
/// the projections give (n, heads d) matrices with the heads side by side (head h in columns
/// [h d, (h + 1) d)). `merge_heads` turns the first into the second.
/// \param t  (heads, n, d)
/// \returns n x (heads d)
template <class T>
Matrix<T> merge_heads(const Tensor3<T>& t) {
  const Index heads = t.dimension(0);
  const Index d = t.dimension(2);
  Matrix<T> X(t.dimension(1), heads * d);
  for (Index h = 0; h < heads; ++h) X.middleCols(h * d, d) = detail::slice(t, h);
  return X;
}

/// The inverse of `merge_heads`: n x (heads d) with the heads side by side to (heads, n, d).
/// \param X      n x (heads d), any Eigen expression
/// \param heads  >= 1, dividing X's columns
/// \returns (heads, n, d) with d = X's columns / heads
/// \throws shape_error if heads < 1 or X's columns are not a multiple of heads.
template <class D>
Tensor3<typename D::Scalar> split_heads(const Eigen::MatrixBase<D>& X, Index heads) {
  if (heads < 1 || X.cols() % heads != 0) {
    detail::fail("split_heads", "X is ", detail::shape_of(X),
                 ": its columns must be a multiple of ", "heads = ", heads, " (>= 1)");
  }
  const Index d = X.cols() / heads;
  Tensor3<typename D::Scalar> t(heads, X.rows(), d);
  for (Index h = 0; h < heads; ++h) detail::slice(t, h) = X.middleCols(h * d, d);
  return t;
}

}  // namespace attn
