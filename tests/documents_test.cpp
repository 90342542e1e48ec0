/// The two teaching documents' worked examples, number by number (/work/shared/seeds):
/// 1. "Self-Attention - Concept, Step-by-Step Example": three tokens with Q = K, d_k = 2, every
///    intermediate table printed to 4 decimals.
/// 2. "Self-Attention in Transformers: Explained Visually": the "I love AI" NumPy example, weights
///    and outputs printed to 2 decimals.
/// The expected numbers are the documents' own, or computed independently in this file.

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <cmath>
#include <type_traits>

#include "test_support.hpp"

namespace {

using attn::Index;
using attn_test::LMatrix;
using attn_test::near;

/// Tolerance for a number printed with 4 decimals: one unit of the last printed digit.
constexpr double kUnit4 = 1e-4;

template <class T>
attn::Matrix<T> make(Index rows, Index cols, std::initializer_list<double> values) {
  attn::Matrix<T> M(rows, cols);
  auto it = values.begin();
  for (Index i = 0; i < rows; ++i) {
    for (Index j = 0; j < cols; ++j) M(i, j) = static_cast<T>(*it++);
  }
  return M;
}

LMatrix printed(Index rows, Index cols, std::initializer_list<double> values) {
  LMatrix M(rows, cols);
  auto it = values.begin();
  for (Index i = 0; i < rows; ++i) {
    for (Index j = 0; j < cols; ++j) M(i, j) = static_cast<long double>(*it++);
  }
  return M;
}

/// `M` with every entry rounded to `decimals` decimals, half to even (what NumPy's `round` does).
template <class D>
LMatrix rounded(const Eigen::MatrixBase<D>& M, int decimals) {
  const long double factor = std::pow(10.0L, decimals);
  LMatrix R = attn_test::to_long_double(M);
  for (Index i = 0; i < R.rows(); ++i) {
    for (Index j = 0; j < R.cols(); ++j) R(i, j) = std::nearbyint(R(i, j) * factor) / factor;
  }
  return R;
}

// ------------------------------------------------------------------------------------------------
// Document 1: three tokens, Q = K = [[1,0],[0,1],[1,1]], V = [[1,0],[0,1],[0.5,0.5]], d_k = 2.
// ------------------------------------------------------------------------------------------------

template <class T>
class FirstDocument : public ::testing::Test {
 protected:
  attn::Matrix<T> Q = make<T>(3, 2, {1, 0, 0, 1, 1, 1});
  attn::Matrix<T> K = Q;  // the document uses the same vectors for Q and K
  attn::Matrix<T> V = make<T>(3, 2, {1, 0, 0, 1, 0.5, 0.5});

  // The document's printed tables (4 decimals).
  LMatrix raw = printed(3, 3, {1, 0, 1, 0, 1, 1, 1, 1, 2});
  LMatrix scaled = printed(3, 3, {0.7071, 0, 0.7071, 0, 0.7071, 0.7071, 0.7071, 0.7071, 1.4142});
  LMatrix exps = printed(3, 3, {2.0281, 1, 2.0281, 1, 2.0281, 2.0281, 2.0281, 2.0281, 4.1133});
  LMatrix sums = printed(3, 1, {5.0562, 5.0562, 8.1695});
  LMatrix weights =
      printed(3, 3, {0.4011, 0.1978, 0.4011, 0.1978, 0.4011, 0.4011, 0.2482, 0.2482, 0.5035});
  LMatrix output = printed(3, 2, {0.6017, 0.3983, 0.3983, 0.6017, 0.5000, 0.5000});
};
TYPED_TEST_SUITE(FirstDocument, attn_test::ScalarTypes);

TYPED_TEST(FirstDocument, TraceReproducesEveryPrintedTable) {
  using T = TypeParam;
  const attn::AttentionTrace<T> trace = attn::trace_attention(this->Q, this->K, this->V);

  // Raw scores are small integers: exact.
  EXPECT_TRUE(attn_test::identical(trace.scores, this->raw.template cast<T>()));
  // Scaled by 1/sqrt(2).
  EXPECT_TRUE(near(trace.scaled, this->scaled, 0, kUnit4));
  // No options: nothing is masked.
  EXPECT_TRUE(attn_test::identical(trace.masked, trace.scaled));
  // The row maxima are the largest scaled scores: 0.7071, 0.7071, 1.4142.
  EXPECT_TRUE(near(trace.row_max, printed(3, 1, {0.7071, 0.7071, 1.4142}), 0, kUnit4));

  // The document's e^x are exponentials of the *unshifted* scaled scores (e^0.7071 = 2.0281,
  // e^0 = 1, e^1.4142 = 4.1133). The trace keeps the stable, max-shifted ones,
  // exp(i, j) = e^(masked(i, j) - row_max(i)), so the document's table is exp(i, j) * e^row_max(i),
  // and equally e^scaled(i, j) computed directly. Both must print as the document does.
  LMatrix unshifted(3, 3);
  LMatrix direct(3, 3);
  for (Index i = 0; i < 3; ++i) {
    for (Index j = 0; j < 3; ++j) {
      unshifted(i, j) = static_cast<long double>(trace.exp(i, j)) *
                        std::exp(static_cast<long double>(trace.row_max(i)));
      direct(i, j) = std::exp(static_cast<long double>(trace.scaled(i, j)));
    }
  }
  EXPECT_TRUE(near(unshifted, this->exps, 0, kUnit4));
  EXPECT_TRUE(near(direct, this->exps, 0, kUnit4));
  // The shifted exponential of each row's maximum is exactly e^0 = 1.
  EXPECT_EQ(trace.exp(0, 0), T(1));
  EXPECT_EQ(trace.exp(1, 1), T(1));
  EXPECT_EQ(trace.exp(2, 2), T(1));

  // Likewise the document's row sums are of unshifted exponentials: row_sum(i) * e^row_max(i).
  LMatrix document_sums(3, 1);
  for (Index i = 0; i < 3; ++i) {
    document_sums(i, 0) = static_cast<long double>(trace.row_sum(i)) *
                          std::exp(static_cast<long double>(trace.row_max(i)));
  }
  EXPECT_TRUE(near(document_sums, this->sums, 0, kUnit4));

  // Weights and output. The document prints 0.2482 for weights (3, 1) and (3, 2), whose exact value
  // is 2.02811 / 8.16948 = 0.248255 (it truncates; rounding gives 0.2483). 0.248255 is still within
  // one unit of the last printed digit of 0.2482 (0.000055 <= 0.0001), so the one-unit check holds
  // for every entry, that one included; the stricter rounding check of
  // FirstDocumentDouble.PrintedNumbersAreCorrectlyRounded exempts only it.
  EXPECT_TRUE(near(trace.weights, this->weights, 0, kUnit4));
  EXPECT_TRUE(near(trace.output, this->output, 0, kUnit4));

  // The public entry points print the same.
  EXPECT_TRUE(
      near(attn::scaled_dot_product_attention(this->Q, this->K, this->V), this->output, 0, kUnit4));
  const attn::Attention<T> result = attn::attention_with_weights(this->Q, this->K, this->V);
  EXPECT_TRUE(near(result.weights, this->weights, 0, kUnit4));
  EXPECT_TRUE(near(result.output, this->output, 0, kUnit4));
}

// In double, every printed number is moreover the correctly rounded value (within half a unit),
// except the document's truncated 0.2482, which rounds to 0.2483.
TEST(FirstDocumentDouble, PrintedNumbersAreCorrectlyRounded) {
  attn::Matrix<double> Q(3, 2);
  Q << 1, 0, 0, 1, 1, 1;
  attn::Matrix<double> V(3, 2);
  V << 1, 0, 0, 1, 0.5, 0.5;
  const attn::AttentionTrace<double> trace = attn::trace_attention(Q, Q, V);
  const double half = 0.5e-4;
  EXPECT_TRUE(near(rounded(trace.scaled, 4),
                   printed(3, 3, {0.7071, 0, 0.7071, 0, 0.7071, 0.7071, 0.7071, 0.7071, 1.4142}), 0,
                   1e-12));
  EXPECT_NEAR(std::exp(trace.scaled(0, 0)), 2.0281, half);
  EXPECT_NEAR(std::exp(trace.scaled(2, 2)), 4.1133, half);
  EXPECT_NEAR(trace.row_sum(0) * std::exp(trace.row_max(0)), 5.0562, half);
  EXPECT_NEAR(trace.row_sum(2) * std::exp(trace.row_max(2)), 8.1695, half);
  EXPECT_TRUE(near(rounded(trace.weights.topRows(2), 4),
                   printed(2, 3, {0.4011, 0.1978, 0.4011, 0.1978, 0.4011, 0.4011}), 0, 1e-12));
  EXPECT_NEAR(trace.weights(2, 2), 0.5035, half);
  // The document's 0.2482: exactly 0.248255..., so correctly rounded it is 0.2483.
  EXPECT_NEAR(trace.weights(2, 0), 0.248255, 1e-6);
  EXPECT_NEAR(trace.weights(2, 1), 0.248255, 1e-6);
  EXPECT_NEAR(trace.weights(2, 0), 0.2483, half);
  EXPECT_TRUE(near(rounded(trace.output, 4),
                   printed(3, 2, {0.6017, 0.3983, 0.3983, 0.6017, 0.5, 0.5}), 0, 1e-12));
}

// The causal variant (a decoder): token i sees tokens 1..i. Expected weights computed here from
// the scaled scores a = 1/sqrt(2): row 1 [1, 0, 0]; row 2 softmax([0, a]); row 3 softmax of the
// full row [a, a, 2a] (nothing of row 3 is in the future).
TYPED_TEST(FirstDocument, CausalVariant) {
  using T = TypeParam;
  attn::AttentionOptions<T> options;
  options.causal = attn::Causal::BottomRight;
  const long double a = 1.0L / std::sqrt(2.0L);

  LMatrix expected_weights = LMatrix::Zero(3, 3);
  expected_weights(0, 0) = 1;
  expected_weights(1, 0) = 1 / (1 + std::exp(a));
  expected_weights(1, 1) = std::exp(a) / (1 + std::exp(a));
  const long double sum3 = 2 * std::exp(a) + std::exp(2 * a);
  expected_weights(2, 0) = std::exp(a) / sum3;
  expected_weights(2, 1) = std::exp(a) / sum3;
  expected_weights(2, 2) = std::exp(2 * a) / sum3;
  const LMatrix expected_output = expected_weights * attn_test::to_long_double(this->V);

  const attn::AttentionTrace<T> trace = attn::trace_attention(this->Q, this->K, this->V, options);
  EXPECT_TRUE(attn_test::near_t<T>(trace.weights, expected_weights));
  EXPECT_TRUE(attn_test::near_t<T>(trace.output, expected_output));
  // The future is at -inf before the softmax and gets exactly zero weight.
  const T neg_inf = -std::numeric_limits<T>::infinity();
  EXPECT_EQ(trace.masked(0, 1), neg_inf);
  EXPECT_EQ(trace.masked(0, 2), neg_inf);
  EXPECT_EQ(trace.masked(1, 2), neg_inf);
  EXPECT_EQ(trace.exp(0, 1), T(0));
  EXPECT_EQ(trace.weights(0, 2), T(0));
  EXPECT_EQ(trace.weights(1, 2), T(0));
  EXPECT_EQ(trace.weights(0, 0), T(1));  // the first token has only itself
  // Row 3 sees everything, so it equals the document's non-causal row 3.
  EXPECT_TRUE(near(trace.weights.row(2), printed(1, 3, {0.2482, 0.2482, 0.5035}), 0, kUnit4));

  const attn::Attention<T> result =
      attn::attention_with_weights(this->Q, this->K, this->V, options);
  EXPECT_TRUE(attn_test::near_t<T>(result.weights, expected_weights));
  EXPECT_TRUE(attn_test::near_t<T>(result.output, expected_output));
  EXPECT_TRUE(attn_test::near_t<T>(
      attn::scaled_dot_product_attention(this->Q, this->K, this->V, options), expected_output));
}

// ------------------------------------------------------------------------------------------------
// Document 2: "I love AI" in NumPy.
// ------------------------------------------------------------------------------------------------

template <class T>
class SecondDocument : public ::testing::Test {
 protected:
  attn::Matrix<T> X = make<T>(3, 4,
                              {1, 0, 1, 0,    // "I"
                               0, 2, 0, 1,    // "love"
                               1, 1, 1, 1});  // "AI"
  attn::Matrix<T> W_q = make<T>(4, 2, {1, 0, 0, 1, 1, 0, 0, 1});
  attn::Matrix<T> W_k = make<T>(4, 2, {0, 1, 1, 0, 0, 1, 1, 0});
  attn::Matrix<T> W_v = make<T>(4, 2, {1, 0, 0, 1, 1, 1, 0, 0});
};
TYPED_TEST_SUITE(SecondDocument, attn_test::ScalarTypes);

TYPED_TEST(SecondDocument, ProjectionsAreExact) {
  using T = TypeParam;
  const attn::QKV<T> qkv = attn::project_qkv(this->X, this->W_q, this->W_k, this->W_v);
  // Small integers: every product is exact, so equality is bitwise.
  EXPECT_TRUE(
      attn_test::identical(qkv.Q, attn_test::naive_product(this->X, this->W_q).template cast<T>()));
  EXPECT_TRUE(
      attn_test::identical(qkv.K, attn_test::naive_product(this->X, this->W_k).template cast<T>()));
  EXPECT_TRUE(
      attn_test::identical(qkv.V, attn_test::naive_product(this->X, this->W_v).template cast<T>()));
  // And by hand: "I" = e1 + e3, "love" = 2 e2 + e4, "AI" = e1 + e2 + e3 + e4.
  EXPECT_TRUE(attn_test::identical(qkv.Q, make<T>(3, 2, {2, 0, 0, 3, 2, 2})));
  EXPECT_TRUE(attn_test::identical(qkv.K, make<T>(3, 2, {0, 2, 3, 0, 2, 2})));
  EXPECT_TRUE(attn_test::identical(qkv.V, make<T>(3, 2, {2, 1, 0, 2, 2, 2})));
}

TYPED_TEST(SecondDocument, WeightsAndOutputAsPrinted) {
  using T = TypeParam;
  const attn::QKV<T> qkv = attn::project_qkv(this->X, this->W_q, this->W_k, this->W_v);
  const attn::Attention<T> result = attn::attention_with_weights(qkv.Q, qkv.K, qkv.V);
  // weights.round(2) and output.round(2), as NumPy printed them.
  EXPECT_TRUE(near(rounded(result.weights, 2),
                   printed(3, 3, {0.01, 0.8, 0.19, 0.5, 0.01, 0.5, 0.05, 0.19, 0.77}), 0, 1e-9));
  EXPECT_TRUE(
      near(rounded(result.output, 2), printed(3, 2, {0.41, 1.99, 1.99, 1.5, 1.63, 1.95}), 0, 1e-9));
  const attn::AttentionTrace<T> trace = attn::trace_attention(qkv.Q, qkv.K, qkv.V);
  EXPECT_TRUE(
      near(rounded(trace.output, 2), printed(3, 2, {0.41, 1.99, 1.99, 1.5, 1.63, 1.95}), 0, 1e-9));
}

TYPED_TEST(SecondDocument, FullPrecisionAgainstNaiveLoops) {
  using T = TypeParam;
  const attn::QKV<T> qkv = attn::project_qkv(this->X, this->W_q, this->W_k, this->W_v);
  const attn_test::NaiveAttention expected = attn_test::naive_attention<T>(qkv.Q, qkv.K, qkv.V);
  const attn::Attention<T> result = attn::attention_with_weights(qkv.Q, qkv.K, qkv.V);
  const attn::Matrix<T> output = attn::scaled_dot_product_attention(qkv.Q, qkv.K, qkv.V);
  if constexpr (std::is_same_v<T, double>) {
    EXPECT_TRUE(near(result.weights, expected.weights, 0, 1e-12));
    EXPECT_TRUE(near(result.output, expected.output, 0, 1e-12));
    EXPECT_TRUE(near(output, expected.output, 0, 1e-12));
  } else {
    EXPECT_TRUE(attn_test::near_t<T>(result.weights, expected.weights));
    EXPECT_TRUE(attn_test::near_t<T>(result.output, expected.output));
    EXPECT_TRUE(attn_test::near_t<T>(output, expected.output));
  }
}

}  // namespace
