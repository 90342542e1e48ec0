#pragma once
/// \file onnx.hpp
/// The ONNX `Attention` operator (opsets 23, 24 and 25) as one call, `attn::onnx::attention`, for
/// a runtime that wants `attn` as its Attention kernel. It takes the operator's inputs and
/// attributes as dynamic-rank row-major tensors and returns its outputs.
///
/// The adapter only reshapes, broadcasts and concatenates: every score, mask and softmax is
/// computed by `attn`'s single-head API, once per (batch item, query head). Which keys a query
/// sees (causal, windows, masks) is decided by the library's core from `AttentionOptions`
/// (`causal`, `query_offset`, `window`, `window_right`, `mask`, `bias`), never here.
///
/// Not in the umbrella header `attn.hpp`: include `<attn/onnx.hpp>` (docs/onnx.md has the
/// mapping of every input and attribute).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "attention.hpp"
#include "detail/checked.hpp"
#include "error.hpp"
#include "types.hpp"

namespace attn {
/// The ONNX `Attention` operator as one call (`attention`, `output_shapes`), with its inputs,
/// attributes and outputs.
namespace onnx {

/// A dense tensor of any rank, row-major (the last axis varies fastest), as ONNX stores it.
/// `data.size()` must be the product of `shape` (an empty shape is a scalar of one element).
template <class S>
struct Tensor {
  std::vector<Index> shape;  ///< one extent per axis
  std::vector<S> data;       ///< the elements in row-major order

  /// The number of axes.
  /// \returns `shape.size()`
  Index rank() const { return static_cast<Index>(shape.size()); }
  /// The extent of `axis` (0-based; no bounds check beyond `ATTN_ASSERT`).
  /// \param axis  0 to rank() - 1
  /// \returns `shape[axis]`
  Index dim(Index axis) const {
    ATTN_ASSERT(axis >= 0 && axis < rank());
    return shape[static_cast<std::size_t>(axis)];
  }
};

/// A boolean tensor (an ONNX `bool` attention mask: `true` = may attend).
using BoolTensor = Tensor<bool>;

/// The operator's seven input slots. Q, K and V have the same rank: 3 for
/// `(batch, seq, heads * head_size)` (with `Attributes::q_num_heads` and `kv_num_heads`) or 4 for
/// `(batch, heads, seq, head_size)`.
template <class T>
struct Inputs {
  /// `(batch, q_seq, q_heads * d)` or `(batch, q_heads, q_seq, d)`.
  Tensor<T> Q;
  /// `(batch, kv_seq, kv_heads * d)` or `(batch, kv_heads, kv_seq, d)`; `q_heads % kv_heads == 0`.
  Tensor<T> K;
  /// `(batch, kv_seq, kv_heads * d_v)` or `(batch, kv_heads, kv_seq, d_v)`.
  Tensor<T> V;
  /// A float `attn_mask`, added to the scores (`-inf` entries mask). Rank 1 to 4, broadcast
  /// (right-aligned) to `(batch, q_heads, q_seq, total_kv)`; a last axis shorter than `total_kv` is
  /// padded with `-inf`. At most one of `attn_mask` and `attn_bool_mask` may be set.
  std::optional<Tensor<T>> attn_mask;
  /// A bool `attn_mask` (`true` = may attend), broadcast like `attn_mask`, padded with `false`.
  std::optional<BoolTensor> attn_bool_mask;
  /// `(batch, kv_heads, past, d)`: keys before K (a cache). Set with `past_value` or not at all.
  std::optional<Tensor<T>> past_key;
  /// `(batch, kv_heads, past, d_v)`.
  std::optional<Tensor<T>> past_value;
  /// `batch` entries in `[0, total_kv]`: keys `j >= nonpad_kv_seqlen[b]` of item `b` are padding.
  std::optional<std::vector<std::int64_t>> nonpad_kv_seqlen;
};

/// The operator's attributes, with the ONNX defaults (an absent attribute keeps its default).
struct Attributes {
  std::int64_t is_causal = 0;  ///< 0 or 1
  /// Multiplies `Q K^T`; absent: `1 / sqrt(d)`. Must be finite.
  std::optional<double> scale;
  double softcap = 0;                      ///< 0 = off; `c > 0`: scores become `c tanh(s / c)`
  std::int64_t q_num_heads = 0;            ///< 3-D inputs: required (> 0); 4-D: 0 or Q's head count
  std::int64_t kv_num_heads = 0;           ///< 3-D inputs: required (> 0); 4-D: 0 or K's head count
  std::int64_t qk_matmul_output_mode = 0;  ///< 0 to 3: which table `qk_matmul_output` holds
  /// 0 (absent) or an ONNX float type (1 FLOAT, 10 FLOAT16, 11 DOUBLE, 16 BFLOAT16). Accepted
  /// and checked, but the softmax is computed in `T` whatever it says (see docs/onnx.md).
  std::int64_t softmax_precision = 0;
  std::int64_t left_window_size = -1;   ///< -1 = unbounded; `L >= 0`: keys `j >= p - L`
  std::int64_t right_window_size = -1;  ///< -1 = unbounded; `R >= 0`: keys `j <= p + R`
};

/// Which optional outputs to produce (an ONNX node may leave output slots empty).
struct OutputRequest {
  bool present = true;            ///< `present_key` and `present_value`
  bool qk_matmul_output = false;  ///< the `qk_matmul_output` table of `qk_matmul_output_mode`
};

/// The operator's four output slots.
template <class T>
struct Outputs {
  /// The rank of Q: `(batch, q_seq, q_heads * d_v)` or `(batch, q_heads, q_seq, d_v)`.
  Tensor<T> Y;
  /// `(batch, kv_heads, total_kv, d)`: `past_key` then K. Set when `OutputRequest::present`.
  std::optional<Tensor<T>> present_key;
  /// `(batch, kv_heads, total_kv, d_v)`: `past_value` then V.
  std::optional<Tensor<T>> present_value;
  /// `(batch, q_heads, q_seq, total_kv)`, when `OutputRequest::qk_matmul_output`. Mode 0:
  /// `scale Q K^T`; 1: after softcap; 2: after softcap and the mask (disallowed keys at `-inf`);
  /// 3: the softmax weights (an all-zero row for a query that may attend no key).
  std::optional<Tensor<T>> qk_matmul_output;
};

/// The shapes of the outputs a call would produce (`output_shapes`), for a runtime that infers
/// shapes or allocates before it runs the operator. Every extent and every element count fits
/// in `Index`.
struct OutputShapes {
  std::vector<Index> Y;              ///< of Q's rank
  std::vector<Index> present_key;    ///< (batch, kv_heads, total_kv, d); empty when not requested
  std::vector<Index> present_value;  ///< (batch, kv_heads, total_kv, d_v); empty when not requested
  std::vector<Index> qk_matmul_output;  ///< (batch, q_heads, q_seq, total_kv); empty when not
                                        ///< requested
};

}  // namespace onnx

namespace detail {
namespace onnx {

inline constexpr const char* kFunction = "onnx::attention";

template <class S>
std::string dims(const attn::onnx::Tensor<S>& t) {
  std::ostringstream out;
  out << "(";
  for (std::size_t a = 0; a < t.shape.size(); ++a) out << (a > 0 ? ", " : "") << t.shape[a];
  out << ")";
  return out.str();
}

/// The product of non-negative extents. A shape_error naming `name` when the product of its
/// non-zero extents does not fit in Index: such a shape has overflowing strides even when an
/// empty axis makes it hold no element.
inline Index element_count(const char* name, const std::vector<Index>& shape) {
  Index count = 1;
  bool empty = false;
  for (const Index extent : shape) {
    if (extent == 0) {
      empty = true;
      continue;
    }
    if (count > index_max / extent) {
      std::ostringstream text;
      for (std::size_t a = 0; a < shape.size(); ++a) text << (a > 0 ? ", " : "") << shape[a];
      fail(kFunction, name, " has shape (", text.str(),
           "), whose element count does not fit in a 64-bit index");
    }
    count *= extent;
  }
  return empty ? 0 : count;
}

/// Requires non-negative extents whose product fits in Index and is `data.size()`.
template <class S>
void require_consistent(const char* name, const attn::onnx::Tensor<S>& t) {
  for (const Index extent : t.shape) {
    if (extent < 0) fail(kFunction, name, " has a negative extent: shape ", dims(t));
  }
  const Index count = element_count(name, t.shape);
  if (count != static_cast<Index>(t.data.size())) {
    fail(kFunction, name, " has shape ", dims(t), " (", count, " elements) but holds ",
         t.data.size(), " elements");
  }
}

/// The row-major stride of every axis of `shape`.
inline std::vector<Index> strides_of(const std::vector<Index>& shape) {
  std::vector<Index> strides(shape.size(), 1);
  for (std::size_t a = shape.size(); a-- > 1;) strides[a - 1] = strides[a] * shape[a];
  return strides;
}

/// Where element (b, h, i, k) of a per-head operand sits in its flat data:
/// `b * batch + h * head + i * row + k` (rows of one head are `row` apart).
struct HeadLayout {
  Index batch;
  Index head;
  Index row;
};

/// 4-D `(batch, heads, seq, width)` or 3-D `(batch, seq, heads * width)`.
inline HeadLayout head_layout(bool rank3, Index heads, Index seq, Index width) {
  if (rank3) return {seq * heads * width, width, heads * width};
  return {heads * seq * width, seq * width, width};
}

/// How an `attn_mask` of rank 1 to 4 reaches the n x total table of (b, h): right-aligned to
/// `(batch, q_heads, q_seq, total_kv)`, each leading axis of extent 1 (broadcast, stride 0) or
/// equal to its target; the key axis holds `keys <= total_kv` entries, the rest is padding.
struct MaskPlan {
  Index batch_stride = 0;
  Index head_stride = 0;
  Index row_stride = 0;
  Index keys = 0;  ///< key columns the mask holds; columns [keys, total_kv) are padding
  bool varies_by_head = false;
};

template <class S>
MaskPlan mask_plan(const char* name, const attn::onnx::Tensor<S>& mask, Index batch, Index q_heads,
                   Index n, Index total) {
  if (mask.rank() < 1 || mask.rank() > 4) {
    fail(kFunction, name, " must have rank 1 to 4, got shape ", dims(mask));
  }
  const std::vector<Index> target = {batch, q_heads, n, total};
  const char* axis_names[] = {"batch", "q_heads", "q_sequence_length", "total_sequence_length"};
  const std::vector<Index> strides = strides_of(mask.shape);
  Index stride4[4] = {0, 0, 0, 0};
  Index extent4[4] = {1, 1, 1, 1};
  const Index lead = 4 - mask.rank();
  for (Index a = 0; a < mask.rank(); ++a) {
    extent4[lead + a] = mask.dim(a);
    stride4[lead + a] = strides[static_cast<std::size_t>(a)];
  }
  for (Index a = 0; a < 3; ++a) {
    const Index extent = extent4[a];
    if (extent != 1 && extent != target[static_cast<std::size_t>(a)]) {
      fail(kFunction, name, " has shape ", dims(mask), ", which does not broadcast to (", batch,
           ", ", q_heads, ", ", n, ", ", total, "): its ", axis_names[a], " axis is ", extent,
           " (must be 1 or ", target[static_cast<std::size_t>(a)], ")");
    }
    if (extent == 1) stride4[a] = 0;
  }
  if (extent4[3] > total) {
    fail(kFunction, name, " has shape ", dims(mask), ": its last axis is ", extent4[3],
         " but total_sequence_length (past + kv) is ", total);
  }
  return {stride4[0], stride4[1], stride4[2], extent4[3], extent4[1] > 1};
}

/// The n x total table of (b, h) from a mask laid out by `plan`: `convert(value)` for the columns
/// the mask holds, `padding` for the rest.
template <class Table, class S, class Convert>
void fill_table(const attn::onnx::Tensor<S>& mask, const MaskPlan& plan, Index b, Index h,
                typename Table::Scalar padding, Convert convert, Table& table) {
  const Index base = b * plan.batch_stride + h * plan.head_stride;
  for (Index i = 0; i < table.rows(); ++i) {
    const Index row = base + i * plan.row_stride;
    for (Index j = 0; j < plan.keys; ++j) {
      table(i, j) = convert(mask.data[static_cast<std::size_t>(row + j)]);
    }
    for (Index j = plan.keys; j < table.cols(); ++j) table(i, j) = padding;
  }
}

/// present = concat(past, new) along the sequence axis, as `(batch, kv_heads, total, width)`.
template <class T>
attn::onnx::Tensor<T> concat_cache(const std::optional<attn::onnx::Tensor<T>>& past,
                                   const attn::onnx::Tensor<T>& fresh, bool rank3, Index batch,
                                   Index kv_heads, Index past_len, Index seq, Index width) {
  const Index total = past_len + seq;
  attn::onnx::Tensor<T> present{{batch, kv_heads, total, width}, {}};
  present.data.resize(static_cast<std::size_t>(element_count("present", present.shape)));
  if (present.data.empty()) return present;  // nothing to copy, however many (b, h) there are
  const HeadLayout in = head_layout(rank3, kv_heads, seq, width);
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < kv_heads; ++h) {
      T* out = present.data.data() + (b * kv_heads + h) * total * width;
      if (past_len > 0) {
        const T* from = past->data.data() + (b * kv_heads + h) * past_len * width;
        std::copy(from, from + past_len * width, out);
      }
      for (Index i = 0; i < seq; ++i) {
        const T* from = fresh.data.data() + b * in.batch + h * in.head + i * in.row;
        std::copy(from, from + width, out + (past_len + i) * width);
      }
    }
  }
  return present;
}

inline void require_attribute(bool ok, const char* name, std::int64_t value, const char* rule) {
  if (!ok) fail(kFunction, "attribute ", name, " is ", value, " but must be ", rule);
}

/// Every attribute in its ONNX range.
inline void check_attributes(const attn::onnx::Attributes& a) {
  require_attribute(a.is_causal == 0 || a.is_causal == 1, "is_causal", a.is_causal, "0 or 1");
  require_attribute(a.qk_matmul_output_mode >= 0 && a.qk_matmul_output_mode <= 3,
                    "qk_matmul_output_mode", a.qk_matmul_output_mode, "0, 1, 2 or 3");
  require_attribute(
      a.softmax_precision == 0 || a.softmax_precision == 1 || a.softmax_precision == 10 ||
          a.softmax_precision == 11 || a.softmax_precision == 16,
      "softmax_precision", a.softmax_precision, "absent (0) or a float type: 1, 10, 11 or 16");
  require_attribute(a.left_window_size >= -1, "left_window_size", a.left_window_size,
                    ">= -1 (-1 = unbounded)");
  require_attribute(a.right_window_size >= -1, "right_window_size", a.right_window_size,
                    ">= -1 (-1 = unbounded)");
  if (!(std::isfinite(a.softcap) && a.softcap >= 0)) {
    fail(kFunction, "attribute softcap is ", a.softcap, " but must be finite and >= 0 (0 = off)");
  }
  if (a.scale && !std::isfinite(*a.scale)) {
    fail(kFunction, "attribute scale is ", *a.scale, " but must be finite");
  }
}

/// The extents of one call, read from (and checked against) every input.
struct Sizes {
  bool rank3 = false;  ///< Q, K, V are (batch, seq, heads * size), else (batch, heads, seq, size)
  Index batch = 0;
  Index q_heads = 0;
  Index kv_heads = 0;
  Index n = 0;      ///< q_sequence_length
  Index m_new = 0;  ///< kv_sequence_length (the new keys)
  Index past = 0;   ///< past_sequence_length
  Index total = 0;  ///< total_sequence_length = past + m_new
  Index d = 0;      ///< head size of Q and K
  Index d_v = 0;    ///< head size of V
};

/// Checks Q, K, V, the cache and `nonpad_kv_seqlen` and returns their extents.
template <class T>
Sizes check_inputs(const attn::onnx::Inputs<T>& inputs, const attn::onnx::Attributes& a) {
  const attn::onnx::Tensor<T>& Q = inputs.Q;
  const attn::onnx::Tensor<T>& K = inputs.K;
  const attn::onnx::Tensor<T>& V = inputs.V;
  require_consistent("Q", Q);
  require_consistent("K", K);
  require_consistent("V", V);
  if (Q.rank() != 3 && Q.rank() != 4) {
    fail(kFunction, "Q must have rank 3 (batch, seq, heads * head_size) or 4 (batch, heads, seq, ",
         "head_size), got shape ", dims(Q));
  }
  if (K.rank() != Q.rank() || V.rank() != Q.rank()) {
    fail(kFunction, "Q, K and V must have the same rank (Q is ", dims(Q), ", K is ", dims(K),
         ", V is ", dims(V), ")");
  }
  Sizes s;
  s.rank3 = Q.rank() == 3;
  s.batch = Q.dim(0);
  if (K.dim(0) != s.batch || V.dim(0) != s.batch) {
    fail(kFunction, "Q, K and V must have the same batch size (Q is ", dims(Q), ", K is ", dims(K),
         ", V is ", dims(V), ")");
  }
  Index v_seq = 0;
  if (s.rank3) {
    if (a.q_num_heads <= 0 || a.kv_num_heads <= 0) {
      fail(kFunction, "3-D inputs need the attributes q_num_heads and kv_num_heads > 0, got ",
           a.q_num_heads, " and ", a.kv_num_heads, " (Q is ", dims(Q), ")");
    }
    s.q_heads = static_cast<Index>(a.q_num_heads);
    s.kv_heads = static_cast<Index>(a.kv_num_heads);
    const auto split = [](const char* name, const attn::onnx::Tensor<T>& t, Index heads,
                          const char* attribute) {
      if (t.dim(2) % heads != 0) {
        fail(kFunction, name, " has shape ", dims(t), ": its hidden size ", t.dim(2),
             " is not a multiple of ", attribute, " = ", heads);
      }
      return t.dim(2) / heads;
    };
    s.n = Q.dim(1);
    s.m_new = K.dim(1);
    v_seq = V.dim(1);
    s.d = split("Q", Q, s.q_heads, "q_num_heads");
    const Index d_k = split("K", K, s.kv_heads, "kv_num_heads");
    s.d_v = split("V", V, s.kv_heads, "kv_num_heads");
    if (d_k != s.d) {
      fail(kFunction, "K has head size ", d_k, " but Q has ", s.d, " (Q is ", dims(Q), " with ",
           s.q_heads, " heads, K is ", dims(K), " with ", s.kv_heads, " heads)");
    }
  } else {
    s.q_heads = Q.dim(1);
    s.kv_heads = K.dim(1);
    s.n = Q.dim(2);
    s.m_new = K.dim(2);
    v_seq = V.dim(2);
    s.d = Q.dim(3);
    s.d_v = V.dim(3);
    if (V.dim(1) != s.kv_heads) {
      fail(kFunction, "V has ", V.dim(1), " heads but K has ", s.kv_heads, " (K is ", dims(K),
           ", V is ", dims(V), ")");
    }
    if (K.dim(3) != s.d) {
      fail(kFunction, "K has head size ", K.dim(3), " but Q has ", s.d, " (Q is ", dims(Q),
           ", K is ", dims(K), ")");
    }
    if ((a.q_num_heads != 0 && a.q_num_heads != s.q_heads) ||
        (a.kv_num_heads != 0 && a.kv_num_heads != s.kv_heads)) {
      fail(kFunction, "attributes q_num_heads = ", a.q_num_heads,
           " and kv_num_heads = ", a.kv_num_heads, " disagree with the 4-D shapes (Q is ", dims(Q),
           ", K is ", dims(K), ")");
    }
  }
  if (v_seq != s.m_new) {
    fail(kFunction, "V has ", v_seq, " positions but K has ", s.m_new, " (K is ", dims(K),
         ", V is ", dims(V), ")");
  }
  if (s.d == 0) fail(kFunction, "Q has head size 0 (Q is ", dims(Q), ")");
  if (s.kv_heads == 0 || s.q_heads % s.kv_heads != 0) {
    fail(kFunction, "q_heads = ", s.q_heads, " must be a multiple of kv_heads = ", s.kv_heads,
         " (Q is ", dims(Q), ", K is ", dims(K), ")");
  }

  if (inputs.past_key.has_value() != inputs.past_value.has_value()) {
    fail(kFunction, "past_key and past_value must be given together (past_key ",
         inputs.past_key ? dims(*inputs.past_key) : std::string("absent"), ", past_value ",
         inputs.past_value ? dims(*inputs.past_value) : std::string("absent"), ")");
  }
  if (inputs.past_key) {
    const attn::onnx::Tensor<T>& pk = *inputs.past_key;
    const attn::onnx::Tensor<T>& pv = *inputs.past_value;
    require_consistent("past_key", pk);
    require_consistent("past_value", pv);
    if (pk.rank() != 4 || pk.dim(0) != s.batch || pk.dim(1) != s.kv_heads || pk.dim(3) != s.d) {
      fail(kFunction, "past_key is ", dims(pk),
           " but must be (batch, kv_heads, past, head_size) = (", s.batch, ", ", s.kv_heads,
           ", past, ", s.d, ")");
    }
    s.past = pk.dim(2);
    if (pv.rank() != 4 || pv.dim(0) != s.batch || pv.dim(1) != s.kv_heads || pv.dim(2) != s.past ||
        pv.dim(3) != s.d_v) {
      fail(kFunction, "past_value is ", dims(pv),
           " but must be (batch, kv_heads, past, v_head_size) = (", s.batch, ", ", s.kv_heads, ", ",
           s.past, ", ", s.d_v, ") (past_key is ", dims(pk), ")");
    }
  }
  s.total = checked_add(kFunction, s.past, s.m_new, "total_sequence_length = past + kv");

  if (inputs.nonpad_kv_seqlen) {
    const std::vector<std::int64_t>& nonpad = *inputs.nonpad_kv_seqlen;
    if (static_cast<Index>(nonpad.size()) != s.batch) {
      fail(kFunction, "nonpad_kv_seqlen has ", nonpad.size(), " entries but the batch size is ",
           s.batch, " (Q is ", dims(Q), ")");
    }
    for (std::size_t b = 0; b < nonpad.size(); ++b) {
      if (nonpad[b] < 0 || nonpad[b] > s.total) {
        fail(kFunction, "nonpad_kv_seqlen[", b, "] is ", nonpad[b], " but must be in [0, ", s.total,
             "] (total_sequence_length = past + kv)");
      }
    }
  }
  if (inputs.attn_mask && inputs.attn_bool_mask) {
    fail(kFunction, "attn_mask is given both as a float tensor ", dims(*inputs.attn_mask),
         " and as a bool tensor ", dims(*inputs.attn_bool_mask), ": give one");
  }
  return s;
}

/// The masks of one call: how each `attn_mask` reaches the tables of (b, h).
struct MaskPlans {
  MaskPlan bias;     ///< of the float attn_mask
  MaskPlan allowed;  ///< of the bool attn_mask
  bool varies_by_head() const { return bias.varies_by_head || allowed.varies_by_head; }
};

template <class T>
MaskPlans mask_plans(const attn::onnx::Inputs<T>& inputs, const Sizes& s) {
  MaskPlans plans;
  if (inputs.attn_mask) {
    require_consistent("attn_mask", *inputs.attn_mask);
    plans.bias = mask_plan("attn_mask", *inputs.attn_mask, s.batch, s.q_heads, s.n, s.total);
  }
  if (inputs.attn_bool_mask) {
    require_consistent("attn_mask", *inputs.attn_bool_mask);
    plans.allowed =
        mask_plan("attn_mask", *inputs.attn_bool_mask, s.batch, s.q_heads, s.n, s.total);
  }
  return plans;
}

/// The per-(b, h) inputs of `options`: `bias` from the float mask (padded with -inf), `mask` from
/// the bool mask (padded with false) and the padding keys `j >= nonpad_kv_seqlen[b]`.
template <class T>
void set_head_tables(const attn::onnx::Inputs<T>& inputs, const MaskPlans& plans, const Sizes& s,
                     Index b, Index h, AttentionOptions<T>& options) {
  if (inputs.attn_mask) {
    Matrix<T> bias(s.n, s.total);
    fill_table(
        *inputs.attn_mask, plans.bias, b, h, -std::numeric_limits<T>::infinity(),
        [](T value) { return value; }, bias);
    options.bias = std::move(bias);
  }
  if (inputs.attn_bool_mask || inputs.nonpad_kv_seqlen) {
    Mask allowed = Mask::Constant(s.n, s.total, true);
    if (inputs.attn_bool_mask) {
      fill_table(
          *inputs.attn_bool_mask, plans.allowed, b, h, false, [](bool value) { return value; },
          allowed);
    }
    if (inputs.nonpad_kv_seqlen) {
      const Index valid =
          static_cast<Index>((*inputs.nonpad_kv_seqlen)[static_cast<std::size_t>(b)]);
      allowed.rightCols(s.total - valid).setConstant(false);
    }
    options.mask = std::move(allowed);
  }
}

/// The options every head of the call shares (the per-item and per-head fields are set later).
template <class T>
AttentionOptions<T> shared_options(const attn::onnx::Attributes& a, T scale) {
  AttentionOptions<T> options;
  options.causal = a.is_causal ? Causal::TopLeft : Causal::None;
  options.scale = scale;
  if (a.softcap > 0) options.softcap = static_cast<T>(a.softcap);
  if (a.left_window_size >= 0) options.window = static_cast<Index>(a.left_window_size);
  if (a.right_window_size >= 0) options.window_right = static_cast<Index>(a.right_window_size);
  return options;
}

/// ONNX's query offset of batch item b (the key position of query 0): the past length with
/// `past_key`, else `nonpad_kv_seqlen[b] - q_seq` with `nonpad_kv_seqlen` (may be negative),
/// else 0.
template <class T>
Index query_offset(const attn::onnx::Inputs<T>& inputs, const Sizes& s, Index b) {
  if (inputs.past_key) return s.past;
  if (inputs.nonpad_kv_seqlen) {
    return static_cast<Index>((*inputs.nonpad_kv_seqlen)[static_cast<std::size_t>(b)]) - s.n;
  }
  return 0;
}

/// The output shapes of a call with these extents; a shape_error when any of them overflows.
inline attn::onnx::OutputShapes output_shapes(const Sizes& s,
                                              const attn::onnx::OutputRequest& request) {
  attn::onnx::OutputShapes shapes;
  const Index y_width =
      s.rank3 ? checked_mul(kFunction, s.q_heads, s.d_v, "Y's hidden size") : s.d_v;
  shapes.Y = s.rank3 ? std::vector<Index>{s.batch, s.n, y_width}
                     : std::vector<Index>{s.batch, s.q_heads, s.n, s.d_v};
  element_count("Y", shapes.Y);
  if (request.present) {
    shapes.present_key = {s.batch, s.kv_heads, s.total, s.d};
    shapes.present_value = {s.batch, s.kv_heads, s.total, s.d_v};
    element_count("present_key", shapes.present_key);
    element_count("present_value", shapes.present_value);
  }
  if (request.qk_matmul_output) {
    shapes.qk_matmul_output = {s.batch, s.q_heads, s.n, s.total};
    element_count("qk_matmul_output", shapes.qk_matmul_output);
  }
  // The heads always read the whole cache, and a mask is widened to an n x total table.
  element_count("present_key", {s.batch, s.kv_heads, s.total, s.d});
  element_count("present_value", {s.batch, s.kv_heads, s.total, s.d_v});
  element_count("the n x total_kv table of a head", {s.n, s.total});
  return shapes;
}

/// Every check of a call, in order: attributes, inputs, masks. Returns the extents.
template <class T>
Sizes check_call(const attn::onnx::Inputs<T>& inputs, const attn::onnx::Attributes& attributes,
                 KVStorage storage) {
  if (storage == KVStorage::Int8) {
    fail(kFunction, "storage must be Same, Float16 or BFloat16, not ", storage_name(storage),
         " (int8 needs the scales of a KVCache)");
  }
  check_attributes(attributes);
  // The double attributes must also be numbers of T (a float scale of 1e300 would be inf).
  const double largest = static_cast<double>(std::numeric_limits<T>::max());
  if (attributes.scale && std::abs(*attributes.scale) > largest) {
    fail(kFunction, "attribute scale is ", *attributes.scale, " but must be finite in the ",
         "tensors' type (|scale| <= ", largest, ")");
  }
  if (attributes.softcap > largest) {
    fail(kFunction, "attribute softcap is ", attributes.softcap, " but must be finite in the ",
         "tensors' type (<= ", largest, ")");
  }
  return check_inputs(inputs, attributes);
}

}  // namespace onnx
}  // namespace detail

namespace onnx {

/// The shapes `attention` would give its outputs, after every check `attention` makes (the same
/// shape_error for the same inputs), without computing or allocating them.
/// \param inputs      as for `attention`
/// \param attributes  the node's attributes (see `Attributes`)
/// \param request     which optional outputs to produce
/// \param storage     as for `attention` (`Int8` is refused)
/// \returns the extents of Y, `present_key`, `present_value` and `qk_matmul_output`
/// \throws shape_error as `attention` does.
template <class T>
OutputShapes output_shapes(const Inputs<T>& inputs, const Attributes& attributes = {},
                           const OutputRequest& request = {}, KVStorage storage = KVStorage::Same) {
  const detail::onnx::Sizes s = detail::onnx::check_call(inputs, attributes, storage);
  detail::onnx::mask_plans(inputs, s);
  return detail::onnx::output_shapes(s, request);
}

/// The ONNX `Attention` operator: `Y = softmax(softcap(scale Q K^T) + mask) V` per (batch item,
/// query head), with the key/value cache, padding, causal and window rules of opsets 23 to 25.
/// Query head `h` uses key/value head `h / (q_heads / kv_heads)` (GQA, MQA).
///
/// Each (b, h) is one call of `attn::scaled_dot_product_attention` (or `attention_with_weights` /
/// `trace_attention` when `qk_matmul_output` is requested) with these `AttentionOptions`:
/// `causal = TopLeft` when `is_causal`; `query_offset` = the past length with `past_key`, else
/// `nonpad_kv_seqlen[b] - q_seq` with `nonpad_kv_seqlen`, else 0; `window = left_window_size` and
/// `window_right = right_window_size` when >= 0; `mask` = the bool `attn_mask` (padded with
/// `false`) and keys `j < nonpad_kv_seqlen[b]`; `bias` = the float `attn_mask` (padded with
/// `-inf`); `scale` (default `1 / sqrt(d)`); `softcap` when != 0.
///
/// \param inputs      Q, K, V (rank 3 or 4), optional `attn_mask` (float) or `attn_bool_mask`,
///                    `past_key`/`past_value`, `nonpad_kv_seqlen` (see `Inputs` for shapes)
/// \param attributes  the node's attributes (see `Attributes`)
/// \param request     which optional outputs to produce (default: Y and the present cache)
/// \param storage     not an ONNX attribute: the format the heads read the keys and values in.
///                    `Same` (default): T. `Float16` / `BFloat16`: each head's keys and values
///                    (past and new) are rounded to that format and read as `Eigen::half` /
///                    `Eigen::bfloat16` matrices, as from a `KVCache` kept in that format (the
///                    present outputs stay unrounded). `Int8` is refused.
/// \returns `Outputs`: Y of Q's rank; `present_key`/`present_value` of shape
///          `(batch, kv_heads, total_kv, d | d_v)`; `qk_matmul_output` of shape
///          `(batch, q_heads, q_seq, total_kv)` when requested. A query that may attend no key
///          gets a zero row in Y (and in a mode-3 table).
/// \throws shape_error (naming the operand and its shape) on inconsistent ranks, shapes, head
///         counts, masks that do not broadcast, `nonpad_kv_seqlen` outside `[0, total_kv]`, or an
///         attribute outside its range.
/// \note Cost: 4 q_heads n total d flops per batch item (d = d_v), as `attn` computes each head.
///       Memory: the present cache (always built: the heads read their keys from it), one n x
///       total mask/bias table at a time, and with `qk_matmul_output` the table itself.
template <class T>
Outputs<T> attention(const Inputs<T>& inputs, const Attributes& attributes = {},
                     const OutputRequest& request = {}, KVStorage storage = KVStorage::Same) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "attn::onnx::attention works on float and double tensors");
  namespace on = attn::detail::onnx;
  using ConstMap = Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>;
  using MutableMap = Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>;

  // 1. Checks (every extent and product before anything is allocated), then the cache:
  //    present = concat(past, new), the keys every head reads.
  const on::Sizes s = on::check_call(inputs, attributes, storage);
  const on::MaskPlans plans = on::mask_plans(inputs, s);
  const OutputShapes shapes = on::output_shapes(s, OutputRequest{true, request.qk_matmul_output});
  Tensor<T> present_key = on::concat_cache(inputs.past_key, inputs.K, s.rank3, s.batch, s.kv_heads,
                                           s.past, s.m_new, s.d);
  Tensor<T> present_value = on::concat_cache(inputs.past_value, inputs.V, s.rank3, s.batch,
                                             s.kv_heads, s.past, s.m_new, s.d_v);

  // 2. The outputs.
  Outputs<T> out;
  out.Y.shape = shapes.Y;
  out.Y.data.resize(static_cast<std::size_t>(on::element_count("Y", shapes.Y)));
  const std::int64_t mode = attributes.qk_matmul_output_mode;
  Index table_elements = 0;
  if (request.qk_matmul_output) {
    table_elements = on::element_count("qk_matmul_output", shapes.qk_matmul_output);
    out.qk_matmul_output = Tensor<T>{shapes.qk_matmul_output,
                                     std::vector<T>(static_cast<std::size_t>(table_elements))};
  }

  // 3. One single-head attention call per (b, h); query head h reads key/value head h / group.
  const on::HeadLayout q_at = on::head_layout(s.rank3, s.q_heads, s.n, s.d);
  const on::HeadLayout y_at = on::head_layout(s.rank3, s.q_heads, s.n, s.d_v);
  const Index group = s.q_heads / s.kv_heads;
  const T scale =
      attributes.scale ? static_cast<T>(*attributes.scale) : T(1) / std::sqrt(static_cast<T>(s.d));
  AttentionOptions<T> options = on::shared_options<T>(attributes, scale);
  Matrix<T> y_head;  // one head's n x d_v output, reused from head to head
  // With a 16-bit storage: the current key/value head in that format, and widened back to T
  // (for the tables of qk_matmul_output).
  Matrix<Eigen::half> k_half, v_half;
  Matrix<Eigen::bfloat16> k_bf16, v_bf16;
  Matrix<T> k_round, v_round;
  Index stored_head = -1;
  // With no output element there is nothing to compute, however many (b, h) the shapes name.
  const Index batches = out.Y.data.empty() && table_elements == 0 ? 0 : s.batch;
  for (Index b = 0; b < batches; ++b) {
    options.query_offset = on::query_offset(inputs, s, b);
    for (Index h = 0; h < s.q_heads; ++h) {
      if (h == 0 || plans.varies_by_head()) on::set_head_tables(inputs, plans, s, b, h, options);
      const Index kv_h = h / group;
      const ConstMap q_bh(inputs.Q.data.data() + b * q_at.batch + h * q_at.head, s.n, s.d,
                          Eigen::OuterStride<>(q_at.row));
      const ConstMap k_bh(present_key.data.data() + (b * s.kv_heads + kv_h) * s.total * s.d,
                          s.total, s.d, Eigen::OuterStride<>(s.d));
      const ConstMap v_bh(present_value.data.data() + (b * s.kv_heads + kv_h) * s.total * s.d_v,
                          s.total, s.d_v, Eigen::OuterStride<>(s.d_v));
      MutableMap y_bh(out.Y.data.data() + b * y_at.batch + h * y_at.head, s.n, s.d_v,
                      Eigen::OuterStride<>(y_at.row));
      const bool stored = storage != KVStorage::Same;
      if (stored && stored_head != b * s.kv_heads + kv_h) {
        stored_head = b * s.kv_heads + kv_h;
        // The widened copies only for the tables' path, which takes T.
        if (storage == KVStorage::Float16) {
          k_half = k_bh.template cast<Eigen::half>();
          v_half = v_bh.template cast<Eigen::half>();
          if (request.qk_matmul_output) {
            k_round = k_half.template cast<T>();
            v_round = v_half.template cast<T>();
          }
        } else {
          k_bf16 = k_bh.template cast<Eigen::bfloat16>();
          v_bf16 = v_bh.template cast<Eigen::bfloat16>();
          if (request.qk_matmul_output) {
            k_round = k_bf16.template cast<T>();
            v_round = v_bf16.template cast<T>();
          }
        }
      }
      if (!request.qk_matmul_output) {
        if (storage == KVStorage::Float16) {
          scaled_dot_product_attention(q_bh, k_half, v_half, options, y_head);
        } else if (storage == KVStorage::BFloat16) {
          scaled_dot_product_attention(q_bh, k_bf16, v_bf16, options, y_head);
        } else {
          scaled_dot_product_attention(q_bh, k_bh, v_bh, options, y_head);  // reuses y_head
        }
        y_bh = y_head;
        continue;
      }
      const ConstMap k_used(stored ? k_round.data() : k_bh.data(), s.total, s.d,
                            Eigen::OuterStride<>(s.d));
      const ConstMap v_used(stored ? v_round.data() : v_bh.data(), s.total, s.d_v,
                            Eigen::OuterStride<>(s.d_v));
      Eigen::Map<Matrix<T>> table_bh(
          out.qk_matmul_output->data.data() + (b * s.q_heads + h) * s.n * s.total, s.n, s.total);
      if (mode == 3) {
        const Attention<T> result = attention_with_weights(q_bh, k_used, v_used, options);
        y_bh = result.output;
        table_bh = result.weights;  // zero rows where a query may attend nothing
      } else {
        const AttentionTrace<T> trace = trace_attention(q_bh, k_used, v_used, options);
        y_bh = trace.output;
        if (mode == 0) {
          table_bh = scale * trace.scores;  // scale Q K^T, before softcap
        } else if (mode == 1) {
          table_bh = trace.scaled;  // then softcap
        } else {
          table_bh = trace.masked;  // then + bias; disallowed keys at -inf
        }
      }
    }
  }
  if (request.present) {
    out.present_key = std::move(present_key);
    out.present_value = std::move(present_value);
  }
  return out;
}

}  // namespace onnx
}  // namespace attn
