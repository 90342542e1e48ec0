#pragma once
/// \file tensor.hpp
/// Row-major tensors for batches and heads, and matrix views of their slices.

#include <string>
#include <unsupported/Eigen/CXX11/Tensor>

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
}  // namespace attn
