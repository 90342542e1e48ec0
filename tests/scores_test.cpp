/// scores.hpp: the score kernel `scale * Q K^T`, against naive loops written here.

#include <gtest/gtest.h>

#include <attn/scores.hpp>
#include <attn/threads.hpp>
#include <cmath>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Index;
using attn_test::LMatrix;

/// scale * Q K^T by plain loops in long double.
template <class T>
LMatrix naive_scores(const attn::Matrix<T>& Q, const attn::Matrix<T>& K, long double scale) {
  LMatrix S(Q.rows(), K.rows());
  for (Index i = 0; i < Q.rows(); ++i) {
    for (Index j = 0; j < K.rows(); ++j) {
      long double dot = 0;
      for (Index k = 0; k < Q.cols(); ++k) {
        dot += static_cast<long double>(Q(i, k)) * static_cast<long double>(K(j, k));
      }
      S(i, j) = scale * dot;
    }
  }
  return S;
}

template <class T>
class Scores : public ::testing::Test {};
TYPED_TEST_SUITE(Scores, attn_test::ScalarTypes);

TYPED_TEST(Scores, DefaultScaleIsOneOverSqrtDk) {
  using T = TypeParam;
  std::mt19937 rng(21);
  for (const Index d : {1, 3, 16, 64}) {
    const attn::Matrix<T> Q = attn_test::random_matrix<T>(5, d, rng);
    const attn::Matrix<T> K = attn_test::random_matrix<T>(7, d, rng);
    const attn::Matrix<T> S = attn::scores(Q, K);
    EXPECT_TRUE(
        attn_test::near_t<T>(S, naive_scores(Q, K, 1.0L / std::sqrt(static_cast<long double>(d)))))
        << "d_k = " << d;
  }
}

TYPED_TEST(Scores, IntegerInputsWithUnitScaleAreExact) {
  using T = TypeParam;
  attn::Matrix<T> Q(2, 3);
  Q << 1, 2, 3, -1, 0, 4;
  attn::Matrix<T> K(3, 3);
  K << 2, 0, 1, 1, 1, 1, -3, 2, 0;
  // Row i, column j: q_i . k_j, by hand.
  attn::Matrix<T> expected(2, 3);
  expected << 5, 6, 1,  //
      2, 3, 3;
  EXPECT_TRUE(attn_test::identical(attn::scores(Q, K, T(1)), expected));
  // With d_k = 3 the default scale is 1/sqrt(3).
  EXPECT_TRUE(attn_test::near_t<T>(attn::scores(Q, K),
                                   attn_test::to_long_double(expected) / std::sqrt(3.0L)));
  // A power-of-two scale is exact too.
  EXPECT_TRUE(
      attn_test::identical(attn::scores(Q, K, T(0.25)), attn::Matrix<T>(expected * T(0.25))));
}

TYPED_TEST(Scores, ExplicitScale) {
  using T = TypeParam;
  std::mt19937 rng(22);
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(4, 8, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(6, 8, rng);
  for (const double scale : {0.5, 1.0, 0.1, -2.0, 0.0}) {
    EXPECT_TRUE(
        attn_test::near_t<T>(attn::scores(Q, K, static_cast<T>(scale)),
                             naive_scores(Q, K, static_cast<long double>(static_cast<T>(scale)))))
        << "scale = " << scale;
  }
}

TYPED_TEST(Scores, CallerStorageOverloadReusesStorage) {
  using T = TypeParam;
  std::mt19937 rng(23);
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(6, 8, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(9, 8, rng);
  const T scale = T(0.375);

  attn::Matrix<T> S(6, 9);
  S.setConstant(T(123));
  const T* data = S.data();
  attn::scores(Q, K, scale, S);
  EXPECT_EQ(S.data(), data) << "S had the right size: no reallocation";
  EXPECT_TRUE(attn_test::identical(S, attn::scores(Q, K, scale)));
  EXPECT_TRUE(attn_test::near_t<T>(S, naive_scores(Q, K, 0.375L)));

  // A second call with other inputs of the same shape reuses it again.
  const attn::Matrix<T> Q2 = attn_test::random_matrix<T>(6, 8, rng);
  attn::scores(Q2, K, scale, S);
  EXPECT_EQ(S.data(), data);
  EXPECT_TRUE(attn_test::identical(S, attn::scores(Q2, K, scale)));

  // Storage of the wrong size is resized.
  attn::Matrix<T> wrong(2, 2);
  attn::scores(Q, K, scale, wrong);
  EXPECT_EQ(wrong.rows(), 6);
  EXPECT_EQ(wrong.cols(), 9);
  EXPECT_TRUE(attn_test::identical(wrong, attn::scores(Q, K, scale)));
}

TYPED_TEST(Scores, RectangularAndEmpty) {
  using T = TypeParam;
  std::mt19937 rng(24);
  const attn::Matrix<T> Q = attn_test::random_matrix<T>(1, 4, rng);
  const attn::Matrix<T> K = attn_test::random_matrix<T>(11, 4, rng);
  EXPECT_TRUE(attn_test::near_t<T>(attn::scores(Q, K), naive_scores(Q, K, 0.5L)));
  const attn::Matrix<T> none = attn::scores(attn::Matrix<T>(0, 4), K);
  EXPECT_EQ(none.rows(), 0);
  EXPECT_EQ(none.cols(), 11);
  const attn::Matrix<T> no_keys = attn::scores(Q, attn::Matrix<T>(0, 4));
  EXPECT_EQ(no_keys.rows(), 1);
  EXPECT_EQ(no_keys.cols(), 0);
}

/// The register-tiled kernel (detail/score_tiles.hpp) at every edge of its tiles: query rows around
/// the 12- and 6-row tiles and their 8/4/2/1-row tails (4/2/1 for 6), key columns around one and
/// two packets, d_k of 1, 3 and 64; Q as a block of a wider matrix (row stride != d_k), K
/// column-major.
TYPED_TEST(Scores, TileEdgesAgainstNaive) {
  using T = TypeParam;
  std::mt19937 rng(25);
  for (const Index d : {1, 3, 64}) {
    for (const Index n : {1, 2, 5, 6, 7, 8, 10, 11, 12, 13, 20, 25, 97}) {
      for (const Index m : {1, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 65}) {
        const attn::Matrix<T> wide = attn_test::random_matrix<T>(n, d + 5, rng);
        const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor> K =
            attn_test::random_matrix<T>(m, d, rng);
        attn::Matrix<T> S;
        attn::scores(wide.middleCols(2, d), K, T(0.3), S);
        const attn::Matrix<T> Q = wide.middleCols(2, d);
        const attn::Matrix<T> K_rows = K;
        EXPECT_TRUE(
            attn_test::near_t<T>(S, naive_scores(Q, K_rows, static_cast<long double>(T(0.3)))))
            << "n = " << n << ", m = " << m << ", d_k = " << d;
      }
    }
  }
}

/// The packed key panels (`pack_keys_into`, whole blocks of lanes x lanes transposed in registers)
/// hold exactly what the panel layout says: panel p, feature c, key jj at p d cols + c cols + jj,
/// K(p cols + jj, c), zero past the last key. K is a block of a wider matrix (a row stride other
/// than d, rows not on a packet); d and m on both sides of the SIMD width and of a panel.
TYPED_TEST(Scores, KeyPanelsHoldTheKeysTransposed) {
  using T = TypeParam;
  constexpr Index lanes = attn::detail::Simd<T>::lanes;
  constexpr Index cols = attn::detail::ScoreTile<T>::cols;
  std::mt19937 rng(31);
  for (const Index d : {Index(1), Index(3), lanes - 1, lanes, lanes + 3, Index(64), Index(67)}) {
    for (const Index m : {Index(1), cols - 1, cols, cols + 1, 2 * cols + 5, Index(97)}) {
      if (d < 1 || m < 1) continue;
      const attn::Matrix<T> wide = attn_test::random_matrix<T>(m, d + 7, rng);
      const auto K = wide.middleCols(3, d);
      const Index panels = (m + cols - 1) / cols;
      attn::Vector<T> packed =
          attn::Vector<T>::Constant(panels * cols * d, std::numeric_limits<T>::quiet_NaN());
      attn::detail::pack_keys_into<T>(K, packed.data());
      Index wrong = 0;
      for (Index p = 0; p < panels; ++p) {
        for (Index c = 0; c < d; ++c) {
          for (Index jj = 0; jj < cols; ++jj) {
            const Index j = p * cols + jj;
            const T expected = j < m ? K(j, c) : T(0);
            // Bit equality (a NaN left unwritten fails it too).
            if (!(packed(p * d * cols + c * cols + jj) == expected)) ++wrong;
          }
        }
      }
      EXPECT_EQ(wrong, 0) << "d = " << d << ", m = " << m;
    }
  }
}

/// The rows that fill no whole tile take as few tiles of one row as they can (`row_tiles`): of
/// 12-row tiles, 8 rows are one tile of 8 (the halves 6, 3, 1 made them 6 + 1 + 1), 23 are
/// 12 + 8 + 2 + 1; of 6-row tiles, 5 rows are 4 + 1. Every row is visited once, in order.
TEST(RowTiles, TheRestTakesAsFewSmallTilesAsItCan) {
  const auto heights = [](auto rows_per_tile, Index rows) {
    std::vector<Index> seen;
    Index next = 0;
    attn::detail::row_tiles<decltype(rows_per_tile)::value>(rows, [&](auto tile_rows, Index i) {
      EXPECT_EQ(i, next);
      next += Index(tile_rows.size());
      seen.push_back(Index(tile_rows.size()));
    });
    EXPECT_EQ(next, rows);
    return seen;
  };
  using Twelve = std::integral_constant<std::size_t, 12>;
  using Six = std::integral_constant<std::size_t, 6>;
  EXPECT_EQ(heights(Twelve{}, 8), (std::vector<Index>{8}));
  EXPECT_EQ(heights(Twelve{}, 11), (std::vector<Index>{8, 2, 1}));
  EXPECT_EQ(heights(Twelve{}, 23), (std::vector<Index>{12, 8, 2, 1}));
  EXPECT_EQ(heights(Twelve{}, 28), (std::vector<Index>{12, 12, 4}));
  EXPECT_EQ(heights(Twelve{}, 24), (std::vector<Index>{12, 12}));
  EXPECT_EQ(heights(Twelve{}, 0), (std::vector<Index>{}));
  EXPECT_EQ(heights(Six{}, 5), (std::vector<Index>{4, 1}));
  EXPECT_EQ(heights(Six{}, 15), (std::vector<Index>{6, 6, 2, 1}));
}

/// A table of over 8 MiB is written with streaming stores when its rows are aligned (1536 columns)
/// and with ordinary ones otherwise (1531): the same numbers either way, and the same bits with
/// one thread or two.
TYPED_TEST(Scores, LargeTablesStreamedOrNot) {
  using T = TypeParam;
  std::mt19937 rng(26);
  for (const Index m : {1536, 1531}) {
    const Index n = 1536;
    const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, 4, rng);
    const attn::Matrix<T> K = attn_test::random_matrix<T>(m, 4, rng);
    attn::set_num_threads(1);
    const attn::Matrix<T> one = attn::scores(Q, K, T(0.5));
    attn::set_num_threads(2);
    const attn::Matrix<T> two = attn::scores(Q, K, T(0.5));
    attn::set_num_threads(0);
    EXPECT_TRUE(attn_test::identical(one, two)) << "m = " << m;
    EXPECT_TRUE(attn_test::near_t<T>(two, naive_scores(Q, K, 0.5L))) << "m = " << m;
  }
}

}  // namespace
