#pragma once
/// \file types.hpp
/// The value types every part of `attn` speaks: row-major matrices, boolean masks, the causal
/// alignments and the per-call options of the score pipeline.

#include <Eigen/Core>
#include <optional>
#include <type_traits>

namespace attn {

/// Sizes and indices are always Eigen's signed index type.
using Index = Eigen::Index;

/// A dense row-major matrix: one row per token.
template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// A row vector (a bias broadcast over rows).
template <class T>
using RowVector = Eigen::Matrix<T, 1, Eigen::Dynamic>;

/// A column vector: one value per query row (row maxima, row sums, log-sum-exp).
template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

/// A boolean n x m mask. `true` means "this query may attend this key", everywhere in `attn`.
using Mask = Eigen::Array<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Which keys a query may see when the attention is causal.
///
/// With `n` queries and `m` keys:
/// - `None`: no causal restriction.
/// - `TopLeft`: query `i` may attend key `j` iff `j <= i` (PyTorch's `is_causal`).
/// - `BottomRight`: iff `j <= i + (m - n)` (decoding with a cache; FlashAttention's rule).
/// The two alignments agree when `n == m`.
enum class Causal { None, TopLeft, BottomRight };

/// How a `KVCache` stores its keys and values (compute and results stay in the cache's `T`):
/// `Same` (T itself), IEEE `Float16`, `BFloat16`, or `Int8` with one scale per token and key/value
/// head (symmetric: x ~ scale * q, q in -127 .. 127, scale = max |x| / 127 of that row).
enum class KVStorage { Same, Float16, BFloat16, Int8 };

/// How rotary position embedding pairs the features: (2i, 2i+1) or (i, i + d/2).
enum class RopeStyle { Interleaved, Half };

/// How a kernel multiplies float queries with keys and values stored in fewer bits (bfloat16 or
/// int8; docs/kv-cache.md): `Widened` widens the stored numbers to float first, so every product
/// is a float product; `Reduced` rounds the other operand to the stored format too and multiplies
/// with the CPU's instructions for it (AVX512_BF16 `vdpbf16ps`; AVX512_VNNI for a decoding step
/// over int8), where the CPU has them and the shapes suit them, else it widens. A per-call choice:
/// one caller's choice never changes another's results.
enum class StoredArithmetic { Widened, Reduced };

/// Options of one attention call. The score pipeline runs in this order:
/// `scale * Q K^T` -> softcap `c * tanh(s / c)` -> `+ bias` and ALiBi -> mask (causal, window,
/// `mask`) -> softmax (with the optional sink in the denominator).
///
/// `shift` below is the query offset: `query_offset` when set, else `m - n` for
/// `Causal::BottomRight` and `0` otherwise. Query `i` stands at key position `i + shift`.
template <class T>
struct AttentionOptions {
  /// Causal alignment; `None` lets every query see every key.
  Causal causal = Causal::None;
  /// Sliding window `w >= 0`: forbid keys `j < i + shift - w` (a query sees itself and `w` keys
  /// before it). It restricts only the past: combine it with `causal` to forbid the future too.
  std::optional<Index> window;
  /// n x m, `true` = may attend.
  std::optional<Mask> mask;
  /// n x m, added to the (scaled, soft-capped) scores before masking. `-inf` entries act as a mask.
  std::optional<Matrix<T>> bias;
  /// Multiplies `Q K^T`; default `1 / sqrt(d_k)`. Must be finite.
  std::optional<T> scale;
  /// `c > 0`: scores become `c * tanh(s / c)` (Gemma 2, Grok).
  std::optional<T> softcap;
  /// Adds `-slope * |i + shift - j|` to the scores (ALiBi, Press et al. 2022).
  std::optional<T> alibi_slope;
  /// A sink logit: adds `exp(sink - max)` to each row's denominator (gpt-oss). It takes weight but
  /// gives no value, so rows may sum to less than 1.
  std::optional<T> sink;
  /// The key position of query 0 (any sign): query `i` stands at position `i + query_offset`.
  /// Unset: `m - n` for `Causal::BottomRight`, 0 otherwise. ONNX Attention with a cache of `p`
  /// past keys is `query_offset = p`.
  std::optional<Index> query_offset;
  /// `r >= 0`: also forbid keys `j > i + shift + r` (a window to the right; with `causal` set the
  /// causal bound is the tighter one).
  std::optional<Index> window_right;
  /// Products with bfloat16 or int8 keys and values (float queries only): widened (default) or in
  /// the stored format's own arithmetic (see `StoredArithmetic`). No effect on other types.
  StoredArithmetic stored_arithmetic = StoredArithmetic::Widened;
};

/// Queries, keys and values of one sequence.
template <class T>
struct QKV {
  Matrix<T> Q;  ///< n x d_k
  Matrix<T> K;  ///< n x d_k
  Matrix<T> V;  ///< n x d_v
};

/// The result of an attention call that also returns its weights.
template <class T>
struct Attention {
  Matrix<T> output;   ///< n x d_v
  Matrix<T> weights;  ///< n x m; each row sums to 1 (0 for a row that may attend nothing)
};

/// Every intermediate table of one attention call, for teaching and debugging.
template <class T>
struct AttentionTrace {
  Matrix<T> scores;   ///< n x m, raw `Q K^T`
  Matrix<T> scaled;   ///< n x m, `scale * Q K^T`, then soft-capped if `softcap` is set
  Matrix<T> masked;   ///< n x m, `scaled + bias + ALiBi`, with disallowed entries at `-inf`
  Vector<T> row_max;  ///< n, the maximum of each `masked` row (and of the sink); `-inf` when empty
  Matrix<T> exp;      ///< n x m, `exp(masked - row_max)`; exactly 0 where masked
  Vector<T> row_sum;  ///< n, the sum of each `exp` row (plus `exp(sink - row_max)`)
  Matrix<T> weights;  ///< n x m, `exp / row_sum`; all zero where `row_sum` is 0
  Matrix<T> output;   ///< n x d_v, `weights V`
};

/// Gradients of one attention call (`attention_backward`): of the loss L, given dO = dL/dO.
template <class T>
struct AttentionGrads {
  Matrix<T> dQ;     ///< n x d_k
  Matrix<T> dK;     ///< m x d_k
  Matrix<T> dV;     ///< m x d_v
  Matrix<T> dbias;  ///< n x m when the options have a `bias` (0 where masked), else empty
  T dsink = T(0);   ///< dL/d(sink) when the options have a `sink`, else 0
};

namespace detail {
template <class T>
inline constexpr bool is_supported_scalar_v = std::is_floating_point_v<T>;

/// True for option types that extend `AttentionOptions<T>` (such as `MultiHeadOptions<T>`): a
/// call that takes `AttentionOptions` must not silently drop their extra fields, so each such call
/// has a deleted overload for them (`{}` still means "no options": it deduces no type).
template <class Options, class T>
inline constexpr bool is_extended_options_v = std::is_base_of_v<AttentionOptions<T>, Options> &&
                                              !std::is_same_v<Options, AttentionOptions<T>>;

/// Enables the deleted overloads that refuse extended option types.
template <class Options, class T>
using if_extended_options = std::enable_if_t<is_extended_options_v<Options, T>, int>;

/// What every kernel takes: a read-only view of a row-major matrix. A column-major matrix or an
/// expression binds too (Eigen evaluates it once into a temporary), so each kernel is compiled once
/// per scalar type, not once per input type.
template <class T>
using ConstRef = Eigen::Ref<const Matrix<T>>;

/// The SIMD packet of scalar T on the instruction set Eigen was compiled for, its lanes and the
/// vector registers there are (32 with AVX-512, 16 elsewhere): what the register tiles are sized by.
template <class T>
struct Simd {
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  static constexpr Index lanes = Eigen::internal::unpacket_traits<Packet>::size;
  static constexpr int registers = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS;
};
}  // namespace detail

}  // namespace attn
