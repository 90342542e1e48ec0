#pragma once
/// \file rope.hpp
/// Rotary position embedding (RoPE): `rope` and `rope_inplace` with both feature
/// pairings, partial rotation and position scaling (linear, NTK-aware, YaRN; `RopeOptions`), their
/// backward `rope_backward` and `rope_backward_inplace` (the transposed rotation), and
/// `convert_rope_weights`, the column permutation between the two pairings. The rotation kernel and
/// its frequency table (`detail::rope_table`, `detail::rope_kernel`) are shared with `KVCache`.
///
/// RoPE (Su et al. 2021) puts position information into Q and K (not V): the score `q_m . k_n` of
/// a query at position m and a key at position n then depends on the positions only through m - n.
/// The other position encodings (sinusoidal, learned, ALiBi) are in positional.hpp, which includes
/// this file.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <type_traits>
#include <vector>

#include "detail/checked.hpp"
#include "error.hpp"
#include "types.hpp"

namespace attn {

/// Settings of a rotary position embedding beyond its pairing style.
///
/// With `d_rot` rotated features (`rotary_dim`, or all `d` when 0), pair `i` (0 <= i < d_rot / 2)
/// at position `p` turns by the angle
///
///     theta(p, i) = (p / linear_scale) * f_i,     f_i = base'^(-2i / d_rot),
///     base' = base * ntk_scale^(d_rot / (d_rot - 2))      (base' = base when ntk_scale == 1).
///
/// - `linear_scale` s: linear position interpolation (Chen et al. 2023; Hugging Face
///   `rope_scaling = {"type": "linear", "factor": s}`): positions are divided by s.
/// - `ntk_scale` a: "NTK-aware" base scaling (bloc97 2023; the fixed-factor form of Hugging Face's
///   dynamic NTK rule): the base grows so that the lowest frequency is stretched by a while the
///   highest stays unchanged. Needs d_rot > 2.
/// - `rotary_dim` d_rot: partial rotary embedding (GPT-J `rotary_dim`, GPT-NeoX `rotary_pct`): only
///   the first d_rot features of each head rotate, the rest pass through; the exponent uses d_rot,
///   as those implementations do.
/// - `yarn_factor` s > 1: YaRN (Peng, Quesnelle, Fan and Shippole 2023, "YaRN: Efficient Context
///   Window Extension of Large Language Models"; Hugging Face `rope_type = "yarn"` with its
///   default `truncate`), extending a model trained on L = `yarn_original_max_positions` positions
///   to about s L. Pairs that turn many times within L keep their frequency (extrapolation), pairs
///   that turn less than once are interpolated (f_i / s), and those between are blended linearly in
///   i. With d = d_rot and b = base, the pair that turns r times over L is
///
///       corr(r) = d ln(L / (2 pi r)) / (2 ln b),
///       low  = max(floor(corr(beta_fast)), 0),   high = min(ceil(corr(beta_slow)), d - 1)
///              (high = low + 0.001 when they are equal),
///       ramp_i = clamp((i - low) / (high - low), 0, 1),   w_i = 1 - ramp_i,
///       f_i   <- (f_i / s) (1 - w_i) + f_i w_i,
///
///   and the rotated features (not those past d_rot) are multiplied by the attention factor
///   (`yarn_attention_factor`, default 0.1 ln s + 1), i.e. cos and sin are; applied to both Q and
///   K this scales the logits by its square (the paper's temperature sqrt(1/t) = 0.1 ln s + 1).
///   YaRN replaces `linear_scale` and `ntk_scale`: both must stay 1. s = 1 is plain RoPE (YaRN
///   off: L and the betas are then ignored, and yarn_attention_factor must stay unset).
///
///   Hugging Face config -> fields: `factor` -> yarn_factor, `original_max_position_embeddings`
///   (or the model's `max_position_embeddings`) -> yarn_original_max_positions, `beta_fast`,
///   `beta_slow`, `attention_factor` -> the same names prefixed `yarn_`. Its `mscale` /
///   `mscale_all_dim` pair (DeepSeek's) gives
///
///       attention_factor = (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1).
///
///   In the degenerate cases low > high (floor(corr(beta_fast)) > d - 1: L of the order of
///   2 pi beta_fast b^2 or more; ceil(corr(beta_slow)) < 0: L <= 2 pi beta_slow b^(-2/d)) the ramp
///   runs backwards; the formula is applied as written, as Hugging Face does.
template <class T>
struct RopeOptions {
  T base = T(10000);      ///< the frequency base, > 0 (> 1 with YaRN)
  Index rotary_dim = 0;   ///< d_rot: even, <= d; 0 = all features
  T linear_scale = T(1);  ///< s > 0: positions become p / s
  T ntk_scale = T(1);     ///< a > 0: base' = base * a^(d_rot / (d_rot - 2))
  T yarn_factor = T(1);   ///< YaRN's s >= 1: the context extension factor; 1 = YaRN off
  /// YaRN's L >= 1, the context length the model was trained on (required when yarn_factor > 1).
  Index yarn_original_max_positions = 0;
  T yarn_beta_fast = T(32);  ///< pairs turning more often than this over L keep f_i
  T yarn_beta_slow = T(1);   ///< pairs turning less often than this over L get f_i / s
  /// YaRN's attention factor (mscale), > 0: multiplies cos and sin; default 0.1 ln s + 1.
  /// Only with yarn_factor > 1.
  std::optional<T> yarn_attention_factor;
};

namespace detail {

/// What the rotation kernel needs of a `RopeOptions`, in double (so that float results carry no
/// error from the angles): pair i at position p turns by `(p / position_scale) * frequencies[i]`,
/// and its cosine and sine are multiplied by `magnitude`.
struct RopeTable {
  std::vector<double> frequencies;  ///< d_rot / 2 angles per position
  double position_scale = 1.0;      ///< linear_scale
  double magnitude = 1.0;           ///< YaRN's attention factor (1 without YaRN)
};

/// Checks the YaRN fields of `options`.
/// \returns whether YaRN is on (yarn_factor > 1).
/// \throws shape_error naming `function` on a YaRN field out of range, or YaRN combined with
///         linear_scale or ntk_scale != 1 (see `RopeOptions`).
template <class T>
bool check_yarn(const char* function, const RopeOptions<T>& options) {
  const T s = options.yarn_factor;
  if (!(std::isfinite(s) && s >= T(1))) {
    fail(function, "yarn_factor must be finite and >= 1 (1 = off), got ", s);
  }
  if (s == T(1)) {
    if (options.yarn_attention_factor) {
      fail(function, "yarn_attention_factor = ", *options.yarn_attention_factor,
           " needs yarn_factor > 1, got yarn_factor = 1 (YaRN off)");
    }
    return false;
  }
  if (options.linear_scale != T(1)) {
    fail(function, "yarn_factor = ", s,
         " cannot be combined with linear_scale = ", options.linear_scale,
         " (YaRN replaces linear interpolation; set one of them)");
  }
  if (options.ntk_scale != T(1)) {
    fail(function, "yarn_factor = ", s, " cannot be combined with ntk_scale = ", options.ntk_scale,
         " (YaRN replaces NTK-aware scaling; set one of them)");
  }
  if (options.yarn_original_max_positions < 1) {
    fail(function, "yarn_factor = ", s,
         " needs yarn_original_max_positions (L, the trained context length) >= 1, got ",
         options.yarn_original_max_positions);
  }
  const T fast = options.yarn_beta_fast;
  const T slow = options.yarn_beta_slow;
  if (!(std::isfinite(fast) && std::isfinite(slow) && slow > T(0) && fast >= slow)) {
    fail(function, "yarn_beta_fast and yarn_beta_slow must be finite with yarn_beta_fast >= ",
         "yarn_beta_slow > 0, got yarn_beta_fast = ", fast, " and yarn_beta_slow = ", slow);
  }
  if (!(options.base > T(1))) fail(function, "YaRN needs base > 1, got ", options.base);
  if (options.yarn_attention_factor &&
      !(std::isfinite(*options.yarn_attention_factor) && *options.yarn_attention_factor > T(0))) {
    fail(function, "yarn_attention_factor must be finite and > 0, got ",
         *options.yarn_attention_factor);
  }
  return true;
}

/// YaRN's blend of the frequencies `f_i = base^(-2i/d_rot)` (see `RopeOptions`), in place.
/// Pairs below `low` keep f_i exactly (w_i = 1), pairs from `high` on become f_i / s exactly.
/// \param frequencies  d_rot / 2 frequencies f_i, blended in place
/// \param d_rot        the rotated features
/// \param base         the (NTK-scaled) base b of the f_i
/// \param s            yarn_factor, > 1
/// \param L            yarn_original_max_positions
inline void yarn_blend(std::vector<double>& frequencies, Index d_rot, double base, double s,
                       double L, double beta_fast, double beta_slow) {
  const double pi = 3.14159265358979323846;
  const double d = static_cast<double>(d_rot);
  const auto correction_dim = [&](double rotations) {  // the pair turning `rotations` times in L
    return d * std::log(L / (2.0 * pi * rotations)) / (2.0 * std::log(base));
  };
  const double low = std::max(std::floor(correction_dim(beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(beta_slow)), d - 1.0);
  if (low == high) high += 0.001;  // no division by zero
  for (std::size_t i = 0; i < frequencies.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double w = 1.0 - ramp;  // extrapolation weight
    frequencies[i] = frequencies[i] / s * (1.0 - w) + frequencies[i] * w;
  }
}

/// The frequencies, position scale and magnitude of a rotary embedding over `head_dim` features.
/// \returns d_rot / 2 frequencies (d_rot = rotary_dim, or head_dim when 0) and the scales.
/// \throws shape_error on invalid options (naming `function`).
template <class T>
RopeTable rope_table(const char* function, Index head_dim, const RopeOptions<T>& options) {
  const Index d_rot = options.rotary_dim == 0 ? head_dim : options.rotary_dim;
  if (d_rot < 0 || d_rot > head_dim || d_rot % 2 != 0) {
    fail(function, "rotary_dim must be even and at most the feature count ", head_dim, ", got ",
         options.rotary_dim);
  }
  if (!(std::isfinite(options.base) && options.base > T(0))) {
    fail(function, "base must be finite and > 0, got ", options.base);
  }
  if (!(std::isfinite(options.linear_scale) && options.linear_scale > T(0))) {
    fail(function, "linear_scale must be finite and > 0, got ", options.linear_scale);
  }
  if (!(std::isfinite(options.ntk_scale) && options.ntk_scale > T(0))) {
    fail(function, "ntk_scale must be finite and > 0, got ", options.ntk_scale);
  }
  const bool yarn = check_yarn(function, options);
  double base = static_cast<double>(options.base);
  if (options.ntk_scale != T(1)) {
    if (d_rot <= 2) fail(function, "ntk_scale needs more than 2 rotated features, got ", d_rot);
    const double dr = static_cast<double>(d_rot);
    base *= std::pow(static_cast<double>(options.ntk_scale), dr / (dr - 2.0));
  }
  RopeTable table;
  table.frequencies.resize(static_cast<std::size_t>(d_rot / 2));
  for (std::size_t i = 0; i < table.frequencies.size(); ++i) {
    table.frequencies[i] =
        std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d_rot));
  }
  table.position_scale = static_cast<double>(options.linear_scale);
  if (yarn) {
    const double s = static_cast<double>(options.yarn_factor);
    yarn_blend(
        table.frequencies, d_rot, base, s, static_cast<double>(options.yarn_original_max_positions),
        static_cast<double>(options.yarn_beta_fast), static_cast<double>(options.yarn_beta_slow));
    table.magnitude = options.yarn_attention_factor
                          ? static_cast<double>(*options.yarn_attention_factor)
                          : 0.1 * std::log(s) + 1.0;
  }
  return table;
}

/// Which way `rope_kernel` turns: RoPE itself, or its transpose (the backward pass).
enum class RopeRotation {
  Forward,     ///< y = m R(theta) x
  Transposed,  ///< y = m R(theta)^T x = m R(-theta) x: the gradient dX of dY
};

/// Rotates, in place, every head of every row of X: row r is at position `first_position + r`.
/// The cosines and sines of a row are computed once (in double, times `table.magnitude`) and used
/// by all its heads; features past d_rot = 2 * frequencies are left as they are.
///
///     Interleaved: (x_2i, x_2i+1) -> (x_2i c - x_2i+1 s, x_2i s + x_2i+1 c)
///     Half:        (x_i, x_i+h)   -> (x_i c - x_i+h s,   x_i s + x_i+h c),  h = d_rot / 2
///
/// with c = m cos(theta), s = m sin(theta) (m = `table.magnitude`). Each pair's map is m R(theta)
/// (R a rotation), so its Jacobian is m R(theta) and the gradient of a loss is
/// dX = (m R(theta))^T dY = m R(-theta) dY: `RopeRotation::Transposed` runs the same loop with s
/// negated (exactly: a sign flip), the features past d_rot passing dY through as they pass X.
/// \param X         rows x (heads * head_dim), row-major: head h in columns
///                  [h * head_dim, (h + 1) * head_dim); checked by the caller
/// \param table     from `rope_table` for head_dim
/// \param rotation  RoPE (the forward) or its transpose (the backward)
template <class T>
void rope_kernel(Eigen::Ref<Matrix<T>> X, Index head_dim, Index first_position, RopeStyle style,
                 const RopeTable& table, RopeRotation rotation = RopeRotation::Forward) {
  const double sine_sign = rotation == RopeRotation::Forward ? 1.0 : -1.0;
  const Index pairs = static_cast<Index>(table.frequencies.size());
  const Index heads = X.cols() / head_dim;
  RowVector<T> c(pairs);
  RowVector<T> s(pairs);
  for (Index r = 0; r < X.rows(); ++r) {
    const double p = static_cast<double>(first_position + r) / table.position_scale;
    for (Index i = 0; i < pairs; ++i) {
      const double angle = p * table.frequencies[static_cast<std::size_t>(i)];
      c(i) = static_cast<T>(table.magnitude * std::cos(angle));
      s(i) = static_cast<T>(sine_sign * table.magnitude * std::sin(angle));
    }
    for (Index h = 0; h < heads; ++h) {
      T* x = X.row(r).data() + h * head_dim;
      for (Index i = 0; i < pairs; ++i) {
        const Index a = style == RopeStyle::Interleaved ? 2 * i : i;
        const Index b = style == RopeStyle::Interleaved ? 2 * i + 1 : i + pairs;
        const T xa = x[a];
        const T xb = x[b];
        x[a] = xa * c(i) - xb * s(i);
        x[b] = xa * s(i) + xb * c(i);
      }
    }
  }
}

/// `rope_kernel` over X as `heads` heads side by side, after checking `offset`, the heads and the
/// options.
/// \param name      the operand's name in messages ("X", or "dY" for the backward)
/// \param X         n x (heads d), row-major, rotated in place
/// \param rotation  RoPE or its transpose
/// \throws shape_error naming `function` on a negative offset, a head count that does not divide
///         X's columns, or invalid options.
template <class T>
void rope_checked(const char* function, const char* name, Eigen::Ref<Matrix<T>> X, Index offset,
                  RopeStyle style, const RopeOptions<T>& options, RopeRotation rotation,
                  Index heads = 1) {
  if (offset < 0) {
    fail(function, "offset must be >= 0, got ", offset, " (", name, " is ", shape_of(X), ")");
  }
  if (heads < 1 || X.cols() % heads != 0) {
    fail(function, name, " is ", shape_of(X), ": its columns must be a multiple of heads = ", heads,
         " (>= 1)");
  }
  checked_add(function, offset, X.rows(), "the positions offset + rows");
  const Index head_dim = X.cols() / heads;
  rope_kernel<T>(X, head_dim, offset, style, rope_table(function, head_dim, options), rotation);
}

/// `rope_checked` on any writable operand: in place when X binds to a row-major `Ref` (a matrix or
/// a row-major block), else through a row-major copy written back (a column-major or strided X).
template <class D>
void rope_checked_any(const char* function, const char* name, Eigen::MatrixBase<D>& X, Index offset,
                      RopeStyle style, const RopeOptions<typename D::Scalar>& options,
                      RopeRotation rotation, Index heads = 1) {
  using T = typename D::Scalar;
  static_assert(is_supported_scalar_v<T>, "attn works on floating-point scalars");
  if constexpr (std::is_constructible_v<Eigen::Ref<Matrix<T>>, D&>) {
    rope_checked<T>(function, name, X.derived(), offset, style, options, rotation, heads);
  } else {
    Matrix<T> copy = X;
    rope_checked<T>(function, name, copy, offset, style, options, rotation, heads);
    X = copy;
  }
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// Rotation
// ------------------------------------------------------------------------------------------------

/// Rotary position embedding (RoPE), in place. Row r of X is rotated for position `offset + r`
/// (RoFormer: Su et al. 2021): pair i turns by `theta = p * base^(-2i/d)` (see `RopeOptions` for
/// partial rotation and position scaling), `(a, b) -> (a cos - b sin, a sin + b cos)`.
/// Pairs: `RopeStyle::Interleaved` (2i, 2i+1): RoFormer, GPT-J, Meta's Llama code, ggml "normal";
/// `RopeStyle::Half` (i, i + d/2): GPT-NeoX, Hugging Face `rotate_half`, ggml "neox".
/// Apply it to Q and K (not V); `q_m . k_n` then depends on the positions only through m - n.
/// \param X        n x d (d = one head's width; even when rotary_dim == 0), modified; a matrix or a
///                 writable row-major block of one
/// \param offset   position of the first row, >= 0
/// \param style    the feature pairing
/// \param options  base, rotary_dim, linear_scale, ntk_scale, and YaRN's yarn_factor,
///                 yarn_original_max_positions, yarn_beta_fast, yarn_beta_slow,
///                 yarn_attention_factor (with YaRN the rotated features, the first d_rot of each
///                 row, also get multiplied by the attention factor)
/// \throws shape_error on a negative offset or invalid options (odd or too large rotary_dim, a
///         base, scale or factor that is not finite and positive, yarn_factor < 1, YaRN without
///         yarn_original_max_positions or together with linear_scale / ntk_scale != 1, ...).
/// \note n * d_rot / 2 cosines and sines (in double) plus 3 n d_rot flops; no allocation beyond
///       the d_rot / 2 frequencies.
template <class D>
void rope_inplace(Eigen::MatrixBase<D>& X, Index offset, RopeStyle style,
                  const RopeOptions<typename D::Scalar>& options = {}) {
  detail::rope_checked_any("rope_inplace", "X", X, offset, style, options,
                           detail::RopeRotation::Forward);
}

/// `rope_inplace` for a temporary writable expression (`M.middleRows(...)`).
/// \param X        n x d, a writable block of a matrix, modified
/// \param offset   position of the first row, >= 0
/// \param style    the feature pairing
/// \param options  see `RopeOptions`
template <class D>
void rope_inplace(Eigen::MatrixBase<D>&& X, Index offset, RopeStyle style,
                  const RopeOptions<typename D::Scalar>& options = {}) {
  rope_inplace(X, offset, style, options);
}

/// Rotary position embedding of a copy of X (see `rope_inplace`), with partial rotation and
/// position scaling: linear, NTK-aware or YaRN (see `RopeOptions`). `rope(X, offset, style)` and
/// `rope(X, offset, style, {})` both use the default options (base 10000, every feature rotated,
/// no scaling).
/// \param X        n x d (d = one head's width; even when rotary_dim == 0)
/// \param offset   position of the first row, >= 0
/// \param style    the feature pairing: `Interleaved` (pairs (2i, 2i+1)) or `Half` (pairs
///                 (i, i + d/2))
/// \param options  see `RopeOptions`
/// \returns n x d: row r rotated for position offset + r (with YaRN, its first d_rot features
///          also multiplied by the attention factor).
/// \throws shape_error as `rope_inplace`.
/// \note As `rope_inplace`, plus the n x d result.
template <class D>
Matrix<typename D::Scalar> rope(const Eigen::MatrixBase<D>& X, Index offset, RopeStyle style,
                                const RopeOptions<typename D::Scalar>& options = {}) {
  using T = typename D::Scalar;
  static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
  Matrix<T> Y = X;
  detail::rope_checked<T>("rope", "X", Y, offset, style, options, detail::RopeRotation::Forward);
  return Y;
}

/// `rope` with the default options but another frequency base: `rope(X, offset, style, 500000)`
/// is `rope(X, offset, style, options)` with `options.base = 500000` (Llama 3's base; most models
/// use 10000). The base is a deduced arithmetic type so that `rope(X, offset, style, {})` can only
/// mean the default options.
/// \param X       n x d, d even
/// \param offset  position of the first row, >= 0
/// \param style   the feature pairing
/// \param base    the frequency base, finite and > 0 (converted to X's scalar type)
/// \returns n x d: row r rotated for position offset + r.
/// \throws shape_error if d is odd, offset < 0 or base is not finite and positive.
template <class D, class Base, std::enable_if_t<std::is_arithmetic_v<Base>, int> = 0>
Matrix<typename D::Scalar> rope(const Eigen::MatrixBase<D>& X, Index offset, RopeStyle style,
                                Base base) {
  using T = typename D::Scalar;
  RopeOptions<T> options;
  options.base = static_cast<T>(base);
  return rope(X, offset, style, options);
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

/// The backward of `rope_inplace`, in place: given dY = dL/dY for Y = rope(X, offset, style,
/// options), overwrites it with dX = dL/dX. Each pair's map is m R(theta) (R the rotation by
/// theta, m YaRN's attention factor, 1 without YaRN), so dX = m R(theta)^T dY = m R(-theta) dY:
/// the same rotation kernel and table as the forward, with the sine negated. The features past
/// d_rot pass dY through. The result is the exact gradient up to the rounding of one rotation
/// (the forward's own error); `rope_backward(rope(X, ...), ...)` is m^2 X up to that rounding.
/// \param dY       n x d (as the forward's X), overwritten with dX; a matrix or a writable block
/// \param offset   the forward's position of the first row, >= 0
/// \param style    the forward's pairing
/// \param options  the forward's options (every field; see `RopeOptions`)
/// \throws shape_error as `rope_inplace` (naming `rope_backward_inplace`).
/// \note As `rope_inplace`: n * d_rot / 2 cosines and sines plus 3 n d_rot flops.
template <class D>
void rope_backward_inplace(Eigen::MatrixBase<D>& dY, Index offset, RopeStyle style,
                           const RopeOptions<typename D::Scalar>& options = {}) {
  detail::rope_checked_any("rope_backward_inplace", "dY", dY, offset, style, options,
                           detail::RopeRotation::Transposed);
}

/// `rope_backward_inplace` for a temporary writable expression (`M.middleRows(...)`).
/// \param dY       n x d, a writable block of a matrix, overwritten with dX
/// \param offset   the forward's position of the first row, >= 0
/// \param style    the forward's pairing
/// \param options  the forward's options
template <class D>
void rope_backward_inplace(Eigen::MatrixBase<D>&& dY, Index offset, RopeStyle style,
                           const RopeOptions<typename D::Scalar>& options = {}) {
  rope_backward_inplace(dY, offset, style, options);
}

/// The backward of `rope`: the gradient dX = dL/dX of a loss L, given dY = dL/dY for
/// Y = rope(X, offset, style, options); see `rope_backward_inplace`. `rope_backward(dY, offset,
/// style)` and `rope_backward(dY, offset, style, {})` use the default options, as `rope` does.
/// \param dY       n x d, the gradient of the loss with respect to rope's output
/// \param offset   the forward's position of the first row, >= 0
/// \param style    the forward's pairing
/// \param options  the forward's options
/// \returns n x d: dX, row r rotated back by position offset + r's angles (and, with YaRN, its
///          first d_rot features multiplied by the attention factor, as in the forward).
/// \throws shape_error as `rope` (naming `rope_backward`).
/// \note As `rope_backward_inplace`, plus the n x d result.
template <class D>
Matrix<typename D::Scalar> rope_backward(const Eigen::MatrixBase<D>& dY, Index offset,
                                         RopeStyle style,
                                         const RopeOptions<typename D::Scalar>& options = {}) {
  using T = typename D::Scalar;
  static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
  Matrix<T> dX = dY;
  detail::rope_checked<T>("rope_backward", "dY", dX, offset, style, options,
                          detail::RopeRotation::Transposed);
  return dX;
}

/// `rope_backward` with the default options but another frequency base, as `rope(X, offset,
/// style, base)`.
/// \param dY      n x d, d even
/// \param offset  the forward's position of the first row, >= 0
/// \param style   the forward's pairing
/// \param base    the forward's frequency base, finite and > 0 (converted to dY's scalar type)
/// \returns n x d: dX.
/// \throws shape_error if d is odd, offset < 0 or base is not finite and positive.
template <class D, class Base, std::enable_if_t<std::is_arithmetic_v<Base>, int> = 0>
Matrix<typename D::Scalar> rope_backward(const Eigen::MatrixBase<D>& dY, Index offset,
                                         RopeStyle style, Base base) {
  using T = typename D::Scalar;
  RopeOptions<T> options;
  options.base = static_cast<T>(base);
  return rope_backward(dY, offset, style, options);
}

// ------------------------------------------------------------------------------------------------
// Several heads side by side
// ------------------------------------------------------------------------------------------------

/// RoPE of every head of X in one call, in place: X holds `heads` heads side by side (n x
/// (heads d), head h in columns [h d, (h + 1) d), as projections and `KVCache` lay them out), and
/// each head is rotated as `rope_inplace` rotates one (the same positions and options for all).
/// \param X        n x (heads d), modified; a matrix or a writable row-major block of one
/// \param heads    >= 1, dividing X's columns
/// \param offset   position of the first row, >= 0
/// \param style    the feature pairing
/// \param options  see `RopeOptions` (rotary_dim counts within one head)
/// \throws shape_error as `rope_inplace`, and when heads does not divide X's columns.
template <class D>
void rope_heads_inplace(Eigen::MatrixBase<D>& X, Index heads, Index offset, RopeStyle style,
                        const RopeOptions<typename D::Scalar>& options = {}) {
  detail::rope_checked_any("rope_heads_inplace", "X", X, offset, style, options,
                           detail::RopeRotation::Forward, heads);
}

/// `rope_heads_inplace` for a temporary writable expression (`M.middleRows(...)`).
/// \param X        n x (heads d), a writable block of a matrix, modified
/// \param heads    >= 1, dividing X's columns
/// \param offset   position of the first row, >= 0
/// \param style    the feature pairing
/// \param options  see `RopeOptions` (rotary_dim counts within one head)
template <class D>
void rope_heads_inplace(Eigen::MatrixBase<D>&& X, Index heads, Index offset, RopeStyle style,
                        const RopeOptions<typename D::Scalar>& options = {}) {
  rope_heads_inplace(X, heads, offset, style, options);
}

/// RoPE of every head of a copy of X (see `rope_heads_inplace`).
/// \param X        n x (heads d)
/// \param heads    >= 1, dividing X's columns
/// \param offset   position of the first row, >= 0
/// \param style    the feature pairing
/// \param options  see `RopeOptions`
/// \returns n x (heads d): row r of each head rotated for position offset + r.
/// \throws shape_error as `rope_heads_inplace`.
template <class D>
Matrix<typename D::Scalar> rope_heads(const Eigen::MatrixBase<D>& X, Index heads, Index offset,
                                      RopeStyle style,
                                      const RopeOptions<typename D::Scalar>& options = {}) {
  using T = typename D::Scalar;
  static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
  Matrix<T> Y = X;
  detail::rope_checked<T>("rope_heads", "X", Y, offset, style, options,
                          detail::RopeRotation::Forward, heads);
  return Y;
}

/// The backward of `rope_heads`: dX for every head, given dY = dL/dY for
/// Y = rope_heads(X, heads, offset, style, options) (see `rope_backward`).
/// \param dY       n x (heads d)
/// \param heads    the forward's head count
/// \param offset   the forward's position of the first row, >= 0
/// \param style    the forward's pairing
/// \param options  the forward's options
/// \returns n x (heads d): dX.
/// \throws shape_error as `rope_heads` (naming `rope_heads_backward`).
template <class D>
Matrix<typename D::Scalar> rope_heads_backward(
    const Eigen::MatrixBase<D>& dY, Index heads, Index offset, RopeStyle style,
    const RopeOptions<typename D::Scalar>& options = {}) {
  using T = typename D::Scalar;
  static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
  Matrix<T> dX = dY;
  detail::rope_checked<T>("rope_heads_backward", "dY", dX, offset, style, options,
                          detail::RopeRotation::Transposed, heads);
  return dX;
}

// ------------------------------------------------------------------------------------------------
// Weight conversion between the pairings
// ------------------------------------------------------------------------------------------------

/// Permutes the columns of a query or key projection, head by head, so that weights trained for
/// one RoPE pairing give identical attention scores under the other: the conversion Hugging Face
/// applies to Meta's Llama checkpoints (`permute` in `convert_llama_weights_to_hf.py`, there on the
/// rows of PyTorch's transposed layout). Interleaved -> Half moves, in each head, column
/// `2i + s` to column `s * d_rot/2 + i` (s = 0, 1); Half -> Interleaved is the inverse; columns
/// past d_rot stay. Pair (2i, 2i+1) of the one style thereby becomes pair (i, i + d_rot/2) of the
/// other, with the same frequency, so `rope(X W') rope(X W')^T` equals `rope(X W) rope(X W)^T` (a
/// permutation of the dot products' terms). Apply it to W_Q and W_K (and their biases, as 1-row
/// matrices), never to W_V.
/// \param W           d_in x (heads * head_dim), in the documents' `Q = X W` layout
/// \param heads       number of heads in W's columns, >= 1
/// \param from, to    the pairing W was made for, and the one it will be used with
/// \param rotary_dim  d_rot of each head (0 = head_dim), even
/// \returns W with its columns permuted (a copy of W when from == to).
/// \throws shape_error if the columns are not a multiple of heads, or d_rot is odd or too large.
template <class D>
Matrix<typename D::Scalar> convert_rope_weights(const Eigen::MatrixBase<D>& W, Index heads,
                                                RopeStyle from, RopeStyle to,
                                                Index rotary_dim = 0) {
  using T = typename D::Scalar;
  const char* function = "convert_rope_weights";
  detail::require_positive_size(function, "heads", heads);
  if (W.cols() % heads != 0) {
    detail::fail(function, "W has ", W.cols(), " columns, not a multiple of heads = ", heads,
                 " (W is ", detail::shape_of(W), ")");
  }
  const Index head_dim = W.cols() / heads;
  const Index d_rot = rotary_dim == 0 ? head_dim : rotary_dim;
  if (d_rot < 0 || d_rot > head_dim || d_rot % 2 != 0) {
    detail::fail(function, "rotary_dim must be even and at most head_dim = ", head_dim, ", got ",
                 rotary_dim, " (W is ", detail::shape_of(W), ", heads = ", heads, ")");
  }
  Matrix<T> out = W;
  if (from == to) return out;
  const Index half = d_rot / 2;
  for (Index h = 0; h < heads; ++h) {
    const Index base = h * head_dim;
    for (Index i = 0; i < half; ++i) {
      for (Index s = 0; s < 2; ++s) {
        const Index interleaved = base + 2 * i + s;
        const Index split = base + s * half + i;
        if (from == RopeStyle::Interleaved) {
          out.col(split) = W.col(interleaved);
        } else {
          out.col(interleaved) = W.col(split);
        }
      }
    }
  }
  return out;
}

}  // namespace attn
