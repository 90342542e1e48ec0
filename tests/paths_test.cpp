/// detail/paths.hpp and detail/score_rule.hpp, through the public calls: every path (the
/// materialised table, the tiled kernel on both sides of the crossover, the decoding kernel and its
/// fallback width, the cache with a window and pinned tokens, the heads, the layer) follows the
/// one score rule:
/// - `query_offset` (any sign) and `window_right`, alone and with causal masks and left windows,
///   against the long-double reference `attn_test::naive_attention`;
/// - per-head masks and biases in `attention_heads`;
/// - the NaN rule of API.md: a NaN in anything a row uses makes that output row NaN; a key or
///   value that a row may not attend never reaches it, whatever it holds.

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Causal;
using attn::Index;
using attn_test::LMatrix;

template <class T>
class Paths : public ::testing::Test {};
TYPED_TEST_SUITE(Paths, attn_test::ScalarTypes);

template <class T>
constexpr T nan_v = std::numeric_limits<T>::quiet_NaN();

/// Every row in `rows` holds a NaN (a NaN value reaches only its own output column; a NaN query
/// or key reaches every column), and every other row is finite.
template <class D>
::testing::AssertionResult nan_rows_exactly(const Eigen::DenseBase<D>& out,
                                            const std::vector<bool>& rows) {
  for (Index i = 0; i < out.rows(); ++i) {
    bool has_nan = false;
    bool finite = true;
    for (Index c = 0; c < out.cols(); ++c) {
      has_nan = has_nan || std::isnan(out(i, c));
      finite = finite && std::isfinite(out(i, c));
    }
    if (rows[static_cast<std::size_t>(i)] ? !has_nan : !finite) {
      return ::testing::AssertionFailure()
             << "row " << i << " should "
             << (rows[static_cast<std::size_t>(i)] ? "hold a NaN" : "be finite") << " but is "
             << out.row(i);
    }
  }
  return ::testing::AssertionSuccess();
}

/// The single-head calls (every path they can take) on one problem, each against the reference.
template <class T>
void expect_single_head_paths(const attn::Matrix<T>& Q, const attn::Matrix<T>& K,
                              const attn::Matrix<T>& V, const attn::AttentionOptions<T>& options,
                              const std::string& where) {
  const LMatrix expected = attn_test::naive_attention<T>(Q, K, V, options).output;
  EXPECT_TRUE(attn_test::near_t<T>(attn::scaled_dot_product_attention(Q, K, V, options), expected))
      << "sdpa, " << where;
  EXPECT_TRUE(attn_test::near_t<T>(attn::attention_with_weights(Q, K, V, options).output, expected))
      << "materialised, " << where;
  EXPECT_TRUE(attn_test::near_t<T>(attn::trace_attention(Q, K, V, options).output, expected))
      << "trace, " << where;
  EXPECT_TRUE(attn_test::near_t<T>(attn::flash_attention(Q, K, V, options), expected))
      << "tiled, " << where;
  EXPECT_TRUE(attn_test::near_t<T>(attn::flash_attention(Q, K, V, options, attn::FlashTiles{7, 13}),
                                   expected))
      << "tiled 7 x 13, " << where;
}

TYPED_TEST(Paths, QueryOffsetAndRightWindowOnEverySingleHeadPath) {
  using T = TypeParam;
  std::mt19937 rng(31);
  // n x m: small (materialised), one query (decode, vectorised width 16 and fallback width 5),
  // and one large enough for the tiled path (n m > 256 x 256).
  struct Shape {
    Index n, m, d, d_v;
  };
  for (const Shape shape :
       {Shape{9, 14, 8, 6}, Shape{1, 70, 16, 16}, Shape{1, 37, 5, 3}, Shape{260, 270, 8, 4}}) {
    const attn::Matrix<T> Q = attn_test::random_matrix<T>(shape.n, shape.d, rng);
    const attn::Matrix<T> K = attn_test::random_matrix<T>(shape.m, shape.d, rng);
    const attn::Matrix<T> V = attn_test::random_matrix<T>(shape.m, shape.d_v, rng);
    for (const Causal causal : {Causal::None, Causal::TopLeft, Causal::BottomRight}) {
      for (const Index offset : {-3, 0, 5, 12}) {
        for (const std::optional<Index> left : {std::optional<Index>{}, std::optional<Index>{2}}) {
          for (const std::optional<Index> right :
               {std::optional<Index>{}, std::optional<Index>{0}, std::optional<Index>{3}}) {
            attn::AttentionOptions<T> options;
            options.causal = causal;
            options.query_offset = offset;
            options.window = left;
            options.window_right = right;
            const std::string where = std::to_string(shape.n) + " x " + std::to_string(shape.m) +
                                      ", causal " + std::to_string(static_cast<int>(causal)) +
                                      ", offset " + std::to_string(offset) + ", left " +
                                      (left ? std::to_string(*left) : "-") + ", right " +
                                      (right ? std::to_string(*right) : "-");
            expect_single_head_paths<T>(Q, K, V, options, where);
          }
        }
      }
    }
  }
}

TYPED_TEST(Paths, RightWindowWithAlibiBiasAndSink) {
  using T = TypeParam;
  std::mt19937 rng(32);
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(11, 8, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(17, 8, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(17, 5, rng);
  attn::AttentionOptions<T> options;
  options.query_offset = 4;
  options.window = 3;
  options.window_right = 2;
  options.alibi_slope = T(0.25);
  options.sink = T(0.5);
  options.softcap = T(3);
  options.bias = attn_test::random_matrix<T>(11, 17, rng);
  (*options.bias)(2, 5) = -std::numeric_limits<T>::infinity();  // masks key 5 for query 2
  expect_single_head_paths<T>(Q, K, V, options, "alibi, bias, sink, softcap");
}

TYPED_TEST(Paths, HeadsWithPerHeadMasksBiasesAndOffsets) {
  using T = TypeParam;
  std::mt19937 rng(33);
  const Index heads = 4, kv_heads = 2, n = 6, m = 10, d = 8, d_v = 3;
  attn::Tensor3<T> Q(heads, n, d), K(kv_heads, m, d), V(kv_heads, m, d_v);
  for (Index h = 0; h < heads; ++h)
    attn::detail::slice(Q, h) = attn_test::random_matrix<T>(n, d, rng);
  for (Index h = 0; h < kv_heads; ++h) {
    attn::detail::slice(K, h) = attn_test::random_matrix<T>(m, d, rng);
    attn::detail::slice(V, h) = attn_test::random_matrix<T>(m, d_v, rng);
  }
  attn::AttentionOptions<T> options;
  options.causal = Causal::TopLeft;
  options.query_offset = 3;
  options.window_right = 1;
  attn::HeadOptions<T> per_head;
  per_head.masks = attn::HeadMask(heads, n, m);
  per_head.biases = attn::Tensor3<T>(heads, n, m);
  std::bernoulli_distribution keep(0.8);
  for (Index k = 0; k < per_head.masks->size(); ++k) per_head.masks->data()[k] = keep(rng);
  per_head.biases->setRandom();
  const attn::Tensor3<T> out = attn::attention_heads(Q, K, V, options, per_head);
  attn::Tensor3<T> into(1, 1, 1);
  attn::attention_heads(Q, K, V, options, per_head, into);
  for (Index h = 0; h < heads; ++h) {
    attn::AttentionOptions<T> single = options;
    single.mask = attn::Mask(n, m);
    single.bias = attn::Matrix<T>(n, m);
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < m; ++j) {
        (*single.mask)(i, j) = (*per_head.masks)(h, i, j);
        (*single.bias)(i, j) = (*per_head.biases)(h, i, j);
      }
    }
    const LMatrix expected =
        attn_test::naive_attention<T>(attn::detail::slice(Q, h), attn::detail::slice(K, h / 2),
                                      attn::detail::slice(V, h / 2), single)
            .output;
    EXPECT_TRUE(attn_test::near_t<T>(attn::detail::slice(out, h), expected)) << "head " << h;
    EXPECT_TRUE(attn_test::identical(attn::detail::slice(into, h), attn::detail::slice(out, h)));
  }
  per_head.masks = attn::HeadMask(heads, n, m + 1);
  attn_test::expect_shape_error([&] { attn::attention_heads(Q, K, V, options, per_head); },
                                {"attention_heads", "masks is (4, 6, 11)", "6 x 10"});
}

TYPED_TEST(Paths, CacheQueryOffsetPlacesTheQueries) {
  using T = TypeParam;
  std::mt19937 rng(34);
  // ONNX's case: a cache of 8 past keys and 2 new ones, 4 queries at positions 8 .. 11
  // (query_offset = past length), causal.
  const attn::Matrix<T> K = attn_test::random_matrix<T>(10, 8, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(10, 4, rng);
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(4, 8, rng);
  attn::KVCache<T> cache(8, 4);
  cache.append(K, V);
  for (const std::optional<Index> right : {std::optional<Index>{}, std::optional<Index>{1}}) {
    attn::AttentionOptions<T> options;
    options.query_offset = 8;
    options.window_right = right;
    attn::AttentionOptions<T> reference = options;
    reference.causal = Causal::TopLeft;
    EXPECT_TRUE(attn_test::near_t<T>(cache.attend(Q, options),
                                     attn_test::naive_attention<T>(Q, K, V, reference).output));
  }
}

// --- The NaN rule ----------------------------------------------------------------------------

/// Single-head calls, n x m with d: a NaN query row, a NaN in a key and in a value that causal
/// masking hides from the early rows, and inf / NaN values behind a boolean mask.
template <class T>
void expect_nan_rule_single_head(Index n, Index m, Index d, const std::string& where) {
  std::mt19937 rng(35);
  const attn::Matrix<T> Q0 = attn_test::random_matrix<T>(n, d, rng);
  const attn::Matrix<T> K0 = attn_test::random_matrix<T>(m, d, rng);
  const attn::Matrix<T> V0 = attn_test::random_matrix<T>(m, d, rng);
  const auto every_path = [&](const attn::Matrix<T>& Q, const attn::Matrix<T>& K,
                              const attn::Matrix<T>& V, const attn::AttentionOptions<T>& options,
                              const std::vector<bool>& nan_rows, const std::string& what) {
    EXPECT_TRUE(nan_rows_exactly(attn::scaled_dot_product_attention(Q, K, V, options), nan_rows))
        << "sdpa, " << what << ", " << where;
    EXPECT_TRUE(nan_rows_exactly(attn::attention_with_weights(Q, K, V, options).output, nan_rows))
        << "materialised, " << what << ", " << where;
    EXPECT_TRUE(nan_rows_exactly(attn::trace_attention(Q, K, V, options).output, nan_rows))
        << "trace, " << what << ", " << where;
    EXPECT_TRUE(nan_rows_exactly(attn::flash_attention(Q, K, V, options), nan_rows))
        << "tiled, " << what << ", " << where;
    EXPECT_TRUE(
        nan_rows_exactly(attn::flash_attention(Q, K, V, options, attn::FlashTiles{5, 7}), nan_rows))
        << "tiled 5 x 7, " << what << ", " << where;
  };
  attn::AttentionOptions<T> causal;
  causal.causal = Causal::BottomRight;
  const Index shift = m - n;

  // 1. A NaN in query row r: that row only (every entry of it).
  const Index r = n / 2;
  attn::Matrix<T> Q = Q0;
  Q(r, d - 1) = nan_v<T>;
  std::vector<bool> rows(static_cast<std::size_t>(n), false);
  rows[static_cast<std::size_t>(r)] = true;
  every_path(Q, K0, V0, {}, rows, "NaN query row");
  every_path(Q, K0, V0, causal, rows, "NaN query row, causal");

  // 2. A NaN in key j (and separately in value j): the rows that may attend j (causal: i + shift
  //    >= j) are NaN, the earlier ones never see it.
  const Index j = std::max<Index>(shift + n / 2, 0);
  std::vector<bool> sees_j(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) sees_j[static_cast<std::size_t>(i)] = i + shift >= j;
  attn::Matrix<T> K = K0;
  K(j, 0) = nan_v<T>;
  every_path(Q0, K, V0, causal, sees_j, "NaN key, causal");
  attn::Matrix<T> V = V0;
  V(j, 0) = nan_v<T>;
  every_path(Q0, K0, V, causal, sees_j, "NaN value, causal");
  V(j, 1) = std::numeric_limits<T>::infinity();
  every_path(Q0, K0, V, causal, sees_j, "NaN and inf value, causal");

  // 3. Keys a boolean mask forbids (every other key) hold NaN and inf in K and V: no row is
  //    touched, and the result equals that of clean keys there.
  attn::AttentionOptions<T> masked;
  masked.mask = attn::Mask::Constant(n, m, true);
  attn::Matrix<T> K_poison = K0;
  attn::Matrix<T> V_poison = V0;
  for (Index c = 1; c < m; c += 2) {
    masked.mask->col(c).setConstant(false);
    K_poison(c, 0) = nan_v<T>;
    V_poison(c, 0) = c % 4 == 1 ? nan_v<T> : std::numeric_limits<T>::infinity();
  }
  every_path(Q0, K_poison, V_poison, masked, std::vector<bool>(static_cast<std::size_t>(n), false),
             "poisoned masked keys");
  EXPECT_TRUE(
      attn_test::near_t<T>(attn::scaled_dot_product_attention(Q0, K_poison, V_poison, masked),
                           attn_test::naive_attention<T>(Q0, K0, V0, masked).output))
      << where;
  // A -inf bias masks too, whatever the score (+inf score + -inf bias would be NaN).
  attn::AttentionOptions<T> biased;
  biased.bias = attn::Matrix<T>::Zero(n, m);
  for (Index c = 1; c < m; c += 2)
    biased.bias->col(c).setConstant(-std::numeric_limits<T>::infinity());
  attn::Matrix<T> K_inf = K_poison;
  for (Index c = 1; c < m; c += 2) K_inf(c, 1) = std::numeric_limits<T>::infinity();
  every_path(Q0, K_inf, V_poison, biased, std::vector<bool>(static_cast<std::size_t>(n), false),
             "-inf bias over poisoned keys");
}

// The path of `scaled_dot_product_attention` by size (`detail::choose_path`): decode for one query;
// the materialised table up to 32 x 32 scores or with fewer than 16 queries or keys; tiled beyond
// that, and wherever the table would pass 256 x 256 entries or K and V 1 MiB; materialised
// whenever the weights are wanted.
TEST(PathsChoice, TiledFromMoreThan32x32ScoresWithSixteenQueriesAndKeys) {
  using attn::detail::Path;
  const auto path = [](Index n, Index m, bool weights = false) {
    const attn::AttentionOptions<float> options;
    return attn::detail::choose_path(attn::detail::make_rule(options, n, m, 64), 64, 64, weights);
  };
  EXPECT_EQ(path(1, 300), Path::Decode);
  EXPECT_EQ(path(3, 3), Path::Materialised);
  EXPECT_EQ(path(32, 32), Path::Materialised);
  EXPECT_EQ(path(33, 32), Path::Tiled);
  EXPECT_EQ(path(16, 65), Path::Tiled);
  EXPECT_EQ(path(128, 128), Path::Tiled);
  EXPECT_EQ(path(15, 1000), Path::Materialised);
  EXPECT_EQ(path(300, 8), Path::Materialised);
  EXPECT_EQ(path(8, 10000), Path::Tiled);  // 80,000 scores
  EXPECT_EQ(path(4, 2100), Path::Tiled);   // K and V: 2100 x 128 floats, above 1 MiB
  EXPECT_EQ(path(128, 128, true), Path::Materialised);
}

// Each option is a stage of the score rule, and the kernels' shortcuts are the rule's folds over
// its stages: an option set alone must make a tile go through `apply` (changes_scores), keep one
// query off the decoding kernel unless it is uniform (has_per_entry), and enter the backward's
// chain rule unless it is linear (has_slope). A stage left out of the rule's lists fails here.
TEST(PathsChoice, EveryOptionIsSeenByTheKernelsShortcuts) {
  using attn::detail::Path;
  const Index n = 1, m = 40;
  const attn::Mask mask = attn::Mask::Constant(n, m, true);
  const attn::Matrix<float> bias = attn::Matrix<float>::Zero(n, m);
  struct Expected {
    const char* option;
    attn::AttentionOptions<float> options;
    bool per_entry;
    bool sloped;
  };
  std::vector<Expected> cases(4);
  cases[0].option = "softcap";
  cases[0].options.softcap = 30.0f;
  cases[0].sloped = true;
  cases[1].option = "alibi_slope";
  cases[1].options.alibi_slope = 0.5f;
  cases[1].per_entry = true;
  cases[2].option = "bias";
  cases[2].options.bias = bias;
  cases[2].per_entry = true;
  cases[3].option = "mask";
  cases[3].options.mask = mask;
  cases[3].per_entry = true;
  const attn::detail::ScoreRule<float> plain =
      attn::detail::make_rule(attn::AttentionOptions<float>{}, n, m, 64);
  EXPECT_FALSE(plain.changes_scores());
  EXPECT_FALSE(plain.has_per_entry());
  EXPECT_FALSE(plain.has_slope());
  for (const Expected& c : cases) {
    const attn::detail::ScoreRule<float> rule = attn::detail::make_rule(c.options, n, m, 64);
    EXPECT_TRUE(rule.changes_scores()) << c.option;
    EXPECT_EQ(rule.has_per_entry(), c.per_entry) << c.option;
    EXPECT_EQ(rule.has_slope(), c.sloped) << c.option;
    EXPECT_EQ(attn::detail::choose_path(rule, 64, 64, false),
              c.per_entry ? Path::Materialised : Path::Decode)
        << c.option;
  }
  attn::detail::ScoreRule<float> padded = plain;  // key padding, the layer's key_valid
  const bool valid[m] = {};
  padded.key_valid = {valid, 0};
  EXPECT_TRUE(padded.changes_scores());
  EXPECT_TRUE(padded.has_per_entry());
  EXPECT_TRUE(padded.masked_out(0, 1, 0, m));
}

TYPED_TEST(Paths, NanRuleMaterialisedTiledAndDecode) {
  using T = TypeParam;
  expect_nan_rule_single_head<T>(12, 20, 8, "materialised size");
  expect_nan_rule_single_head<T>(257, 260, 8, "tiled size");
  expect_nan_rule_single_head<T>(1, 90, 16, "decode, vectorised width");
  expect_nan_rule_single_head<T>(1, 90, 5, "decode, fallback width");
}

TYPED_TEST(Paths, NanRuleCacheWithWindowAndPinnedTokens) {
  using T = TypeParam;
  std::mt19937 rng(36);
  const Index n = 40, d = 16, w = 6;
  const attn::Matrix<T> Q0 = attn_test::random_matrix<T>(n, 2 * d, rng);  // 2 query heads
  const attn::Matrix<T> K0 = attn_test::random_matrix<T>(n, d, rng);
  const attn::Matrix<T> V0 = attn_test::random_matrix<T>(n, d, rng);
  for (const Index pinned : {0, 2}) {
    attn::KVCacheConfig<T> config;
    config.d_k = d;
    config.d_v = d;
    config.window = w;
    config.pinned_tokens = pinned;
    // A NaN in the value of position 10 (not pinned): positions 10 .. 10 + w see it, the others
    // never do (before it: causal; after it: the window).
    attn::Matrix<T> V = V0;
    V(10, 3) = nan_v<T>;
    // A NaN in query 25: that step only.
    attn::Matrix<T> Q = Q0;
    Q(25, d + 1) = nan_v<T>;  // head 1 of query 25
    attn::KVCache<T> cache(config);
    for (Index t = 0; t < n; ++t) {
      cache.append(K0.row(t), V.row(t));
      const attn::Matrix<T> out = cache.attend(Q.row(t));
      const bool sees_value = t >= 10 && t <= 10 + w;
      for (Index h = 0; h < 2; ++h) {
        const bool nan_row = sees_value || (t == 25 && h == 1);
        EXPECT_TRUE(nan_rows_exactly(out.middleCols(h * d, d), {nan_row}))
            << "position " << t << ", head " << h << ", pinned " << pinned;
      }
    }
    // A NaN in pinned position 1: every later query sees it (pinned rows ignore the window).
    if (pinned > 0) {
      attn::Matrix<T> K = K0;
      K(1, 0) = nan_v<T>;
      attn::KVCache<T> again(config);
      for (Index t = 0; t < n; ++t) {
        again.append(K.row(t), V0.row(t));
        EXPECT_TRUE(nan_rows_exactly(again.attend(Q0.row(t)), {t >= 1})) << "position " << t;
      }
    }
  }
}

TYPED_TEST(Paths, NanRuleHeadsAndLayer) {
  using T = TypeParam;
  std::mt19937 rng(37);
  const Index n = 20, m = 20, d = 8;
  attn::Tensor3<T> Q(4, n, d), K(2, m, d), V(2, m, d);
  Q.setRandom();
  K.setRandom();
  V.setRandom();
  attn::detail::slice(V, 1)(7, 2) = nan_v<T>;  // kv head 1 (query heads 2 and 3), position 7
  attn::AttentionOptions<T> causal;
  causal.causal = Causal::TopLeft;
  const attn::Tensor3<T> out = attn::attention_heads(Q, K, V, causal);
  for (Index h = 0; h < 4; ++h) {
    std::vector<bool> rows(static_cast<std::size_t>(n));
    for (Index i = 0; i < n; ++i) rows[static_cast<std::size_t>(i)] = h >= 2 && i >= 7;
    EXPECT_TRUE(nan_rows_exactly(attn::detail::slice(out, h), rows)) << "head " << h;
  }
  // The layer at 300 tokens (the tiled path inside): a NaN in token 100's embedding reaches
  // tokens 100 .. 299 through its key and value, and none before it.
  const attn::MultiHeadAttention<T> layer({16, 2}, 3);
  for (const Index tokens : {Index(30), Index(300)}) {
    attn::Matrix<T> X = attn_test::random_matrix<T>(tokens, 16, rng);
    const Index t = tokens / 3;
    X(t, 5) = nan_v<T>;
    attn::MultiHeadOptions<T> options;
    options.causal = Causal::BottomRight;
    std::vector<bool> rows(static_cast<std::size_t>(tokens));
    for (Index i = 0; i < tokens; ++i) rows[static_cast<std::size_t>(i)] = i >= t;
    EXPECT_TRUE(nan_rows_exactly(layer.forward(X, options), rows)) << tokens << " tokens";
  }
}

TYPED_TEST(Paths, SplitDecodingStepEqualsTheWholeAndIgnoresTheThreadCount) {
  using T = TypeParam;
  std::mt19937 rng(39);
  // One key/value head, one query: more keys than one part (detail::decode_part_keys = 2048), so
  // the step is split into parts merged by log-sum-exp; with a sink, a window and a query offset.
  const Index m = 5000, d = 16;
  const attn::Matrix<T> q = attn_test::random_matrix<T>(1, d, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(m, d, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(m, d, rng);
  for (const bool with_options : {false, true}) {
    attn::AttentionOptions<T> options;
    if (with_options) {
      options.sink = T(1.5);
      options.softcap = T(5);
      options.causal = Causal::TopLeft;
      options.query_offset = 4500;
      options.window = 4200;  // keys 300 .. 4500: parts of 2048, 2048 and 105 keys
    }
    const LMatrix expected = attn_test::naive_attention<T>(q, K, V, options).output;
    attn::Matrix<T> one, two;
    {
      const attn_test::ThreadCount threads(1);
      one = attn::scaled_dot_product_attention(q, K, V, options);
    }
    {
      const attn_test::ThreadCount threads(2);
      two = attn::scaled_dot_product_attention(q, K, V, options);
    }
    EXPECT_TRUE(attn_test::near_t<T>(one, expected)) << "options " << with_options;
    EXPECT_TRUE(attn_test::identical(one, two)) << "options " << with_options;
    // The same step through a cache of one key/value head and 4 query heads (stacked).
    attn::KVCache<T> cache(d, d);
    cache.append(K, V);
    const attn::Matrix<T> q4 = attn_test::random_matrix<T>(1, 4 * d, rng);
    attn::AttentionOptions<T> cache_options;
    cache_options.sink = options.sink;
    const attn::Matrix<T> stacked = cache.attend(q4, cache_options);
    for (Index h = 0; h < 4; ++h) {
      attn::AttentionOptions<T> single = cache_options;
      single.causal = Causal::BottomRight;
      EXPECT_TRUE(attn_test::near_t<T>(
          stacked.middleCols(h * d, d),
          attn_test::naive_attention<T>(attn::Matrix<T>(q4.middleCols(h * d, d)), K, V, single)
              .output))
          << "head " << h;
    }
  }
}

// --- Options are never cut down ----------------------------------------------------------------

using Mf = attn::Matrix<float>;
using T3f = attn::Tensor3<float>;

/// Whether each call compiles with this options type: they must for `AttentionOptions` and `{}`,
/// and must not for `MultiHeadOptions` (whose key_valid, weight flags and per-head values the call
/// would otherwise drop without a word).
#define ATTN_TEST_DETECT(name, call)     \
  template <class Options, class = void> \
  struct name : std::false_type {};      \
  template <class Options>               \
  struct name<Options, std::void_t<decltype(call)>> : std::true_type {};
ATTN_TEST_DETECT(sdpa_takes, attn::scaled_dot_product_attention(std::declval<const Mf&>(),
                                                                std::declval<const Mf&>(),
                                                                std::declval<const Mf&>(),
                                                                std::declval<const Options&>()))
ATTN_TEST_DETECT(sdpa_into_takes, attn::scaled_dot_product_attention(std::declval<const Mf&>(),
                                                                     std::declval<const Mf&>(),
                                                                     std::declval<const Mf&>(),
                                                                     std::declval<const Options&>(),
                                                                     std::declval<Mf&>()))
ATTN_TEST_DETECT(weights_takes,
                 attn::attention_with_weights(std::declval<const Mf&>(), std::declval<const Mf&>(),
                                              std::declval<const Mf&>(),
                                              std::declval<const Options&>()))
ATTN_TEST_DETECT(flash_takes,
                 attn::flash_attention(std::declval<const Mf&>(), std::declval<const Mf&>(),
                                       std::declval<const Mf&>(), std::declval<const Options&>(),
                                       attn::FlashTiles{}))
ATTN_TEST_DETECT(heads_takes,
                 attn::attention_heads(std::declval<const T3f&>(), std::declval<const T3f&>(),
                                       std::declval<const T3f&>(), std::declval<const Options&>(),
                                       std::declval<T3f&>()))
ATTN_TEST_DETECT(cache_takes,
                 std::declval<const attn::KVCache<float>&>().attend(std::declval<const Mf&>(),
                                                                    std::declval<const Options&>(),
                                                                    attn::HeadOptions<float>{}))
#undef ATTN_TEST_DETECT

TEST(PathsOptions, ExtendedOptionsAreRefusedNotCutDown) {
  using Plain = attn::AttentionOptions<float>;
  using Rich = attn::MultiHeadOptions<float>;
  static_assert(sdpa_takes<Plain>::value && !sdpa_takes<Rich>::value);
  static_assert(sdpa_into_takes<Plain>::value && !sdpa_into_takes<Rich>::value);
  static_assert(weights_takes<Plain>::value && !weights_takes<Rich>::value);
  static_assert(flash_takes<Plain>::value && !flash_takes<Rich>::value);
  static_assert(heads_takes<Plain>::value && !heads_takes<Rich>::value);
  static_assert(cache_takes<Plain>::value && !cache_takes<Rich>::value);
  // `{}` still means "no options" everywhere, and equals the defaults.
  std::mt19937 rng(38);
  const Mf Q = attn_test::random_matrix<float>(3, 4, rng);
  EXPECT_TRUE(attn_test::identical(attn::scaled_dot_product_attention(Q, Q, Q, {}),
                                   attn::scaled_dot_product_attention(Q, Q, Q)));
  EXPECT_TRUE(
      attn_test::identical(attn::flash_attention(Q, Q, Q, {}), attn::flash_attention(Q, Q, Q)));
  T3f q(2, 3, 4);
  q.setRandom();
  const T3f a = attn::attention_heads(q, q, q, {});
  const T3f b = attn::attention_heads(q, q, q);
  EXPECT_TRUE(attn_test::identical(attn::detail::slice(a, 1), attn::detail::slice(b, 1)));
}

}  // namespace
