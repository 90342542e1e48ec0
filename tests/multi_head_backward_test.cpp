/// Gradients of heads.hpp's `attention_heads` (`attention_heads_backward`) and of multi_head.hpp's
/// layer (`MultiHeadAttention::backward`):
/// - every head against `attention_backward` on that head (bit for bit for multi-head attention),
///   grouped-query and multi-query key/value gradients summed over the group, the per-head
///   values (ALiBi slopes, sinks -> dsinks, masks, biases -> dbiases), the tiled path, the form
///   taking the forward's output and log-sum-exp;
/// - finite differences (`attn::gradcheck`, double) for the heads and for the layer: every input,
///   weight and bias, with causal masks, key padding, GQA, kdim/vdim, no biases, add_bias_kv and
///   add_zero_attn, per-head values, softcap, sinks; the single-sequence form;
/// - padded keys get exactly zero gradient; a fully padded item gives zeros, never NaN;
/// - the same bits for one and two threads (heads and layer, materialised and tiled paths);
/// - PyTorch 1.13's own gradients (tests/data/mha_grad_*.json, tests/data/make_mha_grad.py) in
///   float and double, in PyTorch's layout through the `*_grad()` accessors;
/// - shape errors, with both shapes in the message.

#include <gtest/gtest.h>

#include <algorithm>
#include <attn/attn.hpp>
#include <attn/gradcheck.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "test_support.hpp"

// A named namespace: the test build compiles several test files in one translation unit, and
// multi_head_test.cpp has helpers of the same names.
namespace multi_head_backward_test {
namespace {

using attn::Causal;
using attn::HeadGrads;
using attn::HeadOptions;
using attn::Index;
using attn::Mask;
using attn::Matrix;
using attn::MultiHeadAttention;
using attn::MultiHeadConfig;
using attn::MultiHeadGrads;
using attn::MultiHeadOptions;
using attn::RowVector;
using attn::Tensor3;
using GradInputs = std::vector<Matrix<double>>;

std::size_t to_size(Index i) { return static_cast<std::size_t>(i); }

// ------------------------------------------------------------------------------------------------
// Tensors as stacks of matrices
// ------------------------------------------------------------------------------------------------

/// Slice `i` of a (a, b, c) tensor as a b x c matrix (a copy).
template <class T>
Matrix<T> item(const Tensor3<T>& t, Index i) {
  return Eigen::Map<const Matrix<T>>(t.data() + i * t.dimension(1) * t.dimension(2), t.dimension(1),
                                     t.dimension(2));
}

/// A (a, b, c) tensor seen as one (a b) x c matrix (a copy).
template <class T>
Matrix<T> flat(const Tensor3<T>& t) {
  return Eigen::Map<const Matrix<T>>(t.data(), t.dimension(0) * t.dimension(1), t.dimension(2));
}

/// An (a b) x c matrix as a (a, b, c) tensor.
template <class T>
Tensor3<T> unflat(const Matrix<T>& M, Index a) {
  Tensor3<T> t(a, a > 0 ? M.rows() / a : 0, M.cols());
  Eigen::Map<Matrix<T>>(t.data(), M.rows(), M.cols()) = M;
  return t;
}

template <class T>
Tensor3<T> random_tensor(Index a, Index b, Index c, std::mt19937& rng) {
  return unflat<T>(attn_test::random_matrix<T>(a * b, c, rng), a);
}

template <class T>
RowVector<T> random_row(Index size, std::mt19937& rng, double stddev = 0.5) {
  return attn_test::random_matrix<T>(1, size, rng, stddev);
}

/// A mask with about `fraction` of its entries false (at least one true per row).
Mask random_mask(Index rows, Index cols, double fraction, std::mt19937& rng) {
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  Mask mask(rows, cols);
  for (Index i = 0; i < rows; ++i) {
    for (Index j = 0; j < cols; ++j) mask(i, j) = uniform(rng) >= fraction;
    mask(i, i % cols) = true;
  }
  return mask;
}

/// Every slice of `actual` is bitwise `expected`'s.
template <class T>
::testing::AssertionResult identical3(const Tensor3<T>& actual, const Tensor3<T>& expected) {
  if (actual.dimension(0) != expected.dimension(0)) {
    return ::testing::AssertionFailure()
           << "dimension 0 differs: " << actual.dimension(0) << " vs " << expected.dimension(0);
  }
  return attn_test::identical(flat(actual), flat(expected));
}

// ------------------------------------------------------------------------------------------------
// attention_heads_backward against attention_backward, head by head
// ------------------------------------------------------------------------------------------------

/// The options of query head h alone: the shared ones with head h's per-head values.
template <class T>
attn::AttentionOptions<T> options_of_head(const attn::AttentionOptions<T>& shared,
                                          const HeadOptions<T>& per_head, Index h, Index n,
                                          Index m) {
  attn::AttentionOptions<T> o = shared;
  const auto i = to_size(h);
  if (per_head.alibi_slopes) o.alibi_slope = (*per_head.alibi_slopes)[i];
  if (per_head.sinks) o.sink = (*per_head.sinks)[i];
  if (per_head.masks) {
    Mask mask(n, m);
    for (Index r = 0; r < n; ++r) {
      for (Index c = 0; c < m; ++c) mask(r, c) = (*per_head.masks)(h, r, c);
    }
    o.mask = mask;
  }
  if (per_head.biases) o.bias = item(*per_head.biases, h);
  return o;
}

/// The heads' gradients recomputed head by head with `attention_backward`: dK, dV of a key/value
/// head summed over its query heads in head order, dbias and dsink over all heads in head order.
template <class T>
HeadGrads<T> per_head_reference(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                                const Tensor3<T>& dO, const attn::AttentionOptions<T>& shared,
                                const HeadOptions<T>& per_head) {
  const Index heads = Q.dimension(0);
  const Index group = heads / K.dimension(0);
  const Index n = Q.dimension(1);
  const Index m = K.dimension(1);
  std::vector<Matrix<T>> dQ, dK(to_size(K.dimension(0))), dV(to_size(K.dimension(0))), dbiases;
  HeadGrads<T> r;
  for (Index h = 0; h < heads; ++h) {
    const attn::AttentionGrads<T> g =
        attn::attention_backward(item(Q, h), item(K, h / group), item(V, h / group), item(dO, h),
                                 options_of_head(shared, per_head, h, n, m));
    dQ.push_back(g.dQ);
    Matrix<T>& dk = dK[to_size(h / group)];
    Matrix<T>& dv = dV[to_size(h / group)];
    if (h % group == 0) {
      dk = g.dK;
      dv = g.dV;
    } else {
      dk += g.dK;
      dv += g.dV;
    }
    if (shared.bias) r.dbias = h == 0 ? g.dbias : Matrix<T>(r.dbias + g.dbias);
    if (shared.sink) r.dsink += g.dsink;
    if (per_head.biases) dbiases.push_back(g.dbias);
    if (per_head.sinks) r.dsinks.push_back(g.dsink);
  }
  const auto stack = [](const std::vector<Matrix<T>>& items) {
    Tensor3<T> t(static_cast<Index>(items.size()), items.front().rows(), items.front().cols());
    for (Index i = 0; i < t.dimension(0); ++i) {
      Eigen::Map<Matrix<T>>(t.data() + i * t.dimension(1) * t.dimension(2), t.dimension(1),
                            t.dimension(2)) = items[to_size(i)];
    }
    return t;
  };
  r.dQ = stack(dQ);
  r.dK = stack(dK);
  r.dV = stack(dV);
  if (per_head.biases) r.dbiases = stack(dbiases);
  return r;
}

/// Every field of `actual` equals the head-by-head reference: bitwise, or within the
/// tolerances of T.
template <class T>
void expect_head_grads(const HeadGrads<T>& actual, const HeadGrads<T>& expected, bool bitwise) {
  const auto same = [&](const Matrix<T>& a, const Matrix<T>& e) {
    return bitwise ? attn_test::identical(a, e) : attn_test::near_t<T>(a, e);
  };
  EXPECT_TRUE(same(flat(actual.dQ), flat(expected.dQ))) << "dQ";
  EXPECT_TRUE(same(flat(actual.dK), flat(expected.dK))) << "dK";
  EXPECT_TRUE(same(flat(actual.dV), flat(expected.dV))) << "dV";
  EXPECT_TRUE(same(actual.dbias, expected.dbias)) << "dbias";
  EXPECT_TRUE(
      same(Matrix<T>::Constant(1, 1, actual.dsink), Matrix<T>::Constant(1, 1, expected.dsink)))
      << "dsink";
  ASSERT_EQ(actual.dbiases.size(), expected.dbiases.size());
  if (expected.dbiases.size() > 0) {
    EXPECT_TRUE(same(flat(actual.dbiases), flat(expected.dbiases))) << "dbiases";
  }
  ASSERT_EQ(actual.dsinks.size(), expected.dsinks.size());
  for (std::size_t h = 0; h < expected.dsinks.size(); ++h) {
    EXPECT_TRUE(same(Matrix<T>::Constant(1, 1, actual.dsinks[h]),
                     Matrix<T>::Constant(1, 1, expected.dsinks[h])))
        << "dsinks[" << h << "]";
  }
}

template <class T>
class HeadsBackward : public ::testing::Test {};
TYPED_TEST_SUITE(HeadsBackward, attn_test::ScalarTypes);

/// Multi-head attention (one query head per key/value head) with every shared option: each head's
/// gradients are attention_backward's on that head, bit for bit; the shared bias's and sink's are
/// the sums over the heads in head order.
TYPED_TEST(HeadsBackward, EachHeadIsAttentionBackwardBitForBit) {
  using T = TypeParam;
  std::mt19937 rng(101);
  const Index heads = 3, n = 6, m = 9, d = 5, d_v = 4;
  const Tensor3<T> Q = random_tensor<T>(heads, n, d, rng);
  const Tensor3<T> K = random_tensor<T>(heads, m, d, rng);
  const Tensor3<T> V = random_tensor<T>(heads, m, d_v, rng);
  const Tensor3<T> dO = random_tensor<T>(heads, n, d_v, rng);
  attn::AttentionOptions<T> options;
  options.causal = Causal::BottomRight;
  options.window = 5;
  options.softcap = T(3);
  options.sink = T(0.25);
  options.scale = T(0.4);
  options.alibi_slope = T(0.125);
  options.mask = random_mask(n, m, 0.2, rng);
  options.bias = attn_test::random_matrix<T>(n, m, rng, 0.5);
  const HeadGrads<T> grads = attn::attention_heads_backward(Q, K, V, dO, options);
  ASSERT_EQ(grads.dbias.rows(), n);
  EXPECT_NE(grads.dsink, T(0));
  expect_head_grads(grads, per_head_reference(Q, K, V, dO, options, {}), true);

  attn::AttentionOptions<T> plain;  // and without options: no dbias, dsink 0
  const HeadGrads<T> none = attn::attention_heads_backward(Q, K, V, dO, plain);
  EXPECT_EQ(none.dbias.size(), 0);
  EXPECT_EQ(none.dsink, T(0));
  EXPECT_EQ(none.dbiases.size(), 0);
  EXPECT_TRUE(none.dsinks.empty());
  expect_head_grads(none, per_head_reference(Q, K, V, dO, plain, {}), true);
}

/// Grouped-query (6 over 2) and multi-query (4 over 1) attention: the gradient of a shared
/// key/value head is the sum over its query heads, in head order.
TYPED_TEST(HeadsBackward, SharedKeyValueHeadsSumTheirQueryHeads) {
  using T = TypeParam;
  std::mt19937 rng(102);
  for (const Index kv_heads : {2, 1}) {
    const Index heads = kv_heads == 2 ? 6 : 4, n = 5, m = 7, d = 4, d_v = 3;
    SCOPED_TRACE(std::to_string(heads) + " query heads over " + std::to_string(kv_heads));
    const Tensor3<T> Q = random_tensor<T>(heads, n, d, rng);
    const Tensor3<T> K = random_tensor<T>(kv_heads, m, d, rng);
    const Tensor3<T> V = random_tensor<T>(kv_heads, m, d_v, rng);
    const Tensor3<T> dO = random_tensor<T>(heads, n, d_v, rng);
    attn::AttentionOptions<T> options;
    options.causal = Causal::TopLeft;
    options.query_offset = 2;
    options.sink = T(-0.5);
    const HeadGrads<T> grads = attn::attention_heads_backward(Q, K, V, dO, options);
    ASSERT_EQ(grads.dK.dimension(0), kv_heads);
    expect_head_grads(grads, per_head_reference(Q, K, V, dO, options, {}), true);
  }
}

/// Per-head ALiBi slopes, sinks, masks and biases, grouped: each head by its own values; dsinks
/// and dbiases per head.
TYPED_TEST(HeadsBackward, PerHeadValuesGiveTheirOwnGradients) {
  using T = TypeParam;
  std::mt19937 rng(103);
  const Index heads = 4, kv_heads = 2, n = 5, m = 6, d = 4, d_v = 5;
  const Tensor3<T> Q = random_tensor<T>(heads, n, d, rng);
  const Tensor3<T> K = random_tensor<T>(kv_heads, m, d, rng);
  const Tensor3<T> V = random_tensor<T>(kv_heads, m, d_v, rng);
  const Tensor3<T> dO = random_tensor<T>(heads, n, d_v, rng);
  HeadOptions<T> per_head;
  per_head.alibi_slopes = std::vector<T>{T(0.5), T(0.25), T(0), T(1)};
  per_head.sinks = std::vector<T>{T(0.5), T(-1), T(2), -std::numeric_limits<T>::infinity()};
  attn::HeadMask masks(heads, n, m);
  for (Index h = 0; h < heads; ++h) {
    const Mask mask = random_mask(n, m, 0.3, rng);
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < m; ++j) masks(h, i, j) = mask(i, j);
    }
  }
  per_head.masks = masks;
  per_head.biases = random_tensor<T>(heads, n, m, rng);
  attn::AttentionOptions<T> options;
  options.softcap = T(4);
  const HeadGrads<T> grads = attn::attention_heads_backward(Q, K, V, dO, options, per_head);
  ASSERT_EQ(grads.dsinks.size(), to_size(heads));
  EXPECT_EQ(grads.dsinks[3], T(0)) << "a sink of -inf takes no weight";
  EXPECT_NE(grads.dsinks[0], T(0));
  EXPECT_EQ(grads.dbias.size(), 0);
  EXPECT_EQ(grads.dsink, T(0));
  expect_head_grads(grads, per_head_reference(Q, K, V, dO, options, per_head), true);
  // Masked entries get exactly zero bias gradient.
  for (Index h = 0; h < heads; ++h) {
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < m; ++j) {
        if (!masks(h, i, j)) {
          EXPECT_EQ(grads.dbiases(h, i, j), T(0)) << h << ", " << i << ", " << j;
        }
      }
    }
  }
}

/// Heads large enough for the tiled backward (n m > 256^2), grouped: still attention_backward's
/// gradients head by head.
TYPED_TEST(HeadsBackward, TiledPathHeadByHead) {
  using T = TypeParam;
  std::mt19937 rng(104);
  const Index heads = 2, n = 260, m = 270, d = 8;
  const Tensor3<T> Q = random_tensor<T>(heads, n, d, rng);
  const Tensor3<T> K = random_tensor<T>(1, m, d, rng);
  const Tensor3<T> V = random_tensor<T>(1, m, d, rng);
  const Tensor3<T> dO = random_tensor<T>(heads, n, d, rng);
  attn::AttentionOptions<T> options;
  options.causal = Causal::BottomRight;
  options.sink = T(1);
  expect_head_grads(attn::attention_heads_backward(Q, K, V, dO, options),
                    per_head_reference(Q, K, V, dO, options, {}), true);
}

/// The form taking the forward's output and log-sum-exp (from the `attention_heads` overload that
/// returns it) equals the one that runs the forward again; one query takes the decoding path.
TYPED_TEST(HeadsBackward, FromForwardOutputAndLogSumExp) {
  using T = TypeParam;
  std::mt19937 rng(105);
  for (const Index n : {1, 6}) {
    SCOPED_TRACE(std::to_string(n) + " queries");
    const Index heads = 4, kv_heads = 2, m = 8, d = 4;
    const Tensor3<T> Q = random_tensor<T>(heads, n, d, rng);
    const Tensor3<T> K = random_tensor<T>(kv_heads, m, d, rng);
    const Tensor3<T> V = random_tensor<T>(kv_heads, m, d, rng);
    const Tensor3<T> dO = random_tensor<T>(heads, n, d, rng);
    attn::AttentionOptions<T> options;
    options.causal = Causal::BottomRight;
    HeadOptions<T> per_head;
    per_head.sinks = std::vector<T>{T(0), T(1), T(-1), T(0.5)};
    Tensor3<T> O;
    Matrix<T> lse;
    attn::attention_heads(Q, K, V, options, per_head, O, lse);
    ASSERT_EQ(lse.rows(), heads);
    ASSERT_EQ(lse.cols(), n);
    EXPECT_TRUE(
        attn_test::near_t<T>(flat(O), flat(attn::attention_heads(Q, K, V, options, per_head))));
    const HeadGrads<T> from_forward =
        attn::attention_heads_backward(Q, K, V, O, lse, dO, options, per_head);
    expect_head_grads(from_forward, attn::attention_heads_backward(Q, K, V, dO, options, per_head),
                      false);
    // The log-sum-exp of head h is flash_attention's for that head's options.
    for (Index h = 0; h < heads; ++h) {
      attn::Vector<T> expected;
      attn::flash_attention(item(Q, h), item(K, h / 2), item(V, h / 2),
                            options_of_head(options, per_head, h, n, m), expected);
      EXPECT_TRUE(attn_test::near_t<T>(lse.row(h).transpose(), expected)) << "head " << h;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Finite differences (double)
// ------------------------------------------------------------------------------------------------

/// sum(A o B) of two tensors of one shape.
double dot(const Tensor3<double>& a, const Tensor3<double>& b) {
  return flat(a).cwiseProduct(flat(b)).sum();
}

/// The heads' loss sum(attention_heads(...) o dO) of {Q, K, V (flattened heads), sinks, biases}
/// against every gradient: per-head sinks (1 x h_q) and biases (h_q n x m) -> dsinks, dbiases, or
/// a shared sink (1 x 1) and bias (n x m) -> dsink, dbias; with per-head slopes and masks.
void check_heads_gradients(bool per_head_values) {
  SCOPED_TRACE(per_head_values ? "per-head sinks and biases" : "shared sink and bias");
  const attn_test::ThreadCount threads(1);  // (faster; the bits are the same for any count)
  std::mt19937 rng(201);
  const Index heads = 4, kv_heads = 2, n = 4, m = 5, d = 3, d_v = 2;
  const Tensor3<double> dO = random_tensor<double>(heads, n, d_v, rng);
  attn::AttentionOptions<double> options;
  options.causal = Causal::BottomRight;
  options.softcap = 2.5;
  HeadOptions<double> per_head;
  per_head.alibi_slopes = std::vector<double>{0.25, 0, 0.5, 0.125};
  attn::HeadMask masks(heads, n, m);
  masks.setConstant(true);
  masks(1, 2, 0) = false;
  masks(3, 3, 4) = false;
  per_head.masks = masks;
  const Index sinks = per_head_values ? heads : 1;
  const Index bias_rows = per_head_values ? heads * n : n;
  const GradInputs inputs = {attn_test::random_matrix<double>(heads * n, d, rng),
                             attn_test::random_matrix<double>(kv_heads * m, d, rng),
                             attn_test::random_matrix<double>(kv_heads * m, d_v, rng),
                             attn_test::random_matrix<double>(1, sinks, rng),
                             attn_test::random_matrix<double>(bias_rows, m, rng, 0.5)};
  const auto with = [&](const GradInputs& in) {
    HeadOptions<double> p = per_head;
    attn::AttentionOptions<double> o = options;
    if (per_head_values) {
      p.sinks = std::vector<double>(in[3].data(), in[3].data() + heads);
      p.biases = unflat(in[4], heads);
    } else {
      o.sink = in[3](0, 0);
      o.bias = in[4];
    }
    return std::make_pair(o, p);
  };
  const auto loss = [&](const GradInputs& in) {
    const auto [o, p] = with(in);
    return dot(attn::attention_heads(unflat(in[0], heads), unflat(in[1], kv_heads),
                                     unflat(in[2], kv_heads), o, p),
               dO);
  };
  const auto [o, p] = with(inputs);
  const HeadGrads<double> g = attn::attention_heads_backward(
      unflat(inputs[0], heads), unflat(inputs[1], kv_heads), unflat(inputs[2], kv_heads), dO, o, p);
  const Matrix<double> dsinks =
      per_head_values ? Matrix<double>(Eigen::Map<const Matrix<double>>(g.dsinks.data(), 1, heads))
                      : Matrix<double>::Constant(1, 1, g.dsink);
  const GradInputs analytic = {flat(g.dQ), flat(g.dK), flat(g.dV), dsinks,
                               per_head_values ? flat(g.dbiases) : g.dbias};
  const attn::GradcheckResult result = attn::gradcheck(loss, inputs, analytic);
  EXPECT_TRUE(result) << result.message << " (inputs: 0 Q, 1 K, 2 V, 3 sinks, 4 biases)";
}

TEST(HeadsBackwardGradcheck, GroupedHeadsWithPerHeadSinksAndBiases) { check_heads_gradients(true); }

TEST(HeadsBackwardGradcheck, GroupedHeadsWithSharedSinkAndBias) { check_heads_gradients(false); }

/// The layer's inputs and parameters as one list of matrices, in a fixed order (biases 1 x k,
/// empty ones 1 x 0).
enum Slot { kQuery, kKey, kValue, kWQ, kWK, kWV, kWO, kbQ, kbK, kbV, kbO, kBiasK, kBiasV };

GradInputs pack(const MultiHeadAttention<double>& layer, const Tensor3<double>& query,
                const Tensor3<double>& key, const Tensor3<double>& value) {
  return {flat(query), flat(key), flat(value), layer.W_Q, layer.W_K,    layer.W_V,   layer.W_O,
          layer.b_Q,   layer.b_K, layer.b_V,   layer.b_O, layer.bias_k, layer.bias_v};
}

GradInputs pack(const MultiHeadGrads<double>& g) {
  return {flat(g.d_query), flat(g.d_key), flat(g.d_value), g.dW_Q, g.dW_K,     g.dW_V,    g.dW_O,
          g.db_Q,          g.db_K,        g.db_V,          g.db_O, g.d_bias_k, g.d_bias_v};
}

void unpack(const GradInputs& in, Index batch, MultiHeadAttention<double>& layer,
            Tensor3<double>& query, Tensor3<double>& key, Tensor3<double>& value) {
  query = unflat(in[kQuery], batch);
  key = unflat(in[kKey], batch);
  value = unflat(in[kValue], batch);
  layer.W_Q = in[kWQ];
  layer.W_K = in[kWK];
  layer.W_V = in[kWV];
  layer.W_O = in[kWO];
  layer.b_Q = in[kbQ];
  layer.b_K = in[kbK];
  layer.b_V = in[kbV];
  layer.b_O = in[kbO];
  layer.bias_k = in[kBiasK];
  layer.bias_v = in[kBiasV];
}

/// A layer of `config` with random weights and biases (and bias_k, bias_v).
MultiHeadAttention<double> random_layer(const MultiHeadConfig& config, std::mt19937& rng) {
  MultiHeadAttention<double> layer(config, 7);
  for (RowVector<double>* b :
       {&layer.b_Q, &layer.b_K, &layer.b_V, &layer.b_O, &layer.bias_k, &layer.bias_v}) {
    if (b->size() > 0) *b = random_row<double>(b->size(), rng);
  }
  return layer;
}

/// gradcheck of the layer's loss sum(forward(query, key, value) o dY) over every input and
/// parameter.
void check_layer(const MultiHeadConfig& config, const MultiHeadOptions<double>& options,
                 Index batch, Index n, Index m, std::uint32_t seed,
                 std::optional<attn::RopeStyle> rope = std::nullopt,
                 const attn::RopeOptions<double>& rope_options = {}) {
  const attn_test::ThreadCount threads(1);  // (faster; the bits are the same for any count)
  std::mt19937 rng(seed);
  MultiHeadAttention<double> layer = random_layer(config, rng);
  layer.rope = rope;
  layer.rope_options = rope_options;
  const MultiHeadConfig& c = layer.config();
  const Tensor3<double> query = random_tensor<double>(batch, n, c.embed_dim, rng);
  const Tensor3<double> key = random_tensor<double>(batch, m, c.kdim, rng);
  const Tensor3<double> value = random_tensor<double>(batch, m, c.vdim, rng);
  const Tensor3<double> dY = random_tensor<double>(batch, n, c.embed_dim, rng);
  const MultiHeadGrads<double> grads = layer.backward(query, key, value, dY, options);
  MultiHeadAttention<double> probe = layer;
  Tensor3<double> q, k, v;
  const auto loss = [&](const GradInputs& in) {
    unpack(in, batch, probe, q, k, v);
    return dot(probe.forward(q, k, v, options).output, dY);
  };
  const attn::GradcheckResult result =
      attn::gradcheck(loss, pack(layer, query, key, value), pack(grads));
  EXPECT_TRUE(result) << result.message
                      << " (inputs: 0 query, 1 key, 2 value, 3-6 W_Q W_K W_V W_O, 7-10 b_Q b_K "
                         "b_V b_O, 11 bias_k, 12 bias_v)";
  EXPECT_EQ(grads.db_Q.size(), c.bias ? layer.b_Q.size() : 0);
  EXPECT_EQ(grads.d_bias_k.size(), layer.bias_k.size());
}

TEST(MultiHeadBackwardGradcheck, SelfAttentionCausalWithKeyPadding) {
  MultiHeadOptions<double> options;
  options.causal = Causal::BottomRight;
  Mask key_valid = Mask::Constant(2, 4, true);
  key_valid(1, 3) = false;
  key_valid(1, 2) = false;
  options.key_valid = key_valid;
  check_layer({8, 2}, options, 2, 4, 4, 301);
}

TEST(MultiHeadBackwardGradcheck, GroupedQueryWithPerHeadSlopesAndSinksSoftcapWindow) {
  MultiHeadConfig config{8, 4};
  config.num_kv_heads = 2;
  MultiHeadOptions<double> options;
  options.causal = Causal::TopLeft;
  options.window = 2;
  options.softcap = 2;
  options.per_head.alibi_slopes = std::vector<double>{0.5, 0, 0.25, 1};
  options.per_head.sinks = std::vector<double>{0, 1, -0.5, 0.25};
  check_layer(config, options, 2, 4, 5, 302);
}

TEST(MultiHeadBackwardGradcheck, MultiQueryCrossAttentionKdimVdimWithSharedBiasAndMask) {
  MultiHeadConfig config{6, 3};
  config.num_kv_heads = 1;
  config.kdim = 4;
  config.vdim = 5;
  std::mt19937 rng(3);
  MultiHeadOptions<double> options;
  options.bias = attn_test::random_matrix<double>(3, 5, rng, 0.5);
  options.mask = random_mask(3, 5, 0.3, rng);
  options.sink = 0.5;
  check_layer(config, options, 2, 3, 5, 303);
}

// RoPE in the layer: the gradients pass back through the rotation of the queries and keys.
TEST(MultiHeadBackwardGradcheck, RopeHalfGroupedQueryCausal) {
  MultiHeadConfig config{8, 2};
  config.num_kv_heads = 1;
  MultiHeadOptions<double> options;
  options.causal = Causal::BottomRight;
  attn::RopeOptions<double> rope;
  rope.base = 100;
  check_layer(config, options, 2, 4, 4, 305, attn::RopeStyle::Half, rope);
}

TEST(MultiHeadBackwardGradcheck, RopeInterleavedPartialCrossAttentionWithQueryOffset) {
  MultiHeadConfig config{8, 2};
  MultiHeadOptions<double> options;
  options.query_offset = 3;
  options.causal = Causal::TopLeft;
  attn::RopeOptions<double> rope;
  rope.rotary_dim = 2;
  rope.base = 50;
  check_layer(config, options, 1, 3, 6, 306, attn::RopeStyle::Interleaved, rope);
}

TEST(MultiHeadBackwardGradcheck, NoBiases) {
  MultiHeadConfig config{8, 2};
  config.bias = false;
  check_layer(config, {}, 2, 3, 3, 304);
}

TEST(MultiHeadBackwardGradcheck, AddBiasKvAndZeroAttnWithKeyPaddingAndSink) {
  for (const bool zero_attn : {false, true}) {
    SCOPED_TRACE(zero_attn ? "add_bias_kv, add_zero_attn" : "add_bias_kv");
    MultiHeadConfig config{8, 2};
    config.kdim = 6;
    config.vdim = 4;
    config.num_kv_heads = 1;
    config.add_bias_kv = true;
    config.add_zero_attn = zero_attn;
    MultiHeadOptions<double> options;
    Mask key_valid = Mask::Constant(2, 4, true);
    key_valid.row(1).setConstant(false);  // item 1 sees only the appended keys
    key_valid(0, 1) = false;
    options.key_valid = key_valid;
    options.causal = Causal::BottomRight;
    options.sink = -0.25;
    options.softcap = 3;
    check_layer(config, options, 2, 3, 4, 305);
  }
}

/// The single-sequence form: backward(X, dY) is the batch form with batch 1; dL/dX, the sum of
/// the three roles (`self_input_grad`), against finite differences of forward(X).
TEST(MultiHeadBackwardGradcheck, SingleSequenceSelfAttention) {
  const attn_test::ThreadCount threads(1);
  std::mt19937 rng(306);
  const MultiHeadAttention<double> layer = random_layer({8, 2}, rng);
  const Matrix<double> X = attn_test::random_matrix<double>(5, 8, rng);
  const Matrix<double> dY = attn_test::random_matrix<double>(5, 8, rng);
  MultiHeadOptions<double> options;
  options.causal = Causal::BottomRight;
  const MultiHeadGrads<double> single = layer.backward(X, dY, options);
  const Tensor3<double> x = unflat(X, 1);
  const MultiHeadGrads<double> batch = layer.backward(x, x, x, unflat(dY, 1), options);
  EXPECT_TRUE(attn_test::identical(flat(single.d_key), flat(batch.d_key)));
  EXPECT_TRUE(attn_test::identical(single.dW_V, batch.dW_V));
  const auto loss = [&](const GradInputs& in) {
    return layer.forward(in[0], options).cwiseProduct(dY).sum();
  };
  const attn::GradcheckResult result = attn::gradcheck(loss, {X}, {flat(single.self_input_grad())});
  EXPECT_TRUE(result) << result.message;
}

// ------------------------------------------------------------------------------------------------
// Properties
// ------------------------------------------------------------------------------------------------

/// A padded key never reaches the loss: its rows of d_key and d_value are exactly zero. A batch
/// item with every key padded gives an output of b_O alone: zero d_query, finite gradients.
TEST(MultiHeadBackward, PaddedKeysGetZeroGradientAndAFullyPaddedItemNoNaN) {
  std::mt19937 rng(401);
  const MultiHeadAttention<double> layer = random_layer({8, 2}, rng);
  const Index n = 3, m = 5;
  const Tensor3<double> query = random_tensor<double>(3, n, 8, rng);
  const Tensor3<double> key = random_tensor<double>(3, m, 8, rng);
  const Tensor3<double> value = random_tensor<double>(3, m, 8, rng);
  const Tensor3<double> dY = random_tensor<double>(3, n, 8, rng);
  Mask key_valid = Mask::Constant(3, m, true);
  key_valid(0, 1) = false;
  key_valid(1, 4) = false;
  key_valid.row(2).setConstant(false);
  MultiHeadOptions<double> options;
  options.key_valid = key_valid;
  const MultiHeadGrads<double> g = layer.backward(query, key, value, dY, options);
  for (Index b = 0; b < 3; ++b) {
    const Matrix<double> d_key = item(g.d_key, b);
    const Matrix<double> d_value = item(g.d_value, b);
    for (Index j = 0; j < m; ++j) {
      if (key_valid(b, j)) {
        EXPECT_GT(d_value.row(j).norm(), 0.0) << "item " << b << ", real key " << j;
      } else {
        EXPECT_TRUE(attn_test::all_zero(d_key.row(j))) << "item " << b << ", padded key " << j;
        EXPECT_TRUE(attn_test::all_zero(d_value.row(j))) << "item " << b << ", padded key " << j;
      }
    }
  }
  EXPECT_TRUE(attn_test::all_zero(item(g.d_query, 2)));
  for (const Matrix<double>& grad : pack(g)) EXPECT_TRUE(attn_test::all_finite(grad));
}

/// The PyTorch-layout accessors: the transposes of the X-side gradients, stacked as PyTorch
/// stacks in_proj_weight; a grouped-query or kdim/vdim layer has no in_proj_weight.
TEST(MultiHeadBackward, PyTorchLayoutAccessors) {
  std::mt19937 rng(402);
  const MultiHeadAttention<double> layer = random_layer({6, 2}, rng);
  const Tensor3<double> x = random_tensor<double>(2, 3, 6, rng);
  const MultiHeadGrads<double> g = layer.backward(x, x, x, random_tensor<double>(2, 3, 6, rng));
  const Matrix<double> in_proj = g.in_proj_weight_grad();
  ASSERT_EQ(in_proj.rows(), 18);
  ASSERT_EQ(in_proj.cols(), 6);
  EXPECT_TRUE(attn_test::identical(in_proj.topRows(6), Matrix<double>(g.dW_Q.transpose())));
  EXPECT_TRUE(attn_test::identical(in_proj.middleRows(6, 6), Matrix<double>(g.dW_K.transpose())));
  EXPECT_TRUE(attn_test::identical(in_proj.bottomRows(6), Matrix<double>(g.dW_V.transpose())));
  EXPECT_TRUE(attn_test::identical(g.out_proj_weight_grad(), Matrix<double>(g.dW_O.transpose())));
  const RowVector<double> in_bias = g.in_proj_bias_grad();
  ASSERT_EQ(in_bias.size(), 18);
  EXPECT_TRUE(attn_test::identical(in_bias.segment(6, 6), g.db_K));
  EXPECT_TRUE(attn_test::identical(g.out_proj_bias_grad(), g.db_O));
  const Tensor3<double> dx = g.self_input_grad();
  EXPECT_TRUE(
      attn_test::near_t<double>(flat(dx), flat(g.d_query) + flat(g.d_key) + flat(g.d_value)));

  MultiHeadConfig grouped{6, 2};
  grouped.num_kv_heads = 1;
  const MultiHeadAttention<double> gqa(grouped, 1);
  const MultiHeadGrads<double> gg = gqa.backward(x, x, x, random_tensor<double>(2, 3, 6, rng));
  attn_test::expect_shape_error([&] { (void)gg.in_proj_weight_grad(); },
                                {"MultiHeadGrads::in_proj_weight_grad", "6 x 3", "6 x 6"});
  EXPECT_EQ(gg.k_proj_weight_grad().rows(), 3);
}

// ------------------------------------------------------------------------------------------------
// The same bits for any thread count
// ------------------------------------------------------------------------------------------------

template <class T>
class MultiHeadBackwardThreads : public ::testing::Test {};
TYPED_TEST_SUITE(MultiHeadBackwardThreads, attn_test::ScalarTypes);

TYPED_TEST(MultiHeadBackwardThreads, HeadsBackwardOneAndTwoThreads) {
  using T = TypeParam;
  std::mt19937 rng(501);
  // Small heads (materialised), heads past the tiled crossover; three key/value heads (tasks in
  // parallel, and a sum over them whose order shows in the bits) and one (the heads one after
  // the other, each kernel in parallel).
  for (const Index n : {40, 260}) {
    for (const Index kv_heads : {3, 1}) {
      SCOPED_TRACE(std::to_string(n) + " queries, " + std::to_string(kv_heads) + " kv heads");
      const Index heads = 6, m = n + 10, d = 8;
      const Tensor3<T> Q = random_tensor<T>(heads, n, d, rng);
      const Tensor3<T> K = random_tensor<T>(kv_heads, m, d, rng);
      const Tensor3<T> V = random_tensor<T>(kv_heads, m, d, rng);
      const Tensor3<T> dO = random_tensor<T>(heads, n, d, rng);
      attn::AttentionOptions<T> options;
      options.causal = Causal::BottomRight;
      options.bias = attn_test::random_matrix<T>(n, m, rng, 0.5);
      options.sink = T(0.5);
      HeadGrads<T> one, two;
      {
        const attn_test::ThreadCount threads(1);
        one = attn::attention_heads_backward(Q, K, V, dO, options);
      }
      {
        const attn_test::ThreadCount threads(2);
        two = attn::attention_heads_backward(Q, K, V, dO, options);
      }
      EXPECT_TRUE(identical3(one.dQ, two.dQ));
      EXPECT_TRUE(identical3(one.dK, two.dK));
      EXPECT_TRUE(identical3(one.dV, two.dV));
      EXPECT_TRUE(attn_test::identical(one.dbias, two.dbias));
      EXPECT_EQ(one.dsink, two.dsink);
    }
  }
}

TYPED_TEST(MultiHeadBackwardThreads, LayerBackwardOneAndTwoThreads) {
  using T = TypeParam;
  std::mt19937 rng(502);
  // batch 2 x 2 key/value heads: tasks in parallel; batch 1 x 1: kernels in parallel; 260 tokens
  // take the tiled backward.
  for (const Index batch : {2, 1}) {
    for (const Index n : {20, 260}) {
      SCOPED_TRACE("batch " + std::to_string(batch) + ", " + std::to_string(n) + " tokens");
      MultiHeadConfig config{16, 4};
      config.num_kv_heads = batch == 2 ? 2 : 1;
      config.add_bias_kv = true;
      MultiHeadAttention<T> layer(config, 3);
      layer.b_Q = random_row<T>(16, rng);
      layer.bias_k = random_row<T>(layer.bias_k.size(), rng);
      const Tensor3<T> x = random_tensor<T>(batch, n, 16, rng);
      const Tensor3<T> dY = random_tensor<T>(batch, n, 16, rng);
      MultiHeadOptions<T> options;
      options.causal = Causal::BottomRight;
      Mask key_valid = Mask::Constant(batch, n, true);
      key_valid(batch - 1, n - 1) = false;
      options.key_valid = key_valid;
      MultiHeadGrads<T> one, two;
      {
        const attn_test::ThreadCount threads(1);
        one = layer.backward(x, x, x, dY, options);
      }
      {
        const attn_test::ThreadCount threads(2);
        two = layer.backward(x, x, x, dY, options);
      }
      EXPECT_TRUE(identical3(one.d_query, two.d_query));
      EXPECT_TRUE(identical3(one.d_key, two.d_key));
      EXPECT_TRUE(identical3(one.d_value, two.d_value));
      EXPECT_TRUE(attn_test::identical(one.dW_Q, two.dW_Q));
      EXPECT_TRUE(attn_test::identical(one.dW_K, two.dW_K));
      EXPECT_TRUE(attn_test::identical(one.dW_V, two.dW_V));
      EXPECT_TRUE(attn_test::identical(one.dW_O, two.dW_O));
      EXPECT_TRUE(attn_test::identical(one.db_Q, two.db_Q));
      EXPECT_TRUE(attn_test::identical(one.db_K, two.db_K));
      EXPECT_TRUE(attn_test::identical(one.db_V, two.db_V));
      EXPECT_TRUE(attn_test::identical(one.db_O, two.db_O));
      EXPECT_TRUE(attn_test::identical(one.d_bias_k, two.d_bias_k));
      EXPECT_TRUE(attn_test::identical(one.d_bias_v, two.d_bias_v));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// PyTorch 1.13's gradients (tests/data/mha_grad_*.json)
// ------------------------------------------------------------------------------------------------

/// A nested JSON list of rank 3 as a tensor.
template <class T>
Tensor3<T> tensor3(const nlohmann::json& list, const std::string& where) {
  if (!list.is_array() || list.empty() || !list.at(0).is_array() || list.at(0).empty()) {
    throw std::runtime_error(where + " is not a rank-3 nested list");
  }
  const Index a = static_cast<Index>(list.size());
  const Index b = static_cast<Index>(list.at(0).size());
  const Index c = static_cast<Index>(list.at(0).at(0).size());
  Tensor3<T> t(a, b, c);
  for (Index i = 0; i < a; ++i) {
    for (Index j = 0; j < b; ++j) {
      const nlohmann::json& row = list.at(to_size(i)).at(to_size(j));
      if (static_cast<Index>(row.size()) != c) throw std::runtime_error(where + " is ragged");
      for (Index k = 0; k < c; ++k) t(i, j, k) = static_cast<T>(row.at(to_size(k)).get<double>());
    }
  }
  return t;
}

/// A flat JSON list as a row vector.
template <class T>
RowVector<T> row_vector(const nlohmann::json& list) {
  RowVector<T> v(static_cast<Index>(list.size()));
  for (Index k = 0; k < v.size(); ++k) v(k) = static_cast<T>(list.at(to_size(k)).get<double>());
  return v;
}

/// Tolerances of the comparison with PyTorch: those of T, relative to the largest entry of each
/// expected gradient (a gradient entry is a sum of terms of that size, which may cancel to
/// nearly zero: only its absolute error is then meaningful).
template <class T, class DA>
::testing::AssertionResult near_scaled(const Eigen::MatrixBase<DA>& actual,
                                       const Matrix<double>& expected) {
  const double scale = std::max(1.0, expected.cwiseAbs().maxCoeff());
  return attn_test::near(actual, expected, attn_test::Tol<T>::rel,
                         attn_test::Tol<T>::abs + attn_test::Tol<T>::rel * scale);
}

/// The largest |actual - expected| / max(1, max |expected|) over a case's gradients: the
/// comparison's error, printed for the record.
struct WorstError {
  double value = 0;
  template <class DA>
  void add(const Eigen::MatrixBase<DA>& actual, const Matrix<double>& expected) {
    if (actual.rows() != expected.rows() || actual.cols() != expected.cols()) return;
    const double scale = std::max(1.0, expected.cwiseAbs().maxCoeff());
    value =
        std::max(value, (actual.template cast<double>() - expected).cwiseAbs().maxCoeff() / scale);
  }
};

template <class T>
void check_pytorch_case(const std::string& name) {
  const attn_test::Case c = attn_test::load_case(name);
  const nlohmann::json& params = c.params();
  MultiHeadConfig config{params.at("embed_dim").get<Index>(), params.at("num_heads").get<Index>()};
  config.kdim = params.at("kdim").get<Index>();
  config.vdim = params.at("vdim").get<Index>();
  config.bias = params.at("bias").get<bool>();
  config.add_bias_kv = params.at("add_bias_kv").get<bool>();
  config.add_zero_attn = params.at("add_zero_attn").get<bool>();
  const Index E = config.embed_dim;
  MultiHeadAttention<T> layer(config, 0);
  const nlohmann::json& inputs = c.json().at("inputs");
  RowVector<T> in_bias, out_bias;
  if (config.bias) {
    in_bias.resize(3 * E);
    in_bias << row_vector<T>(inputs.at("b_Q")), row_vector<T>(inputs.at("b_K")),
        row_vector<T>(inputs.at("b_V"));
    out_bias = row_vector<T>(inputs.at("b_O"));
  }
  if (c.has_input("torch_in_proj_weight")) {
    layer.load_pytorch(c.input<T>("torch_in_proj_weight"), in_bias,
                       c.input<T>("torch_out_proj_weight"), out_bias);
  } else {
    layer.load_pytorch(Matrix<T>(c.input<T>("W_Q").transpose()),
                       Matrix<T>(c.input<T>("W_K").transpose()),
                       Matrix<T>(c.input<T>("W_V").transpose()), in_bias,
                       c.input<T>("torch_out_proj_weight"), out_bias);
  }
  if (config.add_bias_kv) {
    layer.bias_k = row_vector<T>(inputs.at("bias_k"));
    layer.bias_v = row_vector<T>(inputs.at("bias_v"));
  }
  EXPECT_EQ(layer.parameter_count(), params.at("parameter_count").get<Index>());
  const Tensor3<T> query = tensor3<T>(inputs.at("query"), name + ": query");
  const Tensor3<T> key = tensor3<T>(inputs.at("key"), name + ": key");
  const Tensor3<T> value = tensor3<T>(inputs.at("value"), name + ": value");
  const Tensor3<T> dO = tensor3<T>(inputs.at("dO"), name + ": dO");
  MultiHeadOptions<T> options;
  const std::string causal = params.at("causal").get<std::string>();
  ASSERT_TRUE(causal == "none" || causal == "bottom_right") << causal;
  if (causal == "bottom_right") options.causal = Causal::BottomRight;
  options.key_valid = c.mask("key_valid");

  const nlohmann::json& expected = c.json().at("expected");
  const auto expected3 = [&](const char* key_name) {
    return flat(tensor3<double>(expected.at(key_name), name + ": expected." + key_name));
  };
  const auto expected_row = [&](const char* key_name) {
    return Matrix<double>(row_vector<double>(expected.at(key_name)));
  };
  WorstError worst;
  const auto check = [&](const char* what, const auto& actual, const Matrix<double>& e) {
    EXPECT_TRUE(near_scaled<T>(actual, e)) << what;
    worst.add(actual, e);
  };
  check("output", flat(layer.forward(query, key, value, options).output), expected3("output"));

  const MultiHeadGrads<T> g = layer.backward(query, key, value, dO, options);
  check("d_query", flat(g.d_query), expected3("d_query"));
  check("d_key", flat(g.d_key), expected3("d_key"));
  check("d_value", flat(g.d_value), expected3("d_value"));
  if (c.has_expected("grad_in_proj_weight")) {
    check("in_proj_weight", g.in_proj_weight_grad(), c.expected<double>("grad_in_proj_weight"));
  } else {
    check("q_proj_weight", g.q_proj_weight_grad(), c.expected<double>("grad_q_proj_weight"));
    check("k_proj_weight", g.k_proj_weight_grad(), c.expected<double>("grad_k_proj_weight"));
    check("v_proj_weight", g.v_proj_weight_grad(), c.expected<double>("grad_v_proj_weight"));
  }
  check("out_proj_weight", g.out_proj_weight_grad(), c.expected<double>("grad_out_proj_weight"));
  ASSERT_EQ(config.bias, c.has_expected("grad_in_proj_bias"));
  if (config.bias) {
    check("in_proj_bias", g.in_proj_bias_grad(), expected_row("grad_in_proj_bias"));
    check("out_proj_bias", g.out_proj_bias_grad(), expected_row("grad_out_proj_bias"));
  }
  ASSERT_EQ(config.add_bias_kv, c.has_expected("grad_bias_k"));
  if (config.add_bias_kv) {
    check("bias_k", g.d_bias_k, expected_row("grad_bias_k"));
    check("bias_v", g.d_bias_v, expected_row("grad_bias_v"));
  }
  std::printf(
      "[ note     ] %s (%s): largest error against PyTorch, relative to each tensor's "
      "largest entry: %.3g\n",
      name.c_str(), sizeof(T) == 4 ? "float" : "double", worst.value);
}

template <class T>
class MultiHeadBackwardReference : public ::testing::Test {};
TYPED_TEST_SUITE(MultiHeadBackwardReference, attn_test::ScalarTypes);

TYPED_TEST(MultiHeadBackwardReference, CausalSelfAttentionWithKeyPadding) {
  check_pytorch_case<TypeParam>("mha_grad_causal_padding");
}

TYPED_TEST(MultiHeadBackwardReference, CrossAttentionKdimVdimAddBiasKvAndZeroAttn) {
  check_pytorch_case<TypeParam>("mha_grad_cross_bias_kv");
}

// ------------------------------------------------------------------------------------------------
// Shape errors
// ------------------------------------------------------------------------------------------------

TEST(MultiHeadBackwardErrors, HeadsBackwardGradientShape) {
  const Tensor3<double> Q(4, 3, 2), K(2, 5, 2), V(2, 5, 6), dO(4, 3, 5);
  attn_test::expect_shape_error([&] { (void)attn::attention_heads_backward(Q, K, V, dO); },
                                {"attention_heads_backward", "dO", "(4, 3, 5)", "(2, 5, 6)"});
}

TEST(MultiHeadBackwardErrors, HeadsBackwardChecksTheForwardsShapes) {
  const Tensor3<double> Q(4, 3, 2), K(3, 5, 2), V(3, 5, 6), dO(4, 3, 6);
  attn_test::expect_shape_error([&] { (void)attn::attention_heads_backward(Q, K, V, dO); },
                                {"attention_heads_backward", "(4, 3, 2)", "(3, 5, 2)"});
}

TEST(MultiHeadBackwardErrors, HeadsBackwardOutputAndLogSumExpShapes) {
  Tensor3<double> Q(2, 3, 2), K(1, 5, 2), V(1, 5, 4), dO(2, 3, 4), O(2, 3, 4), wrong_O(2, 4, 4);
  Q.setZero();
  K.setZero();
  V.setZero();
  dO.setZero();
  O.setZero();
  wrong_O.setZero();
  const Matrix<double> lse = Matrix<double>::Zero(2, 3);
  attn_test::expect_shape_error(
      [&] { (void)attn::attention_heads_backward(Q, K, V, O, Matrix<double>(3, 2), dO); },
      {"attention_heads_backward", "log_sum_exp", "3 x 2", "(2, 3, 2)"});
  attn_test::expect_shape_error(
      [&] { (void)attn::attention_heads_backward(Q, K, V, wrong_O, lse, dO); },
      {"attention_heads_backward", "O is (2, 4, 4)", "(2, 3, 2)"});
}

TEST(MultiHeadBackwardErrors, LayerBackwardGradientShape) {
  const MultiHeadAttention<double> layer({8, 2}, 1);
  Tensor3<double> x(2, 3, 8), dY(2, 4, 8);
  x.setZero();
  dY.setZero();
  attn_test::expect_shape_error(
      [&] { (void)layer.backward(x, x, x, dY); },
      {"MultiHeadAttention::backward", "d_output", "(2, 4, 8)", "(2, 3, 8)"});
}

TEST(MultiHeadBackwardErrors, LayerBackwardChecksTheInputs) {
  const MultiHeadAttention<double> layer({8, 2}, 1);
  Tensor3<double> x(2, 3, 8), k(2, 3, 6), dY(2, 3, 8);
  x.setZero();
  k.setZero();
  dY.setZero();
  attn_test::expect_shape_error([&] { (void)layer.backward(x, k, x, dY); },
                                {"MultiHeadAttention::backward", "key", "kdim", "(2, 3, 6)"});
}

/// MultiHeadOptions would lose its key padding and per-head values in attention_heads_backward:
/// refused at compile time.
template <class Options, class = void>
struct heads_backward_takes : std::false_type {};
template <class Options>
struct heads_backward_takes<
    Options, std::void_t<decltype(attn::attention_heads_backward(
                 std::declval<const Tensor3<float>&>(), std::declval<const Tensor3<float>&>(),
                 std::declval<const Tensor3<float>&>(), std::declval<const Tensor3<float>&>(),
                 std::declval<const Options&>()))>> : std::true_type {};
static_assert(heads_backward_takes<attn::AttentionOptions<float>>::value);
static_assert(!heads_backward_takes<MultiHeadOptions<float>>::value);

}  // namespace
}  // namespace multi_head_backward_test
