/// Tests of backward.hpp: `attention_backward` (both paths, every option), `softmax_rows_backward`
/// and `flash_attention_backward`, against PyTorch's autograd (tests/data/sdpa_grad_*.json),
/// against central differences of the long-double reference (`attn::gradcheck`), against each
/// other, across thread counts, and on the NaN and masking rules of API.md.

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <attn/gradcheck.hpp>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Index;
using Md = attn::Matrix<double>;
constexpr double infinity = std::numeric_limits<double>::infinity();
constexpr double nan_value = std::numeric_limits<double>::quiet_NaN();

template <class T>
class BackwardTyped : public ::testing::Test {};
TYPED_TEST_SUITE(BackwardTyped, attn_test::ScalarTypes);

/// Gradients are sums of products of cancelling terms (dP - D): float gets a wider allowance than
/// the forward's.
template <class T>
double grad_rel() {
  return 20 * attn_test::Tol<T>::rel;
}
template <class T>
double grad_abs() {
  return 20 * attn_test::Tol<T>::abs;
}

template <class T>
::testing::AssertionResult grads_near(const attn::AttentionGrads<T>& a,
                                      const attn::AttentionGrads<T>& b, double rel, double abs) {
  for (const auto& [name, x, y] : {std::tuple{"dQ", &a.dQ, &b.dQ},
                                   {"dK", &a.dK, &b.dK},
                                   {"dV", &a.dV, &b.dV},
                                   {"dbias", &a.dbias, &b.dbias}}) {
    const ::testing::AssertionResult r = attn_test::near(*x, *y, rel, abs);
    if (!r) return ::testing::AssertionFailure() << name << ": " << r.message();
  }
  const double ds = std::abs(static_cast<double>(a.dsink - b.dsink));
  if (!(ds <= abs + rel * std::abs(static_cast<double>(b.dsink)))) {
    return ::testing::AssertionFailure() << "dsink " << a.dsink << " vs " << b.dsink;
  }
  return ::testing::AssertionSuccess();
}

template <class T>
::testing::AssertionResult grads_identical(const attn::AttentionGrads<T>& a,
                                           const attn::AttentionGrads<T>& b) {
  for (const auto& [name, x, y] : {std::tuple{"dQ", &a.dQ, &b.dQ},
                                   {"dK", &a.dK, &b.dK},
                                   {"dV", &a.dV, &b.dV},
                                   {"dbias", &a.dbias, &b.dbias}}) {
    const ::testing::AssertionResult r = attn_test::identical(*x, *y);
    if (!r) return ::testing::AssertionFailure() << name << ": " << r.message();
  }
  if (!(a.dsink == b.dsink || (std::isnan(a.dsink) && std::isnan(b.dsink)))) {
    return ::testing::AssertionFailure() << "dsink " << a.dsink << " vs " << b.dsink;
  }
  return ::testing::AssertionSuccess();
}

// ------------------------------------------------------------------------------------------------
// PyTorch autograd reference cases
// ------------------------------------------------------------------------------------------------

TYPED_TEST(BackwardTyped, MatchesPyTorchAutograd) {
  using T = TypeParam;
  for (const std::string name : {"sdpa_grad_full", "sdpa_grad_causal"}) {
    SCOPED_TRACE(name);
    const attn_test::Case c = attn_test::load_case(name);
    const attn::Matrix<T> Q = c.input<T>("Q");
    const attn::Matrix<T> K = c.input<T>("K");
    const attn::Matrix<T> V = c.input<T>("V");
    const attn::Matrix<T> dO = c.input<T>("dO");
    const attn::AttentionOptions<T> options = c.options<T>();
    const double rel = attn_test::Tol<T>::rel;
    const double abs = attn_test::Tol<T>::abs;

    const attn::AttentionGrads<T> g = attn::attention_backward(Q, K, V, dO, options);
    EXPECT_TRUE(attn_test::near(g.dQ, c.expected<T>("dQ"), rel, abs));
    EXPECT_TRUE(attn_test::near(g.dK, c.expected<T>("dK"), rel, abs));
    EXPECT_TRUE(attn_test::near(g.dV, c.expected<T>("dV"), rel, abs));
    EXPECT_EQ(g.dbias.size(), 0);
    EXPECT_EQ(g.dsink, T(0));

    // From the forward's own output and log-sum-exp.
    attn::Vector<T> lse;
    const attn::Matrix<T> O = attn::flash_attention(Q, K, V, options, lse);
    EXPECT_TRUE(attn_test::near(O, c.expected<T>("output"), rel, abs));
    const attn::AttentionGrads<T> f = attn::attention_backward(Q, K, V, O, lse, dO, options);
    EXPECT_TRUE(attn_test::near(f.dQ, c.expected<T>("dQ"), rel, abs));
    EXPECT_TRUE(attn_test::near(f.dK, c.expected<T>("dK"), rel, abs));
    EXPECT_TRUE(attn_test::near(f.dV, c.expected<T>("dV"), rel, abs));

    // The tiled kernel, with tiles smaller than the case.
    const attn::AttentionGrads<T> t =
        attn::flash_attention_backward(Q, K, V, dO, options, attn::BackwardTiles{2, 3});
    EXPECT_TRUE(attn_test::near(t.dQ, c.expected<T>("dQ"), rel, abs));
    EXPECT_TRUE(attn_test::near(t.dK, c.expected<T>("dK"), rel, abs));
    EXPECT_TRUE(attn_test::near(t.dV, c.expected<T>("dV"), rel, abs));
  }
}

// ------------------------------------------------------------------------------------------------
// Central differences of the long-double reference, every option
// ------------------------------------------------------------------------------------------------

/// One configuration of the options, with the smallest shape it is meant for (the tests draw
/// larger random shapes): `set(options, rng, n, m)` fills the options for n queries and m keys.
struct OptionCase {
  std::string name;
  Index n, m;
  std::function<void(attn::AttentionOptions<double>&, std::mt19937&, Index, Index)> set;
};

std::vector<OptionCase> option_cases() {
  using O = attn::AttentionOptions<double>;
  const auto random_mask = [](O& o, std::mt19937& rng, Index n, Index m) {
    attn::Mask mask(n, m);
    std::bernoulli_distribution keep(0.7);
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < m; ++j) mask(i, j) = keep(rng);
    }
    mask.row(1).setConstant(false);  // a row that sees nothing
    o.mask = mask;
  };
  const auto random_bias = [](O& o, std::mt19937& rng, Index n, Index m) {
    Md bias = attn_test::random_matrix<double>(n, m, rng);
    bias(0, 2) = -infinity;  // a -inf bias masks
    bias(3, 0) = -infinity;
    o.bias = bias;
  };
  return {
      {"none", 5, 7, [](O&, std::mt19937&, Index, Index) {}},
      {"causal_top_left", 5, 7,
       [](O& o, std::mt19937&, Index, Index) { o.causal = attn::Causal::TopLeft; }},
      {"causal_bottom_right_more_queries", 7, 5,
       [](O& o, std::mt19937&, Index, Index) { o.causal = attn::Causal::BottomRight; }},
      {"causal_query_offset", 5, 8,
       [](O& o, std::mt19937&, Index, Index) {
         o.causal = attn::Causal::TopLeft;
         o.query_offset = -2;
       }},
      {"window_causal", 6, 8,
       [](O& o, std::mt19937&, Index, Index) {
         o.causal = attn::Causal::BottomRight;
         o.window = 2;
       }},
      {"window_both_sides", 6, 6,
       [](O& o, std::mt19937&, Index, Index) {
         o.window = 1;
         o.window_right = 2;
         o.query_offset = 1;
       }},
      {"mask", 5, 7, [=](O& o, std::mt19937& rng, Index n, Index m) { random_mask(o, rng, n, m); }},
      {"bias", 5, 7, [=](O& o, std::mt19937& rng, Index n, Index m) { random_bias(o, rng, n, m); }},
      {"scale", 5, 7, [](O& o, std::mt19937&, Index, Index) { o.scale = 1.7; }},
      {"softcap", 5, 7,
       [](O& o, std::mt19937&, Index, Index) {
         o.scale = 2.5;
         o.softcap = 1.5;
       }},
      {"alibi", 5, 7, [](O& o, std::mt19937&, Index, Index) { o.alibi_slope = 0.4; }},
      {"sink", 5, 7, [](O& o, std::mt19937&, Index, Index) { o.sink = 0.6; }},
      {"everything", 6, 9,
       [=](O& o, std::mt19937& rng, Index n, Index m) {
         o.causal = attn::Causal::BottomRight;
         o.window = 4;
         o.window_right = 0;
         o.query_offset = 4;
         random_mask(o, rng, n, m);
         random_bias(o, rng, n, m);
         o.scale = 0.9;
         o.softcap = 2.0;
         o.alibi_slope = 0.3;
         o.sink = -0.4;
       }},
  };
}

/// sum(attention(Q, K, V) o G) in long double, with the bias and sink taken from the inputs
/// (inputs: Q, K, V, then bias when the options have one, then the sink as a 1 x 1 matrix).
double reference_loss(const std::vector<Md>& x, attn::AttentionOptions<double> options,
                      const Md& G) {
  std::size_t next = 3;
  if (options.bias) options.bias = x[next++];
  if (options.sink) options.sink = x[next](0, 0);
  const attn_test::NaiveAttention r = attn_test::naive_attention(x[0], x[1], x[2], options);
  return static_cast<double>((r.output.array() * attn_test::to_long_double(G).array()).sum());
}

std::vector<Md> analytic(const attn::AttentionGrads<double>& g,
                         const attn::AttentionOptions<double>& options) {
  std::vector<Md> a = {g.dQ, g.dK, g.dV};
  if (options.bias) a.push_back(g.dbias);
  if (options.sink) a.push_back(Md::Constant(1, 1, g.dsink));
  return a;
}

TEST(BackwardGradcheck, EveryOptionOnBothPaths) {
  std::mt19937 rng(20261201);
  for (const OptionCase& oc : option_cases()) {
    SCOPED_TRACE(oc.name);
    for (int round = 0; round < 2; ++round) {
      // Random shapes from the case's own up: n + 0..2 queries, m + 0..3 keys, widths 1..5.
      const Index n = oc.n + std::uniform_int_distribution<Index>(0, 2)(rng);
      const Index m = oc.m + std::uniform_int_distribution<Index>(0, 3)(rng);
      const Index d = std::uniform_int_distribution<Index>(1, 5)(rng);
      const Index d_v = std::uniform_int_distribution<Index>(1, 5)(rng);
      SCOPED_TRACE(std::to_string(n) + " x " + std::to_string(m) + ", d " + std::to_string(d) +
                   ", d_v " + std::to_string(d_v));
      attn::AttentionOptions<double> options;
      oc.set(options, rng, n, m);
      std::vector<Md> x = {attn_test::random_matrix<double>(n, d, rng),
                           attn_test::random_matrix<double>(m, d, rng),
                           attn_test::random_matrix<double>(m, d_v, rng)};
      if (options.bias) x.push_back(*options.bias);
      if (options.sink) x.push_back(Md::Constant(1, 1, *options.sink));
      const Md G = attn_test::random_matrix<double>(n, d_v, rng);
      const auto loss = [&](const std::vector<Md>& inputs) {
        return reference_loss(inputs, options, G);
      };
      const attn::AttentionGrads<double> whole =
          attn::attention_backward(x[0], x[1], x[2], G, options);
      const attn::GradcheckResult a = attn::gradcheck(loss, x, analytic(whole, options));
      EXPECT_TRUE(a.passed) << "materialised: " << a.message;
      for (const attn::BackwardTiles tiles :
           {attn::BackwardTiles{2, 3}, attn::BackwardTiles{1, 1}}) {
        const attn::AttentionGrads<double> tiled =
            attn::flash_attention_backward(x[0], x[1], x[2], G, options, tiles);
        const attn::GradcheckResult b = attn::gradcheck(loss, x, analytic(tiled, options));
        EXPECT_TRUE(b.passed) << "tiled " << tiles.query_rows << " x " << tiles.key_cols << ": "
                              << b.message;
      }
    }
  }
}

TEST(BackwardGradcheck, SoftmaxRowsBackward) {
  std::mt19937 rng(7);
  Md S = attn_test::random_matrix<double>(4, 6, rng, 2.0);
  S(1, 3) = -infinity;
  const Md G = attn_test::random_matrix<double>(4, 6, rng);
  const auto loss = [&](const std::vector<Md>& x) {
    return (attn::softmax_rows(x[0]).array() * G.array()).sum();
  };
  const Md P = attn::softmax_rows(S);
  const Md dS = attn::softmax_rows_backward(P, G);
  EXPECT_EQ(dS(1, 3), 0.0);  // a masked entry gets exactly zero
  const attn::GradcheckResult r = attn::gradcheck(loss, {S}, {dS});
  EXPECT_TRUE(r.passed) << r.message;
  attn_test::expect_shape_error([&] { (void)attn::softmax_rows_backward(P, G.leftCols(5)); },
                                {"softmax_rows_backward", "dP", "4 x 5", "4 x 6"});
}

// ------------------------------------------------------------------------------------------------
// The tiled kernel against the materialised one; thread counts; the overload from the forward
// ------------------------------------------------------------------------------------------------

TYPED_TEST(BackwardTyped, TiledEqualsMaterialised) {
  using T = TypeParam;
  std::mt19937 rng(11);
  for (const OptionCase& oc : option_cases()) {
    SCOPED_TRACE(oc.name);
    // The options on a larger shape, across several key tiles.
    const Index n = 37 + oc.n;
    const Index m = 41 + oc.m;
    attn::AttentionOptions<double> od;
    oc.set(od, rng, n, m);
    attn::AttentionOptions<T> options;
    options.causal = od.causal;
    options.window = od.window;
    options.window_right = od.window_right;
    options.query_offset = od.query_offset;
    if (od.scale) options.scale = static_cast<T>(*od.scale);
    if (od.softcap) options.softcap = static_cast<T>(*od.softcap);
    if (od.alibi_slope) options.alibi_slope = static_cast<T>(*od.alibi_slope);
    if (od.sink) options.sink = static_cast<T>(*od.sink);
    options.mask = od.mask;
    if (od.bias) options.bias = od.bias->template cast<T>();
    const attn::QKV<T> x = attn_test::random_qkv<T>(n, m, 16, 8, 5);
    const attn::Matrix<T> dO = attn_test::random_matrix<T>(n, 8, rng);
    const attn::AttentionGrads<T> whole = attn::attention_backward(x.Q, x.K, x.V, dO, options);
    for (const attn::BackwardTiles tiles :
         {attn::BackwardTiles{7, 13}, attn::BackwardTiles{64, 64}, attn::BackwardTiles{1, 40}}) {
      SCOPED_TRACE(std::to_string(tiles.query_rows) + " x " + std::to_string(tiles.key_cols));
      const attn::AttentionGrads<T> tiled =
          attn::flash_attention_backward(x.Q, x.K, x.V, dO, options, tiles);
      EXPECT_TRUE(grads_near(tiled, whole, grad_rel<T>(), grad_abs<T>()));
    }
  }
}

TEST(Backward, SameBitsForAnyThreadCount) {
  std::mt19937 rng(3);
  for (const auto& [n, m] : {std::pair<Index, Index>{300, 333}, {40, 50}}) {
    attn::AttentionOptions<float> options;
    options.causal = attn::Causal::BottomRight;
    options.bias = attn_test::random_matrix<float>(n, m, rng);
    options.sink = 0.5f;
    const attn::QKV<float> x = attn_test::random_qkv<float>(n, m, 32, 24, 9);
    const attn::Matrix<float> dO = attn_test::random_matrix<float>(n, 24, rng);
    const auto run = [&](int threads) {
      const attn_test::ThreadCount count(threads);
      return attn::attention_backward(x.Q, x.K, x.V, dO, options);
    };
    const attn::AttentionGrads<float> one = run(1);
    for (const int threads : {2, 3, 5}) {
      SCOPED_TRACE(std::to_string(n) + " x " + std::to_string(m) + ", " + std::to_string(threads) +
                   " threads");
      EXPECT_TRUE(grads_identical(run(threads), one));
    }
  }
}

TEST(Backward, FromTheForwardEqualsRecomputing) {
  std::mt19937 rng(4);
  // 300 x 300 is beyond the crossover: both run the tiled kernels, on the same forward.
  const attn::QKV<float> x = attn_test::random_qkv<float>(300, 300, 16, 16, 21);
  const attn::Matrix<float> dO = attn_test::random_matrix<float>(300, 16, rng);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::TopLeft;
  attn::Vector<float> lse;
  const attn::Matrix<float> O = attn::flash_attention(x.Q, x.K, x.V, options, lse);
  const attn::AttentionGrads<float> given =
      attn::attention_backward(x.Q, x.K, x.V, O, lse, dO, options);
  const attn::AttentionGrads<float> recomputed =
      attn::attention_backward(x.Q, x.K, x.V, dO, options);
  EXPECT_TRUE(grads_identical(given, recomputed));
  // Caller storage: reused, same result.
  attn::AttentionGrads<float> into;
  attn::attention_backward(x.Q, x.K, x.V, dO, options, into);
  const float* dq = into.dQ.data();
  attn::attention_backward(x.Q, x.K, x.V, dO, options, into);
  EXPECT_EQ(into.dQ.data(), dq);
  EXPECT_TRUE(grads_identical(into, recomputed));
}

// ------------------------------------------------------------------------------------------------
// Masked keys, empty rows, NaN
// ------------------------------------------------------------------------------------------------

TYPED_TEST(BackwardTyped, ForbiddenKeysGetExactlyZeroWhateverTheyHold) {
  using T = TypeParam;
  std::mt19937 rng(8);
  const T t_nan = std::numeric_limits<T>::quiet_NaN();
  const T t_inf = std::numeric_limits<T>::infinity();
  for (const auto& [n, m] : {std::pair<Index, Index>{6, 9}, {290, 300}}) {
    SCOPED_TRACE(std::to_string(n) + " x " + std::to_string(m));
    attn::QKV<T> x = attn_test::random_qkv<T>(n, m, 8, 5, 13);
    const attn::Matrix<T> dO = attn_test::random_matrix<T>(n, 5, rng);
    attn::AttentionOptions<T> options;
    attn::Mask mask = attn::Mask::Constant(n, m, true);
    mask.col(2).setConstant(false);  // key 2: no query may see it
    mask.row(1).setConstant(false);  // query 1 sees nothing
    options.mask = mask;
    attn::Matrix<T> bias = attn::Matrix<T>::Zero(n, m);
    bias.col(4).setConstant(-t_inf);  // key 4: masked by its bias
    options.bias = bias;
    const attn::AttentionGrads<T> clean = attn::attention_backward(x.Q, x.K, x.V, dO, options);
    // Poison the forbidden keys, their values and the empty row's query.
    x.K.row(2).setConstant(t_nan);
    x.V.row(2).setConstant(t_inf);
    x.K.row(4).setConstant(t_inf);
    x.V.row(4).setConstant(t_nan);
    x.Q.row(1).setConstant(t_nan);
    const attn::AttentionGrads<T> g = attn::attention_backward(x.Q, x.K, x.V, dO, options);
    for (const Index j : {2, 4}) {
      EXPECT_TRUE((g.dK.row(j).array() == T(0)).all()) << "dK row " << j << ": " << g.dK.row(j);
      EXPECT_TRUE((g.dV.row(j).array() == T(0)).all()) << "dV row " << j << ": " << g.dV.row(j);
      EXPECT_TRUE((g.dbias.col(j).array() == T(0)).all());
    }
    EXPECT_TRUE((g.dQ.row(1).array() == T(0)).all()) << g.dQ.row(1);
    EXPECT_TRUE((g.dbias.row(1).array() == T(0)).all());
    EXPECT_TRUE(grads_near(g, clean, grad_rel<T>(), grad_abs<T>()));
  }
}

TEST(Backward, NaNFollowsTheForwardRule) {
  std::mt19937 rng(10);
  for (const Index n : {Index{6}, Index{280}}) {
    SCOPED_TRACE(n);
    attn::QKV<double> x = attn_test::random_qkv<double>(n, n, 4, 3, 17);
    const Md dO = attn_test::random_matrix<double>(n, 3, rng);
    attn::AttentionOptions<double> options;
    options.causal = attn::Causal::TopLeft;
    x.Q(3, 1) = nan_value;  // query 3 sees keys 0..3
    const attn::AttentionGrads<double> g = attn::attention_backward(x.Q, x.K, x.V, dO, options);
    for (Index i = 0; i < n; ++i) {
      EXPECT_EQ(g.dQ.row(i).array().isNaN().all(), i == 3) << "dQ row " << i << ": " << g.dQ.row(i);
    }
    for (Index j = 0; j < n; ++j) {
      EXPECT_EQ(g.dK.row(j).array().isNaN().any(), j <= 3) << "dK row " << j << ": " << g.dK.row(j);
      EXPECT_EQ(g.dV.row(j).array().isNaN().any(), j <= 3) << "dV row " << j << ": " << g.dV.row(j);
    }
  }
}

TEST(Backward, ZeroSizedProblems) {
  const Md Q(0, 4), K(3, 4), V(3, 2), dO(0, 2);
  const attn::AttentionGrads<double> g = attn::attention_backward(Q, K, V, dO);
  EXPECT_EQ(g.dQ.rows(), 0);
  EXPECT_TRUE((g.dK.array() == 0.0).all() && g.dK.rows() == 3);
  EXPECT_TRUE((g.dV.array() == 0.0).all() && g.dV.rows() == 3);
  const Md Q2 = Md::Ones(2, 4), K2(0, 4), V2(0, 2), dO2 = Md::Ones(2, 2);
  const attn::AttentionGrads<double> h = attn::attention_backward(Q2, K2, V2, dO2);
  EXPECT_TRUE((h.dQ.array() == 0.0).all() && h.dQ.rows() == 2);
}

// ------------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------------

#define ATTN_TEST_DETECT(name, call)     \
  template <class Options, class = void> \
  struct name : std::false_type {};      \
  template <class Options>               \
  struct name<Options, std::void_t<decltype(call)>> : std::true_type {};
using Mf = attn::Matrix<float>;
ATTN_TEST_DETECT(backward_takes,
                 attn::attention_backward(std::declval<const Mf&>(), std::declval<const Mf&>(),
                                          std::declval<const Mf&>(), std::declval<const Mf&>(),
                                          std::declval<const Options&>()))
ATTN_TEST_DETECT(backward_from_forward_takes,
                 attn::attention_backward(std::declval<const Mf&>(), std::declval<const Mf&>(),
                                          std::declval<const Mf&>(), std::declval<const Mf&>(),
                                          std::declval<const attn::Vector<float>&>(),
                                          std::declval<const Mf&>(),
                                          std::declval<const Options&>()))
#undef ATTN_TEST_DETECT

TEST(BackwardErrors, ShapesOptionsAndRefusedOptionTypes) {
  static_assert(backward_takes<attn::AttentionOptions<float>>::value &&
                !backward_takes<attn::MultiHeadOptions<float>>::value);
  static_assert(backward_from_forward_takes<attn::AttentionOptions<float>>::value &&
                !backward_from_forward_takes<attn::MultiHeadOptions<float>>::value);
  const Md Q = Md::Ones(4, 3), K = Md::Ones(5, 3), V = Md::Ones(5, 2), dO = Md::Ones(4, 2);
  attn_test::expect_shape_error([&] { (void)attn::attention_backward(Q, K, V, dO.leftCols(1)); },
                                {"attention_backward", "dO", "4 x 1", "5 x 2"});
  attn_test::expect_shape_error([&] { (void)attn::attention_backward(Q, K, V, dO.topRows(3)); },
                                {"attention_backward", "dO", "3 x 2", "4 x 3"});
  attn_test::expect_shape_error([&] { (void)attn::attention_backward(Q, K.leftCols(2), V, dO); },
                                {"attention_backward", "K"});
  const attn::Vector<double> lse = attn::Vector<double>::Zero(4);
  attn_test::expect_shape_error(
      [&] { (void)attn::attention_backward(Q, K, V, dO, lse.head(3), dO); },
      {"attention_backward", "log_sum_exp", "4 entries", "3 x 1"});
  attn_test::expect_shape_error(
      [&] { (void)attn::attention_backward(Q, K, V, dO.leftCols(1), lse, dO); },
      {"attention_backward", "O", "4 x 1"});
  attn::AttentionOptions<double> bad;
  bad.window = -1;
  attn_test::expect_shape_error([&] { (void)attn::attention_backward(Q, K, V, dO, bad); },
                                {"attention_backward", "window"});
  attn_test::expect_shape_error(
      [&] {
        (void)attn::flash_attention_backward(Q, K, V, dO, {}, attn::BackwardTiles{0, 4});
      },
      {"flash_attention_backward", "tile"});
}

}  // namespace
