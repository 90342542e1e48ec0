/// Hostile sizes and positions: every public size, position and window of any `Index` value has
/// its documented meaning or gives a `shape_error`, never an overflow (CI also runs this file
/// under UBSan), and the ONNX adapter refuses shapes it cannot hold before it allocates.

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <attn/onnx.hpp>
#include <chrono>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Index;
constexpr Index kMax = std::numeric_limits<Index>::max();
constexpr Index kMin = std::numeric_limits<Index>::min();

template <class M>
M random_matrix(Index rows, Index cols, unsigned seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-scale, scale);
  M out(rows, cols);
  for (Index i = 0; i < out.size(); ++i) out.data()[i] = static_cast<typename M::Scalar>(dist(gen));
  return out;
}

using F = attn::Matrix<float>;

/// `call()` throws attn::shape_error whose message contains `fragment`.
template <class Call>
::testing::AssertionResult refuses(Call&& call, const std::string& fragment) {
  try {
    call();
  } catch (const attn::shape_error& e) {
    if (std::string(e.what()).find(fragment) != std::string::npos) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "message lacks \"" << fragment << "\": " << e.what();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw another exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "no exception";
}

/// The three paths (materialised, tiled, decode) with one set of options against the reference
/// options, whose meaning must be the same.
void expect_same_meaning(const attn::AttentionOptions<float>& hostile,
                         const attn::AttentionOptions<float>& meaning, const char* what) {
  for (const Index n : {1, 6, 80}) {
    SCOPED_TRACE(std::string(what) + ", n = " + std::to_string(n));
    const F Q = random_matrix<F>(n, 16, 1);
    const F K = random_matrix<F>(80, 16, 2);
    const F V = random_matrix<F>(80, 8, 3);
    const F expected = attn::scaled_dot_product_attention(Q, K, V, meaning);
    EXPECT_TRUE(attn_test::near(attn::scaled_dot_product_attention(Q, K, V, hostile), expected,
                                1e-6, 1e-5));
    EXPECT_TRUE(attn_test::near(attn::flash_attention(Q, K, V, hostile), expected, 1e-6, 1e-5));
    EXPECT_TRUE(attn_test::near(attn::attention_with_weights(Q, K, V, hostile).output, expected,
                                1e-6, 1e-5));
  }
}

TEST(HostilePositions, UnboundedWindowsMeanNoWindow) {
  attn::AttentionOptions<float> hostile, meaning;
  hostile.window = kMax;
  expect_same_meaning(hostile, meaning, "window INT64_MAX");
  hostile = {};
  hostile.window_right = kMax;
  expect_same_meaning(hostile, meaning, "window_right INT64_MAX");
  hostile.window = kMax;
  hostile.causal = attn::Causal::BottomRight;
  meaning.causal = attn::Causal::BottomRight;
  expect_same_meaning(hostile, meaning, "both windows INT64_MAX, causal");
}

TEST(HostilePositions, ExtremeQueryOffsets) {
  attn::AttentionOptions<float> hostile, meaning;
  // Queries far after every key: causal lets them see every key.
  hostile.causal = attn::Causal::TopLeft;
  hostile.query_offset = kMax - 2;
  expect_same_meaning(hostile, meaning, "query_offset INT64_MAX - 2, causal");
  hostile.window_right = kMax;
  hostile.alibi_slope = 0.0f;
  expect_same_meaning(hostile, meaning, "and window_right INT64_MAX, ALiBi slope 0");
  // ... and with a window of INT64_MAX, query i sees keys i - 2 on: exactly a window of 2 at
  // query offset 0.
  hostile = {};
  hostile.query_offset = kMax - 2;
  hostile.window = kMax;
  meaning.window = 2;
  expect_same_meaning(hostile, meaning, "query_offset INT64_MAX - 2, window INT64_MAX");
  meaning = {};
  // Queries far before every key see none of them: zero rows, on every path.
  hostile = {};
  hostile.causal = attn::Causal::TopLeft;
  hostile.query_offset = kMin + 1;
  for (const Index n : {1, 6, 80}) {
    const F Q = random_matrix<F>(n, 16, 1);
    const F K = random_matrix<F>(80, 16, 2);
    const F V = random_matrix<F>(80, 8, 3);
    EXPECT_EQ(attn::flash_attention(Q, K, V, hostile).cwiseAbs().maxCoeff(), 0.0f);
    EXPECT_EQ(attn::scaled_dot_product_attention(Q, K, V, hostile).cwiseAbs().maxCoeff(), 0.0f);
  }
}

TEST(HostilePositions, CacheWithAnUnboundedWindow) {
  const F K = random_matrix<F>(20, 8, 4);
  const F V = random_matrix<F>(20, 8, 5);
  const F Q = random_matrix<F>(1, 8, 6);
  for (const Index window : {kMax, kMax - 1, Index(1) << 40}) {
    SCOPED_TRACE(window);
    attn::KVCache<float> hostile(8, 8, window);
    attn::KVCache<float> plain(8, 8);
    for (Index t = 0; t < 20; ++t) {  // one token at a time, as a decoder does
      hostile.append(K.row(t), V.row(t));
      plain.append(K.row(t), V.row(t));
      // The ring grows with the sequence: never more than twice what has come, stored twice.
      EXPECT_LE(hostile.capacity(), 2 * 2 * (t + 1));
    }
    EXPECT_TRUE(attn_test::identical(hostile.attend(Q), plain.attend(Q)));
    attn::AttentionOptions<float> far;
    far.query_offset = kMax - 1;  // a query after every key: its window reaches them or not
    if (window >= kMax - 1) {
      EXPECT_TRUE(attn_test::near(hostile.attend(Q, far), plain.attend(Q), 1e-6, 1e-5));
    } else {
      EXPECT_EQ(hostile.attend(Q, far).cwiseAbs().maxCoeff(), 0.0f);
    }
  }
}

TEST(HostilePositions, LongWindowCostsNothingUntilTokensCome) {
  // The case: a window of 131,072 with d = 128 and 8 key/value heads reserved about
  // 2.1 GB at the first token.
  attn::KVCacheConfig<float> config;
  config.d_k = config.d_v = 128;
  config.kv_heads = 8;
  config.window = 131072;
  attn::KVCache<float> cache(config);
  cache.append(random_matrix<F>(1, 8 * 128, 7), random_matrix<F>(1, 8 * 128, 8));
  EXPECT_LE(cache.bytes(), 2 * attn::KVCache<float>::bytes_for(config, 2));
  // Growth keeps the documented bound: pinned + 2 min(w + largest append, 2 rows appended).
  config.window = 6;
  config.pinned_tokens = 2;
  attn::KVCache<float> small(config);
  Index appended = 0, largest = 0;
  for (const Index r : {1, 1, 3, 1, 5, 2, 1, 1, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}) {
    small.append(random_matrix<F>(r, 8 * 128, unsigned(r)), random_matrix<F>(r, 8 * 128, 9));
    appended += r;
    largest = std::max(largest, r);
    EXPECT_LE(small.capacity(), 2 + 2 * std::min<Index>(6 + largest, 2 * appended));
    // Which rows are kept does not depend on the growth: the pinned ones, then the last
    // w + (largest append) rows, as with a ring of full length from the start.
    std::vector<Index> kept;
    for (Index p = 0; p < std::min<Index>(2, appended); ++p) kept.push_back(p);
    for (Index p = std::max<Index>(2, appended - (6 + largest)); p < appended; ++p) {
      kept.push_back(p);
    }
    EXPECT_EQ(small.key_positions(), kept) << "after " << appended << " rows";
  }
}

TEST(HostilePositions, CacheQueriesNearTheIndexLimit) {
  attn::KVCacheConfig<float> config;
  config.d_k = config.d_v = 8;
  config.rope = attn::RopeStyle::Half;
  attn::KVCache<float> cache(config);
  cache.append(random_matrix<F>(4, 8, 1), random_matrix<F>(4, 8, 2));
  attn::AttentionOptions<float> options;
  options.query_offset = kMax - 1;  // 2 queries at kMax - 1 and kMax: the second does not exist
  EXPECT_TRUE(refuses([&] { cache.attend(random_matrix<F>(2, 8, 3), options); }, "positions"));
}

TEST(HostilePositions, RopeAndLearnedTablesNearTheIndexLimit) {
  const F X = random_matrix<F>(3, 8, 1);
  EXPECT_TRUE(refuses([&] { (void)attn::rope(X, kMax - 1, attn::RopeStyle::Half); }, "offset"));
  const F Y = attn::rope(X, kMax - 3, attn::RopeStyle::Half);  // positions kMax - 3 .. kMax - 1
  EXPECT_TRUE(Y.allFinite());
  attn::LearnedPositionalEmbedding<float> table(16, 8);
  F Z = X;
  for (const Index offset : {kMax - 1, kMax, Index(15)}) {
    SCOPED_TRACE(offset);
    EXPECT_TRUE(refuses([&] { table.add_to(Z, offset); }, "outside the table"));
    EXPECT_TRUE(refuses([&] { (void)table.added(X, offset); }, "outside the table"));
    EXPECT_TRUE(refuses([&] { (void)table.table_gradient(X, offset); }, "outside the table"));
  }
  EXPECT_TRUE(attn_test::identical(Z, X));
}

TEST(HostileSizes, BytesForRefusesWhatDoesNotFit) {
  attn::KVCacheConfig<float> config;
  config.d_k = config.d_v = 128;
  config.kv_heads = 8;
  EXPECT_EQ(attn::KVCache<float>::bytes_for(config, 3), 3 * 8 * 256 * 4);
  EXPECT_TRUE(refuses([&] { (void)attn::KVCache<float>::bytes_for(config, Index(1) << 61); },
                      "KVCache::bytes_for"));
  EXPECT_TRUE(refuses([&] { (void)attn::KVCache<float>::bytes_for(config, -1); }, "tokens"));
}

TEST(HostileSizes, StorageThatCannotBeAllocatedIsAShapeError) {
  attn::KVCacheConfig<float> config;
  config.d_k = config.d_v = 64;
  config.window = 16;
  config.pinned_tokens = Index(1) << 40;  // 2^40 rows of 64 floats per head: 256 TiB
  EXPECT_TRUE(refuses([&] { attn::KVCache<float> cache(config); }, "cannot allocate"));
  config.pinned_tokens = Index(1) << 60;  // overflows the byte count
  EXPECT_TRUE(refuses([&] { attn::KVCache<float> cache(config); }, "does not fit"));
}

// ------------------------------------------------------------------------------------------------
// Extreme but finite inputs: the tiled path must not overflow where the materialised one does not.

TEST(HostileValues, ProductsBeyondFloatWithATinyScale) {
  // Entries near 1e19 and a scale of 1e-38: Q K^T overflows float (up to 16e38), the scaled
  // scores are 2..16.
  const Index d = 16;
  for (const Index n : {80, 300}) {
    SCOPED_TRACE(n);
    const F Q = random_matrix<F>(n, d, 11, 1e19);
    const F K = random_matrix<F>(n, d, 12, 1e19);
    const F V = random_matrix<F>(n, 8, 13);
    attn::AttentionOptions<float> options;
    options.scale = 1e-38f;
    for (const attn::Causal causal : {attn::Causal::None, attn::Causal::TopLeft}) {
      options.causal = causal;
      const F expected = attn::attention_with_weights(Q, K, V, options).output;
      ASSERT_TRUE(expected.allFinite());
      const F tiled = attn::flash_attention(Q, K, V, options);
      EXPECT_TRUE(tiled.allFinite());
      EXPECT_TRUE(attn_test::near(tiled, expected, 1e-5, 1e-4));
      attn::Vector<float> lse;
      EXPECT_TRUE(attn::flash_attention(Q, K, V, options, lse).allFinite());
      EXPECT_TRUE(lse.allFinite());
      EXPECT_TRUE(attn_test::near(attn::scaled_dot_product_attention(Q, K, V, options), expected,
                                  1e-5, 1e-4));
    }
  }
}

// A NaN beside such products: the guard's scan must not let the NaN hide the other entries'
// magnitude (found by the fuzzer: Q = [NaN; -1.49e154], K = 1.34e154, scale 2.8e-309 gave row 1
// zero instead of V). The NaN row stays NaN; the other rows are the materialised path's. Also with
// the NaN in K and in bfloat16 keys.
TEST(HostileValues, ANaNDoesNotHideAProductBeyondTheRange) {
  {
    attn::Matrix<double> Q(2, 1), K(1, 1), V(1, 1);
    Q << std::nan(""), -1.490024623305252e+154;
    K << 1.3407807929942597e+154;
    V << 15.75;
    attn::AttentionOptions<double> options;
    options.scale = 2.7813423231340017e-309;
    const attn::Matrix<double> out = attn::flash_attention(Q, K, V, options);
    EXPECT_TRUE(std::isnan(out(0, 0)));
    EXPECT_EQ(out(1, 0), 15.75);
  }
  const Index d = 16;
  F Q = random_matrix<F>(40, d, 21, 1e19);
  F K = random_matrix<F>(60, d, 22, 1e19);
  const F V = random_matrix<F>(60, 8, 23);
  attn::AttentionOptions<float> options;
  options.scale = 1e-38f;
  Q(0, 3) = std::nanf("");
  K(59, 0) = std::nanf("");  // a key every row sees: every row NaN ...
  F tiled = attn::flash_attention(Q, K, V, options);
  EXPECT_TRUE(tiled.array().isNaN().all());
  K(59, 0) = 1.0f;  // ... and without it only row 0
  const F expected = attn::attention_with_weights(Q, K, V, options).output;
  tiled = attn::flash_attention(Q, K, V, options);
  EXPECT_TRUE(tiled.row(0).array().isNaN().all());
  EXPECT_TRUE(attn_test::near(tiled.bottomRows(39), expected.bottomRows(39), 1e-5, 1e-4));
  using Rows = Eigen::Matrix<Eigen::bfloat16, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Rows K16 = K.cast<Eigen::bfloat16>();
  K16(10, 2) = Eigen::bfloat16(std::nanf(""));
  attn::AttentionOptions<float> masked = options;  // no row may see key 10: the NaN stays out
  masked.mask = attn::Mask::Constant(40, 60, true);
  masked.mask->col(10).setConstant(false);
  Q(0, 3) = 1.0f;
  const F want = attn::attention_with_weights(Q, F(K16.cast<float>()), V, masked).output;
  ASSERT_TRUE(want.allFinite());
  const Rows V16 = V.cast<Eigen::bfloat16>();
  EXPECT_TRUE(attn_test::near(
      attn::flash_attention(Q, K16, V16, masked),
      attn::attention_with_weights(Q, F(K16.cast<float>()), F(V16.cast<float>()), masked).output,
      1e-5, 1e-4));
}

// ------------------------------------------------------------------------------------------------
// The ONNX adapter on shapes a model file may hold.

attn::onnx::Tensor<float> tensor(std::vector<Index> shape) {
  attn::onnx::Tensor<float> t;
  t.shape = std::move(shape);
  Index count = 1;
  for (const Index e : t.shape) count *= e;
  t.data.assign(static_cast<std::size_t>(count), 0.5f);
  return t;
}

TEST(HostileOnnx, OverflowingShapesAreShapeErrors) {
  attn::onnx::Inputs<float> in;
  in.Q = tensor({1, 2, 3, 4});
  in.K = tensor({1, 2, 5, 4});
  in.V = tensor({1, 2, 5, 4});
  attn::onnx::Inputs<float> bad = in;
  bad.Q.shape = {Index(1) << 40, Index(1) << 40, 3, 4};  // 2^80 x 12 elements
  EXPECT_TRUE(refuses([&] { attn::onnx::attention(bad); }, "Q has shape"));
  EXPECT_TRUE(refuses([&] { attn::onnx::output_shapes(bad); }, "Q has shape"));
  bad.Q.shape = {Index(1) << 40, Index(1) << 40, 0, 4};  // no element, but 2^80 (b, h)
  EXPECT_TRUE(refuses([&] { attn::onnx::attention(bad); }, "Q has shape"));
  bad.Q.shape = {1, -2, 3, 4};
  EXPECT_TRUE(refuses([&] { attn::onnx::attention(bad); }, "negative"));
  bad = in;  // V with no position but a head size whose Y overflows
  bad.Q = tensor({1, 0, 3});
  bad.K = tensor({1, 0, 1});
  bad.V.shape = {1, 0, kMax / 2};
  bad.V.data.clear();
  attn::onnx::Attributes rank3;
  rank3.q_num_heads = 3;
  rank3.kv_num_heads = 1;
  EXPECT_TRUE(refuses([&] { attn::onnx::attention(bad, rank3); }, "Y's hidden size"));
  bad = in;  // a past whose length overflows past + kv
  bad.Q = tensor({0, 1, 3, 1});
  bad.K = tensor({0, 1, 5, 1});
  bad.V = tensor({0, 1, 5, 1});
  bad.past_key = tensor({0, 1, kMax, 1});
  bad.past_value = tensor({0, 1, kMax, 1});
  EXPECT_TRUE(refuses([&] { attn::onnx::attention(bad); }, "past + kv"));
  attn::onnx::Attributes scale;
  scale.scale = 1e300;  // finite as a double, infinite as a float
  EXPECT_TRUE(refuses([&] { attn::onnx::attention(in, scale); }, "attribute scale"));
  attn::onnx::Attributes softcap;
  softcap.softcap = 1e300;
  EXPECT_TRUE(refuses([&] { attn::onnx::attention(in, softcap); }, "attribute softcap"));
}

TEST(HostileOnnx, EmptyTensorsWithHugeAxesReturnAtOnce) {
  // 2^20 x 2^20 (batch, head) pairs with no query: nothing to compute, nothing to loop over.
  attn::onnx::Inputs<float> in;
  in.Q = tensor({Index(1) << 20, Index(1) << 20, 0, 4});
  in.K = tensor({Index(1) << 20, Index(1) << 20, 0, 4});
  in.V = tensor({Index(1) << 20, Index(1) << 20, 0, 4});
  const auto start = std::chrono::steady_clock::now();
  const attn::onnx::Outputs<float> out = attn::onnx::attention(in);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  EXPECT_EQ(out.Y.shape, (std::vector<Index>{Index(1) << 20, Index(1) << 20, 0, 4}));
  EXPECT_TRUE(out.Y.data.empty());
  ASSERT_TRUE(out.present_key.has_value());
  EXPECT_TRUE(out.present_key->data.empty());
}

TEST(HostileOnnx, WindowAttributesOfAnySizeMeanUnbounded) {
  attn::onnx::Inputs<float> in;
  in.Q = tensor({1, 2, 6, 4});
  in.K = tensor({1, 2, 9, 4});
  in.V = tensor({1, 2, 9, 4});
  in.Q.data = std::vector<float>(in.Q.data.size());
  for (std::size_t i = 0; i < in.Q.data.size(); ++i) in.Q.data[i] = float(i % 7) * 0.3f - 1.0f;
  for (std::size_t i = 0; i < in.K.data.size(); ++i) in.K.data[i] = float(i % 5) * 0.4f - 0.9f;
  for (std::size_t i = 0; i < in.V.data.size(); ++i) in.V.data[i] = float(i % 11) * 0.2f;
  attn::onnx::Attributes unbounded, huge;
  huge.left_window_size = kMax;
  huge.right_window_size = kMax;
  const std::vector<float> expected = attn::onnx::attention(in, unbounded).Y.data;
  EXPECT_EQ(attn::onnx::attention(in, huge).Y.data, expected);
  unbounded.is_causal = huge.is_causal = 1;
  EXPECT_EQ(attn::onnx::attention(in, huge).Y.data, attn::onnx::attention(in, unbounded).Y.data);
}

TEST(HostileOnnx, OutputShapesAreWhatAttentionReturns) {
  attn::onnx::Inputs<float> in;
  in.Q = tensor({2, 3, 12});
  in.K = tensor({2, 5, 4});
  in.V = tensor({2, 5, 6});
  in.past_key = tensor({2, 1, 4, 4});
  in.past_value = tensor({2, 1, 4, 6});
  attn::onnx::Attributes a;
  a.q_num_heads = 3;
  a.kv_num_heads = 1;
  const attn::onnx::OutputRequest request{true, true};
  const attn::onnx::OutputShapes shapes = attn::onnx::output_shapes(in, a, request);
  const attn::onnx::Outputs<float> out = attn::onnx::attention(in, a, request);
  EXPECT_EQ(shapes.Y, out.Y.shape);
  EXPECT_EQ(shapes.Y, (std::vector<Index>{2, 3, 18}));
  EXPECT_EQ(shapes.present_key, out.present_key->shape);
  EXPECT_EQ(shapes.present_value, (std::vector<Index>{2, 1, 9, 6}));
  EXPECT_EQ(shapes.qk_matmul_output, out.qk_matmul_output->shape);
  EXPECT_EQ(shapes.qk_matmul_output, (std::vector<Index>{2, 3, 3, 9}));
}

}  // namespace
