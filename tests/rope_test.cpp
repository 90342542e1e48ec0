/// rope.hpp: rotary position embedding (RoPE), its scalings, and the weight conversion between
/// its two pairings.
/// - the PyTorch float64 reference cases tests/data/rope_half.json and rope_interleaved.json,
///   through API.md's calls as written;
/// - partial rotation, linear and NTK-aware scaling against an independent long double loop
///   written from the published formulas; the in-place variant, also on a column-major matrix;
/// - the default options: `rope(X, p, style)`, `rope(X, p, style, {})` and an explicit
///   `RopeOptions<T>{}` agree (and `{}` is not read as base = 0);
/// - RoPE's relative-position property, the Interleaved <-> Half weight permutation (equal
///   attention scores), the errors;
/// - YaRN (Peng et al. 2023): the blended frequencies against a long double loop from the formula,
///   the NumPy reference case tests/data/rope_yarn.json (tests/data/make_yarn.py), yarn_factor = 1
///   as plain RoPE bit for bit, a YaRN KVCache against RoPE then causal attention, and its errors;
/// - the backward (`rope_backward`, `rope_backward_inplace`): `attn::gradcheck` of
///   sum(rope(X) o G) in double for both pairings and every option (partial rotation, base,
///   linear, NTK, YaRN with its default and a given attention factor, other betas), random shapes
///   and offsets; the adjoint identity <rope(X), G> = <X, rope_backward(G)> and float against
///   double; rope_backward(rope(X)) = m^2 X; the overloads and the in-place and copy paths agree
///   bit for bit; the errors.

#include <gtest/gtest.h>

#include <algorithm>
#include <attn/attn.hpp>
#include <attn/gradcheck.hpp>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Index;
using attn::RopeStyle;
using attn_test::LMatrix;

using attn_test::expect_shape_error;

/// RoPE by the definition, in long double, one pair at a time: RoFormer's rotation with Hugging
/// Face's frequencies `inv_freq = 1 / base^(arange(0, d_rot, 2) / d_rot)`, positions divided by
/// the linear factor, and the NTK base `base * a^(d_rot / (d_rot - 2))`.
LMatrix naive_rope(const LMatrix& X, Index offset, RopeStyle style, long double base,
                   Index rotary_dim = 0, long double linear = 1, long double ntk = 1) {
  const Index d_rot = rotary_dim == 0 ? X.cols() : rotary_dim;
  const long double dr = static_cast<long double>(d_rot);
  const long double b = base * std::pow(ntk, dr / (dr - 2));
  LMatrix Y = X;
  for (Index r = 0; r < X.rows(); ++r) {
    const long double p = static_cast<long double>(offset + r) / linear;
    for (Index i = 0; i < d_rot / 2; ++i) {
      const long double theta = p / std::pow(b, static_cast<long double>(2 * i) / dr);
      const Index a = style == RopeStyle::Interleaved ? 2 * i : i;
      const Index c = style == RopeStyle::Interleaved ? 2 * i + 1 : i + d_rot / 2;
      Y(r, a) = X(r, a) * std::cos(theta) - X(r, c) * std::sin(theta);
      Y(r, c) = X(r, a) * std::sin(theta) + X(r, c) * std::cos(theta);
    }
  }
  return Y;
}

template <class T>
class Rope : public ::testing::Test {};
TYPED_TEST_SUITE(Rope, attn_test::ScalarTypes);

TYPED_TEST(Rope, ReferenceCases) {
  using T = TypeParam;
  for (const auto& [name, style] : {std::pair<std::string, RopeStyle>{"rope_half", RopeStyle::Half},
                                    {"rope_interleaved", RopeStyle::Interleaved}}) {
    const attn_test::Case c = attn_test::load_case(name);
    ASSERT_EQ(c.params().at("style").get<std::string>(),
              style == RopeStyle::Half ? "half" : "interleaved");
    const Index offset = c.params().at("offset").get<Index>();
    const T base = static_cast<T>(c.params().at("base").get<double>());
    const attn::Matrix<T> X = c.input<T>("X");
    EXPECT_TRUE(attn_test::near_t<T>(attn::rope(X, offset, style, base), c.expected<double>("Y")))
        << name;
    attn::Matrix<T> Y = X;
    attn::rope_inplace(Y, offset, style);
    EXPECT_TRUE(attn_test::near_t<T>(Y, c.expected<double>("Y"))) << name << " in place";
  }
}

TYPED_TEST(Rope, DefaultOptionsBraceAndOmittedAgree) {
  using T = TypeParam;
  std::mt19937 rng(43);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(5, 8, rng);
  for (const RopeStyle style : {RopeStyle::Interleaved, RopeStyle::Half}) {
    for (const Index offset : {Index(0), Index(3)}) {
      const attn::Matrix<T> explicit_default = attn::rope(X, offset, style, attn::RopeOptions<T>{});
      // `{}` means the default options (not base = 0, which would throw); so does omitting them.
      EXPECT_TRUE(attn_test::identical(attn::rope(X, offset, style, {}), explicit_default));
      EXPECT_TRUE(attn_test::identical(attn::rope(X, offset, style), explicit_default));
      // The base shorthand with the default base, as T or as an integer.
      EXPECT_TRUE(attn_test::identical(attn::rope(X, offset, style, T(10000)), explicit_default));
      EXPECT_TRUE(attn_test::identical(attn::rope(X, offset, style, 10000), explicit_default));
      attn::Matrix<T> Y = X;
      attn::rope_inplace(Y, offset, style, {});
      EXPECT_TRUE(attn_test::identical(Y, explicit_default));
      // The default options do rotate: rows 1 .. 4 (and row 0 from offset 3 on) change.
      EXPECT_FALSE(attn_test::identical(explicit_default, X));
    }
  }
}

TYPED_TEST(Rope, MatchesTheDefinitionWithScalingAndPartialRotation) {
  using T = TypeParam;
  std::mt19937 rng(11);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(9, 12, rng);
  const LMatrix XL = attn_test::to_long_double(X);
  for (const RopeStyle style : {RopeStyle::Interleaved, RopeStyle::Half}) {
    attn::RopeOptions<T> options;
    options.base = T(500000);
    EXPECT_TRUE(
        attn_test::near_t<T>(attn::rope(X, 40, style, options), naive_rope(XL, 40, style, 500000)));
    options.rotary_dim = 8;  // features 8 .. 11 pass through
    options.linear_scale = T(4);
    EXPECT_TRUE(attn_test::near_t<T>(attn::rope(X, 40, style, options),
                                     naive_rope(XL, 40, style, 500000, 8, 4)));
    options.linear_scale = T(1);
    options.ntk_scale = T(8);
    EXPECT_TRUE(attn_test::near_t<T>(attn::rope(X, 1000, style, options),
                                     naive_rope(XL, 1000, style, 500000, 8, 1, 8)));
    // In place on a block of a column-major matrix: the copy path.
    Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> C = X;
    attn::rope_inplace(C, 40, style, options);
    EXPECT_TRUE(attn_test::near_t<T>(C, naive_rope(XL, 40, style, 500000, 8, 1, 8)));
  }
}

TYPED_TEST(Rope, ScoresDependOnlyOnRelativePosition) {
  using T = TypeParam;
  std::mt19937 rng(3);
  const attn::Matrix<T> q = attn_test::random_matrix<T>(1, 16, rng);
  const attn::Matrix<T> k = attn_test::random_matrix<T>(1, 16, rng);
  for (const RopeStyle style : {RopeStyle::Interleaved, RopeStyle::Half}) {
    const T near_origin = (attn::rope(q, 7, style) * attn::rope(k, 3, style).transpose())(0, 0);
    const T far_away = (attn::rope(q, 107, style) * attn::rope(k, 103, style).transpose())(0, 0);
    EXPECT_NEAR(static_cast<double>(near_origin), static_cast<double>(far_away),
                100 * attn_test::Tol<T>::rel * 16);
  }
}

TYPED_TEST(Rope, ConvertRopeWeightsGivesEqualScores) {
  using T = TypeParam;
  std::mt19937 rng(17);
  const Index heads = 3;
  const Index head_dim = 8;
  const attn::Matrix<T> X = attn_test::random_matrix<T>(6, 10, rng);
  const attn::Matrix<T> W_Q = attn_test::random_matrix<T>(10, heads * head_dim, rng, 0.3);
  const attn::Matrix<T> W_K = attn_test::random_matrix<T>(10, heads * head_dim, rng, 0.3);
  for (const Index rotary_dim : {Index(0), Index(4)}) {
    for (const RopeStyle from : {RopeStyle::Interleaved, RopeStyle::Half}) {
      const RopeStyle to = from == RopeStyle::Half ? RopeStyle::Interleaved : RopeStyle::Half;
      const attn::Matrix<T> W_Q2 = attn::convert_rope_weights(W_Q, heads, from, to, rotary_dim);
      const attn::Matrix<T> W_K2 = attn::convert_rope_weights(W_K, heads, from, to, rotary_dim);
      EXPECT_TRUE(
          attn_test::identical(attn::convert_rope_weights(W_Q2, heads, to, from, rotary_dim),
                               W_Q));  // a permutation and its inverse
      attn::RopeOptions<T> options;
      options.rotary_dim = rotary_dim;
      const attn::Matrix<T> Q = X * W_Q;
      const attn::Matrix<T> K = X * W_K;
      const attn::Matrix<T> Q2 = X * W_Q2;
      const attn::Matrix<T> K2 = X * W_K2;
      for (Index h = 0; h < heads; ++h) {
        const auto head = [&](const attn::Matrix<T>& M) {
          return attn::Matrix<T>(M.middleCols(h * head_dim, head_dim));
        };
        const attn::Matrix<T> made_for = attn::scores(attn::rope(head(Q), 5, from, options),
                                                      attn::rope(head(K), 0, from, options));
        const attn::Matrix<T> used_with = attn::scores(attn::rope(head(Q2), 5, to, options),
                                                       attn::rope(head(K2), 0, to, options));
        EXPECT_TRUE(attn_test::near(used_with, made_for, 10 * attn_test::Tol<T>::rel,
                                    10 * attn_test::Tol<T>::abs))
            << "head " << h << ", rotary_dim " << rotary_dim;
        // Without the conversion the scores differ: the test would see a wrong permutation.
        const attn::Matrix<T> unconverted =
            attn::scores(attn::rope(head(Q), 5, to, options), attn::rope(head(K), 0, to, options));
        EXPECT_GT((unconverted - made_for).cwiseAbs().maxCoeff(), T(1e-3));
      }
    }
  }
}

TEST(RopeErrors, BadArguments) {
  const attn::Matrix<float> odd = attn::Matrix<float>::Zero(2, 5);
  expect_shape_error([&] { attn::rope(odd, 0, RopeStyle::Half); },
                     {"attn::rope", "rotary_dim", "5"});
  const attn::Matrix<float> X = attn::Matrix<float>::Zero(2, 4);
  expect_shape_error([&] { attn::rope(X, -2, RopeStyle::Half); }, {"offset", "-2", "2 x 4"});
  expect_shape_error([&] { attn::rope(X, 0, RopeStyle::Half, 0.0f); }, {"base"});
  attn::RopeOptions<float> options;
  options.rotary_dim = 6;
  expect_shape_error([&] { attn::rope(X, 0, RopeStyle::Half, options); }, {"rotary_dim", "6"});
  expect_shape_error(
      [] {
        attn::convert_rope_weights(attn::Matrix<float>::Zero(4, 10), 3, RopeStyle::Half,
                                   RopeStyle::Interleaved);
      },
      {"convert_rope_weights", "10 columns", "heads = 3", "4 x 10"});
}

// ------------------------------------------------------------------------------------------------
// YaRN
// ------------------------------------------------------------------------------------------------

/// YaRN's frequencies by the formula (Peng et al. 2023; Hugging Face rope_type "yarn"), in long
/// double, with the correction range it uses.
struct NaiveYarn {
  std::vector<long double> frequencies;
  long double low = 0;
  long double high = 0;
};

NaiveYarn naive_yarn(Index d_rot, long double base, long double s, long double L,
                     long double beta_fast = 32, long double beta_slow = 1) {
  const long double d = static_cast<long double>(d_rot);
  const long double pi = 3.141592653589793238462643383279502884L;
  const auto corr = [&](long double r) {
    return d * std::log(L / (2 * pi * r)) / (2 * std::log(base));
  };
  NaiveYarn y;
  y.low = std::max(std::floor(corr(beta_fast)), 0.0L);
  y.high = std::min(std::ceil(corr(beta_slow)), d - 1);
  const long double high = y.low == y.high ? y.high + 0.001L : y.high;
  for (Index i = 0; i < d_rot / 2; ++i) {
    const long double f = std::pow(base, -2 * static_cast<long double>(i) / d);
    const long double ramp =
        std::min(std::max((static_cast<long double>(i) - y.low) / (high - y.low), 0.0L), 1.0L);
    const long double w = 1 - ramp;
    y.frequencies.push_back(f / s * (1 - w) + f * w);
  }
  return y;
}

/// RoPE with the given frequencies and magnitude (cos and sin times `mscale`), in long double.
LMatrix naive_rope_with(const LMatrix& X, Index offset, RopeStyle style,
                        const std::vector<long double>& frequencies, long double mscale) {
  const Index half = static_cast<Index>(frequencies.size());
  LMatrix Y = X;
  for (Index r = 0; r < X.rows(); ++r) {
    for (Index i = 0; i < half; ++i) {
      const long double theta =
          static_cast<long double>(offset + r) * frequencies[static_cast<std::size_t>(i)];
      const Index a = style == RopeStyle::Interleaved ? 2 * i : i;
      const Index c = style == RopeStyle::Interleaved ? 2 * i + 1 : i + half;
      Y(r, a) = mscale * (X(r, a) * std::cos(theta) - X(r, c) * std::sin(theta));
      Y(r, c) = mscale * (X(r, a) * std::sin(theta) + X(r, c) * std::cos(theta));
    }
  }
  return Y;
}

/// YaRN with factor `s` over a trained length `L`; the other fields as given or at their defaults.
template <class T>
attn::RopeOptions<T> yarn_options(T s, Index L, Index rotary_dim = 0, T base = T(10000)) {
  attn::RopeOptions<T> options;
  options.base = base;
  options.rotary_dim = rotary_dim;
  options.yarn_factor = s;
  options.yarn_original_max_positions = L;
  return options;
}

TYPED_TEST(Rope, YarnFrequenciesBlendExtrapolationAndInterpolation) {
  using T = TypeParam;
  struct Setting {
    Index head_dim, rotary_dim;
    T base, s;
    Index L;
    Index expected_low, expected_high;  // from the formula, by hand
    Index kept, blended, divided;       // pairs i <= low, low < i < high, i >= high
  };
  // d = 64, L = 4096: corr(32) = 10.47, corr(1) = 22.5: pairs 0 .. 10 kept, 11 .. 22 blended,
  // 23 .. 31 divided by s. d = 16, L = 4: both corrections negative, low = high = 0 (the + 0.001
  // rule). d = 16, L = 32 (the reference case): low 0, high 2. Partial rotation, d_rot = 48 of 80
  // features, base 500000, L = 8192: low 6, high 14. d = 16, L = 100000: low 5, high 9 > d/2 - 1
  // (nothing divided; the ramp's slope is 1/4). d = 16, base 16, L = 2048: corr(1) = 16.7, so
  // high is clamped to d - 1 = 15 (the ramp's slope is 1/9).
  const Setting settings[] = {{64, 0, T(10000), T(8), 4096, 10, 23, 11, 12, 9},
                              {16, 0, T(10000), T(2), 4, 0, 0, 1, 0, 7},
                              {16, 0, T(10000), T(4), 32, 0, 2, 1, 1, 6},
                              {80, 48, T(500000), T(16), 8192, 6, 14, 7, 7, 10},
                              {16, 0, T(10000), T(4), 100000, 5, 9, 6, 2, 0},
                              {16, 0, T(16), T(4), 2048, 6, 15, 7, 1, 0}};
  for (const Setting& c : settings) {
    const Index d_rot = c.rotary_dim == 0 ? c.head_dim : c.rotary_dim;
    attn::RopeOptions<T> plain;
    plain.base = c.base;
    plain.rotary_dim = c.rotary_dim;
    const attn::RopeOptions<T> options = yarn_options<T>(c.s, c.L, c.rotary_dim, c.base);
    const attn::detail::RopeTable unscaled = attn::detail::rope_table("test", c.head_dim, plain);
    const attn::detail::RopeTable yarn = attn::detail::rope_table("test", c.head_dim, options);
    const NaiveYarn expected =
        naive_yarn(d_rot, static_cast<long double>(c.base), static_cast<long double>(c.s),
                   static_cast<long double>(c.L));
    ASSERT_EQ(expected.low, static_cast<long double>(c.expected_low)) << "d_rot " << d_rot;
    ASSERT_EQ(expected.high, static_cast<long double>(c.expected_high)) << "d_rot " << d_rot;
    ASSERT_EQ(yarn.frequencies.size(), static_cast<std::size_t>(d_rot / 2));
    const double s = static_cast<double>(c.s);
    Index kept = 0;
    Index blended = 0;
    Index divided = 0;
    for (std::size_t i = 0; i < yarn.frequencies.size(); ++i) {
      const auto pair = static_cast<long double>(i);
      if (pair <= expected.low) {  // w_i = 1: the unscaled frequency, bit for bit
        EXPECT_EQ(yarn.frequencies[i], unscaled.frequencies[i]) << "pair " << i;
        ++kept;
      } else if (pair >= expected.high) {  // w_i = 0: the interpolated one, f_i / s
        EXPECT_EQ(yarn.frequencies[i], unscaled.frequencies[i] / s) << "pair " << i;
        ++divided;
      } else {  // strictly between the two
        EXPECT_LT(yarn.frequencies[i], unscaled.frequencies[i]) << "pair " << i;
        EXPECT_GT(yarn.frequencies[i], unscaled.frequencies[i] / s) << "pair " << i;
        ++blended;
      }
      const auto naive = static_cast<double>(expected.frequencies[i]);
      EXPECT_NEAR(yarn.frequencies[i], naive, 1e-14 * naive) << "pair " << i << ", d_rot " << d_rot;
    }
    EXPECT_EQ(kept, c.kept) << "d_rot " << d_rot << ", L " << c.L;
    EXPECT_EQ(blended, c.blended) << "d_rot " << d_rot << ", L " << c.L;
    EXPECT_EQ(divided, c.divided) << "d_rot " << d_rot << ", L " << c.L;
    // The default attention factor, and the unscaled table's 1.
    EXPECT_DOUBLE_EQ(yarn.magnitude, 0.1 * std::log(s) + 1.0);
    EXPECT_EQ(unscaled.magnitude, 1.0);
    EXPECT_EQ(yarn.position_scale, 1.0);
  }
  attn::RopeOptions<T> custom = yarn_options<T>(T(8), 4096);
  custom.yarn_attention_factor = T(0.75);
  EXPECT_EQ(attn::detail::rope_table("test", 64, custom).magnitude, static_cast<double>(T(0.75)));
  custom.yarn_beta_fast = T(16);  // other betas move the range: corr(16) = 12.9 -> low 12
  custom.yarn_beta_slow = T(2);   // corr(2) = 20.1 -> high 21
  const NaiveYarn moved = naive_yarn(64, 10000, 8, 4096, 16, 2);
  EXPECT_EQ(moved.low, 12.0L);
  EXPECT_EQ(moved.high, 21.0L);
  const std::vector<double> frequencies = attn::detail::rope_table("test", 64, custom).frequencies;
  for (std::size_t i = 0; i < frequencies.size(); ++i) {
    const auto naive = static_cast<double>(moved.frequencies[i]);
    EXPECT_NEAR(frequencies[i], naive, 1e-14 * naive) << "pair " << i;
  }
}

TYPED_TEST(Rope, YarnRopeMatchesTheDefinition) {
  using T = TypeParam;
  std::mt19937 rng(31);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(7, 20, rng);
  const LMatrix XL = attn_test::to_long_double(X);
  for (const RopeStyle style : {RopeStyle::Interleaved, RopeStyle::Half}) {
    // All 20 features rotate; then 16 of them (features 16 .. 19 pass through unscaled).
    for (const Index rotary_dim : {Index(0), Index(16)}) {
      const Index d_rot = rotary_dim == 0 ? 20 : rotary_dim;
      for (const bool custom_factor : {false, true}) {
        attn::RopeOptions<T> options = yarn_options<T>(T(8), 512, rotary_dim);
        long double mscale = 0.1L * std::log(8.0L) + 1;
        if (custom_factor) {
          options.yarn_attention_factor = T(0.625);
          mscale = 0.625L;
        }
        const NaiveYarn naive = naive_yarn(d_rot, 10000, 8, 512);
        const LMatrix expected = naive_rope_with(XL, 3000, style, naive.frequencies, mscale);
        EXPECT_TRUE(attn_test::near_t<T>(attn::rope(X, 3000, style, options), expected))
            << "rotary_dim " << rotary_dim << (custom_factor ? ", attention factor 0.625" : "");
        attn::Matrix<T> Y = X;
        attn::rope_inplace(Y, 3000, style, options);
        EXPECT_TRUE(attn_test::near_t<T>(Y, expected)) << "in place";
        // The features past d_rot are untouched (not multiplied by the attention factor).
        EXPECT_TRUE(attn_test::identical(Y.rightCols(20 - d_rot), X.rightCols(20 - d_rot)));
      }
    }
  }
}

TYPED_TEST(Rope, YarnReferenceCase) {
  using T = TypeParam;
  const attn_test::Case c = attn_test::load_case("rope_yarn");
  const Index offset = c.params().at("offset").get<Index>();
  const Index partial = c.params().at("rotary_dim_partial").get<Index>();
  attn::RopeOptions<T> options;
  options.base = static_cast<T>(c.params().at("base").get<double>());
  options.yarn_factor = static_cast<T>(c.params().at("yarn_factor").get<double>());
  options.yarn_original_max_positions = c.params().at("yarn_original_max_positions").get<Index>();
  options.yarn_beta_fast = static_cast<T>(c.params().at("yarn_beta_fast").get<double>());
  options.yarn_beta_slow = static_cast<T>(c.params().at("yarn_beta_slow").get<double>());
  const attn::Matrix<T> X = c.input<T>("X");
  ASSERT_EQ(X.rows(), 6);
  ASSERT_EQ(X.cols(), 16);

  // The frequencies and the attention factor (in double whatever T is).
  const attn::detail::RopeTable table = attn::detail::rope_table("test", X.cols(), options);
  const attn::Matrix<double> frequencies = c.expected<double>("frequencies");
  ASSERT_EQ(frequencies.cols(), static_cast<Index>(table.frequencies.size()));
  for (Index i = 0; i < frequencies.cols(); ++i) {
    EXPECT_NEAR(table.frequencies[static_cast<std::size_t>(i)], frequencies(0, i),
                1e-14 * frequencies(0, i))
        << "pair " << i;
  }
  EXPECT_NEAR(table.magnitude, c.expected<double>("attention_factor")(0, 0), 1e-15);

  EXPECT_TRUE(attn_test::near_t<T>(attn::rope(X, offset, RopeStyle::Half, options),
                                   c.expected<double>("Y_half")));
  EXPECT_TRUE(attn_test::near_t<T>(attn::rope(X, offset, RopeStyle::Interleaved, options),
                                   c.expected<double>("Y_interleaved")));
  attn::Matrix<T> Y = X;
  attn::rope_inplace(Y, offset, RopeStyle::Interleaved, options);
  EXPECT_TRUE(attn_test::near_t<T>(Y, c.expected<double>("Y_interleaved"))) << "in place";
  options.rotary_dim = partial;
  EXPECT_TRUE(attn_test::near_t<T>(attn::rope(X, offset, RopeStyle::Half, options),
                                   c.expected<double>("Y_half_rotary_dim_12")));
}

TYPED_TEST(Rope, YarnFactorOneIsPlainRope) {
  using T = TypeParam;
  std::mt19937 rng(37);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(5, 12, rng);
  for (const RopeStyle style : {RopeStyle::Interleaved, RopeStyle::Half}) {
    attn::RopeOptions<T> plain;
    plain.rotary_dim = 8;
    plain.linear_scale = T(2);  // allowed beside yarn_factor = 1
    attn::RopeOptions<T> off = plain;
    off.yarn_factor = T(1);
    off.yarn_original_max_positions = 64;  // ignored at s = 1, as are the betas
    off.yarn_beta_fast = T(4);
    off.yarn_beta_slow = T(2);
    EXPECT_TRUE(
        attn_test::identical(attn::rope(X, 70, style, off), attn::rope(X, 70, style, plain)));
    attn::Matrix<T> Y = X;
    attn::rope_inplace(Y, 70, style, off);
    EXPECT_TRUE(attn_test::identical(Y, attn::rope(X, 70, style, plain)));
    // And an unset L is no error when YaRN is off.
    off.yarn_original_max_positions = 0;
    EXPECT_TRUE(
        attn_test::identical(attn::rope(X, 70, style, off), attn::rope(X, 70, style, plain)));
  }
}

TYPED_TEST(Rope, YarnKVCacheTokenByTokenEqualsRopeThenCausalAttention) {
  using T = TypeParam;
  std::mt19937 rng(41);
  const Index n = 24;
  const Index heads = 4;
  const Index kv_heads = 2;
  const Index d = 12;
  const Index d_v = 5;
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, heads * d, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(n, kv_heads * d, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(n, kv_heads * d_v, rng);
  for (const RopeStyle style : {RopeStyle::Interleaved, RopeStyle::Half}) {
    attn::KVCacheConfig<T> config;
    config.d_k = d;
    config.d_v = d_v;
    config.kv_heads = kv_heads;
    config.rope = style;
    // d_rot = 10 of 12 features, base 100, L = 64: pair 0 kept, 1 and 2 blended, 3 and 4 divided.
    config.rope_options = yarn_options<T>(T(4), 64, 10, T(100));
    attn::KVCache<T> cache(config);
    attn::Matrix<T> out(n, heads * d_v);
    for (Index t = 0; t < n; ++t) {
      cache.append(K.row(t), V.row(t));
      out.row(t) = cache.attend(Q.row(t));
    }
    for (Index h = 0; h < heads; ++h) {
      const Index kv = h / 2;
      const attn::Matrix<T> Q_h = attn::rope(Q.middleCols(h * d, d), 0, style, config.rope_options);
      const attn::Matrix<T> K_kv =
          attn::rope(K.middleCols(kv * d, d), 0, style, config.rope_options);
      attn::AttentionOptions<T> causal;
      causal.causal = attn::Causal::BottomRight;
      const LMatrix expected =
          attn_test::naive_attention<T>(Q_h, K_kv, V.middleCols(kv * d_v, d_v), causal).output;
      EXPECT_TRUE(attn_test::near_t<T>(out.middleCols(h * d_v, d_v), expected)) << "head " << h;
      // The stored keys are the YaRN-rotated (and attention-factor scaled) rows.
      EXPECT_TRUE(attn_test::near_t<T>(cache.keys(kv), K_kv)) << "kv head " << kv;
    }
  }
}

TEST(RopeErrors, YarnBadOptions) {
  const attn::Matrix<float> X = attn::Matrix<float>::Zero(2, 8);
  const auto call = [&](const attn::RopeOptions<float>& options) {
    return [&X, options] { attn::rope(X, 0, RopeStyle::Half, options); };
  };
  for (const float s : {0.5f, 0.0f, -2.0f, std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity()}) {
    expect_shape_error(call(yarn_options<float>(s, 32)), {"attn::rope", "yarn_factor", ">= 1"});
  }
  expect_shape_error(call(yarn_options<float>(4.0f, 0)),
                     {"attn::rope", "yarn_original_max_positions", "got 0", "yarn_factor = 4"});
  expect_shape_error(call(yarn_options<float>(4.0f, -5)), {"yarn_original_max_positions", "-5"});
  attn::RopeOptions<float> linear = yarn_options<float>(4.0f, 32);
  linear.linear_scale = 2.0f;
  expect_shape_error(call(linear), {"yarn_factor = 4", "linear_scale = 2"});
  attn::RopeOptions<float> ntk = yarn_options<float>(4.0f, 32);
  ntk.ntk_scale = 3.0f;
  expect_shape_error(call(ntk), {"yarn_factor = 4", "ntk_scale = 3"});
  attn::RopeOptions<float> betas = yarn_options<float>(4.0f, 32);
  betas.yarn_beta_fast = 0.5f;  // below beta_slow = 1
  expect_shape_error(call(betas), {"yarn_beta_fast = 0.5", "yarn_beta_slow = 1"});
  betas.yarn_beta_fast = 32.0f;
  betas.yarn_beta_slow = 0.0f;
  expect_shape_error(call(betas), {"yarn_beta_slow = 0"});
  attn::RopeOptions<float> factor = yarn_options<float>(4.0f, 32);
  factor.yarn_attention_factor = 0.0f;
  expect_shape_error(call(factor), {"yarn_attention_factor", "0"});
  factor.yarn_factor = 1.0f;  // an attention factor without YaRN
  factor.yarn_attention_factor = 1.5f;
  expect_shape_error(call(factor), {"yarn_attention_factor = 1.5", "yarn_factor = 1"});
  expect_shape_error(call(yarn_options<float>(4.0f, 32, 0, 1.0f)), {"YaRN needs base > 1"});
  // In place and in a cache (its constructor checks the rope options).
  attn::Matrix<float> Y = X;
  expect_shape_error([&] { attn::rope_inplace(Y, 0, RopeStyle::Half, linear); },
                     {"attn::rope_inplace", "linear_scale"});
  attn::KVCacheConfig<float> config;
  config.d_k = 8;
  config.d_v = 4;
  config.rope = RopeStyle::Half;
  config.rope_options = yarn_options<float>(4.0f, 0);
  expect_shape_error([&] { attn::KVCache<float> cache(config); },
                     {"attn::KVCache", "yarn_original_max_positions"});
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

/// The option sets the backward runs under, for one head of d >= 6 features (d even): every
/// `RopeOptions` field on its own, and YaRN with partial rotation, a given attention factor and
/// other betas.
template <class T>
std::vector<std::pair<std::string, attn::RopeOptions<T>>> rope_backward_option_sets(Index d) {
  std::vector<std::pair<std::string, attn::RopeOptions<T>>> sets;
  sets.emplace_back("default", attn::RopeOptions<T>{});
  attn::RopeOptions<T> o;
  o.base = T(500000);
  sets.emplace_back("base 500000", o);
  o = {};
  o.rotary_dim = d - 2;  // the last two features pass through
  sets.emplace_back("rotary_dim d - 2", o);
  o = {};
  o.linear_scale = T(4);
  sets.emplace_back("linear_scale 4", o);
  o = {};
  o.ntk_scale = T(8);
  o.rotary_dim = d - 2;
  sets.emplace_back("ntk_scale 8, rotary_dim d - 2", o);
  // base 100, L = 64: with d_rot of 6 to 12, pairs are kept, blended and divided.
  sets.emplace_back("yarn 4", yarn_options<T>(T(4), 64, 0, T(100)));
  o = yarn_options<T>(T(8), 64, d - 4, T(100));
  o.yarn_attention_factor = T(1.375);
  o.yarn_beta_fast = T(16);
  o.yarn_beta_slow = T(2);
  sets.emplace_back("yarn 8, rotary_dim d - 4, attention factor 1.375, betas 16 / 2", o);
  return sets;
}

/// YaRN's attention factor m of `options` (1 without YaRN): the backward scales by it, as rope.
template <class T>
double rope_magnitude(const attn::RopeOptions<T>& options) {
  if (options.yarn_factor == T(1)) return 1.0;
  if (options.yarn_attention_factor) return static_cast<double>(*options.yarn_attention_factor);
  return 0.1 * std::log(static_cast<double>(options.yarn_factor)) + 1.0;
}

TEST(RopeBackward, GradcheckEveryStyleAndOption) {
  std::mt19937 rng(47);
  std::uniform_int_distribution<Index> rows(1, 5);
  std::uniform_int_distribution<Index> half_width(3, 6);  // d = 6 .. 12
  std::uniform_int_distribution<Index> position(0, 3000);
  for (int trial = 0; trial < 3; ++trial) {
    const Index n = rows(rng);
    const Index d = 2 * half_width(rng);
    const Index offset = trial == 0 ? 0 : position(rng);  // offset 0: row 0 does not turn
    const std::vector<attn::Matrix<double>> inputs = {attn_test::random_matrix<double>(n, d, rng)};
    const attn::Matrix<double> G = attn_test::random_matrix<double>(n, d, rng);
    for (const RopeStyle style : {RopeStyle::Interleaved, RopeStyle::Half}) {
      for (const auto& [name, options] : rope_backward_option_sets<double>(d)) {
        const auto loss = [&, &opts = options](const std::vector<attn::Matrix<double>>& in) {
          return attn::rope(in[0], offset, style, opts).cwiseProduct(G).sum();
        };
        const attn::GradcheckResult result =
            attn::gradcheck(loss, inputs, {attn::rope_backward(G, offset, style, options)});
        EXPECT_TRUE(result) << name << (style == RopeStyle::Half ? ", Half" : ", Interleaved")
                            << ", " << n << " x " << d << ", offset " << offset << ": "
                            << result.message;
      }
    }
  }
}

TYPED_TEST(Rope, BackwardIsTheAdjointAndFloatMatchesDouble) {
  using T = TypeParam;
  std::mt19937 rng(53);
  const Index n = 6;
  const Index d = 10;
  const attn::Matrix<T> X = attn_test::random_matrix<T>(n, d, rng);
  const attn::Matrix<T> G = attn_test::random_matrix<T>(n, d, rng);
  const attn::Matrix<double> G_double = G.template cast<double>();
  // The same option sets in double (their values are exact in float).
  const auto sets = rope_backward_option_sets<T>(d);
  const auto sets_double = rope_backward_option_sets<double>(d);
  for (const RopeStyle style : {RopeStyle::Interleaved, RopeStyle::Half}) {
    for (std::size_t k = 0; k < sets.size(); ++k) {
      const auto& [name, options] = sets[k];
      const attn::Matrix<T> dX = attn::rope_backward(G, 700, style, options);
      // <rope(X), G> = <X, rope_backward(G)>: the backward is the forward's transpose.
      const attn::Matrix<T> Y = attn::rope(X, 700, style, options);
      const double forward_side = static_cast<double>(Y.cwiseProduct(G).sum());
      const double backward_side = static_cast<double>(X.cwiseProduct(dX).sum());
      const double terms = static_cast<double>(Y.cwiseAbs().cwiseProduct(G.cwiseAbs()).sum() +
                                               X.cwiseAbs().cwiseProduct(dX.cwiseAbs()).sum());
      EXPECT_NEAR(backward_side, forward_side,
                  8 * static_cast<double>(std::numeric_limits<T>::epsilon()) * terms)
          << name;
      // The same gradient as the double code, to T's rounding (the angles are double in both).
      const attn::Matrix<double> dX_double =
          attn::rope_backward(G_double, 700, style, sets_double[k].second);
      EXPECT_TRUE(attn_test::near_t<T>(dX, dX_double)) << name;
    }
  }
}

TYPED_TEST(Rope, BackwardOfRopeIsTheFactorSquaredTimesX) {
  using T = TypeParam;
  std::mt19937 rng(59);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(5, 12, rng);
  for (const RopeStyle style : {RopeStyle::Interleaved, RopeStyle::Half}) {
    for (const auto& [name, options] : rope_backward_option_sets<T>(12)) {
      // R^T (m R) x = m x on the rotated features: m^2 x after both; the rest pass through.
      const Index d_rot = options.rotary_dim == 0 ? 12 : options.rotary_dim;
      const double m = rope_magnitude(options);
      attn::Matrix<double> expected = X.template cast<double>();
      expected.leftCols(d_rot) *= m * m;
      const attn::Matrix<T> back =
          attn::rope_backward(attn::rope(X, 1234, style, options), 1234, style, options);
      EXPECT_TRUE(
          attn_test::near(back, expected, 4 * attn_test::Tol<T>::rel, 4 * attn_test::Tol<T>::abs))
          << name;
      EXPECT_TRUE(attn_test::identical(back.rightCols(12 - d_rot), X.rightCols(12 - d_rot)))
          << name;
    }
  }
}

TYPED_TEST(Rope, BackwardOverloadsAndInPlaceAgree) {
  using T = TypeParam;
  std::mt19937 rng(61);
  const attn::Matrix<T> G = attn_test::random_matrix<T>(7, 8, rng);
  for (const RopeStyle style : {RopeStyle::Interleaved, RopeStyle::Half}) {
    const attn::RopeOptions<T> options = yarn_options<T>(T(4), 32, 6);
    const attn::Matrix<T> dX = attn::rope_backward(G, 9, style, options);
    attn::Matrix<T> in_place = G;
    attn::rope_backward_inplace(in_place, 9, style, options);
    EXPECT_TRUE(attn_test::identical(in_place, dX));
    // A column-major matrix (the copy path) and a temporary block of a wider matrix.
    Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> column_major = G;
    attn::rope_backward_inplace(column_major, 9, style, options);
    EXPECT_TRUE(attn_test::identical(attn::Matrix<T>(column_major), dX));
    attn::Matrix<T> wide = attn::Matrix<T>::Zero(9, 8);
    wide.middleRows(1, 7) = G;
    attn::rope_backward_inplace(wide.middleRows(1, 7), 9, style, options);
    EXPECT_TRUE(attn_test::identical(wide.middleRows(1, 7), dX));
    EXPECT_TRUE(attn_test::all_zero(wide.row(0)));
    // The default options: omitted, `{}`, and the base shorthand.
    const attn::Matrix<T> plain = attn::rope_backward(G, 9, style, attn::RopeOptions<T>{});
    EXPECT_TRUE(attn_test::identical(attn::rope_backward(G, 9, style), plain));
    EXPECT_TRUE(attn_test::identical(attn::rope_backward(G, 9, style, {}), plain));
    EXPECT_TRUE(attn_test::identical(attn::rope_backward(G, 9, style, 10000), plain));
    attn::RopeOptions<T> llama;
    llama.base = T(500000);
    EXPECT_TRUE(attn_test::identical(attn::rope_backward(G, 9, style, 500000),
                                     attn::rope_backward(G, 9, style, llama)));
    attn::Matrix<T> plain_in_place = G;
    attn::rope_backward_inplace(plain_in_place, 9, style);
    EXPECT_TRUE(attn_test::identical(plain_in_place, plain));
    // The forward is unchanged by the backward's sign: rope's rotation is not its transpose.
    EXPECT_FALSE(attn_test::identical(attn::rope(G, 9, style), plain));
  }
}

TEST(RopeErrors, BackwardBadArguments) {
  const attn::Matrix<float> odd = attn::Matrix<float>::Zero(2, 5);
  expect_shape_error([&] { attn::rope_backward(odd, 0, RopeStyle::Half); },
                     {"attn::rope_backward", "rotary_dim", "5"});
  const attn::Matrix<float> dY = attn::Matrix<float>::Zero(2, 4);
  expect_shape_error([&] { attn::rope_backward(dY, -2, RopeStyle::Half); },
                     {"attn::rope_backward", "offset", "-2", "dY is 2 x 4"});
  expect_shape_error([&] { attn::rope_backward(dY, 0, RopeStyle::Half, 0.0f); }, {"base"});
  attn::RopeOptions<float> options;
  options.rotary_dim = 6;
  expect_shape_error([&] { attn::rope_backward(dY, 0, RopeStyle::Interleaved, options); },
                     {"attn::rope_backward", "rotary_dim", "6"});
  attn::RopeOptions<float> yarn = yarn_options<float>(4.0f, 32);
  yarn.linear_scale = 2.0f;
  expect_shape_error([&] { attn::rope_backward(dY, 0, RopeStyle::Half, yarn); },
                     {"attn::rope_backward", "yarn_factor = 4", "linear_scale = 2"});
  attn::Matrix<float> in_place = dY;
  expect_shape_error([&] { attn::rope_backward_inplace(in_place, -1, RopeStyle::Half); },
                     {"attn::rope_backward_inplace", "offset", "-1", "dY is 2 x 4"});
  Eigen::MatrixXf column_major = Eigen::MatrixXf::Zero(2, 4);
  expect_shape_error(
      [&] { attn::rope_backward_inplace(column_major, 0, RopeStyle::Half, options); },
      {"attn::rope_backward_inplace", "rotary_dim", "6"});
}

}  // namespace
