/// The ONNX Attention conformance cases (tests/data/onnx_attention/*.json, 87 cases of opsets 23 to
/// 25 from the ONNX reference implementation; see the README there) through
/// `attn::onnx::attention`, in float and in double, comparing every output the case produces.
/// Also: the shape errors of the adapter. Only <attn/onnx.hpp> is included (not the umbrella, not
/// test_support.hpp), so this executable compiles just the part of the library the adapter uses.

#include <gtest/gtest.h>

#include <algorithm>
#include <attn/onnx.hpp>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef ATTN_ONNX_CASES_DIR
#error "ATTN_ONNX_CASES_DIR must name tests/data/onnx_attention"
#endif

namespace {

using attn::Index;
namespace fs = std::filesystem;

constexpr std::size_t kExpectedCases = 87;

/// The case names: the *.json files of the directory, sorted.
std::vector<std::string> case_names() {
  std::vector<std::string> names;
  if (!fs::is_directory(ATTN_ONNX_CASES_DIR)) return names;
  for (const auto& entry : fs::directory_iterator(ATTN_ONNX_CASES_DIR)) {
    if (entry.path().extension() == ".json") names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

nlohmann::json load_json(const std::string& name) {
  const std::string path = std::string(ATTN_ONNX_CASES_DIR) + "/" + name + ".json";
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot open " + path);
  nlohmann::json json;
  file >> json;
  return json;
}

/// A float value of the JSON files: a number, or "-inf", "inf", "nan".
double number(const nlohmann::json& value) {
  if (value.is_number()) return value.get<double>();
  const std::string text = value.get<std::string>();
  if (text == "-inf") return -std::numeric_limits<double>::infinity();
  if (text == "inf") return std::numeric_limits<double>::infinity();
  if (text == "nan") return std::numeric_limits<double>::quiet_NaN();
  throw std::runtime_error("not a number: " + value.dump());
}

std::vector<Index> shape_of(const nlohmann::json& tensor) {
  return tensor.at("shape").get<std::vector<Index>>();
}

/// A float32/float16 tensor, each value parsed as double (exact, see the README) then cast to T.
template <class T>
attn::onnx::Tensor<T> float_tensor(const nlohmann::json& tensor) {
  const std::string dtype = tensor.at("dtype").get<std::string>();
  if (dtype != "float32" && dtype != "float16") {
    throw std::runtime_error(tensor.at("name").get<std::string>() + " is " + dtype);
  }
  attn::onnx::Tensor<T> t;
  t.shape = shape_of(tensor);
  for (const auto& value : tensor.at("data")) t.data.push_back(static_cast<T>(number(value)));
  return t;
}

attn::onnx::BoolTensor bool_tensor(const nlohmann::json& tensor) {
  attn::onnx::BoolTensor t;
  t.shape = shape_of(tensor);
  for (const auto& value : tensor.at("data")) t.data.push_back(value.get<bool>());
  return t;
}

/// The node's attributes; an attribute the adapter does not know fails the case.
attn::onnx::Attributes attributes_of(const nlohmann::json& json) {
  attn::onnx::Attributes a;
  for (const auto& item : json.items()) {
    const std::string& key = item.key();
    const nlohmann::json& value = item.value();
    if (key == "is_causal") {
      a.is_causal = value.get<std::int64_t>();
    } else if (key == "scale") {
      a.scale = number(value);
    } else if (key == "softcap") {
      a.softcap = number(value);
    } else if (key == "q_num_heads") {
      a.q_num_heads = value.get<std::int64_t>();
    } else if (key == "kv_num_heads") {
      a.kv_num_heads = value.get<std::int64_t>();
    } else if (key == "qk_matmul_output_mode") {
      a.qk_matmul_output_mode = value.get<std::int64_t>();
    } else if (key == "softmax_precision") {
      a.softmax_precision = value.get<std::int64_t>();
    } else if (key == "left_window_size") {
      a.left_window_size = value.get<std::int64_t>();
    } else if (key == "right_window_size") {
      a.right_window_size = value.get<std::int64_t>();
    } else {
      throw std::runtime_error("unknown attribute " + key);
    }
  }
  return a;
}

std::string dims(const std::vector<Index>& shape) {
  std::ostringstream out;
  out << "(";
  for (std::size_t a = 0; a < shape.size(); ++a) out << (a > 0 ? ", " : "") << shape[a];
  return out.str() + ")";
}

/// The multi-index of flat position `k` of a row-major tensor of `shape`.
std::string position(std::vector<Index> shape, Index k) {
  std::vector<Index> index(shape.size());
  for (std::size_t a = shape.size(); a-- > 0;) {
    index[a] = shape[a] > 0 ? k % shape[a] : 0;
    k = shape[a] > 0 ? k / shape[a] : 0;
  }
  return dims(index);
}

/// `got` equals the expected tensor: same shape; each entry within `atol + rtol |want|`;
/// non-finite expected values exactly (same infinity, NaN for NaN). Reports the failing count
/// and the worst entry with its multi-index.
template <class T>
::testing::AssertionResult matches(const attn::onnx::Tensor<T>& got, const nlohmann::json& want,
                                   double atol, double rtol) {
  const std::vector<Index> shape = shape_of(want);
  if (got.shape != shape) {
    return ::testing::AssertionFailure()
           << "shape " << dims(got.shape) << ", expected " << dims(shape);
  }
  const nlohmann::json& data = want.at("data");
  if (got.data.size() != data.size()) {
    return ::testing::AssertionFailure()
           << got.data.size() << " elements, expected " << data.size();
  }
  Index failures = 0;
  Index worst = -1;
  double worst_ratio = 0;
  const double infinity = std::numeric_limits<double>::infinity();
  for (std::size_t k = 0; k < data.size(); ++k) {
    const double g = static_cast<double>(got.data[k]);
    const double w = number(data[k]);
    double ratio = 0;
    if (!std::isfinite(w) || !std::isfinite(g)) {
      const bool same = (std::isnan(w) && std::isnan(g)) || g == w;
      ratio = same ? 0 : infinity;
    } else {
      const double allowed = atol + rtol * std::fabs(w);
      const double error = std::fabs(g - w);
      ratio = error <= allowed ? 0 : error / allowed;
    }
    if (ratio > 0) {
      ++failures;
      if (worst < 0 || ratio > worst_ratio) {
        worst = static_cast<Index>(k);
        worst_ratio = ratio;
      }
    }
  }
  if (failures == 0) return ::testing::AssertionSuccess();
  const std::size_t at = static_cast<std::size_t>(worst);
  std::ostringstream got_text;
  got_text.precision(9);
  got_text << static_cast<double>(got.data[at]);
  return ::testing::AssertionFailure()
         << failures << " of " << data.size() << " entries differ (shape " << dims(shape)
         << "); worst at " << position(shape, worst) << ": got " << got_text.str() << ", expected "
         << data[at].dump() << " (atol " << atol << ", rtol " << rtol << ")";
}

/// Runs one case in T and compares every output it has.
template <class T>
void run_case(const std::string& name) {
  const nlohmann::json json = load_json(name);
  ASSERT_EQ(json.at("name").get<std::string>(), name);
  const nlohmann::json& in = json.at("inputs");
  const nlohmann::json& out = json.at("outputs");
  ASSERT_EQ(in.size(), 7u) << "the operator's 7 input slots";
  ASSERT_EQ(out.size(), 4u) << "the operator's 4 output slots";
  ASSERT_FALSE(out[0].is_null()) << "every case has Y";

  attn::onnx::Inputs<T> inputs;
  inputs.Q = float_tensor<T>(in[0]);
  inputs.K = float_tensor<T>(in[1]);
  inputs.V = float_tensor<T>(in[2]);
  if (!in[3].is_null()) {
    if (in[3].at("dtype").get<std::string>() == "bool") {
      inputs.attn_bool_mask = bool_tensor(in[3]);
    } else {
      inputs.attn_mask = float_tensor<T>(in[3]);
    }
  }
  if (!in[4].is_null()) inputs.past_key = float_tensor<T>(in[4]);
  if (!in[5].is_null()) inputs.past_value = float_tensor<T>(in[5]);
  if (!in[6].is_null()) {
    ASSERT_EQ(in[6].at("dtype").get<std::string>(), "int64");
    inputs.nonpad_kv_seqlen = in[6].at("data").get<std::vector<std::int64_t>>();
  }
  const attn::onnx::Attributes attributes = attributes_of(json.at("attributes"));
  attn::onnx::OutputRequest request;
  request.present = !out[1].is_null() || !out[2].is_null();
  request.qk_matmul_output = !out[3].is_null();

  const bool fp16 = in[0].at("dtype").get<std::string>() == "float16";
  const double atol = fp16 ? 2e-3 : 1e-5;
  const double rtol = fp16 ? 1e-3 : 1e-4;

  const attn::onnx::Outputs<T> got = attn::onnx::attention(inputs, attributes, request);
  EXPECT_TRUE(matches(got.Y, out[0], atol, rtol)) << "Y";
  if (fp16) {
    // The same case with the keys and values read through float16 storage (Eigen::half
    // matrices, as from a KVCache kept in KVStorage::Float16): within the case's tolerance.
    const attn::onnx::Outputs<T> stored =
        attn::onnx::attention(inputs, attributes, request, attn::KVStorage::Float16);
    EXPECT_TRUE(matches(stored.Y, out[0], atol, rtol)) << "Y through float16 storage";
    if (request.qk_matmul_output) {
      EXPECT_TRUE(matches(*stored.qk_matmul_output, out[3], atol, rtol))
          << "qk_matmul_output through float16 storage";
    }
  }
  const char* names[] = {"Y", "present_key", "present_value", "qk_matmul_output"};
  const std::optional<attn::onnx::Tensor<T>>* optional_outputs[] = {
      nullptr, &got.present_key, &got.present_value, &got.qk_matmul_output};
  for (std::size_t slot = 1; slot < 4; ++slot) {
    if (out[slot].is_null()) continue;
    const std::optional<attn::onnx::Tensor<T>>& produced = *optional_outputs[slot];
    ASSERT_TRUE(produced.has_value()) << names[slot] << " was not produced";
    EXPECT_TRUE(matches(*produced, out[slot], atol, rtol)) << names[slot];
  }
}

const std::vector<std::string>& all_cases() {
  static const std::vector<std::string> names = case_names();
  return names;
}

TEST(OnnxConformanceFiles, AllCasesArePresent) {
  EXPECT_EQ(all_cases().size(), kExpectedCases) << "in " << ATTN_ONNX_CASES_DIR;
}

/// Every case of the README's table has its file, and every file is in the table.
TEST(OnnxConformanceFiles, EveryFileIsInTheReadme) {
  std::ifstream readme(std::string(ATTN_ONNX_CASES_DIR) + "/README.md");
  ASSERT_TRUE(readme) << "missing README.md in " << ATTN_ONNX_CASES_DIR;
  std::set<std::string> listed;
  const std::regex row(R"(^\| *[0-9]+ *\| *`(test_attention[a-z0-9_]*)`)");
  std::string line;
  std::smatch match;
  while (std::getline(readme, line)) {
    if (std::regex_search(line, match, row)) listed.insert(match[1].str());
  }
  const std::set<std::string> found(all_cases().begin(), all_cases().end());
  EXPECT_EQ(listed.size(), kExpectedCases);
  EXPECT_EQ(found, listed);
}

class OnnxConformance : public ::testing::TestWithParam<std::string> {};

TEST_P(OnnxConformance, Float) { run_case<float>(GetParam()); }
TEST_P(OnnxConformance, Double) { run_case<double>(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Onnx, OnnxConformance, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<std::string>& case_info) {
                           return case_info.param;
                         });

// ------------------------------------------------------------------------------------------------
// Shape errors: the operand and the shapes are named.
// ------------------------------------------------------------------------------------------------

/// `call` throws attn::shape_error whose message starts with "attn::" and contains every part.
void expect_shape_error(const std::function<void()>& call,
                        std::initializer_list<const char*> parts) {
  try {
    call();
  } catch (const attn::shape_error& error) {
    const std::string message = error.what();
    EXPECT_EQ(message.rfind("attn::onnx::attention: ", 0), 0u) << message;
    for (const char* part : parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "message lacks '" << part << "': " << message;
    }
    return;
  } catch (const std::exception& error) {
    ADD_FAILURE() << "threw something other than attn::shape_error: " << error.what();
    return;
  }
  ADD_FAILURE() << "did not throw attn::shape_error";
}

attn::onnx::Tensor<double> zeros(std::vector<Index> shape) {
  Index count = 1;
  for (const Index extent : shape) count *= extent;
  return {std::move(shape), std::vector<double>(static_cast<std::size_t>(count), 0.0)};
}

attn::onnx::Inputs<double> small_inputs() {
  attn::onnx::Inputs<double> in;
  in.Q = zeros({2, 4, 3, 8});
  in.K = zeros({2, 2, 5, 8});
  in.V = zeros({2, 2, 5, 6});
  return in;
}

TEST(OnnxAttentionErrors, ValidInputsRun) {
  const attn::onnx::Outputs<double> out = attn::onnx::attention(small_inputs());
  EXPECT_EQ(out.Y.shape, (std::vector<Index>{2, 4, 3, 6}));
  ASSERT_TRUE(out.present_key.has_value());
  EXPECT_EQ(out.present_key->shape, (std::vector<Index>{2, 2, 5, 8}));
  EXPECT_FALSE(out.qk_matmul_output.has_value());
}

TEST(OnnxAttentionErrors, HeadSizeMismatch) {
  attn::onnx::Inputs<double> in = small_inputs();
  in.K = zeros({2, 2, 5, 7});
  expect_shape_error([&] { attn::onnx::attention(in); },
                     {"onnx::attention", "K", "(2, 2, 5, 7)", "(2, 4, 3, 8)"});
}

TEST(OnnxAttentionErrors, HeadsNotAMultiple) {
  attn::onnx::Inputs<double> in = small_inputs();
  in.K = zeros({2, 3, 5, 8});
  in.V = zeros({2, 3, 5, 6});
  expect_shape_error([&] { attn::onnx::attention(in); },
                     {"q_heads = 4", "kv_heads = 3", "(2, 3, 5, 8)"});
}

TEST(OnnxAttentionErrors, DataSizeDisagreesWithShape) {
  attn::onnx::Inputs<double> in = small_inputs();
  in.V.data.pop_back();
  expect_shape_error([&] { attn::onnx::attention(in); }, {"V", "(2, 2, 5, 6)"});
}

TEST(OnnxAttentionErrors, RankThreeNeedsHeadCounts) {
  attn::onnx::Inputs<double> in;
  in.Q = zeros({1, 3, 16});
  in.K = zeros({1, 5, 16});
  in.V = zeros({1, 5, 16});
  expect_shape_error([&] { attn::onnx::attention(in); },
                     {"q_num_heads", "kv_num_heads", "(1, 3, 16)"});
  attn::onnx::Attributes a;
  a.q_num_heads = 3;
  a.kv_num_heads = 2;
  expect_shape_error([&] { attn::onnx::attention(in, a); }, {"Q", "(1, 3, 16)", "q_num_heads = 3"});
}

TEST(OnnxAttentionErrors, MaskThatDoesNotBroadcast) {
  attn::onnx::Inputs<double> in = small_inputs();
  in.attn_mask = zeros({3, 3, 5});  // heads axis 3, Q has 4 heads
  expect_shape_error([&] { attn::onnx::attention(in); },
                     {"attn_mask", "(3, 3, 5)", "(2, 4, 3, 5)", "q_heads"});
  in.attn_mask = zeros({3, 6});  // more keys than total_sequence_length
  expect_shape_error([&] { attn::onnx::attention(in); },
                     {"attn_mask", "(3, 6)", "total_sequence_length"});
  in.attn_mask.reset();
  in.attn_bool_mask = attn::onnx::BoolTensor{{2, 1, 1, 1, 5}, std::vector<bool>(10, true)};
  expect_shape_error([&] { attn::onnx::attention(in); },
                     {"attn_mask", "rank 1 to 4", "(2, 1, 1, 1, 5)"});
}

TEST(OnnxAttentionErrors, Int8StorageIsRefused) {
  expect_shape_error([&] { attn::onnx::attention(small_inputs(), {}, {}, attn::KVStorage::Int8); },
                     {"storage", "KVStorage::Int8"});
}

TEST(OnnxAttentionErrors, PastAndPadding) {
  attn::onnx::Inputs<double> in = small_inputs();
  in.past_key = zeros({2, 2, 4, 8});
  expect_shape_error([&] { attn::onnx::attention(in); }, {"past_key", "past_value", "absent"});
  in.past_value = zeros({2, 2, 3, 6});
  expect_shape_error([&] { attn::onnx::attention(in); },
                     {"past_value", "(2, 2, 3, 6)", "(2, 2, 4, 6)"});
  in.past_value = zeros({2, 2, 4, 6});
  in.nonpad_kv_seqlen = std::vector<std::int64_t>{9, 10};  // total is 4 + 5 = 9
  expect_shape_error([&] { attn::onnx::attention(in); }, {"nonpad_kv_seqlen[1]", "10", "[0, 9]"});
  in.nonpad_kv_seqlen = std::vector<std::int64_t>{9};
  expect_shape_error([&] { attn::onnx::attention(in); },
                     {"nonpad_kv_seqlen", "1 entries", "batch size is 2"});
}

TEST(OnnxAttentionErrors, AttributesOutOfRange) {
  attn::onnx::Attributes a;
  a.qk_matmul_output_mode = 4;
  expect_shape_error([&] { attn::onnx::attention(small_inputs(), a); },
                     {"qk_matmul_output_mode", "4"});
  a = {};
  a.left_window_size = -2;
  expect_shape_error([&] { attn::onnx::attention(small_inputs(), a); }, {"left_window_size", "-2"});
  a = {};
  a.softcap = -1;
  expect_shape_error([&] { attn::onnx::attention(small_inputs(), a); }, {"softcap", "-1"});
  a = {};
  a.softmax_precision = 7;
  expect_shape_error([&] { attn::onnx::attention(small_inputs(), a); }, {"softmax_precision", "7"});
}

// ------------------------------------------------------------------------------------------------
// Right padding of a short mask (the conformance cases pad only where nonpad_kv_seqlen also masks
// the padded keys, so they alone would not notice padding with 0 / true).
// ------------------------------------------------------------------------------------------------

/// A tensor of `shape` holding sin(1 + k + seed), k the flat index.
attn::onnx::Tensor<double> waves(std::vector<Index> shape, double seed) {
  attn::onnx::Tensor<double> t = zeros(std::move(shape));
  for (std::size_t k = 0; k < t.data.size(); ++k)
    t.data[k] = std::sin(1.0 + static_cast<double>(k) + seed);
  return t;
}

/// The same tensor with its last axis padded to `keys` entries of `value`.
template <class S>
attn::onnx::Tensor<S> pad_last(const attn::onnx::Tensor<S>& t, Index keys, S value) {
  attn::onnx::Tensor<S> padded{t.shape, {}};
  const Index width = t.shape.back();
  padded.shape.back() = keys;
  for (std::size_t k = 0; k < t.data.size(); ++k) {
    padded.data.push_back(t.data[k]);
    if (static_cast<Index>(k % static_cast<std::size_t>(width)) == width - 1) {
      for (Index j = width; j < keys; ++j) padded.data.push_back(value);
    }
  }
  return padded;
}

TEST(OnnxAttentionPadding, ShortMasksArePaddedToMaskTheMissingKeys) {
  attn::onnx::Inputs<double> in;
  in.Q = waves({2, 2, 3, 4}, 0.0);
  in.K = waves({2, 2, 5, 4}, 0.5);
  in.V = waves({2, 2, 5, 3}, 0.25);
  attn::onnx::OutputRequest request;
  request.qk_matmul_output = true;
  attn::onnx::Attributes softmax;
  softmax.qk_matmul_output_mode = 3;

  attn::onnx::Inputs<double> short_float = in;
  short_float.attn_mask = waves({3, 3}, 2.0);
  attn::onnx::Inputs<double> full_float = in;
  full_float.attn_mask =
      pad_last(*short_float.attn_mask, 5, -std::numeric_limits<double>::infinity());

  attn::onnx::Inputs<double> short_bool = in;
  short_bool.attn_bool_mask = attn::onnx::BoolTensor{
      {2, 1, 3, 2}, {true, false, true, true, false, true, true, true, false, true, true, false}};
  attn::onnx::Inputs<double> full_bool = in;
  full_bool.attn_bool_mask = pad_last(*short_bool.attn_bool_mask, 5, false);

  for (const auto& pair :
       {std::make_pair(short_float, full_float), std::make_pair(short_bool, full_bool)}) {
    const attn::onnx::Outputs<double> got = attn::onnx::attention(pair.first, softmax, request);
    const attn::onnx::Outputs<double> want = attn::onnx::attention(pair.second, softmax, request);
    EXPECT_EQ(got.Y.data, want.Y.data);
    ASSERT_TRUE(got.qk_matmul_output.has_value());
    EXPECT_EQ(got.qk_matmul_output->data, want.qk_matmul_output->data);
    // The padded keys 3 and 4 (float) or 2 to 4 (bool) have weight exactly 0.
    const std::vector<double>& weights = got.qk_matmul_output->data;
    const Index first_padded = pair.first.attn_mask ? 3 : 2;
    std::size_t nonzero = 0;
    for (std::size_t k = 0; k < weights.size(); ++k) {
      if (static_cast<Index>(k % 5) >= first_padded && weights[k] != 0.0) ++nonzero;
    }
    EXPECT_EQ(nonzero, 0u) << "weights on padded keys";
  }
}

}  // namespace
