/// gradcheck.hpp: the finite-difference gradient checker itself, on losses whose gradients are
/// known in closed form.
/// - `numerical_gradient` on sum(A o (X W)) (linear in each entry: the stencil is exact up to
///   rounding), on log-sum-exp of a row with a sink logit (a 1 x 1 input), on exp (its error is the
///   fourth-order stencil's h^4 / 30 f^(5), and not the second-order one's), on x^2 at x = 1e8
///   (the step scales with |x|), the exact points f is evaluated at, and a -inf entry (gradient
///   0, not NaN);
/// - f sees the given inputs with exactly one entry changed, every other entry bit for bit, also
///   -0, subnormals and values that x + h - h would not give back; the caller's inputs stay;
/// - `gradcheck` passes the right gradients (softmax_rows_backward among them), fails a wrong one
///   by one entry, a sign, a relative 1e-6, a NaN, and names the input, row, column and values of
///   the worst entry; shape mismatches and bad options throw before f is called.

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <attn/gradcheck.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Index;
using attn_test::expect_shape_error;
using GradInputs = std::vector<attn::Matrix<double>>;

/// sum(A o (X W)) over inputs {A (n x m), X (n x k), W (k x m)}.
double bilinear_loss(const GradInputs& in) { return in[0].cwiseProduct(in[1] * in[2]).sum(); }

/// Its gradients: dA = X W, dX = A W^T, dW = X^T A.
GradInputs bilinear_gradient(const GradInputs& in) {
  return {in[1] * in[2], in[0] * in[2].transpose(), in[1].transpose() * in[0]};
}

/// Random inputs {A, X, W} of the bilinear loss.
GradInputs bilinear_inputs(Index n, Index k, Index m, std::mt19937& rng) {
  return {attn_test::random_matrix<double>(n, m, rng), attn_test::random_matrix<double>(n, k, rng),
          attn_test::random_matrix<double>(k, m, rng)};
}

/// The bits of a double (to tell -0 from +0 and to compare NaNs).
std::uint64_t bits_of(double value) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

TEST(Gradcheck, NumericalGradientOfABilinearLoss) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<Index> size(1, 5);
  for (int trial = 0; trial < 6; ++trial) {
    const GradInputs inputs = bilinear_inputs(size(rng), size(rng), size(rng), rng);
    const GradInputs expected = bilinear_gradient(inputs);
    const GradInputs numeric = attn::numerical_gradient(bilinear_loss, inputs);
    ASSERT_EQ(numeric.size(), 3u);
    for (std::size_t k = 0; k < 3; ++k) {
      // Linear in each entry: no truncation error, only rounding (about 1e-12 here).
      EXPECT_TRUE(attn_test::near(numeric[k], expected[k], 1e-9, 1e-10)) << "input " << k;
    }
    const attn::GradcheckResult result = attn::gradcheck(bilinear_loss, inputs, expected);
    EXPECT_TRUE(result) << result.message;
    EXPECT_TRUE(result.passed);
    EXPECT_LE(result.worst_error, 1.0);
    EXPECT_NE(result.message.find("gradcheck passed: 0 of "), std::string::npos) << result.message;
  }
}

TEST(Gradcheck, LogSumExpOfARowWithASinkScalar) {
  std::mt19937 rng(11);
  const GradInputs inputs = {attn_test::random_matrix<double>(1, 7, rng, 2.0),
                             attn::Matrix<double>::Constant(1, 1, 0.5)};  // x, and a sink logit
  const auto log_sum_exp = [](const GradInputs& in) {
    return std::log(in[0].array().exp().sum() + std::exp(in[1](0, 0)));
  };
  // d/dx_j = exp(x_j) / Z, d/ds = exp(s) / Z: the softmax with the sink in the denominator.
  const double Z = inputs[0].array().exp().sum() + std::exp(0.5);
  const GradInputs expected = {attn::Matrix<double>(inputs[0].array().exp() / Z),
                               attn::Matrix<double>::Constant(1, 1, std::exp(0.5) / Z)};
  const GradInputs numeric = attn::numerical_gradient(log_sum_exp, inputs);
  EXPECT_TRUE(attn_test::near(numeric[0], expected[0], 1e-9, 1e-11));
  EXPECT_TRUE(attn_test::near(numeric[1], expected[1], 1e-9, 1e-11));
  const attn::GradcheckResult result = attn::gradcheck(log_sum_exp, inputs, expected);
  EXPECT_TRUE(result) << result.message;
}

TEST(Gradcheck, SoftmaxRowsBackwardPassesAndItsHalfFails) {
  std::mt19937 rng(13);
  const GradInputs inputs = {attn_test::random_matrix<double>(4, 6, rng, 2.0)};  // S
  const attn::Matrix<double> G = attn_test::random_matrix<double>(4, 6, rng);
  const auto loss = [&G](const GradInputs& in) {
    return attn::softmax_rows(in[0]).cwiseProduct(G).sum();
  };
  const attn::Matrix<double> P = attn::softmax_rows(inputs[0]);
  const attn::GradcheckResult right =
      attn::gradcheck(loss, inputs, {attn::softmax_rows_backward(P, G)});
  EXPECT_TRUE(right) << right.message;
  // Without the rowsum term (dS = P o dP): a plausible wrong backward, caught.
  const attn::GradcheckResult wrong = attn::gradcheck(loss, inputs, {P.cwiseProduct(G)});
  EXPECT_FALSE(wrong) << wrong.message;
  EXPECT_GT(wrong.worst_error, 1e3);
}

TEST(Gradcheck, FourthOrderStencil) {
  // f = exp(x) at x = 0.5 with h = 1e-2: the five-point stencil's error is -h^4 / 30 f^(5)(x)
  // = -5.5e-10 (the second-order central difference would be off by +h^2 / 6 f'''(x) = 2.7e-5);
  // rounding adds about 1e-13.
  const auto f = [](const GradInputs& in) { return std::exp(in[0](0, 0)); };
  const GradInputs x = {attn::Matrix<double>::Constant(1, 1, 0.5)};
  const double exact = std::exp(0.5);
  const double error = attn::numerical_gradient(f, x, 1e-2)[0](0, 0) - exact;
  const double truncation = -std::pow(1e-2, 4) / 30.0 * exact;
  EXPECT_NEAR(error, truncation, 0.01 * std::abs(truncation));
  // The default step: truncation 5.5e-14, below the rounding.
  EXPECT_NEAR(attn::numerical_gradient(f, x)[0](0, 0), exact, 1e-11);
}

TEST(Gradcheck, InfiniteEntryHasZeroGradient) {
  // A masked logit (-inf) stays -inf under any finite perturbation: f does not change, and the
  // numeric gradient is exactly 0 (h = step, not step * |x| = inf, which would give -inf + inf).
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const GradInputs inputs = {(attn::Matrix<double>(1, 4) << neg_inf, 0.5, -1.0, 2.0).finished()};
  std::vector<double> masked_seen;
  const auto log_sum_exp = [&masked_seen](const GradInputs& in) {
    masked_seen.push_back(in[0](0, 0));
    return std::log(in[0].array().exp().sum());
  };
  const GradInputs numeric = attn::numerical_gradient(log_sum_exp, inputs);
  EXPECT_EQ(numeric[0](0, 0), 0.0);
  for (const double seen : masked_seen) EXPECT_EQ(seen, neg_inf);
  const attn::Matrix<double> softmax = attn::softmax_rows(inputs[0]);  // 0 at the masked entry
  EXPECT_TRUE(attn_test::near(numeric[0], softmax, 1e-9, 1e-11));
  const attn::GradcheckResult result = attn::gradcheck(log_sum_exp, inputs, {softmax});
  EXPECT_TRUE(result) << result.message;
}

TEST(Gradcheck, StepScalesWithTheEntry) {
  // f = x^2 at x = 1e8 (f = 1e16): h = 1e-3 * 1e8 gives 2e8 to about 1e-13 relative (the stencil
  // is exact for a quadratic); an unscaled h = 1e-3 would lose about 1e-5 of it to the rounding
  // of f (eps |f| / h = 2.2).
  const auto square = [](const GradInputs& in) { return in[0](0, 0) * in[0](0, 0); };
  const GradInputs big = {attn::Matrix<double>::Constant(1, 1, 1e8)};
  EXPECT_NEAR(attn::numerical_gradient(square, big)[0](0, 0), 2e8, 2e8 * 1e-11);

  // The points f is evaluated at: x + c h for c = -2, -1, 1, 2, h = step * max(1, |x|).
  for (const double x : {0.3, -2.5, 1e8, -0.0, 0.999, -1000.0}) {
    for (const double step : {1e-3, 0.25}) {
      std::vector<double> seen;
      const auto record = [&seen](const GradInputs& in) {
        seen.push_back(in[0](0, 0));
        return 0.0;
      };
      attn::numerical_gradient(record, {attn::Matrix<double>::Constant(1, 1, x)}, step);
      const double h = step * std::max(1.0, std::abs(x));
      ASSERT_EQ(seen.size(), 4u);
      EXPECT_EQ(seen[0], x - 2.0 * h) << "x " << x << ", step " << step;
      EXPECT_EQ(seen[1], x - h) << "x " << x << ", step " << step;
      EXPECT_EQ(seen[2], x + h) << "x " << x << ", step " << step;
      EXPECT_EQ(seen[3], x + 2.0 * h) << "x " << x << ", step " << step;
    }
  }
}

TEST(Gradcheck, PerturbsOneEntryAtATimeAndRestoresItsBits) {
  // Values that a perturb-and-undo by arithmetic would not give back: -0 (-0 - h + h is +0), a
  // subnormal and 1e-300 (x + h - h is a multiple of h's ulp), 0.1 and 1/3 (x + 2h - 2h rounds),
  // a huge value.
  const double tiny = std::numeric_limits<double>::denorm_min() * 12345.0;
  const GradInputs inputs = {
      (attn::Matrix<double>(2, 3) << 0.1, -0.0, 1.0 / 3.0, tiny, 1e300, -7.25).finished(),
      attn::Matrix<double>::Constant(1, 1, 1e-300),
      (attn::Matrix<double>(3, 1) << 3.0e-5, -123.456, 2.0 / 3.0).finished()};
  std::vector<std::vector<std::uint64_t>> original(inputs.size());
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    for (Index e = 0; e < inputs[k].size(); ++e) original[k].push_back(bits_of(inputs[k](e)));
  }
  std::vector<std::pair<std::size_t, Index>> changed;  // per call: (input, flat entry) that differ
  int calls_with_other_than_one_change = 0;
  const auto spy = [&](const GradInputs& in) {
    int differing = 0;
    for (std::size_t k = 0; k < in.size(); ++k) {
      for (Index e = 0; e < in[k].size(); ++e) {
        if (bits_of(in[k](e)) != original[k][static_cast<std::size_t>(e)]) {
          ++differing;
          changed.emplace_back(k, e);
        }
      }
    }
    if (differing != 1) ++calls_with_other_than_one_change;
    return 0.0;
  };
  const GradInputs gradient = attn::numerical_gradient(spy, inputs);
  EXPECT_EQ(calls_with_other_than_one_change, 0);
  const Index entries = 6 + 1 + 3;
  ASSERT_EQ(changed.size(), static_cast<std::size_t>(4 * entries));
  std::size_t call = 0;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    for (Index e = 0; e < inputs[k].size(); ++e) {
      for (int c = 0; c < 4; ++c, ++call) {  // the entries in order, 4 calls each
        EXPECT_EQ(changed[call].first, k);
        EXPECT_EQ(changed[call].second, e);
      }
    }
  }
  // The caller's inputs are untouched, and the gradients have their shapes.
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    for (Index e = 0; e < inputs[k].size(); ++e) {
      EXPECT_EQ(bits_of(inputs[k](e)), original[k][static_cast<std::size_t>(e)]);
    }
    EXPECT_EQ(gradient[k].rows(), inputs[k].rows());
    EXPECT_EQ(gradient[k].cols(), inputs[k].cols());
  }
}

TEST(Gradcheck, FailsOnAWrongGradientAndNamesTheEntry) {
  std::mt19937 rng(17);
  const GradInputs inputs = bilinear_inputs(4, 3, 5, rng);  // A 4 x 5, X 4 x 3, W 3 x 5
  const GradInputs right = bilinear_gradient(inputs);

  GradInputs wrong = right;
  wrong[1](2, 1) += 1e-4;  // one entry of dX
  const attn::GradcheckResult one = attn::gradcheck(bilinear_loss, inputs, wrong);
  EXPECT_FALSE(one);
  EXPECT_FALSE(one.passed);
  EXPECT_EQ(one.input, 1u);
  EXPECT_EQ(one.row, 2);
  EXPECT_EQ(one.col, 1);
  EXPECT_EQ(one.analytic, wrong[1](2, 1));
  EXPECT_NEAR(one.numeric, right[1](2, 1), 1e-10);
  EXPECT_NEAR(one.worst_error, 1e-4 / (1e-9 + 1e-7 * std::abs(right[1](2, 1))),
              1e-3 * one.worst_error);
  for (const char* part : {"gradcheck FAILED", "1 of 47 entries fail", "input 1 (4 x 3)", "row 2",
                           "col 1", "analytic ", "numeric ", "worst_error"}) {
    EXPECT_NE(one.message.find(part), std::string::npos)
        << "lacks '" << part << "': " << one.message;
  }

  GradInputs negated = right;  // a sign error in dW
  negated[2] = -negated[2];
  const attn::GradcheckResult sign = attn::gradcheck(bilinear_loss, inputs, negated);
  EXPECT_FALSE(sign);
  EXPECT_EQ(sign.input, 2u);
  EXPECT_NE(sign.message.find("15 of 47 entries fail"), std::string::npos) << sign.message;

  // Off by a relative 1e-6 everywhere: beyond the default rtol 1e-7, within rtol 1e-5.
  GradInputs scaled = right;
  for (attn::Matrix<double>& g : scaled) g *= 1.0 + 1e-6;
  EXPECT_FALSE(attn::gradcheck(bilinear_loss, inputs, scaled));
  attn::GradcheckOptions loose;
  loose.rtol = 1e-5;
  const attn::GradcheckResult within = attn::gradcheck(bilinear_loss, inputs, scaled, loose);
  EXPECT_TRUE(within) << within.message;
  EXPECT_GT(within.worst_error, 0.05);  // 1e-6 |g| against 1e-9 + 1e-5 |g|
  EXPECT_LE(within.worst_error, 1.0);

  // A NaN never passes, and is the worst entry.
  GradInputs nan = right;
  nan[0](3, 4) = std::numeric_limits<double>::quiet_NaN();
  const attn::GradcheckResult with_nan = attn::gradcheck(bilinear_loss, inputs, nan);
  EXPECT_FALSE(with_nan);
  EXPECT_EQ(with_nan.input, 0u);
  EXPECT_EQ(with_nan.row, 3);
  EXPECT_EQ(with_nan.col, 4);
  EXPECT_EQ(with_nan.worst_error, std::numeric_limits<double>::infinity());
  // Nor does a loss that gives NaN.
  const auto nan_loss = [](const GradInputs&) { return std::numeric_limits<double>::quiet_NaN(); };
  EXPECT_FALSE(attn::gradcheck(nan_loss, inputs, right));
}

TEST(Gradcheck, NoEntriesPass) {
  const auto zero = [](const GradInputs&) { return 0.0; };
  const attn::GradcheckResult none = attn::gradcheck(zero, {}, {});
  EXPECT_TRUE(none) << none.message;
  EXPECT_NE(none.message.find("no entries"), std::string::npos) << none.message;
  const GradInputs empty = {attn::Matrix<double>(0, 3)};
  EXPECT_TRUE(attn::gradcheck(zero, empty, empty));
  EXPECT_TRUE(attn::numerical_gradient(zero, {}).empty());
}

TEST(GradcheckErrors, ShapeMismatchAndBadOptionsThrowBeforeCallingF) {
  std::mt19937 rng(19);
  const GradInputs inputs = bilinear_inputs(2, 3, 2, rng);  // A 2 x 2, X 2 x 3, W 3 x 2
  GradInputs analytic = bilinear_gradient(inputs);
  int calls = 0;
  const auto counted = [&calls](const GradInputs& in) {
    ++calls;
    return bilinear_loss(in);
  };
  expect_shape_error(
      [&] {
        attn::gradcheck(counted, inputs, {analytic[0], analytic[1]});
      },
      {"attn::gradcheck", "analytic has 2", "inputs has 3"});
  analytic[1] = attn::Matrix<double>::Zero(3, 2);
  expect_shape_error([&] { attn::gradcheck(counted, inputs, analytic); },
                     {"attn::gradcheck", "analytic[1] is 3 x 2", "inputs[1] is 2 x 3"});
  analytic = bilinear_gradient(inputs);
  for (const double step : {0.0, -1e-3, std::numeric_limits<double>::quiet_NaN(),
                            std::numeric_limits<double>::infinity()}) {
    expect_shape_error([&] { attn::numerical_gradient(counted, inputs, step); },
                       {"attn::numerical_gradient", "step"});
    attn::GradcheckOptions options;
    options.step = step;
    expect_shape_error([&] { attn::gradcheck(counted, inputs, analytic, options); },
                       {"attn::gradcheck", "step"});
  }
  attn::GradcheckOptions negative;
  negative.rtol = -1e-7;
  expect_shape_error([&] { attn::gradcheck(counted, inputs, analytic, negative); },
                     {"attn::gradcheck", "rtol = -1e-07"});
  negative.rtol = 1e-7;
  negative.atol = std::numeric_limits<double>::quiet_NaN();
  expect_shape_error([&] { attn::gradcheck(counted, inputs, analytic, negative); }, {"atol"});
  EXPECT_EQ(calls, 0);
}

}  // namespace
