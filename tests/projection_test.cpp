/// projection.hpp: `project` (with and without bias) and `project_qkv`, against naive loops.

#include <gtest/gtest.h>

#include <attn/projection.hpp>
#include <limits>
#include <random>

#include "test_support.hpp"

namespace {

using attn::Index;
using attn_test::LMatrix;

template <class T>
class Projection : public ::testing::Test {};
TYPED_TEST_SUITE(Projection, attn_test::ScalarTypes);

TYPED_TEST(Projection, ProjectAgainstNaiveLoops) {
  using T = TypeParam;
  std::mt19937 rng(31);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(7, 12, rng);
  const attn::Matrix<T> W = attn_test::random_matrix<T>(12, 5, rng);
  const attn::Matrix<T> Y = attn::project(X, W);
  EXPECT_EQ(Y.rows(), 7);
  EXPECT_EQ(Y.cols(), 5);
  EXPECT_TRUE(attn_test::near_t<T>(Y, attn_test::naive_product(X, W)));
}

TYPED_TEST(Projection, IntegerInputsAreExact) {
  using T = TypeParam;
  attn::Matrix<T> X(2, 3);
  X << 1, 2, 0, -1, 3, 2;
  attn::Matrix<T> W(3, 2);
  W << 1, 0, 2, -1, 0, 4;
  attn::Matrix<T> expected(2, 2);  // by hand
  expected << 5, -2,               //
      5, 5;
  EXPECT_TRUE(attn_test::identical(attn::project(X, W), expected));
  attn::RowVector<T> b(2);
  b << 10, -20;
  attn::Matrix<T> with_bias(2, 2);
  with_bias << 15, -22,  //
      15, -15;
  EXPECT_TRUE(attn_test::identical(attn::project(X, W, b), with_bias));
}

TYPED_TEST(Projection, BiasAsRowOrColumnVector) {
  using T = TypeParam;
  std::mt19937 rng(32);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(6, 4, rng);
  const attn::Matrix<T> W = attn_test::random_matrix<T>(4, 3, rng);
  const attn::RowVector<T> b_row = attn_test::random_matrix<T>(1, 3, rng);
  const attn::Vector<T> b_col = b_row.transpose();

  LMatrix expected = attn_test::naive_product(X, W);
  for (Index i = 0; i < expected.rows(); ++i) {
    for (Index j = 0; j < expected.cols(); ++j)
      expected(i, j) += static_cast<long double>(b_row(j));
  }
  const attn::Matrix<T> from_row = attn::project(X, W, b_row);
  const attn::Matrix<T> from_col = attn::project(X, W, b_col);
  EXPECT_TRUE(attn_test::near_t<T>(from_row, expected));
  EXPECT_TRUE(attn_test::identical(from_col, from_row));
  // The bias is added to X W, nothing else: same as projecting, then adding.
  attn::Matrix<T> added = attn::project(X, W);
  added.rowwise() += b_row;
  EXPECT_TRUE(attn_test::identical(from_row, added));
  // A 1 x d_out row-major Matrix works as a bias too.
  const attn::Matrix<T> b_matrix = b_row;
  EXPECT_TRUE(attn_test::identical(attn::project(X, W, b_matrix), from_row));
}

TYPED_TEST(Projection, ProjectQkvEqualsThreeProjections) {
  using T = TypeParam;
  std::mt19937 rng(33);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(9, 16, rng);
  const attn::Matrix<T> W_Q = attn_test::random_matrix<T>(16, 8, rng);
  const attn::Matrix<T> W_K = attn_test::random_matrix<T>(16, 8, rng);
  const attn::Matrix<T> W_V = attn_test::random_matrix<T>(16, 5, rng);  // d_v != d_k is fine
  const attn::QKV<T> qkv = attn::project_qkv(X, W_Q, W_K, W_V);
  EXPECT_TRUE(attn_test::near_t<T>(qkv.Q, attn_test::naive_product(X, W_Q)));
  EXPECT_TRUE(attn_test::near_t<T>(qkv.K, attn_test::naive_product(X, W_K)));
  EXPECT_TRUE(attn_test::near_t<T>(qkv.V, attn_test::naive_product(X, W_V)));
  EXPECT_EQ(qkv.V.cols(), 5);
  // The same GEMM on the same data as `project`: bitwise equal.
  EXPECT_TRUE(attn_test::identical(qkv.Q, attn::project(X, W_Q)));
  EXPECT_TRUE(attn_test::identical(qkv.K, attn::project(X, W_K)));
  EXPECT_TRUE(attn_test::identical(qkv.V, attn::project(X, W_V)));
}

/// `project` reads W's columns in place as the kernel's key panels (rows that start on a packet
/// and hold whole panels, a short X: `detail::columns_in_place`) or packs them: the same bits
/// either way, both near the naive product, each route taken where it should be. W in place with
/// a row stride wider than its columns (a block of a wider matrix) checks the stride.
TYPED_TEST(Projection, WeightsInPlaceOrPackedGiveTheSameBits) {
  using T = TypeParam;
  constexpr Index w = attn::detail::ScoreTile<T>::cols;
  std::mt19937 rng(34);
  const attn::Matrix<T> W = attn_test::random_matrix<T>(70, 3 * w, rng);
  attn::Matrix<T> shifted(70, 3 * w + 1);  // the same W one scalar along: rows off their packets
  shifted.col(0).setZero();
  shifted.rightCols(3 * w) = W;
  attn::Matrix<T> wider = attn::Matrix<T>::Zero(70, 4 * w);  // W with a row stride of 4 w
  wider.leftCols(3 * w) = W;
  const auto W_shifted = shifted.rightCols(3 * w);
  const auto W_wider = wider.leftCols(3 * w);
  for (const Index n : {1, 7, 13, 40}) {
    const attn::Matrix<T> X = attn_test::random_matrix<T>(n, 70, rng);
    ASSERT_TRUE(attn::detail::columns_in_place<T>(W, n));
    ASSERT_TRUE(attn::detail::columns_in_place<T>(W_wider, n));
    ASSERT_FALSE(attn::detail::columns_in_place<T>(W_shifted, n));
    const attn::Matrix<T> in_place = attn::project(X, W);
    // Each entry is a sum of 70 products in T: within 70 eps (|X| |W|) of the exact product.
    const LMatrix error =
        (in_place.template cast<long double>() - attn_test::naive_product(X, W)).cwiseAbs();
    const LMatrix bound = attn_test::naive_product(X.cwiseAbs(), W.cwiseAbs()) *
                          (70.0L * static_cast<long double>(std::numeric_limits<T>::epsilon()));
    EXPECT_TRUE((error.array() <= bound.array()).all()) << "n = " << n;
    EXPECT_TRUE(attn_test::identical(attn::project(X, W_shifted), in_place)) << "n = " << n;
    EXPECT_TRUE(attn_test::identical(attn::project(X, W_wider), in_place)) << "n = " << n;
  }
  // Columns that end inside a panel are packed (zeros past the last column).
  EXPECT_FALSE(attn::detail::columns_in_place<T>(W.leftCols(3 * w - 1), 1));
  // The size limit: n times W's bytes at most 512 MiB; a 512 x 512 W of floats (1 MiB) is read in
  // place for up to 512 rows of X.
  const attn::Matrix<T> big = attn::Matrix<T>::Zero(512, 512);
  const Index rows = Index(512 * 4 / sizeof(T));
  EXPECT_TRUE(attn::detail::columns_in_place<T>(big, rows));
  EXPECT_FALSE(attn::detail::columns_in_place<T>(big, rows + 1));
}

TYPED_TEST(Projection, EmptyShapes) {
  using T = TypeParam;
  const attn::Matrix<T> none = attn::project(attn::Matrix<T>(0, 3), attn::Matrix<T>::Ones(3, 2));
  EXPECT_EQ(none.rows(), 0);
  EXPECT_EQ(none.cols(), 2);
  // d_in = 0: X W is an n x d_out matrix of zeros (an empty sum).
  const attn::Matrix<T> zero_width = attn::project(attn::Matrix<T>(2, 0), attn::Matrix<T>(0, 3));
  EXPECT_TRUE(attn_test::identical(zero_width, attn::Matrix<T>::Zero(2, 3)));
}

}  // namespace
