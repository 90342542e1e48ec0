/// The PyTorch float64 reference cases tests/data/sdpa_*.json (see tests/data/README.md; generated
/// by PyTorch 1.13 plain tensor code), in float and double, through every attention entry point.
/// The gradient cases (sdpa_grad_*) are tested in backward_test.cpp; softmax_rows.json is tested in
/// softmax_test.cpp.

#include <gtest/gtest.h>

#include <algorithm>
#include <attn/attn.hpp>
#include <filesystem>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace {

/// Every forward scaled-dot-product case. A missing file fails its own test (load_case throws) and
/// `AllCaseFilesArePresent`; a new sdpa_* file not listed here fails `EveryCaseFileIsListed`.
const std::vector<std::string>& kCases = attn_test::kForwardCases;

TEST(ReferenceCases, AllCaseFilesArePresent) {
  for (const std::string& name : kCases) {
    EXPECT_TRUE(std::filesystem::is_regular_file(attn_test::case_path(name)))
        << "missing reference case " << attn_test::case_path(name);
  }
}

TEST(ReferenceCases, EveryCaseFileIsListed) {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator(ATTN_TEST_DATA_DIR)) {
    const std::string stem = entry.path().stem().string();
    if (entry.path().extension() == ".json" && stem.rfind("sdpa_", 0) == 0 &&
        stem.rfind("sdpa_grad_", 0) != 0) {
      found.push_back(stem);
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> listed = kCases;
  std::sort(listed.begin(), listed.end());
  EXPECT_EQ(found, listed);
}

class Sdpa : public ::testing::TestWithParam<std::string> {};

/// The case's fields, checked strictly, so that no generator setting goes unread: inputs are
/// Q, K, V and optionally mask and bias; expected is output and optionally weights; params are
/// converted by Case::options (which rejects unknown parameters).
void check_fields(const attn_test::Case& c) {
  EXPECT_EQ(c.json().at("name").get<std::string>(), c.name());
  const std::string generator = c.json().at("generator").get<std::string>();
  EXPECT_NE(generator.find("PyTorch"), std::string::npos) << generator;
  EXPECT_NE(generator.find("float64"), std::string::npos) << generator;
  const std::set<std::string> inputs = {"Q", "K", "V", "mask", "bias"};
  for (const auto& item : c.json().at("inputs").items()) {
    EXPECT_EQ(inputs.count(item.key()), 1u) << c.name() << ": unexpected input " << item.key();
  }
  const std::set<std::string> expected = {"output", "weights"};
  for (const auto& item : c.json().at("expected").items()) {
    EXPECT_EQ(expected.count(item.key()), 1u) << c.name() << ": unexpected expected " << item.key();
  }
  ASSERT_TRUE(c.has_expected("output"));
}

template <class T>
void check_case(const std::string& name) {
  const attn_test::Case c = attn_test::load_case(name);
  check_fields(c);
  const attn::Matrix<T> Q = c.input<T>("Q");
  const attn::Matrix<T> K = c.input<T>("K");
  const attn::Matrix<T> V = c.input<T>("V");
  const attn::AttentionOptions<T> options = c.options<T>();
  // Compared in double: the expected values keep PyTorch's float64 digits even for T = float.
  const attn::Matrix<double> output = c.expected<double>("output");
  ASSERT_EQ(output.rows(), Q.rows());
  ASSERT_EQ(output.cols(), V.cols());

  EXPECT_TRUE(attn_test::near_t<T>(attn::scaled_dot_product_attention(Q, K, V, options), output))
      << "scaled_dot_product_attention";
  const attn::Attention<T> result = attn::attention_with_weights(Q, K, V, options);
  EXPECT_TRUE(attn_test::near_t<T>(result.output, output)) << "attention_with_weights.output";
  const attn::AttentionTrace<T> trace = attn::trace_attention(Q, K, V, options);
  EXPECT_TRUE(attn_test::near_t<T>(trace.output, output)) << "trace_attention.output";
  if (c.has_expected("weights")) {
    const attn::Matrix<double> weights = c.expected<double>("weights");
    EXPECT_TRUE(attn_test::near_t<T>(result.weights, weights)) << "attention_with_weights.weights";
    EXPECT_TRUE(attn_test::near_t<T>(trace.weights, weights)) << "trace_attention.weights";
    // Where PyTorch gives exactly zero weight because the key is masked (causal, window, mask, or a
    // row attending nothing), ours is exactly zero too. (A zero that is only an underflow, as in
    // sdpa_large_scores, need not be.)
    for (attn::Index i = 0; i < weights.rows(); ++i) {
      for (attn::Index j = 0; j < weights.cols(); ++j) {
        if (trace.masked(i, j) == -std::numeric_limits<T>::infinity()) {
          EXPECT_EQ(weights(i, j), 0.0)
              << "masked here, not in PyTorch: (" << i << ", " << j << ")";
          EXPECT_EQ(result.weights(i, j), T(0)) << "(" << i << ", " << j << ")";
        }
      }
    }
  }
}

TEST_P(Sdpa, Float) { check_case<float>(GetParam()); }
TEST_P(Sdpa, Double) { check_case<double>(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Reference, Sdpa, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<std::string>& case_info) {
                           return case_info.param;
                         });

// The parameters of the cases are honoured, and needed: computed with default options instead of
// the case's (ignoring causal alignment, window, scale, mask or bias), the result must NOT match
// PyTorch's, otherwise the case would not test the parameter.
TEST(ReferenceCases, ParametersMatter) {
  const std::vector<std::string> with_parameters = {
      "sdpa_additive_bias",       "sdpa_bool_mask",     "sdpa_causal_bottom_right",
      "sdpa_causal_more_queries", "sdpa_causal_square", "sdpa_causal_top_left",
      "sdpa_custom_scale",        "sdpa_long",          "sdpa_sliding_window"};
  for (const std::string& name : with_parameters) {
    const attn_test::Case c = attn_test::load_case(name);
    const attn::Matrix<double> Q = c.input<double>("Q");
    const attn::Matrix<double> K = c.input<double>("K");
    const attn::Matrix<double> V = c.input<double>("V");
    const attn::Matrix<double> expected = c.expected<double>("output");
    EXPECT_TRUE(attn_test::near_t<double>(
        attn::scaled_dot_product_attention(Q, K, V, c.options<double>()), expected))
        << name;
    EXPECT_FALSE(attn_test::near(attn::scaled_dot_product_attention(Q, K, V), expected, 1e-6, 1e-6))
        << name << ": the default options already reproduce the case";
  }
  // With n != m the alignment matters: each rectangular causal case fails under the other one.
  for (const std::string& name :
       {std::string("sdpa_causal_bottom_right"), std::string("sdpa_causal_top_left"),
        std::string("sdpa_causal_more_queries")}) {
    const attn_test::Case c = attn_test::load_case(name);
    attn::AttentionOptions<double> swapped = c.options<double>();
    swapped.causal =
        swapped.causal == attn::Causal::TopLeft ? attn::Causal::BottomRight : attn::Causal::TopLeft;
    EXPECT_FALSE(attn_test::near(
        attn::scaled_dot_product_attention(c.input<double>("Q"), c.input<double>("K"),
                                           c.input<double>("V"), swapped),
        c.expected<double>("output"), 1e-6, 1e-6))
        << name << ": the other causal alignment reproduces the case";
  }
}

// Specific parameter conversions of the loader, against the case descriptions.
TEST(ReferenceCases, ParamsAreConverted) {
  const attn::AttentionOptions<double> top_left =
      attn_test::load_case("sdpa_causal_top_left").options<double>();
  EXPECT_EQ(top_left.causal, attn::Causal::TopLeft);
  EXPECT_FALSE(top_left.window.has_value());
  EXPECT_FALSE(top_left.scale.has_value());
  const attn::AttentionOptions<double> bottom_right =
      attn_test::load_case("sdpa_causal_bottom_right").options<double>();
  EXPECT_EQ(bottom_right.causal, attn::Causal::BottomRight);
  const attn::AttentionOptions<double> window =
      attn_test::load_case("sdpa_sliding_window").options<double>();
  ASSERT_TRUE(window.window.has_value());
  EXPECT_EQ(*window.window, 3);
  EXPECT_EQ(window.causal, attn::Causal::BottomRight);
  const attn::AttentionOptions<float> scale =
      attn_test::load_case("sdpa_custom_scale").options<float>();
  ASSERT_TRUE(scale.scale.has_value());
  EXPECT_EQ(*scale.scale, 0.5f);
  EXPECT_EQ(scale.causal, attn::Causal::None);
  const attn::AttentionOptions<double> mask =
      attn_test::load_case("sdpa_bool_mask").options<double>();
  ASSERT_TRUE(mask.mask.has_value());
  EXPECT_EQ(mask.mask->rows(), 5);
  EXPECT_EQ(mask.mask->cols(), 7);
  EXPECT_FALSE(mask.mask->row(2).any());  // "row 2 attends nothing"
  EXPECT_TRUE((*mask.mask)(0, 0));
  EXPECT_FALSE((*mask.mask)(0, 1));
  const attn::AttentionOptions<double> bias =
      attn_test::load_case("sdpa_additive_bias").options<double>();
  ASSERT_TRUE(bias.bias.has_value());
  EXPECT_EQ(bias.bias->rows(), 5);
  EXPECT_EQ(bias.bias->cols(), 6);
  EXPECT_EQ((*bias.bias)(0, 0), -2.21875);
}

TEST(ReferenceCases, LoaderReadsNegativeInfinityAndRejectsUnknowns) {
  const attn_test::Case softmax = attn_test::load_case("softmax_rows");
  const attn::Matrix<float> S = softmax.input<float>("S");
  EXPECT_EQ(S(2, 0), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(S(4, 0), 3e38f);
  EXPECT_THROW(attn_test::load_case("no_such_case"), std::runtime_error);
  const attn_test::Case odd("odd", nlohmann::json::parse(R"({"params": {"causal": "sideways"},
      "inputs": {"mask": [[0, 2]]}, "expected": {}})"));
  EXPECT_THROW(odd.options<double>(), std::runtime_error);
  EXPECT_THROW(odd.mask("mask"), std::runtime_error);
  const attn_test::Case unknown("unknown", nlohmann::json::parse(R"({"params": {"dropout": 0.1},
      "inputs": {}, "expected": {}})"));
  EXPECT_THROW(unknown.options<double>(), std::runtime_error);
}

}  // namespace
