/// attention.hpp: `scaled_dot_product_attention`, `attention_with_weights` and `trace_attention`
/// with every option of the materialised path (mask, bias, window, scale, softcap, ALiBi, sink)
/// against the naive long double pipeline of test_support.hpp; and every public function fed
/// column-major matrices and Eigen expressions instead of row-major matrices.

#include <gtest/gtest.h>

#include <algorithm>
#include <attn/attn.hpp>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <utility>

#include "test_support.hpp"

namespace {

using attn::Causal;
using attn::Index;
using attn_test::LMatrix;

template <class T>
using ColMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

using attn_test::random_qkv;

/// Runs the three entry points on `x` with `options` and compares every result with the naive
/// long double pipeline.
template <class T>
void expect_matches_naive(const attn::QKV<T>& x, const attn::AttentionOptions<T>& options) {
  const attn_test::NaiveAttention expected = attn_test::naive_attention<T>(x.Q, x.K, x.V, options);
  const attn::Attention<T> result = attn::attention_with_weights(x.Q, x.K, x.V, options);
  EXPECT_TRUE(attn_test::near_t<T>(result.weights, expected.weights));
  EXPECT_TRUE(attn_test::near_t<T>(result.output, expected.output));
  EXPECT_TRUE(attn_test::near_t<T>(attn::scaled_dot_product_attention(x.Q, x.K, x.V, options),
                                   expected.output));
  const attn::AttentionTrace<T> trace = attn::trace_attention(x.Q, x.K, x.V, options);
  EXPECT_TRUE(attn_test::near_t<T>(trace.masked, expected.logits));
  EXPECT_TRUE(attn_test::near_t<T>(trace.weights, expected.weights));
  EXPECT_TRUE(attn_test::near_t<T>(trace.output, expected.output));
}

template <class T>
class Attention : public ::testing::Test {};
TYPED_TEST_SUITE(Attention, attn_test::ScalarTypes);

TYPED_TEST(Attention, PlainAgainstNaive) {
  using T = TypeParam;
  expect_matches_naive<T>(random_qkv<T>(6, 6, 8, 5, 41), {});
  expect_matches_naive<T>(random_qkv<T>(3, 11, 4, 2, 42), {});   // n < m
  expect_matches_naive<T>(random_qkv<T>(10, 2, 16, 3, 43), {});  // n > m
  expect_matches_naive<T>(random_qkv<T>(1, 1, 1, 1, 44), {});    // a single key: weight 1
}

TYPED_TEST(Attention, CausalWindowMaskBiasScaleAgainstNaive) {
  using T = TypeParam;
  for (const Causal align : {Causal::None, Causal::TopLeft, Causal::BottomRight}) {
    const std::pair<Index, Index> shapes[] = {{5, 5}, {3, 8}, {8, 3}};
    for (const auto& [n, m] : shapes) {
      SCOPED_TRACE(::testing::Message()
                   << "align " << static_cast<int>(align) << ", n " << n << ", m " << m);
      const attn::QKV<T> x = random_qkv<T>(n, m, 4, 3, 50);
      attn::AttentionOptions<T> options;
      options.causal = align;
      expect_matches_naive<T>(x, options);
      options.window = 2;
      expect_matches_naive<T>(x, options);
      options.scale = T(0.75);
      expect_matches_naive<T>(x, options);
      attn::Mask mask(n, m);
      for (Index i = 0; i < n; ++i) {
        for (Index j = 0; j < m; ++j) mask(i, j) = (i * 7 + j * 3) % 4 != 1;
      }
      options.mask = mask;
      std::mt19937 rng(51);
      options.bias = attn_test::random_matrix<T>(n, m, rng);
      expect_matches_naive<T>(x, options);
    }
  }
}

// softcap: scores become c * tanh(s / c), after scaling and before the bias.
TYPED_TEST(Attention, SoftcapAgainstNaive) {
  using T = TypeParam;
  const attn::QKV<T> x = random_qkv<T>(5, 7, 8, 3, 60);
  attn::AttentionOptions<T> options;
  options.scale = T(2);  // large scores, so that the cap really bends them
  options.softcap = T(1.5);
  expect_matches_naive<T>(x, options);
  const attn::AttentionTrace<T> trace = attn::trace_attention(x.Q, x.K, x.V, options);
  for (Index i = 0; i < trace.scaled.rows(); ++i) {
    for (Index j = 0; j < trace.scaled.cols(); ++j) {
      const long double s = 2.0L * static_cast<long double>(trace.scores(i, j));
      const long double capped = 1.5L * std::tanh(s / 1.5L);
      EXPECT_NEAR(static_cast<double>(trace.scaled(i, j)), static_cast<double>(capped),
                  attn_test::Tol<T>::rel * 4);
      EXPECT_LT(std::fabs(trace.scaled(i, j)), T(1.5));
    }
  }
  // The cap changes the result: without it the weights differ.
  attn::AttentionOptions<T> uncapped = options;
  uncapped.softcap.reset();
  EXPECT_FALSE(attn_test::near(attn::attention_with_weights(x.Q, x.K, x.V, uncapped).weights,
                               attn_test::naive_attention<T>(x.Q, x.K, x.V, options).weights, 1e-3,
                               1e-3));
  // With a bias too: the bias is added after the cap.
  std::mt19937 rng(61);
  options.bias = attn_test::random_matrix<T>(5, 7, rng, 3.0);
  options.causal = Causal::BottomRight;
  expect_matches_naive<T>(x, options);
}

// ALiBi: -slope * |i + shift - j| added to the scores.
TYPED_TEST(Attention, AlibiAgainstNaive) {
  using T = TypeParam;
  for (const Causal align : {Causal::None, Causal::BottomRight, Causal::TopLeft}) {
    const attn::QKV<T> x = random_qkv<T>(4, 9, 8, 3, 70);
    attn::AttentionOptions<T> options;
    options.causal = align;
    options.alibi_slope = T(0.5);
    expect_matches_naive<T>(x, options);
    // The trace shows the penalty directly: masked - scaled = -slope * |i + shift - j|.
    const attn::AttentionTrace<T> trace = attn::trace_attention(x.Q, x.K, x.V, options);
    const Index shift = align == Causal::BottomRight ? 5 : 0;
    for (Index i = 0; i < 4; ++i) {
      for (Index j = 0; j < 9; ++j) {
        if (!attn_test::naive_allowed(i, j, 4, 9, align, std::nullopt)) continue;
        const double penalty = -0.5 * static_cast<double>(std::abs(i + shift - j));
        EXPECT_NEAR(static_cast<double>(trace.masked(i, j) - trace.scaled(i, j)), penalty,
                    8 * attn_test::Tol<T>::rel)
            << "align " << static_cast<int>(align) << " at (" << i << ", " << j << ")";
      }
    }
  }
}

// The sink: exp(sink - max) joins each row's denominator, so rows sum to less than 1.
TYPED_TEST(Attention, SinkAgainstNaive) {
  using T = TypeParam;
  const attn::QKV<T> x = random_qkv<T>(6, 6, 4, 3, 80);
  for (const double sink : {-1.0, 0.0, 0.5, 3.0}) {
    SCOPED_TRACE(::testing::Message() << "sink " << sink);
    attn::AttentionOptions<T> options;
    options.sink = static_cast<T>(sink);
    options.causal = Causal::BottomRight;
    expect_matches_naive<T>(x, options);
    const attn::AttentionTrace<T> trace = attn::trace_attention(x.Q, x.K, x.V, options);
    for (Index i = 0; i < 6; ++i) {
      const T sum = trace.weights.row(i).sum();
      EXPECT_LT(sum, T(1));
      EXPECT_GT(sum, T(0));
      // The missing mass is the sink's share: exp(sink - max) / row_sum.
      const long double share = std::exp(static_cast<long double>(static_cast<T>(sink)) -
                                         static_cast<long double>(trace.row_max(i))) /
                                static_cast<long double>(trace.row_sum(i));
      EXPECT_NEAR(static_cast<double>(1 - sum), static_cast<double>(share),
                  10 * attn_test::Tol<T>::rel);
      // row_max includes the sink.
      EXPECT_GE(trace.row_max(i), static_cast<T>(sink));
    }
  }
  // A sink of -inf is no sink at all.
  attn::AttentionOptions<T> none;
  none.sink = -std::numeric_limits<T>::infinity();
  EXPECT_TRUE(attn_test::identical(attn::attention_with_weights(x.Q, x.K, x.V, none).weights,
                                   attn::attention_with_weights(x.Q, x.K, x.V).weights));
  // A fully masked row stays all zero with a sink.
  attn::AttentionOptions<T> masked;
  masked.sink = T(1);
  masked.mask = attn::Mask::Constant(6, 6, true);
  masked.mask->row(2).setConstant(false);
  const attn::Attention<T> result = attn::attention_with_weights(x.Q, x.K, x.V, masked);
  EXPECT_TRUE(attn_test::identical(result.weights.row(2), attn::Matrix<T>::Zero(1, 6)));
  EXPECT_TRUE(attn_test::all_zero(result.output.row(2)));
}

TYPED_TEST(Attention, NegativeInfinityBiasActsAsMask) {
  using T = TypeParam;
  const attn::QKV<T> x = random_qkv<T>(4, 5, 4, 2, 90);
  attn::Matrix<T> bias = attn::Matrix<T>::Zero(4, 5);
  attn::Mask mask = attn::Mask::Constant(4, 5, true);
  const std::pair<Index, Index> blocked[] = {{0, 1}, {1, 4}, {3, 0}, {3, 2}};
  for (const auto& [i, j] : blocked) {
    bias(i, j) = -std::numeric_limits<T>::infinity();
    mask(i, j) = false;
  }
  attn::AttentionOptions<T> with_bias;
  with_bias.bias = bias;
  attn::AttentionOptions<T> with_mask;
  with_mask.mask = mask;
  const attn::Attention<T> a = attn::attention_with_weights(x.Q, x.K, x.V, with_bias);
  const attn::Attention<T> b = attn::attention_with_weights(x.Q, x.K, x.V, with_mask);
  // Adding a zero bias is exact, so the two are bitwise equal.
  EXPECT_TRUE(attn_test::identical(a.weights, b.weights));
  EXPECT_TRUE(attn_test::identical(a.output, b.output));
  EXPECT_EQ(a.weights(0, 1), T(0));
}

TYPED_TEST(Attention, EmptyShapes) {
  using T = TypeParam;
  // No keys: every query attends nothing -> zero output (n x d_v), not NaN.
  const attn::Matrix<T> Q = attn::Matrix<T>::Ones(3, 4);
  const attn::Attention<T> no_keys =
      attn::attention_with_weights(Q, attn::Matrix<T>(0, 4), attn::Matrix<T>(0, 2));
  EXPECT_EQ(no_keys.output.rows(), 3);
  EXPECT_EQ(no_keys.output.cols(), 2);
  EXPECT_TRUE(attn_test::all_zero(no_keys.output));
  EXPECT_EQ(no_keys.weights.rows(), 3);
  EXPECT_EQ(no_keys.weights.cols(), 0);
  EXPECT_TRUE(attn_test::identical(
      attn::scaled_dot_product_attention(Q, attn::Matrix<T>(0, 4), attn::Matrix<T>(0, 2)),
      attn::Matrix<T>::Zero(3, 2)));
  // No queries.
  const attn::Matrix<T> none = attn::scaled_dot_product_attention(
      attn::Matrix<T>(0, 4), attn::Matrix<T>::Ones(5, 4), attn::Matrix<T>::Ones(5, 2));
  EXPECT_EQ(none.rows(), 0);
  EXPECT_EQ(none.cols(), 2);
  const attn::AttentionTrace<T> trace =
      attn::trace_attention(Q, attn::Matrix<T>(0, 4), attn::Matrix<T>(0, 2));
  EXPECT_EQ(trace.output.rows(), 3);
  EXPECT_EQ(trace.output.cols(), 2);
  EXPECT_TRUE(attn_test::all_zero(trace.output));
  EXPECT_EQ(trace.row_max(0), -std::numeric_limits<T>::infinity());
  EXPECT_EQ(trace.row_sum(0), T(0));
}

// ------------------------------------------------------------------------------------------------
// Column-major and expression inputs.
//
// Every public function accepts any Eigen::MatrixBase expression, either storage order. The
// attention entry points and `scores` bind their operands to Eigen::Ref<const row-major Matrix>: a
// row-major block or leftCols binds in place (with an outer stride), anything else is evaluated
// once into a row-major temporary holding exactly the same values. `project` and `project_qkv`
// hand the expressions to Eigen's product, which packs either storage order into the same panel
// layout before the same GEMM kernel, and `softmax_rows` first copies its argument. So the
// arithmetic on every entry is the same sequence of the same operations, and the results are
// asserted to be BITWISE identical (the strictest claim, and it holds) to the row-major inputs
// holding the same values -- for the small sizes of Eigen's coefficient-based product as well as
// for the GEMM sizes.
//
// The one exception is a scalar factor folded into a product, tested separately below.
// ------------------------------------------------------------------------------------------------

/// The row-major inputs every expression is compared with: Q (n x d), K (m x d), V (m x d_v), and
/// Wt = K^T (d x m) for the projections.
template <class T>
struct Plain {
  attn::Matrix<T> Q, K, V, Wt;
};

template <class T>
Plain<T> plain_inputs(Index n, Index m, Index d, Index d_v, std::uint32_t seed) {
  const attn::QKV<T> x = random_qkv<T>(n, m, d, d_v, seed);
  return {x.Q, x.K, x.V, x.K.transpose()};
}

template <class T, class DQ, class DK, class DV>
void expect_same_as_plain(const Plain<T>& plain, const Eigen::MatrixBase<DQ>& Q,
                          const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V) {
  // The expressions hold the plain values (otherwise the comparison below would mean nothing).
  ASSERT_TRUE(attn_test::identical(attn::Matrix<T>(Q), plain.Q));
  ASSERT_TRUE(attn_test::identical(attn::Matrix<T>(K), plain.K));
  ASSERT_TRUE(attn_test::identical(attn::Matrix<T>(V), plain.V));

  attn::AttentionOptions<T> causal;
  causal.causal = Causal::BottomRight;
  causal.alibi_slope = T(0.25);
  for (const attn::AttentionOptions<T>& options : {attn::AttentionOptions<T>{}, causal}) {
    EXPECT_TRUE(attn_test::identical(
        attn::scaled_dot_product_attention(Q, K, V, options),
        attn::scaled_dot_product_attention(plain.Q, plain.K, plain.V, options)));
    const attn::Attention<T> a = attn::attention_with_weights(Q, K, V, options);
    const attn::Attention<T> b = attn::attention_with_weights(plain.Q, plain.K, plain.V, options);
    EXPECT_TRUE(attn_test::identical(a.weights, b.weights));
    EXPECT_TRUE(attn_test::identical(a.output, b.output));
    const attn::AttentionTrace<T> t = attn::trace_attention(Q, K, V, options);
    const attn::AttentionTrace<T> u = attn::trace_attention(plain.Q, plain.K, plain.V, options);
    EXPECT_TRUE(attn_test::identical(t.scores, u.scores));
    EXPECT_TRUE(attn_test::identical(t.scaled, u.scaled));
    EXPECT_TRUE(attn_test::identical(t.masked, u.masked));
    EXPECT_TRUE(attn_test::identical(t.row_max, u.row_max));
    EXPECT_TRUE(attn_test::identical(t.exp, u.exp));
    EXPECT_TRUE(attn_test::identical(t.row_sum, u.row_sum));
    EXPECT_TRUE(attn_test::identical(t.weights, u.weights));
    EXPECT_TRUE(attn_test::identical(t.output, u.output));
  }

  EXPECT_TRUE(attn_test::identical(attn::scores(Q, K), attn::scores(plain.Q, plain.K)));
  EXPECT_TRUE(
      attn_test::identical(attn::scores(Q, K, T(0.3)), attn::scores(plain.Q, plain.K, T(0.3))));
  attn::Matrix<T> S;
  attn::scores(Q, K, T(0.3), S);
  EXPECT_TRUE(attn_test::identical(S, attn::scores(plain.Q, plain.K, T(0.3))));

  // Projections: X = Q, W = K^T (an expression: the transpose of whatever K is).
  EXPECT_TRUE(
      attn_test::identical(attn::project(Q, K.transpose()), attn::project(plain.Q, plain.Wt)));
  const attn::RowVector<T> b = plain.K.col(0).transpose();
  EXPECT_TRUE(attn_test::identical(attn::project(Q, K.transpose(), b),
                                   attn::project(plain.Q, plain.Wt, b)));
  const attn::QKV<T> qkv = attn::project_qkv(Q, K.transpose(), K.transpose(), K.transpose());
  const attn::QKV<T> ref = attn::project_qkv(plain.Q, plain.Wt, plain.Wt, plain.Wt);
  EXPECT_TRUE(attn_test::identical(qkv.Q, ref.Q));
  EXPECT_TRUE(attn_test::identical(qkv.K, ref.K));
  EXPECT_TRUE(attn_test::identical(qkv.V, ref.V));

  EXPECT_TRUE(attn_test::identical(attn::softmax_rows(Q), attn::softmax_rows(plain.Q)));
  EXPECT_TRUE(attn_test::identical(attn::softmax_rows(K), attn::softmax_rows(plain.K)));
}

/// Every kind of input, for one problem size.
template <class T>
void check_all_input_kinds(Index n, Index m, Index d, Index d_v, std::uint32_t seed) {
  const Plain<T> p = plain_inputs<T>(n, m, d, d_v, seed);
  {
    SCOPED_TRACE("column-major matrices");
    const ColMajor<T> Q = p.Q;
    const ColMajor<T> K = p.K;
    const ColMajor<T> V = p.V;
    expect_same_as_plain(p, Q, K, V);
  }
  {
    SCOPED_TRACE("transpose of a stored transpose (row-major storage)");
    const attn::Matrix<T> Qt = p.Q.transpose();
    const attn::Matrix<T> Kt = p.K.transpose();
    const attn::Matrix<T> Vt = p.V.transpose();
    expect_same_as_plain(p, Qt.transpose(), Kt.transpose(), Vt.transpose());
  }
  {
    SCOPED_TRACE("transpose of a stored transpose (column-major storage)");
    const ColMajor<T> Qt = p.Q.transpose();
    const ColMajor<T> Kt = p.K.transpose();
    const ColMajor<T> Vt = p.V.transpose();
    expect_same_as_plain(p, Qt.transpose(), Kt.transpose(), Vt.transpose());
  }
  {
    SCOPED_TRACE("blocks of larger row-major matrices");
    std::mt19937 rng(seed + 1);
    attn::Matrix<T> big_q = attn_test::random_matrix<T>(n + 3, d + 5, rng);
    attn::Matrix<T> big_k = attn_test::random_matrix<T>(m + 2, d + 1, rng);
    attn::Matrix<T> big_v = attn_test::random_matrix<T>(m + 4, d_v + 3, rng);
    big_q.block(2, 3, n, d) = p.Q;
    big_k.block(1, 1, m, d) = p.K;
    big_v.block(4, 0, m, d_v) = p.V;
    expect_same_as_plain(p, big_q.block(2, 3, n, d), big_k.block(1, 1, m, d),
                         big_v.block(4, 0, m, d_v));
  }
  {
    SCOPED_TRACE("blocks of larger column-major matrices");
    std::mt19937 rng(seed + 2);
    ColMajor<T> big_q = attn_test::random_matrix<T>(n + 3, d + 5, rng);
    ColMajor<T> big_k = attn_test::random_matrix<T>(m + 2, d + 1, rng);
    ColMajor<T> big_v = attn_test::random_matrix<T>(m + 4, d_v + 3, rng);
    big_q.block(2, 3, n, d) = p.Q;
    big_k.block(1, 1, m, d) = p.K;
    big_v.block(4, 0, m, d_v) = p.V;
    expect_same_as_plain(p, big_q.block(2, 3, n, d), big_k.block(1, 1, m, d),
                         big_v.block(4, 0, m, d_v));
  }
  {
    SCOPED_TRACE("leftCols of wider matrices");
    std::mt19937 rng(seed + 3);
    attn::Matrix<T> wide_q = attn_test::random_matrix<T>(n, d + 7, rng);
    ColMajor<T> wide_k = attn_test::random_matrix<T>(m, d + 2, rng);
    attn::Matrix<T> wide_v = attn_test::random_matrix<T>(m, d_v + 1, rng);
    wide_q.leftCols(d) = p.Q;
    wide_k.leftCols(d) = p.K;
    wide_v.leftCols(d_v) = p.V;
    expect_same_as_plain(p, wide_q.leftCols(d), wide_k.leftCols(d), wide_v.leftCols(d_v));
  }
  {
    // Multiplying by 2 (and by 0.5 to build the operands) is exact, so these expressions hold
    // exactly the plain values.
    SCOPED_TRACE("scalar-multiplied expressions (power-of-two factor)");
    const attn::Matrix<T> half_q = p.Q * T(0.5);
    const ColMajor<T> half_k = p.K * T(0.5);
    const attn::Matrix<T> half_v = p.V * T(0.5);
    expect_same_as_plain(p, T(2) * half_q, T(2) * half_k, half_v * T(2));
  }
}

TYPED_TEST(Attention, ExpressionInputsAreBitwiseIdenticalSmall) {
  // 3 + 3 + 2 < 20: Eigen's coefficient-based (lazy) product path.
  check_all_input_kinds<TypeParam>(3, 3, 2, 2, 100);
}

TYPED_TEST(Attention, ExpressionInputsAreBitwiseIdenticalGemm) {
  // Large enough for Eigen's blocked GEMM, odd sizes for the kernel edges.
  check_all_input_kinds<TypeParam>(13, 17, 24, 10, 101);
}

// A general scalar factor: c * X, compared with the row-major matrix holding the evaluated c * X.
// Every entry point evaluates an expression operand first (into an Eigen::Ref temporary or a copy),
// so all are bitwise identical -- `project` too: handed to Eigen directly, c * X would have its
// factor folded into the GEMM's alpha (c * (X W) instead of (c X) W, another rounding).
TYPED_TEST(Attention, GeneralScalarFactorExpressions) {
  using T = TypeParam;
  const T c = T(0.3);
  for (const Index size : {Index{3}, Index{24}, Index{100}}) {
    SCOPED_TRACE(::testing::Message() << "size " << size);
    const attn::QKV<T> x = random_qkv<T>(size, size + 1, size, 4, 110);
    const attn::Matrix<T> cQ = c * x.Q;  // the plain matrix holding the expression's values
    EXPECT_TRUE(attn_test::identical(attn::scaled_dot_product_attention(c * x.Q, x.K, x.V),
                                     attn::scaled_dot_product_attention(cQ, x.K, x.V)));
    const attn::AttentionTrace<T> t = attn::trace_attention(c * x.Q, x.K, x.V);
    const attn::AttentionTrace<T> u = attn::trace_attention(cQ, x.K, x.V);
    EXPECT_TRUE(attn_test::identical(t.scores, u.scores));
    EXPECT_TRUE(attn_test::identical(t.weights, u.weights));
    EXPECT_TRUE(attn_test::identical(t.output, u.output));
    EXPECT_TRUE(attn_test::identical(attn::attention_with_weights(c * x.Q, x.K, x.V).weights,
                                     attn::attention_with_weights(cQ, x.K, x.V).weights));
    EXPECT_TRUE(attn_test::identical(attn::scores(c * x.Q, x.K), attn::scores(cQ, x.K)));
    EXPECT_TRUE(attn_test::identical(attn::softmax_rows(c * x.Q), attn::softmax_rows(cQ)));

    const attn::Matrix<T> W = x.K.transpose();
    const attn::Matrix<T> projected = attn::project(cQ, W);
    const attn::QKV<T> qkv = attn::project_qkv(c * x.Q, W, W, W);
    EXPECT_TRUE(attn_test::identical(qkv.Q, projected));
    EXPECT_TRUE(attn_test::identical(qkv.V, projected));

    EXPECT_TRUE(attn_test::identical(attn::project(c * x.Q, W), projected));
  }
}

}  // namespace
