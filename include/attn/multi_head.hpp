#pragma once
/// \file multi_head.hpp
/// The `MultiHeadAttention` layer (Vaswani et al. 2017) with PyTorch `nn.MultiheadAttention`
/// semantics and weight loading; its heads go through the core of `heads.hpp`.

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "detail/online_softmax.hpp"
#include "detail/paths.hpp"
#include "detail/score_rule.hpp"
#include "error.hpp"
#include "heads.hpp"
#include "projection.hpp"
#include "scores.hpp"
#include "tensor.hpp"
#include "threads.hpp"
#include "types.hpp"

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
  Index embed_dim;             ///< E: width of the queries and of the output
  Index num_heads;             ///< heads; E must be divisible by it (head_dim = E / heads)
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
};

namespace detail {

/// Per-thread working memory of the layer's loop over (batch item, head).
template <class T>
struct LayerScratch {
  PathScratch<T> path;  ///< the head's path (its weights in path.P when they are wanted)
  Matrix<T> P_extra;    ///< n x extra weights of the appended keys
  Matrix<T> O_extra;    ///< n x head_dim output over the appended keys
  Vector<T> lse, lse_extra;
};

}  // namespace detail

/// Multi-head attention (Vaswani et al. 2017), in the documents' convention `Q = X W_Q`, with
/// PyTorch `nn.MultiheadAttention` semantics and weight loading.
///
/// Head h uses columns [h * head_dim, (h + 1) * head_dim) of W_Q (and of W_K, W_V for its key/value
/// head h / (num_heads / num_kv_heads)); the heads' outputs are concatenated in head order and
/// multiplied by W_O.
template <class T>
class MultiHeadAttention {
 public:
  /// Builds the layer with Xavier-uniform weights (bound sqrt(6 / (fan_in + fan_out)) per matrix)
  /// drawn from `seed`, and zero biases.
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

  const MultiHeadConfig& config() const { return config_; }
  Index head_dim() const { return config_.embed_dim / config_.num_heads; }

  /// Number of learned scalars: 4 E^2 + 4 E for E = 512 and 8 heads, 1,050,624.
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
  /// \param query  (batch, n, embed_dim)
  /// \param key    (batch, m, kdim)
  /// \param value  (batch, m, vdim)
  /// \param options  causal, window, mask (n x m, shared by the batch), bias (n x m), scale,
  ///                 softcap, ALiBi, sink (every head, or per head: alibi_slopes, sinks),
  ///                 key_valid (batch x m), weights output
  /// \returns output (batch, n, embed_dim), and weights when asked: head-averaged
  ///          (batch, n, m') or per head (batch, heads, n, m'), m' = m plus one column for each of
  ///          add_bias_kv and add_zero_attn.
  /// \throws shape_error on mismatched shapes or invalid options.
  /// \note One GEMM per projection over the whole batch; heads run on strided views (no copies).
  MultiHeadResult<T> forward(const Tensor3<T>& query, const Tensor3<T>& key,
                             const Tensor3<T>& value,
                             const MultiHeadOptions<T>& options = {}) const {
    MultiHeadWorkspace<T> workspace;
    MultiHeadResult<T> result;
    forward(query, key, value, options, workspace, result);
    return result;
  }

  /// `forward` into caller storage: the hot path. `workspace` and `result` are reused from call to
  /// call (resized only when a shape changes), which spares the page faults of fresh allocations:
  /// at (batch 8, 128 tokens, E = 512) they were most of the time of a call.
  /// \param workspace  working memory, any state (see `MultiHeadWorkspace`)
  /// \param result     overwritten like the value `forward` returns; fields not asked for are
  ///                   left empty
  /// \throws shape_error as `forward`.
  void forward(const Tensor3<T>& query, const Tensor3<T>& key, const Tensor3<T>& value,
               const MultiHeadOptions<T>& options, MultiHeadWorkspace<T>& workspace,
               MultiHeadResult<T>& result) const {
    const char* function = "MultiHeadAttention::forward";
    const Index batch = query.dimension(0);
    const Index n = query.dimension(1);
    const Index m = key.dimension(1);
    check_inputs(function, query, key, value, options);

    // 1. Projections: one GEMM per operand over all batch items.
    MultiHeadWorkspace<T>& ws = workspace;
    project_into(detail::flatten(query), W_Q, b_Q, ws.Q);
    project_into(detail::flatten(key), W_K, b_K, ws.K);
    project_into(detail::flatten(value), W_V, b_V, ws.V);

    // 2. Each (batch item, head) in parallel, on the path `detail::choose_path` picks, written
    //    straight into the item's rows and the head's columns of the concatenated heads. Key
    //    padding is the rule's key_valid row of the item. PyTorch's appended keys (add_bias_kv,
    //    add_zero_attn) are seen by every query: they are a second block of keys, merged with
    //    the first by log-sum-exp (`detail::merge_partial`); the sink is added once after it.
    const Index extra = (config_.add_bias_kv ? 1 : 0) + (config_.add_zero_attn ? 1 : 0);
    const Index keys = m + extra;
    const Index hd = head_dim();
    const Index heads = config_.num_heads;
    const Index group = heads / config_.num_kv_heads;
    if (extra > 0) {
      extra_rows(bias_k, ws.K_extra);
      extra_rows(bias_v, ws.V_extra);
    }
    Tensor4<T>& per_head = options.average_weights ? ws.per_head : result.head_weights;
    if (options.need_weights) per_head.resize(batch, heads, n, keys);
    ws.concat.resize(batch * n, heads * hd);
    const detail::ScoreRule<T> shared = detail::make_rule<T>(options, n, m, hd);
    detail::parallel_for<detail::LayerScratch<T>>(
        n > 0 ? batch * heads : 0, [&](Index bh, detail::LayerScratch<T>& s) {
          const Index b = bh / heads;
          const Index h = bh % heads;
          const Index kv = h / group;
          detail::ScoreRule<T> rule =
              options.per_head.any() ? detail::head_rule(shared, options.per_head, h) : shared;
          if (options.key_valid) rule.key_valid = {options.key_valid->data() + b * m, 0};
          const std::optional<T> sink = rule.sink;
          if (extra > 0) rule.sink.reset();
          const detail::ConstRef<T> q = ws.Q.block(b * n, h * hd, n, hd);
          Eigen::Ref<Matrix<T>> o = ws.concat.block(b * n, h * hd, n, hd);
          if (extra > 0) s.lse.setConstant(n, -std::numeric_limits<T>::infinity());
          if (m > 0) {
            detail::run_path<T>(detail::choose_path(rule, hd, hd, options.need_weights), q,
                                ws.K.block(b * m, kv * hd, m, hd),
                                ws.V.block(b * m, kv * hd, m, hd), rule, s.path, o,
                                extra > 0 ? s.lse.data() : nullptr);
          } else {
            o.setZero();  // no key: a zero row (and no view into the empty K and V)
          }
          Eigen::Map<Matrix<T>> weights(
              options.need_weights ? per_head.data() + bh * n * keys : nullptr, n, keys);
          if (options.need_weights && m > 0) weights.leftCols(m) = s.path.P;
          if (extra == 0) return;
          detail::ScoreRule<T> appended;  // every query sees the appended keys; no bias, no ALiBi
          appended.n = n;
          appended.m = extra;
          appended.scale = rule.scale;
          appended.softcap = rule.softcap;
          s.O_extra.resize(n, hd);
          s.lse_extra.resize(n);
          detail::materialised_kernel<T>(q, ws.K_extra.middleCols(kv * hd, hd),
                                         ws.V_extra.middleCols(kv * hd, hd), appended, s.P_extra,
                                         s.O_extra, s.lse_extra.data());
          for (Index i = 0; i < n; ++i) {
            T lse = s.lse(i);
            detail::merge_partial<T>(o.row(i), lse, s.O_extra.row(i), s.lse_extra(i));
            detail::merge_sink<T>(o.row(i), lse, sink);
            if (options.need_weights) {  // each block's weights, renormalised to the merged sum
              weights.row(i).head(m) *= std::exp(s.lse(i) - lse);
              weights.row(i).tail(extra) = s.P_extra.row(i) * std::exp(s.lse_extra(i) - lse);
            }
          }
        });
    if (options.need_weights && options.average_weights) {
      result.weights.resize(batch, n, keys);
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
    result.output.resize(batch, n, config_.embed_dim);
    Eigen::Map<Matrix<T>> output = detail::flatten(result.output);
    project_into(ws.concat, W_O, b_O, output);
  }

  /// Self-attention of one sequence: `forward(X, X, X)` without the batch dimension.
  /// \param X  (n, embed_dim); requires kdim == vdim == embed_dim
  /// \returns (n, embed_dim)
  Matrix<T> forward(const Matrix<T>& X, const MultiHeadOptions<T>& options = {}) const {
    Tensor3<T> x(1, X.rows(), X.cols());
    detail::slice(x, 0) = X;
    const MultiHeadResult<T> result = forward(x, x, x, options);
    return detail::slice(result.output, 0);
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
  /// (W packed once, rows in parallel; each entry is one sum in feature order, so the same bits for
  /// any thread count). Y is resized (a matrix) or must have the right shape (a map).
  template <class Out>
  static void project_into(const detail::ConstRef<T>& X, const Matrix<T>& W, const RowVector<T>& b,
                           Out& Y) {
    if constexpr (std::is_same_v<Out, Matrix<T>>) Y.resize(X.rows(), W.cols());
    detail::product_kernel<T>(X, W, Y);
    if (b.size() > 0) Y.rowwise() += b;
  }

  /// PyTorch's appended key (or value) rows, the same for every batch item: the learned
  /// bias_k/bias_v row (add_bias_kv), then a zero row (add_zero_attn).
  void extra_rows(const RowVector<T>& bias_row, Matrix<T>& out) const {
    const Index extra = (config_.add_bias_kv ? 1 : 0) + (config_.add_zero_attn ? 1 : 0);
    out.resize(extra, config_.num_kv_heads * head_dim());
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
