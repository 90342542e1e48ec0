#pragma once
/// \file backward.hpp
/// Gradients of attention: `attention_backward` (every `AttentionOptions` field, materialised for
/// small problems and tiled beyond, deterministic for any thread count) and the row softmax's own
/// backward, `softmax_rows_backward`.
///
/// With the loss L and dO = dL/dO given, the forward O = P V, P = softmax(Z) (each row's sink in
/// its denominator), Z = softcap(scale Q K^T) + bias + ALiBi, masked, gives (FlashAttention-2,
/// Dao 2023, section 3.1.2, in the library's notation):
///   dV = P^T dO,   dP = dO V^T,   D_i = sum_j P_ij dP_ij = rowsum(dO o O)_i,
///   dZ = P o (dP - D),   dbias = dZ,   dsink = -sum_i P_i,sink D_i,
///   dS = dZ o (1 - tanh^2(s / c))  (softcap; dS = dZ without),
///   dQ = scale dS K,   dK = scale dS^T Q.
/// A key a row may not attend has P_ij = 0 and gets no gradient from that row, whatever its value
/// holds (its entries of dZ are set to 0, never computed as 0 * NaN).

#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include "attention.hpp"
#include "detail/backward_kernels.hpp"
#include "detail/paths.hpp"
#include "detail/pipeline.hpp"
#include "error.hpp"
#include "flash.hpp"
#include "types.hpp"
#include "variant.hpp"

namespace attn {

/// Backward of the row softmax: with P = softmax_rows(S) and dP = dL/dP,
/// dS = P o (dP - rowsum(dP o P)). Entries where P is 0 (masked) get exactly 0.
/// \param P   n x m weights (rows of a softmax)
/// \param dP  n x m gradient of the loss with respect to P
/// \returns n x m gradient with respect to the softmax's input S
/// \throws shape_error when the shapes differ.
template <class DP, class DG>
Matrix<typename DP::Scalar> softmax_rows_backward(const Eigen::MatrixBase<DP>& P,
                                                  const Eigen::MatrixBase<DG>& dP) {
  using T = typename DP::Scalar;
  detail::require_same_scalar<DP, DG>();
  detail::require_same_rows("softmax_rows_backward", "dP", dP, "P", P);
  detail::require_same_cols("softmax_rows_backward", "dP", dP, "P", P);
  Matrix<T> dS(P.rows(), P.cols());
  for (Index i = 0; i < P.rows(); ++i) {
    T D = T(0);
    for (Index j = 0; j < P.cols(); ++j) {
      if (P(i, j) != T(0)) D += P(i, j) * dP(i, j);
    }
    for (Index j = 0; j < P.cols(); ++j) {
      dS(i, j) = P(i, j) == T(0) ? T(0) : P(i, j) * (dP(i, j) - D);
    }
  }
  return dS;
}

namespace detail {

template <class DQ, class DK, class DV, class DO>
void check_backward(const char* function, const Eigen::MatrixBase<DQ>& Q,
                    const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                    const Eigen::MatrixBase<DO>& dO,
                    const AttentionOptions<typename DQ::Scalar>& options) {
  require_same_scalar<DQ, DO>();
  check_attention(function, Q, K, V, options);
  require_same_rows(function, "dO", dO, "Q", Q);
  require_same_cols(function, "dO", dO, "V", V);
}

/// The forward (tiled) and backward with a variant, checks included (errors naming `function`):
/// on the tiled path with `tiles` when given, else on the path `backward_path` picks; the
/// variant's parameter gradient into `dparams` when not null.
template <class DQ, class DK, class DV, class DG, class Variant>
void variant_backward(const char* function, const Eigen::MatrixBase<DQ>& Q,
                      const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                      const Eigen::MatrixBase<DG>& dO, const Variant& variant,
                      const AttentionOptions<typename DQ::Scalar>& options,
                      const std::optional<BackwardTiles>& tiles,
                      AttentionGrads<typename DQ::Scalar>& grads,
                      typename GradientOf<Variant>::type* dparams) {
  using T = typename DQ::Scalar;
  check_variant<Variant, T, true>();
  check_backward(function, Q, K, V, dO, options);
  if (tiles) require_tiles(function, *tiles);
  const ScoreRule<T> rule = make_rule(options, Q.rows(), K.rows(), Q.cols());
  require_variant_positions(function, rule.q_position, rule.n, 0, rule.m);
  forward_and_backward<T>(
      Q, K, V, dO, rule, tiles ? Path::Tiled : backward_path(rule, Q.cols(), V.cols()),
      tiles ? *tiles : BackwardTiles{}, grads, BoundVariant<Variant>{&variant}, dparams);
}

}  // namespace detail

/// Gradients of attention from the forward's own output and log-sum-exp (a training loop that kept
/// them does not run the forward again), into caller storage.
/// \param Q            n x d_k queries
/// \param K            m x d_k keys
/// \param V            m x d_v values
/// \param O            n x d_v the forward's output for these operands and options
/// \param log_sum_exp  n, each row's log-sum-exp as `flash_attention` returns it (sink included)
/// \param dO           n x d_v gradient of the loss with respect to the output
/// \param options      the forward's options (every field)
/// \param grads        dQ (n x d_k), dK (m x d_k), dV (m x d_v), dbias (n x m when `bias` is set,
///                     else empty), dsink (0 unless `sink` is set); resized, storage reused
/// \throws shape_error on mismatched shapes or invalid options.
/// \note About 10 n m d flops (2.5x the forward). Beyond `choose_path`'s crossover the tiled kernel
///       runs (FlashAttention-2's backward: P recomputed tile by tile from the log-sum-exp, never
///       the n x m table; extra memory O(parts n d_k) for the partial dQ, parts <= 16); below it the
///       materialised one (two n x m tables). Identical bits for any thread count.
template <class DQ, class DK, class DV, class DOut, class DL, class DG>
void attention_backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                        const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DOut>& O,
                        const Eigen::MatrixBase<DL>& log_sum_exp, const Eigen::MatrixBase<DG>& dO,
                        const AttentionOptions<typename DQ::Scalar>& options,
                        AttentionGrads<typename DQ::Scalar>& grads) {
  using T = typename DQ::Scalar;
  constexpr const char* function = "attention_backward";
  detail::check_backward(function, Q, K, V, dO, options);
  detail::require_same_scalar<DQ, DOut>();
  detail::require_same_scalar<DQ, DL>();
  detail::require_same_rows(function, "O", O, "Q", Q);
  detail::require_same_cols(function, "O", O, "V", V);
  if (log_sum_exp.size() != Q.rows() || (log_sum_exp.rows() != 1 && log_sum_exp.cols() != 1)) {
    detail::fail(function, "log_sum_exp must have ", Q.rows(), " entries (one per row of Q), got ",
                 detail::shape_of(log_sum_exp));
  }
  const Vector<T> lse = log_sum_exp.derived().reshaped();
  const detail::ScoreRule<T> rule = detail::make_rule(options, Q.rows(), K.rows(), Q.cols());
  detail::backward_kernel<T>(Q, K, V, O, lse, dO, rule,
                             detail::backward_path(rule, Q.cols(), V.cols()), BackwardTiles{},
                             grads);
}

/// Gradients of attention from the forward's output and log-sum-exp (see the overload writing
/// into caller storage).
/// \param Q            n x d_k queries
/// \param K            m x d_k keys
/// \param V            m x d_v values
/// \param O            n x d_v the forward's output for these operands and options
/// \param log_sum_exp  n, each row's log-sum-exp as `flash_attention` returns it (sink included)
/// \param dO           n x d_v gradient of the loss with respect to the output
/// \param options      the forward's options (every field)
/// \returns `{dQ, dK, dV, dbias, dsink}`
template <class DQ, class DK, class DV, class DOut, class DL, class DG>
AttentionGrads<typename DQ::Scalar> attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DOut>& O, const Eigen::MatrixBase<DL>& log_sum_exp,
    const Eigen::MatrixBase<DG>& dO, const AttentionOptions<typename DQ::Scalar>& options = {}) {
  AttentionGrads<typename DQ::Scalar> grads;
  attention_backward(Q, K, V, O, log_sum_exp, dO, options, grads);
  return grads;
}

/// Gradients of attention: runs the forward (keeping its output and log-sum-exp), then the
/// backward on the same path, into caller storage.
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param dO       n x d_v gradient of the loss with respect to the output
/// \param options  every `AttentionOptions` field
/// \param grads    see the overload taking the forward's output
/// \throws shape_error on mismatched shapes or invalid options.
template <class DQ, class DK, class DV, class DG>
void attention_backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                        const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dO,
                        const AttentionOptions<typename DQ::Scalar>& options,
                        AttentionGrads<typename DQ::Scalar>& grads) {
  using T = typename DQ::Scalar;
  detail::check_backward("attention_backward", Q, K, V, dO, options);
  const detail::ScoreRule<T> rule = detail::make_rule(options, Q.rows(), K.rows(), Q.cols());
  detail::forward_and_backward<T>(
      Q, K, V, dO, rule, detail::backward_path(rule, Q.cols(), V.cols()), BackwardTiles{}, grads);
}

/// Gradients of attention (see the overload writing into caller storage).
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param dO       n x d_v gradient of the loss with respect to the output
/// \param options  every `AttentionOptions` field
/// \returns `{dQ, dK, dV, dbias, dsink}`: dQ n x d_k, dK m x d_k, dV m x d_v, dbias n x m when
///          `bias` is set (else empty), dsink when `sink` is set (else 0)
template <class DQ, class DK, class DV, class DG>
AttentionGrads<typename DQ::Scalar> attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dO, const AttentionOptions<typename DQ::Scalar>& options = {}) {
  AttentionGrads<typename DQ::Scalar> grads;
  attention_backward(Q, K, V, dO, options, grads);
  return grads;
}

/// The tiled backward at any size (what `attention_backward` runs beyond the crossover), with
/// chosen tiles: for tests, benchmarks and tuning.
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param dO       n x d_v gradient of the loss with respect to the output
/// \param options  every `AttentionOptions` field
/// \param tiles    query rows and key columns per tile (each at least 1)
/// \returns `{dQ, dK, dV, dbias, dsink}` (see `attention_backward`)
/// \throws shape_error on mismatched shapes, invalid options or tiles below 1.
template <class DQ, class DK, class DV, class DG>
AttentionGrads<typename DQ::Scalar> flash_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dO, const AttentionOptions<typename DQ::Scalar>& options = {},
    const BackwardTiles& tiles = {}) {
  using T = typename DQ::Scalar;
  detail::check_backward("flash_attention_backward", Q, K, V, dO, options);
  detail::require_tiles("flash_attention_backward", tiles);
  const detail::ScoreRule<T> rule = detail::make_rule(options, Q.rows(), K.rows(), Q.cols());
  AttentionGrads<T> grads;
  detail::forward_and_backward<T>(Q, K, V, dO, rule, detail::Path::Tiled, tiles, grads);
  return grads;
}

/// Gradients of attention with a variant (variant.hpp), into caller storage: the forward (the
/// tiled kernel, keeping its output and log-sum-exp), then the backward with the variant's score
/// (through its `dscore`) and mask, on the path `attention_backward` takes. A key the variant
/// forbids gets exactly zero gradient from the queries it is forbidden to; the bits do not depend
/// on the thread count.
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param dO       n x d_v gradient of the loss with respect to the output
/// \param variant  a variant (`is_variant_v`) with `dscore` wherever it has `score`
/// \param options  every `AttentionOptions` field
/// \param grads    see `attention_backward`; resized, storage reused
/// \throws shape_error on mismatched shapes or invalid options.
template <class DQ, class DK, class DV, class DG, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
void attention_backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                        const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dO,
                        const Variant& variant,
                        const AttentionOptions<typename DQ::Scalar>& options,
                        AttentionGrads<typename DQ::Scalar>& grads) {
  detail::variant_backward("attention_backward", Q, K, V, dO, variant, options, std::nullopt, grads,
                           static_cast<typename detail::GradientOf<Variant>::type*>(nullptr));
}

/// Gradients of attention with a learnable variant (`variant_learns_v`, such as `T5Bias`): as the
/// overload above, and the gradient of the variant's parameters, summed tile by tile in a fixed
/// order (the same bits for any thread count).
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param dO       n x d_v gradient of the loss with respect to the output
/// \param variant  a variant with learnable parameters
/// \param options  every `AttentionOptions` field
/// \param grads    see `attention_backward`; resized, storage reused
/// \param dparams  receives dL / d(the variant's parameters), as `Variant::Gradient`
/// \throws shape_error on mismatched shapes or invalid options.
template <class DQ, class DK, class DV, class DG, class Variant,
          std::enable_if_t<variant_learns_v<Variant>, int> = 0>
void attention_backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                        const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dO,
                        const Variant& variant,
                        const AttentionOptions<typename DQ::Scalar>& options,
                        AttentionGrads<typename DQ::Scalar>& grads,
                        typename Variant::Gradient& dparams) {
  detail::variant_backward("attention_backward", Q, K, V, dO, variant, options, std::nullopt, grads,
                           &dparams);
}

/// Gradients of attention with a variant (see the overload writing into caller storage).
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param dO       n x d_v gradient of the loss with respect to the output
/// \param variant  a variant (`is_variant_v`) with `dscore` wherever it has `score`
/// \param options  every `AttentionOptions` field
/// \returns `{dQ, dK, dV, dbias, dsink}` (see `attention_backward`)
template <class DQ, class DK, class DV, class DG, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
AttentionGrads<typename DQ::Scalar> attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dO, const Variant& variant,
    const AttentionOptions<typename DQ::Scalar>& options = {}) {
  AttentionGrads<typename DQ::Scalar> grads;
  attention_backward(Q, K, V, dO, variant, options, grads);
  return grads;
}

/// The tiled backward with a variant at any size, with chosen tiles (see `attention_backward`
/// with a variant and `flash_attention_backward`).
/// \param Q        n x d_k queries
/// \param K        m x d_k keys
/// \param V        m x d_v values
/// \param dO       n x d_v gradient of the loss with respect to the output
/// \param variant  a variant (`is_variant_v`) with `dscore` wherever it has `score`
/// \param options  every `AttentionOptions` field
/// \param tiles    query rows and key columns per tile (each at least 1)
/// \param dparams  when not null (a learnable variant), receives the gradient of its parameters
/// \returns `{dQ, dK, dV, dbias, dsink}`
template <class DQ, class DK, class DV, class DG, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
AttentionGrads<typename DQ::Scalar> flash_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dO, const Variant& variant,
    const AttentionOptions<typename DQ::Scalar>& options = {}, const BackwardTiles& tiles = {},
    typename detail::GradientOf<Variant>::type* dparams = nullptr) {
  AttentionGrads<typename DQ::Scalar> grads;
  detail::variant_backward("flash_attention_backward", Q, K, V, dO, variant, options, tiles, grads,
                           dparams);
  return grads;
}

/// Options types that extend `AttentionOptions` (`MultiHeadOptions`) are refused at compile time.
template <class DQ, class DK, class DV, class DG, class Options, class... Rest,
          detail::if_extended_options<Options, typename DQ::Scalar> = 0>
void attention_backward(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                        const Eigen::MatrixBase<DV>&, const Eigen::MatrixBase<DG>&, const Options&,
                        Rest&&...) = delete;
/// Likewise for the overload taking the forward's output.
template <class DQ, class DK, class DV, class DOut, class DL, class DG, class Options,
          class... Rest, detail::if_extended_options<Options, typename DQ::Scalar> = 0>
void attention_backward(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                        const Eigen::MatrixBase<DV>&, const Eigen::MatrixBase<DOut>&,
                        const Eigen::MatrixBase<DL>&, const Eigen::MatrixBase<DG>&, const Options&,
                        Rest&&...) = delete;
/// Likewise for `flash_attention_backward`.
template <class DQ, class DK, class DV, class DG, class Options, class... Rest,
          detail::if_extended_options<Options, typename DQ::Scalar> = 0>
void flash_attention_backward(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                              const Eigen::MatrixBase<DV>&, const Eigen::MatrixBase<DG>&,
                              const Options&, Rest&&...) = delete;

}  // namespace attn
