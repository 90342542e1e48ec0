/// positional.hpp: sinusoidal encodings, learned positions and the ALiBi slopes; per-head slopes
/// and sinks of multi_head.hpp. (RoPE and YaRN, rope.hpp: rope_test.cpp.)
/// - the PyTorch float64 reference case tests/data/sinusoidal.json, through API.md's call;
/// - the Marian/BART and tensor2tensor/fairseq layouts and odd widths against independent long
///   double loops written from the published formulas;
/// - learned positions: the rows added, writable blocks, positions past the table; the table's
///   gradient (`table_gradient`, `accumulate_table_gradient`) by value, summed over calls, into
///   blocks, against `attn::gradcheck` in double (with dX = dY), and its errors;
/// - ALiBi slopes for H = 8 and 12 from the formulas; per-head slopes and sinks in
///   `attention_heads` and `MultiHeadAttention::forward` against per-head naive attention.

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <attn/gradcheck.hpp>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <random>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Index;
using attn_test::LMatrix;

using attn_test::expect_shape_error;

template <class T>
class Positional : public ::testing::Test {};
TYPED_TEST_SUITE(Positional, attn_test::ScalarTypes);

// ------------------------------------------------------------------------------------------------
// Sinusoidal
// ------------------------------------------------------------------------------------------------

TYPED_TEST(Positional, SinusoidalReferenceCase) {
  using T = TypeParam;
  const attn_test::Case c = attn_test::load_case("sinusoidal");
  const Index max_len = c.params().at("max_len").get<Index>();
  const Index d_model = c.params().at("d_model").get<Index>();
  const attn::Matrix<T> PE = attn::sinusoidal_encoding<T>(max_len, d_model);
  EXPECT_TRUE(attn_test::near_t<T>(PE, c.expected<double>("PE")));
}

TYPED_TEST(Positional, SinusoidalOddWidthFollowsTheFormula) {
  using T = TypeParam;
  for (const Index d : {Index(1), Index(7), Index(16)}) {
    LMatrix expected(20, d);
    for (Index p = 0; p < 20; ++p) {
      for (Index j = 0; j < d; ++j) {  // PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos
        const long double angle =
            static_cast<long double>(p) /
            std::pow(10000.0L, static_cast<long double>(j - j % 2) / static_cast<long double>(d));
        expected(p, j) = j % 2 == 0 ? std::sin(angle) : std::cos(angle);
      }
    }
    EXPECT_TRUE(attn_test::near_t<T>(attn::sinusoidal_encoding<T>(20, d), expected)) << "d " << d;
  }
}

TYPED_TEST(Positional, SinusoidalConcatenatedIsMarianLayout) {
  using T = TypeParam;
  for (const Index d : {Index(8), Index(9)}) {
    // Hugging Face MarianSinusoidalPositionalEmbedding._init_weight, literally:
    // position_enc[p, j] = p / 10000^(2 (j // 2) / d); sentinel = ceil(d / 2);
    // out[:, :sentinel] = sin(position_enc[:, 0::2]);
    // out[:, sentinel:] = cos(position_enc[:, 1::2])
    const Index sentinel = d % 2 == 0 ? d / 2 : d / 2 + 1;
    LMatrix expected(11, d);
    for (Index p = 0; p < 11; ++p) {
      const auto enc = [&](Index j) {
        return static_cast<long double>(p) /
               std::pow(10000.0L,
                        static_cast<long double>(2 * (j / 2)) / static_cast<long double>(d));
      };
      Index col = 0;
      for (Index j = 0; j < d; j += 2) expected(p, col++) = std::sin(enc(j));
      EXPECT_EQ(col, sentinel);
      for (Index j = 1; j < d; j += 2) expected(p, col++) = std::cos(enc(j));
    }
    EXPECT_TRUE(attn_test::near_t<T>(attn::sinusoidal_encoding_concatenated<T>(11, d), expected))
        << "d " << d;
  }
}

TYPED_TEST(Positional, SinusoidalTensor2TensorIsFairseqLayout) {
  using T = TypeParam;
  for (const Index d : {Index(10), Index(9)}) {
    // fairseq SinusoidalPositionalEmbedding.get_embedding: half = d // 2,
    // f_k = exp(-k log(10000) / (half - 1)), [sin(p f) | cos(p f)], zero column if d is odd.
    const Index half = d / 2;
    LMatrix expected = LMatrix::Zero(12, d);
    for (Index p = 0; p < 12; ++p) {
      for (Index k = 0; k < half; ++k) {
        const long double f = std::exp(-static_cast<long double>(k) * std::log(10000.0L) /
                                       static_cast<long double>(half - 1));
        expected(p, k) = std::sin(static_cast<long double>(p) * f);
        expected(p, half + k) = std::cos(static_cast<long double>(p) * f);
      }
    }
    EXPECT_TRUE(attn_test::near_t<T>(attn::sinusoidal_encoding_tensor2tensor<T>(12, d), expected))
        << "d " << d;
  }
}

TEST(PositionalErrors, SinusoidalBadSizes) {
  expect_shape_error([] { attn::sinusoidal_encoding<float>(-1, 4); },
                     {"sinusoidal_encoding", "max_len", "-1"});
  expect_shape_error([] { attn::sinusoidal_encoding<float>(4, 0); }, {"d_model", "0"});
  expect_shape_error([] { attn::sinusoidal_encoding_tensor2tensor<double>(4, 0); },
                     {"sinusoidal_encoding_tensor2tensor", "d_model"});
}

// ------------------------------------------------------------------------------------------------
// Learned
// ------------------------------------------------------------------------------------------------

TYPED_TEST(Positional, LearnedAddsTheRowsOfItsPositions) {
  using T = TypeParam;
  std::mt19937 rng(5);
  const attn::Matrix<T> table = attn_test::random_matrix<T>(10, 4, rng);
  const attn::LearnedPositionalEmbedding<T> embedding(table);
  EXPECT_EQ(embedding.max_len(), 10);
  EXPECT_EQ(embedding.d_model(), 4);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(3, 4, rng);
  attn::Matrix<T> Y = X;
  embedding.add_to(Y, 6);
  for (Index r = 0; r < 3; ++r) {
    for (Index c = 0; c < 4; ++c) EXPECT_EQ(Y(r, c), X(r, c) + table(6 + r, c));
  }
  EXPECT_TRUE(attn_test::identical(embedding.added(X, 6), Y));
  attn::Matrix<T> Z = attn::Matrix<T>::Zero(5, 4);
  embedding.add_to(Z.middleRows(1, 2), 0);  // a writable block
  EXPECT_TRUE(attn_test::identical(Z.middleRows(1, 2), table.topRows(2)));
  EXPECT_TRUE(attn_test::all_zero(Z.row(0)));
}

TEST(PositionalErrors, LearnedPastMaxLen) {
  const attn::LearnedPositionalEmbedding<float> embedding(8, 4);
  attn::Matrix<float> X = attn::Matrix<float>::Zero(3, 4);
  expect_shape_error([&] { embedding.add_to(X, 6); },
                     {"LearnedPositionalEmbedding::add_to", "6 .. 8", "0 .. 7", "3 x 4", "8 x 4"});
  expect_shape_error([&] { embedding.add_to(X, -1); }, {"-1"});
  attn::Matrix<float> W = attn::Matrix<float>::Zero(3, 5);
  expect_shape_error([&] { embedding.add_to(W, 0); }, {"5 columns", "4", "3 x 5", "8 x 4"});
  expect_shape_error([] { attn::LearnedPositionalEmbedding<float>(0, 4); }, {"max_len"});
}

TYPED_TEST(Positional, LearnedTableGradientIsDYAtItsPositions) {
  using T = TypeParam;
  std::mt19937 rng(67);
  const attn::LearnedPositionalEmbedding<T> embedding(attn_test::random_matrix<T>(10, 4, rng));
  const attn::Matrix<T> dY = attn_test::random_matrix<T>(3, 4, rng);
  const attn::Matrix<T> dtable = embedding.table_gradient(dY, 6);
  ASSERT_EQ(dtable.rows(), 10);
  ASSERT_EQ(dtable.cols(), 4);
  EXPECT_TRUE(attn_test::identical(dtable.middleRows(6, 3), dY));
  EXPECT_TRUE(attn_test::all_zero(dtable.topRows(6)));
  EXPECT_TRUE(attn_test::all_zero(dtable.bottomRows(1)));
  EXPECT_TRUE(attn_test::identical(embedding.table_gradient(dY), [&] {
    attn::Matrix<T> at_zero = attn::Matrix<T>::Zero(10, 4);
    at_zero.topRows(3) = dY;
    return at_zero;
  }()));

  // Two calls of one step, overlapping at position 6: their gradients add.
  const attn::Matrix<T> dY2 = attn_test::random_matrix<T>(4, 4, rng);
  attn::Matrix<T> sum = attn::Matrix<T>::Zero(10, 4);
  embedding.accumulate_table_gradient(dY, 6, sum);
  embedding.accumulate_table_gradient(dY2, 3, sum);
  const attn::Matrix<T> expected = dtable + embedding.table_gradient(dY2, 3);
  EXPECT_TRUE(attn_test::identical(sum, expected));
  EXPECT_EQ(sum(6, 1), dY(0, 1) + dY2(3, 1));
  // Into a block of a larger buffer (a temporary expression), and into a column-major matrix.
  attn::Matrix<T> buffer = attn::Matrix<T>::Zero(10, 7);
  embedding.accumulate_table_gradient(dY, 6, buffer.middleCols(2, 4));
  embedding.accumulate_table_gradient(dY2, 3, buffer.middleCols(2, 4));
  EXPECT_TRUE(attn_test::identical(buffer.middleCols(2, 4), expected));
  EXPECT_TRUE(attn_test::all_zero(buffer.leftCols(2)));
  EXPECT_TRUE(attn_test::all_zero(buffer.rightCols(1)));
  Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> column_major =
      Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>::Zero(10, 4);
  embedding.accumulate_table_gradient(dY, 6, column_major);
  EXPECT_TRUE(attn_test::identical(attn::Matrix<T>(column_major), dtable));
}

TEST(LearnedPositionalGradient, GradcheckOfTheTableAndX) {
  // loss = sum(sin(X + table rows [offset, offset + n)) o G): dY = G o cos(Y), d table as
  // table_gradient(dY, offset), dX = dY.
  std::mt19937 rng(71);
  std::uniform_int_distribution<Index> size(1, 6);
  for (int trial = 0; trial < 4; ++trial) {
    const Index max_len = size(rng) + 2;
    const Index d_model = size(rng);
    const Index n = std::uniform_int_distribution<Index>(1, max_len)(rng);
    const Index offset = std::uniform_int_distribution<Index>(0, max_len - n)(rng);
    const std::vector<attn::Matrix<double>> inputs = {
        attn_test::random_matrix<double>(max_len, d_model, rng),
        attn_test::random_matrix<double>(n, d_model, rng)};
    const attn::Matrix<double> G = attn_test::random_matrix<double>(n, d_model, rng);
    const auto loss = [&](const std::vector<attn::Matrix<double>>& in) {
      const attn::LearnedPositionalEmbedding<double> embedding(in[0]);
      return embedding.added(in[1], offset).array().sin().cwiseProduct(G.array()).sum();
    };
    const attn::LearnedPositionalEmbedding<double> embedding(inputs[0]);
    const attn::Matrix<double> dY =
        embedding.added(inputs[1], offset).array().cos().cwiseProduct(G.array()).matrix();
    const attn::GradcheckResult result =
        attn::gradcheck(loss, inputs, {embedding.table_gradient(dY, offset), dY});
    EXPECT_TRUE(result) << max_len << " x " << d_model << ", n " << n << ", offset " << offset
                        << ": " << result.message;
  }
}

TEST(PositionalErrors, LearnedGradientBadArguments) {
  const attn::LearnedPositionalEmbedding<float> embedding(8, 4);
  const attn::Matrix<float> dY = attn::Matrix<float>::Zero(3, 4);
  expect_shape_error(
      [&] { embedding.table_gradient(dY, 6); },
      {"LearnedPositionalEmbedding::table_gradient", "6 .. 8", "0 .. 7", "dY is 3 x 4", "8 x 4"});
  expect_shape_error([&] { embedding.table_gradient(dY, -1); }, {"table_gradient", "-1"});
  const attn::Matrix<float> wide = attn::Matrix<float>::Zero(3, 5);
  expect_shape_error([&] { embedding.table_gradient(wide); },
                     {"table_gradient", "dY has 5 columns", "dY is 3 x 5", "8 x 4"});
  attn::Matrix<float> dtable = attn::Matrix<float>::Zero(8, 4);
  expect_shape_error([&] { embedding.accumulate_table_gradient(dY, 7, dtable); },
                     {"LearnedPositionalEmbedding::accumulate_table_gradient", "7 .. 9"});
  expect_shape_error([&] { embedding.accumulate_table_gradient(wide, 0, dtable); },
                     {"accumulate_table_gradient", "dY has 5 columns"});
  attn::Matrix<float> short_table = attn::Matrix<float>::Zero(7, 4);
  expect_shape_error([&] { embedding.accumulate_table_gradient(dY, 0, short_table); },
                     {"accumulate_table_gradient", "dtable is 7 x 4", "the table is 8 x 4"});
  EXPECT_TRUE(attn_test::all_zero(dtable));  // nothing was added before the checks threw
}

// ------------------------------------------------------------------------------------------------
// ALiBi slopes
// ------------------------------------------------------------------------------------------------

TEST(AlibiSlopes, PowerOfTwoHeads) {
  const std::vector<double> slopes = attn::alibi_slopes<double>(8);
  ASSERT_EQ(slopes.size(), 8u);
  for (std::size_t h = 0; h < 8; ++h) EXPECT_EQ(slopes[h], 1.0 / static_cast<double>(2 << h));
  EXPECT_EQ(attn::alibi_slopes<float>(1), std::vector<float>{1.0f / 256.0f});
}

TEST(AlibiSlopes, TwelveHeadsInterpolated) {
  // Press et al.'s get_slopes(12): get_slopes_power_of_2(8) + get_slopes_power_of_2(16)[0::2][:4].
  const std::vector<double> slopes = attn::alibi_slopes<double>(12);
  ASSERT_EQ(slopes.size(), 12u);
  for (std::size_t h = 0; h < 8; ++h) {
    EXPECT_DOUBLE_EQ(slopes[h], std::pow(2.0, -static_cast<double>(h + 1)));
  }
  const double sixteen[4] = {std::pow(2.0, -0.5), std::pow(2.0, -1.5), std::pow(2.0, -2.5),
                             std::pow(2.0, -3.5)};
  for (std::size_t k = 0; k < 4; ++k) EXPECT_DOUBLE_EQ(slopes[8 + k], sixteen[k]);
  expect_shape_error([] { attn::alibi_slopes<float>(0); }, {"alibi_slopes", "heads"});
}

// ------------------------------------------------------------------------------------------------
// Per-head slopes and sinks
// ------------------------------------------------------------------------------------------------

TYPED_TEST(Positional, AlibiPerHeadSlopesAndSinksInAttentionHeads) {
  using T = TypeParam;
  std::mt19937 rng(23);
  const Index heads = 4;
  const Index kv_heads = 2;
  const Index n = 5;
  const Index m = 9;
  attn::Tensor3<T> Q(heads, n, 6);
  attn::Tensor3<T> K(kv_heads, m, 6);
  attn::Tensor3<T> V(kv_heads, m, 3);
  for (Index h = 0; h < heads; ++h)
    attn::detail::slice(Q, h) = attn_test::random_matrix<T>(n, 6, rng);
  for (Index h = 0; h < kv_heads; ++h) {
    attn::detail::slice(K, h) = attn_test::random_matrix<T>(m, 6, rng);
    attn::detail::slice(V, h) = attn_test::random_matrix<T>(m, 3, rng);
  }
  attn::AttentionOptions<T> options;
  options.causal = attn::Causal::BottomRight;
  attn::HeadOptions<T> per_head;
  per_head.alibi_slopes = attn::alibi_slopes<T>(heads);
  per_head.sinks = std::vector<T>{T(0.5), T(-1), T(2), T(0)};
  const attn::Tensor3<T> out = attn::attention_heads(Q, K, V, options, per_head);
  for (Index h = 0; h < heads; ++h) {
    attn::AttentionOptions<T> single;
    single.causal = attn::Causal::BottomRight;
    single.alibi_slope = static_cast<T>(std::exp2(-8.0 * static_cast<double>(h + 1) / 4.0));
    single.sink = (*per_head.sinks)[static_cast<std::size_t>(h)];
    const Index kv = h / 2;
    const attn_test::NaiveAttention expected = attn_test::naive_attention<T>(
        attn::detail::slice(Q, h), attn::detail::slice(K, kv), attn::detail::slice(V, kv), single);
    EXPECT_TRUE(attn_test::near_t<T>(attn::detail::slice(out, h), expected.output)) << "head " << h;
  }
  per_head.sinks = std::vector<T>{T(0)};
  expect_shape_error([&] { attn::attention_heads(Q, K, V, options, per_head); },
                     {"attention_heads", "sinks has 1 entries", "4 query heads"});
  per_head.sinks.reset();
  options.alibi_slope = T(1);
  expect_shape_error([&] { attn::attention_heads(Q, K, V, options, per_head); },
                     {"alibi_slopes or alibi_slope"});
}

TYPED_TEST(Positional, AlibiPerHeadSlopesAndSinksInMultiHeadForward) {
  using T = TypeParam;
  attn::MultiHeadConfig config{12, 3};
  const attn::MultiHeadAttention<T> layer(config, 7);
  std::mt19937 rng(29);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(6, 12, rng);
  attn::MultiHeadOptions<T> options;
  options.causal = attn::Causal::BottomRight;
  options.per_head.alibi_slopes = attn::alibi_slopes<T>(3);  // 2^-4, 2^-8, then 2^-2 (of 4 heads)
  options.per_head.sinks = std::vector<T>{T(1), T(-2), T(0.25)};
  const attn::Matrix<T> out = layer.forward(X, options);

  const LMatrix Q = attn_test::naive_product(X, layer.W_Q);
  const LMatrix K = attn_test::naive_product(X, layer.W_K);
  const LMatrix V = attn_test::naive_product(X, layer.W_V);
  const double slopes[3] = {std::exp2(-4.0), std::exp2(-8.0), std::exp2(-2.0)};
  LMatrix concat(6, 12);
  for (Index h = 0; h < 3; ++h) {
    attn::AttentionOptions<long double> single;
    single.causal = attn::Causal::BottomRight;
    single.alibi_slope = static_cast<long double>(slopes[h]);
    single.sink = static_cast<long double>((*options.per_head.sinks)[static_cast<std::size_t>(h)]);
    concat.middleCols(h * 4, 4) =
        attn_test::naive_attention<long double>(Q.middleCols(h * 4, 4), K.middleCols(h * 4, 4),
                                                V.middleCols(h * 4, 4), single)
            .output;
  }
  const LMatrix expected = attn_test::naive_product(concat, layer.W_O);
  EXPECT_TRUE(
      attn_test::near(out, expected, 10 * attn_test::Tol<T>::rel, 10 * attn_test::Tol<T>::abs));
}

}  // namespace
