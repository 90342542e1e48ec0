/// `KVCacheConfig::storage`: keys and values kept in float16, bfloat16 or int8 (one scale per token
/// and key/value head), widened in the kernels:
/// - the codecs: exactly representable values survive, rounding is to nearest even, int8 rows get
///   max |x| / 127 as their scale, a zero row and a non-finite row are handled;
/// - the SIMD widening (`detail::load_stored`) equals element-by-element widening for every codec;
/// - a cache in each format equals attention computed by plain long-double loops over the values
///   it stores (`keys()`, `values()`: widened copies): decoding with grouped-query heads, a window
///   with pinned tokens (two blocks), RoPE, softcap / sink / ALiBi, a mask (the materialised
///   path), several queries, widths that are not whole packets;
/// - rows are never re-rounded when the storage grows or the ring moves them;
/// - accuracy against the double reference at n = 4096 (the README's table), with bounds;
/// - `bytes()` and `bytes_for`, and the errors of the views that need `Same`.

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Index;
using attn::KVCache;
using attn::KVCacheConfig;
using attn::KVStorage;
using attn::Mask;
using attn::Matrix;

/// A cache's configuration: 2 key/value heads, keys and values of width d stored in `storage`.
/// Options asking for the stored formats' own arithmetic (`StoredArithmetic::Reduced`).
attn::AttentionOptions<float> reduced(attn::AttentionOptions<float> options = {}) {
  options.stored_arithmetic = attn::StoredArithmetic::Reduced;
  return options;
}

KVCacheConfig<float> two_kv_heads(Index d, KVStorage storage) {
  KVCacheConfig<float> config;
  config.d_k = d;
  config.d_v = d;
  config.kv_heads = 2;
  config.storage = storage;
  return config;
}

constexpr KVStorage kReduced[] = {KVStorage::Float16, KVStorage::BFloat16, KVStorage::Int8};

const char* name(KVStorage s) { return attn::detail::storage_name(s); }

float from_bits(std::uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

/// Stores one row through the cache's codec and reads it back widened.
template <class T>
Matrix<T> round_trip(KVStorage storage, const Matrix<T>& row) {
  KVCacheConfig<T> config;
  config.d_k = row.cols();
  config.d_v = row.cols();
  config.storage = storage;
  KVCache<T> cache(config);
  cache.append(row, row);
  return cache.keys(0);
}

TEST(KVStorageCodecs, RepresentableValuesSurviveAndRoundingIsToNearestEven) {
  // float16: 11 significant bits; bfloat16: 8.
  Matrix<float> exact(1, 4);
  exact << 1.0f, -0.5f, 1.5f, 96.0f;
  for (const KVStorage s : {KVStorage::Float16, KVStorage::BFloat16}) {
    EXPECT_TRUE(attn_test::identical(round_trip(s, exact), exact)) << name(s);
  }
  Matrix<float> ties(1, 3);
  // 1 + 2^-11 is halfway between float16 neighbours 1 and 1 + 2^-10: ties to even (1).
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9: ties to even (1 + 2^-9).
  ties << 1.0f + std::ldexp(1.0f, -11), 1.0f + 3 * std::ldexp(1.0f, -11), 70000.0f;
  const Matrix<float> h = round_trip(KVStorage::Float16, ties);
  EXPECT_EQ(h(0, 0), 1.0f);
  EXPECT_EQ(h(0, 1), 1.0f + std::ldexp(1.0f, -9));
  EXPECT_EQ(h(0, 2), std::numeric_limits<float>::infinity()) << "float16 overflows beyond 65504";
  Matrix<float> bties(1, 2);
  bties << 1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8);
  const Matrix<float> b = round_trip(KVStorage::BFloat16, bties);
  EXPECT_EQ(b(0, 0), 1.0f);
  EXPECT_EQ(b(0, 1), 1.0f + std::ldexp(1.0f, -6));
}

TEST(KVStorageCodecs, Int8RowsAreScaledByTheirLargestMagnitude) {
  Matrix<double> row(1, 4);
  row << 2.54, -1.01, 0.0, 0.6;  // scale 0.02: q = 127, -50.5 -> -50 (nearest even), 0, 30
  const Matrix<double> got = round_trip(KVStorage::Int8, row);
  EXPECT_NEAR(got(0, 0), 2.54, 1e-14);
  EXPECT_NEAR(got(0, 1), -50 * 0.02, 1e-14);
  EXPECT_EQ(got(0, 2), 0.0);
  EXPECT_NEAR(got(0, 3), 30 * 0.02, 1e-14);
  // Every entry is within half a step of the original.
  std::mt19937 rng(7);
  const Matrix<double> random = attn_test::random_matrix<double>(1, 64, rng);
  const Matrix<double> back = round_trip(KVStorage::Int8, random);
  const double step = random.cwiseAbs().maxCoeff() / 127;
  EXPECT_LE((back - random).cwiseAbs().maxCoeff(), 0.5 * step * (1 + 1e-12));
  // A zero row stays zero; a row with a NaN reads as NaN, one with inf as non-finite.
  EXPECT_TRUE(attn_test::all_zero(round_trip<double>(KVStorage::Int8, Matrix<double>::Zero(1, 5))));
  Matrix<double> bad = Matrix<double>::Ones(1, 3);
  bad(0, 1) = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(round_trip(KVStorage::Int8, bad).array().isNaN().all());
  bad(0, 1) = -std::numeric_limits<double>::infinity();
  EXPECT_FALSE(round_trip(KVStorage::Int8, bad).array().isFinite().any());
  // A row so small that 127 / largest overflows: 0 times that would be NaN, and NaN cast to 8 bits
  // undefined (clang's -fsanitize=float-cast-overflow stops here without the guard). Its scale is
  // subnormal, so it reads back as about 0.
  Matrix<float> tiny(1, 3);
  tiny << 2e-40f, 0.0f, -1e-40f;
  const Matrix<float> tiny_back = round_trip(KVStorage::Int8, tiny);
  EXPECT_TRUE(tiny_back.array().isFinite().all());
  EXPECT_LE((tiny_back - tiny).cwiseAbs().maxCoeff(), 2e-40f);
}

/// load_stored (the kernels' SIMD widening) against element-by-element widening.
template <class T, class Codec>
void expect_same_widening(std::mt19937& rng) {
  using Bits = typename Codec::Bits;
  constexpr Index lanes = attn::detail::decode_lanes<T>;
  // Every bit pattern may occur (NaN, inf, subnormal halves included), but int8's -128.
  std::vector<Bits> bits(static_cast<std::size_t>(lanes) * 64);
  std::uniform_int_distribution<int> any(0, 65535);
  for (Bits& b : bits) {
    if constexpr (std::is_same_v<Codec, attn::detail::Int8Codec>) {
      b = static_cast<Bits>(any(rng) % 255 - 127);
    } else {
      b = Eigen::numext::bit_cast<Bits>(static_cast<std::uint16_t>(any(rng)));
    }
  }
  alignas(64) T got[static_cast<std::size_t>(lanes)];
  for (std::size_t at = 0; at + static_cast<std::size_t>(lanes) <= bits.size(); at += 3) {
    Eigen::internal::pstore(got, attn::detail::load_stored<T, Codec>(bits.data() + at));
    for (Index i = 0; i < lanes; ++i) {
      const T want = attn::detail::widen<T>(Codec{}, bits[at + static_cast<std::size_t>(i)], T(1));
      const T have = got[static_cast<std::size_t>(i)];
      ASSERT_TRUE((std::isnan(want) && std::isnan(have)) || want == have)
          << "offset " << at << " lane " << i << ": " << have << " vs " << want;
    }
  }
}

TEST(KVStorageCodecs, SimdWideningEqualsElementByElement) {
  std::mt19937 rng(3);
  expect_same_widening<float, attn::detail::Float16Codec>(rng);
  expect_same_widening<float, attn::detail::BFloat16Codec>(rng);
  expect_same_widening<float, attn::detail::Int8Codec>(rng);
  expect_same_widening<double, attn::detail::Float16Codec>(rng);
  expect_same_widening<double, attn::detail::BFloat16Codec>(rng);
  expect_same_widening<double, attn::detail::Int8Codec>(rng);
  // bfloat16's widening is exact by construction: the float with those upper bits.
  const auto one = Eigen::numext::bit_cast<Eigen::bfloat16>(std::uint16_t{0x3F80});
  EXPECT_EQ(attn::detail::widen<float>(attn::detail::BFloat16Codec{}, one), 1.0f);
  EXPECT_EQ(from_bits(0x3F800000u), 1.0f);
}

template <class T>
class KVStorageCache : public ::testing::Test {};
TYPED_TEST_SUITE(KVStorageCache, attn_test::ScalarTypes);

struct Setup {
  Index d = 32;
  Index kv_heads = 2;
  Index group = 2;
  std::optional<Index> window;
  Index pinned = 0;
  std::optional<attn::RopeStyle> rope;
};

/// Appends `tokens` rows in chunks of `chunk` into a cache of `storage`, then checks `attend` of
/// the last `queries` positions (and a query_offset call) against long-double loops over what the
/// cache stores, for each head with its visible positions as the mask.
template <class T>
void expect_matches_stored(const Setup& s, KVStorage storage, Index tokens, Index chunk,
                           Index queries, const attn::AttentionOptions<T>& options,
                           std::uint32_t seed) {
  KVCacheConfig<T> config;
  config.d_k = s.d;
  config.d_v = s.d;
  config.kv_heads = s.kv_heads;
  config.window = s.window;
  config.pinned_tokens = s.pinned;
  config.rope = s.rope;
  config.storage = storage;
  KVCache<T> cache(config);
  std::mt19937 rng(seed);
  for (Index done = 0; done < tokens; done += chunk) {
    const Index r = std::min(chunk, tokens - done);
    cache.append(attn_test::random_matrix<T>(r, s.kv_heads * s.d, rng),
                 attn_test::random_matrix<T>(r, s.kv_heads * s.d, rng));
  }
  const Index heads = s.kv_heads * s.group;
  const Matrix<T> Q = attn_test::random_matrix<T>(queries, heads * s.d, rng);
  const Matrix<T> got = cache.attend(Q, options);
  const Index first = cache.position() - queries;
  Matrix<T> rotated = Q;
  for (Index h = 0; s.rope && h < heads; ++h) {
    rotated.middleCols(h * s.d, s.d) = attn::rope(Q.middleCols(h * s.d, s.d), first, *s.rope);
  }
  const std::vector<Index> positions = cache.key_positions();
  const auto m = static_cast<Index>(positions.size());
  Mask allowed(queries, m);
  for (Index i = 0; i < queries; ++i) {
    for (Index j = 0; j < m; ++j) {
      const Index p = first + i;
      const Index k = positions[static_cast<std::size_t>(j)];
      allowed(i, j) = k <= p && (!s.window || k >= p - *s.window || k < s.pinned);
      if (options.mask) allowed(i, j) = allowed(i, j) && (*options.mask)(i, j);
    }
  }
  for (Index h = 0; h < heads; ++h) {
    const Matrix<T> K = cache.keys(h / s.group);
    const Matrix<T> V = cache.values(h / s.group);
    attn::AttentionOptions<T> naive_options = options;
    naive_options.causal = attn::Causal::None;
    naive_options.mask = allowed;
    naive_options.query_offset = first;
    const auto want =
        attn_test::naive_attention<T>(rotated.middleCols(h * s.d, s.d), K, V, naive_options);
    ASSERT_TRUE(attn_test::near_t<T>(got.middleCols(h * s.d, s.d), want.output))
        << name(storage) << ", head " << h << ", " << tokens << " tokens, " << queries
        << " queries";
  }
}

TYPED_TEST(KVStorageCache, EqualsAttentionOverWhatItStores) {
  using T = TypeParam;
  attn::AttentionOptions<T> none;
  attn::AttentionOptions<T> scalars;
  scalars.softcap = T(3);
  scalars.sink = T(0.5);
  for (const KVStorage storage :
       {KVStorage::Same, KVStorage::Float16, KVStorage::BFloat16, KVStorage::Int8}) {
    SCOPED_TRACE(name(storage));
    Setup gqa;  // 4 query heads over 2 key/value heads, d = 32
    // One query: the decoding kernel (one part, then 3 parts of 2048 keys merged).
    expect_matches_stored<T>(gqa, storage, 300, 300, 1, none, 1);
    expect_matches_stored<T>(gqa, storage, 5000, 1250, 1, scalars, 2);
    // 4 query heads per key/value head: the decoding kernel's 4 x 4 score blocks (AVX-512),
    // 301 keys: the last tile ends with one key done alone.
    Setup four = gqa;
    four.group = 4;
    expect_matches_stored<T>(four, storage, 301, 301, 1, scalars, 9);
    expect_matches_stored<T>(four, storage, 4099, 4099, 1, none, 10);
    // Several queries (the materialised path over widened keys).
    expect_matches_stored<T>(gqa, storage, 200, 67, 5, scalars, 3);
    // A window with pinned tokens: two blocks merged; appended one row at a time.
    Setup windowed;
    windowed.window = 37;
    windowed.pinned = 3;
    expect_matches_stored<T>(windowed, storage, 150, 1, 1, scalars, 4);
    expect_matches_stored<T>(windowed, storage, 150, 20, 4, none, 5);
    // RoPE (keys stored after rotation), the half layout, and a width of 20 (not whole packets).
    Setup rotary;
    rotary.d = 20;
    rotary.group = 3;
    rotary.rope = attn::RopeStyle::Half;
    expect_matches_stored<T>(rotary, storage, 130, 13, 1, scalars, 6);
    expect_matches_stored<T>(rotary, storage, 130, 13, 3, none, 7);
    // ALiBi and a mask: one query through the materialised path.
    attn::AttentionOptions<T> tables;
    tables.alibi_slope = T(0.125);
    tables.mask = Mask::Constant(1, 90, true);
    (*tables.mask)(0, 7) = false;
    expect_matches_stored<T>(gqa, storage, 90, 90, 1, tables, 8);
  }
}

TEST(KVStorageCache, RowsAreNeverRoundedTwice) {
  // The same rows appended at once and one by one (storage doubling, ring moves) read back the
  // same bits: rows are copied as stored, never decoded and encoded again.
  std::mt19937 rng(11);
  const Matrix<float> K = attn_test::random_matrix<float>(300, 16, rng, 3.0);
  const Matrix<float> V = attn_test::random_matrix<float>(300, 16, rng, 3.0);
  for (const KVStorage storage : kReduced) {
    for (const std::optional<Index> window : {std::optional<Index>{}, std::optional<Index>{40}}) {
      KVCacheConfig<float> config;
      config.d_k = 8;
      config.d_v = 8;
      config.kv_heads = 2;
      config.window = window;
      config.pinned_tokens = window ? 2 : 0;
      config.storage = storage;
      KVCache<float> whole(config);
      KVCache<float> rows(config);
      whole.append(K, V);
      for (Index i = 0; i < K.rows(); ++i) rows.append(K.middleRows(i, 1), V.middleRows(i, 1));
      // `whole` keeps every row (a window keeps w + the last append's rows); `rows` keeps the
      // pinned and the last w + 1.
      const std::vector<Index> kept = rows.key_positions();
      ASSERT_EQ(static_cast<Index>(kept.size()), window ? 2 + 41 : 300);
      for (Index h = 0; h < 2; ++h) {
        const Matrix<float> all_K = whole.keys(h);
        const Matrix<float> all_V = whole.values(h);
        Matrix<float> want_K(static_cast<Index>(kept.size()), 8);
        Matrix<float> want_V(static_cast<Index>(kept.size()), 8);
        for (std::size_t i = 0; i < kept.size(); ++i) {
          want_K.row(static_cast<Index>(i)) = all_K.row(kept[i]);
          want_V.row(static_cast<Index>(i)) = all_V.row(kept[i]);
        }
        EXPECT_TRUE(attn_test::identical(rows.keys(h), want_K)) << name(storage);
        EXPECT_TRUE(attn_test::identical(rows.values(h), want_V)) << name(storage);
      }
    }
  }
}

/// The worst error of a decoding step over n cached tokens in `storage` (or of the last `queries`
/// tokens' queries, causal), against the double computation over the unrounded values:
/// max |o - o_ref| / max |o_ref| over every head.
double worst_relative_error(KVStorage storage, Index n, std::uint32_t seed, Index queries = 1,
                            attn::StoredArithmetic arithmetic = attn::StoredArithmetic::Widened) {
  constexpr Index d = 128;
  constexpr Index kv_heads = 2;
  constexpr Index heads = 8;
  std::mt19937 rng(seed);
  const Matrix<double> K = attn_test::random_matrix<double>(n, kv_heads * d, rng);
  const Matrix<double> V = attn_test::random_matrix<double>(n, kv_heads * d, rng);
  const Matrix<double> Q = attn_test::random_matrix<double>(queries, heads * d, rng);
  KVCacheConfig<double> reference_config;
  reference_config.d_k = d;
  reference_config.d_v = d;
  reference_config.kv_heads = kv_heads;
  KVCache<double> reference(reference_config);
  reference.append(K, V);
  const Matrix<double> want = reference.attend(Q);
  KVCacheConfig<float> config;
  config.d_k = d;
  config.d_v = d;
  config.kv_heads = kv_heads;
  config.storage = storage;
  KVCache<float> cache(config);
  cache.append(K.cast<float>(), V.cast<float>());
  attn::AttentionOptions<float> options;
  options.stored_arithmetic = arithmetic;
  const Matrix<double> got = cache.attend(Q.cast<float>(), options).cast<double>();
  double worst = 0;
  for (Index h = 0; h < heads; ++h) {
    const auto w = want.middleCols(h * d, d);
    worst = std::max(
        worst, (got.middleCols(h * d, d) - w).cwiseAbs().maxCoeff() / w.cwiseAbs().maxCoeff());
  }
  return worst;
}

TEST(KVStorageAccuracy, DecodingAt4096TokensStaysWithinEachFormatsBound) {
  // docs/benchmarks.md's accuracy table (float compute; N(0, 1) queries, keys and values; d = 128;
  // 8 query heads over 2 key/value heads). The bounds are about twice the worst of 3 seeds.
  struct Bound {
    KVStorage storage;
    double bound;
  };
  for (const Bound b : {Bound{KVStorage::Same, 1e-5}, Bound{KVStorage::Float16, 2e-3},
                        Bound{KVStorage::BFloat16, 1.5e-2}, Bound{KVStorage::Int8, 3e-2}}) {
    double worst = 0;
    for (std::uint32_t seed = 1; seed <= 3; ++seed) {
      worst = std::max(worst, worst_relative_error(b.storage, 4096, seed));
    }
    RecordProperty(name(b.storage), std::to_string(worst));
    std::printf("[ accuracy ] %-20s n = 4096: worst relative error %.2e (bound %.1e)\n",
                name(b.storage), worst, b.bound);
    EXPECT_LT(worst, b.bound) << name(b.storage);
    if (b.storage != KVStorage::Same) {
      EXPECT_GT(worst, 1e-6) << name(b.storage) << ": the keys were not rounded at all";
    }
  }
}

TEST(KVStorageAccuracy, BFloat16ArithmeticAt4096TokensStaysWithinItsBound) {
  // docs/benchmarks.md's accuracy table, rows "BFloat16 + vdpbf16ps" (StoredArithmetic::Reduced):
  // one decoding step (scores by vdpbf16ps on the rounded queries) and the last 256 tokens'
  // queries (the tiled kernel: scores and values by vdpbf16ps, the probabilities rounded too).
  // Same setup and reference as the formats' test above; the bound is about twice the worst of 3
  // seeds.
  if (!attn::bfloat16_arithmetic_available()) {
    std::printf("[ accuracy ] bfloat16 arithmetic not available on this CPU: nothing to measure\n");
    return;
  }
  struct Bound {
    Index queries;
    double bound;
  };
  for (const Bound b : {Bound{1, 1e-2}, Bound{256, 1e-2}}) {
    double worst = 0;
    for (std::uint32_t seed = 1; seed <= 3; ++seed) {
      worst = std::max(worst, worst_relative_error(KVStorage::BFloat16, 4096, seed, b.queries,
                                                   attn::StoredArithmetic::Reduced));
    }
    std::printf(
        "[ accuracy ] BFloat16 + vdpbf16ps, %3ld queries, n = 4096: worst relative error "
        "%.2e (bound %.1e)\n",
        static_cast<long>(b.queries), worst, b.bound);
    EXPECT_LT(worst, b.bound) << b.queries << " queries";
    EXPECT_GT(worst, 1e-6) << b.queries << " queries";
  }
}

TEST(KVStorageAccuracy, Int8ArithmeticAt4096TokensStaysWithinItsBound) {
  // docs/benchmarks.md's accuracy table, row "Int8 + VNNI" (StoredArithmetic::Reduced): one
  // decoding step, its scores by vpdpbusd on the queries rounded to 8 bits, its values by vpdpwssd
  // on the weights rounded to 16 bits. Same setup and reference as the formats' test; the bound is
  // about twice the worst of 3 seeds.
  if (!attn::int8_arithmetic_available()) {
    std::printf("[ accuracy ] int8 arithmetic not available on this CPU: nothing to measure\n");
    return;
  }
  double worst = 0;
  for (std::uint32_t seed = 1; seed <= 3; ++seed) {
    worst = std::max(worst, worst_relative_error(KVStorage::Int8, 4096, seed, 1,
                                                 attn::StoredArithmetic::Reduced));
  }
  double storage_alone = 0;  // the same steps in float arithmetic over the same int8 cache
  for (std::uint32_t seed = 1; seed <= 3; ++seed) {
    storage_alone = std::max(storage_alone, worst_relative_error(KVStorage::Int8, 4096, seed));
  }
  std::printf(
      "[ accuracy ] Int8 + vpdpbusd, n = 4096: worst relative error %.2e (bound %.1e; float "
      "arithmetic over the same cache %.2e)\n",
      worst, 3e-2, storage_alone);
  EXPECT_LT(worst, 3e-2);
  EXPECT_NE(worst, storage_alone) << "the int8 arithmetic did not run";
}

TEST(KVStorageCache, BytesCountWhatIsStored) {
  KVCacheConfig<float> config;
  config.d_k = 64;
  config.d_v = 32;
  config.kv_heads = 3;
  const Index per_token_same = 3 * (64 + 32) * 4;
  for (const KVStorage storage :
       {KVStorage::Same, KVStorage::Float16, KVStorage::BFloat16, KVStorage::Int8}) {
    config.storage = storage;
    KVCache<float> cache(config);
    EXPECT_EQ(cache.bytes(), 0);
    cache.append(Matrix<float>::Ones(1000, 3 * 64), Matrix<float>::Ones(1000, 3 * 32));
    const Index expected = storage == KVStorage::Same ? 1000 * per_token_same
                           : storage == KVStorage::Int8
                               ? 1000 * 3 * (64 + 32 + 2 * 4)  // 1 byte each, 2 float scales
                               : 1000 * 3 * (64 + 32) * 2;
    EXPECT_EQ(cache.bytes(), expected) << name(storage);
    EXPECT_EQ(KVCache<float>::bytes_for(config, 1000), expected) << name(storage);
  }
}

/// K and V rounded to S and back: what the kernels must compute with.
template <class S>
Matrix<float> widened(const Matrix<S>& X) {
  return X.template cast<float>();
}

/// flash_attention, scaled_dot_product_attention and attention_heads with Eigen::half or
/// Eigen::bfloat16 keys and values give the bits of the same calls on the widened floats, on
/// every path (decode, materialised, tiled) and with every kind of option.
template <class S>
void expect_narrow_kv_calls_match(std::uint32_t seed) {
  std::mt19937 rng(seed);
  struct Shape {
    Index n, m, d;
  };
  attn::AttentionOptions<float> plain;
  attn::AttentionOptions<float> rich;
  rich.causal = attn::Causal::BottomRight;
  rich.softcap = 5.0f;
  rich.alibi_slope = 0.0625f;
  rich.sink = 0.25f;
  rich.window = 150;
  for (const Shape shape : {Shape{1, 333, 32}, Shape{20, 30, 16}, Shape{300, 700, 32},
                            Shape{1, 90, 20}, Shape{130, 260, 24}}) {
    SCOPED_TRACE(::testing::Message() << "n = " << shape.n << ", m = " << shape.m);
    const Matrix<float> Q = attn_test::random_matrix<float>(shape.n, shape.d, rng);
    const Matrix<S> K = attn_test::random_matrix<float>(shape.m, shape.d, rng).template cast<S>();
    const Matrix<S> V = attn_test::random_matrix<float>(shape.m, shape.d, rng).template cast<S>();
    attn::AttentionOptions<float> tables = rich;
    tables.bias = attn_test::random_matrix<float>(shape.n, shape.m, rng);
    tables.mask = Mask::Constant(shape.n, shape.m, true);
    (*tables.mask)(0, shape.m / 2) = false;
    for (const auto* options : {&plain, &rich, &tables}) {
      EXPECT_TRUE(attn_test::identical(attn::flash_attention(Q, K, V, *options),
                                       attn::flash_attention(Q, widened(K), widened(V), *options)));
      EXPECT_TRUE(attn_test::identical(
          attn::scaled_dot_product_attention(Q, K, V, *options),
          attn::scaled_dot_product_attention(Q, widened(K), widened(V), *options)));
    }
    attn::Vector<float> lse_narrow, lse_wide;
    const Matrix<float> O = attn::flash_attention(Q, K, V, rich, lse_narrow);
    EXPECT_TRUE(
        attn_test::identical(O, attn::flash_attention(Q, widened(K), widened(V), rich, lse_wide)));
    EXPECT_TRUE(attn_test::identical(lse_narrow, lse_wide));
  }
  // attention_heads: 6 query heads over 2 key/value heads (the stacked decoding path for one
  // query), several queries, per-head sinks.
  for (const Index n : {1, 40}) {
    attn::Tensor3<float> Q(6, n, 32);
    attn::Tensor3<S> K(2, 500, 32), V(2, 500, 32);
    attn::Tensor3<float> K_wide(2, 500, 32), V_wide(2, 500, 32);
    std::normal_distribution<float> normal;
    for (Index i = 0; i < Q.size(); ++i) Q.data()[i] = normal(rng);
    for (Index i = 0; i < K.size(); ++i) {
      K.data()[i] = S(normal(rng));
      V.data()[i] = S(normal(rng));
      K_wide.data()[i] = static_cast<float>(K.data()[i]);
      V_wide.data()[i] = static_cast<float>(V.data()[i]);
    }
    attn::HeadOptions<float> per_head;
    per_head.sinks = std::vector<float>{0.5f, -1.0f, 0.0f, 1.0f, 2.0f, -0.5f};
    attn::HeadOptions<float> shared;
    for (const auto* p : {&shared, &per_head}) {
      attn::AttentionOptions<float> options = rich;
      if (p->sinks) options.sink.reset();
      const attn::Tensor3<float> narrow = attn::attention_heads(Q, K, V, options, *p);
      const attn::Tensor3<float> wide = attn::attention_heads(Q, K_wide, V_wide, options, *p);
      for (Index h = 0; h < 6; ++h) {
        EXPECT_TRUE(
            attn_test::identical(attn::detail::slice(narrow, h), attn::detail::slice(wide, h)))
            << "head " << h << ", n = " << n;
      }
    }
  }
}

TEST(NarrowKeysAndValues, EqualTheCallsOnTheWidenedFloats) {
  expect_narrow_kv_calls_match<Eigen::half>(21);
  expect_narrow_kv_calls_match<Eigen::bfloat16>(22);
}

/// The bfloat16 arithmetic path (StoredArithmetic::Reduced, AVX512_BF16's vdpbf16ps) against
/// long-double loops over what it computes with: the stored keys and values and the scaled
/// queries rounded to bfloat16. Says which paths ran on this machine.
TEST(KVStorageBFloat16Arithmetic, EachPathThisMachineSupports) {
  constexpr Index d = 128;
  KVCache<float> cache(two_kv_heads(d, KVStorage::BFloat16));
  std::mt19937 rng(31);
  cache.append(attn_test::random_matrix<float>(301, 2 * d, rng),
               attn_test::random_matrix<float>(301, 2 * d, rng));
  const Matrix<float> Q = attn_test::random_matrix<float>(1, 8 * d, rng);  // 4 heads per group
  const Matrix<float> portable = cache.attend(Q);
  const bool dispatched = attn::bfloat16_arithmetic_available();
  const Matrix<float> chosen = cache.attend(Q, reduced());
  std::printf("[ dispatch ] AVX512_BF16 %s: paths run: float%s\n",
              attn::bfloat16_arithmetic_available() ? "available" : "not available",
              dispatched ? ", bfloat16 (vdpbf16ps)" : "");
  RecordProperty("bfloat16_path_ran", dispatched ? "yes" : "no");
  if (!dispatched) {
    EXPECT_TRUE(attn_test::identical(chosen, portable))
        << "without the instruction, the float path";
    return;
  }
  EXPECT_FALSE(attn_test::identical(chosen, portable)) << "the bfloat16 path did not run";
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (Index h = 0; h < 8; ++h) {
    const Matrix<float> q_rounded =
        (scale * Q.middleCols(h * d, d)).cast<Eigen::bfloat16>().cast<float>();
    attn::AttentionOptions<float> options;
    options.scale = 1.0f;
    const auto want = attn_test::naive_attention<float>(q_rounded, cache.keys(h / 4),
                                                        cache.values(h / 4), options);
    EXPECT_TRUE(attn_test::near_t<float>(chosen.middleCols(h * d, d), want.output)) << "head " << h;
  }
}

/// The operands of the bfloat16 score tiles hold exactly what their layout says. Keys
/// (`pack_bfloat16_keys`): panel p, pair c, key jj at (p ceil(d / 2) + c) 32 + jj, the bits of
/// features 2c (low half) and 2c + 1 (high half, 0 past d) of key 32 p + jj, 0 past the last key;
/// K a block of a wider matrix, on a 32-bit word with an even row stride (the words moved 16 x 16
/// at a time) or off it with an odd one (pair by pair). Queries (`pack_bfloat16_queries`, where the CPU has AVX512_BF16): each
/// feature rounded to nearest even as Eigen rounds it, a subnormal to 0 (what `vdpbf16ps` makes
/// of one anyway), a NaN to a NaN.
TEST(BFloat16Operands, PackedAsTheirLayoutSays) {
  using Rows = Eigen::Matrix<Eigen::bfloat16, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  constexpr Index w = attn::detail::bfloat16_panel_keys;
  const auto bits = [](Eigen::bfloat16 x) {
    return std::uint32_t(Eigen::numext::bit_cast<std::uint16_t>(x));
  };
  std::mt19937 rng(37);
  for (const Index d : {1, 2, 3, 31, 32, 33, 64, 65, 66}) {
    for (const Index m : {1, 31, 32, 33, 70}) {
      for (const Index extra : {2, 3}) {
        const Rows wide =
            attn_test::random_matrix<float>(m, d + extra, rng).cast<Eigen::bfloat16>();
        const Index offset = extra == 2 ? 2 : 1;  // on a 32-bit word, or not
        const attn::detail::StoredBlock<attn::detail::BFloat16Codec, float> K(
            wide.data() + offset, m, d, d + extra, nullptr);
        const Index pairs = (d + 1) / 2;
        const Index panels = (m + w - 1) / w;
        std::vector<std::uint32_t> packed(std::size_t(panels * pairs * w), 0xdeadbeefu);
        attn::detail::pack_bfloat16_keys(K, packed.data());
        Index wrong = 0;
        for (Index p = 0; p < panels; ++p) {
          for (Index c = 0; c < pairs; ++c) {
            for (Index jj = 0; jj < w; ++jj) {
              const Index j = p * w + jj;
              std::uint32_t want = 0;
              if (j < m) {
                want = bits(wide(j, offset + 2 * c));
                if (2 * c + 1 < d) want |= bits(wide(j, offset + 1 + 2 * c)) << 16;
              }
              if (packed[std::size_t((p * pairs + c) * w + jj)] != want) ++wrong;
            }
          }
        }
        EXPECT_EQ(wrong, 0) << "d = " << d << ", m = " << m << ", row stride " << d + extra;
      }
    }
  }

  if (!attn::bfloat16_arithmetic_available()) {
    std::printf("[ skipped  ] the queries' rounding: no AVX512_BF16 here\n");
    return;
  }
  for (const Index d : {1, 15, 16, 17, 64, 65}) {
    Matrix<float> wide = attn_test::random_matrix<float>(5, d + 3, rng, 3.0);
    wide(1, 2) = std::numeric_limits<float>::denorm_min() * 1000;  // subnormal
    wide(2, 1 + d - 1) = std::numeric_limits<float>::quiet_NaN();
    wide(3, 1) = -std::numeric_limits<float>::infinity();
    wide(4, 1) = 1.00390625f;  // halfway between two bfloat16: rounds to even (1.0)
    const Matrix<float> Q = wide.middleCols(1, d);
    const Index pairs = (d + 1) / 2;
    std::vector<std::uint32_t> packed(std::size_t(5 * pairs), 0xdeadbeefu);
    attn::detail::pack_bfloat16_queries(wide.middleCols(1, d), packed.data());
    Index wrong = 0;
    for (Index i = 0; i < 5; ++i) {
      for (Index f = 0; f < d; ++f) {
        const std::uint32_t word = packed[std::size_t(i * pairs + f / 2)];
        const std::uint32_t got = f % 2 == 0 ? word & 0xffffu : word >> 16;
        const float x = Q(i, f);
        if (std::isnan(x)) {
          if ((got & 0x7f80u) != 0x7f80u || (got & 0x7fu) == 0) ++wrong;
        } else if (std::fpclassify(x) == FP_SUBNORMAL) {
          if ((got & 0x7fffu) != 0) ++wrong;
        } else if (got != bits(Eigen::bfloat16(x))) {
          ++wrong;
        }
      }
      if (d % 2 == 1 && (packed[std::size_t(i * pairs + pairs - 1)] >> 16) != 0) ++wrong;
    }
    EXPECT_EQ(wrong, 0) << "d = " << d;
  }
}

/// The tiled kernel in bfloat16 arithmetic (StoredArithmetic::Reduced, keys and values in
/// bfloat16): scores by vdpbf16ps on the queries rounded to bfloat16, and, where d_v is a multiple
/// of 16, the value product by vdpbf16ps on the probabilities rounded to bfloat16. Against
/// long-double loops over the rounded queries and the stored keys and values:
/// - widths whose values take the float tiles agree to float rounding (the scores' check);
/// - the others within the probabilities' rounding: |sum_j (p~_j - p_j) v_j| / l <= u max |v| with
///   u = 2^-8, bfloat16's unit roundoff (l = sum_j p_j is summed before rounding).
/// Through `flash_attention` (query blocks in parallel), `attention_heads` (one head's blocks on a
/// thread) and a bfloat16 cache's several queries, which must equal `flash_attention` head by head.
/// Says which paths ran.
TEST(FlashBFloat16Arithmetic, EachPathThisMachineSupports) {
  using Rows = Eigen::Matrix<Eigen::bfloat16, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const auto rounded = [](const Matrix<float>& X) -> Matrix<float> {
    return X.cast<Eigen::bfloat16>().cast<float>();
  };
  // call(options) with the options' arithmetic Reduced (bfloat16 = true) or Widened.
  const auto run = [](bool bfloat16, const auto& call) {
    return call(bfloat16 ? attn::StoredArithmetic::Reduced : attn::StoredArithmetic::Widened);
  };
  const auto with = [](attn::AttentionOptions<float> options, attn::StoredArithmetic arithmetic) {
    options.stored_arithmetic = arithmetic;
    return options;
  };
  const bool dispatched =
      attn::bfloat16_arithmetic_available() && attn::detail::bfloat16_tiles_compiled();
  std::printf("[ dispatch ] tiled kernel, AVX512_BF16 %s%s: paths run: float%s\n",
              attn::bfloat16_arithmetic_available() ? "available" : "not available",
              attn::detail::bfloat16_tiles_compiled() ? "" : " (not compiled for AVX-512)",
              dispatched ? ", bfloat16 scores and values (vdpbf16ps)" : "");
  RecordProperty("bfloat16_tiles_ran", dispatched ? "yes" : "no");

  struct Shape {
    Index n, m, d_k, d_v;
  };
  attn::AttentionOptions<float> plain;
  attn::AttentionOptions<float> rich;  // a tile that crosses each row's range, softcap, sink
  rich.causal = attn::Causal::BottomRight;
  rich.window = 40;
  rich.softcap = 20.0f;
  rich.sink = 0.5f;
  std::mt19937 rng(34);
  // Rows that are not whole register tiles, keys that are not whole panels (and two key tiles),
  // odd d_k; d_v of 64,
  // 128 (two column groups), 80 (4 + 1 registers), 48 (3), and 33 and 20 (the float value tiles).
  for (const Shape shape :
       {Shape{37, 45, 64, 64}, Shape{130, 701, 128, 128}, Shape{25, 200, 65, 80},
        Shape{50, 97, 20, 48}, Shape{13, 70, 33, 33}, Shape{40, 600, 64, 20}}) {
    const Matrix<float> Q = attn_test::random_matrix<float>(shape.n, shape.d_k, rng, 2.0);
    const Rows K =
        attn_test::random_matrix<float>(shape.m, shape.d_k, rng, 2.0).cast<Eigen::bfloat16>();
    const Rows V =
        attn_test::random_matrix<float>(shape.m, shape.d_v, rng, 2.0).cast<Eigen::bfloat16>();
    const Matrix<float> K_stored = K.cast<float>();
    const Matrix<float> V_stored = V.cast<float>();
    for (const auto* options : {&plain, &rich}) {
      const auto call = [&](attn::StoredArithmetic a) {
        return attn::flash_attention(Q, K, V, with(*options, a));
      };
      const Matrix<float> portable = run(false, call);
      const Matrix<float> chosen = run(true, call);
      const std::string where = "n " + std::to_string(shape.n) + ", m " + std::to_string(shape.m) +
                                ", d_k " + std::to_string(shape.d_k) + ", d_v " +
                                std::to_string(shape.d_v) + (options == &rich ? ", rich" : "");
      if (!dispatched) {
        EXPECT_TRUE(attn_test::identical(chosen, portable)) << where;
        continue;
      }
      EXPECT_FALSE(attn_test::identical(chosen, portable))
          << "the bfloat16 path did not run: " << where;
      const auto want = attn_test::naive_attention<float>(rounded(Q), K_stored, V_stored, *options);
      if (shape.d_v % 16 != 0) {
        EXPECT_TRUE(attn_test::near_t<float>(chosen, want.output)) << where;
      } else {
        const float bound = (1.0f / 256 + 1e-5f) * V_stored.cwiseAbs().maxCoeff();
        const auto error =
            static_cast<float>((chosen.cast<long double>() - want.output).cwiseAbs().maxCoeff());
        EXPECT_LE(error, bound) << where;
        EXPECT_GT(error, 0.0f) << where;
      }
    }
  }
  if (!dispatched) return;

  // The NaN rule holds: a query with a NaN gives a NaN row (recomputed by the float path), and
  // the other rows are what they were.
  {
    Matrix<float> Q = attn_test::random_matrix<float>(40, 64, rng);
    const Rows K = attn_test::random_matrix<float>(300, 64, rng).cast<Eigen::bfloat16>();
    const Rows V = attn_test::random_matrix<float>(300, 64, rng).cast<Eigen::bfloat16>();
    const Matrix<float> clean = attn::flash_attention(Q, K, V, reduced(plain));
    Q(3, 5) = std::numeric_limits<float>::quiet_NaN();
    const Matrix<float> with_nan = attn::flash_attention(Q, K, V, reduced(plain));
    EXPECT_TRUE(with_nan.row(3).array().isNaN().all());
    EXPECT_TRUE(attn_test::identical(with_nan.topRows(3), clean.topRows(3)));
    EXPECT_TRUE(attn_test::identical(with_nan.bottomRows(36), clean.bottomRows(36)));
  }

  // attention_heads: 4 query heads over 2 key/value heads, 100 queries over 1000 keys each (the
  // tiled path); head by head equal to flash_attention, bit for bit.
  attn::Tensor3<float> Q(4, 100, 64);
  attn::Tensor3<Eigen::bfloat16> K(2, 1000, 64), V(2, 1000, 64);
  std::normal_distribution<float> normal;
  for (Index i = 0; i < Q.size(); ++i) Q.data()[i] = normal(rng);
  for (Index i = 0; i < K.size(); ++i) {
    K.data()[i] = Eigen::bfloat16(normal(rng));
    V.data()[i] = Eigen::bfloat16(normal(rng));
  }
  const attn::Tensor3<float> heads = attn::attention_heads(Q, K, V, reduced(rich));
  for (Index h = 0; h < 4; ++h) {
    const Matrix<float> one =
        attn::flash_attention(attn::detail::slice(Q, h), attn::detail::slice(K, h / 2),
                              attn::detail::slice(V, h / 2), reduced(rich));
    EXPECT_TRUE(attn_test::identical(attn::detail::slice(heads, h), one)) << "head " << h;
  }

  // A cache in bfloat16: its last 100 tokens' queries over 1000 (causal, bottom right; the tiled
  // path), head by head equal to flash_attention over what it stores.
  KVCache<float> cache(two_kv_heads(64, KVStorage::BFloat16));
  cache.append(attn_test::random_matrix<float>(1000, 128, rng),
               attn_test::random_matrix<float>(1000, 128, rng));
  const Matrix<float> Q_new = attn_test::random_matrix<float>(100, 4 * 64, rng);
  const Matrix<float> portable = cache.attend(Q_new);
  const Matrix<float> chosen = cache.attend(Q_new, reduced());
  EXPECT_FALSE(attn_test::identical(chosen, portable));
  attn::AttentionOptions<float> causal;
  causal.causal = attn::Causal::BottomRight;
  for (Index h = 0; h < 4; ++h) {
    const Rows K_h = cache.keys(h / 2).cast<Eigen::bfloat16>();
    const Rows V_h = cache.values(h / 2).cast<Eigen::bfloat16>();
    const Matrix<float> Q_h = Q_new.middleCols(h * 64, 64);
    const Matrix<float> one = attn::flash_attention(Q_h, K_h, V_h, reduced(causal));
    EXPECT_TRUE(attn_test::identical(chosen.middleCols(h * 64, 64), one)) << "cache, head " << h;
  }
}

/// The int8 arithmetic path (StoredArithmetic::Reduced, AVX512_VNNI's vpdpbusd and vpdpwssd) against
/// long-double loops over what it computes with: the stored (int8, scaled) keys and values and each
/// scaled query head rounded to 8 bits with its own scale; the values' weights are rounded to 16 bits
/// per head and tile, which moves an output entry by at most n max |V| / 65534 over the softmax's
/// sum (detail/decode.hpp). d = 128 and 96 (the value kernel's passes of 64 and of 32 columns),
/// 301 tokens (a last tile of 45 keys, odd). Says which paths ran on this machine.
TEST(KVStorageInt8Arithmetic, EachPathThisMachineSupports) {
  bool dispatched = false;
  // d = 128: the scores' keys read 64 bytes at a time and the values in passes of 64 columns; 96:
  // a last 32 key bytes read masked, and a value pass of 32 after the 64; 544: a wide key, 8 x 64
  // bytes and 32 masked.
  for (const Index d : {Index(128), Index(96), Index(544)}) {
    SCOPED_TRACE("d = " + std::to_string(d));
    constexpr Index n = 301;
    const KVCacheConfig<float> config = two_kv_heads(d, KVStorage::Int8);
    KVCache<float> cache(config);
    std::mt19937 rng(32);
    const Matrix<float> K = attn_test::random_matrix<float>(n, 2 * d, rng);
    Matrix<float> V = attn_test::random_matrix<float>(n, 2 * d, rng);
    cache.append(K, V);
    const Matrix<float> Q = attn_test::random_matrix<float>(1, 8 * d, rng);  // 4 heads per group
    const Matrix<float> portable = cache.attend(Q);
    dispatched = attn::int8_arithmetic_available();
    const Matrix<float> chosen = cache.attend(Q, reduced());
    // A query that is not finite keeps the float path for the scores, and so the NaN rule ...
    Matrix<float> Q_nan = Q;
    Q_nan(0, 5) = std::numeric_limits<float>::quiet_NaN();
    const Matrix<float> with_nan_query = cache.attend(Q_nan, reduced());
    // (Also with every key in the 4 x 4 blocks: 301 keys leave one key per step to the float
    // path, whose score alone would carry the NaN.)
    KVCache<float> blocks_cache(config);
    blocks_cache.append(K.topRows(256), V.topRows(256));
    const Matrix<float> blocks_with_nan_query = blocks_cache.attend(Q_nan, reduced());
    // ... and a value row that is not finite (its int8 scale NaN) the float path for the values.
    V(200, 7) = std::numeric_limits<float>::quiet_NaN();
    KVCache<float> nan_cache(config);
    nan_cache.append(K, V);
    const Matrix<float> with_nan_value = nan_cache.attend(Q, reduced());
    EXPECT_TRUE(with_nan_query.leftCols(d).array().isNaN().all()) << "head 0 saw the NaN";
    EXPECT_TRUE(with_nan_query.rightCols(7 * d).array().isFinite().all());
    EXPECT_TRUE(blocks_with_nan_query.leftCols(d).array().isNaN().all()) << "head 0, 256 keys";
    EXPECT_TRUE(blocks_with_nan_query.rightCols(7 * d).array().isFinite().all());
    EXPECT_TRUE(with_nan_value.leftCols(4 * d).array().isNaN().all()) << "group 0 saw the NaN";
    EXPECT_TRUE(with_nan_value.rightCols(4 * d).array().isFinite().all());
    if (!dispatched) {
      EXPECT_TRUE(attn_test::identical(chosen, portable))
          << "without the instruction, the float path";
      continue;
    }
    EXPECT_FALSE(attn_test::identical(chosen, portable)) << "the int8 path did not run";
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (Index h = 0; h < 8; ++h) {
      Matrix<float> q_rounded = scale * Q.middleCols(h * d, d);
      const float q_scale = q_rounded.cwiseAbs().maxCoeff() / 127.0f;
      for (Index c = 0; c < d; ++c)
        q_rounded(0, c) = std::nearbyint(q_rounded(0, c) / q_scale) * q_scale;
      attn::AttentionOptions<float> options;
      options.scale = 1.0f;
      const Matrix<float> values = cache.values(h / 4);
      const auto want =
          attn_test::naive_attention<float>(q_rounded, cache.keys(h / 4), values, options);
      const long double sum = (want.logits.array() - want.logits.maxCoeff()).exp().sum();
      const double weights_bound =
          double(static_cast<long double>(n * values.cwiseAbs().maxCoeff()) / (65534.0L * sum));
      EXPECT_TRUE(attn_test::near(chosen.middleCols(h * d, d), want.output,
                                  attn_test::Tol<float>::rel,
                                  attn_test::Tol<float>::abs + weights_bound))
          << "head " << h << ", weights' bound " << weights_bound;
    }
    // The rounding of the queries to 8 bits moves the output about as much as the keys' own
    // rounding does (about 1e-2 of its largest entry here; the weights' 16 bits add little).
    EXPECT_LT((chosen - portable).cwiseAbs().maxCoeff(), 2e-2f * portable.cwiseAbs().maxCoeff());
  }
  std::printf("[ dispatch ] AVX512_VNNI %s: paths run: float%s\n",
              attn::int8_arithmetic_available() ? "available" : "not available",
              dispatched ? ", int8 keys and values by integers (vpdpbusd, vpdpwssd)" : "");
  RecordProperty("int8_path_ran", dispatched ? "yes" : "no");
}

// The largest scores the int8 path can meet: every query entry rounded to 127 and every key entry
// stored as 127 (read as 255 by vpdpbusd, the 128 x 127 d taken off after the sum). At the widest
// d the path takes, 8192, the score's 32-bit integer sum (8192 x 255 x 127) stays below 2^31.
TEST(KVStorageInt8Arithmetic, LargestScoresDoNotWrap) {
  for (const Index d : {Index(544), Index(8192)}) {
    SCOPED_TRACE("d = " + std::to_string(d));
    KVCache<float> cache(two_kv_heads(d, KVStorage::Int8));
    // Keys of 1 then 0.5 (both stored as 127, with scales 1/127 and 0.5/127); values +1 then -1.
    Matrix<float> K(2, 2 * d), V(2, 2 * d);
    K.row(0).setConstant(1.0f);
    K.row(1).setConstant(0.5f);
    V.row(0).setConstant(1.0f);
    V.row(1).setConstant(-1.0f);
    // 4 copies of each: 8 keys, all of them in the 4 x 4 score blocks (a key after the last block
    // would take the float path, and its correct score would hide the others').
    for (int i = 0; i < 4; ++i) cache.append(K, V);
    const Matrix<float> Q = Matrix<float>::Ones(1, 8 * d);
    const Matrix<float> chosen = cache.attend(Q, reduced());
    // Scores sqrt(d) and sqrt(d) / 2: the first key's weight is 1 / (1 + exp(-sqrt(d) / 2)).
    const double w = 1.0 / (1.0 + std::exp(-std::sqrt(double(d)) / 2.0));
    const double want = w - (1.0 - w);
    // The weights' 16 bits: off by at most n max |V| / (65534 sum) < 8 / 65534 (a wrong or
    // wrapped sum would make the two keys' scores other than sqrt(d) and sqrt(d) / 2).
    EXPECT_NEAR(chosen.minCoeff(), want, 8.0 / 65534.0);
    EXPECT_NEAR(chosen.maxCoeff(), want, 8.0 / 65534.0);
  }
}

// Queries so small that their 8-bit scale (largest / 127) is subnormal: rounded there, it can
// make largest / scale pass 127 (2e-43 / 127 rounds to 1.4e-45, and 2e-43 / 1.4e-45 is 143),
// which does not fit in 8 bits (a float-to-integer conversion out of range: undefined). The
// rounded queries are clamped to [-127, 127], so the step stays the float path's: scores of about
// 0, the mean of the values. (Caught without the clamp by clang's
// -fsanitize=float-cast-overflow, which CI's sanitizer build does not run.)
TEST(KVStorageInt8Arithmetic, SubnormalQueriesStayIn8Bits) {
  constexpr Index d = 128;
  KVCache<float> cache(two_kv_heads(d, KVStorage::Int8));
  std::mt19937 rng(5);
  const Matrix<float> K = attn_test::random_matrix<float>(64, 2 * d, rng);
  cache.append(K, K.colwise().reverse());  // values: the keys, last token first
  // Scaled by 1 / sqrt(d): every entry of head 0 +-2e-43 (subnormal), the other heads' 1e-42.
  Matrix<float> Q = Matrix<float>::Constant(1, 8 * d, 1e-42f * std::sqrt(float(d)));
  for (Index c = 0; c < d; c += 2) Q(0, c) = -2e-43f * std::sqrt(float(d));
  for (Index c = 1; c < d; c += 2) Q(0, c) = 2e-43f * std::sqrt(float(d));
  const Matrix<float> portable = cache.attend(Q);
  const Matrix<float> chosen = cache.attend(Q, reduced());
  EXPECT_TRUE(chosen.array().isFinite().all());
  EXPECT_TRUE(attn_test::near(chosen, portable, attn_test::Tol<float>::rel,
                              attn_test::Tol<float>::abs + 1e-4))
      << "the weights' 16 bits aside, the same mean of the values";
}

/// The stored formats' arithmetic is a per-call choice: while one thread decodes with
/// `StoredArithmetic::Reduced` (bfloat16 and int8 caches), another thread's widened calls over the
/// same caches give, call after call, exactly what they give alone. (With a process-wide switch,
/// as before, the second thread's calls took the first one's choice.) Where the CPU has neither
/// instruction both choices compute the same; the test then only checks that.
TEST(StoredArithmetic, OneThreadsChoiceDoesNotChangeAnothers) {
  constexpr Index d = 128;
  std::mt19937 rng(41);
  const Matrix<float> K = attn_test::random_matrix<float>(300, 2 * d, rng);
  const Matrix<float> V = attn_test::random_matrix<float>(300, 2 * d, rng);
  const Matrix<float> Q = attn_test::random_matrix<float>(1, 8 * d, rng);  // 4 heads per group
  for (const KVStorage storage : {KVStorage::BFloat16, KVStorage::Int8}) {
    SCOPED_TRACE(name(storage));
    KVCache<float> cache(two_kv_heads(d, storage));
    cache.append(K, V);
    const Matrix<float> widened = cache.attend(Q);
    const Matrix<float> reduced_alone = cache.attend(Q, reduced());
    const bool available = storage == KVStorage::BFloat16 ? attn::bfloat16_arithmetic_available()
                                                          : attn::int8_arithmetic_available();
    EXPECT_EQ(!attn_test::identical(widened, reduced_alone), available)
        << "Reduced differs from Widened exactly where the CPU has the instructions";
    constexpr int calls = 400;
    int widened_wrong = 0, reduced_wrong = 0;
    std::thread other([&] {
      Matrix<float> out;
      for (int i = 0; i < calls; ++i) {
        cache.attend(Q, reduced(), out);
        if (!attn_test::identical(out, reduced_alone)) ++reduced_wrong;
      }
    });
    Matrix<float> out;
    for (int i = 0; i < calls; ++i) {
      cache.attend(Q, attn::AttentionOptions<float>{}, out);
      if (!attn_test::identical(out, widened)) ++widened_wrong;
    }
    other.join();
    EXPECT_EQ(widened_wrong, 0) << "of " << calls << " widened calls beside reduced ones";
    EXPECT_EQ(reduced_wrong, 0) << "of " << calls << " reduced calls beside widened ones";
  }
}

TEST(KVStorageCache, ViewsOfTRowsNeedSameStorage) {
  attn::KVStore<float> store(attn::KVStoreShape{4, 4, 1, std::nullopt, 0, KVStorage::Int8});
  store.append(Matrix<float>::Ones(2, 4), Matrix<float>::Ones(2, 4));
  attn_test::expect_shape_error([&] { store.recent_keys(0); },
                                {"KVStorage::Same", "KVStorage::Int8", "keys()"});
  EXPECT_TRUE(attn_test::identical(store.keys(0), Matrix<float>::Ones(2, 4)));
}

}  // namespace
