/// The tiled path (`flash_attention`, include/attn/flash.hpp): against the PyTorch reference cases,
/// against its materialised twin and the long-double naive pipeline around tile edges, with fully
/// masked tiles and rows, its log-sum-exp, the thread-count invariance of every parallel path, and
/// the float error at n = 4096.

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <cmath>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "test_support.hpp"

namespace {

using attn::Index;

template <class T>
class Flash : public ::testing::Test {};
TYPED_TEST_SUITE(Flash, attn_test::ScalarTypes);

using attn_test::kForwardCases;

// Every reference case, with the default tiles and with tiny ones (several tiles per case, partial
// tiles at both edges).
TYPED_TEST(Flash, MatchesEveryReferenceCase) {
  using T = TypeParam;
  for (const std::string& name : kForwardCases) {
    SCOPED_TRACE(name);
    const attn_test::Case c = attn_test::load_case(name);
    const attn::Matrix<T> Q = c.input<T>("Q");
    const attn::Matrix<T> K = c.input<T>("K");
    const attn::Matrix<T> V = c.input<T>("V");
    const attn::AttentionOptions<T> options = c.options<T>();
    const attn::Matrix<T> expected = c.expected<T>("output");
    EXPECT_TRUE(attn_test::near_t<T>(attn::flash_attention(Q, K, V, options), expected));
    EXPECT_TRUE(attn_test::near_t<T>(
        attn::flash_attention(Q, K, V, options, attn::FlashTiles{2, 3}), expected));
  }
}

/// Options exercised around the tile edges; each is compared with the naive long-double pipeline.
template <class T>
std::vector<std::pair<std::string, attn::AttentionOptions<T>>> option_sets(Index n, Index m,
                                                                           std::mt19937& rng) {
  std::vector<std::pair<std::string, attn::AttentionOptions<T>>> sets;
  sets.emplace_back("none", attn::AttentionOptions<T>{});
  attn::AttentionOptions<T> o;
  o.causal = attn::Causal::BottomRight;
  sets.emplace_back("causal bottom-right", o);
  o.causal = attn::Causal::TopLeft;
  sets.emplace_back("causal top-left", o);
  o.causal = attn::Causal::BottomRight;
  o.window = 5;
  sets.emplace_back("causal + window 5", o);
  attn::AttentionOptions<T> w;
  w.window = 3;
  sets.emplace_back("window 3, no causal", w);
  // A mask that forbids a whole row (the last query) and a whole block of keys [0, 17) for the
  // first 16 queries (an entirely masked tile), with random holes elsewhere.
  attn::AttentionOptions<T> masked;
  std::bernoulli_distribution keep(0.7);
  attn::Mask mask(n, m);
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < m; ++j) mask(i, j) = keep(rng) && !(i < 16 && j < 17);
  }
  mask.row(n - 1).setConstant(false);
  masked.mask = mask;
  sets.emplace_back("mask with empty row and empty tile", masked);
  attn::AttentionOptions<T> extras;
  extras.bias = attn_test::random_matrix<T>(n, m, rng);
  extras.softcap = T(2.5);
  extras.alibi_slope = T(0.125);
  extras.sink = T(0.5);
  extras.causal = attn::Causal::BottomRight;
  extras.scale = T(0.3);
  sets.emplace_back("bias, softcap, alibi, sink, scale, causal", extras);
  return sets;
}

TYPED_TEST(Flash, AgreesAroundTileEdges) {
  using T = TypeParam;
  constexpr Index tile = 16;
  const attn::FlashTiles tiles{tile, tile};
  std::mt19937 rng(2024);
  const std::vector<Index> sizes = {1, tile - 1, tile, tile + 1, 3 * tile + 5};
  for (const Index n : sizes) {
    for (const Index m : sizes) {
      const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, 8, rng);
      const attn::Matrix<T> K = attn_test::random_matrix<T>(m, 8, rng);
      const attn::Matrix<T> V = attn_test::random_matrix<T>(m, 5, rng);
      for (const auto& [label, options] : option_sets<T>(n, m, rng)) {
        SCOPED_TRACE("n = " + std::to_string(n) + ", m = " + std::to_string(m) + ", " + label);
        const attn::Matrix<T> flash = attn::flash_attention(Q, K, V, options, tiles);
        const attn_test::NaiveAttention naive = attn_test::naive_attention(Q, K, V, options);
        EXPECT_TRUE(attn_test::near_t<T>(flash, naive.output));
        EXPECT_TRUE(
            attn_test::near_t<T>(flash, attn::attention_with_weights(Q, K, V, options).output));
        EXPECT_TRUE(attn_test::all_finite(flash));
      }
    }
  }
}

// The register tiles of the scores and values: key widths and value widths of whole packets for
// every SIMD set (16, 64, 128), of a chunk and a remainder (80 = 5 x 16, 136), and of no whole
// packet (3); query blocks of 1 to 73 rows (the 12-, 6-, 3- and 1-row tiles) and key tiles that
// start before the first visible key (a window) or end inside a panel (m = 301).
TYPED_TEST(Flash, RegisterTilesAgreeForEveryWidth) {
  using T = TypeParam;
  std::mt19937 rng(31);
  for (const Index d_v : {3, 16, 64, 80, 128, 136}) {
    for (const Index d_k : {5, 64, 128}) {
      for (const Index n : {1, 13, 73}) {
        const Index m = 301;
        const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, d_k, rng);
        const attn::Matrix<T> K = attn_test::random_matrix<T>(m, d_k, rng);
        const attn::Matrix<T> V = attn_test::random_matrix<T>(m, d_v, rng);
        attn::AttentionOptions<T> windowed;
        windowed.causal = attn::Causal::BottomRight;
        windowed.window = 70;
        for (const auto& options : {attn::AttentionOptions<T>{}, windowed}) {
          SCOPED_TRACE("d_k " + std::to_string(d_k) + ", d_v " + std::to_string(d_v) + ", n " +
                       std::to_string(n) + (options.window ? ", window" : ""));
          const attn::Matrix<T> expected = attn::attention_with_weights(Q, K, V, options).output;
          EXPECT_TRUE(attn_test::near_t<T>(attn::flash_attention(Q, K, V, options), expected));
          EXPECT_TRUE(attn_test::near_t<T>(
              attn::flash_attention(Q, K, V, options, attn::FlashTiles{7, 40}), expected));
        }
      }
    }
  }
}

TYPED_TEST(Flash, FullyMaskedRowsAreZeroAndTheirLogSumExpIsMinusInfinity) {
  using T = TypeParam;
  std::mt19937 rng(7);
  const Index n = 40;
  const Index m = 50;
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, 6, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(m, 6, rng);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(m, 3, rng);
  attn::AttentionOptions<T> options;
  options.mask = attn::Mask::Constant(n, m, true);
  options.mask->middleRows(10, 20).setConstant(false);  // rows 10..29: nothing to attend
  attn::Vector<T> lse;
  const attn::Matrix<T> O = attn::flash_attention(Q, K, V, options, lse, attn::FlashTiles{8, 16});
  ASSERT_EQ(lse.size(), n);
  const attn_test::NaiveAttention naive = attn_test::naive_attention(Q, K, V, options);
  for (Index i = 0; i < n; ++i) {
    SCOPED_TRACE("row " + std::to_string(i));
    if (i >= 10 && i < 30) {
      EXPECT_TRUE(O.row(i).isZero(0));
      EXPECT_EQ(lse(i), -std::numeric_limits<T>::infinity());
      continue;
    }
    // log-sum-exp of the row's logits, independently in long double
    long double max = -std::numeric_limits<long double>::infinity();
    for (Index j = 0; j < m; ++j) max = std::max(max, naive.logits(i, j));
    long double sum = 0;
    for (Index j = 0; j < m; ++j) sum += std::exp(naive.logits(i, j) - max);
    const double expected = static_cast<double>(max + std::log(sum));
    EXPECT_NEAR(static_cast<double>(lse(i)), expected,
                attn_test::Tol<T>::rel * std::abs(expected) + attn_test::Tol<T>::abs * 10);
  }
  EXPECT_TRUE(attn_test::near_t<T>(O, naive.output));
}

TYPED_TEST(Flash, ScaledDotProductAttentionAgreesOnBothSidesOfTheCrossover) {
  using T = TypeParam;
  std::mt19937 rng(11);
  for (const Index n : {Index{100}, Index{600}}) {  // 100 x 100: materialised; 600 x 600: tiled
    const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, 16, rng);
    const attn::Matrix<T> K = attn_test::random_matrix<T>(n, 16, rng);
    const attn::Matrix<T> V = attn_test::random_matrix<T>(n, 16, rng);
    attn::AttentionOptions<T> options;
    options.causal = attn::Causal::BottomRight;
    EXPECT_TRUE(attn_test::near_t<T>(attn::scaled_dot_product_attention(Q, K, V, options),
                                     attn::attention_with_weights(Q, K, V, options).output));
  }
}

TEST(Flash, FloatStaysWithin1e5OfTheDoubleReferenceAtN4096) {
  std::mt19937 rng(4096);
  const Index n = 4096;
  const attn::Matrix<double> Q = attn_test::random_matrix<double>(n, 64, rng);
  const attn::Matrix<double> K = attn_test::random_matrix<double>(n, 64, rng);
  const attn::Matrix<double> V = attn_test::random_matrix<double>(n, 64, rng);
  const attn::Matrix<float> Qf = Q.cast<float>();
  const attn::Matrix<float> Kf = K.cast<float>();
  const attn::Matrix<float> Vf = V.cast<float>();
  for (const attn::Causal causal : {attn::Causal::None, attn::Causal::BottomRight}) {
    attn::AttentionOptions<double> od;
    od.causal = causal;
    attn::AttentionOptions<float> of;
    of.causal = causal;
    const attn::Matrix<double> reference = attn::attention_with_weights(Q, K, V, od).output;
    const attn::Matrix<double> flash = attn::flash_attention(Qf, Kf, Vf, of).cast<double>();
    // Relative to the output's scale: entries near zero have no meaningful relative error.
    const double error = (flash - reference).cwiseAbs().maxCoeff();
    const double scale = reference.cwiseAbs().maxCoeff();
    EXPECT_LE(error / scale, 1e-5) << "max |float - double| = " << error << ", max |O| = " << scale;
  }
}

TEST(Threads, EveryParallelPathGivesTheSameBitsForAnyThreadCount) {
  std::mt19937 rng(99);
  const Index n = 333;
  const attn::Matrix<float> Q = attn_test::random_matrix<float>(n, 32, rng);
  const attn::Matrix<float> K = attn_test::random_matrix<float>(n + 21, 32, rng);
  const attn::Matrix<float> V = attn_test::random_matrix<float>(n + 21, 24, rng);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  attn::Tensor3<float> heads_q(4, 70, 16);
  attn::Tensor3<float> heads_kv(2, 90, 16);
  heads_q.setRandom();
  heads_kv.setRandom();
  attn::MultiHeadAttention<float> layer({64, 4}, 5);
  attn::Tensor3<float> x(3, 50, 64);
  x.setRandom();
  attn::MultiHeadOptions<float> mha_options;
  mha_options.need_weights = true;

  struct Results {
    attn::Matrix<float> flash, sdpa, weights, output, heads, mha, mha_weights;
  };
  const auto run = [&](int threads) {
    const attn_test::ThreadCount count(threads);
    Results r;
    r.flash = attn::flash_attention(Q, K, V, options, attn::FlashTiles{32, 64});
    r.sdpa = attn::scaled_dot_product_attention(Q, K, V, options);
    const attn::Attention<float> a = attn::attention_with_weights(Q, K, V, options);
    r.weights = a.weights;
    r.output = a.output;
    const attn::Tensor3<float> h = attn::attention_heads(heads_q, heads_kv, heads_kv, options);
    r.heads = Eigen::Map<const attn::Matrix<float>>(h.data(), 4 * 70, 16);
    const attn::MultiHeadResult<float> mr = layer.forward(x, x, x, mha_options);
    r.mha = Eigen::Map<const attn::Matrix<float>>(mr.output.data(), 3 * 50, 64);
    r.mha_weights = Eigen::Map<const attn::Matrix<float>>(mr.weights.data(), 3 * 50, 50);
    return r;
  };
  const Results one = run(1);
  for (const int threads : {2, 3, 5}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    const Results many = run(threads);
    EXPECT_TRUE(attn_test::identical(many.flash, one.flash));
    EXPECT_TRUE(attn_test::identical(many.sdpa, one.sdpa));
    EXPECT_TRUE(attn_test::identical(many.weights, one.weights));
    EXPECT_TRUE(attn_test::identical(many.output, one.output));
    EXPECT_TRUE(attn_test::identical(many.heads, one.heads));
    EXPECT_TRUE(attn_test::identical(many.mha, one.mha));
    EXPECT_TRUE(attn_test::identical(many.mha_weights, one.mha_weights));
  }
}

TEST(Threads, SetNumThreadsIsReported) {
  attn::set_num_threads(3);
#ifdef _OPENMP
  EXPECT_EQ(attn::num_threads(), 3);
#else
  EXPECT_EQ(attn::num_threads(), 1);
#endif
  attn::set_num_threads(0);
  EXPECT_GE(attn::num_threads(), 1);
}

#ifdef _OPENMP
/// What the parallel loop's body sees of OpenMP, per item.
struct LoopSeen {
  bool in_team = false;   ///< inside a parallel region, active or not (omp_get_level() > 0)
  int eigen_threads = 0;  ///< Eigen::nbThreads(): what its GEMM would split over
};

/// What the body sees for each item; with `flops`, the loop's work (below `team_flops`: no team).
std::vector<LoopSeen> loop_seen(Index count, std::optional<double> flops = {}) {
  std::vector<LoopSeen> seen(static_cast<std::size_t>(count));
  const auto body = [&](Index i, int&) {
    seen[static_cast<std::size_t>(i)] = {omp_get_level() > 0, Eigen::nbThreads()};
  };
  if (flops) {
    attn::detail::parallel_for<int>(count, *flops, body);
  } else {
    attn::detail::parallel_for<int>(count, body);
  }
  return seen;
}

// One thread runs the loop without entering an OpenMP team (a team even of one thread cost about
// 4 us per call on the project's machine); Eigen's GEMM stays serial inside the loop either way,
// and the caller's own OpenMP setting is what it was after the loop.
TEST(Threads, OneThreadRunsWithoutATeamAndEigenStaysSerial) {
  const int caller = omp_get_max_threads();
  for (const int threads : {1, 2}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    const attn_test::ThreadCount count(threads);
    for (const Index items : {Index(1), Index(4)}) {
      SCOPED_TRACE(std::to_string(items) + " items");
      const bool team = threads > 1 && items > 1;
      for (const LoopSeen& seen : loop_seen(items)) {
        EXPECT_EQ(seen.in_team, team);
        EXPECT_EQ(seen.eigen_threads, 1);
      }
      EXPECT_EQ(omp_get_max_threads(), caller);
    }
  }
}

// A loop of little work (below detail::team_flops, 2 MFLOP) runs on the calling thread even when
// two threads are asked for: a team of two cost more than it saved there.
TEST(Threads, LittleWorkRunsWithoutATeam) {
  const int caller = omp_get_max_threads();
  const attn_test::ThreadCount count(2);
  for (const LoopSeen& seen : loop_seen(4, 0.5 * attn::detail::team_flops)) {
    EXPECT_FALSE(seen.in_team);
    EXPECT_EQ(seen.eigen_threads, 1);
  }
  for (const LoopSeen& seen : loop_seen(4, 2 * attn::detail::team_flops)) {
    EXPECT_TRUE(seen.in_team);
    EXPECT_EQ(seen.eigen_threads, 1);
  }
  // Three items: two threads save only a third of the work (the slowest runs two items).
  for (const LoopSeen& seen : loop_seen(3, 1.4 * attn::detail::team_flops)) {
    EXPECT_FALSE(seen.in_team);
  }
  for (const LoopSeen& seen : loop_seen(3, 1.6 * attn::detail::team_flops)) {
    EXPECT_TRUE(seen.in_team);
  }
  EXPECT_EQ(omp_get_max_threads(), caller);
}

// The work a team takes off the calling thread, items of equal work: half of an even count with
// two threads, a third of 3 items, 2/5 of 5, none of one item or with one thread.
TEST(Threads, TeamSavingCountsTheSlowestThreadsItems) {
  const attn_test::ThreadCount two(2);
  EXPECT_DOUBLE_EQ(attn::detail::team_saving(4, 12.0), 6.0);
  EXPECT_DOUBLE_EQ(attn::detail::team_saving(3, 12.0), 4.0);
  EXPECT_DOUBLE_EQ(attn::detail::team_saving(5, 10.0), 4.0);
  EXPECT_DOUBLE_EQ(attn::detail::team_saving(1, 12.0), 0.0);
  EXPECT_DOUBLE_EQ(attn::detail::team_saving(0, 12.0), 0.0);
  const attn_test::ThreadCount one(1);
  EXPECT_DOUBLE_EQ(attn::detail::team_saving(4, 12.0), 0.0);
}
#endif

// A thread's kept scratch is the same object from one borrowing to the next (its buffers stay
// grown); borrowed again while borrowed (a loop inside a loop) it is a fresh one, and the thread's
// own is free again once its borrower ends.
TEST(Threads, KeptScratchIsTheThreadsOwnUnlessAlreadyBorrowed) {
  using Kept = attn::detail::KeptScratch<attn::Matrix<float>>;
  const float* grown = nullptr;
  {
    Kept first;
    first.get().resize(3, 5);
    grown = first.get().data();
    Kept inner;
    EXPECT_NE(&inner.get(), &first.get());
    EXPECT_EQ(inner.get().size(), 0);
  }
  Kept again;
  EXPECT_EQ(again.get().rows(), 3);
  EXPECT_EQ(again.get().data(), grown);
  std::thread other([&] {
    Kept theirs;
    EXPECT_EQ(theirs.get().size(), 0);
  });
  other.join();
}

TEST(FlashErrors, ChecksShapesOptionsAndTiles) {
  const attn::Matrix<double> Q = attn::Matrix<double>::Ones(4, 3);
  const attn::Matrix<double> K = attn::Matrix<double>::Ones(5, 2);
  try {
    (void)attn::flash_attention(Q, K, K);
    FAIL() << "no shape_error for mismatched d_k";
  } catch (const attn::shape_error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("attn::flash_attention"), std::string::npos) << message;
    EXPECT_NE(message.find("5 x 2"), std::string::npos) << message;
    EXPECT_NE(message.find("4 x 3"), std::string::npos) << message;
  }
  EXPECT_THROW((void)attn::flash_attention(Q, Q, Q, {}, attn::FlashTiles{0, 4}), attn::shape_error);
  attn::AttentionOptions<double> bad_window;
  bad_window.window = -1;
  EXPECT_THROW((void)attn::flash_attention(Q, Q, Q, bad_window), attn::shape_error);
}

/// `release_thread_buffers` gives back what the threads keep between calls: after a call over
/// 40,000 keys (its keys packed into each thread's buffer, 10 MB per thread), the bytes in use
/// fall by at least 8 MB, and the next call gives the same bits. glibc's count of the bytes in
/// use (`mallinfo2`, every arena and the mapped blocks); not under AddressSanitizer, whose
/// allocator glibc does not count.
// AddressSanitizer replaces glibc's allocator (GCC says so with __SANITIZE_ADDRESS__, Clang 14 only
// through __has_feature).
#if defined(__SANITIZE_ADDRESS__)
#define ATTN_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTN_TEST_ASAN 1
#endif
#endif

TEST(ThreadBuffers, ReleaseGivesTheKeptMemoryBack) {
#if !defined(__GLIBC__) || defined(ATTN_TEST_ASAN)
  GTEST_SKIP() << "needs glibc's allocator";
#else
  const auto in_use = [] {
    const struct mallinfo2 info = mallinfo2();
    return static_cast<double>(info.uordblks + info.hblkhd);
  };
  std::mt19937 rng(8);
  const attn::Matrix<float> Q = attn_test::random_matrix<float>(64, 64, rng);
  const attn::Matrix<float> K = attn_test::random_matrix<float>(40000, 64, rng);
  const attn::Matrix<float> V = attn_test::random_matrix<float>(40000, 64, rng);
  const attn::Matrix<float> first = attn::flash_attention(Q, K, V);
  const double kept = in_use();
  attn::release_thread_buffers();
  const double released = in_use();
  EXPECT_GT(kept - released, 8e6) << "in use: " << kept << " bytes before, " << released
                                  << " after";
  EXPECT_TRUE(attn_test::identical(attn::flash_attention(Q, K, V), first));
#endif
}

}  // namespace
