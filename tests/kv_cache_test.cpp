/// kv_cache.hpp: `KVCache` against attention over the whole sequence, computed independently by
/// `attn_test::naive_attention` (long double loops) with the causal / window / sink rules written
/// out as masks:
/// - token-by-token decoding and chunked prefill equal full causal attention (API.md's calls);
/// - a windowed cache equals `sliding_window_mask` attention, and stays within its memory bound
///   over 100,000 appended tokens;
/// - sink tokens (StreamingLLM) stay visible, with ALiBi, softcap and a sink logit on top;
/// - RoPE applied at append equals RoPE applied to the whole sequence (GQA, window, sinks);
/// - grouped-query storage: the stacked decoding path and the tensor calls equal per-head
/// attention;
/// - per-query-head ALiBi slopes and sinks (`MultiHeadOptions`) equal single-head
///   `scaled_dot_product_attention` with that head's values (windows, sink tokens, RoPE), and
///   equal per-head values equal the shared ones;
/// - shape errors, also of the per-head values.

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <cstddef>
#include <functional>
#include <initializer_list>
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
using attn::KVCache;
using attn::KVCacheConfig;
using attn::Mask;
using attn::RopeStyle;
using attn_test::LMatrix;

using attn_test::expect_shape_error;

/// The keys query i of a length-n sequence sees: j <= i, and with a window w, j >= i - w unless j
/// is one of the first `sinks` tokens (StreamingLLM).
Mask visible(Index n, std::optional<Index> window, Index sinks = 0) {
  Mask allowed(n, n);
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < n; ++j) {
      allowed(i, j) = j <= i && (!window || j >= i - *window || j < sinks);
    }
  }
  return allowed;
}

/// Naive attention of the whole sequence for one head, with `allowed` as the only mask.
template <class T>
LMatrix full_attention(const attn::Matrix<T>& Q, const attn::Matrix<T>& K, const attn::Matrix<T>& V,
                       const Mask& allowed, attn::AttentionOptions<T> options = {}) {
  options.mask = allowed;
  return attn_test::naive_attention<T>(Q, K, V, options).output;
}

/// Feeds the rows of K and V (and Q) to `cache` in chunks; returns the stacked outputs.
/// `options` are shared by the heads, `per_head` holds the per-head values.
template <class T>
attn::Matrix<T> decode(KVCache<T>& cache, const attn::Matrix<T>& Q, const attn::Matrix<T>& K,
                       const attn::Matrix<T>& V, const std::vector<Index>& chunks,
                       const attn::AttentionOptions<T>& options = {}, Index d_out = 0,
                       const attn::HeadOptions<T>& per_head = {}) {
  attn::Matrix<T> out(Q.rows(), d_out > 0 ? d_out : V.cols());
  Index t = 0;
  for (std::size_t c = 0; t < Q.rows(); ++c) {
    const Index r = std::min(chunks[c % chunks.size()], Q.rows() - t);
    cache.append(K.middleRows(t, r), V.middleRows(t, r));
    out.middleRows(t, r) = cache.attend(Q.middleRows(t, r), options, per_head);
    t += r;
  }
  return out;
}

/// Each query head's columns of `out` (heads of d_v columns, query head h reading key/value head
/// h / (heads / kv_heads)) equal naive attention of that head over the whole sequence with
/// `allowed` as its mask.
template <class T>
void expect_heads_equal_full_attention(const attn::Matrix<T>& out, const attn::Matrix<T>& Q,
                                       const attn::Matrix<T>& K, const attn::Matrix<T>& V,
                                       Index kv_heads, const Mask& allowed,
                                       const attn::AttentionOptions<T>& options,
                                       const std::string& where) {
  const Index d = K.cols() / kv_heads;
  const Index d_v = V.cols() / kv_heads;
  const Index heads = Q.cols() / d;
  for (Index h = 0; h < heads; ++h) {
    const Index kv = h / (heads / kv_heads);
    const LMatrix expected = full_attention<T>(
        attn::Matrix<T>(Q.middleCols(h * d, d)), attn::Matrix<T>(K.middleCols(kv * d, d)),
        attn::Matrix<T>(V.middleCols(kv * d_v, d_v)), allowed, options);
    EXPECT_TRUE(attn_test::near_t<T>(out.middleCols(h * d_v, d_v), expected))
        << "head " << h << " of " << heads << where;
  }
}

template <class T>
class KVCacheTest : public ::testing::Test {};
TYPED_TEST_SUITE(KVCacheTest, attn_test::ScalarTypes);

TYPED_TEST(KVCacheTest, TokenByTokenEqualsFullCausal) {
  using T = TypeParam;
  std::mt19937 rng(1);
  const Index n = 20;
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, 8, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(n, 8, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(n, 6, rng);
  const LMatrix expected = full_attention<T>(Q, K, V, visible(n, std::nullopt));
  KVCache<T> cache(8, 6);
  for (Index t = 0; t < n; ++t) {
    cache.append(K.row(t), V.row(t));
    EXPECT_EQ(cache.size(), t + 1);
    const attn::Matrix<T> out = cache.attend(Q.row(t));
    EXPECT_TRUE(attn_test::near_t<T>(out, expected.row(t))) << "token " << t;
  }
}

TYPED_TEST(KVCacheTest, ChunkedPrefillEqualsFullCausal) {
  using T = TypeParam;
  std::mt19937 rng(2);
  const Index n = 40;
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, 8, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(n, 8, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(n, 5, rng);
  const LMatrix expected = full_attention<T>(Q, K, V, visible(n, std::nullopt));
  KVCache<T> cache(8, 5);
  EXPECT_TRUE(attn_test::near_t<T>(decode(cache, Q, K, V, {7, 1, 5, 7, 20}), expected));
  EXPECT_EQ(cache.position(), n);
  EXPECT_EQ(cache.size(), n);
}

TYPED_TEST(KVCacheTest, WindowedEqualsSlidingWindowMask) {
  using T = TypeParam;
  std::mt19937 rng(3);
  const Index n = 37;
  const Index w = 4;
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, 8, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(n, 8, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(n, 6, rng);
  const LMatrix expected = full_attention<T>(Q, K, V, visible(n, w));
  attn::AttentionOptions<T> masked;
  masked.mask = attn::sliding_window_mask(n, n, w);
  const attn::Matrix<T> library = attn::scaled_dot_product_attention(Q, K, V, masked);
  for (const std::vector<Index>& chunks :
       {std::vector<Index>{1}, std::vector<Index>{3, 3, 1, 5, 8}}) {
    KVCache<T> cache(8, 6, w);
    const attn::Matrix<T> out = decode(cache, Q, K, V, chunks);
    EXPECT_TRUE(attn_test::near_t<T>(out, expected)) << "first chunk " << chunks[0];
    EXPECT_TRUE(attn_test::near_t<T>(out, library)) << "first chunk " << chunks[0];
    EXPECT_LE(cache.size(), w + 8);
  }
}

TEST(KVCacheMemory, BoundedOver100000TokensWithAWindow) {
  using T = float;
  const Index total = 100000;
  const Index w = 16;
  const Index sinks = 4;
  KVCacheConfig<T> config;
  config.d_k = 4;
  config.d_v = 3;
  config.window = w;
  config.pinned_tokens = sinks;
  KVCache<T> cache(config);
  std::mt19937 rng(4);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(total, 4, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(total, 3, rng);
  const attn::Matrix<T> q = attn_test::random_matrix<T>(1, 4, rng);
  const Index bound = sinks + 2 * (w + 1);  // sink rows + a ring of w + 1 rows stored twice
  Index max_capacity = 0;
  for (Index t = 0; t < total; ++t) {
    cache.append(K.row(t), V.row(t));
    max_capacity = std::max(max_capacity, cache.capacity());
    if (t % 24989 == 0 || t == total - 1) {
      EXPECT_EQ(cache.size(), std::min(t + 1, sinks + w + 1));
      // The one query at position t sees the sinks and the window: the naive reference over every
      // key appended so far, masked.
      Mask allowed = Mask::Constant(1, t + 1, false);
      for (Index j = 0; j <= t; ++j) allowed(0, j) = j < sinks || j >= t - w;
      attn::AttentionOptions<T> options;
      options.mask = allowed;
      const LMatrix expected =
          attn_test::naive_attention<T>(q, K.topRows(t + 1), V.topRows(t + 1), options).output;
      EXPECT_TRUE(attn_test::near_t<T>(cache.attend(q), expected)) << "token " << t;
    }
  }
  EXPECT_LE(max_capacity, bound);
  EXPECT_EQ(cache.position(), total);
  const std::vector<Index> positions = cache.key_positions();
  ASSERT_EQ(positions.size(), static_cast<std::size_t>(sinks + w + 1));
  EXPECT_EQ(positions[0], 0);
  EXPECT_EQ(positions[3], 3);
  EXPECT_EQ(positions[4], total - w - 1);
  EXPECT_EQ(positions.back(), total - 1);
}

TYPED_TEST(KVCacheTest, SinkTokensStayVisible) {
  using T = TypeParam;
  std::mt19937 rng(5);
  const Index n = 30;
  const Index w = 3;
  const Index sinks = 2;
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, 8, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(n, 8, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(n, 4, rng);
  attn::AttentionOptions<T> options;
  options.alibi_slope = T(0.25);
  options.softcap = T(5);
  options.sink = T(0.5);
  const LMatrix expected = full_attention<T>(Q, K, V, visible(n, w, sinks), options);
  KVCacheConfig<T> config;
  config.d_k = 8;
  config.d_v = 4;
  config.window = w;
  config.pinned_tokens = sinks;
  for (const std::vector<Index>& chunks :
       {std::vector<Index>{1}, std::vector<Index>{4}, std::vector<Index>{1, 6, 2}}) {
    KVCache<T> cache(config);
    EXPECT_TRUE(attn_test::near_t<T>(decode(cache, Q, K, V, chunks, options), expected))
        << "first chunk " << chunks[0];
    const std::vector<Index> positions = cache.key_positions();
    EXPECT_EQ(positions[0], 0);
    EXPECT_EQ(positions[1], 1);
    EXPECT_EQ(positions.back(), n - 1);
    EXPECT_TRUE(attn_test::identical(cache.keys().topRows(2), K.topRows(2)));
    EXPECT_TRUE(attn_test::identical(cache.keys().bottomRows(w + 1), K.bottomRows(w + 1)));
  }
}

TYPED_TEST(KVCacheTest, RopeAtAppendEqualsRopeOnTheWholeSequence) {
  using T = TypeParam;
  std::mt19937 rng(6);
  const Index n = 26;
  const Index heads = 4;
  const Index kv_heads = 2;
  const Index d = 8;
  const Index d_v = 3;
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, heads * d, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(n, kv_heads * d, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(n, kv_heads * d_v, rng);
  KVCacheConfig<T> config;
  config.d_k = d;
  config.d_v = d_v;
  config.kv_heads = kv_heads;
  config.window = 5;
  config.pinned_tokens = 1;
  config.rope = RopeStyle::Half;
  config.rope_options.rotary_dim = 6;
  config.rope_options.base = T(100);
  KVCache<T> cache(config);
  const attn::Matrix<T> out = decode(cache, Q, K, V, {3, 1, 1, 6}, {}, heads * d_v);
  for (Index h = 0; h < heads; ++h) {
    const Index kv = h / 2;
    const attn::Matrix<T> Q_h =
        attn::rope(Q.middleCols(h * d, d), 0, RopeStyle::Half, config.rope_options);
    const attn::Matrix<T> K_kv =
        attn::rope(K.middleCols(kv * d, d), 0, RopeStyle::Half, config.rope_options);
    const attn::Matrix<T> V_kv = V.middleCols(kv * d_v, d_v);
    const LMatrix expected = full_attention<T>(Q_h, K_kv, V_kv, visible(n, 5, 1));
    EXPECT_TRUE(attn_test::near_t<T>(out.middleCols(h * d_v, d_v), expected)) << "head " << h;
    if (h % 2 == 0) {  // the stored keys are the rotated rows of their positions
      const std::vector<Index> positions = cache.key_positions();
      const attn::Matrix<T> kept = cache.keys(kv);
      for (std::size_t r = 0; r < positions.size(); ++r) {
        EXPECT_TRUE(attn_test::near_t<T>(kept.row(static_cast<Index>(r)), K_kv.row(positions[r])));
      }
    }
  }
}

TYPED_TEST(KVCacheTest, GroupedQueryDecodingEqualsPerHeadAttention) {
  using T = TypeParam;
  std::mt19937 rng(7);
  const Index n = 18;
  const Index heads = 6;
  const Index kv_heads = 2;
  const Index d = 8;
  const Index d_v = 5;
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, heads * d, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(n, kv_heads * d, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(n, kv_heads * d_v, rng);
  attn::AttentionOptions<T> options;
  options.softcap = T(3);
  options.sink = T(-0.5);
  for (const std::optional<Index> window : {std::optional<Index>{}, std::optional<Index>{6}}) {
    KVCacheConfig<T> config;
    config.d_k = d;
    config.d_v = d_v;
    config.kv_heads = kv_heads;
    config.window = window;
    KVCache<T> cache(config);
    const attn::Matrix<T> out = decode(cache, Q, K, V, {1}, options, heads * d_v);
    expect_heads_equal_full_attention<T>(out, Q, K, V, kv_heads, visible(n, window), options,
                                         window ? ", windowed" : "");
    // The tensor calls: (heads, tokens, features) in and out, same numbers.
    KVCache<T> tensors(config);
    attn::Tensor3<T> K_t(kv_heads, n, d);
    attn::Tensor3<T> V_t(kv_heads, n, d_v);
    for (Index h = 0; h < kv_heads; ++h) {
      attn::detail::slice(K_t, h) = K.middleCols(h * d, d);
      attn::detail::slice(V_t, h) = V.middleCols(h * d_v, d_v);
    }
    tensors.append_heads(K_t, V_t);
    attn::Tensor3<T> Q_t(heads, 1, d);
    for (Index h = 0; h < heads; ++h) {
      attn::detail::slice(Q_t, h) = Q.block(n - 1, h * d, 1, d);
    }
    const attn::Tensor3<T> last = tensors.attend_heads(Q_t, options);
    for (Index h = 0; h < heads; ++h) {
      EXPECT_TRUE(
          attn_test::near_t<T>(attn::detail::slice(last, h), out.block(n - 1, h * d_v, 1, d_v)));
    }
  }
}

/// The vectorised decoding kernel (detail/decode.hpp: widths of whole packets, here 16) for groups
/// of 7 = 4 + 2 + 1 and 4 query heads per key/value head, token by token over 140 tokens (tiles of
/// 64 keys: partial, whole and several), with a softcap and a sink logit, with and without a
/// window: each step equals per-head attention over the whole sequence.
TYPED_TEST(KVCacheTest, VectorisedDecodingEqualsPerHeadAttention) {
  using T = TypeParam;
  std::mt19937 rng(8);
  const Index n = 140;
  const Index d = 16;
  for (const Index kv_heads : {1, 2}) {
    const Index heads = kv_heads == 1 ? 7 : 8;
    const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, heads * d, rng);
    const attn::Matrix<T> K = attn_test::random_matrix<T>(n, kv_heads * d, rng);
    const attn::Matrix<T> V = attn_test::random_matrix<T>(n, kv_heads * d, rng);
    attn::AttentionOptions<T> options;
    if (kv_heads == 2) {
      options.softcap = T(2);
      options.sink = T(0.25);
    }
    for (const std::optional<Index> window : {std::optional<Index>{}, std::optional<Index>{70}}) {
      KVCacheConfig<T> config;
      config.d_k = d;
      config.d_v = d;
      config.kv_heads = kv_heads;
      config.window = window;
      KVCache<T> cache(config);
      const attn::Matrix<T> out = decode(cache, Q, K, V, {1}, options, heads * d);
      expect_heads_equal_full_attention<T>(out, Q, K, V, kv_heads, visible(n, window), options,
                                           window ? ", windowed" : "");
    }
  }
}

// A decoding step keeps each thread's scratch between calls: after a one-thread step the calling
// thread's kept `DecodeScratch` holds that step's scaled queries (a group's 4 query heads), and a
// second step finds them where the first left them, writing the same output.
TEST(KVCacheHotPath, ARepeatedStepReusesTheThreadsScratch) {
  using T = float;
  using Kept = attn::detail::KeptScratch<attn::detail::DecodeScratch<T>>;
  const attn_test::ThreadCount one(1);
  std::mt19937 rng(12);
  const Index d = 16;
  KVCacheConfig<T> config;
  config.d_k = d;
  config.d_v = d;
  config.kv_heads = 2;
  KVCache<T> cache(config);
  cache.append(attn_test::random_matrix<T>(100, 2 * d, rng),
               attn_test::random_matrix<T>(100, 2 * d, rng));
  const attn::Matrix<T> q = attn_test::random_matrix<T>(1, 8 * d, rng);
  const attn::AttentionOptions<T> options;
  attn::Matrix<T> out;
  cache.attend(q, options, out);
  const attn::Matrix<T> first = out;
  const T* queries = nullptr;
  {
    Kept kept;
    ASSERT_EQ(kept.get().q_scaled.rows(), 4);
    ASSERT_EQ(kept.get().q_scaled.cols(), d);
    queries = kept.get().q_scaled.data();
  }
  cache.attend(q, options, out);
  Kept kept;
  EXPECT_EQ(kept.get().q_scaled.data(), queries);
  EXPECT_TRUE(attn_test::identical(out, first));
}

TYPED_TEST(KVCacheTest, PerHeadSlopesAndSinksEqualPerHeadAttention) {
  using T = TypeParam;
  std::mt19937 rng(8);
  const Index n = 23;
  const Index heads = 4;
  const Index kv_heads = 2;
  const Index d = 8;
  const Index d_v = 5;
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, heads * d, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(n, kv_heads * d, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(n, kv_heads * d_v, rng);
  attn::AttentionOptions<T> options;
  attn::HeadOptions<T> per_head;
  per_head.alibi_slopes = std::vector<T>{T(0.5), T(0.125), T(0), T(1)};
  per_head.sinks = std::vector<T>{T(0.5), T(-1), T(2), -std::numeric_limits<T>::infinity()};
  options.softcap = T(4);  // a shared option beside the per-head ones
  struct Setting {
    std::optional<Index> window;
    Index pinned_tokens;
    std::optional<RopeStyle> rope;
  };
  const Setting settings[] = {{std::nullopt, 0, std::nullopt},
                              {5, 0, std::nullopt},
                              {5, 2, std::nullopt},
                              {4, 1, RopeStyle::Half}};
  for (const Setting& setting : settings) {
    KVCacheConfig<T> config;
    config.d_k = d;
    config.d_v = d_v;
    config.kv_heads = kv_heads;
    config.window = setting.window;
    config.pinned_tokens = setting.pinned_tokens;
    config.rope = setting.rope;
    const std::string where = std::string(setting.window ? "window" : "no window") + ", " +
                              std::to_string(setting.pinned_tokens) + " pinned tokens" +
                              (setting.rope ? ", RoPE" : "");
    for (const std::vector<Index>& chunks :
         {std::vector<Index>{1}, std::vector<Index>{4, 1, 7, 3}}) {
      KVCache<T> cache(config);
      const attn::Matrix<T> out = decode(cache, Q, K, V, chunks, options, heads * d_v, per_head);
      for (Index h = 0; h < heads; ++h) {
        const Index kv = h / 2;
        attn::Matrix<T> Q_h = Q.middleCols(h * d, d);
        attn::Matrix<T> K_kv = K.middleCols(kv * d, d);
        const attn::Matrix<T> V_kv = V.middleCols(kv * d_v, d_v);
        if (setting.rope) {
          Q_h = attn::rope(Q_h, 0, *setting.rope);
          K_kv = attn::rope(K_kv, 0, *setting.rope);
        }
        // Head h alone: its slope and sink, and the cache's visibility as options (causal and
        // window) or, with sink tokens, as a mask.
        attn::AttentionOptions<T> single;
        single.softcap = options.softcap;
        single.alibi_slope = (*per_head.alibi_slopes)[static_cast<std::size_t>(h)];
        single.sink = (*per_head.sinks)[static_cast<std::size_t>(h)];
        if (setting.pinned_tokens == 0) {
          single.causal = Causal::BottomRight;
          single.window = setting.window;
        } else {
          single.mask = visible(n, setting.window, setting.pinned_tokens);
        }
        const attn::Matrix<T> library = attn::scaled_dot_product_attention(Q_h, K_kv, V_kv, single);
        const LMatrix naive = attn_test::naive_attention<T>(Q_h, K_kv, V_kv, single).output;
        EXPECT_TRUE(attn_test::near_t<T>(out.middleCols(h * d_v, d_v), library))
            << "head " << h << ", " << where << ", first chunk " << chunks[0];
        EXPECT_TRUE(attn_test::near_t<T>(out.middleCols(h * d_v, d_v), naive))
            << "head " << h << ", " << where << ", first chunk " << chunks[0];
      }
      // The last query again, through the three entry points: the same call, the same bits.
      const attn::Matrix<T> last = cache.attend(Q.bottomRows(1), options, per_head);
      EXPECT_TRUE(attn_test::near_t<T>(last, out.bottomRows(1))) << where;
      attn::Matrix<T> into;
      cache.attend(Q.bottomRows(1), options, per_head, into);
      EXPECT_TRUE(attn_test::identical(into, last)) << where;
      attn::Tensor3<T> Q_t(heads, 1, d);
      for (Index h = 0; h < heads; ++h) attn::detail::slice(Q_t, h) = Q.block(n - 1, h * d, 1, d);
      const attn::Tensor3<T> last_t = cache.attend_heads(Q_t, options, per_head);
      for (Index h = 0; h < heads; ++h) {
        EXPECT_TRUE(attn_test::identical(attn::Matrix<T>(attn::detail::slice(last_t, h)),
                                         attn::Matrix<T>(last.middleCols(h * d_v, d_v))))
            << "head " << h << ", " << where;
      }
    }
  }
}

TYPED_TEST(KVCacheTest, EqualPerHeadValuesEqualTheSharedOnes) {
  using T = TypeParam;
  std::mt19937 rng(9);
  const Index n = 12;
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, 3 * 8, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(n, 8, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(n, 4, rng);
  KVCacheConfig<T> config;
  config.d_k = 8;
  config.d_v = 4;
  attn::AttentionOptions<T> shared;  // one query, a sink, no ALiBi: the stacked decoding kernel
  shared.sink = T(0.75);
  attn::HeadOptions<T> per_head;  // the per-head kernel path, with the same values
  per_head.sinks = std::vector<T>(3, T(0.75));
  KVCache<T> a(config);
  KVCache<T> b(config);
  EXPECT_TRUE(attn_test::near_t<T>(decode(b, Q, K, V, {1}, {}, 12, per_head),
                                   decode(a, Q, K, V, {1}, shared, 12)));
  shared.alibi_slope = T(0.25);
  per_head.alibi_slopes = std::vector<T>(3, T(0.25));
  attn::AttentionOptions<T> none;
  KVCache<T> c(config);
  KVCache<T> e(config);
  EXPECT_TRUE(attn_test::near_t<T>(decode(e, Q, K, V, {2, 3}, none, 12, per_head),
                                   decode(c, Q, K, V, {2, 3}, shared, 12)));
}

/// Whether `KVCache<float>::attend(Q, options)` compiles for this options type.
template <class Options, class = void>
struct can_attend : std::false_type {};
template <class Options>
struct can_attend<Options,
                  std::void_t<decltype(std::declval<const KVCache<float>&>().attend(
                      std::declval<const attn::Matrix<float>&>(), std::declval<const Options&>()))>>
    : std::true_type {};

TEST(KVCacheErrors, PerHeadSlopesAndSinks) {
  KVCacheConfig<float> config;
  config.d_k = 4;
  config.d_v = 3;
  config.kv_heads = 2;
  KVCache<float> cache(config);
  cache.append(attn::Matrix<float>::Zero(3, 8), attn::Matrix<float>::Zero(3, 6));
  const attn::Matrix<float> q = attn::Matrix<float>::Zero(1, 16);  // 4 query heads
  attn::AttentionOptions<float> options;
  attn::HeadOptions<float> per_head;
  const auto attend = [&] { cache.attend(q, options, per_head); };
  per_head.alibi_slopes = std::vector<float>(3, 0.5f);
  expect_shape_error(attend, {"KVCache::attend", "alibi_slopes has 3 entries", "4 query heads"});
  per_head.alibi_slopes = std::vector<float>(5, 0.5f);
  expect_shape_error(attend, {"alibi_slopes has 5 entries", "4 query heads"});
  per_head.alibi_slopes.reset();
  per_head.sinks = std::vector<float>(2, 0.0f);
  expect_shape_error(attend, {"KVCache::attend", "sinks has 2 entries", "4 query heads"});
  attn::Tensor3<float> Q_t(4, 1, 4);
  Q_t.setZero();
  expect_shape_error([&] { cache.attend_heads(Q_t, options, per_head); },
                     {"sinks has 2 entries", "4 query heads"});
  per_head.sinks.reset();
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    per_head.alibi_slopes = std::vector<float>{0.5f, bad, 0.5f, 0.5f};
    expect_shape_error(attend, {"KVCache::attend", "alibi_slopes holds", "slopes must be finite"});
  }
  per_head.alibi_slopes.reset();
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    per_head.sinks = std::vector<float>{0.0f, 0.0f, 0.0f, bad};
    expect_shape_error(attend, {"sinks holds", "sinks must be numbers below +inf"});
  }
  per_head.sinks = std::vector<float>(4, 0.0f);
  options.sink = 1.0f;
  expect_shape_error(attend, {"KVCache::attend", "set sinks or sink, not both"});
  per_head.sinks.reset();
  options.sink.reset();
  per_head.alibi_slopes = std::vector<float>(4, 0.5f);
  options.alibi_slope = 0.5f;
  expect_shape_error(attend, {"set alibi_slopes or alibi_slope, not both"});
  options.alibi_slope.reset();
  // key_valid and need_weights are MultiHeadOptions fields: `attend` refuses that type at compile
  // time instead of cutting it down (and `{}` still means "no options").
  static_assert(!can_attend<attn::MultiHeadOptions<float>>::value);
  static_assert(can_attend<attn::AttentionOptions<float>>::value);
  EXPECT_TRUE(attn_test::identical(cache.attend(q, {}), cache.attend(q)));
  cache.attend(q, options, per_head);  // valid again
}

TEST(KVCacheErrors, ShapesAndPositions) {
  KVCache<float> cache(4, 3, 2);
  const attn::Matrix<float> K = attn::Matrix<float>::Zero(5, 4);
  const attn::Matrix<float> V = attn::Matrix<float>::Zero(5, 3);
  expect_shape_error([&] { cache.append(attn::Matrix<float>::Zero(5, 6), V); },
                     {"KVCache::append", "K_new has 6 columns", "4", "5 x 6"});
  expect_shape_error([&] { cache.append(K, attn::Matrix<float>::Zero(4, 3)); },
                     {"V_new has 4 rows", "K_new has 5", "4 x 3", "5 x 4"});
  cache.append(K, V);
  expect_shape_error([&] { cache.attend(attn::Matrix<float>::Zero(1, 5)); },
                     {"KVCache::attend", "5 columns", "1 x 5"});
  expect_shape_error([&] { cache.attend(attn::Matrix<float>::Zero(6, 4)); },
                     {"6 queries", "seen only 5 positions"});
  attn::AttentionOptions<float> top_left;
  top_left.causal = Causal::TopLeft;
  expect_shape_error([&] { cache.attend(attn::Matrix<float>::Zero(1, 4), top_left); }, {"TopLeft"});
  cache.append(attn::Matrix<float>::Zero(1, 4), attn::Matrix<float>::Zero(1, 3));
  // The ring now keeps w + 5 = 7 rows: six queries with a window of 2 need 8.
  cache.append(attn::Matrix<float>::Zero(1, 4), attn::Matrix<float>::Zero(1, 3));
  cache.append(attn::Matrix<float>::Zero(1, 4), attn::Matrix<float>::Zero(1, 3));
  expect_shape_error([&] { cache.attend(attn::Matrix<float>::Zero(6, 4)); },
                     {"6 queries with a window of 2", "keeps positions"});
  attn::AttentionOptions<float> bad_mask;
  bad_mask.mask = Mask::Constant(1, 3, true);
  expect_shape_error([&] { cache.attend(attn::Matrix<float>::Zero(1, 4), bad_mask); },
                     {"mask is 1 x 3", "1 x 7"});
  expect_shape_error([] { KVCache<float> bad(0, 3); }, {"KVCache", "d_k"});
  expect_shape_error([] { KVCache<float> bad(4, 3, -1); }, {"window", "-1"});
}

}  // namespace
