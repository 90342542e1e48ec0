/// mask.hpp: `causal_mask`, `sliding_window_mask` and `apply_mask`, against brute-force
/// definitions written here from API.md and against small tables written out by hand.

#include <gtest/gtest.h>

#include <attn/mask.hpp>
#include <limits>
#include <random>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Causal;
using attn::Index;

/// A mask from rows of 0/1.
attn::Mask table(Index n, Index m, std::initializer_list<int> values) {
  attn::Mask M(n, m);
  auto it = values.begin();
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < m; ++j) M(i, j) = *it++ != 0;
  }
  return M;
}

/// API.md: BottomRight: j <= i + (m - n); TopLeft: j <= i; None: everything.
bool brute_causal(Index i, Index j, Index n, Index m, Causal align) {
  switch (align) {
    case Causal::None:
      return true;
    case Causal::TopLeft:
      return j <= i;
    case Causal::BottomRight:
      return j <= i + (m - n);
  }
  return false;
}

/// API.md: query i sees keys i + shift - w <= j <= i + shift; with Causal::None only the lower
/// bound applies (shift 0).
bool brute_window(Index i, Index j, Index n, Index m, Index w, Causal align) {
  const Index shift = align == Causal::BottomRight ? m - n : 0;
  if (j < i + shift - w) return false;
  if (align != Causal::None && j > i + shift) return false;
  return true;
}

const std::vector<Index> kSizes = {0, 1, 2, 3, 5, 8};
const Causal kAligns[] = {Causal::None, Causal::TopLeft, Causal::BottomRight};

TEST(CausalMask, HandWrittenTables) {
  // n < m: bottom-right lets the last query see every key; top-left starts at the first key.
  EXPECT_TRUE(
      attn_test::identical(attn::causal_mask(2, 4, Causal::BottomRight), table(2, 4,
                                                                               {1, 1, 1, 0,  //
                                                                                1, 1, 1, 1})));
  EXPECT_TRUE(attn_test::identical(attn::causal_mask(2, 4, Causal::TopLeft), table(2, 4,
                                                                                   {1, 0, 0, 0,  //
                                                                                    1, 1, 0, 0})));
  // n > m: with bottom-right alignment the first n - m queries see nothing.
  EXPECT_TRUE(attn_test::identical(attn::causal_mask(4, 2, Causal::BottomRight), table(4, 2,
                                                                                       {0, 0,  //
                                                                                        0, 0,  //
                                                                                        1, 0,  //
                                                                                        1, 1})));
  EXPECT_TRUE(attn_test::identical(attn::causal_mask(4, 2, Causal::TopLeft), table(4, 2,
                                                                                   {1, 0,  //
                                                                                    1, 1,  //
                                                                                    1, 1,  //
                                                                                    1, 1})));
  // n == m: both alignments are the lower triangle.
  const attn::Mask lower = table(3, 3, {1, 0, 0, 1, 1, 0, 1, 1, 1});
  EXPECT_TRUE(attn_test::identical(attn::causal_mask(3, 3, Causal::BottomRight), lower));
  EXPECT_TRUE(attn_test::identical(attn::causal_mask(3, 3, Causal::TopLeft), lower));
  // The default alignment is bottom-right.
  EXPECT_TRUE(
      attn_test::identical(attn::causal_mask(2, 4), attn::causal_mask(2, 4, Causal::BottomRight)));
  // None: every key.
  EXPECT_TRUE(attn_test::identical(attn::causal_mask(2, 3, Causal::None),
                                   attn::Mask::Constant(2, 3, true)));
}

TEST(CausalMask, MatchesDefinitionForAllSmallShapes) {
  for (const Causal align : kAligns) {
    for (const Index n : kSizes) {
      for (const Index m : kSizes) {
        const attn::Mask M = attn::causal_mask(n, m, align);
        ASSERT_EQ(M.rows(), n);
        ASSERT_EQ(M.cols(), m);
        attn::Mask expected(n, m);
        for (Index i = 0; i < n; ++i) {
          for (Index j = 0; j < m; ++j) expected(i, j) = brute_causal(i, j, n, m, align);
        }
        EXPECT_TRUE(attn_test::identical(M, expected))
            << "n = " << n << ", m = " << m << ", align = " << static_cast<int>(align);
      }
    }
  }
}

TEST(CausalMask, ZeroSizes) {
  EXPECT_EQ(attn::causal_mask(0, 0).size(), 0);
  const attn::Mask no_keys = attn::causal_mask(3, 0);
  EXPECT_EQ(no_keys.rows(), 3);
  EXPECT_EQ(no_keys.cols(), 0);
  const attn::Mask no_queries = attn::causal_mask(0, 4, Causal::TopLeft);
  EXPECT_EQ(no_queries.rows(), 0);
  EXPECT_EQ(no_queries.cols(), 4);
}

TEST(SlidingWindowMask, HandWrittenTables) {
  // Window 1, causal, n == m: each query sees itself and one key before it (a band of width 2).
  EXPECT_TRUE(attn_test::identical(attn::sliding_window_mask(4, 4, 1), table(4, 4,
                                                                             {1, 0, 0, 0,  //
                                                                              1, 1, 0, 0,  //
                                                                              0, 1, 1, 0,  //
                                                                              0, 0, 1, 1})));
  // Window 0: only the query's own position.
  EXPECT_TRUE(attn_test::identical(attn::sliding_window_mask(3, 3, 0),
                                   table(3, 3, {1, 0, 0, 0, 1, 0, 0, 0, 1})));
  // Bottom-right with n < m: the two queries sit at key positions 3 and 4.
  EXPECT_TRUE(attn_test::identical(attn::sliding_window_mask(2, 5, 2, Causal::BottomRight),
                                   table(2, 5,
                                         {0, 1, 1, 1, 0,  //
                                          0, 0, 1, 1, 1})));
  // Top-left with n < m: the queries sit at positions 0 and 1.
  EXPECT_TRUE(attn_test::identical(attn::sliding_window_mask(2, 5, 1, Causal::TopLeft),
                                   table(2, 5,
                                         {1, 0, 0, 0, 0,  //
                                          1, 1, 0, 0, 0})));
  // Causal::None: only the lower bound, so every later key stays visible.
  EXPECT_TRUE(
      attn_test::identical(attn::sliding_window_mask(3, 4, 1, Causal::None), table(3, 4,
                                                                                   {1, 1, 1, 1,  //
                                                                                    1, 1, 1, 1,  //
                                                                                    0, 1, 1, 1})));
}

TEST(SlidingWindowMask, MatchesDefinitionForAllSmallShapes) {
  for (const Causal align : kAligns) {
    for (const Index n : kSizes) {
      for (const Index m : kSizes) {
        for (const Index w : {0, 1, 2, 4, 10}) {
          const attn::Mask M = attn::sliding_window_mask(n, m, w, align);
          ASSERT_EQ(M.rows(), n);
          ASSERT_EQ(M.cols(), m);
          attn::Mask expected(n, m);
          for (Index i = 0; i < n; ++i) {
            for (Index j = 0; j < m; ++j) expected(i, j) = brute_window(i, j, n, m, w, align);
          }
          EXPECT_TRUE(attn_test::identical(M, expected))
              << "n = " << n << ", m = " << m << ", window = " << w
              << ", align = " << static_cast<int>(align);
        }
      }
    }
  }
}

TEST(SlidingWindowMask, WideWindowEqualsCausalMask) {
  // A window at least as long as the sequence forbids nothing in the past.
  for (const Causal align : {Causal::TopLeft, Causal::BottomRight}) {
    EXPECT_TRUE(attn_test::identical(attn::sliding_window_mask(5, 7, 7, align),
                                     attn::causal_mask(5, 7, align)));
  }
  EXPECT_TRUE(attn_test::identical(attn::sliding_window_mask(4, 4, 0, Causal::BottomRight),
                                   attn::sliding_window_mask(4, 4, 0, Causal::TopLeft)));
}

template <class T>
class ApplyMask : public ::testing::Test {};
TYPED_TEST_SUITE(ApplyMask, attn_test::ScalarTypes);

TYPED_TEST(ApplyMask, DisallowedEntriesBecomeNegativeInfinityOthersUnchanged) {
  using T = TypeParam;
  std::mt19937 rng(5);
  const attn::Matrix<T> S = attn_test::random_matrix<T>(4, 6, rng);
  attn::Mask allowed(4, 6);
  for (Index i = 0; i < 4; ++i) {
    for (Index j = 0; j < 6; ++j) allowed(i, j) = (i + 2 * j) % 3 != 0;
  }
  attn::Matrix<T> masked = S;
  const T* data = masked.data();
  attn::apply_mask(masked, allowed);
  EXPECT_EQ(masked.data(), data);  // in place
  for (Index i = 0; i < 4; ++i) {
    for (Index j = 0; j < 6; ++j) {
      if (allowed(i, j)) {
        EXPECT_EQ(masked(i, j), S(i, j)) << "at (" << i << ", " << j << ")";
      } else {
        EXPECT_EQ(masked(i, j), -std::numeric_limits<T>::infinity())
            << "at (" << i << ", " << j << ")";
      }
    }
  }
  // An all-true mask changes nothing; an all-false one gives -inf everywhere.
  attn::Matrix<T> all = S;
  attn::apply_mask(all, attn::Mask::Constant(4, 6, true));
  EXPECT_TRUE(attn_test::identical(all, S));
  attn::apply_mask(all, attn::Mask::Constant(4, 6, false));
  EXPECT_TRUE(attn_test::identical(
      all, attn::Matrix<T>::Constant(4, 6, -std::numeric_limits<T>::infinity())));
}

TYPED_TEST(ApplyMask, CausalMaskThenSoftmaxGivesZeroWeightToTheFuture) {
  using T = TypeParam;
  std::mt19937 rng(11);
  attn::Matrix<T> S = attn_test::random_matrix<T>(3, 5, rng);
  attn::apply_mask(S, attn::causal_mask(3, 5));
  const attn::Matrix<T> P = attn::softmax_rows(S);
  for (Index i = 0; i < 3; ++i) {
    for (Index j = 0; j < 5; ++j) {
      if (j > i + 2) {
        EXPECT_EQ(P(i, j), T(0));
      } else {
        EXPECT_GT(P(i, j), T(0));
      }
    }
  }
}

}  // namespace
