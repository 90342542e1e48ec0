/// multi_head.hpp: `attention_heads` (MHA, GQA, MQA) and the `MultiHeadAttention` layer.
/// - the PyTorch 1.13 float64 reference cases tests/data/mha_*.json and gqa_causal.json, with the
///   weights loaded by `load_pytorch` (PyTorch's own tensors) and set directly (W_Q = X-side
///   layout);
/// - the second teaching document's layer (E = 512, 8 heads): shapes and parameter count;
/// - properties: per-head weights average to the averaged weights, one identity head equals
///   `scaled_dot_product_attention`, GQA equals MHA with repeated key/value heads, a fully padded
///   batch item gives zeros (never NaN), the single-sequence overload equals the batch one,
///   PyTorch's add_bias_kv / add_zero_attn against an independent naive long double computation,
///   deterministic Xavier initialisation;
/// - every shape error, with both shapes in the message.

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Causal;
using attn::Index;
using attn::Mask;
using attn::MultiHeadAttention;
using attn::MultiHeadConfig;
using attn::MultiHeadOptions;
using attn::MultiHeadResult;
using attn::Tensor3;
using attn::Tensor4;
using attn_test::LMatrix;

// ------------------------------------------------------------------------------------------------
// Rank-3 and rank-4 tensors: loading (nested JSON lists), slicing, random filling
// ------------------------------------------------------------------------------------------------

std::size_t to_size(Index i) { return static_cast<std::size_t>(i); }

/// The sizes of a nested list, outermost first; throws unless it is rectangular to `rank` levels.
std::vector<Index> nested_dims(const nlohmann::json& list, int rank, const std::string& where) {
  std::vector<Index> dims;
  const nlohmann::json* level = &list;
  for (int r = 0; r < rank; ++r) {
    if (!level->is_array() || level->empty()) {
      throw std::runtime_error(where + " is not a non-empty rank-" + std::to_string(rank) +
                               " nested list");
    }
    dims.push_back(static_cast<Index>(level->size()));
    level = &level->at(0);
  }
  return dims;
}

/// Row `i` of a nested list, checked to have `size` entries.
const nlohmann::json& sublist(const nlohmann::json& list, Index i, Index size,
                              const std::string& where) {
  const nlohmann::json& row = list.at(to_size(i));
  if (!row.is_array() || static_cast<Index>(row.size()) != size) {
    throw std::runtime_error(where + " is not rectangular");
  }
  return row;
}

/// inputs.<key> or expected.<key> of a case as a (d0, d1, d2) tensor.
template <class T>
Tensor3<T> tensor3(const nlohmann::json& list, const std::string& where) {
  const std::vector<Index> d = nested_dims(list, 3, where);
  Tensor3<T> t(d[0], d[1], d[2]);
  for (Index a = 0; a < d[0]; ++a) {
    const nlohmann::json& la = sublist(list, a, d[1], where);
    for (Index b = 0; b < d[1]; ++b) {
      const nlohmann::json& lb = sublist(la, b, d[2], where);
      for (Index c = 0; c < d[2]; ++c) t(a, b, c) = static_cast<T>(lb.at(to_size(c)).get<double>());
    }
  }
  return t;
}

/// A (d0, d1, d2, d3) tensor from a nested list.
template <class T>
Tensor4<T> tensor4(const nlohmann::json& list, const std::string& where) {
  const std::vector<Index> d = nested_dims(list, 4, where);
  Tensor4<T> t(d[0], d[1], d[2], d[3]);
  for (Index a = 0; a < d[0]; ++a) {
    const nlohmann::json& la = sublist(list, a, d[1], where);
    for (Index b = 0; b < d[1]; ++b) {
      const nlohmann::json& lb = sublist(la, b, d[2], where);
      for (Index c = 0; c < d[2]; ++c) {
        const nlohmann::json& lc = sublist(lb, c, d[3], where);
        for (Index e = 0; e < d[3]; ++e) {
          t(a, b, c, e) = static_cast<T>(lc.at(to_size(e)).get<double>());
        }
      }
    }
  }
  return t;
}

/// A flat JSON list as a row vector.
template <class T>
attn::RowVector<T> row_vector(const nlohmann::json& list) {
  attn::RowVector<T> v(static_cast<Index>(list.size()));
  for (Index k = 0; k < v.size(); ++k) v(k) = static_cast<T>(list.at(to_size(k)).get<double>());
  return v;
}

template <class T>
Tensor3<T> input3(const attn_test::Case& c, const std::string& key) {
  return tensor3<T>(c.json().at("inputs").at(key), c.name() + ": inputs." + key);
}
template <class T>
Tensor3<T> expected3(const attn_test::Case& c, const std::string& key) {
  return tensor3<T>(c.json().at("expected").at(key), c.name() + ": expected." + key);
}
template <class T>
attn::RowVector<T> input_vector(const attn_test::Case& c, const std::string& key) {
  return row_vector<T>(c.json().at("inputs").at(key));
}

/// Slice `i` of a (a, b, c) tensor as a b x c matrix (a copy).
template <class T>
attn::Matrix<T> item(const Tensor3<T>& t, Index i) {
  const Index rows = t.dimension(1);
  const Index cols = t.dimension(2);
  return Eigen::Map<const attn::Matrix<T>>(t.data() + i * rows * cols, rows, cols);
}

/// Slice (b, h) of a (batch, heads, n, m) tensor as an n x m matrix (a copy).
template <class T>
attn::Matrix<T> head_item(const Tensor4<T>& t, Index b, Index h) {
  const Index rows = t.dimension(2);
  const Index cols = t.dimension(3);
  return Eigen::Map<const attn::Matrix<T>>(t.data() + (b * t.dimension(1) + h) * rows * cols, rows,
                                           cols);
}

/// A (batch, rows, cols) tensor of N(0, 1) entries.
template <class T>
Tensor3<T> random_tensor(Index batch, Index rows, Index cols, std::mt19937& rng) {
  Tensor3<T> t(batch, rows, cols);
  Eigen::Map<attn::Matrix<T>>(t.data(), batch * rows, cols) =
      attn_test::random_matrix<T>(batch * rows, cols, rng);
  return t;
}

/// Stacks n x d matrices into a (count, n, d) tensor.
template <class T>
Tensor3<T> stack(const std::vector<attn::Matrix<T>>& items) {
  Tensor3<T> t(static_cast<Index>(items.size()), items.front().rows(), items.front().cols());
  for (Index i = 0; i < t.dimension(0); ++i) {
    Eigen::Map<attn::Matrix<T>>(t.data() + i * t.dimension(1) * t.dimension(2), t.dimension(1),
                                t.dimension(2)) = items[to_size(i)];
  }
  return t;
}

/// Every slice of `actual` agrees with `expected` within the tolerances of `T`.
template <class T, class TE>
void expect_near3(const Tensor3<T>& actual, const Tensor3<TE>& expected, const char* what) {
  ASSERT_EQ(actual.dimension(0), expected.dimension(0)) << what;
  for (Index b = 0; b < expected.dimension(0); ++b) {
    SCOPED_TRACE(std::string(what) + ", slice " + std::to_string(b));
    EXPECT_TRUE(attn_test::near_t<T>(item(actual, b), item(expected, b)));
  }
}

template <class T, class TE>
void expect_near4(const Tensor4<T>& actual, const Tensor4<TE>& expected, const char* what) {
  ASSERT_EQ(actual.dimension(0), expected.dimension(0)) << what;
  ASSERT_EQ(actual.dimension(1), expected.dimension(1)) << what;
  for (Index b = 0; b < expected.dimension(0); ++b) {
    for (Index h = 0; h < expected.dimension(1); ++h) {
      SCOPED_TRACE(std::string(what) + ", batch item " + std::to_string(b) + ", head " +
                   std::to_string(h));
      EXPECT_TRUE(attn_test::near_t<T>(head_item(actual, b, h), head_item(expected, b, h)));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The PyTorch reference cases
// ------------------------------------------------------------------------------------------------

/// params.causal of a multi-head case.
Causal causal_of(const attn_test::Case& c) {
  const std::string causal = c.params().at("causal").get<std::string>();
  if (causal == "none") return Causal::None;
  if (causal == "top_left") return Causal::TopLeft;
  if (causal == "bottom_right") return Causal::BottomRight;
  throw std::runtime_error(c.name() + ": unknown params.causal \"" + causal + "\"");
}

MultiHeadConfig config_of(const attn_test::Case& c) {
  MultiHeadConfig config{c.params().at("embed_dim").get<Index>(),
                         c.params().at("num_heads").get<Index>()};
  config.kdim = c.params().at("kdim").get<Index>();
  config.vdim = c.params().at("vdim").get<Index>();
  config.bias = c.params().at("bias").get<bool>();
  return config;
}

/// [b_Q, b_K, b_V]: PyTorch's in_proj_bias.
template <class T>
attn::RowVector<T> in_proj_bias_of(const attn_test::Case& c) {
  if (!c.has_input("b_Q")) return {};
  const attn::RowVector<T> q = input_vector<T>(c, "b_Q");
  const attn::RowVector<T> k = input_vector<T>(c, "b_K");
  const attn::RowVector<T> v = input_vector<T>(c, "b_V");
  attn::RowVector<T> all(q.size() + k.size() + v.size());
  all << q, k, v;
  return all;
}

template <class T>
attn::RowVector<T> out_proj_bias_of(const attn_test::Case& c) {
  return c.has_input("b_O") ? input_vector<T>(c, "b_O") : attn::RowVector<T>();
}

enum class Loader { PyTorch, Direct };

/// The case's layer: weights loaded from PyTorch's tensors, or set directly from W_Q ... b_O.
template <class T>
MultiHeadAttention<T> layer_of(const attn_test::Case& c, Loader loader) {
  MultiHeadAttention<T> layer(config_of(c), 99);
  if (loader == Loader::Direct) {
    layer.W_Q = c.input<T>("W_Q");
    layer.W_K = c.input<T>("W_K");
    layer.W_V = c.input<T>("W_V");
    layer.W_O = c.input<T>("W_O");
    if (layer.config().bias) {
      layer.b_Q = input_vector<T>(c, "b_Q");
      layer.b_K = input_vector<T>(c, "b_K");
      layer.b_V = input_vector<T>(c, "b_V");
      layer.b_O = input_vector<T>(c, "b_O");
    }
    return layer;
  }
  if (c.has_input("torch_in_proj_weight")) {
    layer.load_pytorch(c.input<T>("torch_in_proj_weight"), in_proj_bias_of<T>(c),
                       c.input<T>("torch_out_proj_weight"), out_proj_bias_of<T>(c));
  } else {
    // kdim/vdim != embed_dim: PyTorch keeps separate q/k/v_proj_weight, each W^T.
    const attn::Matrix<T> q_proj = c.input<T>("W_Q").transpose();
    const attn::Matrix<T> k_proj = c.input<T>("W_K").transpose();
    const attn::Matrix<T> v_proj = c.input<T>("W_V").transpose();
    layer.load_pytorch(q_proj, k_proj, v_proj, in_proj_bias_of<T>(c),
                       c.input<T>("torch_out_proj_weight"), out_proj_bias_of<T>(c));
  }
  // The loader must give exactly the X-side weights of the case (a transpose is exact).
  EXPECT_TRUE(attn_test::identical(layer.W_Q, c.input<T>("W_Q")));
  EXPECT_TRUE(attn_test::identical(layer.W_K, c.input<T>("W_K")));
  EXPECT_TRUE(attn_test::identical(layer.W_V, c.input<T>("W_V")));
  EXPECT_TRUE(attn_test::identical(layer.W_O, c.input<T>("W_O")));
  if (layer.config().bias) {
    EXPECT_TRUE(attn_test::identical(layer.b_Q, input_vector<T>(c, "b_Q")));
    EXPECT_TRUE(attn_test::identical(layer.b_K, input_vector<T>(c, "b_K")));
    EXPECT_TRUE(attn_test::identical(layer.b_V, input_vector<T>(c, "b_V")));
    EXPECT_TRUE(attn_test::identical(layer.b_O, input_vector<T>(c, "b_O")));
  } else {
    EXPECT_EQ(layer.b_Q.size() + layer.b_K.size() + layer.b_V.size() + layer.b_O.size(), 0);
  }
  return layer;
}

/// Runs one mha_* case: output, head-averaged weights and per-head weights against PyTorch.
template <class T>
void check_mha_case(const std::string& name, Loader loader) {
  const attn_test::Case c = attn_test::load_case(name);
  const MultiHeadAttention<T> layer = layer_of<T>(c, loader);
  EXPECT_EQ(layer.parameter_count(), c.params().at("parameter_count").get<Index>());

  const Tensor3<T> query = input3<T>(c, "query");
  const Tensor3<T> key = input3<T>(c, "key");
  const Tensor3<T> value = input3<T>(c, "value");
  MultiHeadOptions<T> options;
  options.causal = causal_of(c);
  if (c.has_input("key_valid")) options.key_valid = c.mask("key_valid");

  const Tensor3<double> expected_output = expected3<double>(c, "output");
  const Tensor3<double> expected_weights = expected3<double>(c, "weights_avg");
  const Tensor4<double> expected_head_weights = tensor4<double>(
      c.json().at("expected").at("weights_per_head"), name + ": expected.weights_per_head");

  // No weights asked: only the output.
  const MultiHeadResult<T> plain = layer.forward(query, key, value, options);
  expect_near3(plain.output, expected_output, "output");
  EXPECT_EQ(plain.weights.size(), 0);
  EXPECT_EQ(plain.head_weights.size(), 0);

  options.need_weights = true;
  const MultiHeadResult<T> averaged = layer.forward(query, key, value, options);
  expect_near3(averaged.output, expected_output, "output (need_weights)");
  expect_near3(averaged.weights, expected_weights, "head-averaged weights");
  EXPECT_EQ(averaged.head_weights.size(), 0);

  options.average_weights = false;
  const MultiHeadResult<T> per_head = layer.forward(query, key, value, options);
  expect_near3(per_head.output, expected_output, "output (per-head weights)");
  expect_near4(per_head.head_weights, expected_head_weights, "per-head weights");
  EXPECT_EQ(per_head.weights.size(), 0);
}

template <class T>
class MultiHeadReference : public ::testing::Test {};
TYPED_TEST_SUITE(MultiHeadReference, attn_test::ScalarTypes);

TYPED_TEST(MultiHeadReference, SelfAttentionBatchWithBiasesLoadedFromPyTorch) {
  check_mha_case<TypeParam>("mha_self", Loader::PyTorch);
}
TYPED_TEST(MultiHeadReference, SelfAttentionBatchWithBiasesSetDirectly) {
  check_mha_case<TypeParam>("mha_self", Loader::Direct);
}
TYPED_TEST(MultiHeadReference, NoBiasesLoadedFromPyTorch) {
  check_mha_case<TypeParam>("mha_nobias", Loader::PyTorch);
}
TYPED_TEST(MultiHeadReference, NoBiasesSetDirectly) {
  check_mha_case<TypeParam>("mha_nobias", Loader::Direct);
}
TYPED_TEST(MultiHeadReference, CausalWithKeyPaddingLoadedFromPyTorch) {
  check_mha_case<TypeParam>("mha_causal_padding", Loader::PyTorch);
}
TYPED_TEST(MultiHeadReference, CausalWithKeyPaddingSetDirectly) {
  check_mha_case<TypeParam>("mha_causal_padding", Loader::Direct);
}
TYPED_TEST(MultiHeadReference, CrossAttentionKdimVdimLoadedFromSeparateProjections) {
  check_mha_case<TypeParam>("mha_cross_kdim_vdim", Loader::PyTorch);
}
TYPED_TEST(MultiHeadReference, CrossAttentionKdimVdimSetDirectly) {
  check_mha_case<TypeParam>("mha_cross_kdim_vdim", Loader::Direct);
}

/// key_valid means "true = a real key" (PyTorch's key_padding_mask is the opposite): the padded
/// keys of item 1 get exactly zero weight in every head, and the inverted table (PyTorch's meaning
/// read as ours) does not reproduce the reference.
TYPED_TEST(MultiHeadReference, KeyValidTrueMeansARealKey) {
  using T = TypeParam;
  const attn_test::Case c = attn_test::load_case("mha_causal_padding");
  const MultiHeadAttention<T> layer = layer_of<T>(c, Loader::Direct);
  const Tensor3<T> x = input3<T>(c, "query");
  const Mask key_valid = c.mask("key_valid");
  ASSERT_FALSE(key_valid.row(1).all()) << "the case pads item 1";
  ASSERT_TRUE(key_valid.row(0).all());

  MultiHeadOptions<T> options;
  options.causal = causal_of(c);
  options.key_valid = key_valid;
  options.need_weights = true;
  options.average_weights = false;
  const MultiHeadResult<T> result = layer.forward(x, x, x, options);
  for (Index h = 0; h < layer.config().num_heads; ++h) {
    const attn::Matrix<T> w = head_item(result.head_weights, 1, h);
    for (Index j = 0; j < key_valid.cols(); ++j) {
      if (!key_valid(1, j)) {
        EXPECT_TRUE((w.col(j).array() == T(0)).all()) << "head " << h << ", padded key " << j;
      }
    }
  }

  options.key_valid = Mask(!key_valid);  // PyTorch's key_padding_mask meaning, misread as ours
  options.need_weights = false;
  const MultiHeadResult<T> inverted = layer.forward(x, x, x, options);
  const Tensor3<double> expected = expected3<double>(c, "output");
  EXPECT_FALSE(attn_test::near_t<T>(item(inverted.output, 0), item(expected, 0)));
}

// ------------------------------------------------------------------------------------------------
// attention_heads: GQA reference and properties
// ------------------------------------------------------------------------------------------------

template <class T>
class GqaReference : public ::testing::Test {};
TYPED_TEST_SUITE(GqaReference, attn_test::ScalarTypes);

TYPED_TEST(GqaReference, CausalEightQueryHeadsOverTwoKeyValueHeads) {
  using T = TypeParam;
  const attn_test::Case c = attn_test::load_case("gqa_causal");
  const Tensor3<T> Q = input3<T>(c, "Q");
  const Tensor3<T> K = input3<T>(c, "K");
  const Tensor3<T> V = input3<T>(c, "V");
  ASSERT_EQ(Q.dimension(0), c.params().at("q_heads").get<Index>());
  ASSERT_EQ(K.dimension(0), c.params().at("kv_heads").get<Index>());
  attn::AttentionOptions<T> options;
  options.causal = causal_of(c);
  const Tensor3<T> out = attn::attention_heads(Q, K, V, options);
  expect_near3(out, expected3<double>(c, "output"), "output");
}

template <class T>
class AttentionHeads : public ::testing::Test {};
TYPED_TEST_SUITE(AttentionHeads, attn_test::ScalarTypes);

/// Repeats each key/value head `group` times: (h_kv, m, d) -> (h_kv * group, m, d), head h of the
/// result being head h / group of the input.
template <class T>
Tensor3<T> repeat_heads(const Tensor3<T>& t, Index group) {
  std::vector<attn::Matrix<T>> heads;
  for (Index h = 0; h < t.dimension(0) * group; ++h) heads.push_back(item(t, h / group));
  return stack(heads);
}

TYPED_TEST(AttentionHeads, GroupedQueryEqualsMultiHeadWithRepeatedKeyValueHeads) {
  using T = TypeParam;
  std::mt19937 rng(11);
  const Tensor3<T> Q = random_tensor<T>(6, 5, 4, rng);
  const Tensor3<T> K = random_tensor<T>(2, 7, 4, rng);
  const Tensor3<T> V = random_tensor<T>(2, 7, 3, rng);
  attn::AttentionOptions<T> options;
  options.causal = Causal::BottomRight;
  const Tensor3<T> gqa = attn::attention_heads(Q, K, V, options);
  ASSERT_EQ(gqa.dimension(0), 6);
  ASSERT_EQ(gqa.dimension(1), 5);
  ASSERT_EQ(gqa.dimension(2), 3);
  const Tensor3<T> mha = attn::attention_heads(Q, repeat_heads(K, 3), repeat_heads(V, 3), options);
  for (Index h = 0; h < 6; ++h) {
    SCOPED_TRACE("head " + std::to_string(h));
    EXPECT_TRUE(attn_test::identical(item(gqa, h), item(mha, h)));
    const attn_test::NaiveAttention naive =
        attn_test::naive_attention<T>(item(Q, h), item(K, h / 3), item(V, h / 3), options);
    EXPECT_TRUE(attn_test::near_t<T>(item(gqa, h), naive.output));
  }
}

TYPED_TEST(AttentionHeads, MultiQueryUsesTheOneKeyValueHeadForEveryQueryHead) {
  using T = TypeParam;
  std::mt19937 rng(12);
  const Tensor3<T> Q = random_tensor<T>(4, 3, 8, rng);
  const Tensor3<T> K = random_tensor<T>(1, 6, 8, rng);
  const Tensor3<T> V = random_tensor<T>(1, 6, 8, rng);
  const Tensor3<T> out = attn::attention_heads(Q, K, V);
  for (Index h = 0; h < 4; ++h) {
    SCOPED_TRACE("head " + std::to_string(h));
    EXPECT_TRUE(attn_test::near_t<T>(
        item(out, h), attn::scaled_dot_product_attention(item(Q, h), item(K, 0), item(V, 0))));
  }
}

// ------------------------------------------------------------------------------------------------
// The layer: the document's shapes and properties
// ------------------------------------------------------------------------------------------------

template <class T>
class MultiHeadLayer : public ::testing::Test {};
TYPED_TEST_SUITE(MultiHeadLayer, attn_test::ScalarTypes);

/// Gives every weight and bias of `layer` random values (the constructor's biases are zero).
template <class T>
void randomise(MultiHeadAttention<T>& layer, std::mt19937& rng) {
  const auto fill = [&rng](auto& m) {
    if (m.size() > 0) m = attn_test::random_matrix<T>(m.rows(), m.cols(), rng, 0.5);
  };
  fill(layer.W_Q);
  fill(layer.W_K);
  fill(layer.W_V);
  fill(layer.W_O);
  fill(layer.b_Q);
  fill(layer.b_K);
  fill(layer.b_V);
  fill(layer.b_O);
  fill(layer.bias_k);
  fill(layer.bias_v);
}

/// nn.MultiheadAttention(embed_dim=512, num_heads=8) on x of shape (2, 10, 512): output
/// (2, 10, 512), head-averaged weights (2, 10, 10) whose rows sum to 1, 1,050,624 parameters
/// (4 x 262,144 + 4 x 512), d_k = 512 / 8 = 64.
TYPED_TEST(MultiHeadLayer, DocumentShapesAndParameterCount) {
  using T = TypeParam;
  const MultiHeadAttention<T> mha(MultiHeadConfig{512, 8}, 2024);
  EXPECT_EQ(mha.head_dim(), 64);
  EXPECT_EQ(mha.parameter_count(), 1050624);
  EXPECT_EQ(mha.parameter_count(), 4 * 262144 + 4 * 512);

  std::mt19937 rng(1);
  const Tensor3<T> x = random_tensor<T>(2, 10, 512, rng);
  MultiHeadOptions<T> options;
  options.need_weights = true;
  const MultiHeadResult<T> result = mha.forward(x, x, x, options);
  EXPECT_EQ(result.output.dimension(0), 2);
  EXPECT_EQ(result.output.dimension(1), 10);
  EXPECT_EQ(result.output.dimension(2), 512);
  EXPECT_EQ(result.weights.dimension(0), 2);
  EXPECT_EQ(result.weights.dimension(1), 10);
  EXPECT_EQ(result.weights.dimension(2), 10);
  for (Index b = 0; b < 2; ++b) {
    SCOPED_TRACE("batch item " + std::to_string(b));
    EXPECT_TRUE(attn_test::all_finite(item(result.output, b)));
    const attn::Matrix<T> w = item(result.weights, b);
    EXPECT_TRUE((w.array() >= T(0)).all());
    EXPECT_TRUE(attn_test::near_t<T>(w.rowwise().sum(), attn::Vector<T>::Ones(10)));
  }
}

TYPED_TEST(MultiHeadLayer, PerHeadWeightsAverageToTheAveragedWeights) {
  using T = TypeParam;
  const MultiHeadAttention<T> mha(MultiHeadConfig{512, 8}, 2024);
  std::mt19937 rng(2);
  const Tensor3<T> x = random_tensor<T>(2, 10, 512, rng);
  MultiHeadOptions<T> options;
  options.causal = Causal::BottomRight;
  options.need_weights = true;
  const MultiHeadResult<T> averaged = mha.forward(x, x, x, options);
  options.average_weights = false;
  const MultiHeadResult<T> per_head = mha.forward(x, x, x, options);
  ASSERT_EQ(per_head.head_weights.dimension(0), 2);
  ASSERT_EQ(per_head.head_weights.dimension(1), 8);
  ASSERT_EQ(per_head.head_weights.dimension(2), 10);
  ASSERT_EQ(per_head.head_weights.dimension(3), 10);
  for (Index b = 0; b < 2; ++b) {
    attn::Matrix<T> sum = attn::Matrix<T>::Zero(10, 10);
    for (Index h = 0; h < 8; ++h) {
      const attn::Matrix<T> w = head_item(per_head.head_weights, b, h);
      EXPECT_TRUE(attn_test::near_t<T>(w.rowwise().sum(), attn::Vector<T>::Ones(10)))
          << "batch item " << b << ", head " << h;
      sum += w;
    }
    EXPECT_TRUE(attn_test::near_t<T>(item(averaged.weights, b), sum / T(8))) << "batch item " << b;
    EXPECT_TRUE(attn_test::identical(item(averaged.output, b), item(per_head.output, b)));
  }
}

/// One head, identity projections, zero biases: the layer is scaled dot-product attention.
TYPED_TEST(MultiHeadLayer, OneIdentityHeadEqualsScaledDotProductAttention) {
  using T = TypeParam;
  constexpr Index d = 8;
  MultiHeadAttention<T> layer(MultiHeadConfig{d, 1}, 5);
  ASSERT_TRUE((layer.b_Q.array() == T(0)).all() && (layer.b_K.array() == T(0)).all() &&
              (layer.b_V.array() == T(0)).all() && (layer.b_O.array() == T(0)).all())
      << "the constructor's biases are zero";
  layer.W_Q = layer.W_K = layer.W_V = layer.W_O = attn::Matrix<T>::Identity(d, d);

  std::mt19937 rng(3);
  const Tensor3<T> query = random_tensor<T>(2, 4, d, rng);
  const Tensor3<T> key = random_tensor<T>(2, 6, d, rng);
  const Tensor3<T> value = random_tensor<T>(2, 6, d, rng);
  for (const Causal causal : {Causal::None, Causal::BottomRight, Causal::TopLeft}) {
    MultiHeadOptions<T> options;
    options.causal = causal;
    attn::AttentionOptions<T> single;
    single.causal = causal;
    const MultiHeadResult<T> result = layer.forward(query, key, value, options);
    for (Index b = 0; b < 2; ++b) {
      SCOPED_TRACE("causal " + std::to_string(static_cast<int>(causal)) + ", batch item " +
                   std::to_string(b));
      EXPECT_TRUE(attn_test::near_t<T>(
          item(result.output, b), attn::scaled_dot_product_attention(item(query, b), item(key, b),
                                                                     item(value, b), single)));
    }
  }
}

/// A GQA layer (num_kv_heads < num_heads) equals the MHA layer whose key/value projections repeat
/// each key/value head's columns for the query heads that share it.
TYPED_TEST(MultiHeadLayer, GroupedQueryLayerEqualsMultiHeadWithRepeatedKeyValueHeads) {
  using T = TypeParam;
  constexpr Index E = 16;
  constexpr Index heads = 4;
  constexpr Index kv_heads = 2;
  MultiHeadConfig gqa_config{E, heads};
  gqa_config.num_kv_heads = kv_heads;
  MultiHeadAttention<T> gqa(gqa_config, 6);
  std::mt19937 rng(4);
  randomise(gqa, rng);
  const Index hd = gqa.head_dim();
  ASSERT_EQ(gqa.W_K.cols(), kv_heads * hd);
  ASSERT_EQ(gqa.W_V.cols(), kv_heads * hd);
  ASSERT_EQ(gqa.b_K.size(), kv_heads * hd);
  EXPECT_EQ(gqa.parameter_count(), 2 * (E * E + E) + 2 * (E * kv_heads * hd + kv_heads * hd));

  MultiHeadAttention<T> mha(MultiHeadConfig{E, heads}, 7);
  mha.W_Q = gqa.W_Q;
  mha.b_Q = gqa.b_Q;
  mha.W_O = gqa.W_O;
  mha.b_O = gqa.b_O;
  const Index group = heads / kv_heads;
  for (Index h = 0; h < heads; ++h) {
    const Index kv = h / group;
    mha.W_K.middleCols(h * hd, hd) = gqa.W_K.middleCols(kv * hd, hd);
    mha.W_V.middleCols(h * hd, hd) = gqa.W_V.middleCols(kv * hd, hd);
    mha.b_K.segment(h * hd, hd) = gqa.b_K.segment(kv * hd, hd);
    mha.b_V.segment(h * hd, hd) = gqa.b_V.segment(kv * hd, hd);
  }

  const Tensor3<T> query = random_tensor<T>(2, 5, E, rng);
  const Tensor3<T> key = random_tensor<T>(2, 7, E, rng);
  const Tensor3<T> value = random_tensor<T>(2, 7, E, rng);
  MultiHeadOptions<T> options;
  options.causal = Causal::BottomRight;
  options.need_weights = true;
  options.average_weights = false;
  const MultiHeadResult<T> expected = mha.forward(query, key, value, options);
  const MultiHeadResult<T> actual = gqa.forward(query, key, value, options);
  expect_near3(actual.output, expected.output, "output");
  expect_near4(actual.head_weights, expected.head_weights, "per-head weights");
}

/// A tensor's entries as a matrix of its last dimension's width (0 x 0 when empty): for comparing
/// results bit for bit.
template <class T, class Tensor>
attn::Matrix<T> as_rows(const Tensor& t) {
  const Index width = t.size() == 0 ? 0 : t.dimension(t.NumDimensions - 1);
  return attn::Matrix<T>(
      Eigen::Map<const attn::Matrix<T>>(t.data(), width == 0 ? 0 : t.size() / width, width));
}

/// A layer of E = 16 and 4 heads with random weights; with `extra_rows`, PyTorch's add_bias_kv and
/// add_zero_attn on.
template <class T>
MultiHeadAttention<T> random_layer(bool extra_rows, Index kv_heads, unsigned seed,
                                   std::mt19937& rng) {
  MultiHeadConfig config{16, 4};
  config.add_bias_kv = extra_rows;
  config.add_zero_attn = extra_rows;
  config.num_kv_heads = kv_heads;
  MultiHeadAttention<T> layer(config, seed);
  randomise(layer, rng);
  return layer;
}

/// The hot-path overload with a reused workspace and result gives the same bits as the allocating
/// one, call after call, across shapes, options and PyTorch's extra key rows; a repeated shape
/// reuses the storage.
TYPED_TEST(MultiHeadLayer, WorkspaceOverloadEqualsAllocatingOverload) {
  using T = TypeParam;
  std::mt19937 rng(12);
  const MultiHeadAttention<T> plain = random_layer<T>(false, 0, 21, rng);
  const MultiHeadAttention<T> extra = random_layer<T>(true, 0, 22, rng);
  attn::MultiHeadWorkspace<T> workspace;
  MultiHeadResult<T> result;
  for (int call = 0; call < 6; ++call) {
    SCOPED_TRACE(::testing::Message() << "call " << call);
    const MultiHeadAttention<T>& layer = call % 3 == 2 ? extra : plain;
    const Index batch = call < 3 ? 2 : 3;
    const Index n = call < 3 ? 5 : 7;
    const Tensor3<T> x = random_tensor<T>(batch, n, 16, rng);
    MultiHeadOptions<T> options;
    options.need_weights = call % 3 != 0;
    options.average_weights = call % 3 == 1;
    if (call % 3 == 2) {
      options.causal = attn::Causal::TopLeft;
      Mask key_valid = Mask::Constant(batch, n, true);
      key_valid(0, n - 1) = false;
      options.key_valid = key_valid;
    }
    layer.forward(x, x, x, options, workspace, result);
    const MultiHeadResult<T> expected = layer.forward(x, x, x, options);
    EXPECT_TRUE(attn_test::identical(as_rows<T>(result.output), as_rows<T>(expected.output)));
    EXPECT_TRUE(attn_test::identical(as_rows<T>(result.weights), as_rows<T>(expected.weights)));
    EXPECT_TRUE(
        attn_test::identical(as_rows<T>(result.head_weights), as_rows<T>(expected.head_weights)));
    EXPECT_EQ(result.weights.size(), expected.weights.size());
    EXPECT_EQ(result.head_weights.size(), expected.head_weights.size());

    // The same call again: the same bits, in the same storage.
    const T* output = result.output.data();
    const T* projected = workspace.Q.data();
    layer.forward(x, x, x, options, workspace, result);
    EXPECT_EQ(result.output.data(), output);
    EXPECT_EQ(workspace.Q.data(), projected);
    EXPECT_TRUE(attn_test::identical(as_rows<T>(result.output), as_rows<T>(expected.output)));
  }
}

/// The returning overloads work in this thread's kept workspace (`detail::thread_workspace`): call
/// after call, across shapes, options and PyTorch's extra key rows, each gives the bits of the hot
/// path run in a fresh workspace (so nothing left from an earlier call leaks in), and a repeated
/// shape reuses the kept storage (so the returning call allocates only its result). The
/// returning backward likewise equals the hot-path backward in a fresh workspace.
TYPED_TEST(MultiHeadLayer, ReturningOverloadsReuseThisThreadsWorkspace) {
  using T = TypeParam;
  std::mt19937 rng(13);
  const MultiHeadAttention<T> plain = random_layer<T>(false, 0, 31, rng);
  const MultiHeadAttention<T> extra = random_layer<T>(true, 2, 32, rng);
  const attn::MultiHeadWorkspace<T>& kept = attn::detail::thread_workspace<T>();
  for (int call = 0; call < 6; ++call) {
    SCOPED_TRACE(::testing::Message() << "call " << call);
    const MultiHeadAttention<T>& layer = call % 2 == 1 ? extra : plain;
    const Index batch = call < 2 ? 3 : call < 4 ? 1 : 2;
    const Index n = call < 2 ? 9 : call < 4 ? 4 : 6;
    const Tensor3<T> x = random_tensor<T>(batch, n, 16, rng);
    MultiHeadOptions<T> options;
    options.need_weights = call % 3 != 0;
    options.average_weights = call % 3 == 1;
    if (call % 2 == 0) options.causal = attn::Causal::TopLeft;

    const MultiHeadResult<T> returned = layer.forward(x, x, x, options);
    attn::MultiHeadWorkspace<T> fresh;
    MultiHeadResult<T> expected;
    layer.forward(x, x, x, options, fresh, expected);
    EXPECT_TRUE(attn_test::identical(as_rows<T>(returned.output), as_rows<T>(expected.output)));
    EXPECT_TRUE(attn_test::identical(as_rows<T>(returned.weights), as_rows<T>(expected.weights)));
    EXPECT_TRUE(
        attn_test::identical(as_rows<T>(returned.head_weights), as_rows<T>(expected.head_weights)));
    EXPECT_EQ(returned.weights.size(), expected.weights.size());
    EXPECT_EQ(returned.head_weights.size(), expected.head_weights.size());

    // The same call again: the kept workspace is neither empty nor reallocated.
    const T* projected = kept.Q.data();
    ASSERT_NE(projected, nullptr);
    EXPECT_EQ(kept.Q.rows(), batch * n);
    const MultiHeadResult<T> again = layer.forward(x, x, x, options);
    EXPECT_EQ(kept.Q.data(), projected);
    EXPECT_TRUE(attn_test::identical(as_rows<T>(again.output), as_rows<T>(expected.output)));

    const Tensor3<T> d_output = random_tensor<T>(batch, n, 16, rng);
    const attn::MultiHeadGrads<T> grads = layer.backward(x, x, x, d_output, options);
    attn::MultiHeadWorkspace<T> fresh_backward;
    attn::MultiHeadGrads<T> expected_grads;
    layer.backward(x, x, x, d_output, options, fresh_backward, expected_grads);
    EXPECT_TRUE(
        attn_test::identical(as_rows<T>(grads.d_query), as_rows<T>(expected_grads.d_query)));
    EXPECT_TRUE(attn_test::identical(grads.dW_Q, expected_grads.dW_Q));
    EXPECT_TRUE(attn_test::identical(grads.dW_K, expected_grads.dW_K));
    EXPECT_TRUE(attn_test::identical(grads.dW_O, expected_grads.dW_O));
  }
}

#if defined(__linux__)
/// The VmFlags of the mapping that holds `address` in /proc/self/smaps ("" if none).
std::string mapping_flags(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = begin <= at && at < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

/// Whether the mapping that holds `address` is advised for 2 MiB pages (VmFlags "hg").
bool advised_for_large_pages(const void* address) {
  return (mapping_flags(address) + " ").find(" hg ") != std::string::npos;
}

/// The convenience overloads ask Linux for 2 MiB pages for their large buffers (the kept
/// workspace and the result they return: `MultiHeadWorkspace::large_pages`), the hot path with a
/// default workspace does not; the advice is a flag of the mapping, set whatever the system then
/// does with it. Each buffer is 4 MiB or more (1024 sequences of 16 tokens, E = 64), so the
/// address 2 MiB past its start lies inside a whole 2 MiB page of it, which is what is advised.
TEST(MultiHeadLargePages, ConvenienceOverloadsAskForThemTheHotPathDoesNot) {
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) {
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  }
  std::mt19937 rng(41);
  attn::MultiHeadConfig config;
  config.embed_dim = 64;
  config.num_heads = 4;
  const MultiHeadAttention<float> layer(config, 42);
  const Tensor3<float> x = random_tensor<float>(1024, 16, 64, rng);
  const std::size_t two_mib = std::size_t(2) << 20;
  const auto inside = [&](const float* data) {
    return reinterpret_cast<const char*>(data) + two_mib;
  };
  ASSERT_GE(static_cast<std::size_t>(x.size()) * sizeof(float), 2 * two_mib);

  const MultiHeadResult<float> returned = layer.forward(x, x, x);
  const attn::MultiHeadWorkspace<float>& kept = attn::detail::thread_workspace<float>();
  EXPECT_TRUE(kept.large_pages);
  EXPECT_TRUE(advised_for_large_pages(inside(returned.output.data())))
      << mapping_flags(inside(returned.output.data()));
  EXPECT_TRUE(advised_for_large_pages(inside(kept.Q.data())))
      << mapping_flags(inside(kept.Q.data()));
  EXPECT_TRUE(advised_for_large_pages(inside(kept.concat.data())));

  attn::MultiHeadWorkspace<float> workspace;
  MultiHeadResult<float> result;
  layer.forward(x, x, x, {}, workspace, result);
  EXPECT_FALSE(workspace.large_pages);
  EXPECT_FALSE(advised_for_large_pages(inside(result.output.data())))
      << mapping_flags(inside(result.output.data()));
  EXPECT_FALSE(advised_for_large_pages(inside(workspace.Q.data())));
  EXPECT_TRUE(attn_test::identical(as_rows<float>(result.output), as_rows<float>(returned.output)));

  // The backward's gradients with respect to the inputs, returned, are advised too.
  const attn::MultiHeadGrads<float> grads = layer.backward(x, x, x, x, {});
  EXPECT_TRUE(advised_for_large_pages(inside(grads.d_query.data())));
  EXPECT_TRUE(advised_for_large_pages(inside(kept.dQ.data())));
}
#endif

/// A batch item whose keys are all padding attends nothing: zero weights and a zero attention
/// output (so the layer's output is the output bias), never NaN (PyTorch 1.13 gives NaN here).
/// The other item is unaffected.
TYPED_TEST(MultiHeadLayer, FullyPaddedBatchItemGivesZerosNotNaN) {
  using T = TypeParam;
  std::mt19937 rng(5);
  const Tensor3<T> x = random_tensor<T>(2, 4, 8, rng);
  Mask key_valid = Mask::Constant(2, 4, true);
  key_valid.row(1).setConstant(false);

  for (const bool bias : {false, true}) {
    SCOPED_TRACE(bias ? "with biases" : "without biases");
    MultiHeadConfig config{8, 2};
    config.bias = bias;
    MultiHeadAttention<T> layer(config, 8);
    randomise(layer, rng);
    MultiHeadOptions<T> options;
    options.key_valid = key_valid;
    options.need_weights = true;
    const MultiHeadResult<T> averaged = layer.forward(x, x, x, options);
    options.average_weights = false;
    const MultiHeadResult<T> per_head = layer.forward(x, x, x, options);

    const attn::Matrix<T> padded_output = item(averaged.output, 1);
    EXPECT_TRUE(attn_test::all_finite(padded_output));
    const attn::Matrix<T> expected_output =
        bias ? attn::Matrix<T>(layer.b_O.replicate(4, 1)) : attn::Matrix<T>::Zero(4, 8);
    EXPECT_TRUE(attn_test::identical(padded_output, expected_output));
    EXPECT_TRUE(attn_test::identical(item(averaged.weights, 1), attn::Matrix<T>::Zero(4, 4)));
    for (Index h = 0; h < 2; ++h) {
      EXPECT_TRUE(
          attn_test::identical(head_item(per_head.head_weights, 1, h), attn::Matrix<T>::Zero(4, 4)))
          << "head " << h;
    }
    // Item 0 (all keys real) is what it is without any key_valid.
    const attn::Matrix<T> alone = layer.forward(item(x, 0));
    EXPECT_TRUE(attn_test::near_t<T>(item(averaged.output, 0), alone));
  }
}

/// `forward(Matrix)` (one sequence, self-attention) equals the batch forward, item by item.
TYPED_TEST(MultiHeadLayer, SingleSequenceForwardEqualsBatchForward) {
  using T = TypeParam;
  MultiHeadAttention<T> layer(MultiHeadConfig{12, 3}, 9);
  std::mt19937 rng(6);
  randomise(layer, rng);
  const Tensor3<T> x = random_tensor<T>(3, 5, 12, rng);
  MultiHeadOptions<T> options;
  options.causal = Causal::BottomRight;
  const MultiHeadResult<T> batch = layer.forward(x, x, x, options);
  for (Index b = 0; b < 3; ++b) {
    SCOPED_TRACE("batch item " + std::to_string(b));
    const attn::Matrix<T> single = layer.forward(item(x, b), options);
    EXPECT_TRUE(attn_test::near_t<T>(single, item(batch.output, b)));
    const Tensor3<T> one = stack<T>({item(x, b)});
    EXPECT_TRUE(
        attn_test::identical(single, item(layer.forward(one, one, one, options).output, 0)));
  }
}

/// The layer computed independently, by plain loops in long double, with PyTorch's semantics of
/// add_bias_kv and add_zero_attn: after the projections, each batch item's keys (values) get the
/// row bias_k (bias_v), then a zero row; the (n x m) masks are padded with `allowed` columns.
struct NaiveLayer {
  std::vector<LMatrix> output;   ///< per batch item, n x E
  std::vector<LMatrix> weights;  ///< per batch item, n x (m + extra), averaged over heads
};

template <class T>
NaiveLayer naive_layer(const MultiHeadAttention<T>& layer, const Tensor3<T>& query,
                       const Tensor3<T>& key, const Tensor3<T>& value, Causal causal,
                       const Mask& key_valid) {
  const MultiHeadConfig& config = layer.config();
  const Index n = query.dimension(1);
  const Index m = key.dimension(1);
  const Index heads = config.num_heads;
  const Index hd = config.embed_dim / heads;
  const Index group = heads / (config.num_kv_heads == 0 ? heads : config.num_kv_heads);
  const Index extra = (config.add_bias_kv ? 1 : 0) + (config.add_zero_attn ? 1 : 0);
  const auto plus_bias = [](LMatrix Y, const attn::RowVector<T>& b) {
    if (b.size() > 0) Y.rowwise() += attn_test::to_long_double(b).row(0);
    return Y;
  };
  NaiveLayer r;
  for (Index b = 0; b < query.dimension(0); ++b) {
    const LMatrix Q = plus_bias(attn_test::naive_product(item(query, b), layer.W_Q), layer.b_Q);
    const LMatrix K = plus_bias(attn_test::naive_product(item(key, b), layer.W_K), layer.b_K);
    const LMatrix V = plus_bias(attn_test::naive_product(item(value, b), layer.W_V), layer.b_V);
    LMatrix K_ext = LMatrix::Zero(m + extra, K.cols());
    LMatrix V_ext = LMatrix::Zero(m + extra, V.cols());
    K_ext.topRows(m) = K;
    V_ext.topRows(m) = V;
    if (config.add_bias_kv) {  // then the zero row of add_zero_attn, already there
      K_ext.row(m) = attn_test::to_long_double(layer.bias_k).row(0);
      V_ext.row(m) = attn_test::to_long_double(layer.bias_v).row(0);
    }
    attn::AttentionOptions<T> options;
    options.mask = Mask::Constant(n, m + extra, true);
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < m; ++j) {
        (*options.mask)(i, j) =
            attn_test::naive_allowed(i, j, n, m, causal, std::nullopt) && key_valid(b, j);
      }
    }
    LMatrix concat(n, heads * hd);
    LMatrix weights = LMatrix::Zero(n, m + extra);
    for (Index h = 0; h < heads; ++h) {
      const Index kv = h / group;
      const attn_test::NaiveAttention head =
          attn_test::naive_attention<T>(Q.middleCols(h * hd, hd), K_ext.middleCols(kv * hd, hd),
                                        V_ext.middleCols(kv * hd, hd), options);
      concat.middleCols(h * hd, hd) = head.output;
      weights += head.weights / static_cast<long double>(heads);
    }
    r.output.push_back(plus_bias(attn_test::naive_product(concat, layer.W_O), layer.b_O));
    r.weights.push_back(weights);
  }
  return r;
}

template <class T>
void check_extra_keys(bool add_bias_kv, bool add_zero_attn, Index num_kv_heads) {
  MultiHeadConfig config{8, 2};
  config.add_bias_kv = add_bias_kv;
  config.add_zero_attn = add_zero_attn;
  config.num_kv_heads = num_kv_heads;
  MultiHeadAttention<T> layer(config, 10);
  const Index kv_width = layer.W_K.cols();
  EXPECT_EQ(layer.bias_k.size(), add_bias_kv ? kv_width : 0);
  EXPECT_EQ(layer.bias_v.size(), add_bias_kv ? kv_width : 0);
  // PyTorch counts bias_k and bias_v among the parameters.
  EXPECT_EQ(layer.parameter_count(), layer.W_Q.size() + layer.W_K.size() + layer.W_V.size() +
                                         layer.W_O.size() + 8 + 2 * kv_width + 8 +
                                         (add_bias_kv ? 2 * kv_width : 0));
  std::mt19937 rng(7);
  randomise(layer, rng);

  const Index n = 3;
  const Index m = 4;
  const Tensor3<T> query = random_tensor<T>(2, n, 8, rng);
  const Tensor3<T> key = random_tensor<T>(2, m, 8, rng);
  const Tensor3<T> value = random_tensor<T>(2, m, 8, rng);
  Mask key_valid = Mask::Constant(2, m, true);
  key_valid(1, m - 1) = false;
  key_valid(1, 0) = false;

  for (const Causal causal : {Causal::None, Causal::BottomRight}) {
    SCOPED_TRACE(causal == Causal::None ? "no causal mask" : "causal, bottom right");
    MultiHeadOptions<T> options;
    options.causal = causal;
    options.key_valid = key_valid;
    options.need_weights = true;
    const MultiHeadResult<T> result = layer.forward(query, key, value, options);
    const NaiveLayer expected = naive_layer(layer, query, key, value, causal, key_valid);
    const Index extra = (add_bias_kv ? 1 : 0) + (add_zero_attn ? 1 : 0);
    ASSERT_EQ(result.weights.dimension(2), m + extra);
    for (Index b = 0; b < 2; ++b) {
      SCOPED_TRACE("batch item " + std::to_string(b));
      EXPECT_TRUE(attn_test::near_t<T>(item(result.output, b), expected.output[to_size(b)]));
      EXPECT_TRUE(attn_test::near_t<T>(item(result.weights, b), expected.weights[to_size(b)]));
    }
    options.average_weights = false;
    const MultiHeadResult<T> per_head = layer.forward(query, key, value, options);
    ASSERT_EQ(per_head.head_weights.dimension(3), m + extra);
  }
}

TYPED_TEST(MultiHeadLayer, AddBiasKvAppendsTheLearnedRowAfterProjection) {
  check_extra_keys<TypeParam>(true, false, 0);
}
TYPED_TEST(MultiHeadLayer, AddZeroAttnAppendsAZeroRow) {
  check_extra_keys<TypeParam>(false, true, 0);
}
TYPED_TEST(MultiHeadLayer, AddBiasKvThenZeroAttn) { check_extra_keys<TypeParam>(true, true, 0); }
TYPED_TEST(MultiHeadLayer, AddBiasKvAndZeroAttnWithGroupedQueryHeads) {
  check_extra_keys<TypeParam>(true, true, 1);
}

/// Xavier-uniform from the seed: same seed -> same weights; another seed -> other weights; every
/// entry within sqrt(6 / (fan_in + fan_out)) of its matrix; biases zero.
TYPED_TEST(MultiHeadLayer, XavierInitialisationIsDeterministicAndBounded) {
  using T = TypeParam;
  MultiHeadConfig config{16, 4};
  config.kdim = 6;
  config.vdim = 10;
  config.num_kv_heads = 2;
  const MultiHeadAttention<T> a(config, 42);
  const MultiHeadAttention<T> same(config, 42);
  const MultiHeadAttention<T> other(config, 43);
  const std::vector<std::pair<const char*, const attn::Matrix<T>*>> weights = {
      {"W_Q", &a.W_Q}, {"W_K", &a.W_K}, {"W_V", &a.W_V}, {"W_O", &a.W_O}};
  EXPECT_EQ(a.W_Q.rows(), 16);
  EXPECT_EQ(a.W_Q.cols(), 16);
  EXPECT_EQ(a.W_K.rows(), 6);
  EXPECT_EQ(a.W_K.cols(), 8);
  EXPECT_EQ(a.W_V.rows(), 10);
  EXPECT_EQ(a.W_V.cols(), 8);
  EXPECT_EQ(a.W_O.rows(), 16);
  EXPECT_EQ(a.W_O.cols(), 16);

  EXPECT_TRUE(attn_test::identical(a.W_Q, same.W_Q));
  EXPECT_TRUE(attn_test::identical(a.W_K, same.W_K));
  EXPECT_TRUE(attn_test::identical(a.W_V, same.W_V));
  EXPECT_TRUE(attn_test::identical(a.W_O, same.W_O));
  EXPECT_FALSE((a.W_Q.array() == other.W_Q.array()).any());
  EXPECT_FALSE((a.W_K.array() == other.W_K.array()).any());
  EXPECT_FALSE((a.W_V.array() == other.W_V.array()).any());
  EXPECT_FALSE((a.W_O.array() == other.W_O.array()).any());
  // The four matrices are not copies of one another.
  EXPECT_FALSE(attn_test::identical(a.W_Q.topRows(6), a.W_O.topRows(6)));

  for (const auto& [name, W] : weights) {
    SCOPED_TRACE(name);
    const double bound = std::sqrt(6.0 / static_cast<double>(W->rows() + W->cols()));
    const double largest = static_cast<double>(W->cwiseAbs().maxCoeff());
    EXPECT_LE(largest, bound);
    EXPECT_GT(largest, 0.5 * bound) << "the entries should spread over [-bound, bound]";
    EXPECT_LT(static_cast<double>(W->minCoeff()), 0.0);
    EXPECT_GT(static_cast<double>(W->maxCoeff()), 0.0);
  }
  for (const attn::RowVector<T>* b : {&a.b_Q, &a.b_K, &a.b_V, &a.b_O}) {
    EXPECT_GT(b->size(), 0);
    EXPECT_TRUE((b->array() == T(0)).all());
  }
}

// ------------------------------------------------------------------------------------------------
// Errors: attn::shape_error with both shapes (or sizes) in the message
// ------------------------------------------------------------------------------------------------

using attn_test::expect_shape_error;

using Layer = MultiHeadAttention<float>;
using Tensor = Tensor3<float>;

Tensor zeros(Index a, Index b, Index c) {
  Tensor t(a, b, c);
  t.setZero();
  return t;
}

// ------------------------------------------------------------------------------------------------
// The layer a decoder needs: RoPE, the cache step, the layouts, GQA projections
// ------------------------------------------------------------------------------------------------

TEST(HeadLayouts, SplitAndMergeAreInverseAndMatchTheColumns) {
  std::mt19937 rng(61);
  const attn::Matrix<float> X = attn_test::random_matrix<float>(5, 12, rng);
  const Tensor3<float> t = attn::split_heads(X, 3);
  ASSERT_EQ(t.dimension(0), 3);
  ASSERT_EQ(t.dimension(1), 5);
  ASSERT_EQ(t.dimension(2), 4);
  for (Index h = 0; h < 3; ++h) {
    EXPECT_TRUE(attn_test::identical(attn::detail::slice(t, h), X.middleCols(h * 4, 4)));
  }
  EXPECT_TRUE(attn_test::identical(attn::merge_heads(t), X));
  attn_test::expect_shape_error([&] { attn::split_heads(X, 5); }, {"split_heads", "5 x 12", "5"});
  attn_test::expect_shape_error([&] { attn::split_heads(X, 0); }, {"split_heads", "heads = 0"});
}

TEST(RopeHeads, EveryHeadRotatedAsOneAndTheBackwardToo) {
  std::mt19937 rng(62);
  const attn::Matrix<double> X = attn_test::random_matrix<double>(6, 3 * 8, rng);
  attn::RopeOptions<double> options;
  options.rotary_dim = 6;
  options.base = 500;
  for (const attn::RopeStyle style : {attn::RopeStyle::Interleaved, attn::RopeStyle::Half}) {
    const attn::Matrix<double> Y = attn::rope_heads(X, 3, 7, style, options);
    const attn::Matrix<double> dX = attn::rope_heads_backward(X, 3, 7, style, options);
    attn::Matrix<double> in_place = X;
    attn::rope_heads_inplace(in_place, 3, 7, style, options);
    for (Index h = 0; h < 3; ++h) {
      EXPECT_TRUE(attn_test::identical(Y.middleCols(h * 8, 8),
                                       attn::rope(X.middleCols(h * 8, 8), 7, style, options)));
      EXPECT_TRUE(attn_test::identical(
          dX.middleCols(h * 8, 8), attn::rope_backward(X.middleCols(h * 8, 8), 7, style, options)));
    }
    EXPECT_TRUE(attn_test::identical(in_place, Y));
  }
  attn_test::expect_shape_error([&] { attn::rope_heads(X, 5, 0, attn::RopeStyle::Half); },
                                {"rope_heads", "6 x 24", "heads = 5"});
}

TEST(ProjectQkv, GroupedQueryWidths) {
  std::mt19937 rng(63);
  const attn::Matrix<double> X = attn_test::random_matrix<double>(4, 6, rng);
  const attn::Matrix<double> W_Q = attn_test::random_matrix<double>(6, 8, rng);
  const attn::Matrix<double> W_K = attn_test::random_matrix<double>(6, 4, rng);
  const attn::Matrix<double> W_V = attn_test::random_matrix<double>(6, 4, rng);
  const attn::QKV<double> qkv = attn::project_qkv(X, W_Q, W_K, W_V);
  EXPECT_TRUE(attn_test::near_t<double>(qkv.Q, (X * W_Q).eval()));
  EXPECT_TRUE(attn_test::near_t<double>(qkv.K, (X * W_K).eval()));
  const attn::Matrix<double> W_bad = attn_test::random_matrix<double>(6, 3, rng);
  attn_test::expect_shape_error([&] { attn::project_qkv(X, W_Q, W_bad, W_V); },
                                {"project_qkv", "W_K is 6 x 3", "W_Q 6 x 8"});
}

/// A GQA layer (8 query heads over 2 key/value heads, head_dim 8) with random biases.
template <class T>
MultiHeadAttention<T> decoder_layer(std::optional<attn::RopeStyle> rope, std::uint64_t seed) {
  MultiHeadConfig config{64, 8};
  config.num_kv_heads = 2;
  MultiHeadAttention<T> layer(config, seed);
  std::mt19937 rng(static_cast<std::uint32_t>(seed));
  for (attn::RowVector<T>* b : {&layer.b_Q, &layer.b_K, &layer.b_V, &layer.b_O}) {
    *b = attn_test::random_matrix<T>(1, b->size(), rng);
  }
  layer.rope = rope;
  layer.rope_options.base = T(1000);
  return layer;
}

template <class T>
attn::KVCacheConfig<T> decoder_cache(attn::KVStorage storage = attn::KVStorage::Same) {
  attn::KVCacheConfig<T> config;
  config.d_k = 8;
  config.d_v = 8;
  config.kv_heads = 2;
  config.storage = storage;
  return config;
}

TYPED_TEST(MultiHeadLayer, RopeForwardIsTheProjectionsRotatedThenAttended) {
  using T = TypeParam;
  const MultiHeadAttention<T> layer = decoder_layer<T>(attn::RopeStyle::Half, 64);
  std::mt19937 rng(64);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(9, 64, rng);
  MultiHeadOptions<T> options;
  options.causal = Causal::BottomRight;
  const attn::Matrix<T> got = layer.forward(X, options);
  const attn::Matrix<T> Q = attn::rope_heads(attn::project(X, layer.W_Q, layer.b_Q), 8, 0,
                                             attn::RopeStyle::Half, layer.rope_options);
  const attn::Matrix<T> K = attn::rope_heads(attn::project(X, layer.W_K, layer.b_K), 2, 0,
                                             attn::RopeStyle::Half, layer.rope_options);
  const attn::Matrix<T> V = attn::project(X, layer.W_V, layer.b_V);
  attn::AttentionOptions<T> causal;
  causal.causal = Causal::BottomRight;
  const Tensor3<T> heads = attn::attention_heads(attn::split_heads(Q, 8), attn::split_heads(K, 2),
                                                 attn::split_heads(V, 2), causal);
  const attn::Matrix<T> want = attn::project(attn::merge_heads(heads), layer.W_O, layer.b_O);
  EXPECT_TRUE(attn_test::near_t<T>(got, want));
  // And RoPE matters: without it the layer gives something else.
  MultiHeadAttention<T> plain = layer;
  plain.rope.reset();
  EXPECT_FALSE(attn_test::near_t<T>(plain.forward(X, options), want));
}

/// A prefill of 5 tokens and 7 single-token steps through `forward_step` give the rows of the
/// full causal forward: RoPE in the layer, or in the cache instead, or none.
TYPED_TEST(MultiHeadLayer, ForwardStepEqualsTheFullCausalForward) {
  using T = TypeParam;
  std::mt19937 rng(65);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(12, 64, rng);
  MultiHeadOptions<T> causal;
  causal.causal = Causal::BottomRight;
  for (const int where : {0, 1, 2}) {  // RoPE in the layer, in the cache, nowhere
    SCOPED_TRACE("RoPE " + std::string(where == 0   ? "in the layer"
                                       : where == 1 ? "in the cache"
                                                    : "nowhere"));
    MultiHeadAttention<T> layer = decoder_layer<T>(
        where == 2 ? std::nullopt : std::optional<attn::RopeStyle>(attn::RopeStyle::Interleaved),
        66);
    const attn::Matrix<T> full = layer.forward(X, causal);
    attn::KVCacheConfig<T> config = decoder_cache<T>();
    if (where == 1) {
      config.rope = layer.rope;
      config.rope_options = layer.rope_options;
      layer.rope.reset();
    }
    attn::KVCache<T> cache(config);
    attn::Matrix<T> stepped(12, 64);
    stepped.topRows(5) = layer.forward_step(X.topRows(5), cache);
    for (Index i = 5; i < 12; ++i) stepped.row(i) = layer.forward_step(X.row(i), cache);
    EXPECT_EQ(cache.size(), 12);
    EXPECT_TRUE(attn_test::near_t<T>(stepped, full));
  }
}

TEST(MultiHeadForwardStep, Float16CacheStaysNearTheFullForward) {
  const MultiHeadAttention<float> layer = decoder_layer<float>(attn::RopeStyle::Half, 67);
  std::mt19937 rng(67);
  const attn::Matrix<float> X = attn_test::random_matrix<float>(40, 64, rng);
  MultiHeadOptions<float> causal;
  causal.causal = Causal::BottomRight;
  const attn::Matrix<float> full = layer.forward(X, causal);
  attn::KVCache<float> cache(decoder_cache<float>(attn::KVStorage::Float16));
  attn::Matrix<float> stepped(40, 64);
  stepped.topRows(30) = layer.forward_step(X.topRows(30), cache);
  for (Index i = 30; i < 40; ++i) stepped.row(i) = layer.forward_step(X.row(i), cache);
  const float worst = (stepped - full).cwiseAbs().maxCoeff() / full.cwiseAbs().maxCoeff();
  EXPECT_LT(worst, 5e-3f);  // float16 keys and values: about 2^-11 relative per entry
  EXPECT_GT(worst, 0.0f);   // (they were rounded)
}

/// A batch of sequences stepped in one call over a paged cache, prompt chunks and decoding steps
/// mixed (and a sequence with no row in a step): each sequence's rows have the bits of
/// `forward_step` on it alone over a `KVCache` of the same configuration.
TEST(MultiHeadForwardStep, ABatchOverAPagedCacheIsEachSequenceAlone) {
  const MultiHeadAttention<float> layer = decoder_layer<float>(attn::RopeStyle::Half, 69);
  attn::PagedKVCacheConfig<float> config;
  static_cast<attn::KVCacheConfig<float>&>(config) = decoder_cache<float>(attn::KVStorage::Float16);
  config.page_size = 16;
  config.pages = 64;
  attn::PagedKVCache<float> paged(config);
  std::vector<attn::KVCache<float>> alone(3, attn::KVCache<float>(config));
  const std::vector<Index> ids{paged.add_sequence(), paged.add_sequence(), paged.add_sequence()};
  std::mt19937 rng(69);
  for (const std::vector<int>& lengths :
       {std::vector<int>{20, 7, 33}, {1, 1, 1}, {5, 1, 0}, {1, 1, 1}}) {
    std::vector<int> cu{0};
    for (const int n : lengths) cu.push_back(cu.back() + n);
    const attn::Matrix<float> X = attn_test::random_matrix<float>(cu.back(), 64, rng);
    const attn::Matrix<float> out = layer.forward_step(X, paged, ids, cu);
    for (std::size_t b = 0; b < ids.size(); ++b) {
      if (lengths[b] == 0) continue;
      const attn::Matrix<float> expected =
          layer.forward_step(X.middleRows(cu[b], lengths[b]), alone[b]);
      EXPECT_EQ(0, std::memcmp(out.middleRows(cu[b], lengths[b]).eval().data(), expected.data(),
                               sizeof(float) * std::size_t(expected.size())))
          << "sequence " << b << " of a step of " << cu.back() << " rows";
    }
  }
  EXPECT_EQ(paged.length(ids[2]), 35);
  attn::PagedKVCacheConfig<float> rotating = config;
  rotating.rope = attn::RopeStyle::Half;
  attn::PagedKVCache<float> both(rotating);
  const Index id = both.add_sequence();
  attn_test::expect_shape_error(
      [&] {
        layer.forward_step(attn::Matrix<float>::Ones(1, 64), both, {id}, {0, 1});
      },
      {"MultiHeadAttention::forward_step", "RoPE"});
  EXPECT_EQ(both.length(id), 0) << "the cache is unchanged";
}

TEST(MultiHeadForwardStep, RefusesWhatItCannotDo) {
  MultiHeadAttention<float> layer = decoder_layer<float>(attn::RopeStyle::Half, 68);
  const attn::Matrix<float> x = attn::Matrix<float>::Ones(1, 64);
  attn::KVCacheConfig<float> both = decoder_cache<float>();
  both.rope = attn::RopeStyle::Half;
  attn::KVCache<float> rotating(both);
  attn_test::expect_shape_error([&] { layer.forward_step(x, rotating); },
                                {"MultiHeadAttention::forward_step", "RoPE"});
  EXPECT_EQ(rotating.size(), 0) << "the cache is unchanged";
  attn::KVCacheConfig<float> narrow = decoder_cache<float>();
  narrow.kv_heads = 4;
  attn::KVCache<float> wrong(narrow);
  attn_test::expect_shape_error([&] { layer.forward_step(x, wrong); },
                                {"forward_step", "4 key/value heads", "2 of head_dim 8"});
  attn::KVCache<float> cache(decoder_cache<float>());
  attn_test::expect_shape_error(
      [&] { layer.forward_step(attn::Matrix<float>::Ones(1, 63), cache); },
      {"forward_step", "x is 1 x 63", "64"});
  MultiHeadConfig with_bias_kv{64, 8};
  with_bias_kv.num_kv_heads = 2;
  with_bias_kv.add_bias_kv = true;
  const MultiHeadAttention<float> appended(with_bias_kv);
  attn_test::expect_shape_error([&] { appended.forward_step(x, cache); },
                                {"forward_step", "add_bias_kv"});
  EXPECT_EQ(cache.size(), 0);
  // A RoPE layer's queries may not stand before position 0.
  MultiHeadOptions<float> early;
  early.query_offset = -1;
  attn_test::expect_shape_error([&] { layer.forward(x, early); }, {"RoPE", "-1"});
}

TEST(MultiHeadErrors, EmbedDimNotDivisibleByNumHeads) {
  expect_shape_error([] { Layer layer(MultiHeadConfig{10, 4}); }, {"10", "4", "divisible"});
}

TEST(MultiHeadErrors, NumHeadsNotDivisibleByNumKvHeads) {
  MultiHeadConfig config{12, 4};
  config.num_kv_heads = 3;
  expect_shape_error([&] { Layer layer(config); }, {"num_heads 4", "num_kv_heads 3"});
}

TEST(MultiHeadErrors, NonPositiveEmbedDimOrHeads) {
  expect_shape_error([] { Layer layer(MultiHeadConfig{0, 1}); }, {"embed_dim = 0"});
  expect_shape_error([] { Layer layer(MultiHeadConfig{8, 0}); }, {"num_heads = 0"});
}

TEST(MultiHeadErrors, QueryKeyBatchMismatch) {
  const Layer layer(MultiHeadConfig{8, 2});
  expect_shape_error([&] { layer.forward(zeros(2, 3, 8), zeros(3, 4, 8), zeros(3, 4, 8)); },
                     {"batch", "(2, 3, 8)", "(3, 4, 8)"});
}

TEST(MultiHeadErrors, ValueBatchMismatch) {
  const Layer layer(MultiHeadConfig{8, 2});
  expect_shape_error([&] { layer.forward(zeros(2, 3, 8), zeros(2, 4, 8), zeros(1, 4, 8)); },
                     {"batch", "(2, 4, 8)", "(1, 4, 8)"});
}

TEST(MultiHeadErrors, QueryWidthDiffersFromEmbedDim) {
  const Layer layer(MultiHeadConfig{8, 2});
  expect_shape_error([&] { layer.forward(zeros(1, 3, 6), zeros(1, 4, 8), zeros(1, 4, 8)); },
                     {"embed_dim is 8", "(1, 3, 6)"});
}

TEST(MultiHeadErrors, KeyWidthDiffersFromKdim) {
  MultiHeadConfig config{8, 2};
  config.kdim = 5;
  const Layer layer(config);
  expect_shape_error([&] { layer.forward(zeros(1, 3, 8), zeros(1, 4, 8), zeros(1, 4, 8)); },
                     {"kdim is 5", "(1, 4, 8)"});
}

TEST(MultiHeadErrors, ValueWidthDiffersFromVdim) {
  MultiHeadConfig config{8, 2};
  config.vdim = 7;
  const Layer layer(config);
  expect_shape_error([&] { layer.forward(zeros(1, 3, 8), zeros(1, 4, 8), zeros(1, 4, 8)); },
                     {"vdim is 7", "(1, 4, 8)"});
}

TEST(MultiHeadErrors, KeyValueTokenMismatch) {
  const Layer layer(MultiHeadConfig{8, 2});
  expect_shape_error([&] { layer.forward(zeros(1, 3, 8), zeros(1, 4, 8), zeros(1, 5, 8)); },
                     {"tokens", "(1, 4, 8)", "(1, 5, 8)"});
}

TEST(MultiHeadErrors, MaskShape) {
  const Layer layer(MultiHeadConfig{8, 2});
  MultiHeadOptions<float> options;
  options.mask = Mask::Constant(3, 5, true);
  expect_shape_error(
      [&] { layer.forward(zeros(1, 3, 8), zeros(1, 4, 8), zeros(1, 4, 8), options); },
      {"mask", "3 x 5", "3 x 4"});
}

TEST(MultiHeadErrors, KeyValidShape) {
  const Layer layer(MultiHeadConfig{8, 2});
  MultiHeadOptions<float> options;
  options.key_valid = Mask::Constant(1, 4, true);
  expect_shape_error(
      [&] { layer.forward(zeros(2, 3, 8), zeros(2, 4, 8), zeros(2, 4, 8), options); },
      {"key_valid", "1 x 4", "2 x 4"});
}

TEST(MultiHeadErrors, SingleSequenceForwardNeedsSelfAttentionWidths) {
  MultiHeadConfig config{8, 2};
  config.kdim = 6;
  const Layer layer(config);
  expect_shape_error([&] { layer.forward(attn::Matrix<float>::Zero(3, 8)); }, {"kdim is 6"});
}

TEST(MultiHeadErrors, PyTorchInProjWeightShape) {
  Layer layer(MultiHeadConfig{8, 2});
  expect_shape_error(
      [&] {
        layer.load_pytorch(attn::Matrix<float>::Zero(23, 8), attn::RowVector<float>::Zero(24),
                           attn::Matrix<float>::Zero(8, 8), attn::RowVector<float>::Zero(8));
      },
      {"in_proj_weight", "23 x 8", "24 x 8"});
}

TEST(MultiHeadErrors, PyTorchOutProjWeightShape) {
  Layer layer(MultiHeadConfig{8, 2});
  expect_shape_error(
      [&] {
        layer.load_pytorch(attn::Matrix<float>::Zero(24, 8), attn::RowVector<float>::Zero(24),
                           attn::Matrix<float>::Zero(8, 7), attn::RowVector<float>::Zero(8));
      },
      {"out_proj_weight", "8 x 7", "8 x 8"});
}

TEST(MultiHeadErrors, PyTorchBiasSizes) {
  Layer layer(MultiHeadConfig{8, 2});
  expect_shape_error(
      [&] {
        layer.load_pytorch(attn::Matrix<float>::Zero(24, 8), attn::RowVector<float>::Zero(23),
                           attn::Matrix<float>::Zero(8, 8), attn::RowVector<float>::Zero(8));
      },
      {"in_proj_bias", "23", "24"});
  MultiHeadConfig no_bias{8, 2};
  no_bias.bias = false;
  Layer unbiased(no_bias);
  expect_shape_error(
      [&] {
        unbiased.load_pytorch(attn::Matrix<float>::Zero(24, 8), attn::RowVector<float>::Zero(24),
                              attn::Matrix<float>::Zero(8, 8), attn::RowVector<float>());
      },
      {"in_proj_bias", "24", "bias = false"});
}

TEST(MultiHeadErrors, PyTorchSeparateProjectionShapes) {
  MultiHeadConfig config{8, 2};
  config.kdim = 6;
  config.vdim = 10;
  Layer layer(config);
  expect_shape_error(
      [&] {
        layer.load_pytorch(attn::Matrix<float>::Zero(8, 8), attn::Matrix<float>::Zero(6, 8),
                           attn::Matrix<float>::Zero(8, 10), attn::RowVector<float>::Zero(24),
                           attn::Matrix<float>::Zero(8, 8), attn::RowVector<float>::Zero(8));
      },
      {"k_proj_weight", "6 x 8", "8 x 6"});
  // The packed overload cannot hold kdim != embed_dim.
  expect_shape_error(
      [&] {
        layer.load_pytorch(attn::Matrix<float>::Zero(24, 8), attn::RowVector<float>::Zero(24),
                           attn::Matrix<float>::Zero(8, 8), attn::RowVector<float>::Zero(8));
      },
      {"kdim 6", "vdim 10", "embed_dim 8"});
}

TEST(MultiHeadErrors, PyTorchLoaderRejectsGroupedQueryLayers) {
  MultiHeadConfig config{8, 4};
  config.num_kv_heads = 2;
  Layer layer(config);
  expect_shape_error(
      [&] {
        layer.load_pytorch(attn::Matrix<float>::Zero(24, 8), attn::RowVector<float>::Zero(24),
                           attn::Matrix<float>::Zero(8, 8), attn::RowVector<float>::Zero(8));
      },
      {"num_kv_heads = 2", "num_heads = 4"});
}

TEST(MultiHeadErrors, AttentionHeadsQueryHeadsNotAMultipleOfKeyValueHeads) {
  expect_shape_error([] { attn::attention_heads(zeros(3, 2, 4), zeros(2, 5, 4), zeros(2, 5, 4)); },
                     {"multiple", "(3, 2, 4)", "(2, 5, 4)"});
}

TEST(MultiHeadErrors, AttentionHeadsKeyValueHeadCountMismatch) {
  expect_shape_error([] { attn::attention_heads(zeros(4, 2, 4), zeros(2, 5, 4), zeros(1, 5, 4)); },
                     {"same number of heads", "(2, 5, 4)", "(1, 5, 4)"});
}

TEST(MultiHeadErrors, AttentionHeadsKeyValueTokenMismatch) {
  expect_shape_error([] { attn::attention_heads(zeros(4, 2, 4), zeros(2, 5, 4), zeros(2, 6, 4)); },
                     {"tokens", "(2, 5, 4)", "(2, 6, 4)"});
}

TEST(MultiHeadErrors, AttentionHeadsQueryKeyWidthMismatch) {
  expect_shape_error([] { attn::attention_heads(zeros(4, 2, 4), zeros(2, 5, 3), zeros(2, 5, 4)); },
                     {"features", "(4, 2, 4)", "(2, 5, 3)"});
}

TEST(MultiHeadErrors, AttentionHeadsMaskShape) {
  attn::AttentionOptions<float> options;
  options.mask = Mask::Constant(2, 4, true);
  expect_shape_error(
      [&] { attn::attention_heads(zeros(4, 2, 4), zeros(2, 5, 4), zeros(2, 5, 4), options); },
      {"mask", "2 x 4", "2 x 5"});
}

}  // namespace
