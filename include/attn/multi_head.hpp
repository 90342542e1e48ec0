#pragma once
/// \file multi_head.hpp
/// The `MultiHeadAttention` layer with PyTorch `nn.MultiheadAttention` semantics and weight
/// loading; its heads go through the core of `heads.hpp`. The layer is the Transformer's (Vaswani
/// et al. 2017).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "detail/backward_kernels.hpp"
#include "detail/large_buffers.hpp"
#include "detail/online_softmax.hpp"
#include "detail/paths.hpp"
#include "detail/score_rule.hpp"
#include "error.hpp"
#include "flash.hpp"
#include "heads.hpp"
#include "kv_cache.hpp"
#include "paged_kv_cache.hpp"
#include "projection.hpp"
#include "rope.hpp"
#include "scores.hpp"
#include "tensor.hpp"
#include "threads.hpp"
#include "types.hpp"
#include "variant.hpp"

namespace attn {
namespace detail {

/// Uniform numbers in [0, 1) from a 64-bit Mersenne twister, identical on every platform (the
/// standard distributions are not).
class UniformSource {
 public:
  explicit UniformSource(std::uint64_t seed) : engine_(seed) {}
  double next() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }

 private:
  std::mt19937_64 engine_;
};

/// Xavier (Glorot) uniform: entries in [-a, a], a = sqrt(6 / (fan_in + fan_out)).
template <class T>
Matrix<T> xavier_uniform(Index fan_in, Index fan_out, UniformSource& source) {
  const double bound = std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  Matrix<T> W(fan_in, fan_out);
  for (Index k = 0; k < W.size(); ++k) {
    W.data()[k] = static_cast<T>((2.0 * source.next() - 1.0) * bound);
  }
  return W;
}

}  // namespace detail

/// The shape of a `MultiHeadAttention` layer.
struct MultiHeadConfig {
  Index embed_dim;             ///< d_model: width of the queries and of the output
  Index num_heads;             ///< heads, dividing d_model (head_dim = d_model / heads)
  Index kdim = 0;              ///< width of the keys' input; 0 = embed_dim
  Index vdim = 0;              ///< width of the values' input; 0 = embed_dim
  bool bias = true;            ///< input and output projection biases
  Index num_kv_heads = 0;      ///< 0 = num_heads; fewer gives grouped-query attention
  bool add_bias_kv = false;    ///< PyTorch's add_bias_kv: a learned key/value row appended
  bool add_zero_attn = false;  ///< PyTorch's add_zero_attn: a zero key/value row appended
};

/// Options of a multi-head call: those of every head, plus padding, weight output and the values
/// that differ per head.
template <class T>
struct MultiHeadOptions : AttentionOptions<T> {
  std::optional<Mask> key_valid;  ///< (batch, m): true = a real key, false = padding
  bool need_weights = false;      ///< also return attention weights
  bool average_weights = true;    ///< weights averaged over heads (PyTorch's default)
  HeadOptions<T> per_head;        ///< per-head ALiBi slopes, sinks, (heads, n, m) masks and biases
};

/// The output of `MultiHeadAttention::forward` on a batch.
template <class T>
struct MultiHeadResult {
  Tensor3<T> output;        ///< (batch, n, embed_dim)
  Tensor3<T> weights;       ///< (batch, n, m) when need_weights && average_weights
  Tensor4<T> head_weights;  ///< (batch, heads, n, m) when need_weights && !average_weights
};

/// Working memory of `MultiHeadAttention::forward`, for its hot-path overload: reused by every
/// call, it reallocates only when a shape grows or changes, so repeated calls of one shape allocate
/// nothing on this side (the per-thread score tables of the heads aside).
template <class T>
struct MultiHeadWorkspace {
  Matrix<T> Q;          ///< (batch n, heads head_dim) projected queries
  Matrix<T> K;          ///< (batch m, kv_heads head_dim) projected keys
  Matrix<T> V;          ///< (batch m, kv_heads head_dim) projected values
  Matrix<T> concat;     ///< (batch n, heads head_dim) the heads' outputs side by side
  Matrix<T> K_extra;    ///< (extra, kv_heads head_dim): add_bias_kv / add_zero_attn keys
  Matrix<T> V_extra;    ///< (extra, kv_heads head_dim): their values
  Tensor4<T> per_head;  ///< (batch, heads, n, m') weights to average
  // `backward` only:
  Matrix<T> lse;       ///< (batch heads, n) each head's log-sum-exp over all its keys
  Matrix<T> d_concat;  ///< (batch n, heads head_dim) gradient of the concatenated heads
  Matrix<T> dQ;        ///< (batch n, heads head_dim) gradient of the projected queries
  Matrix<T> dK;        ///< (batch m, kv_heads head_dim) of the projected keys
  Matrix<T> dV;        ///< (batch m, kv_heads head_dim) of the projected values
  Matrix<T> dK_extra;  ///< (batch extra, kv_heads head_dim) of the appended keys, per item
  Matrix<T> dV_extra;  ///< (batch extra, kv_heads head_dim) of the appended values, per item
  /// Ask the system (Linux) for 2 MiB pages when a buffer of 4 MiB or more is allocated, here or in
  /// the result (`detail::resize_large`). The convenience overloads' workspace sets it: their
  /// results go back to the system when their owners drop them, and where page faults are costly
  /// (virtual machines) each such return can make the next touch of other 4 KiB pages fault again.
  /// Off by default: set for the hot path's workspace too, it slowed the hot path (chosen by
  /// measurement; see docs/benchmarks.md).
  bool large_pages = false;
};

namespace detail {
/// This thread's workspace for the convenience overloads of `MultiHeadAttention::forward` and
/// `backward` (those that return their result): kept between calls like the packed keys of the
/// score kernel, each buffer reallocated only when its size changes, so that a repeated call of
/// one shape allocates only the result it returns. Fresh memory is costly where page faults are
/// (virtual machines): a fresh workspace per call made the convenience overload much slower than
/// the hot path (see docs/benchmarks.md). Its `large_pages` is set (see there).
template <class T>
MultiHeadWorkspace<T>& thread_workspace() {
  MultiHeadWorkspace<T>& workspace = thread_buffer<MultiHeadWorkspace<T>, MultiHeadWorkspace<T>>();
  workspace.large_pages = true;
  return workspace;
}
}  // namespace detail

/// The gradients of `MultiHeadAttention::backward`: of the loss L, given dL/d(output), with respect
/// to the inputs and every parameter, in the layer's own layout (`Q = X W_Q`); the `*_grad()`
/// functions give them in PyTorch's layout, named after `load_pytorch`'s parameters.
template <class T>
struct MultiHeadGrads {
  Tensor3<T> d_query;                   ///< (batch, n, embed_dim)
  Tensor3<T> d_key;                     ///< (batch, m, kdim)
  Tensor3<T> d_value;                   ///< (batch, m, vdim)
  Matrix<T> dW_Q;                       ///< (embed_dim, heads head_dim), as W_Q
  Matrix<T> dW_K;                       ///< (kdim, kv_heads head_dim), as W_K
  Matrix<T> dW_V;                       ///< (vdim, kv_heads head_dim), as W_V
  Matrix<T> dW_O;                       ///< (heads head_dim, embed_dim), as W_O
  RowVector<T> db_Q, db_K, db_V, db_O;  ///< as b_Q ... b_O; empty when bias == false
  RowVector<T> d_bias_k, d_bias_v;      ///< as bias_k, bias_v; empty unless add_bias_kv
  /// \var db_Q
  /// As b_Q; empty when bias == false.
  /// \var db_K
  /// As b_K; empty when bias == false.
  /// \var db_V
  /// As b_V; empty when bias == false.
  /// \var d_bias_k
  /// As bias_k; empty unless add_bias_kv.

  /// dL/dx when query, key and value are one tensor x (self-attention, and the single-sequence
  /// `backward`): d_query + d_key + d_value.
  /// \returns (batch, n, embed_dim)
  /// \throws shape_error unless the three have the same shape.
  Tensor3<T> self_input_grad() const {
    const auto same = [&](const Tensor3<T>& t) {
      return t.dimension(0) == d_query.dimension(0) && t.dimension(1) == d_query.dimension(1) &&
             t.dimension(2) == d_query.dimension(2);
    };
    if (!same(d_key) || !same(d_value)) {
      detail::fail("MultiHeadGrads::self_input_grad", "d_query is ", detail::dims_of(d_query),
                   ", d_key ", detail::dims_of(d_key), ", d_value ", detail::dims_of(d_value),
                   ": not one input in three roles");
    }
    Tensor3<T> sum = d_query;
    detail::flatten(sum) += detail::flatten(d_key);
    detail::flatten(sum) += detail::flatten(d_value);
    return sum;
  }

  /// PyTorch's in_proj_weight.grad: [dW_Q^T; dW_K^T; dW_V^T].
  /// \returns (3 E, E)
  /// \throws shape_error unless kdim == vdim == embed_dim and num_kv_heads == num_heads.
  Matrix<T> in_proj_weight_grad() const {
    if (dW_K.rows() != dW_Q.rows() || dW_K.cols() != dW_Q.cols() || dW_V.rows() != dW_Q.rows() ||
        dW_V.cols() != dW_Q.cols() || dW_Q.rows() != dW_Q.cols()) {
      detail::fail("MultiHeadGrads::in_proj_weight_grad", "dW_Q is ", detail::shape_of(dW_Q),
                   ", dW_K ", detail::shape_of(dW_K), ", dW_V ", detail::shape_of(dW_V),
                   ": PyTorch stacks them only when all are E x E (use q/k/v_proj_weight_grad)");
    }
    Matrix<T> stacked(3 * dW_Q.cols(), dW_Q.rows());
    stacked << dW_Q.transpose(), dW_K.transpose(), dW_V.transpose();
    return stacked;
  }
  /// PyTorch's q_proj_weight.grad: dW_Q^T.
  /// \returns (E, E)
  Matrix<T> q_proj_weight_grad() const { return dW_Q.transpose(); }
  /// PyTorch's k_proj_weight.grad: dW_K^T.
  /// \returns (E, kdim)
  Matrix<T> k_proj_weight_grad() const { return dW_K.transpose(); }
  /// PyTorch's v_proj_weight.grad: dW_V^T.
  /// \returns (E, vdim)
  Matrix<T> v_proj_weight_grad() const { return dW_V.transpose(); }
  /// PyTorch's in_proj_bias.grad: [db_Q, db_K, db_V].
  /// \returns 3E entries ((heads + 2 kv_heads) head_dim in general); empty when bias == false
  RowVector<T> in_proj_bias_grad() const {
    if (db_Q.size() == 0) return {};
    RowVector<T> stacked(db_Q.size() + db_K.size() + db_V.size());
    stacked << db_Q, db_K, db_V;
    return stacked;
  }
  /// PyTorch's out_proj.weight.grad: dW_O^T.
  /// \returns (E, heads head_dim)
  Matrix<T> out_proj_weight_grad() const { return dW_O.transpose(); }
  /// PyTorch's out_proj.bias.grad: db_O.
  /// \returns E entries, empty when bias == false
  RowVector<T> out_proj_bias_grad() const { return db_O; }
};

namespace detail {

/// Per-thread working memory of the layer's loop over (batch item, head).
template <class T>
struct LayerScratch {
  PathScratch<T> path;  ///< the head's path (its weights in path.P when they are wanted)
  Matrix<T> P_extra;    ///< n x extra weights of the appended keys
  Matrix<T> O_extra;    ///< n x head_dim output over the appended keys
  Vector<T> lse, lse_extra;
  Vector<T> lse_keys;  ///< the log-sum-exp over the item's keys alone, when the weights are wanted
};

/// Per-thread working memory of the layer's backward over (batch item, key/value head).
template <class T>
struct LayerBackwardScratch {
  AttentionGrads<T> keys;   ///< one head's gradients over the item's keys
  AttentionGrads<T> extra;  ///< over the appended keys
  Vector<T> lse;            ///< the head's log-sum-exp
};

}  // namespace detail

/// Multi-head attention in the documents' convention `Q = X W_Q`, with PyTorch
/// `nn.MultiheadAttention` semantics and weight loading. The layer is the Transformer's (Vaswani
/// et al. 2017).
///
/// Head h uses columns [h * head_dim, (h + 1) * head_dim) of W_Q (and of W_K, W_V for its key/value
/// head h / (num_heads / num_kv_heads)); the heads' outputs are concatenated in head order and
/// multiplied by W_O.
template <class T>
class MultiHeadAttention {
 public:
  /// Builds the layer with Xavier-uniform weights (bound sqrt(6 / (fan_in + fan_out)) per matrix)
  /// drawn from `seed`, and zero biases.
  /// \param config  embed_dim, num_heads, kdim, vdim, bias, num_kv_heads, add_bias_kv,
  ///                add_zero_attn
  /// \param seed    the seed of the weights' random numbers (the same weights on every platform)
  /// \throws shape_error if embed_dim or num_heads is not positive, embed_dim % num_heads != 0, or
  ///         num_heads % num_kv_heads != 0.
  explicit MultiHeadAttention(const MultiHeadConfig& config, std::uint64_t seed = 0)
      : config_(normalised(config)) {
    const Index E = config_.embed_dim;
    const Index width = config_.num_heads * head_dim();
    const Index kv_width = config_.num_kv_heads * head_dim();
    detail::UniformSource source(seed);
    W_Q = detail::xavier_uniform<T>(E, width, source);
    W_K = detail::xavier_uniform<T>(config_.kdim, kv_width, source);
    W_V = detail::xavier_uniform<T>(config_.vdim, kv_width, source);
    W_O = detail::xavier_uniform<T>(width, E, source);
    if (config_.bias) {
      b_Q = RowVector<T>::Zero(width);
      b_K = RowVector<T>::Zero(kv_width);
      b_V = RowVector<T>::Zero(kv_width);
      b_O = RowVector<T>::Zero(E);
    }
    if (config_.add_bias_kv) {
      bias_k = RowVector<T>::Zero(kv_width);
      bias_v = RowVector<T>::Zero(kv_width);
    }
  }

  Matrix<T> W_Q;                    ///< (embed_dim, heads * head_dim)
  Matrix<T> W_K;                    ///< (kdim, kv_heads * head_dim)
  Matrix<T> W_V;                    ///< (vdim, kv_heads * head_dim)
  Matrix<T> W_O;                    ///< (heads * head_dim, embed_dim)
  RowVector<T> b_Q, b_K, b_V, b_O;  ///< the projections' biases; empty when bias == false
  RowVector<T> bias_k, bias_v;      ///< the appended key/value rows; empty unless add_bias_kv
  /// \var b_Q
  /// The bias of the query projection, heads * head_dim entries; empty when bias == false.
  /// \var b_K
  /// The bias of the key projection, kv_heads * head_dim entries; empty when bias == false.
  /// \var b_V
  /// The bias of the value projection, kv_heads * head_dim entries; empty when bias == false.
  /// \var bias_k
  /// The appended key row, kv_heads * head_dim entries; empty unless add_bias_kv.

  /// Rotary position embedding of the projected queries and keys, every head alike (unset: none).
  /// Keys stand at positions 0 .. m - 1 of their item, queries at `query_offset + i` (or the
  /// options' default query offset: m - n for bottom-right causal, 0 otherwise); in `forward_step`
  /// both continue the cache's positions. The appended add_bias_kv / add_zero_attn rows are not
  /// rotated. `rope_options.rotary_dim` counts within one head.
  std::optional<RopeStyle> rope;
  RopeOptions<T> rope_options;  ///< base, rotary_dim and scaling of `rope` (see `RopeOptions`)

  /// The configuration, with kdim, vdim and num_kv_heads filled in where they were 0.
  /// \returns the configuration
  const MultiHeadConfig& config() const { return config_; }
  /// The width of one head.
  /// \returns head_dim = embed_dim / num_heads
  Index head_dim() const { return config_.embed_dim / config_.num_heads; }

  /// Number of learned scalars: 4 d_model^2 + 4 d_model for d_model = 512 and 8 heads, 1,050,624.
  /// \returns the sizes of the weights and biases, summed
  Index parameter_count() const {
    return W_Q.size() + W_K.size() + W_V.size() + W_O.size() + b_Q.size() + b_K.size() +
           b_V.size() + b_O.size() + bias_k.size() + bias_v.size();
  }

  /// Loads PyTorch `nn.MultiheadAttention` tensors (kdim == vdim == embed_dim, no GQA).
  /// \param in_proj_weight   (3E, E): [W_q; W_k; W_v] in PyTorch's layout (y = x W^T + b)
  /// \param in_proj_bias     3E entries, or empty when bias == false
  /// \param out_proj_weight  (E, E)
  /// \param out_proj_bias    E entries, or empty when bias == false
  /// \throws shape_error if a tensor has the wrong shape or the layer is not PyTorch-shaped.
  void load_pytorch(const Matrix<T>& in_proj_weight, const RowVector<T>& in_proj_bias,
                    const Matrix<T>& out_proj_weight, const RowVector<T>& out_proj_bias) {
    const Index E = config_.embed_dim;
    require_pytorch_shaped(true);
    require_shape("in_proj_weight", in_proj_weight, 3 * E, E);
    load_pytorch(in_proj_weight.topRows(E), in_proj_weight.middleRows(E, E),
                 in_proj_weight.bottomRows(E), in_proj_bias, out_proj_weight, out_proj_bias);
  }

  /// Loads PyTorch's separate projections (the kdim/vdim case, `_qkv_same_embed_dim == False`).
  /// \param q_proj_weight  (E, E)
  /// \param k_proj_weight  (E, kdim)
  /// \param v_proj_weight  (E, vdim)
  /// \param in_proj_bias, out_proj_weight, out_proj_bias  as in the other overload
  void load_pytorch(const Matrix<T>& q_proj_weight, const Matrix<T>& k_proj_weight,
                    const Matrix<T>& v_proj_weight, const RowVector<T>& in_proj_bias,
                    const Matrix<T>& out_proj_weight, const RowVector<T>& out_proj_bias) {
    const Index E = config_.embed_dim;
    require_pytorch_shaped(false);
    require_shape("q_proj_weight", q_proj_weight, E, E);
    require_shape("k_proj_weight", k_proj_weight, E, config_.kdim);
    require_shape("v_proj_weight", v_proj_weight, E, config_.vdim);
    require_shape("out_proj_weight", out_proj_weight, E, E);
    const Index bias_size = config_.bias ? 3 * E : 0;
    const Index out_bias_size = config_.bias ? E : 0;
    if (in_proj_bias.size() != bias_size || out_proj_bias.size() != out_bias_size) {
      detail::fail("MultiHeadAttention::load_pytorch", "in_proj_bias has ", in_proj_bias.size(),
                   " and out_proj_bias ", out_proj_bias.size(), " entries but the layer needs ",
                   bias_size, " and ", out_bias_size, " (bias = ", config_.bias ? "true" : "false",
                   ")");
    }
    W_Q = q_proj_weight.transpose();
    W_K = k_proj_weight.transpose();
    W_V = v_proj_weight.transpose();
    W_O = out_proj_weight.transpose();
    if (config_.bias) {
      b_Q = in_proj_bias.segment(0, E);
      b_K = in_proj_bias.segment(E, E);
      b_V = in_proj_bias.segment(2 * E, E);
      b_O = out_proj_bias;
    }
  }

  /// Attention of a batch of queries over a batch of keys and values.
  /// \param query    (batch, n, embed_dim)
  /// \param key      (batch, m, kdim)
  /// \param value    (batch, m, vdim)
  /// \param options  causal, window, mask (n x m, shared by the batch), bias (n x m), scale,
  ///                 softcap, ALiBi, sink (every head, or per head: alibi_slopes, sinks),
  ///                 key_valid (batch x m), weights output
  /// \returns output (batch, n, embed_dim), and weights when asked: head-averaged
  ///          (batch, n, m') or per head (batch, heads, n, m'), m' = m plus one column for each of
  ///          add_bias_kv and add_zero_attn.
  /// \throws shape_error on mismatched shapes or invalid options.
  /// \note One GEMM per projection over the whole batch; heads run on strided views (no copies).
  ///       The working memory is this thread's (`detail::thread_workspace`), kept between calls
  ///       and reallocated only when a size changes: only the result is allocated when the shape
  ///       repeats. Its large buffers and the result's ask for 2 MiB pages (`large_pages`). The
  ///       hot-path overload below leaves that memory to the caller.
  MultiHeadResult<T> forward(const Tensor3<T>& query, const Tensor3<T>& key,
                             const Tensor3<T>& value,
                             const MultiHeadOptions<T>& options = {}) const {
    MultiHeadResult<T> result;
    forward(query, key, value, options, detail::thread_workspace<T>(), result);
    return result;
  }

  /// `forward` into caller storage: the hot path. `workspace` and `result` are reused from call to
  /// call (resized only when a shape changes), which spares the page faults of fresh allocations
  /// (see docs/benchmarks.md).
  /// \param query      (batch, n, embed_dim)
  /// \param key        (batch, m, kdim)
  /// \param value      (batch, m, vdim)
  /// \param options    as for the overload returning its result
  /// \param workspace  working memory, any state (see `MultiHeadWorkspace`)
  /// \param result     overwritten like the value `forward` returns; fields not asked for are
  ///                   left empty
  /// \throws shape_error as `forward`.
  void forward(const Tensor3<T>& query, const Tensor3<T>& key, const Tensor3<T>& value,
               const MultiHeadOptions<T>& options, MultiHeadWorkspace<T>& workspace,
               MultiHeadResult<T>& result) const {
    forward_with<detail::NoVariant>(query, key, value, nullptr, options, workspace, result);
  }

  /// `forward` with a variant (variant.hpp, docs/variants.md): head h of batch item b sees it as
  /// `ScoreAt::batch` b, `head` h and `kv_head` its key/value head, at the positions of the
  /// item's queries and keys; the appended keys (add_bias_kv, add_zero_attn) are seen by every
  /// query, as without a variant. Each head runs the tiled kernel.
  /// \param query    (batch, n, embed_dim)
  /// \param key      (batch, m, kdim)
  /// \param value    (batch, m, vdim)
  /// \param variant  a variant (`is_variant_v`); `checked(variant)` checks every head's tiles
  /// \param options  as without a variant, except `need_weights` (refused: the weights with a
  ///                 variant come from `attention_with_weights` or `trace_attention`)
  /// \returns output (batch, n, embed_dim)
  /// \throws shape_error as `forward`, or when `need_weights` is set.
  template <class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
  MultiHeadResult<T> forward(const Tensor3<T>& query, const Tensor3<T>& key,
                             const Tensor3<T>& value, const Variant& variant,
                             const MultiHeadOptions<T>& options = {}) const {
    MultiHeadResult<T> result;
    forward(query, key, value, variant, options, detail::thread_workspace<T>(), result);
    return result;
  }

  /// `forward` with a variant into caller storage (see the overloads above).
  /// \param query      (batch, n, embed_dim)
  /// \param key        (batch, m, kdim)
  /// \param value      (batch, m, vdim)
  /// \param variant    a variant (`is_variant_v`)
  /// \param options    as for the overload returning its result
  /// \param workspace  working memory, any state
  /// \param result     its output overwritten; no weights
  /// \throws shape_error as `forward`, or when `need_weights` is set.
  template <class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
  void forward(const Tensor3<T>& query, const Tensor3<T>& key, const Tensor3<T>& value,
               const Variant& variant, const MultiHeadOptions<T>& options,
               MultiHeadWorkspace<T>& workspace, MultiHeadResult<T>& result) const {
    check_variant<Variant, T>();
    forward_with<Variant>(query, key, value, &variant, options, workspace, result);
  }

  /// Self-attention of one sequence with a variant: `forward(X, X, X, variant)` without the batch
  /// dimension.
  /// \param X        (n, embed_dim); requires kdim == vdim == embed_dim
  /// \param variant  a variant (`is_variant_v`)
  /// \param options  as for the batched `forward` with a variant
  /// \returns (n, embed_dim)
  template <class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
  Matrix<T> forward(const Matrix<T>& X, const Variant& variant,
                    const MultiHeadOptions<T>& options = {}) const {
    Tensor3<T> x(1, X.rows(), X.cols());
    detail::slice(x, 0) = X;
    const MultiHeadResult<T> result = forward(x, x, x, variant, options);
    return detail::slice(result.output, 0);
  }

 private:
  /// `forward`, with `variant` unless null (Variant NoVariant).
  template <class Variant>
  void forward_with(const Tensor3<T>& query, const Tensor3<T>& key, const Tensor3<T>& value,
                    const Variant* variant, const MultiHeadOptions<T>& options,
                    MultiHeadWorkspace<T>& workspace, MultiHeadResult<T>& result) const {
    const char* function = "MultiHeadAttention::forward";
    const Index batch = query.dimension(0);
    const Index n = query.dimension(1);
    const Index m = key.dimension(1);
    check_inputs(function, query, key, value, options);
    check_variant_call(function, variant, options, batch, n, m);

    // 1. Projections: one GEMM per operand over all batch items.
    MultiHeadWorkspace<T>& ws = workspace;
    project_into(detail::flatten(query), W_Q, b_Q, ws.Q, ws.large_pages);
    project_into(detail::flatten(key), W_K, b_K, ws.K, ws.large_pages);
    project_into(detail::flatten(value), W_V, b_V, ws.V, ws.large_pages);
    rotate(function, ws, options, batch, n, m, detail::RopeRotation::Forward);

    // 2. Each (batch item, head) in parallel (`attend_head`), written straight into the item's
    //    rows and the head's columns of the concatenated heads.
    const Index keys = m + extra_keys();
    const Index heads = config_.num_heads;
    prepare_heads(ws, batch, n);
    Tensor4<T>& per_head = options.average_weights ? ws.per_head : result.head_weights;
    if (options.need_weights) detail::resize_large(per_head, ws.large_pages, batch, heads, n, keys);
    const detail::ScoreRule<T> shared = detail::make_rule<T>(options, n, m, head_dim());
    detail::parallel_for<detail::LayerScratch<T>>(
        n > 0 ? batch * heads : 0, [&](Index bh, detail::LayerScratch<T>& s) {
          attend_head(ws, shared, options, bh / heads, bh % heads, n, m, s, nullptr,
                      options.need_weights ? per_head.data() + bh * n * keys : nullptr, variant);
        });
    if (options.need_weights && options.average_weights) {
      detail::resize_large(result.weights, ws.large_pages, batch, n, keys);
      for (Index b = 0; b < batch; ++b) {
        Eigen::Map<Matrix<T>> average(result.weights.data() + b * n * keys, n, keys);
        average.setZero();
        for (Index h = 0; h < heads; ++h) {  // in head order: the same bits for any thread count
          average +=
              Eigen::Map<const Matrix<T>>(per_head.data() + (b * heads + h) * n * keys, n, keys);
        }
        average /= static_cast<T>(heads);
      }
    }
    if (!options.need_weights || !options.average_weights) result.weights.resize(0, 0, 0);
    if (!options.need_weights || options.average_weights) result.head_weights.resize(0, 0, 0, 0);

    // 3. Output projection, again one GEMM over the batch.
    detail::resize_large(result.output, ws.large_pages, batch, n, config_.embed_dim);
    Eigen::Map<Matrix<T>> output = detail::flatten(result.output);
    project_into(ws.concat, W_O, b_O, output);
  }

 public:
  /// Self-attention of one sequence: `forward(X, X, X)` without the batch dimension.
  /// \param X        (n, embed_dim); requires kdim == vdim == embed_dim
  /// \param options  as for the batched `forward`; `key_valid`, when set, is 1 x n
  /// \returns (n, embed_dim)
  Matrix<T> forward(const Matrix<T>& X, const MultiHeadOptions<T>& options = {}) const {
    Tensor3<T> x(1, X.rows(), X.cols());
    detail::slice(x, 0) = X;
    const MultiHeadResult<T> result = forward(x, x, x, options);
    return detail::slice(result.output, 0);
  }

  /// Gradients of the layer: runs the forward again (keeping each head's log-sum-exp), then the
  /// backward of the output projection, of each head (`attention_backward`'s kernels) and of the
  /// input projections.
  /// \param query     (batch, n, embed_dim)
  /// \param key       (batch, m, kdim)
  /// \param value     (batch, m, vdim)
  /// \param d_output  (batch, n, embed_dim): gradient of the loss with respect to the output
  /// \param options   the forward's options (every field that changes the output; the weights
  ///                  output is not computed)
  /// \returns d_query, d_key, d_value and the gradients of W_Q ... b_O, bias_k, bias_v
  ///          (`MultiHeadGrads`; PyTorch's layout through its `*_grad()` functions)
  /// \throws shape_error on mismatched shapes or invalid options.
  /// \note About 3.5x the forward's flops (the forward included). The options' sinks, biases
  ///       and masks are inputs, not parameters: they get no gradient here
  ///       (`attention_heads_backward` gives dsink and dbias). Identical bits for any thread
  ///       count.
  MultiHeadGrads<T> backward(const Tensor3<T>& query, const Tensor3<T>& key,
                             const Tensor3<T>& value, const Tensor3<T>& d_output,
                             const MultiHeadOptions<T>& options = {}) const {
    MultiHeadGrads<T> grads;
    backward(query, key, value, d_output, options, detail::thread_workspace<T>(), grads);
    return grads;
  }

  /// `backward` into caller storage: `workspace` (any state, shared with `forward`) and `grads`
  /// are reused from call to call, resized only when a shape changes.
  /// \param query      (batch, n, embed_dim)
  /// \param key        (batch, m, kdim)
  /// \param value      (batch, m, vdim)
  /// \param d_output   (batch, n, embed_dim): gradient of the loss with respect to the output
  /// \param options    the forward's options
  /// \param workspace  working memory, any state (see `MultiHeadWorkspace`)
  /// \param grads      overwritten like the value `backward` returns
  /// \throws shape_error as `backward`.
  void backward(const Tensor3<T>& query, const Tensor3<T>& key, const Tensor3<T>& value,
                const Tensor3<T>& d_output, const MultiHeadOptions<T>& options,
                MultiHeadWorkspace<T>& workspace, MultiHeadGrads<T>& grads) const {
    backward_with<detail::NoVariant>(query, key, value, d_output, nullptr, options, workspace,
                                     grads, nullptr);
  }

  /// Gradients of the layer with a variant (see `forward` with a variant): each head's backward
  /// with the variant bound to its batch item, head and key/value head (its score through
  /// `dscore`; a key its mask forbids gets exactly zero gradient).
  /// \param query     (batch, n, embed_dim)
  /// \param key       (batch, m, kdim)
  /// \param value     (batch, m, vdim)
  /// \param d_output  (batch, n, embed_dim)
  /// \param variant   a variant (`is_variant_v`) with `dscore` wherever it has `score`
  /// \param options   the forward's options
  /// \returns as `backward` without a variant
  /// \throws shape_error as `backward`.
  template <class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
  MultiHeadGrads<T> backward(const Tensor3<T>& query, const Tensor3<T>& key,
                             const Tensor3<T>& value, const Tensor3<T>& d_output,
                             const Variant& variant,
                             const MultiHeadOptions<T>& options = {}) const {
    MultiHeadGrads<T> grads;
    backward(query, key, value, d_output, variant, options, detail::thread_workspace<T>(), grads);
    return grads;
  }

  /// `backward` with a variant into caller storage.
  /// \param query, key, value, d_output, variant, options  as in the overload above
  /// \param workspace  working memory, any state
  /// \param grads      overwritten like the value `backward` returns
  /// \throws shape_error as `backward`.
  template <class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
  void backward(const Tensor3<T>& query, const Tensor3<T>& key, const Tensor3<T>& value,
                const Tensor3<T>& d_output, const Variant& variant,
                const MultiHeadOptions<T>& options, MultiHeadWorkspace<T>& workspace,
                MultiHeadGrads<T>& grads) const {
    check_variant<Variant, T, true>();
    backward_with<Variant>(query, key, value, d_output, &variant, options, workspace, grads,
                           nullptr);
  }

  /// `backward` with a learnable variant (`variant_learns_v`, such as `T5Bias`), its parameters'
  /// gradient included: each (batch item, head)'s summed in a fixed order, then theirs in item
  /// and head order (the same bits for any thread count).
  /// \param query, key, value, d_output, variant, options, workspace, grads  as above
  /// \param dparams  receives dL / d(the variant's parameters), as `Variant::Gradient`
  /// \throws shape_error as `backward`.
  template <class Variant, std::enable_if_t<variant_learns_v<Variant>, int> = 0>
  void backward(const Tensor3<T>& query, const Tensor3<T>& key, const Tensor3<T>& value,
                const Tensor3<T>& d_output, const Variant& variant,
                const MultiHeadOptions<T>& options, MultiHeadWorkspace<T>& workspace,
                MultiHeadGrads<T>& grads, typename Variant::Gradient& dparams) const {
    check_variant<Variant, T, true>();
    backward_with<Variant>(query, key, value, d_output, &variant, options, workspace, grads,
                           &dparams);
  }

 private:
  /// `backward`, with `variant` unless null (Variant NoVariant), its parameters' gradient into
  /// `dparams` when not null.
  template <class Variant>
  void backward_with(const Tensor3<T>& query, const Tensor3<T>& key, const Tensor3<T>& value,
                     const Tensor3<T>& d_output, const Variant* variant,
                     const MultiHeadOptions<T>& options, MultiHeadWorkspace<T>& workspace,
                     MultiHeadGrads<T>& grads,
                     typename detail::GradientOf<Variant>::type* dparams) const {
    using Gradient = typename detail::GradientOf<Variant>::type;
    const char* function = "MultiHeadAttention::backward";
    const Index batch = query.dimension(0);
    const Index n = query.dimension(1);
    const Index m = key.dimension(1);
    check_inputs(function, query, key, value, options);
    MultiHeadOptions<T> forward_options = options;
    forward_options.need_weights = false;  // the backward computes no weights
    check_variant_call(function, variant, forward_options, batch, n, m);
    if (d_output.dimension(0) != batch || d_output.dimension(1) != n ||
        d_output.dimension(2) != config_.embed_dim) {
      detail::fail(function, "d_output is ", detail::dims_of(d_output), " but query is ",
                   detail::dims_of(query), ": it must be (batch, n, embed_dim)");
    }
    MultiHeadWorkspace<T>& ws = workspace;
    const Index hd = head_dim();
    const Index heads = config_.num_heads;
    const Index kv_heads = config_.num_kv_heads;
    const Index group = heads / kv_heads;
    const Index extra = extra_keys();

    // 1. The forward again, keeping every head's log-sum-exp (over its keys and the appended
    //    ones, sink included): projections, then each (batch item, head) in parallel.
    project_into(detail::flatten(query), W_Q, b_Q, ws.Q, ws.large_pages);
    project_into(detail::flatten(key), W_K, b_K, ws.K, ws.large_pages);
    project_into(detail::flatten(value), W_V, b_V, ws.V, ws.large_pages);
    rotate(function, ws, options, batch, n, m, detail::RopeRotation::Forward);
    prepare_heads(ws, batch, n);
    detail::resize_large(ws.lse, ws.large_pages, batch * heads, n);
    const detail::ScoreRule<T> shared = detail::make_rule<T>(options, n, m, hd);
    detail::parallel_for<detail::LayerScratch<T>>(
        n > 0 ? batch * heads : 0, [&](Index bh, detail::LayerScratch<T>& s) {
          attend_head(ws, shared, options, bh / heads, bh % heads, n, m, s, ws.lse.data() + bh * n,
                      nullptr, variant);
        });

    // 2. Output projection Y = C W_O + b_O: dW_O = C^T dY, db_O = colsum(dY), dC = dY W_O^T.
    const detail::ConstRef<T> dY = detail::flatten(d_output);
    weight_grad(ws.concat, dY, grads.dW_O);
    bias_grad(dY, grads.db_O);
    detail::resize_large(ws.d_concat, ws.large_pages, batch * n, heads * hd);
    detail::product_kernel<T>(dY, W_O.transpose(), ws.d_concat);

    // 3. Each (batch item, key/value head) a task: its query heads in head order, each by
    //    `backward_kernel` over the item's keys and then over the appended keys (both from the
    //    head's merged output and log-sum-exp, so each block's P is its share of the whole
    //    softmax). dQ of a head is the sum of the two blocks'; dK, dV (and the appended rows')
    //    of the key/value head the sum over its query heads, in head order.
    detail::resize_large(ws.dQ, ws.large_pages, batch * n, heads * hd);
    detail::resize_large(ws.dK, ws.large_pages, batch * m, kv_heads * hd);
    detail::resize_large(ws.dV, ws.large_pages, batch * m, kv_heads * hd);
    ws.dK_extra.resize(batch * extra, kv_heads * hd);
    ws.dV_extra.resize(batch * extra, kv_heads * hd);
    if (n == 0) {  // no query: nothing reaches the keys
      ws.dK.setZero();
      ws.dV.setZero();
      ws.dK_extra.setZero();
      ws.dV_extra.setZero();
    }
    std::vector<Gradient> dparams_heads(dparams ? static_cast<std::size_t>(batch * heads) : 0);
    detail::tasks_or_kernels<detail::LayerBackwardScratch<T>>(
        n > 0 ? batch * kv_heads : 0, [&](Index bkv, detail::LayerBackwardScratch<T>& s) {
          const Index b = bkv / kv_heads;
          const Index kv = bkv % kv_heads;
          for (Index h = kv * group; h < (kv + 1) * group; ++h) {
            const bool first = h == kv * group;
            const detail::ScoreRule<T> rule = item_head_rule(shared, options, b, h, m);
            const detail::ConstRef<T> q = ws.Q.block(b * n, h * hd, n, hd);
            const detail::ConstRef<T> o = ws.concat.block(b * n, h * hd, n, hd);
            const detail::ConstRef<T> d_o = ws.d_concat.block(b * n, h * hd, n, hd);
            Eigen::Ref<Matrix<T>> dq = ws.dQ.block(b * n, h * hd, n, hd);
            s.lse = ws.lse.row(b * heads + h).transpose();
            if (m > 0) {
              detail::backward_kernel<T>(
                  q, ws.K.block(b * m, kv * hd, m, hd), ws.V.block(b * m, kv * hd, m, hd), o, s.lse,
                  d_o, rule, detail::backward_path(rule, hd, hd), BackwardTiles{}, s.keys,
                  detail::BoundVariant<Variant>{variant, b, h, kv},
                  dparams ? &dparams_heads[static_cast<std::size_t>(b * heads + h)] : nullptr);
              dq = s.keys.dQ;
              accumulate(ws.dK.block(b * m, kv * hd, m, hd), s.keys.dK, first);
              accumulate(ws.dV.block(b * m, kv * hd, m, hd), s.keys.dV, first);
            } else {
              dq.setZero();
            }
            if (extra == 0) continue;
            const detail::ScoreRule<T> appended = appended_rule(rule, extra);
            detail::backward_kernel<T>(
                q, ws.K_extra.middleCols(kv * hd, hd), ws.V_extra.middleCols(kv * hd, hd), o, s.lse,
                d_o, appended, detail::backward_path(appended, hd, hd), BackwardTiles{}, s.extra);
            dq += s.extra.dQ;
            accumulate(ws.dK_extra.block(b * extra, kv * hd, extra, hd), s.extra.dK, first);
            accumulate(ws.dV_extra.block(b * extra, kv * hd, extra, hd), s.extra.dV, first);
          }
        });

    // 4. Input projections P = X W + b (rotated by RoPE, when set: its transpose first): dX = dP
    //    W^T, dW = X^T dP, db = colsum(dP); add_bias_kv's rows take the appended keys' (values')
    //    first row, summed over the items in item order.
    rotate_gradients(ws, options, batch, n, m);
    input_grads(query, W_Q, ws.dQ, grads.d_query, grads.dW_Q, grads.db_Q, ws.large_pages);
    input_grads(key, W_K, ws.dK, grads.d_key, grads.dW_K, grads.db_K, ws.large_pages);
    input_grads(value, W_V, ws.dV, grads.d_value, grads.dW_V, grads.db_V, ws.large_pages);
    if (config_.add_bias_kv) {
      grads.d_bias_k.setZero(kv_heads * hd);
      grads.d_bias_v.setZero(kv_heads * hd);
      for (Index b = 0; b < batch; ++b) {
        grads.d_bias_k += ws.dK_extra.row(b * extra);
        grads.d_bias_v += ws.dV_extra.row(b * extra);
      }
    } else {
      grads.d_bias_k.resize(0);
      grads.d_bias_v.resize(0);
    }
    if constexpr (variant_learns_v<Variant>) {
      if (dparams) {  // in item and head order
        *dparams = variant->zero_gradient();
        for (const Gradient& g : dparams_heads) *dparams += g;
      }
    }
  }

 public:
  /// One step of a decoder over a key/value cache: projects x to queries, keys and values, rotates
  /// them by `rope` when set (at the positions that continue the cache's), appends the keys and
  /// values to `cache`, attends the queries over everything the cache keeps (causal; the queries
  /// are the cache's last n positions unless `options.query_offset` says otherwise) and projects
  /// the heads' outputs. A prefill is one step of many rows; decoding, steps of one row. The
  /// result equals the rows of `forward(X)` (causal, bottom right) for the whole sequence, up to
  /// rounding.
  /// \param x        n x embed_dim, the new tokens (self-attention: kdim == vdim == embed_dim)
  /// \param cache    d_k == d_v == head_dim(), kv_heads == num_kv_heads; appended to. A cache that
  ///                 rotates keys itself (`config().rope`) takes the place of the layer's `rope`,
  ///                 which must then be unset
  /// \param options  the cache's attention options (scale, softcap, ALiBi, sink, window, ...)
  /// \returns n x embed_dim
  /// \throws shape_error on mismatched shapes, a layer with add_bias_kv or add_zero_attn, or RoPE
  ///         in both the layer and the cache (before the cache changes); the options are checked
  ///         by `KVCache::attend`, after the append.
  template <class DX>
  Matrix<T> forward_step(const Eigen::MatrixBase<DX>& x, KVCache<T>& cache,
                         const AttentionOptions<T>& options = {}) const {
    return forward_step_with<detail::NoVariant>(x, cache, nullptr, options);
  }

  /// `forward_step` with a variant: the cache attends with it (`KVCache::attend` with a variant:
  /// each query and key at its absolute position, query head h as `ScoreAt::head`).
  /// \param x        n x embed_dim, the new tokens
  /// \param cache    as for `forward_step`; appended to
  /// \param variant  a variant (`is_variant_v`)
  /// \param options  the cache's attention options
  /// \returns n x embed_dim
  /// \throws shape_error as `forward_step`.
  template <class DX, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
  Matrix<T> forward_step(const Eigen::MatrixBase<DX>& x, KVCache<T>& cache, const Variant& variant,
                         const AttentionOptions<T>& options = {}) const {
    check_variant<Variant, T>();
    return forward_step_with<Variant>(x, cache, &variant, options);
  }

  /// One step of a decoder for a batch of sequences in a paged cache, in one call: rows
  /// [cu_seqlens[b], cu_seqlens[b + 1]) of x are sequence ids[b]'s new tokens (a chunk of a
  /// prompt, or one token of a decoding step). Projects all rows at once, rotates each sequence's
  /// by `rope` when set (at the positions that continue it), appends them to their sequences
  /// (one `PagedKVCache::append`), attends each sequence's queries over its tokens (one
  /// `PagedKVCache::attend`) and projects the heads' outputs. Each sequence's rows are those of
  /// `forward_step` on it alone with a `KVCache` of the same configuration holding the same
  /// tokens.
  /// \param x           total x embed_dim, the sequences' new tokens packed by rows
  /// \param cache       d_k == d_v == head_dim(), kv_heads == num_kv_heads; appended to
  /// \param ids         existing sequences of `cache`, each listed once
  /// \param cu_seqlens  ids.size() + 1 offsets of their rows in x
  /// \param options     shared or per-sequence attention options
  /// \returns total x embed_dim
  /// \throws shape_error as `forward_step`, and as `PagedKVCache::append` (before anything
  ///         changes: unknown ids, offsets, too few free pages) and `attend`.
  template <class DX>
  Matrix<T> forward_step(const Eigen::MatrixBase<DX>& x, PagedKVCache<T>& cache,
                         const std::vector<Index>& ids, const std::vector<int>& cu_seqlens,
                         const SequenceOptions<T>& options = {}) const {
    const char* function = "MultiHeadAttention::forward_step";
    Matrix<T> Q, K, V;
    project_step(function, x, cache.config(), Q, K, V);
    const Index hd = head_dim();
    if (rope && cu_seqlens.size() == ids.size() + 1 && cu_seqlens.back() == x.rows()) {
      const detail::RopeTable table = detail::rope_table(function, hd, rope_options);
      for (std::size_t b = 0; b < ids.size(); ++b) {
        const Index first = cache.contains(ids[b]) ? cache.length(ids[b]) : 0;
        const Index n = cu_seqlens[b + 1] - cu_seqlens[b];
        const auto& own = options.of(static_cast<Index>(b));
        const Index q_first = own.query_offset ? *own.query_offset : first;
        if (n <= 0) continue;
        if (q_first < 0) {
          detail::fail(function, "with RoPE the queries' position must be >= 0, got ", q_first);
        }
        detail::checked_add(function, first, n, "the positions of the new keys");
        detail::checked_add(function, q_first, n, "the positions of the queries");
        detail::rope_kernel<T>(Q.middleRows(cu_seqlens[b], n), hd, q_first, *rope, table);
        detail::rope_kernel<T>(K.middleRows(cu_seqlens[b], n), hd, first, *rope, table);
      }
    }
    cache.append(ids, cu_seqlens, K, V);
    Matrix<T> heads_out;
    cache.attend(ids, cu_seqlens, Q, options, {}, heads_out);
    Matrix<T> out;
    project_into(heads_out, W_O, b_O, out);
    return out;
  }

 private:
  /// The start of a cache step: its checks (`check_cache_step`), then x projected to the queries,
  /// keys and values.
  template <class DX>
  void project_step(const char* function, const Eigen::MatrixBase<DX>& x,
                    const KVCacheConfig<T>& cc, Matrix<T>& Q, Matrix<T>& K, Matrix<T>& V) const {
    static_assert(std::is_same_v<typename DX::Scalar, T>, "x must have the layer's scalar type");
    check_cache_step(function, x, cc);
    const detail::ConstRef<T> input(x);
    project_into(input, W_Q, b_Q, Q);
    project_into(input, W_K, b_K, K);
    project_into(input, W_V, b_V, V);
  }

  /// The checks of a cache step: x's width, a layer with a cache step (self-attention, no extra
  /// keys), the cache's widths and heads, RoPE in one place only.
  template <class DX>
  void check_cache_step(const char* function, const Eigen::MatrixBase<DX>& x,
                        const KVCacheConfig<T>& cc) const {
    const Index hd = head_dim();
    if (x.cols() != config_.embed_dim || config_.kdim != config_.embed_dim ||
        config_.vdim != config_.embed_dim) {
      detail::fail(function, "x is ", detail::shape_of(x), " but the layer needs ",
                   config_.embed_dim, " columns and kdim == vdim == embed_dim (kdim ", config_.kdim,
                   ", vdim ", config_.vdim, ")");
    }
    if (extra_keys() > 0) {
      detail::fail(function, "a layer with add_bias_kv or add_zero_attn has no cache step");
    }
    if (cc.d_k != hd || cc.d_v != hd || cc.kv_heads != config_.num_kv_heads) {
      detail::fail(function, "the cache holds ", cc.kv_heads, " key/value heads of d_k = ", cc.d_k,
                   ", d_v = ", cc.d_v, " but the layer has ", config_.num_kv_heads, " of head_dim ",
                   hd);
    }
    if (rope && cc.rope) {
      detail::fail(function, "both the layer and the cache apply RoPE: set one of them");
    }
  }

  /// `forward_step`, with `variant` unless null (Variant NoVariant).
  template <class Variant, class DX>
  Matrix<T> forward_step_with(const Eigen::MatrixBase<DX>& x, KVCache<T>& cache,
                              const Variant* variant, const AttentionOptions<T>& options) const {
    const char* function = "MultiHeadAttention::forward_step";
    Matrix<T> Q, K, V;
    project_step(function, x, cache.config(), Q, K, V);
    const Index hd = head_dim();
    if (rope) {
      const Index first = cache.position();
      const Index q_first = options.query_offset ? *options.query_offset : first;
      if (q_first < 0) {
        detail::fail(function, "with RoPE the queries' position must be >= 0, got ", q_first);
      }
      const detail::RopeTable table = detail::rope_table(function, hd, rope_options);
      detail::checked_add(function, first, x.rows(), "the positions of the new keys");
      detail::checked_add(function, q_first, x.rows(), "the positions of the queries");
      detail::rope_kernel<T>(Q, hd, q_first, *rope, table);
      detail::rope_kernel<T>(K, hd, first, *rope, table);
    }
    cache.append(K, V);
    Matrix<T> heads_out;
    if constexpr (is_variant_v<Variant>) {
      cache.attend(Q, *variant, options, {}, heads_out);
    } else {
      cache.attend(Q, options, heads_out);
    }
    Matrix<T> out;
    project_into(heads_out, W_O, b_O, out);
    return out;
  }

 public:
  /// Gradients of the single-sequence self-attention `forward(X)`: `backward(X, X, X, ...)`
  /// without the batch dimension.
  /// \param X         (n, embed_dim); requires kdim == vdim == embed_dim
  /// \param d_output  (n, embed_dim)
  /// \param options   the forward's options
  /// \returns the gradients with batch 1: X's three roles in d_query, d_key, d_value (their sum,
  ///          dL/dX, is `self_input_grad()`), and the parameters'
  MultiHeadGrads<T> backward(const Matrix<T>& X, const Matrix<T>& d_output,
                             const MultiHeadOptions<T>& options = {}) const {
    Tensor3<T> x(1, X.rows(), X.cols());
    detail::slice(x, 0) = X;
    Tensor3<T> dy(1, d_output.rows(), d_output.cols());
    detail::slice(dy, 0) = d_output;
    return backward(x, x, x, dy, options);
  }

 private:
  static MultiHeadConfig normalised(MultiHeadConfig config) {
    const char* function = "MultiHeadAttention";
    if (config.embed_dim <= 0 || config.num_heads <= 0) {
      detail::fail(function,
                   "embed_dim and num_heads must be positive, got embed_dim = ", config.embed_dim,
                   ", num_heads = ", config.num_heads);
    }
    if (config.embed_dim % config.num_heads != 0) {
      detail::fail(function, "embed_dim ", config.embed_dim, " is not divisible by num_heads ",
                   config.num_heads);
    }
    if (config.kdim < 0 || config.vdim < 0 || config.num_kv_heads < 0) {
      detail::fail(function, "kdim, vdim and num_kv_heads must be >= 0 (0 = default)");
    }
    if (config.kdim == 0) config.kdim = config.embed_dim;
    if (config.vdim == 0) config.vdim = config.embed_dim;
    if (config.num_kv_heads == 0) config.num_kv_heads = config.num_heads;
    if (config.num_heads % config.num_kv_heads != 0) {
      detail::fail(function, "num_heads ", config.num_heads, " is not divisible by num_kv_heads ",
                   config.num_kv_heads);
    }
    return config;
  }

  template <class M>
  static void require_shape(const char* name, const M& m, Index rows, Index cols) {
    if (m.rows() != rows || m.cols() != cols) {
      detail::fail("MultiHeadAttention::load_pytorch", name, " is ", detail::shape_of(m),
                   " but the layer needs ", rows, " x ", cols);
    }
  }

  void require_pytorch_shaped(bool same_embed_dim) const {
    if (config_.num_kv_heads != config_.num_heads) {
      detail::fail(
          "MultiHeadAttention::load_pytorch",
          "PyTorch's nn.MultiheadAttention has no grouped-query attention (num_kv_heads = ",
          config_.num_kv_heads, ", num_heads = ", config_.num_heads, ")");
    }
    if (same_embed_dim &&
        (config_.kdim != config_.embed_dim || config_.vdim != config_.embed_dim)) {
      detail::fail("MultiHeadAttention::load_pytorch", "kdim ", config_.kdim, " or vdim ",
                   config_.vdim, " differs from embed_dim ", config_.embed_dim,
                   ": use the q/k/v_proj_weight overload");
    }
  }

  /// Y = X W + b over all rows (b empty = no bias), with the register-tiled kernel of `scores`
  /// (`detail::product_kernel`: W read in place or packed once, rows in parallel; each entry is one
  /// sum in feature order, so the same bits for any thread count). Y is resized (a matrix) or must
  /// have the right shape (a map); `large_pages` as `MultiHeadWorkspace::large_pages`.
  template <class Out>
  static void project_into(const detail::ConstRef<T>& X, const Matrix<T>& W, const RowVector<T>& b,
                           Out& Y, bool large_pages = false) {
    if constexpr (std::is_same_v<Out, Matrix<T>>) {
      detail::resize_large(Y, large_pages, X.rows(), W.cols());
    }
    detail::product_kernel<T>(X, W, Y);
    if (b.size() > 0) Y.rowwise() += b;
  }

  /// RoPE (or its transpose) of the projected queries and keys of every batch item, in place:
  /// item b's queries at the call's query positions, its keys at 0 .. m - 1. Nothing without
  /// `rope`.
  void rotate(const char* function, MultiHeadWorkspace<T>& ws, const MultiHeadOptions<T>& options,
              Index batch, Index n, Index m, detail::RopeRotation rotation) const {
    if (!rope) return;
    const Index hd = head_dim();
    const Index q_first = detail::query_position(options, n, m);
    if (q_first < 0) {
      detail::fail(function, "with RoPE the queries' position must be >= 0, got ", q_first,
                   " (query_offset, or m - n = ", m - n, " for bottom-right causal)");
    }
    detail::checked_add(function, q_first, n, "the queries' positions");
    const detail::RopeTable table = detail::rope_table(function, hd, rope_options);
    for (Index b = 0; b < batch; ++b) {
      detail::rope_kernel<T>(ws.Q.middleRows(b * n, n), hd, q_first, *rope, table, rotation);
      detail::rope_kernel<T>(ws.K.middleRows(b * m, m), hd, 0, *rope, table, rotation);
    }
  }

  /// The backward of `rotate` on the gradients of the projected queries and keys (`ws.dQ`,
  /// `ws.dK`): the transposed rotation.
  void rotate_gradients(MultiHeadWorkspace<T>& ws, const MultiHeadOptions<T>& options, Index batch,
                        Index n, Index m) const {
    if (!rope) return;
    const Index hd = head_dim();
    const Index q_first = detail::query_position(options, n, m);
    const detail::RopeTable table =
        detail::rope_table("MultiHeadAttention::backward", hd, rope_options);
    for (Index b = 0; b < batch; ++b) {
      detail::rope_kernel<T>(ws.dQ.middleRows(b * n, n), hd, q_first, *rope, table,
                             detail::RopeRotation::Transposed);
      detail::rope_kernel<T>(ws.dK.middleRows(b * m, m), hd, 0, *rope, table,
                             detail::RopeRotation::Transposed);
    }
  }

  /// Rows appended to every item's keys: one for add_bias_kv, one for add_zero_attn.
  Index extra_keys() const {
    return (config_.add_bias_kv ? 1 : 0) + (config_.add_zero_attn ? 1 : 0);
  }

  /// Sizes the concatenated heads (batch n, heads head_dim) and builds the appended key/value rows.
  void prepare_heads(MultiHeadWorkspace<T>& ws, Index batch, Index n) const {
    if (extra_keys() > 0) {
      extra_rows(bias_k, ws.K_extra);
      extra_rows(bias_v, ws.V_extra);
    }
    detail::resize_large(ws.concat, ws.large_pages, batch * n, config_.num_heads * head_dim());
  }

  /// A call with a variant refuses the weights output and, in the checking mode (`checked`),
  /// checks every (batch item, head)'s tiles before anything is computed. Nothing without one.
  template <class Variant>
  void check_variant_call(const char* function, const Variant* variant,
                          const MultiHeadOptions<T>& options, Index batch, Index n, Index m) const {
    if constexpr (is_variant_v<Variant>) {
      detail::require_variant_positions(function, detail::query_position<T>(options, n, m), n, 0,
                                        m);
      if (options.need_weights) {
        detail::fail(function, "need_weights with a variant: its weights come from ",
                     "attention_with_weights or trace_attention with the same variant");
      }
      if constexpr (detail::is_checked<Variant>::value) {
        const detail::ScoreRule<T> shared = detail::make_rule<T>(options, n, m, head_dim());
        const Index group = config_.num_heads / config_.num_kv_heads;
        for (Index b = 0; b < batch; ++b) {
          for (Index h = 0; h < config_.num_heads; ++h) {
            detail::check_kernel_tiles<T>(item_head_rule(shared, options, b, h, m), FlashTiles{},
                                          detail::BoundVariant<Variant>{variant, b, h, h / group});
          }
        }
      }
    } else {
      static_cast<void>(function), static_cast<void>(variant), static_cast<void>(options);
      static_cast<void>(batch), static_cast<void>(n), static_cast<void>(m);
    }
  }

  /// The rule of head h of batch item b over the item's m keys: the call's rule, head h's values
  /// from `options.per_head`, the item's row of key padding.
  static detail::ScoreRule<T> item_head_rule(const detail::ScoreRule<T>& shared,
                                             const MultiHeadOptions<T>& options, Index b, Index h,
                                             Index m) {
    detail::ScoreRule<T> rule =
        options.per_head.any() ? detail::head_rule(shared, options.per_head, h) : shared;
    if (options.key_valid) rule.key_valid = {options.key_valid->data() + b * m, 0};
    return rule;
  }

  /// The rule of PyTorch's appended keys (add_bias_kv, add_zero_attn): every query sees them, with
  /// the scale and uniform stages (softcap) of `rule`; no mask, bias, ALiBi or sink.
  static detail::ScoreRule<T> appended_rule(const detail::ScoreRule<T>& rule, Index extra) {
    return rule.uniform_part(rule.n, extra);
  }

  /// Head h of batch item b, by the path `detail::choose_path` picks: its output into its block
  /// of `ws.concat`; its log-sum-exp over all its keys, sink included, into `lse` (n entries)
  /// when not null; its weights into `weights` (n x (m + extra)) when not null. The appended
  /// keys (add_bias_kv, add_zero_attn) are a second block of keys, merged with the first by the
  /// merge protocol (`detail::merge_block`, the sink added once).
  /// With a variant (not null), the item's keys run the tiled kernel with it.
  template <class Variant>
  void attend_head(MultiHeadWorkspace<T>& ws, const detail::ScoreRule<T>& shared,
                   const MultiHeadOptions<T>& options, Index b, Index h, Index n, Index m,
                   detail::LayerScratch<T>& s, T* lse, T* weights, const Variant* variant) const {
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    const Index hd = head_dim();
    const Index kv = h / (config_.num_heads / config_.num_kv_heads);
    const Index extra = extra_keys();
    const Index keys = m + extra;
    detail::ScoreRule<T> rule = item_head_rule(shared, options, b, h, m);
    const std::optional<T> sink = rule.sink;
    if (extra > 0) rule.sink.reset();
    const detail::ConstRef<T> q = ws.Q.block(b * n, h * hd, n, hd);
    Eigen::Ref<Matrix<T>> o = ws.concat.block(b * n, h * hd, n, hd);
    if (extra > 0 && lse == nullptr) {
      s.lse.resize(n);
      lse = s.lse.data();
    }
    if (lse) std::fill(lse, lse + n, neg_inf);
    if (m > 0) {
      const detail::ConstRef<T> k = ws.K.block(b * m, kv * hd, m, hd);
      const detail::ConstRef<T> v = ws.V.block(b * m, kv * hd, m, hd);
      if constexpr (is_variant_v<Variant>) {
        detail::flash_blocks<T>(q, k, v, rule, FlashTiles{}, s.path.flash, o, lse,
                                detail::BoundVariant<Variant>{variant, b, h, kv});
      } else {
        detail::run_path<T>(detail::choose_path(rule, hd, hd, weights != nullptr), q, k, v, rule,
                            s.path, o, lse);
      }
    } else {
      o.setZero();  // no key: a zero row (and no view into the empty K and V)
    }
    Eigen::Map<Matrix<T>> P(weights, weights ? n : 0, keys);
    if (weights && m > 0) P.leftCols(m) = s.path.P;
    if (extra == 0) return;
    s.O_extra.resize(n, hd);
    s.lse_extra.resize(n);
    detail::materialised_kernel<T>(q, ws.K_extra.middleCols(kv * hd, hd),
                                   ws.V_extra.middleCols(kv * hd, hd), appended_rule(rule, extra),
                                   s.P_extra, s.O_extra, s.lse_extra.data());
    if (weights) s.lse_keys = Eigen::Map<const Vector<T>>(lse, n);
    detail::merge_block<T>(o, lse, s.O_extra, s.lse_extra.data());
    detail::finish_merge<T>(o, lse, sink);
    if (weights) {  // each block's weights, renormalised to the merged sum
      for (Index i = 0; i < n; ++i) {
        P.row(i).head(m) *= std::exp(s.lse_keys(i) - lse[i]);
        P.row(i).tail(extra) = s.P_extra.row(i) * std::exp(s.lse_extra(i) - lse[i]);
      }
    }
  }

  /// dst = src (first) or dst += src: a sum over heads in head order.
  static void accumulate(Eigen::Ref<Matrix<T>> dst, const Matrix<T>& src, bool first) {
    if (first) {
      dst = src;
    } else {
      dst += src;
    }
  }

  /// dW = X^T dY (the shape of W) by the projections' own kernel (one sum in row order per entry,
  /// the same bits for any thread count).
  static void weight_grad(const detail::ConstRef<T>& X, const detail::ConstRef<T>& dY,
                          Matrix<T>& dW) {
    dW.resize(X.cols(), dY.cols());
    detail::product_kernel<T>(X.transpose(), dY, dW);
  }

  /// db = colsum(dY) when the layer has biases, else empty.
  void bias_grad(const detail::ConstRef<T>& dY, RowVector<T>& db) const {
    if (config_.bias) {
      db = dY.colwise().sum();
    } else {
      db.resize(0);
    }
  }

  /// The backward of one input projection P = X W + b from dP: dX (the shape of X), dW, db.
  void input_grads(const Tensor3<T>& X, const Matrix<T>& W, const Matrix<T>& dP, Tensor3<T>& dX,
                   Matrix<T>& dW, RowVector<T>& db, bool large_pages) const {
    detail::resize_large(dX, large_pages, X.dimension(0), X.dimension(1), X.dimension(2));
    Eigen::Map<Matrix<T>> dX_flat = detail::flatten(dX);
    detail::product_kernel<T>(dP, W.transpose(), dX_flat);
    weight_grad(detail::flatten(X), dP, dW);
    bias_grad(dP, db);
  }

  /// PyTorch's appended key (or value) rows, the same for every batch item: the learned
  /// bias_k/bias_v row (add_bias_kv), then a zero row (add_zero_attn).
  void extra_rows(const RowVector<T>& bias_row, Matrix<T>& out) const {
    out.resize(extra_keys(), config_.num_kv_heads * head_dim());
    Index next = 0;
    if (config_.add_bias_kv) out.row(next++) = bias_row;
    if (config_.add_zero_attn) out.row(next).setZero();
  }

  void check_inputs(const char* function, const Tensor3<T>& query, const Tensor3<T>& key,
                    const Tensor3<T>& value, const MultiHeadOptions<T>& options) const {
    const auto mismatch = [&](const std::string& what) {
      detail::fail(function, what, " (query is ", detail::dims_of(query), ", key is ",
                   detail::dims_of(key), ", value is ", detail::dims_of(value),
                   "; batch x tokens x features)");
    };
    if (query.dimension(2) != config_.embed_dim) {
      mismatch("query has " + std::to_string(query.dimension(2)) + " features but embed_dim is " +
               std::to_string(config_.embed_dim));
    }
    if (key.dimension(2) != config_.kdim) {
      mismatch("key has " + std::to_string(key.dimension(2)) + " features but kdim is " +
               std::to_string(config_.kdim));
    }
    if (value.dimension(2) != config_.vdim) {
      mismatch("value has " + std::to_string(value.dimension(2)) + " features but vdim is " +
               std::to_string(config_.vdim));
    }
    if (key.dimension(0) != query.dimension(0) || value.dimension(0) != query.dimension(0)) {
      mismatch("query, key and value must have the same batch size");
    }
    if (key.dimension(1) != value.dimension(1)) {
      mismatch("key and value must have the same number of tokens");
    }
    detail::check_options(function, static_cast<const AttentionOptions<T>&>(options),
                          query.dimension(1), key.dimension(1));
    if (options.key_valid) {
      detail::require_table(function, "key_valid", *options.key_valid, query.dimension(0),
                            key.dimension(1));
    }
    detail::check_head_options(function, options, options.per_head, config_.num_heads,
                               query.dimension(1), key.dimension(1));
    if ((options.alibi_slope || options.per_head.alibi_slopes) &&
        (config_.add_bias_kv || config_.add_zero_attn)) {
      detail::fail(function, "alibi_slope is not defined for the extra key positions of ",
                   "add_bias_kv / add_zero_attn");
    }
  }

  MultiHeadConfig config_;
};

}  // namespace attn
