#pragma once
/// \file positional.hpp
/// Where each token is: sinusoidal encodings, learned position embeddings and ALiBi slopes. The
/// sinusoidal encodings of Vaswani et al. 2017 come in their layout and in those of Hugging Face
/// Marian/BART and tensor2tensor/fairseq; the learned ones are BERT's and GPT-2's (with the
/// gradient of their table); the ALiBi slopes are the standard ones (Press et al. 2022). Rotary
/// position embedding (RoPE, with partial rotation, linear, NTK-aware and YaRN scaling, its
/// backward, and the weight conversion between its two pairings) is in rope.hpp, which this header
/// includes.
///
/// Self-attention alone is permutation equivariant: permuting the tokens permutes the output rows
/// and nothing else ("dog bites man" and "man bites dog" get the same rows). Each of these adds
/// position information, either to the embeddings (sinusoidal, learned) or to Q and K (RoPE), or
/// to the scores (ALiBi, see `AttentionOptions::alibi_slope` and `MultiHeadOptions::alibi_slopes`).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "detail/checked.hpp"
#include "error.hpp"
#include "rope.hpp"
#include "types.hpp"

namespace attn {

// ------------------------------------------------------------------------------------------------
// Sinusoidal encodings
// ------------------------------------------------------------------------------------------------

/// The sinusoidal position encoding of "Attention Is All You Need", in the paper's interleaved
/// layout: `PE[p, 2i] = sin(p / 10000^(2i/d))`, `PE[p, 2i+1] = cos(p / 10000^(2i/d))`.
/// \param max_len  positions 0 .. max_len - 1 (rows), >= 0
/// \param d_model  features d (columns), >= 1. An odd d ends with one sine column,
///                 `PE[p, d-1] = sin(p / 10000^((d-1)/d))` (the formula, read literally).
/// \returns max_len x d_model; add it (or a block of it) to the embeddings, one row per token.
/// \throws shape_error if max_len < 0 or d_model < 1.
/// \note max_len * d_model sines/cosines, computed in double.
template <class T>
Matrix<T> sinusoidal_encoding(Index max_len, Index d_model) {
  static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
  if (max_len < 0) detail::fail("sinusoidal_encoding", "max_len must be >= 0, got ", max_len);
  detail::require_positive_size("sinusoidal_encoding", "d_model", d_model);
  Matrix<T> PE(max_len, d_model);
  const double d = static_cast<double>(d_model);
  for (Index j = 0; j < d_model; ++j) {
    const double frequency = std::pow(10000.0, -static_cast<double>(j - j % 2) / d);
    for (Index p = 0; p < max_len; ++p) {
      const double angle = static_cast<double>(p) * frequency;
      PE(p, j) = static_cast<T>(j % 2 == 0 ? std::sin(angle) : std::cos(angle));
    }
  }
  return PE;
}

/// The same frequencies as `sinusoidal_encoding`, in the concatenated layout `[sin | cos]` of
/// Hugging Face's Marian and BART (`MarianSinusoidalPositionalEmbedding`): column k < ceil(d/2) is
/// `sin(p / 10000^(2k/d))`, column ceil(d/2) + k is `cos(p / 10000^(2k/d))`. It is the interleaved
/// table with its even columns first, then its odd ones (so an odd d has one more sine than cosine,
/// as in Marian).
/// \param max_len  rows, >= 0
/// \param d_model  columns, >= 1
/// \returns max_len x d_model
/// \throws shape_error if max_len < 0 or d_model < 1.
template <class T>
Matrix<T> sinusoidal_encoding_concatenated(Index max_len, Index d_model) {
  if (max_len < 0) {
    detail::fail("sinusoidal_encoding_concatenated", "max_len must be >= 0, got ", max_len);
  }
  detail::require_positive_size("sinusoidal_encoding_concatenated", "d_model", d_model);
  const Matrix<T> interleaved = sinusoidal_encoding<T>(max_len, d_model);
  const Index sines = (d_model + 1) / 2;
  Matrix<T> PE(max_len, d_model);
  for (Index j = 0; j < d_model; ++j) {
    PE.col(j % 2 == 0 ? j / 2 : sines + j / 2) = interleaved.col(j);
  }
  return PE;
}

/// The tensor2tensor / fairseq layout (`get_timing_signal_1d`, `SinusoidalPositionalEmbedding`):
/// with `h = floor(d/2)` frequencies `f_k = 10000^(-k / max(h - 1, 1))` (k = 0 .. h-1, so the
/// lowest is exactly 1/10000), column k is `sin(p f_k)`, column h + k is `cos(p f_k)`, and an odd d
/// ends with a zero column (as both pad).
/// \param max_len  rows, >= 0; row p is position p (fairseq adds `padding_idx + 1` to its positions
///                 before looking them up: pass those positions' rows)
/// \param d_model  columns, >= 1
/// \returns max_len x d_model
/// \throws shape_error if max_len < 0 or d_model < 1.
template <class T>
Matrix<T> sinusoidal_encoding_tensor2tensor(Index max_len, Index d_model) {
  static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
  const char* function = "sinusoidal_encoding_tensor2tensor";
  if (max_len < 0) detail::fail(function, "max_len must be >= 0, got ", max_len);
  detail::require_positive_size(function, "d_model", d_model);
  const Index half = d_model / 2;
  Matrix<T> PE = Matrix<T>::Zero(max_len, d_model);
  const double steps = static_cast<double>(std::max<Index>(half - 1, 1));
  for (Index k = 0; k < half; ++k) {
    const double frequency = std::exp(-std::log(10000.0) * static_cast<double>(k) / steps);
    for (Index p = 0; p < max_len; ++p) {
      const double angle = static_cast<double>(p) * frequency;
      PE(p, k) = static_cast<T>(std::sin(angle));
      PE(p, half + k) = static_cast<T>(std::cos(angle));
    }
  }
  return PE;
}

// ------------------------------------------------------------------------------------------------
// Learned positions
// ------------------------------------------------------------------------------------------------

/// Learned absolute position embeddings (BERT, GPT-2): one trainable row per position.
///
/// Gradients: Y = X + table rows [offset, offset + n), so with dY = dL/dY given,
/// dX = dY (the addition passes the gradient through unchanged: no call needed) and
/// d table = dY in rows offset .. offset + n - 1, zero elsewhere (`table_gradient`; summed over the
/// calls of a step with `accumulate_table_gradient`).
template <class T>
class LearnedPositionalEmbedding {
 public:
  /// A zero table (load trained values into `table`).
  /// \param max_len  positions the table holds, >= 1
  /// \param d_model  width of one embedding, >= 1
  /// \throws shape_error if max_len < 1 or d_model < 1.
  LearnedPositionalEmbedding(Index max_len, Index d_model) {
    detail::require_positive_size("LearnedPositionalEmbedding", "max_len", max_len);
    detail::require_positive_size("LearnedPositionalEmbedding", "d_model", d_model);
    table = Matrix<T>::Zero(max_len, d_model);
  }

  /// Takes a trained (max_len, d_model) table (GPT-2's `wpe.weight`, say, which has this layout).
  /// \param trained  max_len x d_model, max_len >= 1 and d_model >= 1
  /// \throws shape_error if the table has no rows or no columns.
  template <class D>
  explicit LearnedPositionalEmbedding(const Eigen::MatrixBase<D>& trained) : table(trained) {
    detail::require_positive_size("LearnedPositionalEmbedding", "table rows", table.rows());
    detail::require_positive_size("LearnedPositionalEmbedding", "table columns", table.cols());
  }

  Matrix<T> table;  ///< (max_len, d_model): row p is the embedding of position p

  /// The number of positions the table holds.
  /// \returns max_len, the table's rows
  Index max_len() const { return table.rows(); }
  /// The width of one embedding.
  /// \returns d_model, the table's columns
  Index d_model() const { return table.cols(); }

  /// Adds the embeddings of positions offset .. offset + n - 1 to the rows of X, in place.
  /// \param X       n x d_model, modified (a matrix or a writable block of one)
  /// \param offset  position of X's first row, >= 0
  /// \throws shape_error if X has the wrong width, or offset + n > max_len (positions past the
  ///         table have no embedding: a learned table cannot extrapolate).
  template <class D>
  void add_to(Eigen::MatrixBase<D>& X, Index offset = 0) const {
    check("LearnedPositionalEmbedding::add_to", "X", X, offset);
    X += table.middleRows(offset, X.rows());
  }
  /// `add_to` for a temporary writable expression (`M.middleRows(...)`).
  /// \param X       n x d_model, a writable block of a matrix, modified
  /// \param offset  position of X's first row, >= 0
  template <class D>
  void add_to(Eigen::MatrixBase<D>&& X, Index offset = 0) const {
    add_to(X, offset);
  }

  /// `X + table rows [offset, offset + n)`, as a new matrix (see `add_to`).
  /// \param X       n x d_model
  /// \param offset  position of X's first row, >= 0
  /// \returns n x d_model
  /// \throws shape_error as `add_to`.
  template <class D>
  Matrix<T> added(const Eigen::MatrixBase<D>& X, Index offset = 0) const {
    check("LearnedPositionalEmbedding::added", "X", X, offset);
    Matrix<T> Y = X;
    Y += table.middleRows(offset, X.rows());
    return Y;
  }

  /// The gradient of a loss with respect to `table`, given dY = dL/dY for
  /// Y = added(X, offset) (or X after add_to(X, offset)). The gradient with respect to X is dY
  /// itself.
  /// \param dY      n x d_model, the gradient of the loss with respect to Y
  /// \param offset  the forward's position of the first row, >= 0
  /// \returns max_len x d_model: rows offset .. offset + n - 1 are dY, the others zero.
  /// \throws shape_error as `add_to` (dY's width, positions outside the table).
  /// \note Allocates the max_len x d_model result; `accumulate_table_gradient` adds into storage
  ///       the caller keeps.
  template <class D>
  Matrix<T> table_gradient(const Eigen::MatrixBase<D>& dY, Index offset = 0) const {
    check("LearnedPositionalEmbedding::table_gradient", "dY", dY, offset);
    Matrix<T> dtable = Matrix<T>::Zero(table.rows(), table.cols());
    dtable.middleRows(offset, dY.rows()) = dY;
    return dtable;
  }

  /// Adds the table gradient of one call (see `table_gradient`) into `dtable`: its rows
  /// offset .. offset + n - 1 get dY added, the others stay. For a training step that adds
  /// positions to several sequences (or chunks of one): zero dtable once, accumulate each call.
  /// \param dY      n x d_model, the gradient of the loss with respect to Y
  /// \param offset  the forward's position of the first row, >= 0
  /// \param dtable  max_len x d_model, added to (a matrix or a writable block of one)
  /// \throws shape_error as `add_to`, or if dtable is not max_len x d_model.
  /// \note n * d_model additions; no allocation.
  template <class D, class G>
  void accumulate_table_gradient(const Eigen::MatrixBase<D>& dY, Index offset,
                                 Eigen::MatrixBase<G>& dtable) const {
    const char* function = "LearnedPositionalEmbedding::accumulate_table_gradient";
    static_assert(std::is_same_v<typename G::Scalar, T>,
                  "dtable must have the table's scalar type");
    check(function, "dY", dY, offset);
    if (dtable.rows() != table.rows() || dtable.cols() != table.cols()) {
      detail::fail(function, "dtable is ", detail::shape_of(dtable), " but the table is ",
                   detail::shape_of(table), " (a gradient has the table's shape)");
    }
    dtable.middleRows(offset, dY.rows()) += dY;
  }
  /// `accumulate_table_gradient` into a temporary writable expression (`M.middleCols(...)`).
  /// \param dY      n x d_model, the gradient of the loss with respect to Y
  /// \param offset  the forward's position of the first row, >= 0
  /// \param dtable  max_len x d_model, a writable block of a matrix, added to
  template <class D, class G>
  void accumulate_table_gradient(const Eigen::MatrixBase<D>& dY, Index offset,
                                 Eigen::MatrixBase<G>&& dtable) const {
    accumulate_table_gradient(dY, offset, dtable);
  }

 private:
  template <class D>
  void check(const char* function, const char* name, const Eigen::MatrixBase<D>& X,
             Index offset) const {
    static_assert(std::is_same_v<typename D::Scalar, T>,
                  "the operand must have the table's scalar type");
    if (X.cols() != table.cols()) {
      detail::fail(function, name, " has ", X.cols(), " columns but the table has ", table.cols(),
                   " (", name, " is ", detail::shape_of(X), ", table is ", detail::shape_of(table),
                   ")");
    }
    if (offset < 0 || offset > table.rows() - X.rows()) {  // offset + n would overflow
      detail::fail(function, "positions ", offset, " .. ",
                   detail::saturating_add(offset, X.rows() - 1), " are outside the table's 0 .. ",
                   table.rows() - 1, " (", name, " is ", detail::shape_of(X), ", offset ", offset,
                   ", table is ", detail::shape_of(table), ")");
    }
  }
};

// ------------------------------------------------------------------------------------------------
// ALiBi
// ------------------------------------------------------------------------------------------------

/// The standard ALiBi slopes of `heads` heads. As in Press et al. 2022 and their reference
/// `get_slopes`: for H a power of two, head h (0-based) gets `2^(-8 (h+1) / H)` (H = 8: 1/2, 1/4,
/// ..., 1/256). Otherwise, with P the largest power of two below H, the first P heads get the
/// slopes of P, and the remaining H - P heads take every other slope of 2P, starting with the
/// first: `2^(-8 (2k+1) / (2P))`, k = 0 .. H-P-1 (H = 12: 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5,
/// 2^-2.5, 2^-3.5).
/// \param heads  H >= 1
/// \returns H slopes, one per query head, for `AttentionOptions::alibi_slope` or
///          `MultiHeadOptions::alibi_slopes`.
/// \throws shape_error if heads < 1.
template <class T>
std::vector<T> alibi_slopes(Index heads) {
  static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
  detail::require_positive_size("alibi_slopes", "heads", heads);
  Index power = 1;
  while (power * 2 <= heads) power *= 2;
  std::vector<T> slopes;
  slopes.reserve(static_cast<std::size_t>(heads));
  for (Index h = 0; h < power; ++h) {
    slopes.push_back(
        static_cast<T>(std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(power))));
  }
  for (Index k = 0; k < heads - power; ++k) {
    slopes.push_back(static_cast<T>(
        std::exp2(-8.0 * static_cast<double>(2 * k + 1) / static_cast<double>(2 * power))));
  }
  return slopes;
}

}  // namespace attn
